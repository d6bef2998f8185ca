//! Expert placement policy: which (layer, expert) pairs the hot tier holds, how large the
//! prefill ring is, what the profile says each layer will miss, and when a prompt batch copies
//! its cold experts to the GPU rather than computing them on the CPU. Pure functions of the
//! model's expert layout, the ranked profile and measured rates; the mechanism that carries a
//! plan out lives in strata-ffi's `moe` module.
//!
//! The hot tier is filled greedily from a ranking (the profile's, most selections first, or an
//! even interleaving of the layers without one) until a byte budget or an expert count runs out,
//! the classic static frequency placement of MoE offloading (MoE-Lightning, KTransformers'
//! hot-expert lists). The ring's choice is a two-term cost model in the style of Fiddler's
//! CPU-or-GPU decision: copying the batch's expected distinct cold experts over PCIe against
//! computing its cold (token, expert) pairs on the CPU.

use crate::gguf::ExpertLayout;
use crate::profile::Profile;

/// Hot experts per layer, as (layer, experts in ranking order).
pub type Hot = Vec<(i32, Vec<u32>)>;

/// --expert-cache: what VRAM allows, or a number of experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cache {
    Auto,
    Experts(u64),
}

/// Where the cold experts are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdCopy {
    /// Where llama.cpp put them (the file mapping with mmap).
    Mapped,
    /// A pageable RAM copy.
    Ram,
    /// A page-locked RAM copy (the GPU backend's host buffer type).
    PinnedRam,
}

/// VRAM an automatic hot tier leaves free beyond --vram-reserve-mib: the compute buffer of the
/// tiered graph and the GPU library's workspaces may grow past what the context reserved.
pub const AUTO_MARGIN: u64 = 512 << 20;

/// The machine a placement is decided for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Machine {
    /// A GPU backend holds the hot tier (else there is none, unless the ring is emulated).
    pub gpu: bool,
    /// VRAM free once the model, KV cache and compute buffers are allocated.
    pub free_vram: u64,
    /// Threads the machine runs at once.
    pub cores: i32,
    /// The prefill ring is emulated on the host (tests and experiments).
    pub emulate_ring: bool,
}

/// Everything the placement is decided from: the model, its profile, the flags, the machine.
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    pub layout: &'a ExpertLayout,
    pub profile: Option<&'a Profile>,
    /// A hot tier is wanted (else selections are only counted).
    pub hot_tier: bool,
    pub cache: Cache,
    pub cold: ColdCopy,
    pub vram_reserve: u64,
    pub pcie_frac: f64,
    pub adapt_every: u64,
    /// STRATA_PREFILL_RING (None: sized automatically; 0: off).
    pub ring_slots: Option<usize>,
    pub pool_workers: i32,
    pub machine: Machine,
}

/// The placement decided: what the mechanism is asked to build, and what start-up says.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The hot tier's byte budget and expert count (u64::MAX: no bound).
    pub budget: u64,
    pub max: u64,
    pub ranking: Vec<(u32, u32)>,
    pub hot: Hot,
    /// Hot experts every layer keeps for adaptation (0: no floor).
    pub floor: usize,
    /// Slots per half of the prefill ring (0: no ring).
    pub ring_half: usize,
    pub pool_workers: i32,
    /// Bytes the RAM copy of the cold experts takes (0 with the file mapping).
    pub cold_copy_bytes: u64,
    pub stand_in: Vec<(i32, u32)>,
    pub cold_share: Vec<(i32, f64)>,
    /// Settings used otherwise than given, each a start-up warning that says the value used.
    pub clamps: Vec<String>,
}

/// Zero pads per routing position (with --pcie-frac also as many staging slots and their pads).
pub fn pads_per_layer(layout: &ExpertLayout, pcie_frac: f64) -> u64 {
    let per_pos = if pcie_frac > 0.0 { 3 } else { 1 };
    per_pos * u64::from(layout.n_expert_used)
}

