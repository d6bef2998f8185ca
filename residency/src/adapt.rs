//! Run-time adaptation of the hot tier: every interval (`--adapt-every N` decode steps) the
//! experts a layer's hot slots hold are compared with the cold experts by a score that mixes
//! recent use with the profile's rank, and the clearest winners change places.
//!
//! The score is an exponentially decayed count of selections (recency, as in llama.cpp PR
//! #27861's measurement that LRU slots hit well in real routing) plus the profile's share of the
//! layer's selections scaled to one interval (so a profile still counts before the counts speak,
//! and an even prior when there is no profile). Hysteresis keeps it from thrashing: a cold expert
//! displaces a hot one only when its score beats the hot one's by a factor, a margin and a number
//! of standard deviations of the counts (a few selections more are noise, not a trend), and an
//! interval swaps at most `max_swaps` pairs (their number bounds the bytes moved per interval).
//! The defaults were chosen by replaying recorded routing (examples/adapt_sim.rs).

/// The policy's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// Weight kept of the previous score each interval (0: only the last interval counts).
    pub decay: f64,
    /// A cold expert must score above (1 + hysteresis) x the hot one's score ...
    pub hysteresis: f64,
    /// ... plus this many selections.
    pub margin: f64,
    /// Weight of the prior (the profile's share times the selections of one interval).
    pub prior_weight: f64,
    /// Swaps per interval over all layers.
    pub max_swaps: usize,
    /// ... plus this many standard deviations of the two scores' difference (counts are Poisson:
    /// sqrt of their sum), so that a handful of selections does not move an expert.
    pub z: f64,
}

impl Default for Policy {
    fn default() -> Self {
        Self { decay: 0.95, hysteresis: 0.2, margin: 2.0, prior_weight: 0.25, max_swaps: 512, z: 2.0 }
    }
}

/// One exchange: the hot slot `slot` of `layer` gives up expert `out` and takes `into`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Swap {
    pub layer: i32,
    pub slot: usize,
    pub out: u32,
    pub into: u32,
}

struct Layer {
    layer: i32,
    /// slot -> expert.
    hot: Vec<u32>,
    /// expert -> decayed selections.
    score: Vec<f64>,
    /// expert -> share of the layer's selections by the profile (sums to 1).
    prior: Vec<f64>,
    /// expert -> selections since the last interval.
    counts: Vec<u64>,
}

/// A tiered layer as placement left it.
#[derive(Clone, Debug, PartialEq)]
pub struct Start {
    pub layer: i32,
    pub n_expert: usize,
    /// The hot experts in slot order.
    pub hot: Vec<u32>,
    /// The profile's selections per expert, or None for an even prior.
    pub profile_hits: Option<Vec<u64>>,
}

/// The adaptation state of every tiered layer.
pub struct Adapter {
    policy: Policy,
    layers: Vec<Layer>,
}

impl Adapter {
    pub fn new(policy: Policy, layers: Vec<Start>) -> Self {
        let layers = layers
            .into_iter()
            .map(|Start { layer, n_expert, hot, profile_hits }| {
                let prior = match profile_hits.filter(|h| h.len() == n_expert && h.iter().sum::<u64>() > 0) {
                    Some(h) => {
                        let total = h.iter().sum::<u64>() as f64;
                        h.iter().map(|&x| x as f64 / total).collect()
                    }
                    None => vec![1.0 / n_expert.max(1) as f64; n_expert],
                };
                Layer { layer, hot, score: vec![0.0; n_expert], prior, counts: vec![0; n_expert] }
            })
            .collect();
        Self { policy, layers }
    }

    /// Counts the selections (expert ids) a decode step made in `layer`.
    pub fn observe(&mut self, layer: i32, selections: &[i32]) {
        let Some(l) = self.layers.iter_mut().find(|l| l.layer == layer) else { return };
        for &e in selections {
            if let Some(c) = usize::try_from(e).ok().and_then(|e| l.counts.get_mut(e)) {
                *c += 1;
            }
        }
    }

    /// Adds `counts[e]` selections of expert e in `layer` (a tally read since the last interval).
    pub fn observe_counts(&mut self, layer: i32, counts: &[u64]) {
        let Some(l) = self.layers.iter_mut().find(|l| l.layer == layer) else { return };
        for (c, &n) in l.counts.iter_mut().zip(counts) {
            *c += n;
        }
    }

