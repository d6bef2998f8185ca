//! PLE rows served from the model file: the mechanism behind `--ple-mode ssd`.
//!
//! llama.cpp keeps the table in the file (`--lazy-mode on`) and, through the hook of
//! patches/0004, asks for the rows each ubatch needs instead of reading the mapping. The rows
//! come from the RAM row cache or, for misses, from a pool of direct-I/O readers
//! (residency::direct_io), deduplicated, and are written as the file holds them, so the graph's
//! get_rows dequantizes exactly the bytes it would have read. A failed read makes llama.cpp
//! read those rows from the mapping instead; it is logged and counted.
//!
//! ```text
//!   ubatch rows ──> cache ──hit──────────────────────────┐
//!                     └─miss─> ReadPool (T workers, O_DIRECT) ─> cache ─> dst (table type)
//! ```
//!
//! A prompt's rows are known before its batches run (for tables indexed by token): the engine
//! hands them to `prefetch`, whose thread reads them chunk by chunk into the cache while earlier
//! batches compute; a batch needing a row still in flight waits for it rather than reading it
//! twice. In decode, when a token goes into a batch, the rows of the tokens seen to follow it
//! before (residency::ple::Successors, learned from prompts and generations) are read while that
//! batch computes, so the next token's rows are often in the cache when its batch needs them.
//!
//! Missing rows are sorted and rows within COALESCE_GAP of each other read as one range, since
//! a direct read fetches whole 4 KiB blocks anyway.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use strata_residency::direct_io::{ReadPool, Stats as IoStats, LATENCY_BUCKETS_US};
use strata_residency::gguf;
use strata_residency::ple::{NgramHash, PleTable, RowCache, Successors};

use crate::hooks::PleRows;
use crate::sys;
use crate::Verbosity;

/// How the rows are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PleConfig {
    /// Reader threads (STRATA_IO_THREADS).
    pub threads: usize,
    /// Bytes of rows kept in RAM.
    pub cache_bytes: u64,
}

/// What `enable` found and set up, for the start-up log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleSetup {
    pub table_bytes: u64,
    pub row_bytes: u64,
    pub n_rows: u64,
    pub threads: usize,
    /// False when the filesystem refused O_DIRECT and reads are buffered.
    pub direct: bool,
}

/// Counters for /metrics, beside the pool's own.
#[derive(Debug, Default)]
struct Counters {
    rows: AtomicU64,
    cache_hits: AtomicU64,
    fallbacks: AtomicU64,
    prefetched: AtomicU64,
    prefetch_used: AtomicU64,
    successor_prefetched: AtomicU64,
    successor_used: AtomicU64,
    /// Batches whose rows could be read neither by the pool nor by a buffered retry.
    failures: AtomicU64,
    /// Time batches spent getting their rows (cache, waits for the prefetcher, reads), µs.
    supply_us: AtomicU64,
}

struct Provider {
    table: PleTable,
    pool: ReadPool,
    /// The model file opened for buffered reads: a batch whose direct reads failed tries once more
    /// through it before giving up.
    retry: std::fs::File,
    /// Why the last batch's rows could not be read, until the context that decoded it asks.
    failure: Mutex<Option<String>>,
    cache: Mutex<RowCache>,
    counters: Counters,
    /// The table has a row per token (gemma4), so a prompt's rows are known before its batches.
    rows_are_tokens: bool,
    /// qwen4exp: rows are hashed n-grams of the tokens (None: another table, or unreadable
    /// parameters, then no prefetch).
    hash: Option<NgramHash>,
    /// Rows the prefetcher read that no batch has used yet, and whether for decode's successors
    /// (else for a prompt).
    prefetched_rows: Mutex<HashMap<u32, bool>>,
    /// Rows a prefetch is reading now; a batch that needs one waits for it instead of reading it
    /// again.
    inflight: Mutex<HashSet<u32>>,
    landed: Condvar,
    /// Chunks of rows for the prefetch thread, in the order the batches will need them (and
    /// whether they are decode's successors).
    prefetch: Mutex<Option<mpsc::Sender<Chunk>>>,
    /// Tokens seen to follow each token, for decode's prefetch.
    successors: Mutex<Successors>,
}

/// Rows for the prefetch thread, and whether they are decode's successors (else a prompt's).
type Chunk = (Vec<u32>, bool);

