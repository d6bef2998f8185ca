//! Cold experts in decode read by the GPU straight from the page-locked RAM copy (zero-copy).
//!
//! A decode step of a tiered layer then runs two mul_mat_id over the same routing inside one
//! device graph: the hot tier's (VRAM) and the RAM copy's, seen by the device through a mapped
//! buffer (patches/0006). The copy's id map sends hot experts to -1, which the kernels skip
//! (zero output, weights unread), so the bus carries only the cold experts the step selected and
//! no CPU hand-off splits the graph. The routing of each step lands in a small mapped log that the
//! host reads after the step to count selections: through tables the down projection's vector
//! kernels write it (patches/0011); the two chains copy it, as f32 so that the copy is a
//! conversion kernel in the device graph (ggml-cuda copies i32 to i32 as a memcpy node).

use std::ffi::c_void;

use super::{Alloc, Mats, Owned, T};
use crate::backend::proc_address;
use crate::sys;

/// Batches of up to this many tokens take the zero-copy form where the device's vector kernels,
/// which skip negative ids and read expert tables, serve mul_mat_id that far (ZeroCopy::max_tokens).
pub(super) const MAX_TOKENS: i64 = 5;

type MappedNew = unsafe extern "C" fn(i32, *mut c_void, usize) -> sys::ggml_backend_buffer_t;
type VecMaxBatch = unsafe extern "C" fn(i32, i32) -> i32;

/// How decode reaches the cold experts of a tiered layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColdDecode {
    /// CPU workers (or the CPU backend's threads) compute them; the graph splits around them.
    Cpu,
    /// The GPU reads them from the page-locked RAM copy; the step stays one device graph.
    Mapped,
    /// CPU workers compute them while the GPU computes the hot ones, handed over by host ops
    /// that a mailbox in mapped memory answers (patches/0009); the step stays one device graph.
    Workers,
    /// Per layer: the workers where a token is expected to select at least
    /// `Switches::workers_min_cold` cold experts, zero-copy reads elsewhere.
    Mixed,
}

/// A layer's zero-copy decode: the RAM copy's matrices as the device addresses them, the map
/// expert -> copy row (-1 for hot experts), and the routing log.
pub(super) struct ZeroCopy {
    pub mats: Mats<T>,
    /// expert -> RAM copy row, or -1 for a hot expert.
    pub skip_map: T,
    /// expert -> hot slot, or -1 for a cold expert (so decode reads no pad expert either).
    pub hot_skip_map: Option<T>,
    /// [n_used, MAX_TOKENS] f32 (expert ids, -1 where none) as the graph writes it.
    pub log: T,
    /// Every expert read through tables of pointers, when on (STRATA_DECODE_TABLE=1).
    pub by_table: Option<ByTable>,
    /// The largest batch that takes the zero-copy form on this device (at most MAX_TOKENS).
    pub max_tokens: i64,
    /// The RAM copy's addresses as the device reads them: [low, high).
    pub mapped: (u64, u64),
    /// The same log where the host reads it.
    log_host: *mut f32,
    log_len: usize,
}

