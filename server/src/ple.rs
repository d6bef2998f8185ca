//! PLE tables kept in the model file (`--ple-mode ssd`): the settings the engine hands the
//! mechanism (strata_ffi::ple) and the `strata:ple_*` lines of /metrics.

use strata_ffi::ple::{PleConfig, PleStats};

use crate::cli::env::Settings;
use crate::cli::flags::{PleMode, StrataArgs};
use crate::engine::metrics::strata_lines;

/// The reader settings for `--ple-mode ssd`, None for the other modes.
pub fn config(a: &StrataArgs, env: &Settings) -> Option<PleConfig> {
    (a.ple_mode == Some(PleMode::Ssd)).then_some(PleConfig { threads: env.io_threads, cache_bytes: a.ple_cache_mib << 20 })
}

/// The `strata:ple_*` lines for /metrics; empty when no table is served from the file.
pub fn metrics_text(s: Option<PleStats>) -> String {
    let Some(s) = s else { return String::new() };
    let mut out = String::new();
    let read_bytes_help = "Bytes of PLE rows read from the model file (the ranges asked; direct reads widen each to 4 KiB blocks)";
    strata_lines(
        &mut out,
        &[
            ("ple_rows_total", "counter", "PLE rows supplied to prompt and decode batches", s.rows),
            ("ple_rows_cached_total", "counter", "Distinct PLE rows of a batch found in the RAM row cache", s.cache_hits),
            ("ple_rows_prefetched_total", "counter", "PLE rows of a prompt read ahead of its batches", s.prefetched),
            ("ple_rows_prefetch_used_total", "counter", "Prefetched PLE rows that a batch then used", s.prefetch_used),
            ("ple_rows_successor_prefetched_total", "counter", "PLE rows of likely next tokens read ahead in decode", s.successor_prefetched),
            ("ple_rows_successor_used_total", "counter", "Successor rows read ahead that a batch then used", s.successor_used),
            ("ple_cache_bytes", "gauge", "Bytes of PLE rows held in the RAM row cache", s.cache_bytes),
            ("ple_reads_total", "counter", "PLE row reads from the model file", s.reads),
            ("ple_read_bytes_total", "counter", read_bytes_help, s.bytes_read),
            ("ple_read_queue", "gauge", "PLE row reads queued or in flight", s.queued),
            ("ple_fallbacks_total", "counter", "Batches whose PLE rows were read again with buffered reads after a failed direct read", s.fallbacks),
            ("ple_read_failures_total", "counter", "Batches that failed because their PLE rows could not be read", s.failures),
        ],
    );
    let supply_help = "Time prompt and decode batches spent getting their PLE rows (cache lookups, waits and reads on the batch's path)";
    out += &format!(
        "# HELP strata:ple_supply_seconds_total {supply_help}\n# TYPE strata:ple_supply_seconds_total counter\nstrata:ple_supply_seconds_total {}\n",
        s.supply_us as f64 / 1e6
    );
    out += "# HELP strata:ple_read_seconds PLE row read latency\n# TYPE strata:ple_read_seconds histogram\n";
    let mut cumulative = 0;
    for (i, n) in s.latency.iter().enumerate() {
        cumulative += n;
        let le = s.latency_bounds_us.get(i).map_or("+Inf".to_string(), |us| format!("{}", *us as f64 / 1e6));
        out += &format!("strata:ple_read_seconds_bucket{{le=\"{le}\"}} {cumulative}\n");
    }
    out += &format!("strata:ple_read_seconds_count {cumulative}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &str) -> StrataArgs {
        let argv: Vec<String> = std::iter::once("strata-server").chain(v.split_whitespace()).map(String::from).collect();
        crate::cli::flags::split(&argv).unwrap().0
    }

    #[test]
    fn only_ssd_mode_starts_readers_and_bad_thread_counts_are_refused() {
        let threads = |v: &str| crate::cli::env::parse([("STRATA_IO_THREADS".to_string(), v.to_string())]);
        assert_eq!(config(&args("--ple-mode mmap"), &threads("4").unwrap()), None);
        assert_eq!(config(&args(""), &Settings::default()), None);
        assert_eq!(
            config(&args("--ple-mode ssd"), &Settings::default()),
            Some(PleConfig { threads: crate::cli::env::DEFAULT_IO_THREADS, cache_bytes: 256 << 20 })
        );
        assert_eq!(config(&args("--ple-mode ssd --ple-cache-mib 0"), &threads("32").unwrap()), Some(PleConfig { threads: 32, cache_bytes: 0 }));
        for bad in ["0", "x", "-2", "5000"] {
            let e = threads(bad).unwrap_err();
            assert!(e.contains("STRATA_IO_THREADS") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn metrics_have_a_cumulative_latency_histogram() {
        assert_eq!(metrics_text(None), "");
        let s = PleStats { rows: 10, reads: 4, latency: [1, 2, 0, 1], latency_bounds_us: [100, 1000, 10000], ..PleStats::default() };
        let t = metrics_text(Some(s));
        assert!(t.contains("strata:ple_rows_total 10\n"), "{t}");
        assert!(t.contains("strata:ple_read_seconds_bucket{le=\"0.001\"} 3\n"), "{t}");
        assert!(t.contains("strata:ple_read_seconds_bucket{le=\"+Inf\"} 4\n"), "{t}");
    }
}
