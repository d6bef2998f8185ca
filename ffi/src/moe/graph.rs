//! Builds a tiered MoE layer into llama.cpp's graph (called from the MoE hook).

use std::ffi::c_void;
use std::ptr::NonNull;

use super::layer::LayerTiers;
use super::types::{Activation, Mats, OFFLOAD_MIN_BATCH, T};
use super::{kernels, pool, prefill};
use crate::sys;

/// An upper bound on the nodes (tensors and views) a tiered layer adds beyond llama.cpp's own
/// expert graph, which it replaces: the second tier's chain, remaps, flattening, custom ops.
pub(crate) const EXTRA_NODES_PER_LAYER: u32 = 192;
/// Columns up to which the flat second pass stays within the id grouping's shared memory.
const FLAT_MAX_COLUMNS: i64 = 32768;

struct G<'a> {
    ctx: *mut sys::ggml_context,
    args: &'a sys::strata_moe_experts_args,
    layer: i32,
}

impl G<'_> {
    /// Names a node "{what}-{layer}" as llama.cpp names its own, so per-layer tools can group it.
    fn named(&self, t: T, what: &str) -> T {
        if let Ok(name) = std::ffi::CString::new(format!("{what}-{}", self.layer)) {
            // SAFETY: t is a live graph tensor; ggml copies the name into the tensor.
            unsafe { sys::ggml_set_name(t, name.as_ptr()) };
        }
        t
    }

    /// mul_mat_id over `mats` with `ids`, the activation, then down: [n_embd, n_used, n_tok].
    /// With `flat`, each (token, slot) pair becomes a column of its own with one expert, so an
    /// id repeated within a token (the pad, a stand-in) stays legal for grouped GPU kernels.
    fn ffn(&self, tier: &str, mats: &Mats<T>, ids: T, act: Activation, flat: bool) -> Option<T> {
        let (ctx, cur) = (self.ctx, self.args.cur);
        // SAFETY: ctx is the graph context; all tensors are live graph or weight tensors of
        // matching shapes (the same shapes llama.cpp would use for this layer); reshapes are of
        // contiguous tensors (mul_mat_id and activation results, remapped ids).
        unsafe {
            let (n_embd, n_used, n_tok) = ((*cur).ne[0], (*ids).ne[0], (*ids).ne[1]);
            let (x, ids) = if flat {
                let n = n_used * n_tok;
                let x = sys::ggml_repeat_4d(ctx, cur, n_embd, n_used, n_tok, 1);
                (sys::ggml_reshape_3d(ctx, x, n_embd, 1, n), sys::ggml_reshape_2d(ctx, ids, 1, n))
            } else {
                (cur, ids)
            };
            let mm = |w: T, x: T| {
                let y = self.named(sys::ggml_mul_mat_id(ctx, w, x, ids), tier);
                if flat {
                    sys::ggml_reshape_3d(ctx, y, (*y).ne[0], n_used, n_tok)
                } else {
                    y
                }
            };
            let (gate, up) = if let Some(gu) = mats.gate_up {
                let gu = mm(gu, x);
                let n_ff = (*gu).ne[0] / 2;
                let g = sys::ggml_view_3d(ctx, gu, n_ff, (*gu).ne[1], (*gu).ne[2], (*gu).nb[1], (*gu).nb[2], 0);
                let u = sys::ggml_view_3d(ctx, gu, n_ff, (*gu).ne[1], (*gu).ne[2], (*gu).nb[1], (*gu).nb[2], n_ff as usize * (*gu).nb[0]);
                (Some(g), u)
            } else {
                let u = mm(mats.up?, x);
                (mats.gate.map(|g| mm(g, x)), u)
            };
            let h = match (gate, act) {
                (Some(g), Activation::Silu) => sys::ggml_swiglu_split(ctx, g, up),
                (Some(g), Activation::Gelu) => sys::ggml_geglu_split(ctx, g, up),
                (Some(g), Activation::Relu) => sys::ggml_reglu_split(ctx, g, up),
                (None, Activation::Silu) => sys::ggml_silu(ctx, up),
                (None, Activation::Gelu) => sys::ggml_gelu(ctx, up),
                (None, Activation::Relu) => sys::ggml_relu(ctx, up),
            };
            let h = self.named(h, &format!("{tier}_act"));
            let h = if flat { sys::ggml_reshape_3d(ctx, h, (*h).ne[0], 1, n_used * n_tok) } else { h };
            Some(mm(mats.down?, h))
        }
    }

    /// map[ids] for an expert map [1, n_expert] (i32 or f32) and contiguous ids [n_used, n_tok].
    fn remap(&self, map: T, ids: T) -> T {
        // SAFETY: map is [1, n_expert] i32, ids is contiguous [n_used, n_tok] i32.
        unsafe {
            let (n_used, n_tok) = ((*ids).ne[0], (*ids).ne[1]);
            let flat = sys::ggml_reshape_1d(self.ctx, ids, n_used * n_tok);
            let rows = sys::ggml_get_rows(self.ctx, map, flat);
            sys::ggml_reshape_2d(self.ctx, rows, n_used, n_tok)
        }
    }

    /// Per-position map[e, j] for ids [n_used, n_tok] and a map [1, n_expert, n_used] (i32).
    fn remap_positions(&self, map: T, ids: T) -> T {
        // SAFETY: map is [1, n_expert, n_used] i32 and ids a contiguous [n_used, n_tok] i32.
        unsafe {
            let (n_used, n_tok) = ((*ids).ne[0], (*ids).ne[1]);
            let by_pos = sys::ggml_cont(self.ctx, sys::ggml_transpose(self.ctx, ids));
            let rows = sys::ggml_reshape_2d(self.ctx, sys::ggml_get_rows(self.ctx, map, by_pos), n_tok, n_used);
            sys::ggml_cont(self.ctx, sys::ggml_transpose(self.ctx, rows))
        }
    }

    fn custom(&self, ne: [i64; 3], srcs: &mut [T], f: sys::ggml_custom_op_t, n_tasks: i32, lt: &LayerTiers) -> T {
        self.custom_of(sys::GGML_TYPE_F32, ne, srcs, f, n_tasks, lt)
    }

    fn custom_of(&self, ty: sys::ggml_type, ne: [i64; 3], srcs: &mut [T], f: sys::ggml_custom_op_t, n_tasks: i32, lt: &LayerTiers) -> T {
        // SAFETY: srcs are live tensors; userdata (the LayerTiers) outlives every graph that
        // uses it (the registry keeps it until the model is freed, after all contexts).
        unsafe {
            sys::ggml_custom_4d(self.ctx, ty, ne[0], ne[1], ne[2], 1, srcs.as_mut_ptr(), srcs.len() as i32, f, n_tasks, lt as *const LayerTiers as *mut c_void)
        }
    }

    fn expand(&self, t: T) {
        // SAFETY: t belongs to this graph's context.
        unsafe { sys::ggml_build_forward_expand(self.args.graph, t) };
    }
}

