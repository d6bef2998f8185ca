//! Placement: the hot tier's device and `place`, which allocates
//! and fills the tiers of a plan and registers each layer with the MoE hook.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, AtomicU8, Ordering};
use std::sync::Arc;

use super::decode::ZERO_COPY;
use super::layer::{Hot, LayerTiers, Staging};
use super::prefill::{self, COLD_MIN_WORKERS};
use super::registry::{REGISTRY, RINGS};
use super::tensors::{copy_experts, copy_map_of, expert_layers, expert_tensors, hot_map_of, set_map, set_mask, zero_expert, Alloc, Owned};
use super::types::{Activation, ColdCopy, ColdMat, CpuTraits, Mats, PlaceError, Placement, Plan, Tally, Tier, T};
use super::{adapt, pool, ring, zero_copy};
use crate::model::Model;
use crate::sys;

/// The device for the hot tier: the `main_gpu`-th GPU, or the CPU when there is none.
pub(crate) fn hot_device(main_gpu: usize) -> sys::ggml_backend_dev_t {
    let mut gpus = Vec::new();
    // SAFETY: enumerating registered devices has no preconditions.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let d = sys::ggml_backend_dev_get(i);
            if sys::ggml_backend_dev_type(d) == sys::GGML_BACKEND_DEVICE_TYPE_GPU {
                gpus.push(d);
            }
        }
        gpus.get(main_gpu).or(gpus.first()).copied().unwrap_or_else(|| sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU))
    }
}

/// (free, total) bytes of the device that would hold the hot tier.
pub fn hot_device_memory(main_gpu: usize) -> (u64, u64, String) {
    let d = hot_device(main_gpu);
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid device and out pointers.
    let name = unsafe {
        sys::ggml_backend_dev_memory(d, &mut free, &mut total);
        std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(d)).to_string_lossy().into_owned()
    };
    (free as u64, total as u64, name)
}

/// Bytes the context `ctx` holds on the hot tier's device: the model's weights there, its
/// memory (KV cache, recurrent state, outputs) and its compute buffers.
pub fn hot_device_use(ctx: &mut crate::Context<'_>, main_gpu: usize) -> Option<[u64; 3]> {
    let (mut m, mut c, mut k) = (0usize, 0usize, 0usize);
    // SAFETY: a live context; the shim catches llama.cpp's exceptions.
    let rc = unsafe { sys::strata_device_memory(ctx.as_ptr(), hot_device(main_gpu), &mut m, &mut c, &mut k) };
    (rc == 0).then_some([m as u64, c as u64, k as u64])
}

/// Whether the hot tier would live in device memory (a GPU is present).
pub fn has_gpu() -> bool {
    // SAFETY: no preconditions.
    unsafe { sys::ggml_backend_dev_type(hot_device(0)) == sys::GGML_BACKEND_DEVICE_TYPE_GPU }
}

pub(crate) fn type_name(ty: sys::ggml_type) -> String {
    // SAFETY: returns a static string for any type.
    unsafe { std::ffi::CStr::from_ptr(sys::ggml_type_name(ty)).to_string_lossy().into_owned() }
}

/// The batch size from which the cold tier's mul_mat_id pass gives one expert per column. Its
/// map repeats an id within a token (the pad row, the stand-in), which the grouped CUDA/HIP
/// kernels do not allow; their vector kernels (always used below 4 tokens for quantized
/// weights) and the CPU do. `flat_ids` flattens every batch (tests of that graph).
pub(crate) fn flat_from(gpu: bool, quantized: bool, flat_ids: bool) -> i64 {
    if flat_ids {
        return 1;
    }
    match (gpu, quantized) {
        (false, _) => i64::MAX,
        (true, true) => 4,
        (true, false) => 1,
    }
}

/// A layer's ring tensors: its windows, the hot tensors within them, and (for passes in waves)
/// tensors over the other half of the ring.
type Windows = (Mats<T>, Mats<T>, Option<Mats<T>>);
/// Per matrix: the window, hot and other-half tensors.
type WindowParts = (T, T, Option<T>);

