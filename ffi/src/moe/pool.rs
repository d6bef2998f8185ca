//! `--pool-workers N`: a dedicated pool of CPU workers for the cold experts of decode batches,
//! so that they run while the GPU computes the hot ones. A tiered layer's graph then has
//!
//!   launch (CPU, one thread) -> the hot tier (GPU, queued asynchronously) -> join (CPU, one thread)
//!
//! launch copies the token rows and the selections into the job and wakes the workers; join
//! takes part in the work, waits for the rest and copies the result out. ggml's scheduler runs
//! the GPU split between the two without waiting for it, so the CPU and the GPU overlap. One job
//! runs at a time: the graph orders every layer's join before the next layer's launch, and a
//! launch from another thread's graph (a second context of the model) waits for the job's join.
//!
//! A job has two phases (gate/up, then down), each cut into chunks that whoever runs claims: a
//! worker without a core (the machine oversubscribed) delays nobody, as the caller and the other
//! workers take its chunks.

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::ThreadId;

use super::kernels::{cold_items, down_rows, gate_up_rows, ids, src, src_opt, tally, token_row, uploaded, weighted_output, weights};
use super::layer::LayerTiers;
use crate::sys;

/// Spins before a worker sleeps: decode launches a job per layer every few tens of microseconds.
const SPIN: u32 = 200_000;
/// Fewest rows (dot products of one weight row) in a chunk.
const MIN_CHUNK_ROWS: usize = 16;

#[derive(Default)]
struct Job {
    lt: usize,
    n_used: usize,
    /// Input rows of the tokens with a cold selection, and each token's row in it.
    x: Vec<f32>,
    x_row: Vec<usize>,
    uploaded: Vec<bool>,
    sel: Vec<i32>,
    /// (token, slot, cold row) of each cold selection to compute.
    items: Vec<(usize, usize, usize)>,
    /// Routing weights, for prompt batches (the weighted output form).
    w: Option<Vec<f32>>,
    h: Vec<f32>,
    out: Vec<f32>,
    /// h and out as launch left them: chunks write disjoint rows through these.
    h_ptr: usize,
    out_ptr: usize,
    /// Rows of each phase and rows per chunk.
    rows: [usize; 2],
    chunk: [usize; 2],
}

impl Job {
    fn chunks(&self, phase: usize) -> usize {
        self.rows[phase].div_ceil(self.chunk[phase])
    }
}

struct Shared {
    n: usize,
    job: UnsafeCell<Job>,
    /// Incremented by launch; wakes the workers.
    generation: AtomicU64,
    /// Per phase: the job's generation (high 32 bits) and the next chunk to claim, so that a
    /// claim can only take a chunk of the job it was made for.
    claim: [AtomicU64; 2],
    /// Chunks finished per phase of the current job.
    finished: [AtomicUsize; 2],
    /// Chunks per phase of the current job (set before its claims open).
    chunks: [AtomicUsize; 2],
    sleep: Mutex<()>,
    wake: Condvar,
    /// The thread whose graph launched the job and has not joined it yet.
    owner: Mutex<Option<ThreadId>>,
    released: Condvar,
}

// SAFETY: `job` is written only by launch, on the thread that owns the pool (`owner`), while no
// chunk of the previous job is claimed or running, and read by a chunk's runner only after its
// claim succeeded (the job cannot finish, so cannot be replaced, before that chunk is counted
// finished); chunks write disjoint rows; join copies it out on the owning thread.
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
    pub(crate) fn workers(&self) -> usize {
        self.shared.n
    }

    fn start(n: usize) -> Pool {
        let shared = Arc::new(Shared::new(n));
        for _ in 0..n {
            let s = shared.clone();
            std::thread::Builder::new().name("strata-cold".into()).spawn(move || worker(&s)).expect("spawn a cold-expert worker");
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

fn tag(gen: u64) -> u64 {
    gen & 0xffff_ffff
}

impl Shared {
    /// Claims and runs chunks of `phase` of job `gen` until none is left; false when that job
    /// is no longer the current one.
    fn work(&self, gen: u64, phase: usize) -> bool {
        loop {
            let v = self.claim[phase].load(Ordering::Acquire);
            if v >> 32 != tag(gen) {
                return false;
            }
            let next = (v & 0xffff_ffff) as usize;
            if next >= self.chunks[phase].load(Ordering::Acquire) {
                return true;
            }
            if self.claim[phase].compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue;
            }
            // SAFETY: see `Shared`: this claimed chunk keeps the job in place until counted.
            let job = unsafe { &*self.job.get() };
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_chunk(job, phase, next)));
            if run.is_err() {
                // The join would wait for this chunk forever and the layer's result is incomplete.
                eprintln!("strata: a cold-expert chunk failed; aborting");
                std::process::abort();
            }
            self.finished[phase].fetch_add(1, Ordering::Release);
        }
    }

    /// Whether every chunk of `phase` of job `gen` is finished (true too when the job is gone).
    fn phase_done(&self, gen: u64, phase: usize) -> bool {
        self.claim[phase].load(Ordering::Acquire) >> 32 != tag(gen)
            || self.finished[phase].load(Ordering::Acquire) >= self.chunks[phase].load(Ordering::Acquire)
    }

    /// Takes part in job `gen` until it is complete.
    fn complete(&self, gen: u64) {
        self.work(gen, 0);
        wait_until(|| self.phase_done(gen, 0));
        self.work(gen, 1);
        wait_until(|| self.phase_done(gen, 1));
    }
}

