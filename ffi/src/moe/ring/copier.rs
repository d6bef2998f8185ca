//! How copies reach the ring: the backend's copy functions (patches/0002) or memcpy in the
//! emulation, and the copier thread that runs jobs of copies, gathering pageable sources
//! through the page-locked staging buffer and pacing what it issues.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use super::super::types::RingFault as Fault;
use super::{Ring, PREFETCH_MIN_P};
use crate::sys;

/// Functions of patches/0002, from the CUDA (or HIP) backend's proc addresses.
type RingNew = unsafe extern "C" fn(i32, usize) -> *mut c_void;
type RingFree = unsafe extern "C" fn(*mut c_void);
type RingSize = unsafe extern "C" fn(*mut c_void) -> usize;
type WindowNew = unsafe extern "C" fn(*mut c_void, usize) -> sys::ggml_backend_buffer_t;
type CopyH2d = unsafe extern "C" fn(i32, *mut c_void, *const c_void, usize) -> bool;
type CopyWait = unsafe extern "C" fn(i32) -> bool;

#[derive(Clone, Copy)]
pub(super) struct Fns {
    pub(super) ring_new: RingNew,
    pub(super) ring_free: RingFree,
    pub(super) ring_size: RingSize,
    pub(super) window_new: WindowNew,
    copy_h2d: CopyH2d,
    copy_wait: CopyWait,
}

impl Fns {
    pub(super) fn load(dev: sys::ggml_backend_dev_t) -> Option<Self> {
        let get = |name: &std::ffi::CStr| crate::backend::proc_address(dev, name);
        // SAFETY: each proc address, when present, has the signature patches/0002 gives it and
        // lives as long as the process.
        unsafe {
            Some(Self {
                ring_new: std::mem::transmute::<*mut c_void, RingNew>(get(c"ggml_backend_cuda_ring_new")?),
                ring_free: std::mem::transmute::<*mut c_void, RingFree>(get(c"ggml_backend_cuda_ring_free")?),
                ring_size: std::mem::transmute::<*mut c_void, RingSize>(get(c"ggml_backend_cuda_ring_size")?),
                window_new: std::mem::transmute::<*mut c_void, WindowNew>(get(c"ggml_backend_cuda_window_new")?),
                copy_h2d: std::mem::transmute::<*mut c_void, CopyH2d>(get(c"ggml_backend_cuda_copy_h2d")?),
                copy_wait: std::mem::transmute::<*mut c_void, CopyWait>(get(c"ggml_backend_cuda_copy_wait")?),
            })
        }
    }
}

/// How copies reach the ring.
#[derive(Clone, Copy)]
pub(super) enum Copier {
    Device {
        fns: Fns,
        dev: i32,
    },
    /// CPU emulation: plain memcpy.
    Host,
}

impl Copier {
    fn copy(&self, dst: *mut u8, src: *const u8, n: usize) -> bool {
        match *self {
            // SAFETY: dst is a device range of n bytes inside a window; src n readable host bytes.
            Copier::Device { fns, dev } => unsafe { (fns.copy_h2d)(dev, dst.cast(), src.cast(), n) },
            Copier::Host => {
                // SAFETY: as above, both on the host and not overlapping (ring vs source).
                unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
                true
            }
        }
    }

    fn wait(&self) -> bool {
        match *self {
            // SAFETY: valid device index.
            Copier::Device { fns, dev } => unsafe { (fns.copy_wait)(dev) },
            Copier::Host => true,
        }
    }
}

/// One copy of an expert matrix: host source, ring destination.
#[derive(Clone, Copy)]
pub(super) struct Piece {
    pub(super) dst: usize,
    pub(super) src: usize,
    pub(super) bytes: usize,
}

/// A batch of copies, done when `done` says so.
pub(super) struct Job {
    pub(super) pieces: Vec<Piece>,
    /// Gather through the page-locked staging half `h` first (pageable sources).
    pub(super) staging: Option<usize>,
    pub(super) done: Arc<Done>,
    /// The ring's count of jobs when this one was submitted, from 1 (for fault injection).
    pub(super) seq: u64,
}