/// Allocates a layer's windows: per matrix, `head_slots` experts of its own (hot experts, then
/// pads) followed by the ring. Returns the window tensors ([head_slots + ring slots]), the hot
/// tensors over their first `head_slots` experts, and with `other` tensors over the ring's other
/// half alone.
fn windows(r: &ring::Ring, src: &Mats<T>, head_slots: usize, half: usize, il: &i32, other: bool, owned: &mut Owned) -> Result<Windows, PlaceError> {
    let a = Alloc::new(12);
    owned.ctxs.push(a.ctx);
    let mut kind = 0usize;
    let mut err = None;
    let pair = |t: T| -> Option<WindowParts> {
        let m = kind;
        kind += 1;
        // SAFETY: t is a live 3-d model tensor.
        let nb2 = unsafe { (*t).nb[2] };
        let head = head_slots * nb2;
        let ring_bytes = r.ring_bytes(m).unwrap_or(half * nb2);
        // A device ring has a spare slot (Ring::new_device) that covers the row padding quantized
        // tensors are allocated with; the slots the window addresses stop before it.
        let ring_slots = if r.emulated { half } else { ring_bytes / nb2 - 1 };
        let Some(mem) = r.window(m, r.next_index(), head, ring_bytes) else {
            err = Some(PlaceError::Alloc {
                what: format!("layer {il} expert window"),
                bytes: (head + ring_bytes) as u64,
                device: "the hot tier's device".into(),
            });
            return None;
        };
        let buf = match mem {
            ring::WindowMem::Device(b) | ring::WindowMem::Host(b) => b,
        };
        owned.bufs.push(buf);
        let win = a.like(t, head_slots + ring_slots, &format!("blk.{il}.exps.window"));
        let hot = a.like(t, head_slots, &format!("blk.{il}.exps.hot"));
        let alloc_err = || PlaceError::Alloc {
            what: format!("layer {il} expert window tensors"),
            bytes: (head + ring_bytes) as u64,
            device: "the hot tier's device".into(),
        };
        // SAFETY: buf holds head + ring_bytes bytes from its base; both tensors start there and fit.
        unsafe {
            sys::ggml_backend_buffer_set_usage(buf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            let base = sys::ggml_backend_buffer_get_base(buf);
            if sys::ggml_backend_tensor_alloc(buf, win, base) != sys::GGML_STATUS_SUCCESS
                || sys::ggml_backend_tensor_alloc(buf, hot, base) != sys::GGML_STATUS_SUCCESS
            {
                err = Some(alloc_err());
                return None;
            }
        }
        // The other half alone: a window with no head of its own.
        let rest = if other {
            let Some(ring::WindowMem::Device(b) | ring::WindowMem::Host(b)) = r.window(m, r.next_index() + 1, 0, ring_bytes) else {
                err = Some(alloc_err());
                return None;
            };
            owned.bufs.push(b);
            let t = a.like(t, ring_slots, &format!("blk.{il}.exps.ring_other"));
            // SAFETY: b holds ring_bytes bytes from its base; the tensor fits.
            unsafe {
                sys::ggml_backend_buffer_set_usage(b, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
                if sys::ggml_backend_tensor_alloc(b, t, sys::ggml_backend_buffer_get_base(b)) != sys::GGML_STATUS_SUCCESS {
                    err = Some(alloc_err());
                    return None;
                }
            }
            Some(t)
        } else {
            None
        };
        Some((win, hot, rest))
    };
    let parts = src.map(pair);
    match (parts, err) {
        (Some(p), None) => {
            let rest = other.then(|| p.map(|(_, _, o)| o)).flatten();
            let part = |f: fn(&WindowParts) -> T| p.map(|x| Some(f(&x))).expect("infallible");
            Ok((part(|x| x.0), part(|x| x.1), rest))
        }
        (_, Some(e)) => Err(e),
        (None, None) => Err(PlaceError::Alloc { what: format!("layer {il} expert window"), bytes: 0, device: "the hot tier's device".into() }),
    }
}

/// Starts the ring's copier, measures the copy and CPU rates that the cost model compares, and
/// returns the start-up log line.
fn start_ring(
    r: &Arc<ring::Ring>,
    entries: &[(usize, Arc<LayerTiers>)],
    dev: sys::ggml_backend_dev_t,
    gpu: bool,
    plan: &Plan,
    expert_bytes: usize,
) -> Result<String, PlaceError> {
    let n_layers = entries.iter().filter(|(_, lt)| lt.ring.is_some()).count();
    let staging_buft = if gpu {
        // SAFETY: valid device; NULL when it has no page-locked host memory.
        let b = unsafe { sys::ggml_backend_dev_host_buffer_type(dev) };
        (!b.is_null()).then_some(b)
    } else {
        // SAFETY: the CPU device exists whenever the CPU backend is loaded.
        Some(unsafe { sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU)) })
    };
    let pace = match plan.lab.ring_copy_pace {
        Some(0) => None,
        Some(b) => Some(b),
        None => (!r.emulated).then_some(ring::DEVICE_PACE),
    };
    let no_copier = r.start(staging_buft, expert_bytes, pace, plan.lab.ring_prefetch_min_p, plan.lab.ring_fault).map_err(|e| PlaceError::Alloc {
        what: e,
        bytes: 0,
        device: "host".into(),
    })?;
    let copy = r.measure_copy(64);
    let workers = plan.cold_threads.max(COLD_MIN_WORKERS) as f64;
    let ringed = entries.iter().map(|(_, lt)| lt).find(|lt| lt.ring.is_some());
    let cpu = ringed.and_then(|lt| prefill::measure_cpu(lt, 16));
    let source = match plan.cold {
        ColdCopy::PinnedRam if plan.mapped.is_empty() => "straight from the page-locked RAM copy",
        ColdCopy::PinnedRam => {
            "straight from the page-locked RAM copy, and through a page-locked staging buffer from the file mapping for the layers it leaves there"
        }
        ColdCopy::Ram if plan.mapped.is_empty() => "through a page-locked staging buffer from the RAM copy",
        ColdCopy::Ram => "through a page-locked staging buffer from the RAM copy and, for the layers it leaves there, the file mapping",
        ColdCopy::Mapped => "through a page-locked staging buffer from the file mapping",
    };
    let what = if r.emulated {
        "emulated on the CPU (STRATA_LAB=emulate-ring)".to_string()
    } else {
        format!("{:.2} GiB on the device", r.bytes as f64 / (1u64 << 30) as f64)
    };
    let mut line =
        format!("prefill ring: {} slots in two halves ({what}), {n_layers} of {} tiered layers windowed, copies {source}", 2 * r.half, entries.len());
    if let (Some(c), Some(p)) = (copy, cpu) {
        let handoff = (2 * ringed.map_or(0, |lt| lt.n_embd) * std::mem::size_of::<f32>()) as f64;
        let model = ring::CostModel { copy_bytes_per_s: c, cpu_pairs_per_s: p * workers, expert_bytes: expert_bytes as f64, handoff_bytes_per_token: handoff };
        *r.cost.lock().unwrap_or_else(|e| e.into_inner()) = Some(model);
        line += &format!(
            "; cost model: copy {:.1} GB/s, CPU {:.0} cold pairs/s ({:.0} per thread x {workers}), {handoff:.0} bytes a token to the CPU and back; a prompt batch takes the ring when copying its expected cold experts is quicker than moving its hidden states to the CPU and computing its cold pairs there",
            c / 1e9,
            p * workers,
            p
        );
    } else {
        line += "; cost model not measured (no cold expert to time): prompt batches always take the ring";
    }
    line += &format!("; prefetch: cold experts used with a chance of at least {}", r.prefetch_min_p());
    line += &match pace {
        Some(b) => format!("; copies paced, {} KiB at a time", b >> 10),
        None => "; copies unpaced".to_string(),
    };
    if r.emulated {
        line += "; emulated, every prompt batch takes it";
    }
    if let Some(why) = no_copier {
        line += &format!("; {why}");
    }
    Ok(line)
}

