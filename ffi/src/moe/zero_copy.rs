//! Cold experts in decode read by the GPU straight from the page-locked RAM copy (zero-copy).
//!
//! A decode step of a tiered layer runs one mul_mat_id per matrix, as on an all-GPU model, whose
//! weight tensor addresses each expert through a table of pointers (patches/0007): a hot
//! expert's entry points into VRAM, a cold one's into the RAM copy, which the device sees
//! through a mapped buffer (patches/0005). The bus carries only the cold experts the step
//! selected and no CPU hand-off splits the graph. The down projection's vector kernels write the
//! step's routing into a small mapped log (patches/0008) that the host reads after the step to
//! count selections. (One chain per tier, skipping the other tier's experts, measured 0.72 of
//! all-GPU decode against the tables' 0.85 on an H100.)

use std::ffi::c_void;

use super::tensors::{set_name, Alloc, Owned};
use super::types::{Mats, T};
use crate::backend::proc_address;
use crate::sys;

/// Batches of up to this many tokens take the zero-copy form where the device's vector kernels,
/// which skip negative ids and read expert tables, serve mul_mat_id that far (ZeroCopy::max_tokens).
pub(super) const MAX_TOKENS: i64 = 5;

type MappedNew = unsafe extern "C" fn(i32, *mut c_void, usize) -> sys::ggml_backend_buffer_t;
type VecMaxBatch = unsafe extern "C" fn(i32, i32) -> i32;

/// A layer's zero-copy decode: the RAM copy's matrices as the device addresses them, the tables,
/// and the routing log.
pub(crate) struct ZeroCopy {
    pub mats: Mats<T>,
    /// Every expert read through tables of pointers.
    pub table: ByTable,
    /// The largest batch that takes the zero-copy form on this device (at most MAX_TOKENS).
    pub max_tokens: i64,
    /// The same log where the host reads it.
    log_host: *mut f32,
    log_len: usize,
}

impl ZeroCopy {
    /// Wraps the RAM copy's buffer (the last of `owned`, holding `copy` and `log`) for `dev`,
    /// with `tables` (one allocated [2, n_expert] i32 tensor per matrix of `src`, the layer's
    /// experts as llama.cpp loaded them). On a machine without a GPU the copy itself serves (the
    /// CPU's mul_mat_id reads the tables too).
    pub(super) fn new(
        dev: sys::ggml_backend_dev_t,
        gpu: bool,
        copy: &Mats<T>,
        log: T,
        (src, tables, n_expert): (&Mats<T>, Mats<T>, usize),
        il: i32,
        owned: &mut Owned,
    ) -> Result<Self, String> {
        // SAFETY: log is a live f32 tensor in a host buffer.
        let (log_host, log_len) = unsafe { ((*log).data.cast::<f32>(), sys::ggml_nelements(log) as usize) };
        let zc = |owned: &mut Owned, mats, log, max_tokens| {
            let table = ByTable::new(src, tables, n_expert, il, owned, log);
            ZeroCopy { mats, table, log_host, log_len, max_tokens }
        };
        if !gpu {
            reset(log_host, log_len);
            return Ok(zc(owned, *copy, log, MAX_TOKENS));
        }
        // SAFETY: the proc address has the VecMaxBatch signature (patches/0007); copy's tensors are live.
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
        let p = proc_address(dev, c"ggml_backend_cuda_mapped_buffer_new").ok_or("the GPU backend has no mapped host buffers (patches/0005 missing)")?;
        // SAFETY: the proc address has the MappedNew signature (patches/0005).
        let mapped_new = unsafe { std::mem::transmute::<*mut c_void, MappedNew>(p) };
        // SAFETY: host_buf is the page-locked buffer of the device's host buffer type that holds
        // the copy; the mapped buffer borrows its memory (freeing it releases nothing) and both
        // are freed together with the layer.
        let (mbuf, host_base, mbase) = unsafe {
            let base = sys::ggml_backend_buffer_get_base(host_buf);
            let size = sys::ggml_backend_buffer_get_size(host_buf);
            let mbuf = mapped_new(super::ring::device_index(dev), base, size);
            if mbuf.is_null() {
                let name = std::ffi::CStr::from_ptr(sys::ggml_backend_dev_name(dev)).to_string_lossy().into_owned();
                return Err(format!("{name} cannot address the page-locked RAM copy"));
            }
            sys::ggml_backend_buffer_set_usage(mbuf, sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            (mbuf, base as usize, sys::ggml_backend_buffer_get_base(mbuf) as usize)
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
                set_name(v, name);
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
                Ok(zc(owned, m, l, max_tokens))
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
        set_name(t, &format!("blk.{il}.exps.decode_log"));
        let spare = sys::ggml_new_tensor_1d(a.ctx, sys::GGML_TYPE_I8, SPARE_BYTES);
        set_name(spare, &format!("blk.{il}.exps.spare"));
        t
    }
}

/// More than the row padding of any matrix (512 columns of the widest type).
const SPARE_BYTES: i64 = 64 << 10;

/// Decode's experts addressed through tables of pointers (patches/0007): per matrix, a tensor
/// over every expert id whose op_params name its table, and the table (one address per id) in
/// the hot tier's buffer. A step is then one mul_mat_id per matrix, as on an all-GPU model, that
/// reads hot experts from VRAM and cold ones from the page-locked copy.
pub(crate) struct ByTable {
    /// The down projection's tensor also names the routing log (patches/0008): its kernels write
    /// the step's ids there, so zero-copy decode adds no node of its own for them.
    pub mats: Mats<T>,
    tables: Mats<T>,
}

impl ByTable {
    /// `tables`: one allocated [2, n_expert] i32 tensor per matrix of `src`, in the same order;
    /// `log`: the layer's routing log as the device writes it, which the down projection names.
    fn new(src: &Mats<T>, tables: Mats<T>, n_expert: usize, il: i32, owned: &mut Owned, log: T) -> Self {
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
            }
            v
        };
        let mut table = tables.iter();
        let mats = src.map(|t| Some(by_table(t, table.next()?))).expect("a table per matrix");
        if let Some(down) = mats.down {
            // SAFETY: down is fresh metadata; log a live tensor in the mapped buffer.
            unsafe { set_address(down, 10, (*log).data as u64) };
        }
        Self { mats, tables }
    }