impl Drop for Job {
    /// A job that never ran (the copier died holding it, or it was queued when it did) failed.
    fn drop(&mut self) {
        self.done.set_once(false);
    }
}

#[derive(Default)]
pub(super) struct Done {
    state: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Done {
    pub(super) fn set(&self, ok: bool) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(ok);
        self.cv.notify_all();
    }

    fn set_once(&self, ok: bool) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.is_none() {
            *s = Some(ok);
            self.cv.notify_all();
        }
    }

    /// Whether the job has ended, without waiting.
    #[cfg(test)]
    pub(super) fn ended(&self) -> Option<bool> {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits; returns (copies succeeded, whether the caller had to wait).
    pub(super) fn wait(&self) -> (bool, bool) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let stalled = s.is_none();
        while s.is_none() {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        (s.unwrap_or(false), stalled)
    }
}

/// The page-locked staging buffer: one half of the ring's worth of experts per ring half.
pub(super) struct Staging {
    pub(super) buf: sys::ggml_backend_buffer_t,
    pub(super) base: usize,
    pub(super) half_bytes: usize,
}

// SAFETY: the buffer is only written by the copier thread, one job at a time.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated by Ring::spawn, owned by one copier thread, freed once.
        unsafe { sys::ggml_backend_buffer_free(self.buf) };
    }
}

/// Consecutive runs of `items` of at most `pace` bytes each (an item larger than that alone),
/// or all of them as one run without a pace.
fn paced<T>(items: &[T], bytes: impl Fn(&T) -> usize, pace: Option<usize>) -> Vec<&[T]> {
    let Some(limit) = pace else { return vec![items] };
    let mut runs = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (i, it) in items.iter().enumerate() {
        if i > start && sum + bytes(it) > limit {
            runs.push(&items[start..i]);
            (start, sum) = (i, 0);
        }
        sum += bytes(it);
    }
    if start < items.len() {
        runs.push(&items[start..]);
    }
    runs
}

/// Where a job's pieces go in the staging buffer: packed from the start of half `h`, every job
/// into the same addresses (the buffer is allocated once), as many pieces as the half holds.
fn stage(pieces: &[Piece], base: usize, half_bytes: usize, h: usize) -> Vec<(usize, Piece)> {
    let mut off = 0usize;
    let mut staged = Vec::with_capacity(pieces.len());
    for p in pieces {
        if off + p.bytes > half_bytes {
            break;
        }
        staged.push((base + h * half_bytes + off, *p));
        off += p.bytes;
    }
    staged
}

pub(super) fn copier_thread(copier: Copier, rx: mpsc::Receiver<Job>, staging: Option<Staging>, pace: Option<usize>, fault: Option<Fault>) {
    while let Ok(job) = rx.recv() {
        assert!(fault != Some(Fault::Die(job.seq)), "prefill ring copier: fault injected at job {}", job.seq);
        let ok = run(copier, &job, staging.as_ref(), pace, fault);
        job.done.set(ok);
    }
}