fn run_chunk(job: &Job, phase: usize, i: usize) {
    // SAFETY: launch stored a LayerTiers that the registry keeps alive while graphs run.
    let lt = unsafe { &*(job.lt as *const LayerTiers) };
    let (r0, r1) = (i * job.chunk[phase], ((i + 1) * job.chunk[phase]).min(job.rows[phase]));
    if phase == 0 {
        let n_embd = lt.n_embd;
        let x = |t: usize| &job.x[job.x_row[t] * n_embd..(job.x_row[t] + 1) * n_embd];
        gate_up_rows(lt, x, &job.items, job.n_used, job.h_ptr as *mut f32, r0, r1);
    } else {
        down_rows(lt, job.h_ptr as *const f32, &job.sel, &job.uploaded, job.w.as_deref(), job.n_used, job.out_ptr as *mut f32, r0, r1);
    }
}

fn worker(s: &Shared) {
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
                // No spinning again after a wake without a job: idle workers (zero-copy decode
                // gives them none) would otherwise spin every 50 ms and take the host's cores.
            }
        };
        seen = gen;
        if s.work(gen, 0) {
            wait_until(|| s.phase_done(gen, 0));
            s.work(gen, 1);
        }
    }
}

/// The launch op. Sources: cur [n_embd, 1, n_tok] f32, sel [n_used, n_tok] i32, the routing
/// weights [1, n_used, n_tok] (read only for the weighted form; decode gives sel in their
/// place), the upload op's ids when the step uploads (`--pcie-frac`),
/// then the cold weight tensors (they place the op on the CPU).
/// Writes one f32 (the join's dependency).
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn launch(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, userdata: *mut c_void) {
    // ggml calls a custom op on every thread of the graph; one launches.
    if ith != 0 {
        return;
    }
    // SAFETY: userdata is the layer's LayerTiers, kept alive by the registry while graphs exist.
    let lt = unsafe { &*(userdata as *const LayerTiers) };
    let Some(pool) = POOL.get() else { return };
    // SAFETY: the graph builder gave this op these sources.
    unsafe { start(pool, lt, src(dst, 0), src(dst, 1), src(dst, 2), src_opt(dst, 3)) };
    // SAFETY: dst is one f32.
    unsafe { *((*dst).data as *mut f32) = 0.0 };
}

