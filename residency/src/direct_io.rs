//! A pool of threads that read byte ranges of one file with direct I/O (O_DIRECT), for tables
//! far larger than what one batch touches (per-layer token embeddings kept on SSD).
//!
//! Direct reads bypass the page cache, so a large table does not evict the memory the server
//! needs and its cost is the device's, not a page fault's per 4 KiB (llama.cpp PRs #28136 and
//! #29030 measured explicit reads well ahead of mmap faults). O_DIRECT wants the file offset,
//! the length and the buffer aligned to the device's logical block: each read is widened to
//! ALIGN-aligned bounds into an aligned buffer and the wanted bytes are cut out of it; the last
//! block of the file comes back short and is handled as such. Filesystems that refuse O_DIRECT
//! (tmpfs, some overlays) get buffered preads instead, which [`ReadPool::direct`] reports.
//!
//! Reads are queued; each worker takes the next one, so a batch of many rows spreads over the
//! pool and its latency is the slowest worker's. [`ReadPool::close`] wakes every worker, lets
//! the queued reads finish, and joins them.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Alignment of direct reads: offsets, lengths and buffers (a multiple of every common logical
/// block size).
pub const ALIGN: usize = 4096;

/// Counters for /metrics.
#[derive(Debug, Default)]
pub struct Stats {
    pub reads: AtomicU64,
    pub bytes: AtomicU64,
    /// Reads queued or in flight.
    pub queued: AtomicUsize,
    /// Reads by latency: below 100 µs, 1 ms, 10 ms, and above.
    pub latency: [AtomicU64; 4],
}

/// Upper bounds (µs) of the latency buckets but the last.
pub const LATENCY_BUCKETS_US: [u64; 3] = [100, 1_000, 10_000];

struct Job {
    offset: u64,
    len: usize,
    index: usize,
    batch: Arc<BatchState>,
}

/// Each read's result once it is in, and how many are still out.
struct Results {
    reads: Vec<Option<io::Result<Vec<u8>>>>,
    pending: usize,
}

struct BatchState {
    slot: Mutex<Results>,
    done: Condvar,
}

/// The reads of one [`ReadPool::submit`].
pub struct Batch(Arc<BatchState>);

