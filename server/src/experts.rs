//! MoE expert residency in strata-server: the engine flags of the seed, turned into a placement
//! of every (layer, expert) in a tier (VRAM, RAM copy, file mapping), checked before use, logged
//! at start-up and reported in /metrics.
//!
//! llama.cpp is asked to keep all routed experts on the host (`--cpu-moe`, no repacking, so
//! their bytes stay in GGUF layout); after the first context exists, the hot tier is filled
//! from the profile's ranking within the VRAM budget and the MoE hook takes over those layers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_ffi::moe::{self, ColdCopy, Placement, Tier};
use strata_ffi::Model;
use strata_residency::gguf::{self, ExpertLayout};
use strata_residency::memguard::{self, CopyKind};
use strata_residency::plan::{self, AUTO_MARGIN};
use strata_residency::profile::Profile;

use crate::cli::env::Settings;
use crate::cli::flags::{CacheSize, StrataArgs};
use crate::engine::metrics::{strata_family, strata_line, strata_lines};

#[derive(Debug, Clone, PartialEq)]
pub struct ExpertConfig {
    pub mmap_experts: bool,
    pub resident_cpu: bool,
    pub pinned: bool,
    pub profile: Option<PathBuf>,
    pub cache: CacheSize,
    pub pool_workers: i32,
    pub vram_reserve_mib: u64,
    pub pcie_frac: f64,
    /// --adapt-every: batches per adaptation interval (0: the placement stays as made).
    pub adapt_every: u64,
    /// Write the counted selections as a ranked profile here after every request.
    pub record: Option<PathBuf>,
    /// Whether a hot tier is wanted (every expert flag but --expert-profile-out alone).
    pub hot_tier: bool,
    /// STRATA_PREFILL_RING: slots of the prefill ring (None: sized automatically; 0: off).
    pub ring_slots: Option<usize>,
    /// STRATA_MEMGUARD_ROOT: where the memory guard reads /proc and the cgroup files.
    pub memguard_root: PathBuf,
    pub lab: moe::Lab,
    /// The expert flags given on the command line, for the start-up line of each one's effect.
    pub given: Vec<(&'static str, String)>,
}

impl ExpertConfig {
    /// The expert flags, or None when none is given (llama.cpp then places experts itself).
    pub fn from_args(a: &StrataArgs, env: &Settings) -> Result<Option<Self>, String> {
        let hot_tier = a.mmap_experts || a.resident_cpu_experts || a.resident_experts || a.expert_profile.is_some() || a.expert_cache.is_some();
        if !hot_tier && a.expert_profile_out.is_none() {
            return Ok(None);
        }
        let cfg = ExpertConfig {
            mmap_experts: a.mmap_experts,
            resident_cpu: a.resident_cpu_experts || a.resident_experts,
            pinned: a.resident_experts,
            profile: a.expert_profile.clone(),
            cache: a.expert_cache.unwrap_or(CacheSize::Auto),
            pool_workers: a.pool_workers.unwrap_or(0),
            vram_reserve_mib: a.vram_reserve_mib.unwrap_or(0),
            pcie_frac: a.pcie_frac.unwrap_or(0.0),
            adapt_every: a.adapt_every.unwrap_or(0),
            ring_slots: env.prefill_ring,
            record: a.expert_profile_out.clone(),
            hot_tier,
            memguard_root: env.memguard_root.clone(),
            lab: env.lab.clone(),
            given: a.given.clone(),
        };
        if cfg.resident_cpu && cfg.profile.is_none() && cfg.adapt_every == 0 {
            return Err(
                "--resident-cpu-experts needs a fixed ranked --expert-profile (write one with tools/expert-profile), or --adapt-every N to learn one at run time"
                    .into(),
            );
        }
        if cfg.adapt_every > 0 && hot_tier && !cfg.resident_cpu {
            return Err("--adapt-every exchanges experts between the hot tier and a RAM copy of the cold ones: add --resident-experts (or --resident-cpu-experts); with --mmap-experts alone the cold experts are read from the model file".into());
        }
        Ok(Some(cfg))
    }

    /// What llama.cpp must do for the tiers to work: experts on the host, in GGUF layout.
    pub fn llama_args(&self) -> &'static [&'static str] {
        if self.hot_tier {
            &["--cpu-moe", "--no-repack"]
        } else {
            &[]
        }
    }
}

/// What was checked before the model is loaded.
#[derive(Clone)]
pub struct Prepared {
    cfg: ExpertConfig,
    layout: ExpertLayout,
    sha256: Option<String>,
    profile: Option<Profile>,
}