impl ZeroCopy {
    /// Wraps the RAM copy's buffer (the last of `owned`, holding `copy` and `log`) for `dev`.
    /// On a machine without a GPU the copy itself serves (the CPU's mul_mat_id skips too).
    pub(super) fn new(
        dev: sys::ggml_backend_dev_t,
        gpu: bool,
        copy: &Mats<T>,
        log: T,
        maps: (T, Option<T>),
        il: i32,
        owned: &mut Owned,
    ) -> Result<Self, String> {
        // SAFETY: log is a live f32 tensor in a host buffer.
        let (log_host, log_len) = unsafe { ((*log).data.cast::<f32>(), sys::ggml_nelements(log) as usize) };
        let zc = |mats, log, max_tokens, mapped| ZeroCopy {
            mats,
            skip_map: maps.0,
            hot_skip_map: maps.1,
            log,
            log_host,
            log_len,
            by_table: None,
            max_tokens,
            mapped,
        };
        if !gpu {
            reset(log_host, log_len);
            // SAFETY: the last of owned's buffers holds the copy.
            let mapped = owned.bufs.last().map_or((0, 0), |&b| unsafe {
                let base = sys::ggml_backend_buffer_get_base(b) as u64;
                (base, base + sys::ggml_backend_buffer_get_size(b) as u64)
            });
            return Ok(zc(*copy, log, MAX_TOKENS, mapped));
        }
        // SAFETY: the proc address has the VecMaxBatch signature (patches/0008); copy's tensors are live.
        let max_tokens = unsafe {
            let ty = copy.iter().next().map_or(0, |t| (*t).type_ as i32);
            match proc_address(dev, c"ggml_backend_cuda_mmid_vec_max_batch") {
                None => MAX_TOKENS,
                Some(p) => i64::from(std::mem::transmute::<*mut c_void, VecMaxBatch>(p)(super::ring::device_index(dev), ty)).min(MAX_TOKENS),
            }
        };
        if max_tokens < 1 {
            return Err("the GPU's vector kernels do not take this expert type".into());
        }
        let host_buf = *owned.bufs.last().ok_or("no RAM copy")?;
        let p = proc_address(dev, c"ggml_backend_cuda_mapped_buffer_new").ok_or("the GPU backend has no mapped host buffers (patches/0006 missing)")?;
        // SAFETY: the proc address has the MappedNew signature (patches/0006).
        let mapped_new = unsafe { std::mem::transmute::<*mut c_void, MappedNew>(p) };
        // SAFETY: host_buf is the page-locked buffer of the device's host buffer type that holds
        // the copy; the mapped buffer borrows its memory (freeing it releases nothing) and both
        // are freed together with the layer.
        let (mbuf, host_base, mbase, msize) = unsafe {
            let base = sys::ggml_backend_buffer_get_base(host_buf);
            let size = sys::ggml_backend_buffer_get_size(host_buf);
            let mbuf = mapped_new(super::ring::device_index(dev), base, size);
            if mbuf.is_null() {
                let name = std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(dev)).to_string_lossy().into_owned();
                return Err(format!("{name} cannot address the page-locked RAM copy"));
            }
            sys::ggml_backend_buffer_set_usage(mbuf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            (mbuf, base as usize, sys::ggml_backend_buffer_get_base(mbuf) as usize, size)
        };
        owned.bufs.push(mbuf);
        let a = Alloc::new(5);
        owned.ctxs.push(a.ctx);
        let mut failed = false;
        let mut view = |t: T, name: &str| -> Option<T> {
            // SAFETY: t is a live tensor inside host_buf; its twin gets the same offset in mbuf,
            // which spans the same bytes.
            unsafe {
                let v = sys::ggml_dup_tensor(a.ctx, t);
                super::set_name(v, name);
                let addr = (mbase + ((*t).data as usize - host_base)) as *mut c_void;
                if sys::ggml_backend_tensor_alloc(mbuf, v, addr) != sys::GGML_STATUS_SUCCESS {
                    failed = true;
                    return None;
                }
                Some(v)
            }
        };
        let mats = copy.map(|t| view(t, &format!("blk.{il}.exps.cold_mapped")));
        let log_dev = view(log, &format!("blk.{il}.exps.decode_log"));
        match (mats, log_dev) {
            (Some(m), Some(l)) if !failed => {
                reset(log_host, log_len);
                Ok(zc(m, l, max_tokens, (mbase as u64, (mbase + msize) as u64)))
            }
            _ => Err("placing tensors in the mapped buffer failed".into()),
        }
    }

    /// Reads the routing the last step logged (entries >= 0) and marks the log empty again. Call
    /// after the step's graph has finished.
    pub(super) fn take_log(&self, out: &mut Vec<i32>) {
        // A step writes its first token's first id first: a log that starts empty is all empty.
        // SAFETY: as below.
        if unsafe { self.log_host.read_volatile() } < 0.0 {
            return;
        }
        for i in 0..self.log_len {
            // SAFETY: log_host addresses log_len f32 of page-locked host memory that no graph is
            // writing now (the caller synchronised).
            let v = unsafe { self.log_host.add(i).read_volatile() };
            if v >= 0.0 {
                out.push(v as i32);
            }
        }
        reset(self.log_host, self.log_len);
    }
}

/// Writes `p` into op_params[at..at + 2] of `t` (low half first), as ggml's readers expect.
///
/// # Safety
/// `t` is a live tensor that no graph is computing.
unsafe fn set_address(t: T, at: usize, p: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        (*t).op_params[at] = p as u32 as i32;
        (*t).op_params[at + 1] = (p >> 32) as u32 as i32;
    }
}

fn reset(log: *mut f32, len: usize) {
    for i in 0..len {
        // SAFETY: log addresses len f32 of host memory owned by the placement.
        unsafe { log.add(i).write_volatile(-1.0) };
    }
}

/// Allocates the routing log beside the RAM copy's matrices (same buffer, so one mapping covers
/// both), then spare bytes: the GPU's buffer type sizes quantized tensors with row padding that
/// the host's does not, and the last matrix's padded size must stay inside the buffer.
pub(super) fn log_tensor(a: &Alloc, n_used: usize, il: i32) -> T {
    // SAFETY: a's context has room for the metadata (two tensors beyond the matrices).
    unsafe {
        let t = sys::ggml_new_tensor_2d(a.ctx, sys::GGML_TYPE_F32, n_used as i64, MAX_TOKENS);
        super::set_name(t, &format!("blk.{il}.exps.decode_log"));
        let spare = sys::ggml_new_tensor_1d(a.ctx, sys::GGML_TYPE_I8, SPARE_BYTES);
        super::set_name(spare, &format!("blk.{il}.exps.spare"));
        t
    }
}

