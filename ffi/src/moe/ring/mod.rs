//! The prefill ring: prompt batches copy the cold experts a tiered layer uses into a ring of
//! device slots shared by all tiered layers, and the layer runs one mul_mat_id over its hot
//! slots and the ring together (docs/prefill-ring.md).
//!
//! Each tiered layer's hot experts live in a *window* (patches/0002): its own device memory
//! followed by one half of the ring, mapped into one virtual range, so `[hot | pads | half]` is
//! one tensor and the unchanged GPU kernels see an ordinary expert tensor. The two halves are
//! separate allocations; tiered layers take them in turn, so while one layer computes from its
//! half, the copies of the next layer's likely experts fill the other (a prefetch issued when the
//! layer's routing is known). A window maps only its own half because the backend's grid spans
//! every expert of the tensor.
//! The copies run on a copy stream from a page-locked source: the page-locked RAM copy itself,
//! or one reusable page-locked staging buffer that a copier thread gathers pageable experts into.
//!
//! Without a GPU the ring is off. `STRATA_LAB=emulate-ring` builds it on the CPU instead (each
//! layer's window is a host tensor with a ring of its own, copies are memcpy) so the slot
//! accounting and the graph can be tested where there is no GPU.

mod copier;
mod slots;

use std::ffi::c_void;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::types::{Mats, Tally, T};
use crate::sys;
use copier::{Copier, CopierCfg, Done, Fns, Job, Piece};
pub(crate) use slots::bounds;
pub use slots::{plan_waves, Placed, Slots, Waves};

pub use strata_residency::plan::CostModel;

/// Share of a layer's time the next layer's prefetch may fill with copies.
const PREFETCH_SHARE: f64 = 0.8;
/// Least chance of use for which an expert is prefetched when the copy budget allows (default).
pub const PREFETCH_MIN_P: f64 = 0.02;

/// The device index of a ggml device named like "CUDA0" or "ROCm1".
pub(crate) fn device_index(dev: sys::ggml_backend_dev_t) -> i32 {
    // SAFETY: valid device; the name is a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(dev)) }.to_string_lossy().into_owned();
    let digits: String = name.chars().rev().take_while(char::is_ascii_digit).collect::<Vec<_>>().into_iter().rev().collect();
    digits.parse().unwrap_or(0)
}

/// Counters for /metrics.
#[derive(Default)]
pub struct RingStats {
    pub h2d_bytes: AtomicU64,
    pub h2d_bytes_last_batch: AtomicU64,
    pub hits: AtomicU64,
    pub fills: AtomicU64,
    pub stalls: AtomicU64,
    pub batches: AtomicU64,
    /// Passes after a layer's first that computed cold experts (a layer in waves).
    pub waves: AtomicU64,
}

/// A tiered layer as the ring sees it.
pub(crate) struct RingLayer {
    /// The window's first ring slot (hot slots and pads come before it).
    pub first_slot: usize,
    /// Host address of each cold row's matrices and their strides, per matrix.
    src: Vec<(usize, usize)>,
    /// Ring start in this layer's window, per matrix (device addresses, or host in emulation).
    dst: Vec<usize>,
    /// Ring start of the other half's tensors (odd passes of a layer in waves), per matrix.
    dst_other: Vec<usize>,
    /// The current batch's passes (set by the first, read by the others).
    waves: Mutex<Waves>,
    /// expert -> cold row, or -1 when hot.
    cold_rows: Vec<i32>,
    /// expert -> hot slot, or -1 when cold.
    pub hot_slots: Vec<i32>,
    tally: Arc<Tally>,
    n_used: usize,
    /// Whether the graph being computed runs this layer through the ring (set when it is built).
    active: std::sync::atomic::AtomicBool,
    /// Its sources are page-locked: copied straight, not through the staging buffer.
    direct: bool,
}

/// The ring of one device, shared by every tiered layer of a model.
pub(crate) struct Ring {
    copier: Copier,
    pub half: usize,
    /// Ring allocations per matrix kind and half (device only): a layer's window maps only the
    /// half it takes, so its expert count, which the backend's grid spans, holds one half.
    handles: Vec<[*mut c_void; 2]>,
    fns: Option<Fns>,
    state: Mutex<State>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    /// The copier, joined before the ring's memory is freed: it may be copying into it.
    copier_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// How the copier is started (again, should it die).
    copier_cfg: Mutex<CopierCfg>,
    /// Jobs submitted so far.
    jobs: AtomicU64,
    pub stats: RingStats,
    pub cost: Mutex<Option<CostModel>>,
    pinned_src: bool,
    layers: Mutex<Vec<Arc<RingLayer>>>,
    pub emulated: bool,
    pub bytes: usize,
    /// One JSON line per fill step (the per-layer timeline), when a file was given.
    trace: Option<Mutex<std::fs::File>>,
    /// Least chance of use for which the next layer's cold experts are prefetched (f64 bits).
    prefetch_min_p: AtomicU64,
}

