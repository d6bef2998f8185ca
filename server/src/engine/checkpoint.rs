//! Context checkpoints: copies of the part of a slot's sequence that cannot be cut back by
//! position (recurrent state, sliding-window cells), so that a prompt sharing a prefix with the
//! cached one resumes from the nearest checkpoint instead of from scratch, and so that a draft
//! can be verified on a context that cannot drop rejected tokens.
//!
//! The rules are llama-server's: checkpoints are taken just before the batch that processes the
//! last `4 + n_ubatch` and the last 4 prompt tokens (and, where no other exists within
//! `--checkpoint-min-step`, before any batch near the prompt's end); at most `--ctx-checkpoints`
//! per slot, oldest evicted first, those too close to an earlier one evicted before that.

use strata_ffi::{Token, Verbosity};

const MIB: f64 = 1024.0 * 1024.0;

#[derive(Clone)]
pub struct Checkpoint {
    /// How many of the slot's tokens the saved state covers.
    pub n_tokens: usize,
    pub pos_min: i32,
    pub pos_max: i32,
    /// The task that created it (its checkpoints are never evicted as too close).
    pub task: u64,
    /// The target context's partial sequence state.
    pub tgt: Vec<u8>,
    /// The drafter's share (draft context and drafter state), when there is a drafter.
    pub spec: Option<Vec<u8>>,
}

impl Checkpoint {
    pub fn size(&self) -> usize {
        self.tgt.len() + self.spec.as_ref().map_or(0, Vec::len)
    }

    fn describe(&self) -> String {
        format!("pos_min = {}, pos_max = {}, n_tokens = {}, size = {:.3} MiB", self.pos_min, self.pos_max, self.n_tokens, self.size() as f64 / MIB)
    }
}

#[derive(Clone, Copy)]
pub struct Policy {
    /// --ctx-checkpoints: the most kept per slot.
    pub max: usize,
    /// --checkpoint-min-step: least spacing in tokens.
    pub min_step: usize,
}

/// Makes room in `list` for a checkpoint of `task` at `n_tokens`: drops, when the list is full,
/// those within `min_step` of an earlier one (unless `task` made them), then the oldest, and any
/// at the same `n_tokens`.
pub fn make_room(list: &mut Vec<Checkpoint>, policy: Policy, slot: usize, task: u64, n_tokens: usize) {
    let mut last: Option<usize> = None;
    let mut i = 0;
    while i < list.len() && list.len() + 1 >= policy.max {
        let c = &list[i];
        if c.task != task && last.is_some_and(|l| c.n_tokens <= l + policy.min_step) {
            let msg = format!("erasing context checkpoint too close to an earlier one ({})", c.describe());
            crate::log::slot(Verbosity::Trace, "create_check", slot, task as i64, &msg);
            list.remove(i);
        } else {
            last = Some(c.n_tokens);
            i += 1;
        }
    }
    while !list.is_empty() && list.len() >= policy.max {
        let c = list.remove(0);
        let msg = format!("erasing old context checkpoint ({})", c.describe());
        crate::log::slot(Verbosity::Warn, "create_check", slot, task as i64, &msg);
    }
    list.retain(|c| {
        let same = c.n_tokens == n_tokens;
        if same {
            crate::log::slot(Verbosity::Trace, "create_check", slot, task as i64, &format!("superseding context checkpoint at n_tokens = {n_tokens}"));
        }
        !same
    });
}

/// Appends a new checkpoint, logging it as llama-server does.
pub fn push(list: &mut Vec<Checkpoint>, policy: Policy, slot: usize, c: Checkpoint) {
    let msg = format!("created context checkpoint {} of {} ({})", list.len() + 1, policy.max, c.describe());
    crate::log::slot(Verbosity::Trace, "create_check", slot, c.task as i64, &msg);
    list.push(c);
}

/// The newest checkpoint that serves a prompt resuming at `pos_next`: it must not reach past
/// it, and must start before `pos_min_thold` (the oldest position the prompt needs) or at 0.
pub fn find(list: &[Checkpoint], pos_next: i32, pos_min_thold: i32) -> Option<usize> {
    list.iter().rposition(|c| c.pos_max <= pos_next && (c.pos_min < pos_min_thold || c.pos_min == 0))
}