    /// Points expert e at slot `hot[e]` of `hot_mats` when that is >= 0, else at row `cold[e]`
    /// of `copy`, else at the copy's zero pad row.
    pub(super) fn write(&self, hot_mats: Option<&Mats<T>>, copy: &Mats<T>, hot: &[i32], cold: &[i32]) {
        let hots: Vec<Option<T>> = match hot_mats {
            Some(h) => h.iter().map(Some).collect(),
            None => copy.iter().map(|_| None).collect(),
        };
        for ((table, h), c) in self.tables.iter().zip(hots).zip(copy.iter()) {
            // SAFETY: live tensors; h and c hold experts of the same shape and type.
            let (cold_base, nb2, pad, hot_base) = unsafe { ((*c).data as u64, (*c).nb[2] as u64, (*c).ne[2] as u64 - 1, h.map(|h| (*h).data as u64)) };
            let entries: Vec<u64> = (0..hot.len())
                .map(|e| match (hot_base, u64::try_from(hot[e]), u64::try_from(cold[e])) {
                    (Some(b), Ok(s), _) => b + s * nb2,
                    (_, _, Ok(r)) => cold_base + r * nb2,
                    _ => cold_base + pad * nb2,
                })
                .collect();
            // SAFETY: table is a [2, n_expert] i32 tensor: n_expert u64.
            unsafe { sys::ggml_backend_tensor_set(table, entries.as_ptr().cast(), 0, std::mem::size_of_val(entries.as_slice())) };
        }
    }
}

/// A zero-copy layer on host memory, built the way placement builds one without a GPU: the
/// layer's experts (2 x 3 f32 each), a hot tier with its pads, the RAM copy with its zero pad
/// row and the routing log, and the tables.
#[cfg(test)]
pub(super) mod on_host {
    use super::*;

    /// Bytes of one expert of one matrix.
    pub(crate) const NB2: usize = 2 * 3 * 4;