/// Successors remembered per token, and tokens remembered at most (a few MB).
const SUCCESSORS_PER_TOKEN: usize = 4;
const SUCCESSOR_TOKENS: usize = 1 << 16;

/// How long a batch waits for rows a prefetch is reading before it reads them itself.
const INFLIGHT_WAIT: Duration = Duration::from_secs(10);

/// A provider waiting for the model whose table it serves to build its first graph.
static PENDING: Mutex<Option<Arc<Provider>>> = Mutex::new(None);
/// Providers by the address of the model they serve.
static BOUND: RwLock<Option<HashMap<usize, Arc<Provider>>>> = RwLock::new(None);

/// Serves the PLE table of the model at `path` from the file for the next model loaded with that
/// table. Call before loading it. Errors when the file has no PLE table, a truncated one, or the
/// readers cannot start.
pub fn enable(path: &Path, cfg: PleConfig) -> Result<PleSetup, String> {
    let info = gguf::read_info(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let table = PleTable::find(&info)?
        .ok_or_else(|| format!("{}: the model has no per-layer embedding table ({})", path.display(), strata_residency::ple::TABLE_NAME))?;
    if !crate::hooks::installed() {
        return Err("Strata's hooks are not installed in llama.cpp (install_hooks before loading the model)".into());
    }
    let pool = ReadPool::open(path, cfg.threads, true).map_err(|e| format!("{}: cannot start the PLE readers: {e}", path.display()))?;
    let retry = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let setup = PleSetup { table_bytes: table.bytes(), row_bytes: table.row_bytes, n_rows: table.n_rows, threads: pool.threads(), direct: pool.direct() };
    let arch = info.get("general.architecture").and_then(|v| v.as_str()).unwrap_or_default();
    let hash = match arch {
        "qwen4exp" => ngram_hash(&info, arch).map_err(|e| crate::log(Verbosity::Warn, &format!("srv     ple_rows: no prefetch: {e}\n"))).ok(),
        _ => None,
    };
    let provider = Arc::new(Provider {
        table,
        pool,
        retry,
        failure: Mutex::new(None),
        cache: Mutex::new(RowCache::new(cfg.cache_bytes)),
        counters: Counters::default(),
        rows_are_tokens: matches!(arch, "gemma4" | "gemma3n"),
        hash,
        prefetched_rows: Mutex::new(HashMap::new()),
        inflight: Mutex::new(HashSet::new()),
        landed: Condvar::new(),
        prefetch: Mutex::new(None),
        successors: Mutex::new(Successors::new(SUCCESSORS_PER_TOKEN, SUCCESSOR_TOKENS)),
    });
    if (provider.rows_are_tokens || provider.hash.is_some()) && cfg.cache_bytes > 0 {
        let (tx, rx) = mpsc::channel::<Chunk>();
        let weak = Arc::downgrade(&provider);
        std::thread::Builder::new()
            .name("strata-ple-prefetch".into())
            .spawn(move || prefetcher(&weak, &rx))
            .map_err(|e| format!("cannot start the PLE prefetch thread: {e}"))?;
        *provider.prefetch.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
    }
    *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(provider);
    Ok(setup)
}

/// Whether the table's shape and type are the provider's (a draft model's table is not).
fn matches(p: &Provider, table: *const sys::ggml_tensor) -> bool {
    if table.is_null() {
        return false;
    }
    // SAFETY: llama.cpp passes a tensor of a loaded model, live for the call.
    let t = unsafe { &*table };
    t.ne[0] as u64 == p.table.ne0 && t.ne[1] as u64 == p.table.n_rows && t.type_ == p.table.ggml_type
}

fn bound(model: *const sys::llama_model) -> Option<Arc<Provider>> {
    BOUND.read().ok()?.as_ref()?.get(&(model as usize)).cloned()
}

pub(crate) fn serves(model: *const sys::llama_model, table: *const sys::ggml_tensor) -> bool {
    if let Some(p) = bound(model) {
        return matches(&p, table);
    }
    let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
    if !pending.as_ref().is_some_and(|p| matches(p, table)) {
        return false;
    }
    let Some(p) = pending.take() else { return false };
    let mut b = BOUND.write().unwrap_or_else(|e| e.into_inner());
    b.get_or_insert_with(HashMap::new).insert(model as usize, p);
    true
}

/// qwen4exp's n-gram hash parameters from the file's metadata (the keys llama.cpp reads).
fn ngram_hash(info: &gguf::GgufInfo, arch: &str) -> Result<NgramHash, String> {
    let get = |name: &str| info.get(&format!("{arch}.ple.{name}")).ok_or_else(|| format!("the model has no {arch}.ple.{name}"));
    let int = |name: &str| get(name)?.as_u64().ok_or_else(|| format!("{arch}.ple.{name} is not a non-negative integer"));
    let list = |name: &str| Ok::<_, String>(get(name)?.as_ints().ok_or_else(|| format!("{arch}.ple.{name} is not a short integer array"))?.to_vec());
    NgramHash::new(
        int("ngram_size")? as usize,
        int("heads_per_ngram")? as usize,
        list("layer_multipliers")?,
        list("head_offsets")?,
        list("head_vocab_sizes")?,
        int("eos_token_id")? as i64,
    )
}

pub(crate) fn forget_model(model: *const sys::llama_model) {
    if let Ok(mut b) = BOUND.write() {
        if let Some(map) = b.as_mut() {
            map.remove(&(model as usize));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_rows_share_a_read_and_distant_ones_do_not() {
        let t = PleTable { offset: 1000, row_bytes: 34, n_rows: 1_000_000, ne0: 32, ggml_type: 8 };
        let s = spans(&t, &[1, 2, 5, 400, 100_000]).unwrap();
        assert_eq!(s.len(), 2, "rows 1..=400 lie within 16 KiB of each other");
        assert_eq!((s[0].offset, s[0].len, s[0].rows.clone()), (1000 + 34, 400 * 34, 0..4));
        assert_eq!((s[1].offset, s[1].len, s[1].rows.clone()), (1000 + 100_000 * 34, 34, 4..5));
        assert!(spans(&t, &[1_000_000]).unwrap_err().contains("past the table"));
    }
}

pub(crate) fn fill(args: &mut PleRows<'_>) -> bool {
    let Some(p) = bound(args.model()) else { return false };
    if args.row_bytes() as u64 != p.table.row_bytes || !matches(&p, args.table()) {
        return false;
    }
    // A panic must not send llama.cpp to the mapping either: the batch fails instead.
    let t0 = Instant::now();
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fill_from_file(&p, args)));
    p.counters.supply_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
    if read.is_err() {
        fail(&p, args.dst(), "could not read the model's per-layer embedding rows: the reader failed".into());
    }
    true
}

/// A batch without its rows: zeroed, counted, and its reason kept for the batch's failure.
fn fail(p: &Provider, dst: &mut [u8], msg: String) {
    dst.fill(0);
    p.counters.failures.fetch_add(1, Ordering::Relaxed);
    *p.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg);
}