/// Places `plan` on `model`: allocates and fills the hot tier (and the RAM copy), registers the
/// layers with the MoE hook. Layers without an entry in the plan are left to llama.cpp. Call
/// before the first graph that should use the tiers is built, with Strata's hooks installed
/// (crate::install_hooks) before the model was loaded.
pub fn place(model: &Model, plan: &Plan, main_gpu: usize) -> Result<Placement, PlaceError> {
    if !crate::hooks::installed() {
        return Err(PlaceError::NoHooks);
    }
    if REGISTRY.read().is_ok_and(|r| r.as_ref().is_some_and(|m| m.values().any(|lt| lt.model == model.as_ptr() as usize))) {
        return Err(PlaceError::Placed);
    }
    let layers = expert_layers(model);
    let dev = hot_device(main_gpu);
    // SAFETY: valid device.
    let gpu = unsafe { sys::ggml_backend_dev_type(dev) == sys::GGML_BACKEND_DEVICE_TYPE_GPU };
    let workers = if plan.cold_threads > 0 && !plan.count_only { pool::get(plan.cold_threads as usize).workers() } else { 0 };
    // SAFETY: valid device.
    let (hot_buft, dev_name) =
        unsafe { (sys::ggml_backend_dev_buffer_type(dev), std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(dev)).to_string_lossy().into_owned()) };
    let cold_buft = match plan.cold {
        ColdCopy::Mapped => None,
        // SAFETY: the CPU device exists whenever the CPU backend is loaded.
        ColdCopy::Ram => Some(unsafe { sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU)) }),
        ColdCopy::PinnedRam => {
            // SAFETY: valid device; NULL when it has no pinned host memory.
            let b = unsafe { sys::ggml_backend_dev_host_buffer_type(dev) };
            if b.is_null() {
                return Err(PlaceError::Alloc { what: "page-locked RAM copy".into(), bytes: 0, device: dev_name });
            }
            Some(b)
        }
    };
    let mut placement = Placement { hot_device: dev_name.clone(), workers, ..Default::default() };
    let emulate = plan.lab.emulate_ring;
    let trace = plan.lab.ring_trace.as_deref();
    let ring = if plan.ring_half > 0 && !plan.count_only && (gpu || emulate) {
        // One ring per matrix kind, as large as the widest layer's experts of that kind.
        let mut max_nb2: Vec<usize> = Vec::new();
        for (il, _) in &plan.hot {
            if let Some(m) = expert_tensors(model.as_ptr(), *il) {
                // SAFETY: live model tensors.
                let nb2: Vec<usize> = m.iter().map(|t| unsafe { (*t).nb[2] }).collect();
                if max_nb2.is_empty() {
                    max_nb2 = nb2;
                } else if max_nb2.len() == nb2.len() {
                    max_nb2.iter_mut().zip(nb2).for_each(|(a, b)| *a = (*a).max(b));
                }
            }
        }
        // layers left in the mapping copy through the staging buffer; the others straight
        let pinned = plan.cold == ColdCopy::PinnedRam && plan.mapped.is_empty();
        if !gpu {
            Some(ring::Ring::new_emulated(plan.ring_half, pinned, trace))
        } else {
            let r = ring::Ring::new_device(dev, plan.ring_half, &max_nb2, pinned, trace);
            if r.is_none() {
                placement.ring = Some(format!("prefill ring: off ({dev_name} has no expert windows: patches/0002 missing, no virtual memory management, or too little memory for {} slots)", 2 * plan.ring_half));
            }
            r
        }
    } else {
        None
    };
    // Decode reads cold experts over the bus wherever the GPU can address them: a page-locked
    // RAM copy. Elsewhere the CPU computes them (on a GPU machine, measured slower than reading
    // them: 111 against 149 t/s on an H100 at 24 GiB).
    let zero_copy_wanted =
        !plan.count_only && plan.cold != ColdCopy::Mapped && (if gpu { plan.cold == ColdCopy::PinnedRam } else { plan.lab.zero_copy_on_cpu });
    if gpu && !plan.count_only && plan.cold != ColdCopy::PinnedRam {
        placement.zero_copy_off = Some("the cold experts are not a page-locked copy (--resident-experts)".into());
    }
    let mut max_expert_bytes = 0usize;
    let mut entries = Vec::new();
    for (il, hot_ids) in &plan.hot {
        let info = layers.iter().find(|l| l.layer == *il).ok_or(PlaceError::NoLayer(*il))?;
        if !info.host && !plan.count_only {
            return Err(PlaceError::NotHost { layer: *il, buffer: info.buffer.clone() });
        }
        let src = expert_tensors(model.as_ptr(), *il).ok_or(PlaceError::NoLayer(*il))?;
        let n_expert = info.n_expert;
        let mut slot_of = vec![-1i32; n_expert];
        for (slot, &e) in hot_ids.iter().enumerate() {
            let cell = slot_of.get_mut(e as usize).ok_or(PlaceError::ExpertRange { layer: *il, expert: e, n_expert })?;
            *cell = slot as i32;
        }
        let hot_list: Vec<usize> = slot_of.iter().enumerate().filter(|(_, s)| **s >= 0).map(|(e, _)| e).collect();
        let n_hot = hot_list.len();
        let cold_list: Vec<usize> = slot_of.iter().enumerate().filter(|(_, s)| **s < 0).map(|(e, _)| e).collect();
        let mut owned = Owned::default();

        // SAFETY: live tensor.
        let quantized = src.down.is_some_and(|t| unsafe { sys::ggml_is_quantized((*t).type_) });
        // The GPU's vector kernels skip ids only for quantized weights.
        let in_mapping = plan.mapped.contains(il);
        let zc_wanted = zero_copy_wanted && !in_mapping && (quantized || !gpu);
        // A layer without cold experts still gets a RAM copy (its zero pad) where decode reads
        // through the mapping: its routing log lives there, so counting needs no CPU op in a step.
        let copy = cold_buft.filter(|_| !in_mapping && (!cold_list.is_empty() || zc_wanted));
        let zc_layer = zc_wanted && copy.is_some();
        // Device side: the hot experts plus a zero pad expert, and the expert -> slot maps.
        let a = Alloc::new(12);
        let n_used = plan.n_used.max(1);
        let n_cold = cold_list.len();
        // With the ring, the hot experts and pads live in windows: [hot | pads | ring] per matrix.
        let windowed = ring.as_ref().filter(|_| n_cold > 0 && (copy.is_some() || info.host));
        // Passes in waves need the backend to skip ids of -1: the CPU's kernels do, a GPU's
        // only for quantized experts (patches/0005).
        let max_passes = if quantized || !gpu { plan.lab.ring_waves.unwrap_or(ring::DEFAULT_PASSES).clamp(1, ring::MAX_PASSES) } else { 1 };
        let (mut window, mut ring_other) = (None, None);
        let hot_mats = match windowed {
            Some(r) => {
                let (w, h, o) = windows(r, &src, n_hot + n_used, plan.ring_half, il, max_passes > 1, &mut owned)?;
                (window, ring_other) = (Some(w), o);
                (n_hot > 0).then_some(h)
            }
            None => (n_hot > 0).then(|| src.map(|t| Some(a.like(t, n_hot + n_used, &format!("blk.{il}.exps.hot")))).expect("infallible")),
        };
        let hot_map = hot_mats.as_ref().map(|_| a.map_per_position(n_expert, n_used, &format!("blk.{il}.exps.hot_map")));
        let mapped_cold = copy.is_none() && !cold_list.is_empty() && !plan.count_only;
        let cold_map = (copy.is_some() || mapped_cold).then(|| a.map(n_expert, &format!("blk.{il}.exps.cold_map")));
        let cold_mask = mapped_cold.then(|| a.mask(n_expert, &format!("blk.{il}.exps.cold_mask")));
        let cold_share_prior = plan.cold_share.iter().find(|(l, _)| l == il).map_or(n_cold as f64 / n_expert as f64, |&(_, c)| c);
        let tables = zc_layer.then(|| src.map(|_| Some(a.table(n_expert, &format!("blk.{il}.exps.table")))).expect("infallible"));
        let staging_mats = (plan.pcie_frac > 0.0 && !cold_list.is_empty() && !plan.count_only)
            .then(|| src.map(|t| Some(a.like(t, 2 * n_used, &format!("blk.{il}.exps.staging")))).expect("infallible"));
        if hot_map.is_some() || cold_map.is_some() || staging_mats.is_some() || (windowed.is_none() && hot_mats.is_some()) {
            a.commit(hot_buft, &mut owned, &format!("layer {il} hot experts"))?;
        } else {
            owned.ctxs.push(a.ctx);
        }
        // Host side: the RAM copy of the cold experts plus a zero pad expert.
        let mut log = None;
        let copy_mats = copy.map(|buft| -> Result<Mats<T>, PlaceError> {
            let a = Alloc::new(6);
            let mats = src.map(|t| Some(a.like(t, n_cold + 1, &format!("blk.{il}.exps.cold")))).expect("infallible");
            log = zc_layer.then(|| zero_copy::log_tensor(&a, n_used, *il));
            a.commit(buft, &mut owned, &format!("layer {il} RAM copy of cold experts"))?;
            Ok(mats)
        });
        let copy_mats = copy_mats.transpose()?;
        let zero_copy = match (copy_mats.as_ref(), log, tables) {
            (Some(m), Some(log), Some(tables)) => match zero_copy::ZeroCopy::new(dev, gpu, m, log, (&src, tables, n_expert), *il, &mut owned) {
                Ok(z) => Some(z),
                Err(e) => {
                    placement.zero_copy_off.get_or_insert(e);
                    None
                }
            },
            _ => None,
        };

        let mut hot_slots = vec![-1i32; n_expert];
        for (slot, &e) in hot_list.iter().enumerate() {
            hot_slots[e] = slot as i32;
        }
        let hot = match (hot_mats, hot_map) {
            (Some(mats), Some(map)) => {
                copy_experts(&src, &mats, &hot_list);
                (0..n_used).for_each(|j| mats.iter().for_each(|d| zero_expert(d, n_hot + j)));
                set_map(map, &hot_map_of(&hot_slots, n_hot, n_used));
                Some(Hot { mats, map })
            }
            _ => None,
        };
        let staging = staging_mats.map(|mats| {
            (n_used..2 * n_used).for_each(|j| mats.iter().for_each(|d| zero_expert(d, j)));
            Staging { mats, slots: n_used }
        });
        let mut cold_rows = vec![-1i32; n_expert];
        let ram_copy = copy_mats.is_some() && cold_map.is_some();
        let (cold_tensors, cold_tier) = match (copy_mats, cold_map) {
            (Some(mats), Some(map)) => {
                for (row, &e) in cold_list.iter().enumerate() {
                    cold_rows[e] = row as i32;
                }
                copy_experts(&src, &mats, &cold_list);
                mats.iter().for_each(|d| zero_expert(d, n_cold));
                set_map(map, &copy_map_of(&cold_rows, n_cold));
                (mats, Tier::Ram)
            }
            (_, map) => {
                for &e in &cold_list {
                    cold_rows[e] = e as i32;
                }
                if let (Some(map), Some(mask)) = (map, cold_mask) {
                    let listed = plan.stand_in.iter().find(|(l, _)| l == il).map(|&(_, e)| e as usize);
                    let stand_in = listed.filter(|&e| cold_rows.get(e).is_some_and(|&r| r >= 0)).unwrap_or(cold_list[0]);
                    let rows: Vec<i32> = cold_rows.iter().map(|&r| if r >= 0 { r } else { stand_in as i32 }).collect();
                    let keep: Vec<f32> = cold_rows.iter().map(|&r| if r >= 0 { 1.0 } else { 0.0 }).collect();
                    set_map(map, &rows);
                    set_mask(mask, &keep);
                }
                (src, if info.buffer.contains("Mapped") { Tier::Mapped } else { Tier::Ram })
            }
        };
        let cold = cold_tensors
            .map(|t| {
                // SAFETY: live tensor in a host buffer.
                let (ty, data, nb1, nb2) = unsafe { ((*t).type_, (*t).data as *const u8, (*t).nb[1], (*t).nb[2]) };
                Some(ColdMat { data, nb1, nb2, traits: CpuTraits::of(ty)? })
            })
            .ok_or_else(|| {
                // SAFETY: live tensor.
                let ty = unsafe { (*src.down.expect("down")).type_ };
                PlaceError::NoCpuKernels(type_name(ty))
            })?;

        placement.experts[Tier::Hot as usize] += n_hot as u64;
        placement.bytes[Tier::Hot as usize] += (n_hot * info.expert_bytes) as u64;
        placement.experts[cold_tier as usize] += cold_list.len() as u64;
        placement.bytes[cold_tier as usize] += (cold_list.len() * info.expert_bytes) as u64;
        let key = src.down.map_or(0, |t| t as usize);
        placement.zero_copy_layers += usize::from(zero_copy.is_some());
        if zero_copy.is_some() {
            ZERO_COPY.store(true, Ordering::Relaxed);
        }
        let tally = Arc::new(Tally::new(n_expert));
        let ring_entry = match (windowed, window.as_ref()) {
            (Some(r), Some(w)) => {
                // SAFETY: live tensors: the cold source (RAM copy or mapping) and the windows.
                let (srcs, dsts) = unsafe {
                    let srcs: Vec<(usize, usize)> = cold_tensors.iter().map(|t| ((*t).data as usize, (*t).nb[2])).collect();
                    let dsts: Vec<usize> = w.iter().map(|t| (*t).data as usize + (n_hot + n_used) * (*t).nb[2]).collect();
                    let others: Vec<usize> = ring_other.iter().flat_map(Mats::iter).map(|t| (*t).data as usize).collect();
                    (srcs, [dsts, others])
                };
                max_expert_bytes = max_expert_bytes.max(info.expert_bytes);
                let direct = plan.cold == ColdCopy::PinnedRam && ram_copy;
                let idx =
                    r.register(ring::RingLayer::new(n_hot + n_used, srcs, dsts, cold_rows.clone(), hot_slots.clone(), tally.clone(), n_used).direct(direct));
                Some((r.clone(), idx))
            }
            _ => None,
        };
        entries.push((
            key,
            Arc::new(LayerTiers {
                model: model.as_ptr() as usize,
                layer: *il,
                n_embd: info.n_embd,
                n_ff: info.n_ff,
                activation: AtomicU8::new(Activation::Silu as u8),
                hot,
                cold_tensors,
                cold,
                cold_rows: cold_rows.into_iter().map(AtomicI32::new).collect(),
                hot_slots: std::sync::Mutex::new(hot_slots),
                n_hot,
                ram_copy,
                cold_map,
                cold_mask,
                cold_tier,
                n_cold: cold_list.len(),
                cold_threads: plan.cold_threads,
                count_only: plan.count_only,
                flat_from: flat_from(gpu, quantized, plan.lab.flat_ids),
                n_used,
                cold_share_prior,
                staging,
                pcie_frac: plan.pcie_frac,
                tally,
                window,
                ring: ring_entry,
                ring_other,
                max_passes,
                passes: std::sync::atomic::AtomicUsize::new(1),
                zero_copy,
                _owned: owned,
            }),
        ));
        if let Some((_, lt)) = entries.last() {
            lt.write_decode_maps();
        }
    }
    if let Some(a) = plan.adapt.as_ref().filter(|a| a.every > 0 && !plan.count_only) {
        let layers: Vec<Arc<LayerTiers>> = entries.iter().map(|(_, lt)| lt.clone()).collect();
        (placement.adapt_layers, placement.adapt_off) = adapt::start(model.as_ptr() as usize, a, &layers, dev, gpu, plan.cold == ColdCopy::PinnedRam)?;
    }
    if let Some(r) = ring.as_ref().filter(|_| !entries.iter().any(|(_, lt)| lt.ring.is_some())) {
        placement.ring = Some(format!("prefill ring: off (no tiered layer's cold experts fit a half of the {} slots)", 2 * r.half));
    } else if let Some(r) = ring.as_ref() {
        placement.ring = Some(start_ring(r, &entries, dev, gpu, plan, max_expert_bytes)?);
        RINGS.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(r));
    }
    crate::decode_scope::guard(model.as_ptr() as usize);
    let mut r = REGISTRY.write().expect("registry poisoned");
    let map = r.get_or_insert_with(HashMap::new);
    for (key, lt) in entries {
        map.insert(key, lt);
    }
    Ok(placement)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Graphs of the model's contexts point at the tiers placed first; placing again would free
    /// them under those graphs, so it is refused and the first placement stays.
    #[test]
    fn a_model_is_placed_once() {
        let dir = std::env::var_os("STRATA_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/models"));
        let path = dir.join("tiny-qwen3moe.gguf");
        assert!(path.is_file(), "{} is missing: run tools/setup", path.display());
        crate::install_hooks().expect("hooks");
        let model = Model::load(&path, &crate::ModelParams::default()).expect("model");
        let n_used: usize = model.meta("qwen3moe.expert_used_count").unwrap().parse().unwrap();
        let plan = Plan {
            hot: expert_layers(&model).into_iter().map(|l| (l.layer, vec![0, 1, 2, 3])).collect(),
            cold: ColdCopy::Mapped,
            mapped: Vec::new(),
            cold_threads: 0,
            count_only: false,
            stand_in: Vec::new(),
            n_used,
            cold_share: Vec::new(),
            pcie_frac: 0.0,
            ring_half: 0,
            adapt: None,
            lab: Default::default(),
        };
        let first = place(&model, &plan, 0).expect("first placement");
        assert_eq!(first.experts[Tier::Hot as usize], 4 * plan.hot.len() as u64);
        let again = place(&model, &plan, 0).expect_err("a second placement");
        assert!(matches!(again, PlaceError::Placed), "{again}");
        let keys = || REGISTRY.read().unwrap().as_ref().map_or(0, |m| m.values().filter(|lt| lt.model == model.as_ptr() as usize).count());
        assert_eq!(keys(), plan.hot.len(), "the first placement's layers stay registered");
    }

    /// llama.cpp's accounting of a context's buffers on the hot tier's device (here the CPU):
    /// the compute buffer grows with the batch.
    #[test]
    fn a_context_reports_its_weights_memory_and_compute_buffers() {
        let dir = std::env::var_os("STRATA_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/models"));
        let model = Model::load(&dir.join("tiny-qwen3moe.gguf"), &crate::ModelParams::default()).expect("model");
        let use_at = |n_batch: u32| {
            let mut ctx = crate::Context::new(&model, crate::ContextParams::default().with_n_ctx(4096).with_n_batch(n_batch)).expect("context");
            hot_device_use(&mut ctx, 0).expect("breakdown")
        };
        let [weights, memory, small] = use_at(64);
        assert!(weights > 0 && memory > 0 && small > 0, "{weights} {memory} {small}");
        let [_, _, large] = use_at(2048);
        assert!(large > small, "compute buffers: {small} at 64 tokens a batch, {large} at 2048");
    }

    #[test]
    fn the_flat_pass_starts_where_grouped_gpu_kernels_would_see_a_repeated_id() {
        assert_eq!(flat_from(false, true, false), i64::MAX, "the CPU takes repeated ids");
        assert_eq!(flat_from(true, true, false), 4, "quantized: vector kernels below 4 tokens");
        assert_eq!(flat_from(true, false, false), 1);
        assert_eq!(flat_from(false, true, true), 1, "STRATA_LAB=flat-ids");
    }
}
