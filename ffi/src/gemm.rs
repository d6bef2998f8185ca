//! Calibrated GEMM dispatch on the GPU backend (patches/0006, kernels/cuda/gemm-dispatch.cuh):
//! before ggml's CUDA/HIP backend picks a kernel for a dense matmul it calls the chooser
//! registered here, which looks the shape up in the table (`STRATA_HIPBLASLT_TUNING`) and may
//! ask for MMQ or one BLASLt algorithm; `STRATA_PREFILL_MMQ=1` asks for MMQ for every quantized
//! prompt-sized product without a row. The backend reports whether a tuned choice ran, or why not
//! (it then takes its own default), and the counters here feed /metrics.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use strata_residency::gemm::{Choice, Device, Fallback, Selection, Shape, Table};

use crate::sys;

/// Mirrors `strata_gemm_desc`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GemmDesc {
    pub device: i32,
    pub type_a: i32,
    pub type_b: i32,
    pub reserved: i32,
    pub m: i64,
    pub n: i64,
    pub k: i64,
    pub lda: i64,
    pub ldb: i64,
    pub ldc: i64,
    pub batch: i64,
}

/// Mirrors `strata_gemm_choice`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmChoice {
    pub kind: i32,
    pub algo: i32,
    pub workspace: u64,
}

const KIND_DEFAULT: i32 = 0;
const KIND_MMQ: i32 = 1;
const KIND_BLASLT: i32 = 2;

/// Columns from which a product counts as prompt processing for `STRATA_PREFILL_MMQ`.
const PREFILL_MIN_COLUMNS: i64 = 32;
/// Workspace a tuned BLASLt row may ask for; a row asking more falls back.
pub const MAX_WORKSPACE: u64 = 64 << 20;

/// The paths a dense matmul took and why tuned choices fell back.
pub const PATHS: [&str; 3] = ["default", "mmq", "blaslt"];
pub const FALLBACKS: [&str; 6] = ["no_entry", "workspace", "layout", "algo", "library", "type"];

static PATH_COUNTS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
static FALLBACK_COUNTS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

struct Dispatch {
    table: Option<Table>,
    prefill_mmq: bool,
}

static DISPATCH: RwLock<Option<Dispatch>> = RwLock::new(None);

/// Dense matmuls by path and tuned choices fallen back by reason, in [`PATHS`] and [`FALLBACKS`]
/// order; None when no chooser is installed.
pub fn counters() -> Option<([u64; 3], [u64; 6])> {
    DISPATCH.read().ok()?.as_ref()?;
    Some((PATH_COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed)), FALLBACK_COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed))))
}

fn type_name(t: i32) -> String {
    if t < 0 || t >= sys::GGML_TYPE_COUNT as i32 {
        return format!("type{t}");
    }
    // SAFETY: a valid type id; ggml returns a static string.
    unsafe { CStr::from_ptr(sys::ggml_type_name(t as sys::ggml_type)).to_string_lossy().into_owned() }
}

fn quantized(t: i32) -> bool {
    // SAFETY: a valid type id (checked).
    t >= 0 && t < sys::GGML_TYPE_COUNT as i32 && unsafe { sys::ggml_is_quantized(t as sys::ggml_type) }
}

/// The table's key for a product (batched products have no rows).
pub fn shape_of(d: &GemmDesc) -> Option<Shape> {
    (d.batch == 1).then(|| Shape {
        type_a: type_name(d.type_a),
        type_b: type_name(d.type_b),
        m: d.m as u64,
        n: d.n as u64,
        k: d.k as u64,
        lda: d.lda as u64,
        ldb: d.ldb as u64,
        ldc: d.ldc as u64,
    })
}

/// What the dispatch asks of the backend for `d`, and the fallback to count when it is the
/// default because no row applies.
fn decide(table: Option<&Table>, prefill_mmq: bool, d: &GemmDesc) -> (GemmChoice, Option<Fallback>) {
    let selection = match (table, shape_of(d)) {
        (Some(t), Some(s)) => t.select(&s, MAX_WORKSPACE),
        _ => Selection::Default(Fallback::NoEntry),
    };
    match selection {
        Selection::Tuned(Choice::Mmq) => (GemmChoice { kind: KIND_MMQ, ..Default::default() }, None),
        Selection::Tuned(Choice::BlasLt { algo, workspace }) => (GemmChoice { kind: KIND_BLASLT, algo: algo as i32, workspace }, None),
        Selection::Default(_) if prefill_mmq && quantized(d.type_a) && d.n >= PREFILL_MIN_COLUMNS => {
            (GemmChoice { kind: KIND_MMQ, ..Default::default() }, None)
        }
        Selection::Default(why) => (GemmChoice::default(), (table.is_some() && d.n >= PREFILL_MIN_COLUMNS).then_some(why)),
    }
}