fn fill_from_file(p: &Provider, args: &mut PleRows<'_>) {
    let rows = args.rows();
    let dst = args.dst();
    let Err(e) = read_rows(p, rows, dst) else { return };
    // Never through the mapping: after an I/O error or with the file cut short underneath, a
    // page fault there would kill the server (SIGBUS). One buffered retry, else the batch fails.
    p.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
    match read_rows_buffered(p, rows, dst) {
        Ok(()) => crate::log(Verbosity::Warn, &format!("srv     ple_rows: {e}; read again without direct I/O\n")),
        Err(e2) => {
            let msg = format!("could not read the model's per-layer embedding rows: {e2}");
            crate::log(Verbosity::Error, &format!("srv     ple_rows: {e}; retry: {msg}\n"));
            fail(p, dst, msg);
        }
    }
}

/// Why a batch that `model`'s context just decoded had no rows, if so (cleared by asking): its
/// output is wrong and the batch must fail.
pub(crate) fn take_failure(model: *const sys::llama_model) -> Option<String> {
    bound(model)?.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Reads `rows` into `dst` one by one with buffered preads.
fn read_rows_buffered(p: &Provider, rows: &[i32], dst: &mut [u8]) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let rb = p.table.row_bytes as usize;
    for (out, &r) in dst.chunks_exact_mut(rb).zip(rows) {
        let (offset, _) = u32::try_from(r).ok().and_then(|r| p.table.row(r)).ok_or_else(|| format!("row {r} is past the table"))?;
        p.retry.read_exact_at(out, offset).map_err(|e| format!("row {r} at byte {offset}: {e}"))?;
    }
    Ok(())
}