/// Validates the model's expert tensors (and the profile against it) before llama.cpp maps them.
pub fn prepare(cfg: &ExpertConfig, model_path: &Path, use_mmap: bool) -> Result<Prepared, String> {
    if cfg.pcie_frac > 0.0 && cfg.pinned && moe::has_gpu() {
        return Err("--pcie-frac uploads a share of the cold experts the CPU computes in decode; with --resident-experts on a GPU, decode reads every cold expert over the bus from the page-locked copy (zero-copy) and the CPU computes none: drop --pcie-frac, or use --resident-cpu-experts".into());
    }
    if !use_mmap && (cfg.mmap_experts || cfg.resident_cpu) {
        let flag = if cfg.mmap_experts { "--mmap-experts" } else { "--resident-cpu-experts" };
        return Err(format!("{flag} needs the model file mapped: use --load-mode mmap (or auto)"));
    }
    let (info, layout) = gguf::validate(model_path).map_err(|e| match e {
        gguf::GgufError::MissingKey(k) if k.ends_with(".expert_count") => {
            format!("{}: the model has no routed experts ({k} is missing); the expert flags need an MoE model", model_path.display())
        }
        e => format!("{}: {e}", model_path.display()),
    })?;
    if layout.layers.is_empty() {
        return Err(format!("{}: the model has no routed-expert tensors; the expert flags need an MoE model", model_path.display()));
    }
    let sha256 = if cfg.profile.is_some() || cfg.record.is_some() {
        Some(gguf::model_sha256(model_path, &info).map_err(|e| format!("{}: {e}", model_path.display()))?)
    } else {
        None
    };
    let profile = match &cfg.profile {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| format!("--expert-profile {}: {e}", p.display()))?;
            let prof = Profile::parse(&bytes).map_err(|e| format!("--expert-profile {}: {e}", p.display()))?;
            prof.check(&layout, sha256.as_deref().unwrap_or_default()).map_err(|e| format!("--expert-profile {}: {e}", p.display()))?;
            Some(prof)
        }
        None => None,
    };
    // Before the model and its context load: a guard that cannot read its limits stops the start
    // now, not after minutes of loading.
    if cfg.resident_cpu {
        memguard::measure(&cfg.memguard_root).map_err(|e| guard_failed(cfg, &e))?;
    }
    // Before the model's contexts exist: they size their graphs by the hook's extra nodes.
    strata_ffi::install_hooks().map_err(|e| e.to_string())?;
    strata_ffi::kv::set_qsa_gather(cfg.lab.qsa_gather);
    Ok(Prepared { cfg: cfg.clone(), layout, sha256, profile })
}

/// `--resident-cpu-experts` on a GPU (`gpu`: one the copy may be page-locked for, i.e. not
/// STRATA_LAB=pageable-copy): the copy is page-locked (decode then reads cold experts over the
/// bus, zero-copy, as the seed's measured line does), unless --pcie-frac asks for the CPU path's
/// uploads; the line says which and why. How much of it the memory guard admits is the RAM rule's.
fn copy_kind(asked: ColdCopy, gpu: bool, pcie_frac: f64) -> (ColdCopy, Option<String>) {
    if asked != ColdCopy::Ram || !gpu {
        return (asked, None);
    }
    if pcie_frac > 0.0 {
        let line = "--resident-cpu-experts: the RAM copy stays pageable for --pcie-frac's uploads, so decode computes cold experts on the CPU (zero-copy decode reads a page-locked copy)";
        return (ColdCopy::Ram, Some(line.into()));
    }
    (
        ColdCopy::PinnedRam,
        Some("--resident-cpu-experts: the RAM copy is page-locked on the GPU's host: decode reads cold experts over the bus (zero-copy)".into()),
    )
}

/// The RAM rule's start-up line when the memory guard admits only part of the copy.
fn ram_rule_line(flag: &str, kind: CopyKind, (allowed, total): (u64, u64), n_layers: usize, split: &plan::RamSplit, profile: bool, gpu: bool) -> String {
    let copied = n_layers - split.mapped.len();
    let list = split.mapped.iter().map(i32::to_string).collect::<Vec<_>>().join(", ");
    let order = if profile { "those whose cold experts the profile selects most per byte" } else { "in layer order (no --expert-profile ranks them)" };
    let how =
        if gpu { "decode computes them on the CPU, prompt batches copy them to the GPU as they would from the RAM copy" } else { "the CPU computes them" };
    format!(
        "{flag}: the memory guard admits {} of the {} {kind} RAM copy: {copied} of {n_layers} layers copied ({}), {order}; the cold experts of layer{} {list} are read from the model file ({how})",
        size(allowed),
        size(total),
        size(split.copied),
        if split.mapped.len() == 1 { "" } else { "s" },
    )
}