/// More than the row padding of any matrix (512 columns of the widest type).
const SPARE_BYTES: i64 = 64 << 10;

/// Decode's experts addressed through tables of pointers (patches/0008): per matrix, a tensor
/// over every expert id whose op_params name its table, and the table (one address per id) in
/// the hot tier's buffer. A step is then one mul_mat_id per matrix, as on an all-GPU model, that
/// reads hot experts from VRAM and cold ones from the page-locked copy.
pub(super) struct ByTable {
    pub mats: Mats<T>,
    /// `mats` whose down projection also names the routing log (patches/0011): its vector
    /// kernels write the step's ids there, so zero-copy decode adds no node of its own for them.
    pub logged: Mats<T>,
    tables: Mats<T>,
}

impl ByTable {
    /// `tables`: one allocated [2, n_expert] i32 tensor per matrix of `src`, in the same order.
    /// With `stage`, the device range of the RAM copy: the GPU then copies a step's selected cold
    /// experts into its own memory before computing them (patches/0010).
    /// With `log` (the layer's routing log as the device writes it), `logged` names it.
    pub(super) fn new(src: &Mats<T>, tables: Mats<T>, n_expert: usize, il: i32, owned: &mut Owned, stage: Option<(u64, u64)>, log: Option<T>) -> Self {
        let a = Alloc::new(5);
        owned.ctxs.push(a.ctx);
        let by_table = |t: T, table: T| {
            let v = a.like(t, n_expert, &format!("blk.{il}.exps.by_table"));
            // SAFETY: v is fresh metadata, table a live allocated tensor. Not
            // ggml_backend_tensor_alloc: v spans n_expert experts by its shape, but no kernel
            // addresses one by offset; the table's buffer only places the op on its device.
            unsafe {
                (*v).buffer = (*table).buffer;
                (*v).data = (*table).data;
                set_address(v, 4, (*table).data as u64);
                if let Some((lo, hi)) = stage {
                    set_address(v, 6, lo);
                    set_address(v, 8, hi);
                }
            }
            v
        };
        let mut table = tables.iter();
        let mats = src.map(|t| Some(by_table(t, table.next()?))).expect("a table per matrix");
        let mut logged = mats;
        if let (Some(log), Some(down), Some(table)) = (log, src.down, tables.down) {
            let v = by_table(down, table);
            // SAFETY: v is fresh metadata; log a live tensor in the mapped buffer.
            unsafe { set_address(v, 10, (*log).data as u64) };
            logged.down = Some(v);
        }
        Self { mats, logged, tables }
    }

    /// Points expert e at slot `hot[e]` of `hot_mats` when that is >= 0, else at row `cold[e]`
    /// of `copy`, else at the copy's zero pad row (as the two chains' skips would compute zero).
    /// With `hot_pad`, a cold expert points at that zero slot of `hot_mats` (at the copy's zero
    /// pad row when the layer has no hot experts) instead: the CPU workers compute it.
    pub(super) fn write(&self, hot_mats: Option<&Mats<T>>, copy: &Mats<T>, hot: &[i32], cold: &[i32], hot_pad: Option<usize>) {
        let hots: Vec<Option<T>> = match hot_mats {
            Some(h) => h.iter().map(Some).collect(),
            None => copy.iter().map(|_| None).collect(),
        };
        for ((table, h), c) in self.tables.iter().zip(hots).zip(copy.iter()) {
            // SAFETY: live tensors; h and c hold experts of the same shape and type.
            let (cold_base, nb2, pad, hot_base) = unsafe { ((*c).data as u64, (*c).nb[2] as u64, (*c).ne[2] as u64 - 1, h.map(|h| (*h).data as u64)) };
            let entries: Vec<u64> = (0..hot.len())
                .map(|e| match (hot_base, u64::try_from(hot[e]), u64::try_from(cold[e]), hot_pad) {
                    (Some(b), Ok(s), _, _) => b + s * nb2,
                    (Some(b), _, Ok(_), Some(p)) => b + p as u64 * nb2,
                    (_, _, Ok(r), None) => cold_base + r * nb2,
                    _ => cold_base + pad * nb2,
                })
                .collect();
            // SAFETY: table is a [2, n_expert] i32 tensor: n_expert u64.
            unsafe { sys::ggml_backend_tensor_set(table, entries.as_ptr().cast(), 0, std::mem::size_of_val(entries.as_slice())) };
        }
    }
}