struct State {
    slots: Slots,
    pending: [Option<Arc<Done>>; 2],
    batch_bytes: u64,
    /// The ring layer of the previous fill (a lower or equal index starts a new batch), and when.
    last: Option<usize>,
    last_at: Option<Instant>,
}

impl State {
    /// Waits for the copies in flight into half `h`, forgetting what the half holds if they
    /// failed. Returns whether they were still running (a stall).
    fn drain(&mut self, h: usize) -> bool {
        let Some(p) = self.pending[h].take() else { return false };
        let (ok, stalled) = p.wait();
        if !ok {
            self.slots.invalidate(h);
        }
        stalled
    }
}

// SAFETY: the raw handles are only used under the ring's own synchronisation (creation, drop).
unsafe impl Send for Ring {}
// SAFETY: as above; shared state is behind mutexes and atomics.
unsafe impl Sync for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // Closing the channel ends the copier once the jobs queued are copied.
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if let Some(t) = self.copier_thread.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        if let Some(f) = self.fns {
            for &h in self.handles.iter().flatten() {
                // SAFETY: created by ring_new, freed once.
                unsafe { (f.ring_free)(h) };
            }
        }
    }
}

/// What a layer's window is made of.
pub(crate) enum WindowMem {
    /// A device buffer from patches/0002 (head + the shared ring).
    Device(sys::ggml_backend_buffer_t),
    /// Emulation: a host buffer of head + the layer's own ring.
    Host(sys::ggml_backend_buffer_t),
}

impl Ring {
    /// A ring of two halves of `half` slots on device `dev` for matrices of at most `max_nb2`
    /// bytes per expert (two allocations per matrix kind, in Mats order), or None where the
    /// backend lacks windows (no patches/0002, no virtual memory management) or the memory is short.
    pub(crate) fn new_device(dev: sys::ggml_backend_dev_t, half: usize, max_nb2: &[usize], pinned_src: bool, trace: Option<&Path>) -> Option<Arc<Self>> {
        let fns = Fns::load(dev)?;
        let idx = device_index(dev);
        let mut handles: Vec<[*mut c_void; 2]> = Vec::new();
        let free_all = |handles: &[[*mut c_void; 2]]| {
            for &h in handles.iter().flatten().filter(|h| !h.is_null()) {
                // SAFETY: created by ring_new, freed once.
                unsafe { (fns.ring_free)(h) };
            }
        };
        for &nb2 in max_nb2 {
            // SAFETY: valid device index; size > 0.
            // One slot more than a half: the window tensor leaves it for the backend's row padding.
            let pair = [0, 1].map(|_| unsafe { (fns.ring_new)(idx, (half + 1) * nb2) });
            let failed = pair.iter().any(|h| h.is_null());
            handles.push(pair);
            if failed {
                free_all(&handles);
                return None;
            }
        }
        // SAFETY: live handles.
        let bytes = handles.iter().flatten().map(|&h| unsafe { (fns.ring_size)(h) }).sum();
        Some(Self::with(Copier::Device { fns, dev: idx }, half, handles, Some(fns), pinned_src, bytes, trace))
    }

    /// The CPU emulation (`STRATA_LAB=emulate-ring`).
    pub(crate) fn new_emulated(half: usize, pinned_src: bool, trace: Option<&Path>) -> Arc<Self> {
        Self::with(Copier::Host, half, Vec::new(), None, pinned_src, 0, trace)
    }

    fn with(copier: Copier, half: usize, handles: Vec<[*mut c_void; 2]>, fns: Option<Fns>, pinned_src: bool, bytes: usize, trace: Option<&Path>) -> Arc<Self> {
        let emulated = matches!(copier, Copier::Host);
        Arc::new(Self {
            copier,
            half,
            handles,
            fns,
            state: Mutex::new(State { slots: Slots::new(half), pending: [None, None], batch_bytes: 0, last: None, last_at: None }),
            tx: Mutex::new(None),
            copier_thread: Mutex::new(None),
            copier_cfg: Mutex::default(),
            jobs: AtomicU64::new(0),
            stats: RingStats::default(),
            cost: Mutex::new(None),
            pinned_src,
            layers: Mutex::new(Vec::new()),
            emulated,
            bytes,
            trace: trace.and_then(|p| std::fs::File::create(p).ok()).map(Mutex::new),
            prefetch_min_p: AtomicU64::new(PREFETCH_MIN_P.to_bits()),
        })
    }

