//! Drafting that backs off where drafts stop gaining tokens.

/// When drafts stop paying: after two drafting steps in a row that gained no token (the drafter
/// returned nothing, or the target rejected its first token), a slot skips drafting for 1, 3, 7,
/// 15 and then 31 steps before it tries again, so a drafter the text does not suit (or whose
/// minimum probability stops it at once) costs a draft step in 32 instead of every step. Only
/// drafters that decode (an MTP head, a draft model) back off: an n-gram lookup costs nothing.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Backoff {
    misses: u32,
    skip: u32,
}

impl Backoff {
    /// Whether this step drafts; a skipped step counts down.
    pub(super) fn should_draft(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// A drafting step's outcome: how many of its draft tokens the target accepted.
    pub(super) fn record(&mut self, n_accepted: usize) {
        if n_accepted > 0 {
            self.misses = 0;
            return;
        }
        self.misses = self.misses.saturating_add(1);
        if self.misses >= 2 {
            self.skip = (1u32 << (self.misses - 1).min(5)) - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Backoff;

    fn run(b: &mut Backoff, steps: usize, accepted: usize) -> Vec<bool> {
        (0..steps)
            .map(|_| {
                let d = b.should_draft();
                if d {
                    b.record(accepted);
                }
                d
            })
            .collect()
    }

    #[test]
    fn drafts_that_gain_nothing_are_tried_ever_less_often_and_one_accepted_token_resets() {
        let mut b = Backoff::default();
        // accepted drafts: every step drafts
        assert!(run(&mut b, 10, 2).iter().all(|&d| d));
        // from the second miss on, the gaps are 1, 3, 7, 15, 31, 31 steps
        let seq = run(&mut b, 120, 0);
        let drafted: Vec<usize> = seq.iter().enumerate().filter(|(_, &d)| d).map(|(i, _)| i).collect();
        assert_eq!(drafted, vec![0, 1, 3, 7, 15, 31, 63, 95]);
        // one accepted token and drafting is back at every step
        let mut b = Backoff { misses: 9, skip: 0 };
        assert!(b.should_draft());
        b.record(1);
        assert!(run(&mut b, 5, 1).iter().all(|&d| d));
        // a single miss between accepted drafts skips nothing
        let mut b = Backoff::default();
        b.record(0);
        assert!(b.should_draft());
    }
}