    pub(crate) struct Layer {
        pub(crate) zc: ZeroCopy,
        pub(crate) src: Mats<T>,
        pub(crate) hot: Mats<T>,
        pub(crate) copy: Mats<T>,
        pub(crate) log: T,
        /// The context of the RAM copy (its matrices, the log and the spare bytes).
        pub(crate) copy_ctx: *mut sys::ggml_context,
        pub(crate) owned: Owned,
    }

    /// `n_hot` hot slots and `n_cold` RAM copy rows of a layer of `n_expert` experts routed
    /// `n_used` per token; the log holds 9.0 before ZeroCopy::new sees it.
    pub(crate) fn layer(n_expert: usize, n_hot: usize, n_cold: usize, n_used: usize, il: i32) -> Layer {
        let mut owned = Owned::default();
        // SAFETY: no preconditions.
        let cpu = unsafe { sys::ggml_backend_cpu_buffer_type() };
        let a = Alloc::new(3);
        let mat = |name: &str| {
            // SAFETY: a's context has room for three tensors' metadata.
            let t = unsafe { sys::ggml_new_tensor_3d(a.ctx, sys::GGML_TYPE_F32, 2, 3, n_expert as i64) };
            set_name(t, name);
            t
        };
        let src = Mats { up: Some(mat("up")), gate: Some(mat("gate")), down: Some(mat("down")), gate_up: None };
        a.commit(cpu, &mut owned, "experts").expect("host memory");
        let a = Alloc::new(6);
        let hot = src.map(|t| Some(a.like(t, n_hot + n_used, "hot"))).expect("infallible");
        let tables = src.map(|_| Some(a.table(n_expert, "table"))).expect("infallible");
        a.commit(cpu, &mut owned, "hot tier").expect("host memory");
        let a = Alloc::new(5);
        let copy = src.map(|t| Some(a.like(t, n_cold + 1, "cold"))).expect("infallible");
        let log = log_tensor(&a, n_used, il);
        let copy_ctx = a.ctx;
        a.commit(cpu, &mut owned, "RAM copy").expect("host memory");
        // SAFETY: log is an allocated f32 tensor in host memory.
        unsafe { std::slice::from_raw_parts_mut((*log).data.cast::<f32>(), sys::ggml_nelements(log) as usize).fill(9.0) };
        let zc = ZeroCopy::new(std::ptr::null_mut(), false, &copy, log, (&src, tables, n_expert), il, &mut owned).expect("the CPU path");
        Layer { zc, src, hot, copy, log, copy_ctx, owned }
    }

    /// The routing log as the host reads it.
    pub(crate) fn read_log(log: T) -> Vec<f32> {
        // SAFETY: log is an allocated f32 tensor in host memory.
        unsafe { std::slice::from_raw_parts((*log).data.cast::<f32>(), sys::ggml_nelements(log) as usize) }.to_vec()
    }

    /// Writes `ids` into the log from its start, as a step's kernels do.
    pub(crate) fn write_log(log: T, ids: &[f32]) {
        // SAFETY: log is an allocated f32 tensor in host memory; no graph writes it in tests.
        unsafe { sys::ggml_backend_tensor_set(log, ids.as_ptr().cast(), 0, std::mem::size_of_val(ids)) };
    }
}

#[cfg(test)]
mod tests {
    use super::on_host::{layer, read_log, write_log, NB2};
    use super::*;

    const N_EXPERT: usize = 5;
    const N_USED: usize = 2;
    /// Experts 3 and 1 hot in slots 0 and 1; 2, 4 and 0 cold in rows 0, 1 and 2.
    const HOT: [i32; N_EXPERT] = [-1, 1, -1, 0, -1];
    const COLD: [i32; N_EXPERT] = [2, -1, 0, -1, 1];

    /// Fills expert `i` of `t` (all its values) with `value(i)`.
    fn mark(t: T, value: impl Fn(usize) -> f32) {
        // SAFETY: t is an allocated f32 tensor in host memory.
        let (data, n) = unsafe { ((*t).data.cast::<f32>(), (*t).ne[2] as usize) };
        for i in 0..n {
            // SAFETY: expert i spans NB2 bytes at i * NB2.
            unsafe { std::slice::from_raw_parts_mut(data.add(i * NB2 / 4), NB2 / 4).fill(value(i)) };
        }
    }

