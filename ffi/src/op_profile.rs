//! Per-op wall time of large batches (STRATA_OP_PROFILE=FILE), for finding where a prompt batch's
//! time goes where no timeline profiler runs. ggml's scheduler computes every node on its own and
//! synchronises its backend before the eval callback, so the time between two callbacks is the
//! node's compute plus the launch and the synchronisation (tens of µs), and for the first node of a
//! split also the split's input copies. Kernel fusion is off in this mode: compare runs made with it.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::io::Write;
use std::sync::Mutex;
use std::time::Instant;

use crate::sys;

/// Batches smaller than this are not written (decode steps would drown the file).
const MIN_TOKENS: i32 = 64;

struct Profile {
    file: std::fs::File,
    last: Option<Instant>,
    /// (op, tensor name without its layer suffix) -> (µs, nodes).
    by_op: HashMap<(String, String), (f64, u32)>,
    /// layer -> µs.
    by_layer: HashMap<i32, f64>,
    /// (layer, tensor name) -> µs of the expert matmuls, which differ most between placements.
    mm_by_layer: HashMap<(i32, String), f64>,
    unlayered_us: f64,
}

static PROFILE: Mutex<Option<Profile>> = Mutex::new(None);

/// Opens FILE and installs the callback into `params` (so the context built from them runs node by node).
pub(crate) fn install(raw: &mut sys::llama_context_params, path: &std::path::Path) -> std::io::Result<()> {
    let file = std::fs::File::create(path)?;
    *PROFILE.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(Profile { file, last: None, by_op: HashMap::new(), by_layer: HashMap::new(), mm_by_layer: HashMap::new(), unlayered_us: 0.0 });
    raw.cb_eval = Some(on_node);
    raw.cb_eval_user_data = std::ptr::null_mut();
    Ok(())
}

/// Marks the start of a batch (the time up to the first node counts as the batch's set-up).
pub(crate) fn batch_start() {
    if let Some(p) = PROFILE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        p.last = Some(Instant::now());
    }
}

/// Writes the batch's line (when it had at least MIN_TOKENS tokens) and resets the sums.
pub(crate) fn batch_end(n_tokens: i32, total: std::time::Duration) {
    let mut guard = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(p) = guard.as_mut() else { return };
    let by_op = std::mem::take(&mut p.by_op);
    let by_layer = std::mem::take(&mut p.by_layer);
    let mm_by_layer = std::mem::take(&mut p.mm_by_layer);
    let unlayered = std::mem::replace(&mut p.unlayered_us, 0.0);
    p.last = None;
    if n_tokens < MIN_TOKENS {
        return;
    }
    let mut ops: Vec<_> = by_op.into_iter().collect();
    ops.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let mut layers: Vec<_> = by_layer.into_iter().collect();
    layers.sort_by_key(|l| l.0);
    let mut mm: Vec<_> = mm_by_layer.into_iter().collect();
    mm.sort_by(|a, b| a.0.cmp(&b.0));
    let line = serde_json::json!({
        "tokens": n_tokens,
        "decode_us": total.as_secs_f64() * 1e6,
        "unlayered_us": unlayered,
        "ops": ops.iter().map(|((op, name), (us, n))| serde_json::json!({"op": op, "name": name, "us": us, "nodes": n})).collect::<Vec<_>>(),
        "layers": layers.iter().map(|(l, us)| serde_json::json!([l, us])).collect::<Vec<_>>(),
        "mul_mat_id_by_layer": mm.iter().map(|((l, name), us)| serde_json::json!([l, name, us])).collect::<Vec<_>>(),
    });
    let _ = writeln!(p.file, "{line}");
}

/// Splits "ffn_moe_gate-12" into ("ffn_moe_gate", Some(12)).
fn split_layer(name: &str) -> (&str, Option<i32>) {
    match name.rsplit_once('-') {
        Some((base, l)) if !base.is_empty() => match l.parse() {
            Ok(l) => (base, Some(l)),
            Err(_) => (name, None),
        },
        _ => (name, None),
    }
}

/// # Safety
/// Called by ggml's scheduler with a valid node; `ask` asks whether the node is wanted, the second
/// call comes after its backend was synchronised.
unsafe extern "C" fn on_node(t: *mut sys::ggml_tensor, ask: bool, _user: *mut c_void) -> bool {
    if ask {
        return true;
    }
    let now = Instant::now();
    let mut guard = PROFILE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(p) = guard.as_mut() else { return true };
    let Some(last) = p.last.replace(now) else { return true };
    let us = (now - last).as_secs_f64() * 1e6;
    // SAFETY: ggml passes a live node; its name is a NUL-terminated array and ggml_op_desc a static string.
    let (name, op) = unsafe { (CStr::from_ptr((*t).name.as_ptr()).to_string_lossy(), CStr::from_ptr(sys::ggml_op_desc(t)).to_string_lossy()) };
    let (base, layer) = split_layer(&name);
    let e = p.by_op.entry((op.into_owned(), base.to_owned())).or_insert((0.0, 0));
    e.0 += us;
    e.1 += 1;
    match layer {
        Some(l) => *p.by_layer.entry(l).or_insert(0.0) += us,
        None => p.unlayered_us += us,
    }
    // SAFETY: as above.
    if let (Some(l), true) = (layer, unsafe { (*t).op } == sys::GGML_OP_MUL_MAT_ID) {
        *p.mm_by_layer.entry((l, base.to_owned())).or_insert(0.0) += us;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::split_layer;

    #[test]
    fn layer_suffixes_are_split_off() {
        assert_eq!(split_layer("ffn_moe_gate-12"), ("ffn_moe_gate", Some(12)));
        assert_eq!(split_layer("result_output"), ("result_output", None));
        assert_eq!(split_layer("attn_norm-0 (reshaped)"), ("attn_norm-0 (reshaped)", None));
        assert_eq!(split_layer("-3"), ("-3", None));
    }
}