impl Batch {
    /// Waits for every read of the batch; each read's bytes in submission order, or the first
    /// error (a read past the end of the file is `UnexpectedEof`).
    pub fn wait(self) -> io::Result<Vec<Vec<u8>>> {
        let mut g = self.0.slot.lock().unwrap_or_else(|e| e.into_inner());
        while g.pending > 0 {
            g = self.0.done.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.reads.drain(..).map(|r| r.unwrap_or_else(|| Err(io::Error::other("read dropped")))).collect()
    }
}

struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

struct Shared {
    file: File,
    direct: bool,
    queue: Mutex<Queue>,
    wake: Condvar,
    stats: Stats,
}

/// A file and the workers that read it.
pub struct ReadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl ReadPool {
    /// Opens `path` with `threads` workers (at least one) for direct reads, or buffered ones
    /// where `direct` is false or the filesystem refuses O_DIRECT.
    pub fn open(path: &Path, threads: usize, direct: bool) -> io::Result<Self> {
        let (file, direct) = if !direct {
            (File::open(path)?, false)
        } else {
            match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) if probe_direct(&f) => (f, true),
                Ok(_) => (File::open(path)?, false),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (File::open(path)?, false),
                Err(e) => return Err(e),
            }
        };
        let shared =
            Arc::new(Shared { file, direct, queue: Mutex::new(Queue { jobs: VecDeque::new(), closed: false }), wake: Condvar::new(), stats: Stats::default() });
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let s = shared.clone();
            let w = std::thread::Builder::new().name(format!("strata-io-{i}")).spawn(move || worker(&s));
            match w {
                Ok(w) => workers.push(w),
                Err(e) => {
                    let pool = Self { shared, workers };
                    pool.close();
                    return Err(e);
                }
            }
        }
        Ok(Self { shared, workers })
    }

    /// Whether reads bypass the page cache (false: the filesystem refused O_DIRECT).
    pub fn direct(&self) -> bool {
        self.shared.direct
    }

    pub fn stats(&self) -> &Stats {
        &self.shared.stats
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Queues `(offset, len)` reads; the batch's results come back in this order.
    pub fn submit(&self, reads: &[(u64, usize)]) -> Batch {
        let batch =
            Arc::new(BatchState { slot: Mutex::new(Results { reads: (0..reads.len()).map(|_| None).collect(), pending: reads.len() }), done: Condvar::new() });
        let mut q = self.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
        for (index, &(offset, len)) in reads.iter().enumerate() {
            if q.closed {
                finish(&batch, index, Err(io::Error::other("the read pool is closed")));
                continue;
            }
            q.jobs.push_back(Job { offset, len, index, batch: batch.clone() });
            self.shared.stats.queued.fetch_add(1, Ordering::Relaxed);
        }
        drop(q);
        self.shared.wake.notify_all();
        Batch(batch)
    }

    /// Lets the queued reads finish, then stops and joins the workers.
    pub fn close(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.queue.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl Drop for ReadPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn finish(batch: &BatchState, index: usize, r: io::Result<Vec<u8>>) {
    let mut g = batch.slot.lock().unwrap_or_else(|e| e.into_inner());
    g.reads[index] = Some(r);
    g.pending -= 1;
    if g.pending == 0 {
        batch.done.notify_all();
    }
}

fn worker(s: &Shared) {
    loop {
        let job = {
            let mut q = s.queue.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.closed {
                    return;
                }
                q = s.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let t0 = std::time::Instant::now();
        let r = if s.direct { read_direct(&s.file, job.offset, job.len) } else { read_buffered(&s.file, job.offset, job.len) };
        let us = t0.elapsed().as_micros() as u64;
        let bucket = LATENCY_BUCKETS_US.iter().position(|&b| us < b).unwrap_or(LATENCY_BUCKETS_US.len());
        s.stats.latency[bucket].fetch_add(1, Ordering::Relaxed);
        s.stats.reads.fetch_add(1, Ordering::Relaxed);
        if let Ok(b) = &r {
            s.stats.bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
        s.stats.queued.fetch_sub(1, Ordering::Relaxed);
        finish(&job.batch, job.index, r);
    }
}

/// An ALIGN-aligned window of `len` bytes inside a fresh buffer: (buffer, start of the window).
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let buf = vec![0u8; len + ALIGN];
    let start = buf.as_ptr().align_offset(ALIGN);
    (buf, start)
}

/// Whether a direct read of the first block works (some filesystems accept the flag at open
/// and refuse the reads).
fn probe_direct(f: &File) -> bool {
    let (mut buf, at) = aligned(ALIGN);
    match f.read_at(&mut buf[at..at + ALIGN], 0) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::EINVAL),
    }
}

/// Reads into `buf` at `offset` until it is full or the file ends; the bytes read.
fn read_full(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn short(offset: u64, len: usize, got: usize) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("read of {len} bytes at {offset} ended after {got}: the file is shorter"))
}