    /// The u64 entries of a [2, n] i32 table.
    fn entries(table: T, n: usize) -> Vec<u64> {
        let mut out = vec![0u64; n];
        // SAFETY: table holds n u64 in a host buffer.
        unsafe { sys::ggml_backend_tensor_get(table, out.as_mut_ptr().cast(), 0, n * 8) };
        out
    }

    /// The values of the expert an entry addresses.
    fn expert_at(addr: u64) -> Vec<f32> {
        // SAFETY: the entries address experts of NB2 bytes in the fixture's host buffers.
        unsafe { std::slice::from_raw_parts(addr as *const f32, NB2 / 4) }.to_vec()
    }

    fn tensor<'a>(t: T) -> &'a sys::ggml_tensor {
        // SAFETY: the fixture's tensors live as long as the test that reads them.
        unsafe { &*t }
    }

    fn address(t: T, at: usize) -> u64 {
        // SAFETY: t is live metadata.
        let p = unsafe { (*t).op_params };
        u64::from(p[at] as u32) | (u64::from(p[at + 1] as u32) << 32)
    }

    /// Hot slots and RAM copy rows hold what placement copies there (matrix m's expert e reads
    /// 100 m + e); pads are zero.
    fn placed(l: &on_host::Layer) {
        let slot_of = |slots: &[i32; N_EXPERT], s: usize| slots.iter().position(|&x| x == s as i32);
        for (m, (h, c)) in l.hot.iter().zip(l.copy.iter()).enumerate() {
            let v = |e: Option<usize>| e.map_or(0.0, |e| (100 * m + e) as f32);
            mark(h, |s| v(slot_of(&HOT, s)));
            mark(c, |r| v(slot_of(&COLD, r)));
        }
    }

    #[test]
    fn each_table_entry_points_at_its_experts_weights_in_the_hot_tier_or_the_ram_copy() {
        let l = layer(N_EXPERT, 2, 3, N_USED, 7);
        placed(&l);
        l.zc.table.write(Some(&l.hot), &l.zc.mats, &HOT, &COLD);
        for (m, table) in l.zc.table.tables.iter().enumerate() {
            let at = entries(table, N_EXPERT);
            for (e, &a) in at.iter().enumerate() {
                assert_eq!(expert_at(a), vec![(100 * m + e) as f32; NB2 / 4], "matrix {m}, expert {e}");
            }
            // SAFETY: live tensors.
            let (hot_base, copy_base) = unsafe { ((*l.hot.iter().nth(m).unwrap()).data as u64, (*l.copy.iter().nth(m).unwrap()).data as u64) };
            assert_eq!(at[3], hot_base, "expert 3 in hot slot 0");
            assert_eq!(at[0], copy_base + 2 * NB2 as u64, "expert 0 in row 2 of the copy");
        }
    }

    #[test]
    fn without_hot_tier_tensors_hot_experts_read_the_copys_zero_pad_row() {
        let l = layer(N_EXPERT, 2, 3, N_USED, 7);
        placed(&l);
        l.zc.table.write(None, &l.zc.mats, &HOT, &COLD);
        for (m, (table, c)) in l.zc.table.tables.iter().zip(l.copy.iter()).enumerate() {
            let at = entries(table, N_EXPERT);
            // SAFETY: live tensor.
            let pad = unsafe { (*c).data as u64 } + 3 * NB2 as u64;
            assert_eq!((at[1], at[3]), (pad, pad), "matrix {m}: hot experts at the pad row after the 3 cold ones");
            assert_eq!(expert_at(pad), vec![0.0; NB2 / 4]);
            for e in [0, 2, 4] {
                assert_eq!(expert_at(at[e]), vec![(100 * m + e) as f32; NB2 / 4], "cold expert {e} still at its row");
            }
        }
    }

