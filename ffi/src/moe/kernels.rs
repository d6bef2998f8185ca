//! The cold tier's CPU kernels: ggml custom ops that compute only the selected experts that
//! are not in the hot tier, with the CPU backend's own quantize and dot-product routines, so a
//! cold expert gives what the CPU backend's mul_mat_id would give for it.
//!
//! Op A (`gate_up`) writes act(gate·x) * (up·x) for each cold (token, slot). Op B (`down`)
//! writes, for decode batches, down·h per cold (token, slot) and zeros for hot ones, which the
//! graph adds to the hot tier's result before weighting (llama.cpp's exact summation order);
//! for prompt batches, each token's routing-weighted sum over its cold slots, [n_embd, n_tok],
//! added to the hot tier's weighted sum (the per-slot form would move n_used times more data).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use super::layer::LayerTiers;
use super::types::{Activation, Tier};
use crate::sys;

/// Splits `total` work items across `nth` threads; thread `ith` gets `[start, end)`.
pub(crate) fn share(total: usize, ith: usize, nth: usize) -> (usize, usize) {
    let per = total.div_ceil(nth.max(1));
    let start = (ith * per).min(total);
    (start, (start + per).min(total))
}

/// (token, slot, cold row in the cold tensors) for every selected expert of the cold tier that
/// this step did not upload (`--pcie-frac`).
pub(crate) fn cold_items(lt: &LayerTiers, sel: &[i32], n_used: usize, uploaded: &[bool]) -> Vec<(usize, usize, usize)> {
    let mut items = Vec::new();
    for (i, &e) in sel.iter().enumerate() {
        if let Some(row) = lt.cold_row(e).filter(|_| !uploaded.get(i).copied().unwrap_or(false)) {
            items.push((i / n_used, i % n_used, row));
        }
    }
    items
}