    /// The window of the ring layer that takes half `h`, whose hot part takes `head` bytes of
    /// matrix kind `m`.
    pub(crate) fn window(&self, m: usize, h: usize, head: usize, ring_bytes_emulated: usize) -> Option<WindowMem> {
        match (self.fns, self.handles.get(m).map(|pair| pair[h % 2])) {
            (Some(f), Some(h)) => {
                // SAFETY: live ring handle.
                let b = unsafe { (f.window_new)(h, head) };
                (!b.is_null()).then_some(WindowMem::Device(b))
            }
            _ => {
                // SAFETY: the CPU device exists whenever the CPU backend is loaded.
                let b = unsafe {
                    let buft = sys::ggml_backend_dev_buffer_type(sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU));
                    sys::ggml_backend_buft_alloc_buffer(buft, head + ring_bytes_emulated)
                };
                (!b.is_null()).then_some(WindowMem::Host(b))
            }
        }
    }

    /// Bytes of one half's ring per matrix kind, as allocated (device rings round up to the granularity).
    pub(crate) fn ring_bytes(&self, m: usize) -> Option<usize> {
        let f = self.fns?;
        // SAFETY: live handle.
        self.handles.get(m).map(|pair| unsafe { (f.ring_size)(pair[0]) })
    }

    /// The least chance of use in the next batch for which a cold expert is prefetched.
    pub(crate) fn prefetch_min_p(&self) -> f64 {
        f64::from_bits(self.prefetch_min_p.load(Ordering::Relaxed))
    }

    /// The ring index the next registered layer gets (its half is the index modulo 2).
    pub(crate) fn next_index(&self) -> usize {
        self.layers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The first ring slot of ring layer `i`'s window.
    pub(crate) fn first_slot(&self, i: usize) -> Option<usize> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner()).get(i).map(|l| l.first_slot)
    }

    /// Records whether the graph being built runs ring layer `i` through the ring.
    pub(crate) fn set_active(&self, i: usize, on: bool) {
        if let Some(l) = self.layers.lock().unwrap_or_else(|e| e.into_inner()).get(i) {
            l.active.store(on, Ordering::Relaxed);
        }
    }

    /// Waits for the prefetch copies in flight, whose sources may be about to change.
    pub(crate) fn settle(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for h in 0..2 {
            st.drain(h);
        }
    }

    /// Records where ring layer `i`'s experts now are (after adaptation exchanged some). Slots
    /// stay valid: they hold an expert's weights, whichever row it came from.
    pub(crate) fn reassign(&self, i: usize, cold_rows: Vec<i32>, hot_slots: Vec<i32>) {
        let mut layers = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = layers.get_mut(i) {
            let l =
                RingLayer::new(old.first_slot, old.src.clone(), [old.dst.clone(), old.dst_other.clone()], cold_rows, hot_slots, old.tally.clone(), old.n_used)
                    .direct(old.direct);
            l.active.store(old.active.load(Ordering::Relaxed), Ordering::Relaxed);
            *old = Arc::new(l);
        }
    }

    /// Adds the next tiered layer (in graph order); returns its ring index.
    pub(crate) fn register(&self, layer: RingLayer) -> usize {
        let mut l = self.layers.lock().unwrap_or_else(|e| e.into_inner());
        l.push(Arc::new(layer));
        l.len() - 1
    }

    /// Copies of cold experts into ring slots of the layer's own half, or of its other half's
    /// tensors (`other`).
    fn pieces(&self, rl: &RingLayer, copies: &[(i32, usize)], other: bool) -> Vec<Piece> {
        let dst = if other { &rl.dst_other } else { &rl.dst };
        let mut out = Vec::with_capacity(copies.len() * rl.src.len());
        for &(e, s) in copies {
            let Some(row) = usize::try_from(e).ok().and_then(|e| rl.cold_rows.get(e)).and_then(|&r| usize::try_from(r).ok()) else { continue };
            for (&(src, nb2), &dst) in rl.src.iter().zip(dst) {
                out.push(Piece { dst: dst + s * nb2, src: src + row * nb2, bytes: nb2 });
            }
        }
        out
    }

    /// Places `chunk` of ring layer `i` in half `h` after waiting for the copies in flight there,
    /// copying what is missing and waiting for it. Returns what was placed, the bytes copied and
    /// when the wait for the copies in flight ended; None if a copy failed.
    fn place_now(&self, st: &mut State, rl: &RingLayer, i: usize, h: usize, chunk: &[i32], other: bool) -> Option<(Placed, u64, Instant)> {
        if st.drain(h) {
            self.stats.stalls.fetch_add(1, Ordering::Relaxed);
        }
        let waited = Instant::now();
        let placed = st.slots.place(h, i, chunk)?;
        let pieces = self.pieces(rl, &placed.copies, other);
        let bytes: u64 = pieces.iter().map(|p| p.bytes as u64).sum();
        if !self.submit(pieces, h, rl.direct).wait().0 {
            st.slots.invalidate(h);
            return None;
        }
        self.account(st, bytes, placed.hits, placed.copies.len());
        Some((placed, bytes, waited))
    }

    /// Starts copying `chunk` of ring layer `i` into half `h` (free: the pass that last used it
    /// has finished), to be waited for by the pass that computes it.
    fn place_ahead(&self, st: &mut State, rl: &RingLayer, i: usize, h: usize, chunk: &[i32], other: bool) {
        st.drain(h);
        // Hits are counted when the pass runs.
        if let Some(placed) = st.slots.place(h, i, chunk) {
            self.copy_ahead(st, rl, &placed.copies, h, other);
        }
    }

    /// Starts `copies` of ring layer `rl` into half `h` (after what was in flight there), for
    /// the next fill of that half to wait for.
    fn copy_ahead(&self, st: &mut State, rl: &RingLayer, copies: &[(i32, usize)], h: usize, other: bool) {
        let pieces = self.pieces(rl, copies, other);
        let bytes: u64 = pieces.iter().map(|p| p.bytes as u64).sum();
        self.account(st, bytes, 0, copies.len());
        st.pending[h] = Some(self.submit(pieces, h, rl.direct));
    }

    fn account(&self, st: &mut State, bytes: u64, hits: usize, copies: usize) {
        st.batch_bytes += bytes;
        self.stats.h2d_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.stats.hits.fetch_add(hits as u64, Ordering::Relaxed);
        self.stats.fills.fetch_add(copies as u64, Ordering::Relaxed);
    }

    /// The fill step of pass `k` of ring layer `i` for a batch routed as `sel` ([n_used, n_tok])
    /// that the graph computes in at most `passes` passes. The first pass plans them: the used
    /// cold experts, most selected first, a half per pass; what no pass takes goes to the zero
    /// pads (the CPU part computes it). Pass k computes its chunk from half (h + k) % 2, where
    /// h is the layer's own: even passes through the layer's window (its hot slots too in the
    /// first), odd ones through its other-half tensors. Each pass waits for its chunk (copied
    /// ahead while the previous pass computed, or the layer's prefetch), starts copying the
    /// next chunk into the other half, and writes each selection's slot into `out`: its slot in
    /// this pass, -1 where another pass computes it, a pad where the CPU does. After the last
    /// pass with experts, the next ring layer's likely experts are prefetched into its half if
    /// that half is free. Returns the slots' [`bounds`] and whether `out` holds a -1, or None if
    /// a copy failed (out is then unusable).
    pub(crate) fn fill(&self, i: usize, k: usize, passes: usize, sel: &[i32], out: &mut [i32]) -> Option<((i32, i32), bool)> {
        let started = Instant::now();
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let rl = layers.get(i)?;
        let n = layers.len();
        let h = i % 2;
        let hk = (h + k) % 2;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let mut layer_s = None;
        if k == 0 {
            // The time since the previous ring layer's fill: about one layer of this batch on the GPU.
            layer_s = match (st.last, st.last_at) {
                (Some(l), Some(at)) if l < i => Some(now.duration_since(at).as_secs_f64() / (i - l) as f64),
                _ => None,
            };
            if st.last.is_none_or(|l| i <= l) {
                st.batch_bytes = 0;
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
            }
            st.last = Some(i);
            st.last_at = Some(now);
            let mut counts = vec![0u32; rl.cold_rows.len()];
            for &e in sel {
                if rl.cold_row(e).is_some() {
                    counts[e as usize] += 1;
                }
            }
            let mut used: Vec<(i32, u32)> = counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(e, &c)| (e as i32, c)).collect();
            used.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            let used: Vec<i32> = used.into_iter().map(|(e, _)| e).collect();
            let passes = if rl.dst_other.is_empty() { 1 } else { passes };
            *rl.waves.lock().unwrap_or_else(|e| e.into_inner()) = plan_waves(&used, self.half, passes);
        }
        let waves = rl.waves.lock().unwrap_or_else(|e| e.into_inner());
        let chunk: &[i32] = waves.chunks.get(k).map_or(&[], Vec::as_slice);
        let wait_at = Instant::now();
        // An empty pass leaves the half alone: it may hold another layer's prefetch.
        let (placed, bytes, copy_at) = if chunk.is_empty() { (Placed::default(), 0, wait_at) } else { self.place_now(&mut st, rl, i, hk, chunk, k % 2 == 1)? };
        let copied_at = Instant::now();
        if k > 0 && !chunk.is_empty() {
            self.stats.waves.fetch_add(1, Ordering::Relaxed);
        }
        let base = if k.is_multiple_of(2) { rl.first_slot } else { 0 };
        let mut slot = vec![-1i32; rl.cold_rows.len()];
        for &(e, s) in &placed.slot_of {
            slot[e as usize] = (base + s) as i32;
        }
        let pads = rl.first_slot - rl.n_used;
        let mut to_cpu = vec![false; if k == 0 { rl.cold_rows.len() } else { 0 }];
        for &e in &waves.cpu {
            if let Some(c) = to_cpu.get_mut(e as usize) {
                *c = true;
            }
        }
        let mut skips = false;
        for (j, (o, &e)) in out.iter_mut().zip(sel).enumerate() {
            let at = |v: &[i32]| usize::try_from(e).ok().and_then(|e| v.get(e)).copied().unwrap_or(-1);
            let (hot, ring) = (at(&rl.hot_slots), at(&slot));
            *o = if k == 0 && hot >= 0 {
                hot
            } else if ring >= 0 {
                ring
            } else if usize::try_from(e).ok().and_then(|e| to_cpu.get(e)).copied().unwrap_or(false) {
                (pads + j % rl.n_used) as i32
            } else {
                skips = true;
                -1
            };
        }
        // The next pass's chunk goes into the other half while this pass computes.
        if let Some(next) = waves.chunks.get(k + 1) {
            self.place_ahead(&mut st, rl, i, (hk + 1) % 2, next, (k + 1) % 2 == 1);
        } else if k + 1 == waves.chunks.len().max(1) {
            // After the last pass with experts (once): prefetch the next layer that this graph
            // runs through the ring into its half, unless that half is this pass's (an odd count
            // wrapping, a pass in the other half, or a layer between that computes its cold
            // experts elsewhere).
            let next = (1..=n).map(|d| (i + d) % n).find(|&j| layers[j].active.load(Ordering::Relaxed));
            if let Some(j) = next.filter(|&j| j != i && j % 2 != hk) {
                let draws = sel.len() as f64;
                // As many as the copy engine moves while this layer computes, most likely first.
                let rate = self.cost.lock().unwrap_or_else(|e| e.into_inner()).map(|c| c.copy_bytes_per_s);
                let budget = match (layer_s, rate) {
                    (Some(t), Some(r)) => Some(((PREFETCH_SHARE * t * r) as usize / layers[j].expert_bytes().max(1)).min(self.half)),
                    _ => None,
                };
                let likely = layers[j].likely_cold(draws, budget, self.prefetch_min_p());
                st.drain(j % 2);
                let copies = st.slots.prefetch(j % 2, j, &likely);
                self.copy_ahead(&mut st, &layers[j], &copies, j % 2, false);
            }
        }
        self.stats.h2d_bytes_last_batch.store(st.batch_bytes, Ordering::Relaxed);
        let (cols, n_as) = bounds(out);
        if let Some(trace) = self.trace.as_ref() {
            let ms = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64() * 1e3;
            let line = format!(
                "{{\"layer\":{i},\"pass\":{k},\"n_tok\":{},\"since_prev_ms\":{},\"copy_wait_ms\":{:.3},\"missing_copy_ms\":{:.3},\"fill_ms\":{:.3},\"used_cold\":{},\"hits\":{},\"copied\":{},\"bytes\":{bytes},\"to_cpu\":{},\"max_cols\":{cols},\"n_as\":{n_as}}}\n",
                sel.len() / rl.n_used.max(1),
                layer_s.map_or("null".into(), |t| format!("{:.3}", t * 1e3)),
                ms(wait_at, copy_at),
                ms(copy_at, copied_at),
                ms(started, Instant::now()),
                chunk.len(),
                placed.hits,
                placed.copies.len(),
                if k == 0 { waves.cpu.len() } else { 0 },
            );
            let _ = std::io::Write::write_all(&mut *trace.lock().unwrap_or_else(|e| e.into_inner()), line.as_bytes());
        }
        // An empty pass still launches its kernels: give them one expert and one column.
        Some(((cols.max(1), n_as.max(1)), skips))
    }

    /// Copies cold rows into other device tensors (`--pcie-frac` staging slots) through the
    /// ring's copier, waiting for them: (slot in `dst`, row in `src`) per expert. False if the
    /// copier could not (the caller then copies another way).
    pub(crate) fn copy_rows(&self, src: &Mats<T>, dst: &Mats<T>, rows: &[(usize, usize)]) -> bool {
        let mut pieces = Vec::with_capacity(rows.len() * 3);
        for (s, d) in src.iter().zip(dst.iter()) {
            // SAFETY: live tensors of the same per-expert stride; dst has more than `slot` experts.
            let (sdata, ddata, nb2) = unsafe { ((*s).data as usize, (*d).data as usize, (*d).nb[2]) };
            for &(slot, row) in rows {
                pieces.push(Piece { dst: ddata + slot * nb2, src: sdata + row * nb2, bytes: nb2 });
            }
        }
        let bytes: u64 = pieces.iter().map(|p| p.bytes as u64).sum();
        let ok = self.submit(pieces, 0, self.pinned_src).wait().0;
        if ok {
            self.stats.h2d_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        ok
    }

    /// Measures the copy rate into the ring with up to `n` experts of the first layer (logged
    /// by the caller), and forgets what the measurement put there.
    pub(crate) fn measure_copy(&self, n: usize) -> Option<f64> {
        let layers = self.layers.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let rl = layers.first()?;
        let cold: Vec<i32> = (0..rl.cold_rows.len() as i32).filter(|&e| rl.cold_row(e).is_some()).take(n.min(self.half)).collect();
        if cold.is_empty() {
            return None;
        }
        let copies: Vec<(i32, usize)> = cold.iter().enumerate().map(|(s, &e)| (e, s)).collect();
        let pieces = self.pieces(rl, &copies, false);
        let bytes: usize = pieces.iter().map(|p| p.bytes).sum();
        // One warm-up, then the timed copy.
        self.submit_as(pieces.clone(), 0, rl.direct, 0).wait();
        let t0 = Instant::now();
        let (ok, _) = self.submit_as(pieces, 0, rl.direct, 0).wait();
        let s = t0.elapsed().as_secs_f64();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.slots.invalidate(0);
        (ok && s > 0.0).then_some(bytes as f64 / s)
    }
}