    #[test]
    fn the_by_table_tensors_name_their_tables_and_the_down_projection_names_the_log() {
        let l = layer(N_EXPERT, 2, 3, N_USED, 7);
        let by_table: Vec<T> = l.zc.table.mats.iter().collect();
        let tables: Vec<T> = l.zc.table.tables.iter().collect();
        assert_eq!(by_table.len(), 3, "one per matrix of the layer");
        for ((&t, &table), s) in by_table.iter().zip(&tables).zip(l.src.iter()) {
            assert_eq!(address(t, 4), tensor(table).data as u64, "its table's address");
            let (v, table, s) = (tensor(t), tensor(table), tensor(s));
            assert_eq!(v.ne[..3], [s.ne[0], s.ne[1], N_EXPERT as i64], "every expert id, shaped like the layer's matrix");
            assert_eq!((v.data, v.buffer), (table.data, table.buffer), "placed where its table is");
            // SAFETY: ggml names are NUL-terminated.
            assert_eq!(unsafe { std::ffi::CStr::from_ptr(v.name.as_ptr()) }.to_str().unwrap(), "blk.7.exps.by_table");
        }
        // SAFETY: live tensor.
        let log = unsafe { (*l.log).data as u64 };
        let down = l.zc.table.mats.down.expect("a down projection");
        assert_eq!(address(down, 10), log, "the down projection's kernels write the routing to the log");
        assert_eq!(address(l.zc.table.mats.up.unwrap(), 10), 0, "only the down projection writes it");
        // Without a GPU the copy itself serves, for batches up to MAX_TOKENS.
        assert_eq!(l.zc.mats.down, l.copy.down);
        assert_eq!(l.zc.max_tokens, MAX_TOKENS);
    }

    #[test]
    fn a_new_log_is_empty_and_take_log_reads_each_step_once() {
        let l = layer(N_EXPERT, 2, 3, N_USED, 7);
        assert!(read_log(l.log).iter().all(|&v| v == -1.0), "ZeroCopy::new resets what was there");
        let mut out = vec![42];
        l.zc.take_log(&mut out);
        assert_eq!(out, [42], "nothing logged, nothing read");
        // A step of 2 tokens routed to (3, 0) and (4, 1).
        write_log(l.log, &[3.0, 0.0, 4.0, 1.0]);
        l.zc.take_log(&mut out);
        assert_eq!(out, [42, 3, 0, 4, 1], "appended in the log's order");
        assert!(read_log(l.log).iter().all(|&v| v == -1.0), "and the log is empty again");
        l.zc.take_log(&mut out);
        assert_eq!(out.len(), 5, "a step is read once");
        // A log whose first entry is empty is taken as empty (a step writes its first id first).
        write_log(l.log, &[-1.0, 2.0]);
        l.zc.take_log(&mut out);
        assert_eq!(out.len(), 5);
    }

    #[test]
    fn the_log_holds_max_tokens_of_routing_and_spare_bytes_follow_the_copy() {
        let l = layer(N_EXPERT, 2, 3, N_USED, 7);
        // SAFETY: live tensor.
        let ne = unsafe { (*l.log).ne };
        assert_eq!((ne[0], ne[1]), (N_USED as i64, MAX_TOKENS));
        let full: Vec<i32> = (0..N_USED * MAX_TOKENS as usize).map(|i| (i % N_EXPERT) as i32).collect();
        write_log(l.log, &full.iter().map(|&e| e as f32).collect::<Vec<_>>());
        let mut out = Vec::new();
        l.zc.take_log(&mut out);
        assert_eq!(out, full, "a batch of MAX_TOKENS tokens is read whole");
        // The spare bytes are in the copy's buffer after its last matrix and the log.
        let name = std::ffi::CString::new("blk.7.exps.spare").unwrap();
        // SAFETY: live context and tensors.
        unsafe {
            let spare = sys::ggml_get_tensor(l.copy_ctx, name.as_ptr());
            assert!(!spare.is_null());
            assert_eq!(sys::ggml_nbytes(spare), SPARE_BYTES as usize);
            assert_eq!((*spare).buffer, (*l.log).buffer);
            let buf = (*spare).buffer;
            let end = sys::ggml_backend_buffer_get_base(buf) as usize + sys::ggml_backend_buffer_get_size(buf);
            let last = l.copy.iter().map(|t| (*t).data as usize + sys::ggml_nbytes(t)).max().unwrap();
            assert!(end - last >= SPARE_BYTES as usize, "room for the device's row padding past the last matrix");
        }
    }
}
