//! `--pool-workers N`: a dedicated pool of CPU workers for the cold experts of decode batches,
//! so that they run while the GPU computes the hot ones. A tiered layer's graph then has
//!
//!   launch (CPU, one thread) -> the hot tier (GPU, queued asynchronously) -> join (CPU, one thread)
//!
//! launch copies the token rows and the selections into the job and wakes the workers; join
//! waits for them and copies the result out. ggml's scheduler runs the GPU split between the two
//! without waiting for it, so the CPU and the GPU overlap. One job runs at a time: the graph
//! orders every layer's join before the next layer's launch.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use super::kernels::{down_rows, gate_up_rows, src_opt, tally, uploaded, weighted_output, weights};
use super::LayerTiers;
use crate::sys;

/// Spins before a worker sleeps: decode launches a job per layer every few tens of microseconds.
const SPIN: u32 = 200_000;

#[derive(Default)]
struct Job {
    lt: usize,
    n_used: usize,
    /// Input rows of the tokens with a cold selection, and each token's row in it.
    x: Vec<f32>,
    x_row: Vec<usize>,
    uploaded: Vec<bool>,
    sel: Vec<i32>,
    /// Routing weights, for prompt batches (the weighted output form).
    w: Option<Vec<f32>>,
    h: Vec<f32>,
    out: Vec<f32>,
    /// h and out as launch left them: workers write disjoint rows through these.
    h_ptr: usize,
    out_ptr: usize,
}

struct Shared {
    n: usize,
    job: UnsafeCell<Job>,
    /// Incremented by launch; workers run the job of each new value once.
    generation: AtomicU64,
    /// Workers done with the gate/up phase, then with the job.
    phase_a: AtomicUsize,
    done: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by launch, while no worker runs (the previous job was joined),
// and read by workers only between a generation bump and `done`; the phases give each worker
// disjoint output rows.
unsafe impl Sync for Shared {}

pub(crate) struct Pool {
    shared: Arc<Shared>,
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// The process's pool, started with `n` workers on first use (later calls keep the first size).
pub(crate) fn get(n: usize) -> &'static Pool {
    POOL.get_or_init(|| Pool::start(n.max(1)))
}

impl Pool {
    fn start(n: usize) -> Pool {
        let shared = Arc::new(Shared {
            n,
            job: UnsafeCell::new(Job::default()),
            generation: AtomicU64::new(0),
            phase_a: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 0..n {
            let s = shared.clone();
            std::thread::Builder::new().name(format!("strata-cold-{i}")).spawn(move || worker(&s, i)).expect("spawn a cold-expert worker");
        }
        Pool { shared }
    }
}

fn wait_until(mut ready: impl FnMut() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        spins += 1;
        if spins < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn worker(s: &Shared, i: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let gen = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                break g;
            }
            spins += 1;
            if spins < SPIN {
                std::hint::spin_loop();
            } else {
                let guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                if s.generation.load(Ordering::Acquire) == seen {
                    let _unused = s.wake.wait_timeout(guard, std::time::Duration::from_millis(50));
                }
                spins = 0;
            }
        };
        seen = gen;
        // SAFETY: see `Shared`: the job is stable until every worker has counted itself done.
        let job = unsafe { &*s.job.get() };
        // SAFETY: launch stored a LayerTiers that the registry keeps alive while graphs run.
        let lt = unsafe { &*(job.lt as *const LayerTiers) };
        let n_embd = lt.n_embd;
        let x = |t: usize| &job.x[job.x_row[t] * n_embd..(job.x_row[t] + 1) * n_embd];
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gate_up_rows(lt, x, &job.sel, job.n_used, &job.uploaded, job.h_ptr as *mut f32, i, s.n);
            s.phase_a.fetch_add(1, Ordering::AcqRel);
            wait_until(|| s.phase_a.load(Ordering::Acquire) == s.n);
            down_rows(lt, job.h_ptr as *const f32, &job.sel, &job.uploaded, job.w.as_deref(), job.n_used, job.out_ptr as *mut f32, i, s.n);
        }));
        if run.is_err() {
            // The join would wait for this worker forever and the layer's result is incomplete.
            eprintln!("strata: a cold-expert worker failed; aborting");
            std::process::abort();
        }
        s.done.fetch_add(1, Ordering::Release);
    }
}