impl RingLayer {
    /// `dst`: the ring's start in the layer's window and in its other-half tensors (empty when
    /// the layer has none), per matrix.
    pub(crate) fn new(
        first_slot: usize,
        src: Vec<(usize, usize)>,
        dst: [Vec<usize>; 2],
        cold_rows: Vec<i32>,
        hot_slots: Vec<i32>,
        tally: Arc<Tally>,
        n_used: usize,
    ) -> Self {
        let [dst, dst_other] = dst;
        Self { first_slot, src, dst, dst_other, waves: Mutex::default(), cold_rows, hot_slots, tally, n_used, active: Default::default(), direct: false }
    }

    /// Its sources are page-locked: the copier reads them straight, not through staging.
    pub(crate) fn direct(mut self, direct: bool) -> Self {
        self.direct = direct;
        self
    }

    fn cold_row(&self, e: i32) -> Option<usize> {
        usize::try_from(*self.cold_rows.get(usize::try_from(e).ok()?)?).ok()
    }

    fn expert_bytes(&self) -> usize {
        self.src.iter().map(|&(_, nb2)| nb2).sum()
    }

    /// The layer's cold experts likely used by a batch of `draws` selections, most likely
    /// first, by the layer's own counts: with a copy budget of `budget` experts, up to that many
    /// of those used with probability >= `min_p`; without one, those used with probability >= 1/2.
    /// Before the layer has counted enough, all of them (up to the budget).
    fn likely_cold(&self, draws: f64, budget: Option<usize>, min_p: f64) -> Vec<i32> {
        let cap = budget.unwrap_or(usize::MAX);
        let counts: Vec<(i32, u64)> = self
            .cold_rows
            .iter()
            .enumerate()
            .filter(|(_, &r)| r >= 0)
            .map(|(e, _)| (e as i32, self.tally.per_expert.get(e).map_or(0, |c| c.load(Ordering::Relaxed))))
            .collect();
        let total: u64 = self.tally.per_expert.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        if total < 64 * self.n_used as u64 {
            return counts.into_iter().map(|(e, _)| e).take(cap).collect();
        }
        let mut ranked: Vec<(i32, f64)> = counts.into_iter().map(|(e, c)| (e, 1.0 - (-draws * c as f64 / total as f64).exp())).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let min_p = if budget.is_some() { min_p } else { 0.5 };
        ranked.into_iter().filter(|&(_, p)| p >= min_p).map(|(e, _)| e).take(cap).collect()
    }
}