extern "C" fn choose(d: *const GemmDesc, out: *mut GemmChoice) {
    // SAFETY: the backend passes valid pointers for the call.
    let (d, out) = unsafe { (&*d, &mut *out) };
    *out = GemmChoice::default();
    // A panic must not unwind into C++: the backend's default then runs.
    let decided = std::panic::catch_unwind(|| {
        let guard = DISPATCH.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|disp| decide(disp.table.as_ref(), disp.prefill_mmq, d))
    });
    let Ok(Some((choice, fallback))) = decided else { return };
    *out = choice;
    if choice.kind == KIND_DEFAULT {
        PATH_COUNTS[0].fetch_add(1, Ordering::Relaxed);
    }
    match fallback {
        Some(Fallback::NoEntry) => FALLBACK_COUNTS[0].fetch_add(1, Ordering::Relaxed),
        Some(Fallback::Workspace) => FALLBACK_COUNTS[1].fetch_add(1, Ordering::Relaxed),
        None => 0,
    };
}

extern "C" fn report(_d: *const GemmDesc, kind: i32, outcome: i32) {
    match (outcome, usize::try_from(kind)) {
        (0, Ok(k)) if k < PATHS.len() => PATH_COUNTS[k].fetch_add(1, Ordering::Relaxed),
        _ => {
            PATH_COUNTS[0].fetch_add(1, Ordering::Relaxed);
            // outcomes 1..=4: layout, algo, library, type
            let i = usize::try_from(outcome).map_or(5, |o| (o + 1).min(5));
            FALLBACK_COUNTS[i].fetch_add(1, Ordering::Relaxed)
        }
    };
}

type Register = unsafe extern "C" fn(Option<extern "C" fn(*const GemmDesc, *mut GemmChoice)>, Option<extern "C" fn(*const GemmDesc, i32, i32)>);
type DeviceFn = unsafe extern "C" fn(i32, *mut c_char, *mut c_char, *mut c_char, usize) -> bool;
type AlgosFn = unsafe extern "C" fn(*const GemmDesc, u64) -> i32;

/// A proc address of the first GPU backend registry that has it.
fn proc_address(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: enumerating registered devices has no preconditions; names are NUL-terminated.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let dev = sys::ggml_backend_dev_get(i);
            if sys::ggml_backend_dev_type(dev) != sys::GGML_BACKEND_DEVICE_TYPE_GPU {
                continue;
            }
            if let Some(p) = crate::backend::proc_address(dev, name) {
                return Some(p);
            }
        }
    }
    None
}

/// What GPU `device` (an index of the backend's own devices) is, as the table's validators name
/// it; None without a GPU backend that has the dispatch.
pub fn device(device: i32) -> Option<Device> {
    let f = proc_address(c"ggml_backend_cuda_strata_gemm_device")?;
    // SAFETY: the proc address has the DeviceFn signature (patches/0006).
    let f = unsafe { std::mem::transmute::<*mut c_void, DeviceFn>(f) };
    let mut bufs = [[0 as c_char; 64]; 3];
    let [a, r, b] = &mut bufs;
    // SAFETY: three writable buffers of the length passed.
    if !unsafe { f(device, a.as_mut_ptr(), r.as_mut_ptr(), b.as_mut_ptr(), 64) } {
        return None;
    }
    // SAFETY: the backend wrote NUL-terminated strings within the buffers.
    let s = |p: &[c_char; 64]| unsafe { CStr::from_ptr(p.as_ptr()) }.to_string_lossy().into_owned();
    Some(Device { arch: s(&bufs[0]), runtime: s(&bufs[1]), blaslt: s(&bufs[2]) })
}

/// BLASLt algorithms the heuristic returns for `d` within `workspace` bytes (the tuner's
/// candidates); 0 without the dispatch or without BLASLt.
pub fn blaslt_algos(d: &GemmDesc, workspace: u64) -> i32 {
    let Some(f) = proc_address(c"ggml_backend_cuda_strata_gemm_algos") else { return 0 };
    // SAFETY: the proc address has the AlgosFn signature; d is valid for the call.
    unsafe { std::mem::transmute::<*mut c_void, AlgosFn>(f)(d, workspace) }
}