fn activation(op: sys::strata_ffn_op) -> Option<Activation> {
    match op {
        sys::STRATA_FFN_OP_SILU => Some(Activation::Silu),
        sys::STRATA_FFN_OP_GELU => Some(Activation::Gelu),
        sys::STRATA_FFN_OP_RELU => Some(Activation::Relu),
        _ => None,
    }
}

/// The tiered layer's weighted expert sum [n_embd, n_tok], or None to let llama.cpp build it
/// (unsupported activation, a layer only being counted, or routing of another width).
///
/// Decode batches of a layer with zero-copy reads run one mul_mat_id per matrix through tables
/// of expert pointers. Otherwise decode batches, and prompt batches whose cold selections are
/// expected to be few, compute the cold selections on the CPU (custom ops, or the worker pool
/// overlapping the hot tier): per slot in decode, added before weighting; as a weighted sum in
/// prompt batches. With `--pcie-frac`, decode sends a share of them to staging slots on the GPU
/// instead. Prompt batches take the prefill ring where its cost model prefers it; others run the
/// cold tier as a second mul_mat_id, which ggml offloads to the GPU uploading only the experts
/// used.
pub(crate) fn build(args: &sys::strata_moe_experts_args, lt: &LayerTiers) -> Option<NonNull<sys::ggml_tensor>> {
    let act = activation(args.ffn_op)?;
    lt.set_activation(act);
    let g = G { ctx: args.ctx, args, layer: lt.layer };
    // SAFETY: args come from llama.cpp's build_moe_ffn and are live for this call.
    let (n_embd, n_tok) = unsafe { ((*args.cur).ne[0], (*args.cur).ne[2]) };
    let n_used = args.n_expert_used;
    // SAFETY: selected_experts is a live i32 tensor [n_used, n_tok] (possibly a view). A decode
    // step's view of one token is already contiguous: no copy kernel for it.
    let sel = unsafe {
        if sys::ggml_is_contiguous(args.selected_experts) {
            args.selected_experts
        } else {
            sys::ggml_cont(g.ctx, args.selected_experts)
        }
    };
    let prompt = n_tok >= OFFLOAD_MIN_BATCH;

    // The counting op runs on the CPU; a host weight among its sources places it there directly.
    let count = || {
        let mut srcs = vec![sel];
        srcs.extend(host_cold_weight(lt));
        let c = g.named(g.custom([1, 1, 1], &mut srcs, Some(kernels::count), 1, lt), "strata_count");
        g.expand(c);
    };
    if lt.count_only || n_used as usize != lt.n_used {
        count();
        return None;
    }
    // The prefill ring: one mul_mat_id over the window, hot slots and ring slots together.
    // Cold experts the ring's half has no room for go to the zero pads and to the CPU part.
    // A layer whose used cold experts outnumber a half takes several passes (waves): pass k
    // computes its share from half (h + k) % 2 while the next share is copied into the other.
    if prompt && lt.ring_preferred(n_tok) {
        let passes = lt.ring_passes();
        let overflow = lt.ring.as_ref().is_some_and(|(r, _)| lt.cold_used_at_most(n_tok) > passes * r.half);
        let mut srcs = vec![sel];
        srcs.extend(host_cold_weight(lt));
        let fill = if overflow { prefill::fill_only } else { prefill::fill };
        let ids = g.named(g.custom_of(sys::GGML_TYPE_I32, [n_used, n_tok, 1], &mut srcs, Some(fill), 1, lt), "strata_ring_fill");
        g.expand(ids);
        let cold_srcs = [lt.cold_tensors.up, lt.cold_tensors.gate, lt.cold_tensors.gate_up].into_iter().flatten();
        let ticket = (overflow && lt.cold_threads > 0).then(|| {
            let mut srcs = vec![args.cur, sel, args.weights, ids];
            srcs.extend(cold_srcs.clone());
            let t = g.named(g.custom([1, 1, 1], &mut srcs, Some(pool::launch), 1, lt), "strata_pool_launch");
            g.expand(t);
            t
        });
        let mut experts = g.ffn("strata_ring_mm", lt.window.as_ref()?, ids, act, false)?;
        g.expand(experts);
        for k in 1..passes {
            // SAFETY: experts is a live f32 graph tensor; a one-element view of it orders this
            // pass's fill after the previous pass has computed.
            let after = unsafe { sys::ggml_view_1d(g.ctx, experts, 1, 0) };
            let mut srcs = vec![sel, after];
            srcs.extend(host_cold_weight(lt));
            let ids = g.named(g.custom_of(sys::GGML_TYPE_I32, [n_used, n_tok, 1], &mut srcs, prefill::fill_op(k), 1, lt), "strata_ring_fill");
            g.expand(ids);
            let pass = g.ffn("strata_ring_mm", lt.pass_mats(k)?, ids, act, false)?;
            // SAFETY: both are [n_embd, n_used, n_tok] f32 graph tensors, zero where the other computes.
            experts = unsafe { sys::ggml_add(g.ctx, experts, pass) };
            g.expand(experts);
        }
        let out = weighted_sum(&g, experts, n_embd, n_tok, n_used);
        let cold_sum = match (overflow, ticket) {
            (false, _) => None,
            (true, Some(t)) => Some(g.named(g.custom([n_embd, n_tok, 1], &mut [t], Some(pool::join), 1, lt), "strata_pool_join")),
            (true, None) => {
                let mut a_srcs = vec![args.cur, sel, ids];
                a_srcs.extend(cold_srcs);
                let h =
                    g.named(g.custom([lt.n_ff as i64, n_used, n_tok], &mut a_srcs, Some(kernels::gate_up), sys::GGML_N_TASKS_MAX, lt), "strata_cpu_gate_up");
                let mut b_srcs = vec![h, sel, args.weights, ids];
                b_srcs.extend(lt.cold_tensors.down);
                Some(g.named(g.custom([n_embd, n_tok, 1], &mut b_srcs, Some(kernels::down), sys::GGML_N_TASKS_MAX, lt), "strata_cpu_down"))
            }
        };
        return NonNull::new(match cold_sum {
            // SAFETY: both are [n_embd, n_tok] f32 graph tensors.
            Some(c) => unsafe { sys::ggml_add(g.ctx, out, c) },
            None => out,
        });
    }
    // Zero-copy decode: every expert id addresses its own weights through the tables, hot ones
    // in VRAM and cold ones in the page-locked copy; no CPU op, so the step stays one device
    // graph, and the down projection's kernels write the routing log.
    if let Some(zc) = lt.zero_copy.as_ref().filter(|z| n_tok <= z.max_tokens) {
        let experts = g.ffn("strata_table_mm", &zc.table.mats, sel, act, false)?;
        return NonNull::new(weighted_sum(&g, experts, n_embd, n_tok, n_used));
    }
    // A windowed layer whose batch skips the ring keeps its cold selections on the CPU, as does
    // a batch too wide for the flat second pass (the GPU's id grouping holds 4-byte entries for
    // every column in shared memory).
    let flat_too_wide = n_tok >= lt.flat_from && n_used * n_tok > FLAT_MAX_COLUMNS;
    let cold_cpu = lt.n_cold > 0 && (!prompt || lt.cold_map.is_none() || lt.window.is_some() || flat_too_wide || lt.cold_on_cpu(n_tok));
    // The CPU ops read the routing weights only for the weighted (prompt) form; otherwise sel
    // stands in as that source, which the scheduler then copies from the GPU once, not twice.
    let weighted_cold = kernels::weighted_output(n_tok as usize);
    let cpu_weights = if weighted_cold { args.weights } else { sel };
    let cold_srcs = || [lt.cold_tensors.up, lt.cold_tensors.gate, lt.cold_tensors.gate_up].into_iter().flatten();

    // --pcie-frac: a share of this decode step's cold selections goes to the staging slots.
    let upload_ids = lt.staging.as_ref().filter(|_| cold_cpu && !prompt && lt.pcie_frac > 0.0).map(|_| {
        let mut srcs = vec![sel];
        srcs.extend(lt.cold_tensors.down);
        let u = g.named(g.custom_of(sys::GGML_TYPE_I32, [n_used, n_tok, 1], &mut srcs, Some(kernels::upload), 1, lt), "strata_upload");
        g.expand(u);
        u
    });
    // With the worker pool, the cold experts start before the hot ones are queued (see pool.rs).
    let ticket = (cold_cpu && lt.cold_threads > 0).then(|| {
        let mut srcs = vec![args.cur, sel, cpu_weights];
        srcs.extend(upload_ids);
        srcs.extend(cold_srcs());
        let t = g.named(g.custom([1, 1, 1], &mut srcs, Some(pool::launch), 1, lt), "strata_pool_launch");
        g.expand(t);
        t
    });
    let down_hot = lt.hot.as_ref().and_then(|hot| {
        let d = g.ffn("strata_hot_mm", &hot.mats, g.remap_positions(hot.map, sel), act, false)?;
        g.expand(d);
        Some(d)
    });
    let down_staged = upload_ids.zip(lt.staging.as_ref()).and_then(|(ids, st)| {
        let d = g.ffn("strata_staged_mm", &st.mats, ids, act, false)?;
        g.expand(d);
        Some(d)
    });
    let down_hot = match (down_hot, down_staged) {
        // SAFETY: both are [n_embd, n_used, n_tok] graph tensors; staging is zero where not uploaded.
        (Some(h), Some(s)) => Some(unsafe { sys::ggml_add(g.ctx, h, s) }),
        (h, s) => h.or(s),
    };
    // The cold tier as mul_mat_id: zero (pad or masked stand-in) where the hot tier computes.
    let down_cold = match lt.cold_map {
        Some(map) if lt.n_cold > 0 && !cold_cpu => {
            count();
            let c = g.ffn("strata_cold_mm", &lt.cold_tensors, g.remap(map, sel), act, n_tok >= lt.flat_from)?;
            Some(match lt.cold_mask {
                // SAFETY: mask is [1, n_expert] f32; the product broadcasts over n_embd.
                Some(mask) => unsafe {
                    let keep = sys::ggml_reshape_3d(g.ctx, g.remap(mask, sel), 1, n_used, n_tok);
                    sys::ggml_mul(g.ctx, c, keep)
                },
                None => c,
            })
        }
        _ => None,
    };
    if lt.n_cold == 0 {
        count();
    }
    // The cold selections on the CPU: per (token, slot) in decode, a weighted sum in prompts.
    let cold_ne = if weighted_cold { [n_embd, n_tok, 1] } else { [n_embd, n_used, n_tok] };
    let cold_cpu_out = if !cold_cpu {
        None
    } else if let Some(t) = ticket {
        Some(g.named(g.custom(cold_ne, &mut [t], Some(pool::join), 1, lt), "strata_pool_join"))
    } else {
        let mut a_srcs = vec![args.cur, sel];
        a_srcs.extend(upload_ids);
        a_srcs.extend(cold_srcs());
        let h = g.named(g.custom([lt.n_ff as i64, n_used, n_tok], &mut a_srcs, Some(kernels::gate_up), sys::GGML_N_TASKS_MAX, lt), "strata_cpu_gate_up");
        let mut b_srcs = vec![h, sel, cpu_weights];
        b_srcs.extend(upload_ids);
        b_srcs.extend(lt.cold_tensors.down);
        Some(g.named(g.custom(cold_ne, &mut b_srcs, Some(kernels::down), sys::GGML_N_TASKS_MAX, lt), "strata_cpu_down"))
    };
    let (down_cold, cold_sum) = if weighted_cold { (down_cold, cold_cpu_out) } else { (down_cold.or(cold_cpu_out), None) };
    let experts = match (down_hot, down_cold) {
        // SAFETY: both are [n_embd, n_used, n_tok] graph tensors.
        (Some(h), Some(c)) => Some(unsafe { sys::ggml_add(g.ctx, h, c) }),
        (h, c) => h.or(c),
    };

    let weighted = experts.map(|experts| weighted_sum(&g, experts, n_embd, n_tok, n_used));
    let out = match (weighted, cold_sum) {
        // SAFETY: both are [n_embd, n_tok] f32 graph tensors.
        (Some(w), Some(c)) => unsafe { sys::ggml_add(g.ctx, w, c) },
        (w, c) => w.or(c)?,
    };
    NonNull::new(out)
}