unsafe fn src<'a>(dst: *mut sys::ggml_tensor, i: usize) -> &'a sys::ggml_tensor {
    // SAFETY: the caller built dst with at least i+1 sources.
    unsafe { &*(*dst).src[i] }
}

/// The launch op. Sources: cur [n_embd, 1, n_tok] f32, sel [n_used, n_tok] i32, the routing
/// weights [1, n_used, n_tok], the upload op's ids when the step uploads (`--pcie-frac`), then
/// the cold weight tensors (they place the op on the CPU).
/// Writes one f32 (the join's dependency).
pub(crate) unsafe extern "C" fn launch(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    // ggml calls a custom op on every thread of the graph; one launches.
    if ith != 0 {
        return;
    }
    // SAFETY: userdata is the layer's LayerTiers, kept alive by the registry while graphs exist.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    let Some(pool) = POOL.get() else { return };
    let s = &pool.shared;
    // SAFETY: the graph builder gave this op these sources; sel is contiguous.
    let (cur, sel, wt) = unsafe { (src(dst, 0), src(dst, 1), src(dst, 2)) };
    let (n_used, n_tok) = (sel.ne[0] as usize, sel.ne[1] as usize);
    // A graph stopped between a launch and its join leaves a job running: let it finish.
    if s.generation.load(Ordering::Acquire) > 0 {
        wait_until(|| s.done.load(Ordering::Acquire) == s.n);
    }
    // SAFETY: no job runs now, so no worker reads the job.
    let job = unsafe { &mut *s.job.get() };
    job.lt = lt as *const LayerTiers as usize;
    job.n_used = n_used;
    job.sel.clear();
    // SAFETY: sel holds n_used * n_tok contiguous ids.
    job.sel.extend_from_slice(unsafe { std::slice::from_raw_parts(sel.data as *const i32, n_used * n_tok) });
    // SAFETY: the builder puts the upload op's ids, when there is one, after the weights.
    job.uploaded = uploaded(lt, unsafe { src_opt(dst, 3) });
    job.x.clear();
    job.x_row.clear();
    for t in 0..n_tok {
        if job.sel[t * n_used..(t + 1) * n_used].iter().any(|&e| lt.cold_row(e).is_some()) {
            job.x_row.push(job.x.len() / lt.n_embd);
            // SAFETY: cur row t holds n_embd floats.
            job.x.extend_from_slice(unsafe { std::slice::from_raw_parts(cur.data.cast::<u8>().add(t * cur.nb[2]) as *const f32, lt.n_embd) });
        } else {
            job.x_row.push(usize::MAX);
        }
    }
    job.h.resize(lt.n_ff * n_used * n_tok, 0.0);
    if weighted_output(n_tok) {
        weights(wt, job.w.get_or_insert_with(Vec::new));
        job.out.resize(lt.n_embd * n_tok, 0.0);
    } else {
        job.w = None;
        job.out.resize(lt.n_embd * n_used * n_tok, 0.0);
    }
    job.h_ptr = job.h.as_mut_ptr() as usize;
    job.out_ptr = job.out.as_mut_ptr() as usize;
    tally(lt, &job.sel);
    s.phase_a.store(0, Ordering::Relaxed);
    s.done.store(0, Ordering::Relaxed);
    s.generation.fetch_add(1, Ordering::Release);
    let _guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
    s.wake.notify_all();
    // SAFETY: dst is one f32.
    unsafe { *((*dst).data as *mut f32) = 0.0 };
}

/// The join op. Source: the launch op's output. Writes op B's output (kernels.rs).
pub(crate) unsafe extern "C" fn join(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, _userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    let Some(pool) = POOL.get() else { return };
    let s = &pool.shared;
    wait_until(|| s.done.load(Ordering::Acquire) == s.n);
    // SAFETY: every worker is done, so the job is stable; dst holds out.len() floats.
    unsafe {
        let job = &*s.job.get();
        std::ptr::copy_nonoverlapping(job.out.as_ptr(), (*dst).data as *mut f32, job.out.len());
    }
}