fn read_direct(f: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let a = ALIGN as u64;
    let start = offset / a * a;
    let end = (offset + len as u64).div_ceil(a) * a;
    let span = (end - start) as usize;
    let (mut buf, at) = aligned(span);
    // A direct read may only stop short at the end of the file, and then within a block; keep
    // whole blocks in the loop so every request stays aligned.
    let mut n = 0;
    while n < span {
        match f.read_at(&mut buf[at + n..at + span], start + n as u64) {
            Ok(0) => break,
            Ok(k) => {
                n += k;
                if n % ALIGN != 0 {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let skip = (offset - start) as usize;
    if n < skip + len {
        return Err(short(offset, len, n.saturating_sub(skip)));
    }
    Ok(buf[at + skip..at + skip + len].to_vec())
}

fn read_buffered(f: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let n = read_full(f, &mut buf, offset)?;
    if n < len {
        return Err(short(offset, len, n));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A file of `n` bytes where byte i is (i * 7 + i / 251) mod 256 (no period a misread could hide in).
    fn table(n: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let data: Vec<u8> = (0..n).map(|i| ((i * 7 + i / 251) % 256) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        f.flush().unwrap();
        (f, data)
    }

    #[test]
    fn queued_reads_come_back_exact_and_in_order() {
        let (f, data) = table(3 * 1024 * 1024 + 123);
        let pool = ReadPool::open(f.path(), 4, true).unwrap();
        // Far more reads than workers, unaligned offsets and lengths, some crossing blocks.
        let reads: Vec<(u64, usize)> = (0..500).map(|i| ((i * 6151 % (data.len() - 5000)) as u64, 1 + (i * 37) % 4999)).collect();
        let got = pool.submit(&reads).wait().unwrap();
        for (&(o, l), g) in reads.iter().zip(&got) {
            assert_eq!(&data[o as usize..o as usize + l], &g[..], "read at {o}, {l} bytes");
        }
        assert_eq!(pool.stats().reads.load(Ordering::Relaxed), 500);
        assert_eq!(pool.stats().queued.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_short_last_block_is_read_and_past_the_end_is_an_error() {
        let (f, data) = table(10 * ALIGN + 77);
        let pool = ReadPool::open(f.path(), 2, true).unwrap();
        let n = data.len() as u64;
        let got = pool.submit(&[(n - 100, 100), (n - 77, 77), (0, data.len())]).wait().unwrap();
        assert_eq!(got[0], &data[data.len() - 100..]);
        assert_eq!(got[1], &data[data.len() - 77..]);
        assert_eq!(got[2], data);
        let e = pool.submit(&[(n - 10, 11)]).wait().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        let e = pool.submit(&[(n + ALIGN as u64, 1)]).wait().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        // The pool still serves after errors.
        assert_eq!(pool.submit(&[(5, 3)]).wait().unwrap()[0], &data[5..8]);
    }

    #[test]
    fn idle_workers_wake_for_new_reads() {
        let (f, data) = table(64 * 1024);
        let pool = ReadPool::open(f.path(), 3, true).unwrap();
        for round in 0..20u64 {
            // The workers have gone back to waiting between rounds.
            std::thread::sleep(std::time::Duration::from_millis(2));
            let o = round * 1000;
            let got = pool.submit(&[(o, 500)]).wait().unwrap();
            assert_eq!(got[0], &data[o as usize..o as usize + 500]);
        }
    }

    #[test]
    fn close_drains_the_queue_and_a_reopened_pool_serves() {
        let (f, data) = table(1024 * 1024);
        let pool = ReadPool::open(f.path(), 2, true).unwrap();
        let reads: Vec<(u64, usize)> = (0..200).map(|i| (i * 4000, 3000)).collect();
        let batch = pool.submit(&reads);
        pool.close();
        let got = batch.wait().unwrap();
        assert_eq!(got.len(), 200);
        assert_eq!(got[199], &data[199 * 4000..199 * 4000 + 3000]);
        let pool = ReadPool::open(f.path(), 2, true).unwrap();
        assert_eq!(pool.submit(&[(17, 4096)]).wait().unwrap()[0], &data[17..17 + 4096]);
    }

    #[test]
    fn an_empty_batch_and_a_missing_file() {
        let (f, _) = table(100);
        let pool = ReadPool::open(f.path(), 1, true).unwrap();
        assert!(pool.submit(&[]).wait().unwrap().is_empty());
        assert!(ReadPool::open(Path::new("/nonexistent/strata-ple"), 1, true).is_err());
    }

    #[test]
    fn buffered_reads_serve_the_same_bytes() {
        let (f, data) = table(5 * ALIGN + 9);
        let pool = ReadPool::open(f.path(), 2, false).unwrap();
        assert!(!pool.direct());
        let n = data.len() as u64;
        let got = pool.submit(&[(n - 9, 9), (3, 5000)]).wait().unwrap();
        assert_eq!(got[0], &data[data.len() - 9..]);
        assert_eq!(got[1], &data[3..5003]);
        assert_eq!(pool.submit(&[(n - 1, 2)]).wait().unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