    /// The hot experts of `layer` in slot order, as the swaps so far left them.
    pub fn hot(&self, layer: i32) -> Option<&[u32]> {
        self.layers.iter().find(|l| l.layer == layer).map(|l| l.hot.as_slice())
    }

    /// Ends an interval: folds its counts into the scores and returns the swaps to make (already
    /// applied to the adapter's view of the hot slots), clearest gains first.
    pub fn interval(&mut self) -> Vec<Swap> {
        self.interval_at_most(usize::MAX)
    }

    /// [`Adapter::interval`] with at most `room` swaps (what the caller can make before the next).
    pub fn interval_at_most(&mut self, room: usize) -> Vec<Swap> {
        let p = self.policy;
        let mut candidates: Vec<(f64, Swap)> = Vec::new();
        for l in &mut self.layers {
            let n: u64 = l.counts.iter().sum();
            for e in 0..l.score.len() {
                l.score[e] = p.decay * l.score[e] + l.counts[e] as f64;
            }
            l.counts.iter_mut().for_each(|c| *c = 0);
            let value = |e: usize| l.score[e] + p.prior_weight * l.prior[e] * n as f64;
            let mut is_hot = vec![false; l.score.len()];
            for &e in &l.hot {
                if let Some(h) = is_hot.get_mut(e as usize) {
                    *h = true;
                }
            }
            let mut cold: Vec<usize> = (0..l.score.len()).filter(|&e| !is_hot[e]).collect();
            cold.sort_by(|&a, &b| value(b).total_cmp(&value(a)).then(a.cmp(&b)));
            let mut slots: Vec<usize> = (0..l.hot.len()).collect();
            slots.sort_by(|&a, &b| value(l.hot[a] as usize).total_cmp(&value(l.hot[b] as usize)).then(a.cmp(&b)));
            for (&c, &s) in cold.iter().zip(&slots) {
                let (vc, vh) = (value(c), value(l.hot[s] as usize));
                if vc <= (1.0 + p.hysteresis) * vh + p.margin + p.z * (vc + vh).sqrt() {
                    break;
                }
                candidates.push((vc - vh, Swap { layer: l.layer, slot: s, out: l.hot[s], into: c as u32 }));
            }
        }
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.layer.cmp(&b.1.layer)).then(a.1.slot.cmp(&b.1.slot)));
        candidates.truncate(p.max_swaps.min(room));
        let swaps: Vec<Swap> = candidates.into_iter().map(|(_, s)| s).collect();
        for s in &swaps {
            if let Some(l) = self.layers.iter_mut().find(|l| l.layer == s.layer) {
                l.hot[s.slot] = s.into;
            }
        }
        swaps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_layer(hot: Vec<u32>, n_expert: usize, hits: Option<Vec<u64>>) -> Adapter {
        Adapter::new(Policy::default(), vec![Start { layer: 0, n_expert, hot, profile_hits: hits }])
    }

    #[test]
    fn a_trace_that_uses_cold_experts_swaps_them_in() {
        let mut a = one_layer(vec![0, 1], 8, None);
        for _ in 0..16 {
            a.observe(0, &[2, 3]);
        }
        let swaps = a.interval();
        assert_eq!(swaps.len(), 2);
        assert_eq!(a.hot(0).unwrap().iter().copied().collect::<std::collections::BTreeSet<_>>(), [2, 3].into());
        // Nothing new: nothing moves.
        for _ in 0..16 {
            a.observe(0, &[2, 3]);
        }
        assert!(a.interval().is_empty());
    }

    #[test]
    fn an_alternating_trace_does_not_thrash() {
        // Experts 1 and 2 take turns at one slot's worth of use; 0 is hot and unused.
        let mut a = one_layer(vec![0], 4, None);
        let mut swaps = 0;
        for i in 0..100 {
            let e = if i % 2 == 0 { 1 } else { 2 };
            for _ in 0..8 {
                a.observe(0, &[e]);
            }
            swaps += a.interval().len();
        }
        assert_eq!(swaps, 1, "one of them replaces the unused expert, then they stay");
    }

    #[test]
    fn a_profile_holds_its_experts_until_the_counts_clearly_differ() {
        // The profile says 0 and 1; a few selections of 5 are not enough to move them.
        let mut a = one_layer(vec![0, 1], 8, Some(vec![500, 400, 10, 10, 10, 10, 10, 10]));
        for _ in 0..3 {
            a.observe(0, &[5, 0, 1]);
        }
        assert!(a.interval().is_empty());
        for _ in 0..40 {
            a.observe(0, &[5, 6, 0]);
        }
        let swaps = a.interval();
        assert_eq!(swaps, [Swap { layer: 0, slot: 1, out: 1, into: 5 }]);
    }

    #[test]
    fn the_swaps_per_interval_are_capped_clearest_first() {
        let policy = Policy { max_swaps: 1, ..Policy::default() };
        let start = |layer| Start { layer, n_expert: 4, hot: vec![0], profile_hits: None };
        let mut a = Adapter::new(policy, vec![start(0), start(1)]);
        for _ in 0..10 {
            a.observe(0, &[3]);
        }
        for _ in 0..30 {
            a.observe(1, &[2]);
        }
        assert_eq!(a.interval(), [Swap { layer: 1, slot: 0, out: 0, into: 2 }]);
        assert_eq!(a.interval(), [Swap { layer: 0, slot: 0, out: 0, into: 3 }]);
    }

    #[test]
    fn a_lead_must_stand_out_of_the_counts_noise() {
        // 8 selections against 2 is a 4x lead but within the noise of so few counts; 40 against
        // 10, the same ratio, is not.
        let mut a = one_layer(vec![0], 4, None);
        a.observe_counts(0, &[2, 8, 0, 0]);
        assert!(a.interval().is_empty());
        let mut b = one_layer(vec![0], 4, None);
        b.observe_counts(0, &[10, 40, 0, 0]);
        assert_eq!(b.interval(), [Swap { layer: 0, slot: 0, out: 0, into: 1 }]);
    }

    #[test]
    fn routing_that_follows_the_profile_moves_nothing() {
        // 64 experts, the hot half by the profile; each interval draws 64 steps of 4 experts
        // from the profile's own shares (seeded): the noise alone must not trade experts.
        let hits: Vec<u64> = (0..64u64).map(|e| 1000 / (e + 1)).collect();
        let mut a = one_layer((0..32).collect(), 64, Some(hits.clone()));
        let total: u64 = hits.iter().sum();
        let mut state = 1u64;
        let mut unit = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut swaps = 0;
        for _ in 0..50 {
            for _ in 0..64 * 4 {
                let mut x = unit() * total as f64;
                let e = hits.iter().position(|&h| {
                    x -= h as f64;
                    x < 0.0
                });
                a.observe(0, &[e.unwrap_or(63) as i32]);
            }
            swaps += a.interval().len();
        }
        assert!(swaps <= 2, "{swaps} swaps over 50 intervals of routing the profile predicts");
    }

    #[test]
    fn an_interval_plans_no_more_than_the_room_it_is_given() {
        let mut a = one_layer(vec![0, 1, 2], 8, None);
        a.observe_counts(0, &[0, 0, 0, 50, 50, 50, 0, 0]);
        let swaps = a.interval_at_most(2);
        assert_eq!(swaps.len(), 2);
        // The view holds only what was planned: the third expert follows in the next interval.
        assert_eq!(a.hot(0).unwrap().iter().filter(|&&e| e >= 3).count(), 2);
        assert_eq!(a.interval_at_most(8).len(), 1);
    }

    #[test]
    fn counts_add_up_as_selections_do() {
        let mut a = one_layer(vec![0], 4, None);
        let mut b = one_layer(vec![0], 4, None);
        a.observe_counts(0, &[1, 0, 9, 0, 5]);
        b.observe(0, &[0, 2, 2, 2, 2, 2, 2, 2, 2, 2]);
        assert_eq!(a.interval(), b.interval());
    }

    #[test]
    fn ids_out_of_range_are_ignored() {
        let mut a = one_layer(vec![0], 2, None);
        a.observe(0, &[-1, 7, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]);
        a.observe(9, &[1]);
        assert_eq!(a.interval(), [Swap { layer: 0, slot: 0, out: 0, into: 1 }]);
    }
}