/// GiB, or MiB below one GiB.
fn size(b: u64) -> String {
    if b >= 1 << 30 {
        gib(b)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// What placement came to, for the flags' effect lines.
struct Facts<'a> {
    placement: &'a Placement,
    cold: ColdCopy,
    n_mapped_layers: usize,
    n_layers: usize,
    hit_note: &'a str,
    gpu: bool,
}

/// One start-up line per expert flag given: what it came to on this machine.
fn effect_lines(cfg: &ExpertConfig, f: &Facts) -> Vec<String> {
    let pl = f.placement;
    let n = |t: Tier| pl.experts[t as usize];
    let b = |t: Tier| size(pl.bytes[t as usize]);
    let mut out = Vec::new();
    for (flag, value) in &cfg.given {
        let effect = match *flag {
            "--mmap-experts" => format!("the experts stay in the file mapping; {} cold experts ({}) are read from it", n(Tier::Mapped), b(Tier::Mapped)),
            "--resident-cpu-experts" | "--resident-experts" => {
                let kind = if f.cold == ColdCopy::PinnedRam { "page-locked" } else { "pageable" };
                let left = match f.n_mapped_layers {
                    0 => String::new(),
                    k => format!("; the memory guard left the cold experts of {k} of {} layers in the mapping", f.n_layers),
                };
                format!("a {kind} RAM copy of {} cold experts ({}){left}", n(Tier::Ram), b(Tier::Ram))
            }
            "--expert-profile" => format!("ranks the hot tier: {}", f.hit_note),
            "--expert-profile-out" => "the selections counted are written as a ranked profile after each request".into(),
            "--expert-cache" => format!("{} experts hot ({})", n(Tier::Hot), b(Tier::Hot)),
            "--pool-workers" => match (pl.workers, pl.zero_copy_layers) {
                (0, _) => "no worker pool: the CPU backend's threads compute cold experts".into(),
                (w, z) if z == f.n_layers => format!(
                    "{w} workers compute cold experts of prompt batches that do not take the ring; decode reads every tiered layer's cold experts zero-copy"
                ),
                (w, z) => format!(
                    "{w} workers compute the cold experts of decode in {} of {} tiered layers and of prompt batches that do not take the ring",
                    f.n_layers - z,
                    f.n_layers
                ),
            },
            "--adapt-every" => match (cfg.adapt_every, pl.adapt_layers) {
                (0, _) => "off, the hot tier keeps its placement".into(),
                (_, 0) => format!("no layer adapts ({})", pl.adapt_off.as_deref().unwrap_or("no layer has both tiers")),
                (e, k) => format!("{k} layers exchange experts between the hot tier and the RAM copy every {e} batches"),
            },
            "--pcie-frac" if cfg.pcie_frac == 0.0 => "no decode step uploads cold experts".into(),
            "--pcie-frac" => format!("{:.0}% of each decode step's cold experts are uploaded to the GPU", 100.0 * cfg.pcie_frac),
            "--vram-reserve-mib" if !f.gpu => "no GPU, nothing to reserve".into(),
            "--vram-reserve-mib" => format!("{} MiB of {} left free beside the hot tier", cfg.vram_reserve_mib, pl.hot_device),
            _ => continue,
        };
        let sep = if value.is_empty() { "" } else { " " };
        out.push(format!("{flag}{sep}{value}: {effect}"));
    }
    out
}

/// The memory guard's error for the RAM copy's flag, with what to do about it.
fn guard_failed(cfg: &ExpertConfig, e: &memguard::GuardError) -> String {
    let flag = if cfg.pinned { "--resident-experts" } else { "--resident-cpu-experts" };
    let fix = match e {
        memguard::GuardError::Refused { .. } => "; give the process more memory, or lower the RAM copy with a larger --expert-cache, or serve the cold experts from the file mapping (--mmap-experts without the RAM copy flags)",
        memguard::GuardError::UnsupportedOs | memguard::GuardError::NoCgroupV2(_) => {
            "; the RAM copy is sized from a cgroup-v2 memory controller: run strata-server in a cgroup-v2 hierarchy (a cgroup-v2 host or container, or systemd-run --scope -p MemoryMax=...), or serve the cold experts from the file mapping (--mmap-experts without the RAM copy flags)"
        }
        _ => "",
    };
    format!("{flag}: {e}{fix}")
}

/// The placement in effect and the selections counted since: a value the engine owns, read by
/// /metrics through the engine handle.
pub struct Residency {
    placement: Placement,
    totals: [u64; 3],
    last_step: [u64; 3],
    recorder: Option<Recorder>,
}

/// What --expert-profile-out needs to write a profile after each request.
struct Recorder {
    path: PathBuf,
    model: Arc<Model>,
    sha256: String,
    layout: ExpertLayout,
    /// The selections the file held when it is also the --expert-profile read at start: this
    /// run's add to them, so feeding a profile back in never loses what it had.
    base: Vec<(i32, Vec<u64>)>,
}

/// Whether two paths name one file (the second may not exist yet).
fn same_file(a: &Path, b: &Path) -> bool {
    let canon = |p: &Path| match std::fs::canonicalize(p) {
        Ok(c) => Some(c),
        Err(_) => Some(std::fs::canonicalize(p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))).ok()?.join(p.file_name()?)),
    };
    canon(a).is_some_and(|x| canon(b) == Some(x))
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// `p` restricted to the layers whose experts llama.cpp loaded, and the MTP layers it left out:
/// it loads those only for MTP drafting. Any other layer missing, or loaded otherwise than the
/// file says, is an error.
fn loaded_layers(p: &Prepared, model: &Model) -> Result<(Prepared, Vec<u32>), String> {
    let loaded = moe::expert_layers(model);
    let trunk = moe::trunk_layers(model);
    let mut unloaded = Vec::new();
    for l in &p.layout.layers {
        let Some(m) = loaded.iter().find(|m| m.layer == l.layer as i32) else {
            if l.layer as i32 >= trunk {
                unloaded.push(l.layer);
                continue;
            }
            return Err(format!("llama.cpp did not load the experts of layer {}", l.layer));
        };
        if m.n_expert as u64 != u64::from(p.layout.n_expert) || m.expert_bytes as u64 != l.expert_bytes() {
            return Err(format!(
                "layer {}: llama.cpp holds {} experts of {} bytes, the file {} of {} bytes",
                l.layer,
                m.n_expert,
                m.expert_bytes,
                p.layout.n_expert,
                l.expert_bytes()
            ));
        }
    }
    let mut out = p.clone();
    out.layout.layers.retain(|l| !unloaded.contains(&l.layer));
    if out.layout.layers.is_empty() {
        return Err("llama.cpp loaded no layer with routed experts".into());
    }
    Ok((out, unloaded))
}