/// The most passes a layer's graph may have (one fill function each).
pub const MAX_PASSES: usize = 8;

/// Passes a layer's prompt batch may take unless STRATA_RING_WAVES says otherwise (on an H200
/// they took the CPU part out of a 12 GiB layer's graph: 7-14% more prefill).
pub const DEFAULT_PASSES: usize = 4;

/// Bytes a device ring's copier issues before it waits for them unless STRATA_RING_COPY_PACE_KIB
/// says otherwise: a fill's small copies then queue behind one run, not a whole prefetch (on an
/// H100 at 12 GiB, -ub 4096: 19-30% more prefill than unpaced in the same lease).
pub const DEVICE_PACE: usize = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// An emulated ring of 2 slots a half over one layer of 8 one-word experts (0 and 1 hot in
    /// slots 0 and 1, pads in 2 and 3, the ring from slot 4), with the cold experts' words in a
    /// host "RAM copy": the experts' values say which expert a slot holds.
    struct Bench {
        ring: Arc<Ring>,
        own: Vec<u32>,
        other: Vec<u32>,
        _ram: Vec<u32>,
    }

    fn bench() -> Bench {
        let ram: Vec<u32> = (2..8).map(|e| 100 + e).collect();
        let (mut own, mut other) = (vec![0u32; 2], vec![0u32; 2]);
        let ring = Ring::new_emulated(2, true, None);
        let cold_rows = vec![-1, -1, 0, 1, 2, 3, 4, 5];
        let hot_slots = vec![0, 1, -1, -1, -1, -1, -1, -1];
        let dst = [vec![own.as_mut_ptr() as usize], vec![other.as_mut_ptr() as usize]];
        ring.register(RingLayer::new(4, vec![(ram.as_ptr() as usize, 4)], dst, cold_rows, hot_slots, Arc::new(Tally::new(8)), 2));
        ring.start(None, 4, Some(1), None, None).expect("copier");
        Bench { ring, own, other, _ram: ram }
    }

    /// 4 tokens of 2 selections: cold 2 twice, then 3, 4, 5, 6, 7 once; hot 0 once.
    const SEL: [i32; 8] = [2, 3, 4, 5, 6, 0, 2, 7];

    #[test]
    fn a_layer_in_waves_computes_each_chunk_from_alternate_halves() {
        let b = bench();
        let mut out = [0i32; 8];
        let (_, skips) = b.ring.fill(0, 0, 3, &SEL, &mut out).expect("pass 0");
        assert!(skips);
        // 2 and 3 (most selected first) in the layer's own half, the rest -1, hot 0 in its slot.
        let own = |e: i32| 4 + b.own.iter().position(|&v| v == 100 + e as u32).expect("in the own half") as i32;
        assert_eq!(out, [own(2), own(3), -1, -1, -1, 0, own(2), -1]);
        let (_, skips) = b.ring.fill(0, 1, 3, &SEL, &mut out).expect("pass 1");
        assert!(skips);
        // 4 and 5 were copied into the other half while pass 0 computed; its tensors start at 0.
        let other = |e: i32| b.other.iter().position(|&v| v == 100 + e as u32).expect("in the other half") as i32;
        assert_eq!(out, [-1, -1, other(4), other(5), -1, -1, -1, -1]);
        b.ring.fill(0, 2, 3, &SEL, &mut out).expect("pass 2");
        assert_eq!(out, [-1, -1, -1, -1, own(6), -1, -1, own(7)], "the own half again, 6 and 7 in 2 and 3's slots");
        assert_eq!(b.ring.stats.waves.load(Ordering::Relaxed), 2);
        assert_eq!(b.ring.stats.fills.load(Ordering::Relaxed), 6, "each used cold expert copied once");
        // A pass with nothing to do writes -1 everywhere and leaves the halves as they were, here
        // the next layer's prefetch in the other half.
        b.ring.state.lock().unwrap().slots.prefetch(1, 1, &[5, 6]);
        let before = format!("{:?}", b.ring.state.lock().unwrap().slots);
        b.ring.fill(0, 3, 4, &SEL, &mut out).expect("empty pass");
        assert_eq!(out, [-1; 8]);
        assert_eq!(format!("{:?}", b.ring.state.lock().unwrap().slots), before);
    }

    #[test]
    fn the_next_layer_is_prefetched_once_after_the_last_pass_with_experts() {
        let b = bench();
        let mut next = vec![0u32; 2];
        let dst = [vec![next.as_mut_ptr() as usize], vec![]];
        let rl = RingLayer::new(
            4,
            vec![(b._ram.as_ptr() as usize, 4)],
            dst,
            vec![-1, -1, 0, 1, 2, 3, 4, 5],
            vec![0, 1, -1, -1, -1, -1, -1, -1],
            Arc::new(Tally::new(8)),
            2,
        );
        assert_eq!(b.ring.register(rl), 1);
        b.ring.set_active(0, true);
        b.ring.set_active(1, true);
        // Layer 0 uses only 2 and 3: one chunk of the graph's three passes.
        let sel = [2, 3, 0, 1, 2, 3, 0, 1];
        let mut out = [0i32; 8];
        b.ring.fill(0, 0, 3, &sel, &mut out).expect("pass 0");
        let job = |r: &Ring| r.state.lock().unwrap().pending[1].clone();
        let prefetch = job(&b.ring).expect("layer 1's prefetch into its half after the only pass with experts");
        b.ring.fill(0, 1, 3, &sel, &mut out).expect("empty pass 1");
        b.ring.fill(0, 2, 3, &sel, &mut out).expect("empty pass 2");
        let now = job(&b.ring).expect("still pending");
        assert!(Arc::ptr_eq(&now, &prefetch), "the empty passes neither repeat nor replace the prefetch in flight");
        b.ring.fill(1, 0, 1, &sel, &mut out).expect("layer 1");
        assert_eq!(b.ring.stats.hits.load(Ordering::Relaxed), 2, "layer 1 finds 2 and 3 prefetched");
        let mut landed = next.clone();
        landed.sort_unstable();
        assert_eq!(landed, [102, 103], "the prefetch copied them into layer 1's window");
    }

    #[test]
    fn a_ring_freed_with_a_prefetch_queued_copies_it_before_its_memory_goes() {
        let Bench { ring, own: _own, other: _other, _ram: ram } = bench();
        let mut next = vec![0u32; 2];
        let dst = [vec![next.as_mut_ptr() as usize], vec![]];
        let rl = RingLayer::new(
            4,
            vec![(ram.as_ptr() as usize, 4)],
            dst,
            vec![-1, -1, 0, 1, 2, 3, 4, 5],
            vec![0, 1, -1, -1, -1, -1, -1, -1],
            Arc::new(Tally::new(8)),
            2,
        );
        ring.register(rl);
        ring.set_active(0, true);
        ring.set_active(1, true);
        let mut out = [0i32; 8];
        ring.fill(0, 0, 1, &[2, 3, 0, 1, 2, 3, 0, 1], &mut out).expect("pass 0");
        let prefetch = ring.state.lock().unwrap().pending[1].clone().expect("layer 1's prefetch queued");
        assert_eq!(Arc::strong_count(&ring), 1, "nothing else holds the ring");
        drop(ring);
        assert_eq!(prefetch.ended(), Some(true), "the copier finished the queued prefetch before the ring was freed");
        next.sort_unstable();
        assert_eq!(next, [102, 103]);
    }

    #[test]
    fn what_the_passes_cannot_take_goes_to_the_pads() {
        let b = bench();
        let mut out = [0i32; 8];
        let (_, skips) = b.ring.fill(0, 0, 1, &SEL, &mut out).expect("one pass");
        assert!(!skips, "one pass: no -1, the CPU computes the pads' selections");
        // Pads 2 and 3 by routing position (selection index modulo 2).
        assert_eq!(&out[2..5], &[2, 3, 2]);
        assert_eq!(out[7], 3);
        assert_eq!(b.ring.stats.waves.load(Ordering::Relaxed), 0);
        // The same batch again: 2 and 3 are still in the half (hits, nothing copied).
        let fills = b.ring.stats.fills.load(Ordering::Relaxed);
        b.ring.fill(0, 0, 1, &SEL, &mut out).expect("again");
        assert_eq!(b.ring.stats.fills.load(Ordering::Relaxed), fills);
        assert_eq!(b.ring.stats.hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn prefetch_takes_the_likeliest_cold_experts_within_the_copy_budget() {
        // Experts 0..8; 0 and 1 hot; counts make 7 the likeliest cold one, then 6, 5, ...
        let tally = Arc::new(Tally::new(8));
        for (e, c) in [(0, 5000u64), (1, 5000), (2, 1), (3, 1), (4, 1), (5, 300), (6, 600), (7, 900)] {
            tally.per_expert[e].store(c, Ordering::Relaxed);
        }
        let cold_rows = vec![-1, -1, 0, 1, 2, 3, 4, 5];
        let rl = RingLayer::new(4, vec![(0, 16)], [vec![0], vec![]], cold_rows, vec![0, 1, -1, -1, -1, -1, -1, -1], tally, 2);
        let p = PREFETCH_MIN_P;
        assert_eq!(rl.likely_cold(100.0, Some(2), p), vec![7, 6], "the budget takes the likeliest first");
        assert_eq!(rl.likely_cold(100.0, Some(10), p), vec![7, 6, 5], "2, 3 and 4 have almost no chance in 100 draws");
        assert_eq!(rl.likely_cold(10.0, None, p), vec![7], "without a budget, only those more likely than not");
        // In 10 draws: 7 is used with p 0.53, 6 with 0.40, 5 with 0.23.
        assert_eq!(rl.likely_cold(10.0, Some(10), p), vec![7, 6, 5]);
        assert_eq!(rl.likely_cold(10.0, Some(10), 0.3), vec![7, 6], "a higher least chance copies fewer within the same budget");
        assert_eq!(rl.likely_cold(10.0, Some(1), 0.3), vec![7], "and the budget still caps it");
        let fresh = RingLayer::new(4, vec![(0, 16)], [vec![0], vec![]], vec![-1, 0, 1], vec![0, -1, -1], Arc::new(Tally::new(3)), 2);
        assert_eq!(fresh.likely_cold(100.0, Some(1), p), vec![1], "before any counts: every cold expert, up to the budget");
    }
}