/// Drops the checkpoints that reach past `pos_next` (their state includes tokens no longer
/// kept).
pub fn invalidate(list: &mut Vec<Checkpoint>, pos_next: i32, n_swa: usize, slot: usize, task: u64) {
    list.retain(|c| {
        let keep = c.pos_max <= pos_next;
        if !keep {
            let msg = format!(
                "erased invalidated context checkpoint (pos_min = {}, pos_max = {}, n_tokens = {}, n_swa = {n_swa}, pos_next = {pos_next}, size = {:.3} MiB)",
                c.pos_min,
                c.pos_max,
                c.n_tokens,
                c.size() as f64 / MIB
            );
            crate::log::slot(Verbosity::Trace, "operator()", slot, task as i64, &msg);
        }
        keep
    });
}

/// Where user messages start in `prompt`: at each position the first delimiter that matches
/// there names the role (llama.cpp's common_chat_msg_delimiters::split).
pub fn user_starts(prompt: &[Token], delimiters: &[(bool, Vec<Token>)]) -> Vec<usize> {
    if delimiters.is_empty() {
        return Vec::new();
    }
    (0..prompt.len()).filter(|&i| delimiters.iter().find(|(_, d)| prompt[i..].starts_with(d)).is_some_and(|(user, _)| *user)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ck(n_tokens: usize, task: u64) -> Checkpoint {
        let p = n_tokens as i32 - 1;
        Checkpoint { n_tokens, pos_min: p, pos_max: p, task, tgt: vec![0; 4], spec: None }
    }

    fn n_tokens(list: &[Checkpoint]) -> Vec<usize> {
        list.iter().map(|c| c.n_tokens).collect()
    }

    #[test]
    fn full_list_drops_close_ones_of_other_tasks_then_the_oldest() {
        let policy = Policy { max: 4, min_step: 100 };
        let mut list = vec![ck(10, 1), ck(50, 1), ck(300, 1)];
        make_room(&mut list, policy, 0, 2, 400);
        assert_eq!(n_tokens(&list), vec![10, 300], "50 is within 100 of 10");

        let mut list = vec![ck(10, 2), ck(50, 2), ck(300, 2)];
        make_room(&mut list, policy, 0, 2, 400);
        assert_eq!(n_tokens(&list), vec![10, 50, 300], "the task's own checkpoints stay");

        let mut list = vec![ck(10, 1), ck(500, 1), ck(1000, 1), ck(1500, 1)];
        make_room(&mut list, policy, 0, 2, 2000);
        assert_eq!(n_tokens(&list), vec![500, 1000, 1500], "the oldest goes");
    }

    #[test]
    fn a_short_list_keeps_close_checkpoints_and_replaces_one_at_the_same_place() {
        let policy = Policy { max: 32, min_step: 8192 };
        let mut list = vec![ck(1, 1), ck(20, 1)];
        make_room(&mut list, policy, 0, 2, 20);
        assert_eq!(n_tokens(&list), vec![1]);
    }

    #[test]
    fn find_takes_the_newest_usable_checkpoint() {
        let list = vec![ck(10, 1), ck(100, 1), ck(200, 1)];
        // a prompt that shares 150 tokens: 200 reaches past it, 100 serves
        assert_eq!(find(&list, 150, 150), Some(1));
        // sharing everything up to 250 with recurrent state at 249: the newest
        assert_eq!(find(&list, 250, 250), Some(2));
        // sharing 5 tokens: none
        assert_eq!(find(&list, 5, 5), None);
        // a checkpoint that starts at position 0 always serves a prompt it does not overrun
        let sw = vec![Checkpoint { n_tokens: 8, pos_min: 0, pos_max: 7, task: 1, tgt: Vec::new(), spec: None }];
        assert_eq!(find(&sw, 8, 0), Some(0));
    }

    #[test]
    fn user_starts_follow_the_first_matching_delimiter() {
        // assistant [1, 2], user [1]: where both match, the first listed wins
        let delims = vec![(false, vec![1, 2]), (true, vec![1])];
        assert_eq!(user_starts(&[1, 2, 9, 1, 9, 1, 2, 1], &delims), vec![3, 7]);
        assert!(user_starts(&[1, 1], &[]).is_empty());
    }

    #[test]
    fn invalidate_drops_checkpoints_past_the_kept_prefix() {
        let mut list = vec![ck(10, 1), ck(100, 1), ck(200, 1)];
        invalidate(&mut list, 100, 0, 0, 1);
        assert_eq!(n_tokens(&list), vec![10, 100]);
        invalidate(&mut list, 0, 0, 0, 1);
        assert!(list.is_empty());
    }
}