/// Where the compute buffers of the context just made (and of the draft context `draft`, as
/// `Speculative::hot_device_use` gives it) would take more than their share of the VRAM they and
/// an automatic hot tier divide, the physical batch size to make the contexts again with, and
/// the line that says so. At a long context a big prompt batch's attention masks and scores
/// alone can take a 24 GiB card, leaving no expert hot.
pub fn prompt_batch_fit(p: &Prepared, main_gpu: usize, ctx: &mut strata_ffi::Context<'_>, draft: Option<[u64; 3]>) -> Option<(u32, String)> {
    let cfg = &p.cfg;
    if !(cfg.hot_tier && cfg.cache == CacheSize::Auto && moe::has_gpu()) {
        return None;
    }
    let [_, _, compute] = moe::hot_device_use(ctx, main_gpu)?;
    let compute = compute + draft.map_or(0, |[_, _, c]| c);
    let (free, _, dev) = moe::hot_device_memory(main_gpu);
    let shared = (free + compute).saturating_sub(cfg.vram_reserve_mib << 20).saturating_sub(AUTO_MARGIN);
    let n_ubatch = ctx.n_ubatch();
    let ub = plan::prompt_batch(n_ubatch, compute, shared)?;
    let line = format!(
        "experts: prompt batches of {n_ubatch} tokens at a {}-token context need {} of compute buffers on {dev}, more than {:.0}% of the {} the hot tier and the buffers share; the contexts are made again with -ub {ub} (an --expert-cache N keeps -ub as typed)",
        ctx.n_ctx(),
        size(compute),
        100.0 * plan::PROMPT_BATCH_SHARE,
        size(shared)
    );
    Some((ub, line))
}