/// Writes `rows` into `dst` (row_bytes each, in order) from the cache and the readers.
fn read_rows(p: &Provider, rows: &[i32], dst: &mut [u8]) -> Result<(), String> {
    let rb = p.table.row_bytes as usize;
    if dst.len() != rows.len() * rb {
        return Err(format!("{} rows need {} bytes, the buffer has {}", rows.len(), rows.len() * rb, dst.len()));
    }
    let mut have: HashMap<u32, Arc<[u8]>> = HashMap::new();
    let mut missing: Vec<u32> = Vec::new();
    {
        let mut cache = p.cache.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = HashSet::new();
        for &r in rows {
            let r = u32::try_from(r).map_err(|_| format!("row {r} out of range"))?;
            if !seen.insert(r) {
                continue;
            }
            match cache.get(r) {
                Some(b) => {
                    have.insert(r, b);
                }
                None => missing.push(r),
            }
        }
    }
    if !missing.is_empty() {
        wait_inflight(p, &missing);
        let mut cache = p.cache.lock().unwrap_or_else(|e| e.into_inner());
        missing.retain(|&r| match cache.get(r) {
            Some(b) => {
                have.insert(r, b);
                false
            }
            None => true,
        });
    }
    p.counters.cache_hits.fetch_add(have.len() as u64, Ordering::Relaxed);
    {
        let mut pre = p.prefetched_rows.lock().unwrap_or_else(|e| e.into_inner());
        if !pre.is_empty() {
            for r in have.keys() {
                match pre.remove(r) {
                    Some(false) => p.counters.prefetch_used.fetch_add(1, Ordering::Relaxed),
                    Some(true) => p.counters.successor_used.fetch_add(1, Ordering::Relaxed),
                    None => 0,
                };
            }
        }
    }
    if !missing.is_empty() {
        missing.sort_unstable();
        let read = read_from_file(p, &missing)?;
        have.extend(missing.into_iter().zip(read));
    }
    for (out, &r) in dst.chunks_exact_mut(rb).zip(rows) {
        out.copy_from_slice(&have[&(r as u32)]);
    }
    p.counters.rows.fetch_add(rows.len() as u64, Ordering::Relaxed);
    Ok(())
}

/// Reads the sorted, distinct `rows` from the file (neighbours coalesced into one read) and keeps
/// them in the cache; their bytes come back in the same order.
fn read_from_file(p: &Provider, rows: &[u32]) -> Result<Vec<Arc<[u8]>>, String> {
    let rb = p.table.row_bytes as usize;
    let spans = spans(&p.table, rows)?;
    let ranges: Vec<(u64, usize)> = spans.iter().map(|s| (s.offset, s.len)).collect();
    let read = p.pool.submit(&ranges).wait().map_err(|e| format!("reading {} PLE rows: {e}", rows.len()))?;
    let mut out = Vec::with_capacity(rows.len());
    let mut cache = p.cache.lock().unwrap_or_else(|e| e.into_inner());
    for (span, bytes) in spans.iter().zip(read) {
        for &r in &rows[span.rows.clone()] {
            let at = (p.table.row(r).map_or(0, |(o, _)| o) - span.offset) as usize;
            let row: Arc<[u8]> = bytes[at..at + rb].into();
            cache.insert(r, row.clone());
            out.push(row);
        }
    }
    Ok(out)
}

/// Waits (at most INFLIGHT_WAIT) until no row of `rows` is being read by the prefetcher.
fn wait_inflight(p: &Provider, rows: &[u32]) {
    let deadline = Instant::now() + INFLIGHT_WAIT;
    let mut inflight = p.inflight.lock().unwrap_or_else(|e| e.into_inner());
    while rows.iter().any(|r| inflight.contains(r)) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        inflight = p.landed.wait_timeout(inflight, left).unwrap_or_else(|e| e.into_inner()).0;
    }
}

/// Reads chunks of rows into the cache ahead of the batches that need them, until the provider
/// is gone.
fn prefetcher(provider: &Weak<Provider>, rx: &mpsc::Receiver<Chunk>) {
    while let Ok((mut todo, successors)) = rx.recv() {
        let Some(p) = provider.upgrade() else { return };
        todo.sort_unstable();
        if read_from_file(&p, &todo).is_ok() {
            let counter = if successors { &p.counters.successor_prefetched } else { &p.counters.prefetched };
            counter.fetch_add(todo.len() as u64, Ordering::Relaxed);
            p.prefetched_rows.lock().unwrap_or_else(|e| e.into_inner()).extend(todo.iter().map(|&r| (r, successors)));
        }
        let mut inflight = p.inflight.lock().unwrap_or_else(|e| e.into_inner());
        for r in &todo {
            inflight.remove(r);
        }
        drop(inflight);
        p.landed.notify_all();
    }
}