/// Installs the chooser with `table` (already checked against the device) and the MMQ switch.
/// Err when the GPU backend has no dispatch (no GPU, or a build without patches/0006).
pub fn install(table: Option<Table>, prefill_mmq: bool) -> Result<(), String> {
    let f = proc_address(c"ggml_backend_cuda_strata_gemm_register").ok_or("no GPU backend with Strata's GEMM dispatch (patches/0006)")?;
    *DISPATCH.write().unwrap_or_else(|e| e.into_inner()) = Some(Dispatch { table, prefill_mmq });
    // SAFETY: the proc address has the Register signature; the functions live for the process.
    unsafe { std::mem::transmute::<*mut c_void, Register>(f)(Some(choose), Some(report)) };
    Ok(())
}

/// Runs the chooser as the backend would, for tests: the choice for `d`.
pub fn choice_for(table: Option<&Table>, prefill_mmq: bool, d: &GemmDesc) -> GemmChoice {
    decide(table, prefill_mmq, d).0
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "strata-gemm-table 1
validator arch sm_90
validator runtime 13000
validator blaslt 130100
f16 f32 4096 512 2048 2048 2048 4096 blaslt 3 1048576 1.21
q8_0 f32 2048 512 2048 2048 2048 2048 mmq - 0 1.08
f16 f32 4096 8192 2048 2048 2048 4096 blaslt 1 1073741824 1.30
";

    fn desc(type_a: sys::ggml_type, m: i64, n: i64, k: i64) -> GemmDesc {
        GemmDesc { type_a: type_a as i32, type_b: sys::GGML_TYPE_F32 as i32, m, n, k, lda: k, ldb: k, ldc: m, batch: 1, ..Default::default() }
    }

    #[test]
    fn a_row_is_chosen_by_type_shape_and_strides() {
        let t = Table::parse(TABLE).unwrap();
        let f16 = desc(sys::GGML_TYPE_F16, 4096, 512, 2048);
        assert_eq!(choice_for(Some(&t), false, &f16), GemmChoice { kind: KIND_BLASLT, algo: 3, workspace: 1048576 });
        assert_eq!(choice_for(Some(&t), false, &desc(sys::GGML_TYPE_Q8_0, 2048, 512, 2048)).kind, KIND_MMQ);
        // Another stride, a batch, or a row whose workspace is over the limit: the default.
        assert_eq!(choice_for(Some(&t), false, &GemmDesc { ldb: 4096, ..f16 }), GemmChoice::default());
        assert_eq!(choice_for(Some(&t), false, &GemmDesc { batch: 2, ..f16 }), GemmChoice::default());
        assert_eq!(decide(Some(&t), false, &desc(sys::GGML_TYPE_F16, 4096, 8192, 2048)), (GemmChoice::default(), Some(Fallback::Workspace)));
    }

    #[test]
    fn prefill_mmq_takes_quantized_prompt_products_without_a_row() {
        let q4 = desc(sys::GGML_TYPE_Q4_K, 2048, 512, 2048);
        assert_eq!(choice_for(None, true, &q4).kind, KIND_MMQ);
        assert_eq!(choice_for(None, false, &q4).kind, KIND_DEFAULT);
        // Decode-sized products and float weights keep the backend's choice.
        assert_eq!(choice_for(None, true, &GemmDesc { n: 1, ..q4 }).kind, KIND_DEFAULT);
        assert_eq!(choice_for(None, true, &desc(sys::GGML_TYPE_F16, 2048, 512, 2048)).kind, KIND_DEFAULT);
    }

    #[test]
    fn reports_count_paths_and_fallback_reasons() {
        let before = FALLBACK_COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed));
        let d = desc(sys::GGML_TYPE_F16, 8, 8, 8);
        report(&d, KIND_BLASLT, 2);
        report(&d, KIND_MMQ, 4);
        let after = FALLBACK_COUNTS.each_ref().map(|c| c.load(Ordering::Relaxed));
        assert_eq!(after[3] - before[3], 1, "algo");
        assert_eq!(after[5] - before[5], 1, "type");
    }

    #[test]
    fn without_a_gpu_there_is_nothing_to_install() {
        assert!(device(0).is_none());
        assert!(install(None, true).unwrap_err().contains("patches/0006"));
        assert_eq!(blaslt_algos(&desc(sys::GGML_TYPE_F16, 8, 8, 8), 0), 0);
    }
}