/// Places the experts of `model` per the prepared flags. Runs once, after the first context is
/// created (so that the VRAM left after weights, KV and compute buffers can be measured) and
/// before any graph is computed.
/// `ctx`: the context just created, whose buffers on the hot tier's device start-up reports;
/// `draft`: what a draft context made before placement holds there.
pub fn place(p: &Prepared, model: &Arc<Model>, main_gpu: usize, ctx: &mut strata_ffi::Context<'_>, draft: Option<[u64; 3]>) -> Result<Residency, String> {
    let full_layout = p.layout.clone();
    let (p, unloaded) = loaded_layers(p, model)?;
    let p = &p;
    if !unloaded.is_empty() {
        let list = unloaded.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let (what, it) = if unloaded.len() == 1 { ("layer", "it") } else { ("layers", "them") };
        let line = format!("experts: MTP {what} {list} not loaded (llama.cpp loads {it} only for --spec-type draft-mtp); not placed");
        crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
    }
    let cfg = &p.cfg;
    let (free, total, dev) = moe::hot_device_memory(main_gpu);
    let usage = moe::hot_device_use(ctx, main_gpu).filter(|_| moe::has_gpu() && cfg.hot_tier);
    // the draft context's weights are the target's where it drafts with the model's MTP head
    let usage = usage.map(|[w, m, c]| draft.map_or([w, m, c], |[_, dm, dc]| [w, m + dm, c + dc]));
    if let Some([weights, memory, compute]) = usage {
        let with_draft = if draft.is_some_and(|[_, m, c]| m + c > 0) { " (with the draft context's)" } else { "" };
        let line = format!(
            "experts: before the hot tier {dev} holds {} of the model's other weights, {} of context memory (KV cache, recurrent state) and {} of compute buffers{with_draft} (their size grows with -ub times the context)",
            size(weights),
            size(memory),
            size(compute)
        );
        crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
    }
    let mut cold = match (cfg.resident_cpu, cfg.pinned) {
        (false, _) => ColdCopy::Mapped,
        (true, false) => ColdCopy::Ram,
        (true, true) => ColdCopy::PinnedRam,
    };
    let d = plan::decide(&plan::Inputs {
        layout: &p.layout,
        profile: p.profile.as_ref(),
        hot_tier: cfg.hot_tier,
        cache: cfg.cache,
        cold,
        vram_reserve: cfg.vram_reserve_mib << 20,
        pcie_frac: cfg.pcie_frac,
        adapt_every: cfg.adapt_every,
        ring_slots: cfg.ring_slots,
        pool_workers: cfg.pool_workers,
        machine: plan::Machine {
            gpu: moe::has_gpu(),
            free_vram: free,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as i32,
            emulate_ring: cfg.lab.emulate_ring,
        },
    });
    for line in &d.clamps {
        crate::log::srv(strata_ffi::Verbosity::Warn, "load_model", line);
    }
    if let (Some([_, memory, compute]), CacheSize::Auto, 0) = (usage, cfg.cache, d.hot.iter().map(|(_, h)| h.len()).sum::<usize>()) {
        let line = format!(
            "experts: the hot tier is empty: {dev} has {} free and --vram-reserve-mib keeps {} MiB; the context takes {} for its memory and {} for compute buffers (a smaller -ub or context shrinks those)",
            size(free),
            cfg.vram_reserve_mib,
            size(memory),
            size(compute)
        );
        crate::log::srv(strata_ffi::Verbosity::Warn, "load_model", &line);
    }
    let mut mapped = Vec::new();
    if cold != ColdCopy::Mapped {
        let report = memguard::measure(&cfg.memguard_root).map_err(|e| guard_failed(cfg, &e))?;
        let (kind, line) = copy_kind(cold, moe::has_gpu() && !cfg.lab.pageable_copy, cfg.pcie_frac);
        cold = kind;
        if let Some(line) = line {
            crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
        }
        let kind = if cold == ColdCopy::PinnedRam { CopyKind::PageLocked } else { CopyKind::Pageable };
        crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &report.summary().to_string());
        let allowed = report.allowance(kind);
        let split = plan::ram_split(&plan::copy_bytes(&p.layout, &d.hot), &d.cold_share, 1.0, allowed);
        if !split.mapped.is_empty() {
            let flag = if cfg.pinned { "--resident-experts" } else { "--resident-cpu-experts" };
            let line = ram_rule_line(flag, kind, (allowed, d.cold_copy_bytes), p.layout.layers.len(), &split, p.profile.is_some(), moe::has_gpu());
            crate::log::srv(strata_ffi::Verbosity::Warn, "load_model", &line);
        }
        mapped = split.mapped;
    }
    let mapped_layers = mapped.len();
    let (floor, ring_half, budget) = (d.floor, d.ring_half, d.budget);
    let plan = moe::Plan {
        hot: d.hot,
        cold,
        mapped,
        cold_threads: d.pool_workers,
        count_only: !cfg.hot_tier,
        stand_in: d.stand_in,
        n_used: p.layout.n_expert_used as usize,
        cold_share: d.cold_share,
        pcie_frac: cfg.pcie_frac,
        ring_half,
        adapt: (cfg.adapt_every > 0).then(|| moe::adapt::AdaptPlan {
            every: cfg.adapt_every,
            policy: strata_residency::adapt::Policy::default(),
            prior: p.profile.as_ref().map(|prof| prior(prof, p.layout.n_expert)).unwrap_or_default(),
        }),
        lab: cfg.lab.clone(),
    };
    let t0 = std::time::Instant::now();
    let placement = moe::place(model, &plan, main_gpu).map_err(|e| e.to_string())?;
    let place_s = t0.elapsed().as_secs_f64();

    let n_pairs = p.layout.layers.len() as u64 * u64::from(p.layout.n_expert);
    let mut line = format!("experts: {} MoE layers x {} experts;", p.layout.layers.len(), p.layout.n_expert);
    for t in Tier::ALL {
        let i = t as usize;
        let place = match t {
            Tier::Hot if moe::has_gpu() => format!("in {}'s memory", placement.hot_device),
            Tier::Hot => "in host memory (no GPU)".into(),
            Tier::Ram => "in a RAM copy".into(),
            Tier::Mapped => "read from the model file".into(),
        };
        line += &format!(" {} {} ({}) {place},", t.name(), placement.experts[i], gib(placement.bytes[i]));
    }
    line.pop();
    crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
    let budget_note = match cfg.cache {
        _ if !cfg.hot_tier => "counting selections only".into(),
        CacheSize::Auto if moe::has_gpu() => {
            format!("auto: {dev} {} free of {}, --vram-reserve-mib {}, margin {}", gib(free), gib(total), cfg.vram_reserve_mib, gib(AUTO_MARGIN))
        }
        CacheSize::Auto => "auto: no GPU, no hot tier".into(),
        CacheSize::Experts(n) => format!("--expert-cache {n}"),
    };
    let hit_note = match &p.profile {
        Some(prof) => {
            let placed = || prof.ranked.iter().filter(|e| p.layout.layers.iter().any(|l| l.layer == e.layer));
            let all: u64 = placed().map(|e| e.hits).sum();
            let hot_hits: u64 = placed().take(placement.experts[Tier::Hot as usize] as usize).map(|e| e.hits).sum();
            format!("profile hit rate of the hot tier {:.2}%", 100.0 * hot_hits as f64 / all.max(1) as f64)
        }
        None if placement.experts[Tier::Hot as usize] == 0 => "no expert is hot".into(),
        None => "no --expert-profile: hot experts taken evenly per layer".into(),
    };
    if cfg.adapt_every > 0 && cfg.hot_tier {
        let policy = strata_residency::adapt::Policy::default();
        let line = match (placement.adapt_layers, &placement.adapt_off) {
            (0, why) => format!("experts: --adapt-every {}: no tiered layer can adapt ({})", cfg.adapt_every, why.as_deref().unwrap_or("no layer has both tiers")),
            (n, _) => format!(
                "experts: adapting {n} of {} tiered layers every {} batches from {}: at most {} swaps an interval, {} after each batch, through a {} staging buffer",
                p.layout.layers.len(),
                cfg.adapt_every,
                match (p.profile.is_some(), floor) {
                    (false, _) => "an even placement".to_string(),
                    (true, 0) => "the profile's placement".to_string(),
                    (true, f) => format!("the profile's placement with at least {f} per layer"),
                },
                policy.max_swaps,
                moe::adapt::SWAPS_PER_BATCH,
                if moe::has_gpu() { "page-locked" } else { "host" },
            ),
        };
        crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
    }
    let cpu = match (placement.workers, cfg.pcie_frac) {
        (0, f) if f > 0.0 => format!("the CPU backend's threads, {:.0}% of them uploaded (--pcie-frac)", 100.0 * f),
        (0, _) => "the CPU backend's threads".into(),
        (n, f) if f > 0.0 => format!("a pool of {n} worker{}, {:.0}% of them uploaded (--pcie-frac)", if n == 1 { "" } else { "s" }, 100.0 * f),
        (n, _) => format!("a pool of {n} worker{}", if n == 1 { "" } else { "s" }),
    };
    let decode = match (placement.zero_copy_layers, &placement.zero_copy_off) {
        (n, _) if n > 0 => format!(
            "read by {} from the page-locked RAM copy in {n} of {} tiered layers (zero-copy: one device graph a step, one mul_mat_id per matrix through tables of expert pointers; prompt batches and the rest on {cpu})",
            placement.hot_device,
            p.layout.layers.len(),
        ),
        (_, Some(why)) => format!("on {cpu} (zero-copy decode off: {why})"),
        _ => format!("on {cpu}"),
    };
    let msg = format!(
        "experts: {} of {n_pairs} in the hot tier ({budget_note}); {hit_note}; cold experts in decode {decode}; placed in {place_s:.1} s",
        placement.experts[Tier::Hot as usize]
    );
    crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &msg);
    match (&placement.ring, ring_half) {
        (Some(line), _) => crate::log::srv(strata_ffi::Verbosity::Info, "load_model", line),
        (None, 0) if cfg.hot_tier && cfg.ring_slots != Some(0) && !moe::has_gpu() => {
            crate::log::srv(strata_ffi::Verbosity::Info, "load_model", "prefill ring: off (no GPU): prompt batches compute their cold experts on the CPU")
        }
        (None, 0) if cfg.hot_tier && cfg.ring_slots.is_none() && cfg.cache == CacheSize::Auto && placement.experts[Tier::Hot as usize] < n_pairs => {
            let line = format!(
                "prefill ring: off ({:.0}% of the {} that the hot tier and the ring share is less than the ring's windows need): prompt batches compute their cold experts on the CPU",
                100.0 * plan::RING_MAX_SHARE,
                size(budget)
            );
            crate::log::srv(strata_ffi::Verbosity::Warn, "load_model", &line);
        }
        _ => {}
    }
    let facts =
        Facts { placement: &placement, cold, n_mapped_layers: mapped_layers, n_layers: p.layout.layers.len(), hit_note: &hit_note, gpu: moe::has_gpu() };
    for line in effect_lines(cfg, &facts) {
        crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
    }
    // The profile covers every layer of the file, so it serves with or without MTP drafting.
    let base = match (&cfg.profile, &cfg.record, &p.profile) {
        (Some(input), Some(out), Some(prof)) if same_file(input, out) => {
            let line = format!("--expert-profile-out {} is the --expert-profile read: this run's selections add to its {} tokens", out.display(), prof.tokens);
            crate::log::srv(strata_ffi::Verbosity::Info, "load_model", &line);
            prior(prof, p.layout.n_expert)
        }
        _ => Vec::new(),
    };
    let recorder =
        cfg.record.clone().map(|path| Recorder { path, model: model.clone(), sha256: p.sha256.clone().unwrap_or_default(), layout: full_layout, base });
    Ok(Residency { placement, totals: moe::hits(), last_step: [0; 3], recorder })
}