/// Counts each selection once per graph evaluation (thread 0 only), by tier and by expert.
pub(crate) fn tally(lt: &LayerTiers, sel: &[i32]) {
    let (mut hot, mut cold) = (0u64, 0u64);
    for &e in sel {
        if lt.cold_row(e).is_some() {
            cold += 1;
        } else {
            hot += 1;
        }
        if let Some(c) = usize::try_from(e).ok().and_then(|e| lt.tally.per_expert.get(e)) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
    let t = &lt.tally;
    t.hits[Tier::Hot as usize].fetch_add(hot, Ordering::Relaxed);
    t.hits[lt.cold_tier as usize].fetch_add(cold, Ordering::Relaxed);
}

fn act(a: Activation, g: f32, u: f32, gated: bool) -> f32 {
    let x = if gated { g } else { u };
    let y = match a {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Relu => x.max(0.0),
        Activation::Gelu => {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
        }
    };
    if gated {
        y * u
    } else {
        y
    }
}

/// # Safety
/// `dst` is a live custom-op tensor with at least `i + 1` sources; the reference lives no longer
/// than the graph.
pub(crate) unsafe fn src<'a>(dst: *mut sys::ggml_tensor, i: usize) -> &'a sys::ggml_tensor {
    // SAFETY: the caller built dst with at least i+1 sources.
    unsafe { &*(*dst).src[i] }
}

/// Source i when it is the upload op's ids (i32, made by [`upload`]), else None.
///
/// # Safety
/// `dst` is a live custom-op tensor and `i < GGML_MAX_SRC`; the reference lives no longer than
/// the graph.
pub(crate) unsafe fn src_opt<'a>(dst: *mut sys::ggml_tensor, i: usize) -> Option<&'a sys::ggml_tensor> {
    // SAFETY: src entries are null or live tensors.
    let t = unsafe { (*dst).src[i].as_ref()? };
    (t.op == sys::GGML_OP_CUSTOM && t.type_ == sys::GGML_TYPE_I32).then_some(t)
}

/// Which selections the upload op sent to the staging slots (ids below the slot count).
pub(crate) fn uploaded(lt: &LayerTiers, ids_t: Option<&sys::ggml_tensor>) -> Vec<bool> {
    // A prompt batch's ids come from the prefill ring: a cold selection sent to a pad stays here.
    if let (Some(t), Some(hot_pads)) = (ids_t.filter(|t| t.ne[1] >= super::types::OFFLOAD_MIN_BATCH), lt.ring_pads()) {
        // SAFETY: the fill op's output is contiguous i32.
        return unsafe { ids(t) }.iter().map(|&s| !hot_pads.contains(&s)).collect();
    }
    match (ids_t, lt.staging.as_ref()) {
        // SAFETY: the upload op's output is contiguous i32.
        (Some(t), Some(st)) => unsafe { ids(t) }.iter().map(|&s| (s as usize) < st.slots).collect(),
        _ => Vec::new(),
    }
}

/// Token t's input row, n_embd floats of cur [n_embd, 1, n_tok].
pub(crate) fn token_row(cur: &sys::ggml_tensor, t: usize, n_embd: usize) -> &[f32] {
    // SAFETY: cur is a live f32 tensor whose rows along dim 2 hold n_embd floats each.
    unsafe { std::slice::from_raw_parts(cur.data.cast::<u8>().add(t * cur.nb[2]) as *const f32, n_embd) }
}

/// The ids of a contiguous [n_used, n_tok] i32 tensor.
///
/// # Safety
/// `sel` is a contiguous i32 tensor whose data lives as long as the returned slice is used.
pub(crate) unsafe fn ids<'a>(sel: &sys::ggml_tensor) -> &'a [i32] {
    // SAFETY: the caller passes a contiguous i32 tensor.
    unsafe { std::slice::from_raw_parts(sel.data as *const i32, (sel.ne[0] * sel.ne[1]) as usize) }
}

/// act(gate·x) * (up·x) into `h` ([n_ff, n_used, n_tok]) for rows `r0..r1` of the
/// `items.len() * n_ff` rows of the cold items ([`cold_items`]). `x(t)` is token t's input row.
pub(crate) fn gate_up_rows<'x>(
    lt: &LayerTiers,
    x: impl Fn(usize) -> &'x [f32],
    items: &[(usize, usize, usize)],
    n_used: usize,
    h: *mut f32,
    r0: usize,
    r1: usize,
) {
    let n_embd = lt.n_embd;
    let n_ff = lt.n_ff;
    let cold = &lt.cold;
    let (g_mat, u_mat, u_off) = match (cold.gate, cold.up, cold.gate_up) {
        (_, _, Some(gu)) => (Some(gu), gu, n_ff),
        (g, Some(u), None) => (g, u, 0),
        _ => return,
    };
    let mut xq_g = Vec::new();
    let mut xq_u = Vec::new();
    // Gate and up of one type read the same converted input.
    let g_own = g_mat.filter(|g| g.traits.vec_dot_type != u_mat.traits.vec_dot_type);
    let mut last_t = usize::MAX;
    for row in r0..r1 {
        let (t, k, slot) = items[row / n_ff];
        let r = row % n_ff;
        if t != last_t {
            let xt = &x(t)[..n_embd];
            u_mat.traits.quantize(xt, &mut xq_u);
            if let Some(g) = g_own {
                g.traits.quantize(xt, &mut xq_g);
            }
            last_t = t;
        }
        let xq_g = if g_own.is_some() { &xq_g } else { &xq_u };
        // SAFETY: slot < experts in the cold tensor and r + u_off < its rows.
        let u = u_mat.traits.dot(n_embd, unsafe { u_mat.data.add(slot * u_mat.nb2 + (r + u_off) * u_mat.nb1) }, &xq_u);
        let g = match g_mat {
            // SAFETY: as above, for the gate rows.
            Some(g) => g.traits.dot(n_embd, unsafe { g.data.add(slot * g.nb2 + r * g.nb1) }, xq_g),
            None => 0.0,
        };
        // SAFETY: h holds [n_ff, n_used, n_tok]; each (t, k, r) is written by one thread only.
        unsafe { *h.add((t * n_used + k) * n_ff + r) = act(lt.activation(), g, u, g_mat.is_some()) };
    }
}

/// Whether op B writes the weighted form for a batch of `n_tok` tokens (see the module doc).
pub(crate) fn weighted_output(n_tok: usize) -> bool {
    n_tok as i64 >= super::types::OFFLOAD_MIN_BATCH
}

