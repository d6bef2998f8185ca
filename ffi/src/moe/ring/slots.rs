//! The ring's slot bookkeeping: which expert each slot of the two halves holds, how a batch's
//! used cold experts are placed in a half or split into passes, and the slot bounds the backend
//! is told. Pure: no copies, no device.

use std::collections::HashMap;

/// Slots of the two halves of the ring: which (layer, expert) each holds. Pure bookkeeping,
/// shared by the device ring and the CPU emulation.
#[derive(Debug)]
pub struct Slots {
    half: usize,
    /// Per half: the ring layer whose experts it holds (None: nothing valid), and per slot the
    /// expert it holds (-1: none).
    owner: [Option<usize>; 2],
    content: [Vec<i32>; 2],
}

/// Where a batch's used cold experts sit in a half, and what had to be copied for them.
#[derive(Debug, Default, PartialEq)]
pub struct Placed {
    /// (expert, slot within the half) for every wanted expert.
    pub slot_of: Vec<(i32, usize)>,
    /// (expert, slot) to copy now.
    pub copies: Vec<(i32, usize)>,
    /// Wanted experts that were already there (prefetched).
    pub hits: usize,
}

impl Slots {
    pub fn new(half: usize) -> Self {
        Self { half, owner: [None, None], content: [vec![-1; half], vec![-1; half]] }
    }

    /// Slots per half.
    pub fn half(&self) -> usize {
        self.half
    }

    /// Places `wanted` (distinct experts of ring layer `layer`) in half `h`: experts already
    /// there stay, the others take slots that hold nothing wanted. None if they do not fit.
    pub fn place(&mut self, h: usize, layer: usize, wanted: &[i32]) -> Option<Placed> {
        if wanted.len() > self.half {
            return None;
        }
        if self.owner[h] != Some(layer) {
            self.content[h].iter_mut().for_each(|e| *e = -1);
            self.owner[h] = Some(layer);
        }
        let content = &mut self.content[h];
        let mut at: HashMap<i32, usize> = HashMap::with_capacity(content.len());
        for (s, &e) in content.iter().enumerate() {
            if e >= 0 {
                at.insert(e, s);
            }
        }
        let mut keep = vec![false; self.half];
        let mut out = Placed::default();
        let mut missing = Vec::new();
        for &e in wanted {
            match at.get(&e) {
                Some(&s) => {
                    keep[s] = true;
                    out.slot_of.push((e, s));
                    out.hits += 1;
                }
                None => missing.push(e),
            }
        }
        let mut free = (0..self.half).filter(|&s| !keep[s]);
        for e in missing {
            let s = free.next()?;
            content[s] = e;
            out.slot_of.push((e, s));
            out.copies.push((e, s));
        }
        Some(out)
    }

    /// Fills half `h` with `experts` of ring layer `layer` ahead of its batch (at most a half;
    /// the rest are ignored). Returns the copies to make.
    pub fn prefetch(&mut self, h: usize, layer: usize, experts: &[i32]) -> Vec<(i32, usize)> {
        if self.owner[h] != Some(layer) {
            self.content[h].iter_mut().for_each(|e| *e = -1);
            self.owner[h] = Some(layer);
        }
        let content = &mut self.content[h];
        let present: std::collections::HashSet<i32> = content.iter().copied().filter(|&e| e >= 0).collect();
        let wanted: Vec<i32> = experts.iter().copied().take(self.half).collect();
        let wanted_set: std::collections::HashSet<i32> = wanted.iter().copied().collect();
        let mut free = (0..self.half).filter(|&s| content[s] < 0 || !wanted_set.contains(&content[s])).collect::<Vec<_>>().into_iter();
        let mut copies = Vec::new();
        for e in wanted.into_iter().filter(|e| !present.contains(e)) {
            let Some(s) = free.next() else { break };
            content[s] = e;
            copies.push((e, s));
        }
        copies
    }

    /// Forgets what half `h` holds (its copies failed).
    pub fn invalidate(&mut self, h: usize) {
        self.owner[h] = None;
        self.content[h].iter_mut().for_each(|e| *e = -1);
    }
}

/// How a prompt batch's used cold experts of one layer go through the ring: pass k computes
/// `chunks[k]` from half (h + k) % 2, so the copies of pass k + 1 run while pass k computes;
/// `cpu` are those no pass takes (the CPU part computes them).
#[derive(Debug, Default, PartialEq)]
pub struct Waves {
    pub chunks: Vec<Vec<i32>>,
    pub cpu: Vec<i32>,
}

/// Splits `used` (distinct, most selected first) into at most `passes` chunks of a half each.
pub fn plan_waves(used: &[i32], half: usize, passes: usize) -> Waves {
    let take = (half * passes.max(1)).min(used.len());
    let chunks = if half == 0 { Vec::new() } else { used[..take].chunks(half).map(<[i32]>::to_vec).collect() };
    Waves { chunks, cpu: used[take..].to_vec() }
}