/// The whole placement policy: the hot tier's budget, the ranking (with a floor per layer when
/// a profile's placement adapts), the hot experts, the ring, the CPU pool, the RAM copy's size,
/// the stand-ins and the cold shares.
pub fn decide(i: &Inputs) -> Decision {
    let layout = i.layout;
    let mut clamps = Vec::new();
    let (budget, max) = match i.cache {
        _ if !i.hot_tier => (0, 0),
        Cache::Experts(n) => (u64::MAX, n),
        Cache::Auto if i.machine.gpu => (i.machine.free_vram.saturating_sub(i.vram_reserve).saturating_sub(AUTO_MARGIN), u64::MAX),
        Cache::Auto => (0, 0),
    };
    let n_all = layout.layers.len() as u64 * u64::from(layout.n_expert);
    if let (true, Cache::Experts(n)) = (i.hot_tier, i.cache) {
        if n > n_all {
            clamps.push(format!("--expert-cache {n}: the model has {n_all} routed experts (layers x experts); all {n_all} can be hot, so {n_all} is used"));
        }
    }
    let pads = pads_per_layer(layout, i.pcie_frac);
    let mut ranking = ranking(layout, i.profile);
    let mut hot = choose(layout, &ranking, budget, max, pads);
    let floor = if i.adapt_every > 0 && i.profile.is_some() { adapt_floor(&hot) } else { 0 };
    if hot.iter().any(|(_, h)| h.len() < floor) {
        ranking = with_floor(&ranking, floor);
        hot = choose(layout, &ranking, budget, max, pads);
    }
    let ring_on = i.hot_tier && i.ring_slots != Some(0) && (i.machine.gpu || i.machine.emulate_ring);
    let ring_half = if ring_on { ring_half(layout, &ranking, RingRequest { slots: i.ring_slots, budget, max, pads_per_layer: pads }, &mut hot) } else { 0 };
    let pool_workers = if i.pool_workers > i.machine.cores {
        let cores = i.machine.cores;
        clamps.push(format!(
            "--pool-workers {}: this machine runs {cores} threads at once; workers beyond that only wait on each other, so {cores} are used",
            i.pool_workers
        ));
        cores
    } else {
        i.pool_workers
    };
    let cold_copy_bytes = match i.cold {
        ColdCopy::Mapped => 0,
        ColdCopy::Ram | ColdCopy::PinnedRam => copy_bytes(layout, &hot).iter().map(|&(_, b)| b).sum(),
    };
    let stand_in = stand_ins(&ranking, &hot);
    let cold_share = i.profile.map(|prof| cold_shares(prof, &hot)).unwrap_or_default();
    Decision { budget, max, ranking, hot, floor, ring_half, pool_workers, cold_copy_bytes, stand_in, cold_share, clamps }
}

/// Bytes of each layer's RAM copy: its cold experts and one zero row.
pub fn copy_bytes(layout: &ExpertLayout, hot: &Hot) -> Vec<(i32, u64)> {
    layout
        .layers
        .iter()
        .map(|l| {
            let n_hot = hot.iter().find(|(il, _)| *il == l.layer as i32).map_or(0, |(_, h)| h.len() as u64);
            (l.layer as i32, (u64::from(layout.n_expert) - n_hot + 1) * l.expert_bytes())
        })
        .collect()
}

/// A RAM copy cut to what the memory guard admits.
#[derive(Clone, Debug, PartialEq)]
pub struct RamSplit {
    /// Bytes of the layers copied.
    pub copied: u64,
    /// Layers whose cold experts stay in the file mapping, ascending.
    pub mapped: Vec<i32>,
}

/// The RAM rule: when the memory guard admits only `allowed` bytes of the RAM copy, the layers
/// whose cold tier takes the most selections per byte are copied (by `cold_share`, the
/// profile's share of each layer's selections that miss the hot tier; layers not listed count
/// as `default_share`) and the others stay in the mapping. A layer's copy is whole: its cold
/// tier is one tensor that the kernels, the ring and zero-copy decode address by row.
pub fn ram_split(copy: &[(i32, u64)], cold_share: &[(i32, f64)], default_share: f64, allowed: u64) -> RamSplit {
    let share = |il: i32| cold_share.iter().find(|(l, _)| *l == il).map_or(default_share, |&(_, s)| s);
    let mut order: Vec<(i32, u64)> = copy.to_vec();
    // most selections per byte first; ties by layer
    order.sort_by(|a, b| (share(b.0) / b.1.max(1) as f64).total_cmp(&(share(a.0) / a.1.max(1) as f64)).then(a.0.cmp(&b.0)));
    let (mut copied, mut mapped) = (0u64, Vec::new());
    for (il, bytes) in order {
        if copied + bytes <= allowed {
            copied += bytes;
        } else {
            mapped.push(il);
        }
    }
    mapped.sort_unstable();
    RamSplit { copied, mapped }
}

/// (layer, expert) in the order the hot tier is filled: the profile's ranking, or without one
/// expert 0 of every layer, then expert 1 of every layer, and so on.
pub fn ranking(layout: &ExpertLayout, profile: Option<&Profile>) -> Vec<(u32, u32)> {
    if let Some(prof) = profile {
        return prof.ranked.iter().map(|e| (e.layer, e.expert)).collect();
    }
    (0..layout.n_expert).flat_map(|e| layout.layers.iter().map(move |l| (l.layer, e))).collect()
}

