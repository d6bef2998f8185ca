//! The host's side of decode steps (STRATA_STEP_TRACE=FILE), for telling a step's device time
//! from the time the device idles where no timeline profiler runs. For each batch of at most
//! [`MAX_TOKENS`] tokens: the llama_decode call (the graph's build or reuse, then its launch), the
//! wait for the device (inside the call for a model with expert tiers, whose decodes end
//! synchronised), the host's time from the end of the previous step's wait to this call
//! (sampling, the server's own work) with the sampler's share, and the expert tiers' bookkeeping
//! inside the call (counting the routing log, adaptation's swaps). Every [`STEPS_PER_LINE`] steps
//! one JSON line of medians and means, in microseconds.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Batches of more tokens are prompt batches: not traced.
pub const MAX_TOKENS: i32 = 5;
pub const STEPS_PER_LINE: usize = 256;

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Step {
    pub launch_us: f64,
    pub wait_us: f64,
    /// From the end of the previous traced step's wait to this step's call (None for the first
    /// step, or after a batch that was not traced).
    pub host_us: Option<f64>,
    pub sample_us: f64,
    pub tiers_us: f64,
}

struct Trace {
    file: std::fs::File,
    steps: Vec<Step>,
    last_end: Option<Instant>,
    sample: Duration,
    tiers: Duration,
    /// Waits for the device inside the llama_decode call (decode_scope synchronises a tiered
    /// model's context before it returns): wait, not launch.
    inner_wait: Duration,
}

static ON: AtomicBool = AtomicBool::new(false);
static TRACE: Mutex<Option<Trace>> = Mutex::new(None);

/// Starts tracing into FILE (created or truncated).
pub fn open(path: &std::path::Path) -> std::io::Result<()> {
    let file = std::fs::File::create(path)?;
    *TRACE.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(Trace { file, steps: Vec::new(), last_end: None, sample: Duration::ZERO, tiers: Duration::ZERO, inner_wait: Duration::ZERO });
    ON.store(true, Ordering::Release);
    Ok(())
}

pub(crate) fn active() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Runs a wait for the device inside a llama_decode call, counted as the step's wait.
pub(crate) fn device_wait<R>(f: impl FnOnce() -> R) -> R {
    timed(f, |t| &mut t.inner_wait)
}

/// Runs a sampler call, its time counted into the next traced step's host time when tracing.
pub(crate) fn sampling<R>(f: impl FnOnce() -> R) -> R {
    timed(f, |t| &mut t.sample)
}

/// Runs the expert tiers' work around a llama_decode call, counted like the sampler's.
pub(crate) fn tiers<R>(f: impl FnOnce() -> R) -> R {
    timed(f, |t| &mut t.tiers)
}

fn timed<R>(f: impl FnOnce() -> R, part: fn(&mut Trace) -> &mut Duration) -> R {
    if !active() {
        return f();
    }
    let t0 = Instant::now();
    let out = f();
    if let Some(t) = TRACE.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        *part(t) += t0.elapsed();
    }
    out
}

/// A batch of `n_tokens` whose llama_decode call began at `begin` and returned at `launched`,
/// after which the host waited for the device until `end`.
pub(crate) fn step(n_tokens: i32, begin: Instant, launched: Instant, end: Instant) {
    let mut guard = TRACE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(t) = guard.as_mut() else { return };
    let inner = std::mem::take(&mut t.inner_wait);
    if n_tokens > MAX_TOKENS {
        t.last_end = None;
        t.sample = Duration::ZERO;
        t.tiers = Duration::ZERO;
        return;
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let host_us = t.last_end.map(|e| us(begin.saturating_duration_since(e)));
    t.steps.push(Step {
        launch_us: us((launched - begin).saturating_sub(inner)),
        wait_us: us(end - launched + inner),
        host_us,
        sample_us: us(std::mem::take(&mut t.sample)),
        tiers_us: us(std::mem::take(&mut t.tiers)),
    });
    t.last_end = Some(end);
    if t.steps.len() >= STEPS_PER_LINE {
        let line = summary(&std::mem::take(&mut t.steps));
        let _ = writeln!(t.file, "{line}");
    }
}

/// Medians and means of each part over `steps`.
pub(crate) fn summary(steps: &[Step]) -> serde_json::Value {
    let stats = |mut v: Vec<f64>| {
        if v.is_empty() {
            return serde_json::Value::Null;
        }
        v.sort_by(f64::total_cmp);
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let round = |x: f64| (x * 10.0).round() / 10.0;
        serde_json::json!({"median": round(v[v.len() / 2]), "mean": round(mean)})
    };
    serde_json::json!({
        "steps": steps.len(),
        "launch_us": stats(steps.iter().map(|s| s.launch_us).collect()),
        "wait_us": stats(steps.iter().map(|s| s.wait_us).collect()),
        "host_us": stats(steps.iter().filter_map(|s| s.host_us).collect()),
        "sample_us": stats(steps.iter().map(|s| s.sample_us).collect()),
        "tiers_us": stats(steps.iter().map(|s| s.tiers_us).collect()),
    })
}

#[cfg(test)]
mod tests {
    use super::{summary, Step};

    #[test]
    fn the_summary_gives_each_part_its_median_and_mean() {
        let s = |launch_us, wait_us, host_us, sample_us| Step { launch_us, wait_us, host_us, sample_us, tiers_us: sample_us / 2.0 };
        let steps = [s(10.0, 100.0, None, 5.0), s(20.0, 300.0, Some(40.0), 7.0), s(30.0, 200.0, Some(60.0), 9.0)];
        let v = summary(&steps);
        assert_eq!(v["steps"], 3);
        assert_eq!(v["launch_us"]["median"], 20.0);
        assert_eq!(v["wait_us"]["median"], 200.0);
        assert_eq!(v["wait_us"]["mean"], 200.0);
        // the first step has no host time before it
        assert_eq!(v["host_us"]["median"], 60.0);
        assert_eq!(v["host_us"]["mean"], 50.0);
        assert_eq!(v["sample_us"]["mean"], 7.0);
        assert_eq!(v["tiers_us"]["median"], 3.5);
        assert!(summary(&[])["launch_us"].is_null());
    }
}