/// The bounds of a batch's window slots for the backend: the selections of the most used slot,
/// and one past the largest slot.
pub(crate) fn bounds(slots: &[i32]) -> (i32, i32) {
    let n_as = slots.iter().copied().max().map_or(0, |m| m + 1).max(0);
    let mut counts = vec![0i32; n_as as usize];
    for &s in slots {
        if let Ok(s) = usize::try_from(s) {
            counts[s] += 1;
        }
    }
    (counts.into_iter().max().unwrap_or(0), n_as)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_the_busiest_slot_and_one_past_the_largest() {
        assert_eq!(bounds(&[3, 0, 3, 7, 3, 0]), (3, 8));
        assert_eq!(bounds(&[5]), (1, 6));
        assert_eq!(bounds(&[]), (0, 0));
    }

    #[test]
    fn waves_take_a_half_per_pass_and_leave_the_rest_to_the_cpu() {
        let used = [9, 4, 7, 1, 3, 8, 2];
        assert_eq!(plan_waves(&used, 3, 1), Waves { chunks: vec![vec![9, 4, 7]], cpu: vec![1, 3, 8, 2] });
        assert_eq!(plan_waves(&used, 3, 2), Waves { chunks: vec![vec![9, 4, 7], vec![1, 3, 8]], cpu: vec![2] });
        assert_eq!(plan_waves(&used, 3, 4), Waves { chunks: vec![vec![9, 4, 7], vec![1, 3, 8], vec![2]], cpu: vec![] });
        assert_eq!(plan_waves(&[], 3, 4), Waves::default(), "nothing used, no pass");
        assert_eq!(plan_waves(&used, 0, 4).cpu, used.to_vec(), "no ring, all on the CPU");
    }

    /// The ring's bookkeeping over a layer in waves, then the next layer: a pass's chunk lands in
    /// its half while the previous pass's half is reused, and a half another layer took is
    /// copied afresh.
    #[test]
    fn passes_alternate_halves_and_reuse_slots() {
        let mut s = Slots::new(2);
        // Layer 0 (half 0): pass 0 takes 2 experts in half 0, pass 1 copies 2 more into half 1 ahead.
        let p0 = s.place(0, 0, &[10, 11]).expect("fits");
        let p1 = s.place(1, 0, &[12, 13]).expect("fits");
        assert_eq!((p0.copies.len(), p1.copies.len()), (2, 2));
        // Pass 2 reuses half 0 (pass 0 has computed): only the new expert is copied.
        let p2 = s.place(0, 0, &[14, 10]).expect("fits");
        assert_eq!((p2.hits, p2.copies), (1, vec![(14, 1)]), "10 stays where it is, 14 takes 11's slot");
        // Pass 1's half then serves layer 1 (half 1): its content was layer 0's, so all is copied.
        let q = s.place(1, 1, &[12]).expect("fits");
        assert_eq!((q.hits, q.copies.len()), (0, 1));
        // The next batch's pass 0 of layer 0 finds half 0 as pass 2 left it.
        assert_eq!(s.place(0, 0, &[10, 14]).expect("fits").hits, 2);
    }

    #[test]
    fn a_half_takes_what_fits_and_refuses_more() {
        let mut s = Slots::new(4);
        let p = s.place(0, 0, &[7, 3, 9]).expect("fits");
        assert_eq!(p.copies, vec![(7, 0), (3, 1), (9, 2)]);
        assert_eq!(p.hits, 0);
        assert!(s.place(0, 0, &[1, 2, 3, 4, 5]).is_none());
    }

    #[test]
    fn prefetched_experts_are_hits_and_only_misses_are_copied() {
        let mut s = Slots::new(4);
        assert_eq!(s.prefetch(1, 3, &[10, 11, 12]), vec![(10, 0), (11, 1), (12, 2)]);
        let p = s.place(1, 3, &[12, 40, 10]).expect("fits");
        assert_eq!(p.hits, 2);
        assert_eq!(p.copies, vec![(40, 1)], "the unused prefetched slot is reused first");
        let mut slots: Vec<_> = p.slot_of.clone();
        slots.sort();
        assert_eq!(slots, vec![(10, 0), (12, 2), (40, 1)]);
    }

    #[test]
    fn another_layer_in_the_half_invalidates_it() {
        let mut s = Slots::new(2);
        s.prefetch(0, 0, &[1, 2]);
        let p = s.place(0, 2, &[1]).expect("fits");
        assert_eq!(p.hits, 0, "layer 2 does not hit layer 0's experts");
        assert_eq!(p.copies, vec![(1, 0)]);
        let again = s.place(0, 2, &[1]).expect("fits");
        assert_eq!((again.hits, again.copies.len()), (1, 0), "a second batch of the same layer reuses the slot");
    }

    #[test]
    fn halves_are_independent_and_invalidate_forgets() {
        let mut s = Slots::new(2);
        s.place(0, 0, &[5, 6]).expect("fits");
        s.place(1, 1, &[5, 6]).expect("fits");
        assert_eq!(s.place(0, 0, &[5, 6]).expect("fits").hits, 2);
        s.invalidate(0);
        assert_eq!(s.place(0, 0, &[5]).expect("fits").copies, vec![(5, 0)]);
        assert_eq!(s.place(1, 1, &[6]).expect("fits").hits, 1);
    }

    #[test]
    fn prefetch_keeps_what_is_there_and_stops_at_the_half() {
        let mut s = Slots::new(3);
        s.prefetch(0, 0, &[1, 2]);
        let c = s.prefetch(0, 0, &[2, 3, 4, 5]);
        assert_eq!(c, vec![(3, 0), (4, 2)], "2 stays; 1 (not wanted) gives its slot up; 5 does not fit");
    }
}