impl Residency {
    /// Records the selections of the decode step just made (cheap: atomics of each tiered layer).
    pub fn after_step(&mut self) {
        let now = moe::hits();
        self.last_step = std::array::from_fn(|i| now[i].saturating_sub(self.totals[i]));
        self.totals = now;
    }

    /// The `strata:*` lines appended to /metrics when experts are placed.
    pub fn metrics_text(&self) -> String {
        let st = self;
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, vals: [u64; 3]| {
            strata_family(&mut out, name, kind, help, "tier", Tier::ALL.iter().map(|&t| (t.name(), vals[t as usize])));
        };
        family("experts_resident", "gauge", "Experts placed in each tier", st.placement.experts);
        family("expert_bytes_resident", "gauge", "Bytes of the experts placed in each tier", st.placement.bytes);
        family("expert_selections_total", "counter", "Selected experts served from each tier", st.totals);
        family("expert_selections_last_step", "gauge", "Selected experts served from each tier in the last decode step", st.last_step);
        let uploads_help = "Cold experts copied to the GPU in decode instead of computed on the CPU (--pcie-frac)";
        strata_line(&mut out, "expert_uploads_total", "counter", uploads_help, moe::uploads());
        if let Some(a) = moe::adapt::counters() {
            strata_lines(
                &mut out,
                &[
                    ("expert_adapt_intervals_total", "counter", "Adaptation intervals ended (--adapt-every)", a.intervals),
                    ("expert_swaps_last_interval", "gauge", "Swaps between the hot tier and the RAM copy planned by the last interval", a.last_interval),
                    ("expert_swaps_pending", "gauge", "Planned swaps not yet made", a.pending),
                    ("expert_swaps_total", "counter", "Experts exchanged between the hot tier and the RAM copy", a.swaps),
                    ("expert_swap_bytes_total", "counter", "Bytes moved by expert swaps, both directions", a.bytes),
                ],
            );
            let help = "Time the host spent on expert swaps between batches: the copies (with the prefill ring's settling) and the map rewrites";
            strata_family(&mut out, "expert_swap_microseconds_total", "counter", help, "part", [("copies", a.copy_micros), ("maps", a.map_micros)]);
        }
        if let Some(r) = moe::ring_stats() {
            strata_lines(
                &mut out,
                &[
                    ("prefill_ring_h2d_bytes_total", "counter", "Bytes of cold experts copied host-to-device into the prefill ring", r.h2d_bytes),
                    ("prefill_ring_h2d_bytes_last_batch", "gauge", "Bytes copied into the prefill ring for the last prompt batch", r.h2d_bytes_last_batch),
                    ("prefill_ring_hits_total", "counter", "Used cold experts already in the ring (prefetched) when their layer ran", r.hits),
                    ("prefill_ring_fills_total", "counter", "Experts copied into ring slots", r.fills),
                    ("prefill_ring_staging_stalls_total", "counter", "Times a layer waited for its prefetch copies", r.stalls),
                    ("prefill_ring_batches_total", "counter", "Prompt batches that used the prefill ring", r.batches),
                    ("prefill_ring_waves_total", "counter", "Passes after a layer's first through the ring that computed cold experts", r.waves),
                ],
            );
        }
        out
    }