/// `ranking` with each layer's first `floor` entries moved to the front (keeping their order),
/// so a hot tier filled from it holds at least `floor` experts of every layer the budget
/// reaches. Run-time adaptation exchanges experts within a layer, so a layer the profile left
/// without hot slots could never gain any.
pub fn with_floor(ranking: &[(u32, u32)], floor: usize) -> Vec<(u32, u32)> {
    let mut taken: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    let (mut head, mut tail) = (Vec::new(), Vec::new());
    for &(layer, expert) in ranking {
        let n = taken.entry(layer).or_default();
        if *n < floor {
            *n += 1;
            head.push((layer, expert));
        } else {
            tail.push((layer, expert));
        }
    }
    head.extend(tail);
    head
}

/// Per-layer floor for an adapting hot tier: half the per-layer average of `hot`.
pub fn adapt_floor(hot: &Hot) -> usize {
    let n: usize = hot.iter().map(|(_, h)| h.len()).sum();
    n / hot.len().max(1) / 2
}

/// Hot experts per layer: the ranking's head within `budget` bytes and `max` experts. The
/// first hot expert of a layer also pays for the layer's `pads_per_layer` zero pad (and
/// staging) experts.
pub fn choose(layout: &ExpertLayout, ranking: &[(u32, u32)], budget: u64, max: u64, pads_per_layer: u64) -> Hot {
    let mut hot: Hot = layout.layers.iter().map(|l| (l.layer as i32, Vec::new())).collect();
    let (mut used, mut n) = (0u64, 0u64);
    for &(layer, expert) in ranking {
        if n >= max {
            break;
        }
        let Some(i) = layout.layers.iter().position(|l| l.layer == layer) else { continue };
        let bytes = layout.layers[i].expert_bytes();
        let cost = if hot[i].1.is_empty() { (1 + pads_per_layer) * bytes } else { bytes };
        if used + cost > budget {
            break;
        }
        used += cost;
        n += 1;
        hot[i].1.push(expert);
    }
    hot
}

/// Ring bytes allowed at most, as a share of the hot tier's budget, when the ring is sized
/// automatically: layers with more cold experts than that keep the prompt path without it.
pub const RING_MAX_SHARE: f64 = 0.25;
/// Unmapped tail of each window (the device maps in 2 MiB granules), per matrix and layer.
pub const WINDOW_SLACK: u64 = 2 << 20;

/// How the ring is sized and what the hot tier may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RingRequest {
    /// Slots asked for (STRATA_PREFILL_RING); None sizes the ring automatically.
    pub slots: Option<usize>,
    /// The hot tier's byte budget (u64::MAX: none) and expert count (u64::MAX: none).
    pub budget: u64,
    pub max: u64,
    pub pads_per_layer: u64,
}

/// Slots per half of the prefill ring, re-choosing `hot` within what the ring leaves of an
/// automatic budget. Asked-for slots give half as many per half; unset, a half holds the largest
/// cold tier of a layer (within RING_MAX_SHARE of the budget): a layer whose cold tier exceeds a
/// half sends every prompt batch's hidden state to the CPU and back, whether or not it overflows.
pub fn ring_half(layout: &ExpertLayout, ranking: &[(u32, u32)], req: RingRequest, hot: &mut Hot) -> usize {
    let expert_bytes = layout.layers.iter().map(|l| l.expert_bytes()).max().unwrap_or(0);
    let n_expert = u64::from(layout.n_expert);
    let max_cold = |hot: &Hot| hot.iter().map(|(_, h)| n_expert - h.len() as u64).max().unwrap_or(0);
    let slack = 3 * WINDOW_SLACK * layout.layers.len() as u64;
    let cost = |half: u64| 2 * half * expert_bytes + slack;
    let auto_budget = req.budget != u64::MAX && req.max == u64::MAX;
    let rechoose = |half: u64| choose(layout, ranking, req.budget.saturating_sub(cost(half)), req.max, req.pads_per_layer);
    let mut half = match req.slots {
        Some(n) => (n / 2) as u64,
        None => max_cold(hot),
    };
    if req.slots.is_none() && auto_budget {
        let cap = ((req.budget as f64 * RING_MAX_SHARE) as u64).saturating_sub(slack) / (2 * expert_bytes.max(1));
        // The hot tier shrinks as the ring grows, which grows the largest cold tier: a few
        // rounds settle it.
        for _ in 0..3 {
            half = max_cold(hot).min(cap);
            *hot = rechoose(half);
        }
        half = max_cold(hot).min(cap);
    } else if auto_budget {
        *hot = rechoose(half);
    }
    half as usize
}