/// Runs a job's copies; whether all succeeded. Without `staging` pageable sources are copied
/// as they are (slower, and synchronous on a device).
pub(super) fn run(copier: Copier, job: &Job, staging: Option<&Staging>, pace: Option<usize>, fault: Option<Fault>) -> bool {
    if fault == Some(Fault::Copy(job.seq)) {
        return false;
    }
    let gather_threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
    {
        // Paced, other host-to-device copies (a batch's ids) queue behind one run, not the whole job.
        match (staging, job.staging) {
            (Some(st), Some(h)) => {
                // Gather into staging half h (parallel reads of the pageable source), then copy.
                let staged = stage(&job.pieces, st.base, st.half_bytes, h);
                let fits = staged.len() == job.pieces.len();
                let chunk = staged.len().div_ceil(gather_threads).max(1);
                std::thread::scope(|s| {
                    for part in staged.chunks(chunk) {
                        s.spawn(move || {
                            for &(at, p) in part {
                                // SAFETY: staging and source ranges are valid and disjoint.
                                unsafe { std::ptr::copy_nonoverlapping(p.src as *const u8, at as *mut u8, p.bytes) };
                            }
                        });
                    }
                });
                fits && paced(&staged, |s| s.1.bytes, pace)
                    .into_iter()
                    .all(|run| run.iter().all(|&(at, p)| copier.copy(p.dst as *mut u8, at as *const u8, p.bytes)) && copier.wait())
            }
            _ => paced(&job.pieces, |p| p.bytes, pace)
                .into_iter()
                .all(|run| run.iter().all(|p| copier.copy(p.dst as *mut u8, p.src as *const u8, p.bytes)) && copier.wait()),
        }
    }
}

/// How the copier is started (again, should it die).
#[derive(Clone, Copy, Default)]
pub(super) struct CopierCfg {
    /// Where the staging buffer for pageable sources comes from, and its bytes.
    staging: Option<(sys::ggml_backend_buffer_type_t, usize)>,
    pace: Option<usize>,
    fault: Option<Fault>,
}

/// Starting, restarting and feeding the ring's copier.
impl Ring {
    /// Starts the copier thread with a staging buffer for pageable sources (of `bytes_per_half`
    /// per half, page-locked when `buft` is the device's host buffer type). `pace`: at most
    /// that many bytes in flight, each group waited for before the next is issued (None: a
    /// job's copies all at once). `min_p`: the least chance of use for which a cold expert is
    /// prefetched (None: PREFETCH_MIN_P). Returns a note for the start-up log when the copier
    /// thread could not start (copies then run on the thread that computes the graph).
    pub(crate) fn start(
        self: &Arc<Self>,
        staging_buft: Option<sys::ggml_backend_buffer_type_t>,
        expert_bytes: usize,
        pace: Option<usize>,
        min_p: Option<f64>,
        fault: Option<Fault>,
    ) -> Result<Option<String>, String> {
        self.prefetch_min_p.store(min_p.unwrap_or(PREFETCH_MIN_P).to_bits(), Ordering::Relaxed);
        let staging = staging_buft.filter(|_| !self.pinned_src).map(|b| (b, 2 * self.half * expert_bytes));
        *self.copier_cfg.lock().unwrap_or_else(|e| e.into_inner()) = CopierCfg { staging, pace, fault };
        match self.spawn() {
            Ok(()) => Ok(None),
            Err(e) if e.starts_with("the prefill ring's staging") => Err(e),
            Err(e) => Ok(Some(format!("{e}; copies run on the thread that computes the graph, without overlap"))),
        }
    }