/// sum_k weights_k * experts_k over the routing positions, [n_embd, n_tok], in llama.cpp's order.
fn weighted_sum(g: &G<'_>, experts: T, n_embd: i64, n_tok: i64, n_used: i64) -> T {
    // SAFETY: graph tensors of matching shapes; the sum mirrors llama.cpp's build_moe_ffn.
    unsafe {
        let experts = g.named(sys::ggml_mul(g.ctx, experts, g.args.weights), "strata_weighted");
        g.expand(experts);
        let view = |i: i64| sys::ggml_view_2d(g.ctx, experts, n_embd, n_tok, (*experts).nb[2], i as usize * (*experts).nb[1]);
        let views: Vec<T> = (0..n_used).map(view).collect();
        for &v in &views {
            g.expand(v);
        }
        let mut out = views[0];
        for &v in &views[1..] {
            out = g.named(sys::ggml_add(g.ctx, out, v), "strata_wsum");
            g.expand(out);
        }
        if n_used == 1 {
            out = sys::ggml_cont(g.ctx, out);
        }
        out
    }
}

/// The cold down tensor when it lives in host memory: as a source it places a custom op on the CPU.
fn host_cold_weight(lt: &LayerTiers) -> Option<T> {
    // SAFETY: the cold down tensor is a live weight tensor.
    lt.cold_tensors.down.filter(|&t| unsafe { !(*t).buffer.is_null() && sys::ggml_backend_buffer_is_host((*t).buffer) })
}