/// Rows `r0..r1` (of n_embd) of down·h over the cold slots, into `out`: [n_embd, n_used, n_tok]
/// per slot (zeros for hot slots), or with `w` (`w[t * n_used + k]` is slot k's routing weight)
/// each token's weighted sum, [n_embd, n_tok]. Uploaded slots count as hot.
#[allow(clippy::too_many_arguments)]
pub(crate) fn down_rows(lt: &LayerTiers, h: *const f32, sel: &[i32], uploaded: &[bool], w: Option<&[f32]>, n_used: usize, out: *mut f32, r0: usize, r1: usize) {
    let (n_embd, n_ff) = (lt.n_embd, lt.n_ff);
    let Some(d) = lt.cold.down else { return };
    let mut hq = Vec::new();
    for t in 0..sel.len() / n_used.max(1) {
        if w.is_some() {
            // SAFETY: out holds [n_embd, n_tok]; rows r0..r1 of each token belong to this thread.
            unsafe { std::slice::from_raw_parts_mut(out.add(t * n_embd + r0), r1 - r0) }.fill(0.0);
        }
        for k in 0..n_used {
            let i = t * n_used + k;
            let row = if w.is_some() { t } else { i };
            // SAFETY: as above, or out holds [n_embd, n_used, n_tok] and row i is (t, k).
            let o = unsafe { std::slice::from_raw_parts_mut(out.add(row * n_embd + r0), r1 - r0) };
            let Some(slot) = lt.cold_row(sel[i]).filter(|_| !uploaded.get(i).copied().unwrap_or(false)) else {
                if w.is_none() {
                    o.fill(0.0);
                }
                continue;
            };
            // SAFETY: h row i holds n_ff floats written by gate_up_rows.
            let hv = unsafe { std::slice::from_raw_parts(h.add(i * n_ff), n_ff) };
            d.traits.quantize(hv, &mut hq);
            for (j, r) in (r0..r1).enumerate() {
                // SAFETY: slot < experts in the cold down tensor and r < n_embd rows.
                let v = d.traits.dot(n_ff, unsafe { d.data.add(slot * d.nb2 + r * d.nb1) }, &hq);
                match w {
                    Some(w) => o[j] += w[i] * v,
                    None => o[j] = v,
                }
            }
        }
    }
}

/// The routing weights [1, n_used, n_tok] f32 (possibly strided), as `w[t * n_used + k]`.
pub(crate) fn weights(wt: &sys::ggml_tensor, out: &mut Vec<f32>) {
    let (n_used, n_tok) = (wt.ne[1] as usize, wt.ne[2] as usize);
    out.clear();
    for t in 0..n_tok {
        for k in 0..n_used {
            // SAFETY: (0, k, t) lies inside the tensor, addressed by its strides.
            out.push(unsafe { *(wt.data.cast::<u8>().add(k * wt.nb[1] + t * wt.nb[2]) as *const f32) });
        }
    }
}

/// Op A. Sources: cur [n_embd, 1, n_tok] f32, sel [n_used, n_tok] i32, the upload op's ids
/// when the step uploads (`--pcie-frac`), then the cold weight tensors (only used to place the
/// op on the CPU; the kernel reads `LayerTiers::cold`).
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn gate_up(dst: *mut sys::ggml_tensor, ith: i32, nth: i32, userdata: *mut c_void) {
    // SAFETY: userdata is the layer's LayerTiers, kept alive by the registry while graphs exist.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    // SAFETY: the graph builder gave this op these sources.
    let (cur, sel) = unsafe { (src(dst, 0), src(dst, 1)) };
    // SAFETY: sel is contiguous i32.
    let ids = unsafe { ids(sel) };
    if ith == 0 {
        tally(lt, ids);
    }
    let x = |t: usize| token_row(cur, t, lt.n_embd);
    // SAFETY: the builder puts the upload op's ids, when there is one, right after sel.
    let uploaded = uploaded(lt, unsafe { src_opt(dst, 2) });
    let n_used = sel.ne[0] as usize;
    let items = cold_items(lt, ids, n_used, &uploaded);
    let (r0, r1) = share(items.len() * lt.n_ff, ith as usize, nth as usize);
    // SAFETY: dst is a contiguous [n_ff, n_used, n_tok] f32 tensor.
    gate_up_rows(lt, x, &items, n_used, unsafe { (*dst).data as *mut f32 }, r0, r1);
}