    /// After a request: with --expert-profile-out, rewrites the profile of the selections so far.
    pub fn request_done(&self) {
        let Some(r) = self.recorder.as_ref() else { return };
        if let Err(e) = write_profile(r) {
            crate::log::srv(strata_ffi::Verbosity::Error, "request_done", &e.to_string());
        }
    }
}

/// The profile's selections per expert, by layer: adaptation's prior.
fn prior(prof: &Profile, n_expert: u32) -> Vec<(i32, Vec<u64>)> {
    let mut out: Vec<(i32, Vec<u64>)> = Vec::new();
    for e in &prof.ranked {
        let i = match out.iter().position(|(l, _)| *l == e.layer as i32) {
            Some(i) => i,
            None => {
                out.push((e.layer as i32, vec![0; n_expert as usize]));
                out.len() - 1
            }
        };
        if let Some(h) = out[i].1.get_mut(e.expert as usize) {
            *h = e.hits;
        }
    }
    out
}

fn write_profile(r: &Recorder) -> Result<(), String> {
    let mut counts: Vec<(u32, Vec<u64>)> = moe::expert_counts(&r.model).into_iter().map(|(l, c)| (l as u32, c)).collect();
    for (layer, hits) in &r.base {
        match counts.iter_mut().find(|(l, _)| *l as i32 == *layer) {
            Some((_, c)) => c.iter_mut().zip(hits).for_each(|(c, h)| *c += h),
            None => counts.push((*layer as u32, hits.clone())),
        }
    }
    // A layer llama.cpp did not load (MTP without drafting) ran nothing: zero counts, so the
    // profile still covers every layer of the file.
    for l in &r.layout.layers {
        if !counts.iter().any(|(layer, _)| *layer == l.layer) {
            counts.push((l.layer, vec![0; r.layout.n_expert as usize]));
        }
    }
    counts.sort_by_key(|(l, _)| *l);
    let n_used = u64::from(r.layout.n_expert_used.max(1));
    let tokens = counts.first().map_or(0, |(_, c)| c.iter().sum::<u64>() / n_used);
    let prof = Profile::from_counts(
        &r.sha256,
        &r.layout.arch,
        r.layout.n_layer,
        r.layout.n_expert,
        r.layout.n_expert_used,
        tokens,
        "strata-server --expert-profile-out",
        &counts,
    );
    let tmp = r.path.with_extension("tmp");
    std::fs::write(&tmp, prof.to_json()).and_then(|_| std::fs::rename(&tmp, &r.path)).map_err(|e| format!("--expert-profile-out {}: {e}", r.path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> StrataArgs {
        let argv: Vec<String> = std::iter::once("strata-server").chain(v.iter().copied()).map(String::from).collect();
        crate::cli::flags::split(&argv).unwrap().0
    }

    /// A cgroup-v2 fixture with `avail_gib` available.
    fn report(avail_gib: u64) -> memguard::Report {
        let root = std::env::temp_dir().join(format!("strata-copy-kind-{}-{avail_gib}", std::process::id()));
        std::fs::create_dir_all(root.join("proc/self")).unwrap();
        std::fs::create_dir_all(root.join("sys/fs/cgroup")).unwrap();
        std::fs::write(root.join("proc/self/cgroup"), "0::/\n").unwrap();
        std::fs::write(root.join("proc/self/mountinfo"), "30 25 0:26 / /sys/fs/cgroup rw,relatime shared:4 - cgroup2 cgroup2 rw\n").unwrap();
        let kib = avail_gib << 20;
        std::fs::write(root.join("proc/meminfo"), format!("MemTotal: {kib} kB\nMemAvailable: {kib} kB\n")).unwrap();
        let r = memguard::measure(&root).unwrap();
        let _ = std::fs::remove_dir_all(&root);
        r
    }

    #[test]
    fn a_ram_copy_on_a_gpu_is_page_locked_and_the_guard_sizes_it() {
        let (kind, line) = copy_kind(ColdCopy::Ram, true, 0.0);
        assert_eq!(kind, ColdCopy::PinnedRam);
        assert!(line.unwrap().contains("page-locked on the GPU's host: decode reads cold experts over the bus"));
        let (kind, line) = copy_kind(ColdCopy::Ram, true, 0.25);
        assert_eq!(kind, ColdCopy::Ram, "--pcie-frac's uploads are the CPU path's");
        assert!(line.unwrap().contains("--pcie-frac"));
        assert_eq!(copy_kind(ColdCopy::Ram, false, 0.0), (ColdCopy::Ram, None), "no GPU: nothing reads it over a bus");
        assert_eq!(copy_kind(ColdCopy::PinnedRam, true, 0.0), (ColdCopy::PinnedRam, None));
        assert_eq!(copy_kind(ColdCopy::Mapped, true, 0.0), (ColdCopy::Mapped, None));
        // 30 GiB available: a page-locked copy keeps 12 GiB of headroom, a pageable one 8
        let gib = 1u64 << 30;
        let r = report(30);
        assert_eq!((r.allowance(CopyKind::PageLocked), r.allowance(CopyKind::Pageable)), (18 * gib, 22 * gib));
        assert_eq!(report(4).allowance(CopyKind::Pageable), 0);
        let split = plan::RamSplit { copied: 18 * gib, mapped: vec![3, 7] };
        let line = ram_rule_line("--resident-cpu-experts", CopyKind::PageLocked, (18 * gib, 20 * gib), 8, &split, true, true);
        assert!(line.contains("admits 18.00 GiB of the 20.00 GiB page-locked RAM copy: 6 of 8 layers copied (18.00 GiB)"), "{line}");
        assert!(line.contains("the cold experts of layers 3, 7 are read from the model file"), "{line}");
    }

    #[test]
    fn no_expert_flag_leaves_llama_cpp_alone() {
        assert_eq!(ExpertConfig::from_args(&args(&["--pool-workers", "4"]), &Settings::default()).unwrap(), None);
    }

    #[test]
    fn flags_parse_and_resident_needs_a_profile() {
        let c = ExpertConfig::from_args(
            &args(&["--mmap-experts", "--expert-cache", "100", "--pool-workers", "15", "--vram-reserve-mib", "1024"]),
            &Settings::default(),
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.cache, CacheSize::Experts(100));
        assert_eq!((c.pool_workers, c.vram_reserve_mib), (15, 1024));
        let e = ExpertConfig::from_args(&args(&["--resident-cpu-experts"]), &Settings::default()).unwrap_err();
        assert!(e.contains("--expert-profile"), "{e}");
        let c = ExpertConfig::from_args(&args(&["--resident-cpu-experts", "--adapt-every", "8"]), &Settings::default()).unwrap().unwrap();
        assert_eq!(c.adapt_every, 8);
        assert!(
            ExpertConfig::from_args(&args(&["--resident-cpu-experts", "--adapt-every", "0"]), &Settings::default()).is_err(),
            "0 is off: a profile is needed"
        );
        let e = ExpertConfig::from_args(&args(&["--mmap-experts", "--adapt-every", "8"]), &Settings::default()).unwrap_err();
        assert!(e.contains("--adapt-every") && e.contains("--resident-experts"), "{e}");
        let c = ExpertConfig::from_args(&args(&["--resident-experts", "--expert-profile", "p.json"]), &Settings::default()).unwrap().unwrap();
        assert!(c.resident_cpu && c.pinned);
    }
}