/// Hands the prefetcher those of `rows` that are neither cached nor being read. They count as in
/// flight from here, not from when the prefetcher's thread wakes, so a batch that needs one waits
/// for that read instead of reading the row a second time itself.
fn send_rows(p: &Provider, tx: &mpsc::Sender<Chunk>, rows: impl IntoIterator<Item = u32>, successors: bool) -> bool {
    let todo: Vec<u32> = {
        let mut cache = p.cache.lock().unwrap_or_else(|e| e.into_inner());
        let mut inflight = p.inflight.lock().unwrap_or_else(|e| e.into_inner());
        let todo: Vec<u32> = rows.into_iter().filter(|&r| !inflight.contains(&r) && cache.get(r).is_none()).collect::<HashSet<_>>().into_iter().collect();
        inflight.extend(&todo);
        todo
    };
    if todo.is_empty() {
        return true;
    }
    match tx.send((todo, successors)) {
        Ok(()) => true,
        Err(mpsc::SendError((todo, _))) => {
            let mut inflight = p.inflight.lock().unwrap_or_else(|e| e.into_inner());
            for r in &todo {
                inflight.remove(r);
            }
            drop(inflight);
            p.landed.notify_all();
            false
        }
    }
}

/// Starts reading the rows that the batches of `prompt[from..]` will need, one `chunk` of tokens
/// after another, while the engine decodes (`prompt[..from]` is already in the sequence). A no-op
/// unless the model's table is served from the file and its rows are known from the tokens (a
/// row per token, or qwen4exp's n-gram hash); at most half the row cache is prefetched so that
/// early rows are not evicted before their batch runs.
pub fn prefetch(model: *const sys::llama_model, prompt: &[i32], from: usize, chunk: usize) {
    let Some(p) = bound(model) else { return };
    let Some(tx) = p.prefetch.lock().unwrap_or_else(|e| e.into_inner()).clone() else { return };
    let from = from.min(prompt.len());
    p.successors.lock().unwrap_or_else(|e| e.into_inner()).observe_all(prompt);
    let (rows, per_token): (Vec<u32>, usize) = if p.rows_are_tokens {
        (prompt[from..].iter().filter_map(|&t| u32::try_from(t).ok()).collect(), 1)
    } else if let Some(h) = p.hash.as_ref() {
        let mut rows = Vec::with_capacity((prompt.len() - from) * h.heads());
        h.rows(prompt, from, &mut rows);
        (rows, h.heads())
    } else {
        return;
    };
    let budget = (p.cache.lock().map(|c| c.budget()).unwrap_or(0) / 2 / p.table.row_bytes.max(1)) as usize;
    let rows: Vec<u32> = rows.into_iter().filter(|&r| u64::from(r) < p.table.n_rows).take(budget).collect();
    for c in rows.chunks(chunk.max(1) * per_token) {
        if !send_rows(&p, &tx, c.iter().copied(), false) {
            return;
        }
    }
}

/// Decode: `tokens` is the sequence with the token just put into a batch last. Records it as a
/// successor of the one before, and starts reading the rows of its own known successors, one of
/// which is likely the next token, while its batch computes. A no-op where `prefetch` is.
pub fn after_token(model: *const sys::llama_model, tokens: &[i32]) {
    let Some(p) = bound(model) else { return };
    let Some(tx) = p.prefetch.lock().unwrap_or_else(|e| e.into_inner()).clone() else { return };
    let Some(&last) = tokens.last() else { return };
    let next: Vec<i32> = {
        let mut succ = p.successors.lock().unwrap_or_else(|e| e.into_inner());
        if let [.., prev, _] = tokens {
            succ.observe(*prev, last);
        }
        succ.of(last).to_vec()
    };
    if next.is_empty() {
        return;
    }
    let mut rows = Vec::new();
    if p.rows_are_tokens {
        rows.extend(next.iter().filter_map(|&t| u32::try_from(t).ok()));
    } else if let Some(h) = p.hash.as_ref() {
        // The n-grams ending at a candidate reach back n_gram - 1 tokens.
        let tail = &tokens[tokens.len().saturating_sub(h.n_gram.saturating_sub(1))..];
        let mut seq = tail.to_vec();
        for &c in &next {
            seq.truncate(tail.len());
            seq.push(c);
            h.rows(&seq, tail.len(), &mut rows);
        }
    }
    rows.retain(|&r| u64::from(r) < p.table.n_rows);
    send_rows(&p, &tx, rows, true);
}