/// Op B. Sources: h [n_ff, n_used, n_tok] f32 from op A, sel [n_used, n_tok] i32, the routing
/// weights [1, n_used, n_tok] (read only for the weighted form), the upload op's ids when the step uploads, the cold down tensor.
/// Writes [n_embd, n_used, n_tok] or, for prompt batches, [n_embd, n_tok] (see the module doc).
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn down(dst: *mut sys::ggml_tensor, ith: i32, nth: i32, userdata: *mut c_void) {
    // SAFETY: as in gate_up.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    // SAFETY: the graph builder gave this op these sources; sel is contiguous i32.
    let (h, sel, wt) = unsafe { (src(dst, 0), src(dst, 1), src(dst, 2)) };
    let mut w = Vec::new();
    let weighted = weighted_output(sel.ne[1] as usize);
    if weighted {
        weights(wt, &mut w);
    }
    // SAFETY: the builder puts the upload op's ids, when there is one, after the weights.
    let uploaded = uploaded(lt, unsafe { src_opt(dst, 3) });
    let (r0, r1) = share(lt.n_embd, ith as usize, nth as usize);
    // SAFETY: dst is contiguous f32 of the shape the graph builder gave for this mode.
    unsafe { down_rows(lt, h.data as *const f32, ids(sel), &uploaded, weighted.then_some(&w[..]), sel.ne[0] as usize, (*dst).data as *mut f32, r0, r1) };
}

/// Counts the selections of a step whose cold experts are computed elsewhere (prompt batches).
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn count(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    // SAFETY: as in gate_up.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    // SAFETY: the graph builder gave this op sel as its first source; dst is one f32.
    unsafe {
        tally(lt, ids(src(dst, 0)));
        *((*dst).data as *mut f32) = 0.0;
    }
}

/// `--pcie-frac`: the upload op of a decode step. Sources: sel [n_used, n_tok] i32, then a cold
/// weight tensor (it places the op on the CPU). Takes the first share of the step's cold
/// selections (at most one per staging slot, distinct experts), copies those experts into the
/// device's staging slots and writes dst [n_used, n_tok] i32: the staging slot of each uploaded
/// selection, else the zero pad of its position. The CPU kernels then skip the uploaded ones.
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn upload(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    // SAFETY: as in gate_up.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    // SAFETY: the graph builder gave this op sel as its first source; dst is i32 of sel's shape.
    let (sel, out) = unsafe {
        let sel = src(dst, 0);
        (ids(sel), std::slice::from_raw_parts_mut((*dst).data as *mut i32, (sel.ne[0] * sel.ne[1]) as usize))
    };
    let Some(st) = lt.staging.as_ref() else { return };
    let n_used = lt.n_used;
    let misses = sel.iter().filter(|&&e| lt.cold_row(e).is_some()).count();
    let mut budget = (misses as f64 * lt.pcie_frac).round() as usize;
    let mut slot_of: Vec<(i32, usize)> = Vec::new();
    let mut rows: Vec<(usize, usize)> = Vec::new();
    for (i, &e) in sel.iter().enumerate() {
        out[i] = (st.slots + i % n_used) as i32;
        let Some(row) = lt.cold_row(e) else { continue };
        if budget == 0 {
            continue;
        }
        let slot = match slot_of.iter().find(|(x, _)| *x == e) {
            Some(&(_, s)) => s,
            None if slot_of.len() < st.slots => {
                rows.push((slot_of.len(), row));
                slot_of.push((e, slot_of.len()));
                slot_of.len() - 1
            }
            None => continue,
        };
        out[i] = slot as i32;
        budget -= 1;
    }
    // With the prefill ring, through its page-locked staging buffer and copy stream, all at once.
    let copied = lt.ring.as_ref().is_some_and(|(ring, _)| ring.copy_rows(&lt.cold_tensors, &st.mats, &rows));
    if !copied {
        for &(slot, row) in &rows {
            st.fill(slot, &lt.cold, row);
        }
    }
    lt.tally.uploads.fetch_add(slot_of.len() as u64, Ordering::Relaxed);
}