    /// Starts a copier thread with its own staging buffer, replacing one that has ended.
    fn spawn(&self) -> Result<(), String> {
        let cfg = *self.copier_cfg.lock().unwrap_or_else(|e| e.into_inner());
        let staging = match cfg.staging {
            Some((buft, bytes)) => {
                // SAFETY: valid buffer type.
                let buf = unsafe { sys::ggml_backend_buft_alloc_buffer(buft, bytes) };
                if buf.is_null() {
                    return Err(format!("the prefill ring's staging buffer ({bytes} bytes, page-locked) could not be allocated"));
                }
                // SAFETY: valid buffer.
                let base = unsafe { sys::ggml_backend_buffer_get_base(buf) } as usize;
                Some(Staging { buf, base, half_bytes: bytes / 2 })
            }
            None => None,
        };
        if cfg.fault == Some(Fault::NoThread) {
            return Err("the prefill ring's copier thread could not start: fault injected (STRATA_LAB=ring-fault=no-thread)".into());
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let copier = self.copier;
        let thread = std::thread::Builder::new()
            .name("strata-ring".into())
            .spawn(move || copier_thread(copier, rx, staging, cfg.pace, cfg.fault))
            .map_err(|e| format!("the prefill ring's copier thread could not start: {e}"))?;
        if let Some(old) = self.copier_thread.lock().unwrap_or_else(|e| e.into_inner()).replace(thread) {
            let _ = old.join();
        }
        *self.tx.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        Ok(())
    }

    fn send(&self, job: Job) -> Result<(), Job> {
        match self.tx.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// Queues `pieces` for the copier. Should the copier have died (its jobs then fail), another
    /// is started; without one the copies run here.
    /// `direct`: the sources are page-locked (no staging).
    pub(super) fn submit(&self, pieces: Vec<Piece>, h: usize, direct: bool) -> Arc<Done> {
        if pieces.is_empty() {
            let done = Arc::new(Done::default());
            done.set(true);
            return done;
        }
        self.submit_as(pieces, h, direct, self.jobs.fetch_add(1, Ordering::Relaxed) + 1)
    }

    /// As `submit`, numbered `seq` (0: outside the count of batches' jobs that faults use).
    pub(super) fn submit_as(&self, pieces: Vec<Piece>, h: usize, direct: bool, seq: u64) -> Arc<Done> {
        let done = Arc::new(Done::default());
        let job = Job { pieces, staging: (!direct).then_some(h), done: done.clone(), seq };
        let Err(mut job) = self.send(job) else { return done };
        let died = self.copier_thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(std::thread::JoinHandle::is_finished);
        if died {
            let again = self.spawn();
            let msg = match &again {
                Ok(()) => "prefill ring: the copier thread stopped; started another\n".to_string(),
                Err(e) => format!("prefill ring: the copier thread stopped and {e}; copies run on the thread that computes the graph\n"),
            };
            crate::backend::log(crate::backend::Verbosity::Warn, &msg);
            if again.is_err() {
                self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(old) = self.copier_thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    let _ = old.join();
                }
            }
            job = match self.send(job) {
                Ok(()) => return done,
                Err(j) => j,
            };
        }
        let cfg = *self.copier_cfg.lock().unwrap_or_else(|e| e.into_inner());
        job.done.set(run(self.copier, &job, None, cfg.pace, cfg.fault));
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_reuses_the_staging_half_it_copies_through() {
        let piece = |src, bytes| Piece { dst: 0, src, bytes };
        let (base, half) = (1 << 20, 100);
        let a = stage(&[piece(7, 40), piece(9, 40)], base, half, 0);
        let b = stage(&[piece(3, 30), piece(5, 30), piece(8, 30)], base, half, 0);
        assert_eq!(a.iter().map(|s| s.0).collect::<Vec<_>>(), [base, base + 40]);
        assert_eq!(b.iter().map(|s| s.0).collect::<Vec<_>>(), [base, base + 30, base + 60], "the next job packs from the same start");
        let other = stage(&[piece(7, 100)], base, half, 1);
        assert_eq!(other[0].0, base + half, "the other half does not overlap the first");
        assert_eq!(stage(&[piece(1, 60), piece(2, 60)], base, half, 0).len(), 1, "what a half cannot hold is not staged");
    }

    #[test]
    fn paced_runs_stay_within_the_pace_in_order() {
        let sizes = [3usize, 3, 3, 10, 1, 1];
        let runs = |pace| -> Vec<Vec<usize>> { paced(&sizes, |&b| b, pace).into_iter().map(<[usize]>::to_vec).collect() };
        assert_eq!(runs(None), vec![sizes.to_vec()], "no pace: one run");
        assert_eq!(runs(Some(6)), vec![vec![3, 3], vec![3], vec![10], vec![1, 1]], "a piece over the pace goes alone");
        assert_eq!(runs(Some(100)), vec![sizes.to_vec()]);
        assert!(paced::<usize>(&[], |&b| b, Some(4)).is_empty());
    }
}