/// Rows closer than this in the file are read as one range: a direct read costs at least a
/// 4 KiB block, so neighbouring small rows share it.
const COALESCE_GAP: u64 = 16 << 10;

/// One read covering the sorted rows `rows` of the missing list.
#[derive(Debug)]
struct Span {
    offset: u64,
    len: usize,
    rows: std::ops::Range<usize>,
}

/// Groups sorted, distinct rows into reads, merging those within COALESCE_GAP of each other.
fn spans(table: &PleTable, sorted: &[u32]) -> Result<Vec<Span>, String> {
    let mut out: Vec<Span> = Vec::new();
    for (i, &r) in sorted.iter().enumerate() {
        let (off, len) = table.row(r).ok_or_else(|| format!("row {r} past the table's {} rows", table.n_rows))?;
        match out.last_mut() {
            Some(s) if off <= s.offset + s.len as u64 + COALESCE_GAP => {
                s.len = (off + len as u64 - s.offset) as usize;
                s.rows.end = i + 1;
            }
            _ => out.push(Span { offset: off, len, rows: i..i + 1 }),
        }
    }
    Ok(out)
}

/// A snapshot of the counters of the provider serving `model`'s table (or the one waiting).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PleStats {
    pub rows: u64,
    pub cache_hits: u64,
    pub prefetched: u64,
    /// Prefetched rows that a batch then used.
    pub prefetch_used: u64,
    /// Decode's successor rows read ahead, and those a batch then used.
    pub successor_prefetched: u64,
    pub successor_used: u64,
    pub cache_bytes: u64,
    /// Batches whose direct reads failed and were retried with buffered reads.
    pub fallbacks: u64,
    /// Batches whose rows could not be read at all (the batch failed).
    pub failures: u64,
    pub reads: u64,
    pub bytes_read: u64,
    pub queued: u64,
    /// Time batches spent getting their rows, on the batch's path (µs).
    pub supply_us: u64,
    /// Reads by latency, with the upper bounds of the buckets but the last (µs).
    pub latency: [u64; 4],
    pub latency_bounds_us: [u64; 3],
}

/// The counters of every provider, summed (one model per server in practice); None without one.
pub fn stats() -> Option<PleStats> {
    let mut all: Vec<Arc<Provider>> = BOUND.read().ok()?.as_ref().map(|m| m.values().cloned().collect()).unwrap_or_default();
    all.extend(PENDING.lock().ok()?.clone());
    if all.is_empty() {
        return None;
    }
    let mut s = PleStats { latency_bounds_us: LATENCY_BUCKETS_US, ..PleStats::default() };
    for p in all {
        let io: &IoStats = p.pool.stats();
        s.rows += p.counters.rows.load(Ordering::Relaxed);
        s.cache_hits += p.counters.cache_hits.load(Ordering::Relaxed);
        s.prefetched += p.counters.prefetched.load(Ordering::Relaxed);
        s.prefetch_used += p.counters.prefetch_used.load(Ordering::Relaxed);
        s.successor_prefetched += p.counters.successor_prefetched.load(Ordering::Relaxed);
        s.successor_used += p.counters.successor_used.load(Ordering::Relaxed);
        s.fallbacks += p.counters.fallbacks.load(Ordering::Relaxed);
        s.failures += p.counters.failures.load(Ordering::Relaxed);
        s.supply_us += p.counters.supply_us.load(Ordering::Relaxed);
        s.cache_bytes += p.cache.lock().map(|c| c.used()).unwrap_or(0);
        s.reads += io.reads.load(Ordering::Relaxed);
        s.bytes_read += io.bytes.load(Ordering::Relaxed);
        s.queued += io.queued.load(Ordering::Relaxed) as u64;
        for (a, b) in s.latency.iter_mut().zip(&io.latency) {
            *a += b.load(Ordering::Relaxed);
        }
    }
    Some(s)
}