/// Per layer, the profile's share of selections that the chosen hot experts miss.
pub fn cold_shares(prof: &Profile, hot: &Hot) -> Vec<(i32, f64)> {
    hot.iter()
        .map(|(il, h)| {
            let (mut all, mut hit) = (0u64, 0u64);
            for e in prof.ranked.iter().filter(|e| e.layer as i32 == *il) {
                all += e.hits;
                if h.contains(&e.expert) {
                    hit += e.hits;
                }
            }
            (*il, if all == 0 { 1.0 } else { (all - hit) as f64 / all as f64 })
        })
        .collect()
}

/// Per layer, the first cold expert of the ranking (the one prompt batches upload anyway).
pub fn stand_ins(ranking: &[(u32, u32)], hot: &Hot) -> Vec<(i32, u32)> {
    let mut out: Vec<(i32, u32)> = Vec::new();
    for &(layer, expert) in ranking {
        let il = layer as i32;
        let is_hot = hot.iter().any(|(l, h)| *l == il && h.contains(&expert));
        if !is_hot && !out.iter().any(|(l, _)| *l == il) {
            out.push((il, expert));
        }
    }
    out
}

/// The cost model of a prompt batch's cold experts, from rates measured at start-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Host-to-device bytes per second into the ring (measured, page-locked or gathered).
    pub copy_bytes_per_s: f64,
    /// Cold (token, expert) pairs per second on the CPU workers (measured on one thread, times
    /// the workers).
    pub cpu_pairs_per_s: f64,
    /// Bytes of one expert (all its matrices).
    pub expert_bytes: f64,
    /// Bytes a token's hidden state takes to the host and its cold result back when a batch's
    /// cold pairs go to the CPU (2 x n_embd f32), moved at the copy rate.
    pub handoff_bytes_per_token: f64,
}

/// The graph split and synchronisation a ring fill step costs (about 80 µs measured on the H200).
pub const RING_STEP_S: f64 = 100e-6;

impl CostModel {
    /// Seconds to copy `distinct` experts, plus one fill step.
    pub fn ring_s(&self, distinct: f64) -> f64 {
        RING_STEP_S + distinct * self.expert_bytes / self.copy_bytes_per_s.max(1.0)
    }

    /// Seconds for the CPU to compute `pairs` cold (token, expert) pairs of an `n_tok`-token
    /// batch: the batch's hidden state to the host and back, and the arithmetic.
    pub fn cpu_s(&self, pairs: f64, n_tok: f64) -> f64 {
        n_tok * self.handoff_bytes_per_token / self.copy_bytes_per_s.max(1.0) + pairs / self.cpu_pairs_per_s.max(1.0)
    }

    /// Whether an `n_tok`-token batch is cheaper through the ring than on the CPU.
    pub fn prefers_ring(&self, pairs: f64, distinct: f64, n_tok: f64) -> bool {
        self.ring_s(distinct) < self.cpu_s(pairs, n_tok)
    }
}

/// Expected distinct experts among `draws` selections with per-selection probabilities `q`.
pub fn expected_distinct(q: impl Iterator<Item = f64>, draws: f64) -> f64 {
    q.map(|p| 1.0 - (-draws * p).exp()).sum()
}

/// Whether a prompt batch of `n_tok` tokens routed to `n_used` experts each, `cold_share` of
/// the selections cold, is quicker through the ring: `cold_p` gives each cold expert's chance per
/// selection (the layer's counts, or the profile's share spread evenly until it has counted enough).
pub fn batch_prefers_ring(cost: &CostModel, n_tok: f64, n_used: f64, cold_share: f64, cold_p: impl Iterator<Item = f64>) -> bool {
    let draws = n_tok * n_used;
    cost.prefers_ring(draws * cold_share, expected_distinct(cold_p, draws), n_tok)
}

/// The share of the VRAM that the hot tier and the compute buffers divide between them which a
/// prompt batch's buffers may take: beyond a few thousand tokens a bigger batch saves little of
/// the ring's copying, while every GiB of hot tier saves decode steps their cold reads.
pub const PROMPT_BATCH_SHARE: f64 = 0.25;

/// The smallest physical batch the fit lowers to (llama.cpp's default -ub).
pub const PROMPT_BATCH_MIN: u32 = 512;