/// Hands a step's cold selections to the workers (see `launch` for the sources).
fn start(pool: &Pool, lt: &LayerTiers, cur: &sys::ggml_tensor, sel: &sys::ggml_tensor, wt: &sys::ggml_tensor, upload_ids: Option<&sys::ggml_tensor>) {
    let s = &pool.shared;
    let (n_used, n_tok) = (sel.ne[0] as usize, sel.ne[1] as usize);
    s.acquire();
    // A graph of this thread stopped between a launch and its join leaves a job unfinished: finish it.
    let prev = s.generation.load(Ordering::Acquire);
    if prev > 0 {
        s.complete(prev);
    }
    // SAFETY: no chunk of any job is claimed or running now, so nothing reads the job.
    let job = unsafe { &mut *s.job.get() };
    job.lt = lt as *const LayerTiers as usize;
    job.n_used = n_used;
    job.sel.clear();
    // SAFETY: sel is the contiguous i32 [n_used, n_tok] the builder made.
    job.sel.extend_from_slice(unsafe { ids(sel) });
    job.uploaded = uploaded(lt, upload_ids);
    job.items = cold_items(lt, &job.sel, n_used, &job.uploaded);
    job.x.clear();
    job.x_row.clear();
    for t in 0..n_tok {
        if job.sel[t * n_used..(t + 1) * n_used].iter().any(|&e| lt.cold_row(e).is_some()) {
            job.x_row.push(job.x.len() / lt.n_embd);
            job.x.extend_from_slice(token_row(cur, t, lt.n_embd));
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
    job.rows = [job.items.len() * lt.n_ff, lt.n_embd];
    // About four chunks per participant (the workers and the caller), none tiny.
    let per = |rows: usize| rows.div_ceil(4 * (s.n + 1)).max(MIN_CHUNK_ROWS);
    job.chunk = [per(job.rows[0]), per(job.rows[1])];
    tally(lt, &job.sel);
    let gen = prev + 1;
    for p in 0..2 {
        s.chunks[p].store(job.chunks(p), Ordering::Relaxed);
        s.finished[p].store(0, Ordering::Relaxed);
        s.claim[p].store(tag(gen) << 32, Ordering::Release);
    }
    s.generation.store(gen, Ordering::Release);
    let _guard = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
    s.wake.notify_all();
}

/// Takes part in the current job until it is complete, then copies its output into `out`, a
/// buffer of `out_len` floats, and lets the next launch in.
fn finish(pool: &Pool, out: *mut f32, out_len: usize) {
    let s = &pool.shared;
    if !s.owned_here() {
        eprintln!("strata: a cold-expert join without its launch on this thread; aborting");
        std::process::abort();
    }
    s.complete(s.generation.load(Ordering::Acquire));
    // SAFETY: the job is complete and this thread owns the pool until release.
    let job = unsafe { &*s.job.get() };
    if job.out.len() != out_len {
        eprintln!("strata: a cold-expert join for {out_len} floats got a job of {}; aborting", job.out.len());
        std::process::abort();
    }
    // SAFETY: out holds out_len floats, checked equal to the job's output.
    unsafe { std::ptr::copy_nonoverlapping(job.out.as_ptr(), out, out_len) };
    s.release();
}

impl Shared {
    fn new(n: usize) -> Shared {
        Shared {
            n,
            job: UnsafeCell::new(Job::default()),
            generation: AtomicU64::new(0),
            claim: [AtomicU64::new(0), AtomicU64::new(0)],
            finished: [AtomicUsize::new(0), AtomicUsize::new(0)],
            chunks: [AtomicUsize::new(0), AtomicUsize::new(0)],
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            owner: Mutex::new(None),
            released: Condvar::new(),
        }
    }

    /// Waits until no other thread's graph holds a job, then takes the pool for this thread's.
    fn acquire(&self) {
        let me = std::thread::current().id();
        let mut owner = self.owner.lock().unwrap_or_else(|e| e.into_inner());
        while owner.is_some_and(|t| t != me) {
            owner = self.released.wait(owner).unwrap_or_else(|e| e.into_inner());
        }
        *owner = Some(me);
    }

    fn owned_here(&self) -> bool {
        *self.owner.lock().unwrap_or_else(|e| e.into_inner()) == Some(std::thread::current().id())
    }

    fn release(&self) {
        *self.owner.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.released.notify_all();
    }
}

/// The join op. Source: the launch op's output. Writes op B's output (kernels.rs).
///
/// # Safety
/// Called by ggml as a custom op: `dst` is the op's live tensor with the sources listed above,
/// and `userdata` the layer's `LayerTiers`, alive for the graph. A panic here aborts (it cannot
/// unwind through ggml's C frames).
pub(crate) unsafe extern "C" fn join(dst: *mut sys::ggml_tensor, ith: i32, _nth: i32, _userdata: *mut c_void) {
    if ith != 0 {
        return;
    }
    let Some(pool) = POOL.get() else { return };
    // SAFETY: dst is the op's live f32 tensor.
    let (out, len) = unsafe { ((*dst).data as *mut f32, sys::ggml_nelements(dst) as usize) };
    finish(pool, out, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    #[test]
    fn a_second_threads_launch_waits_for_the_first_threads_join() {
        let s = Arc::new(Shared::new(1));
        s.acquire();
        // the same thread again: its earlier graph stopped before its join
        s.acquire();
        assert!(s.owned_here());
        let entered = Arc::new(AtomicBool::new(false));
        let other = {
            let (s, entered) = (s.clone(), entered.clone());
            std::thread::spawn(move || {
                s.acquire();
                entered.store(true, Ordering::SeqCst);
                assert!(s.owned_here());
                s.release();
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!entered.load(Ordering::SeqCst), "the other thread took the job slot before this thread's join");
        s.release();
        other.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
        assert!(!s.owned_here());
    }
}