/// The physical batch size that keeps the compute buffers within PROMPT_BATCH_SHARE of `shared`
/// (the VRAM they and the hot tier divide: what is free for the tier plus the buffers), or None
/// where `n_ubatch` does already or cannot go lower. The buffers grow about linearly with the
/// batch at a given context (the attention mask and the scores are batch x context), so the size
/// is scaled and rounded down to a power of two; a caller measures again and may lower further.
pub fn prompt_batch(n_ubatch: u32, compute: u64, shared: u64) -> Option<u32> {
    let allowed = (shared as f64 * PROMPT_BATCH_SHARE) as u64;
    if compute <= allowed || n_ubatch <= PROMPT_BATCH_MIN {
        return None;
    }
    let scaled = (u64::from(n_ubatch) * allowed / compute.max(1)).max(1);
    let pow2 = 1u64 << (63 - scaled.leading_zeros());
    let ub = (pow2 as u32).min(n_ubatch / 2).max(PROMPT_BATCH_MIN);
    Some(ub)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_floor_gives_every_layer_its_share_before_the_rest_of_the_ranking() {
        // The profile ranks layers 0 and 1 far above layer 2.
        let ranking = vec![(0, 5), (1, 3), (0, 1), (1, 0), (0, 2), (1, 7), (2, 4), (2, 6)];
        let floored = with_floor(&ranking, 1);
        assert_eq!(&floored[..3], &[(0, 5), (1, 3), (2, 4)], "each layer's best first, in ranking order");
        assert_eq!(&floored[3..], &[(0, 1), (1, 0), (0, 2), (1, 7), (2, 6)], "then the rest as ranked");
        assert_eq!(with_floor(&ranking, 0), ranking);
        let lay = layout(3, 8);
        let hot = choose(&lay, &floored, u64::MAX, 6, 0);
        assert!(hot.iter().all(|(_, h)| !h.is_empty()), "{hot:?}");
        let plain = choose(&lay, &ranking, u64::MAX, 6, 0);
        assert!(plain[2].1.is_empty(), "without the floor layer 2 gets nothing: {plain:?}");
        assert_eq!(adapt_floor(&plain), 1, "6 hot over 3 layers: half the average of 2");
    }
    #[test]
    fn the_ram_rule_copies_the_layers_with_most_cold_selections_per_byte() {
        let lay = layout(4, 8);
        // layer 0 keeps 4 experts hot, the others 2: copies of 5 and 7 rows of 100 bytes
        let hot: Hot = vec![(0, vec![0, 1, 2, 3]), (1, vec![0, 1]), (2, vec![0, 1]), (3, vec![0, 1])];
        let copy = copy_bytes(&lay, &hot);
        assert_eq!(copy, vec![(0, 500), (1, 700), (2, 700), (3, 700)]);
        let shares = vec![(0, 0.1), (1, 0.2), (2, 0.5), (3, 0.3)];
        let all = ram_split(&copy, &shares, 1.0, 2600);
        assert_eq!(all, RamSplit { copied: 2600, mapped: vec![] }, "everything admitted");
        let some = ram_split(&copy, &shares, 1.0, 1500);
        assert_eq!(some, RamSplit { copied: 1400, mapped: vec![0, 1] }, "layers 2 and 3 take the most cold selections");
        // what does not fit is skipped, and a smaller layer further down still fits
        let rest = ram_split(&copy, &shares, 1.0, 1900);
        assert_eq!(rest, RamSplit { copied: 1900, mapped: vec![1] });
        assert_eq!(ram_split(&copy, &shares, 1.0, 0), RamSplit { copied: 0, mapped: vec![0, 1, 2, 3] }, "nothing admitted: all mapped");
        // without a profile every layer counts the same; the smaller copy first, then by layer
        assert_eq!(ram_split(&copy, &[], 1.0, 1200).mapped, vec![2, 3]);
    }

    use crate::gguf::{ExpertLayer, ExpertMatrix, MatKind};
    use crate::profile::Entry;

    /// `n_layer` layers of `n_expert` experts of 100 bytes each, 2 routed per token.
    fn layout(n_layer: u32, n_expert: u32) -> ExpertLayout {
        let mat = ExpertMatrix { kind: MatKind::ALL[0], name: "m".into(), ggml_type: 0, ne: [1, 1, u64::from(n_expert)], offset: 0, expert_bytes: 100 };
        ExpertLayout {
            arch: "test".into(),
            n_layer,
            n_expert,
            n_expert_used: 2,
            n_embd: 1,
            layers: (0..n_layer).map(|layer| ExpertLayer { layer, n_ff: 1, mats: vec![mat.clone()] }).collect(),
        }
    }

    fn profile(ranked: &[(u32, u32, u64)]) -> Profile {
        Profile {
            model_sha256: String::new(),
            arch: "test".into(),
            n_layer: 2,
            n_expert: 4,
            n_expert_used: 2,
            tokens: 0,
            source: String::new(),
            ranked: ranked.iter().map(|&(layer, expert, hits)| Entry { layer, expert, hits }).collect(),
        }
    }

    #[test]
    fn without_a_profile_the_layers_are_interleaved() {
        assert_eq!(ranking(&layout(2, 2), None), [(0, 0), (1, 0), (0, 1), (1, 1)]);
        let p = profile(&[(1, 3, 9), (0, 2, 5)]);
        assert_eq!(ranking(&layout(2, 4), Some(&p)), [(1, 3), (0, 2)]);
    }

    #[test]
    fn the_first_hot_expert_of_a_layer_pays_for_its_pads() {
        let l = layout(2, 4);
        let r = ranking(&l, None);
        // (1 + 2 pads) x 100 for each layer's first expert, then 100 each.
        assert_eq!(choose(&l, &r, 700, u64::MAX, 2), [(0, vec![0, 1]), (1, vec![0])]);
        assert_eq!(choose(&l, &r, 299, u64::MAX, 2), [(0, vec![]), (1, vec![])]);
        assert_eq!(choose(&l, &r, u64::MAX, 3, 2), [(0, vec![0, 1]), (1, vec![0])]);
    }

    #[test]
    fn an_automatic_ring_holds_the_largest_cold_tier_within_its_share() {
        let l = layout(2, 4);
        let r = ranking(&l, None);
        let slack = 3 * WINDOW_SLACK * 2;
        // A budget big enough for everything: the ring holds the largest cold tier left.
        let big = slack * 10;
        let req = RingRequest { slots: None, budget: big, max: u64::MAX, pads_per_layer: 2 };
        let mut hot = choose(&l, &r, big, u64::MAX, 2);
        assert_eq!(ring_half(&l, &r, req, &mut hot), 0);
        assert!(hot.iter().all(|(_, h)| h.len() == 4));
        // Asked-for slots: half each, and the hot tier gives up what the ring takes.
        let req = RingRequest { slots: Some(8), budget: slack + 8 * 100 + 1000, max: u64::MAX, pads_per_layer: 2 };
        let mut hot = choose(&l, &r, req.budget, u64::MAX, 2);
        assert_eq!(ring_half(&l, &r, req, &mut hot), 4);
        assert_eq!(hot.iter().map(|(_, h)| h.len()).sum::<usize>(), 6);
        // A fixed expert count leaves the hot tier alone.
        let req = RingRequest { slots: None, budget: u64::MAX, max: 3, pads_per_layer: 2 };
        let mut hot = choose(&l, &r, u64::MAX, 3, 2);
        assert_eq!(ring_half(&l, &r, req, &mut hot), 3);
        assert_eq!(hot, [(0, vec![0, 1]), (1, vec![0])]);
    }

    #[test]
    fn cold_shares_and_stand_ins_follow_the_profile() {
        let p = profile(&[(0, 1, 6), (1, 2, 5), (0, 3, 3), (0, 0, 1), (1, 0, 0)]);
        let hot: Hot = vec![(0, vec![1]), (1, vec![])];
        let shares = cold_shares(&p, &hot);
        assert_eq!(shares[0], (0, 0.4));
        assert_eq!(shares[1], (1, 1.0));
        let r = ranking(&layout(2, 4), Some(&p));
        assert_eq!(stand_ins(&r, &hot), [(1, 2), (0, 3)]);
    }

    #[test]
    fn cost_model_prefers_the_ring_for_big_batches() {
        let m = CostModel { copy_bytes_per_s: 50e9, cpu_pairs_per_s: 20_000.0, expert_bytes: 1.2e6, handoff_bytes_per_token: 16384.0 };
        // 4,096 tokens x 10 x 20% cold = 8,192 pairs over ~400 distinct experts.
        assert!(m.prefers_ring(8192.0, 400.0, 4096.0));
        // A cold pair or two of a short batch: the CPU is quicker than a fill step.
        assert!(!m.prefers_ring(2.0, 2.0, 2.0));
        let d = expected_distinct(std::iter::repeat_n(1.0 / 512.0, 512), 40960.0);
        assert!((d - 512.0).abs() < 1.0);
        let d = expected_distinct(std::iter::repeat_n(1.0 / 512.0, 512), 10.0);
        assert!((d - 10.0).abs() < 0.2);
        // 512 tokens of a layer that misses 1% over 400 even cold experts: 51 pairs on the CPU
        // (2.6 ms) against ~50 copies (1.3 ms): the ring; at 5 tokens the CPU.
        let even = |n: usize| std::iter::repeat_n(0.01 / 400.0, n);
        assert!(batch_prefers_ring(&m, 512.0, 10.0, 0.01, even(400)));
        assert!(!batch_prefers_ring(&m, 5.0, 10.0, 0.01, even(400)));
    }

    #[test]
    fn a_large_batch_with_few_cold_pairs_takes_the_ring_for_the_hand_off_it_saves() {
        // 4,096 tokens of a layer the profile says misses 0.12%, spread evenly over 300 cold
        // experts: ~39 pairs on ~37 experts. Copying those (1.3 ms) loses to the CPU's arithmetic
        // (1 ms) and wins once the CPU path's 4,096 hidden states to the host and back count (1.8 ms).
        let m = CostModel { copy_bytes_per_s: 38e9, cpu_pairs_per_s: 41_000.0, expert_bytes: 1.2e6, handoff_bytes_per_token: 16384.0 };
        let even = || std::iter::repeat_n(0.0012 / 300.0, 300);
        assert!(batch_prefers_ring(&m, 4096.0, 8.0, 0.0012, even()));
        let no_handoff = CostModel { handoff_bytes_per_token: 0.0, ..m };
        assert!(!batch_prefers_ring(&no_handoff, 4096.0, 8.0, 0.0012, even()));
        // One token's handful of selections stays on the CPU.
        assert!(!batch_prefers_ring(&m, 1.0, 8.0, 0.0012, even()));
    }

    fn inputs<'a>(lay: &'a ExpertLayout, prof: Option<&'a Profile>) -> Inputs<'a> {
        Inputs {
            layout: lay,
            profile: prof,
            hot_tier: true,
            cache: Cache::Auto,
            cold: ColdCopy::Mapped,
            vram_reserve: 0,
            pcie_frac: 0.0,
            adapt_every: 0,
            ring_slots: None,
            pool_workers: 0,
            machine: Machine { gpu: true, free_vram: AUTO_MARGIN + 1000, cores: 4, emulate_ring: false },
        }
    }

    #[test]
    fn an_automatic_budget_is_free_vram_less_the_reserve_and_the_margin() {
        let lay = layout(2, 8);
        let d = decide(&Inputs { ring_slots: Some(0), ..inputs(&lay, None) });
        assert_eq!((d.budget, d.max), (1000, u64::MAX));
        // two layers, each paying 2 pads with its first expert: (1+2)*100 + 100*k within 1000
        assert_eq!(d.hot.iter().map(|(_, h)| h.len()).sum::<usize>(), 6, "{:?}", d.hot);
        let d = decide(&Inputs { vram_reserve: 600, ring_slots: Some(0), ..inputs(&lay, None) });
        assert_eq!(d.budget, 400);
        assert_eq!(d.hot.iter().map(|(_, h)| h.len()).sum::<usize>(), 1, "one expert and its pads: {:?}", d.hot);
        let no_gpu = Machine { gpu: false, ..inputs(&lay, None).machine };
        let d = decide(&Inputs { machine: no_gpu, ..inputs(&lay, None) });
        assert_eq!((d.budget, d.max, d.ring_half), (0, 0, 0));
        assert!(d.hot.iter().all(|(_, h)| h.is_empty()));
        let d = decide(&Inputs { hot_tier: false, cache: Cache::Experts(4), ..inputs(&lay, None) });
        assert_eq!((d.budget, d.max), (0, 0), "counting only: no hot tier whatever the cache says");
    }

    #[test]
    fn a_cache_or_pool_past_what_exists_is_clamped_with_the_value_used() {
        let lay = layout(2, 4);
        let d = decide(&Inputs { cache: Cache::Experts(100), pool_workers: 9, ..inputs(&lay, None) });
        assert_eq!(d.pool_workers, 4);
        assert_eq!(d.hot.iter().map(|(_, h)| h.len()).sum::<usize>(), 8, "every expert hot");
        assert!(d.clamps[0].starts_with("--expert-cache 100:") && d.clamps[0].ends_with("so 8 is used"), "{:?}", d.clamps);
        assert!(d.clamps[1].starts_with("--pool-workers 9:") && d.clamps[1].ends_with("so 4 are used"), "{:?}", d.clamps);
        assert!(decide(&Inputs { cache: Cache::Experts(8), pool_workers: 4, ..inputs(&lay, None) }).clamps.is_empty());
    }

    #[test]
    fn an_adapting_profile_placement_gets_a_floor_in_every_layer() {
        let lay = layout(2, 4);
        let p = profile(&[(0, 0, 9), (0, 1, 8), (0, 2, 7), (0, 3, 6), (1, 0, 1)]);
        let fixed = decide(&Inputs { cache: Cache::Experts(4), ..inputs(&lay, Some(&p)) });
        assert_eq!(fixed.hot, vec![(0, vec![0, 1, 2, 3]), (1, vec![])]);
        assert_eq!(fixed.floor, 0);
        assert_eq!(fixed.cold_share, vec![(0, 0.0), (1, 1.0)]);
        let adapting = decide(&Inputs { cache: Cache::Experts(4), adapt_every: 8, ..inputs(&lay, Some(&p)) });
        assert_eq!(adapting.floor, 1);
        assert_eq!(adapting.hot, vec![(0, vec![0, 1, 2]), (1, vec![0])]);
        assert_eq!(adapting.stand_in, vec![(0, 3)], "layer 1 has no cold expert in the ranking");
    }

    #[test]
    fn the_ring_needs_a_gpu_or_its_emulation_and_is_off_at_zero_slots() {
        let lay = layout(2, 8);
        let cpu = Machine { gpu: false, ..inputs(&lay, None).machine };
        let d = decide(&Inputs { cache: Cache::Experts(4), machine: cpu, ..inputs(&lay, None) });
        assert_eq!(d.ring_half, 0);
        let emulated = Machine { emulate_ring: true, ..cpu };
        let d = decide(&Inputs { cache: Cache::Experts(4), machine: emulated, ..inputs(&lay, None) });
        assert_eq!(d.ring_half, 6, "the largest cold tier of a layer: 8 - 2");
        let d = decide(&Inputs { cache: Cache::Experts(4), machine: emulated, ring_slots: Some(4), ..inputs(&lay, None) });
        assert_eq!(d.ring_half, 2);
        let d = decide(&Inputs { cache: Cache::Experts(4), machine: emulated, ring_slots: Some(0), ..inputs(&lay, None) });
        assert_eq!(d.ring_half, 0);
    }

    #[test]
    fn the_ram_copy_holds_each_layers_cold_experts_and_a_zero_row() {
        let lay = layout(2, 8);
        let d = decide(&Inputs { cache: Cache::Experts(3), cold: ColdCopy::PinnedRam, ring_slots: Some(0), ..inputs(&lay, None) });
        // 3 hot (2 + 1): layer 0 keeps 6 cold + pad, layer 1 keeps 7 cold + pad
        assert_eq!(d.cold_copy_bytes, (7 + 8) * 100);
        assert_eq!(decide(&Inputs { cold: ColdCopy::Mapped, ..inputs(&lay, None) }).cold_copy_bytes, 0);
        assert_eq!(pads_per_layer(&lay, 0.5), 6, "--pcie-frac adds staging slots and their pads");
    }

    #[test]
    fn a_prompt_batch_whose_buffers_take_the_hot_tiers_room_is_scaled_down() {
        let gib = 1u64 << 30;
        // 9 GiB of buffers for 8192 tokens: a quarter of 24 GiB holds 5461 tokens' worth, 12 GiB 2730
        assert_eq!(prompt_batch(8192, 9 * gib, 24 * gib), Some(4096));
        assert_eq!(prompt_batch(8192, 9 * gib, 12 * gib), Some(2048));
        // within the share: kept
        assert_eq!(prompt_batch(8192, 6 * gib, 24 * gib), None);
        // never below llama.cpp's default, and nothing to do there
        assert_eq!(prompt_batch(8192, 20 * gib, 4 * gib), Some(PROMPT_BATCH_MIN));
        assert_eq!(prompt_batch(512, 20 * gib, 21 * gib), None);
        // a second measurement still over the share lowers it by at least half
        assert_eq!(prompt_batch(4096, 7 * gib, 24 * gib), Some(2048));
        // no room at all: the smallest batch
        assert_eq!(prompt_batch(4096, gib, 0), Some(PROMPT_BATCH_MIN));
        // an odd -ub above the floor halves at most to its half
        assert_eq!(prompt_batch(1000, gib, 3 * gib), Some(PROMPT_BATCH_MIN));
    }
}
