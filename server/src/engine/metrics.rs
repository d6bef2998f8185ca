//! llama-server's `/metrics`: the same `llamacpp:*` counters and gauges, in Prometheus text.
//! The engine updates them; a scrape reads them and resets the throughput buckets.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// Tokens, decode steps and time; the rate uses steps so that free tokens do not inflate it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Bucket {
    pub count: u64,
    pub steps: u64,
    pub time_us: u64,
}

impl Bucket {
    fn add(&mut self, n: u64, steps: u64, t_us: u64) {
        self.count += n;
        self.steps += steps;
        self.time_us += t_us;
    }

    fn per_second(&self) -> f64 {
        if self.time_us > 0 {
            self.steps as f64 / self.time_us as f64 * 1e6
        } else {
            0.0
        }
    }
}

#[derive(Debug, Clone)]
pub struct Metrics {
    pub t_start: u64,
    prompt: Bucket,
    predict: Bucket,
    prompt_bucket: Bucket,
    predict_bucket: Bucket,
    n_prompt_cached: u64,
    n_tokens_max: u64,
    n_decode: u64,
    n_busy_slots: u64,
    n_draft_tokens: u64,
    n_draft_accepted: u64,
    n_draft_verif_steps: u64,
    pub n_processing: usize,
    pub n_deferred: usize,
}

impl Default for Metrics {
    fn default() -> Self {
        let t_start = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Self {
            t_start,
            prompt: Bucket::default(),
            predict: Bucket::default(),
            prompt_bucket: Bucket::default(),
            predict_bucket: Bucket::default(),
            n_prompt_cached: 0,
            n_tokens_max: 0,
            n_decode: 0,
            n_busy_slots: 0,
            n_draft_tokens: 0,
            n_draft_accepted: 0,
            n_draft_verif_steps: 0,
            n_processing: 0,
            n_deferred: 0,
        }
    }
}

/// C++ iostream's default rendering of a double (6 significant digits, like %g).
/// One `strata:<name>` sample with its HELP and TYPE lines, for Strata's own families.
pub fn strata_line(out: &mut String, name: &str, kind: &str, help: &str, v: u64) {
    let _ = write!(out, "# HELP strata:{name} {help}\n# TYPE strata:{name} {kind}\nstrata:{name} {v}\n");
}

/// A `strata:<name>` family with one sample per `label` value: (value of the label, sample).
pub fn strata_family<'a>(out: &mut String, name: &str, kind: &str, help: &str, label: &str, samples: impl IntoIterator<Item = (&'a str, u64)>) {
    let _ = write!(out, "# HELP strata:{name} {help}\n# TYPE strata:{name} {kind}\n");
    for (l, v) in samples {
        let _ = writeln!(out, "strata:{name}{{{label}=\"{l}\"}} {v}");
    }
}

/// Several `strata:*` lines: (name, kind, help, value) each.
pub fn strata_lines(out: &mut String, lines: &[(&str, &str, &str, u64)]) {
    for &(name, kind, help, v) in lines {
        strata_line(out, name, kind, help, v);
    }
}

fn g(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return if v.is_finite() { "0".into() } else { v.to_string() };
    }
    let exp = v.abs().log10().floor() as i32;
    if (-4..6).contains(&exp) {
        let decimals = (5 - exp).max(0) as usize;
        let s = format!("{v:.decimals$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    } else {
        let s = format!("{v:.5e}");
        let (m, e) = s.split_once('e').unwrap();
        let m = if m.contains('.') { m.trim_end_matches('0').trim_end_matches('.') } else { m };
        let e: i32 = e.parse().unwrap();
        format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs())
    }
}

impl Metrics {
    pub fn on_prompt(&mut self, n: u64, t_us: u64) {
        self.prompt.add(n, n, t_us);
        self.prompt_bucket.add(n, n, t_us);
    }

    pub fn on_prompt_cached(&mut self, n: u64) {
        self.n_prompt_cached += n;
    }

    /// A finished generation of n tokens over `steps` decodes.
    pub fn on_prediction(&mut self, n: u64, steps: u64, t_us: u64) {
        self.predict.add(n, steps, t_us);
        self.predict_bucket.add(n, steps, t_us);
    }

    pub fn on_decode(&mut self, n_busy: u64, max_tokens: u64) {
        self.n_decode += 1;
        self.n_busy_slots += n_busy;
        self.n_tokens_max = self.n_tokens_max.max(max_tokens);
    }

    /// A finished task's speculative decoding: tokens drafted, accepted, verification steps.
    pub fn on_drafts(&mut self, drafted: u64, accepted: u64, steps: u64) {
        self.n_draft_tokens += drafted;
        self.n_draft_accepted += accepted;
        self.n_draft_verif_steps += steps;
    }

    /// The Prometheus text of a scrape; the throughput buckets start over afterwards.
    pub fn scrape(&mut self) -> String {
        let counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.count as f64),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.n_prompt_cached as f64),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.time_us as f64 / 1e6),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predict.count as f64),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict.time_us as f64 / 1e6),
            ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding", self.n_decode as f64),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max as f64),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self.n_draft_tokens as f64),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", self.n_draft_accepted as f64),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", self.n_draft_verif_steps as f64),
        ];
        let gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_bucket.per_second()),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", self.predict_bucket.per_second()),
            ("requests_processing", "Number of requests processing", self.n_processing as f64),
            ("requests_deferred", "Number of requests deferred", self.n_deferred as f64),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call", self.n_busy_slots as f64 / (self.n_decode as f64).max(1.0)),
        ];
        let mut out = String::new();
        for (kind, items) in [("counter", &counters[..]), ("gauge", &gauges[..])] {
            for (name, help, value) in items {
                let _ = write!(out, "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {}\n", g(*value));
            }
        }
        self.prompt_bucket = Bucket::default();
        self.predict_bucket = Bucket::default();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labelled_family_has_one_help_and_type_then_a_sample_per_label() {
        let mut out = String::new();
        strata_family(&mut out, "gemm_matmuls_total", "counter", "Dense matmuls by path", "path", [("default", 7), ("mmq", 0)]);
        assert_eq!(
            out,
            "# HELP strata:gemm_matmuls_total Dense matmuls by path\n# TYPE strata:gemm_matmuls_total counter\n\
             strata:gemm_matmuls_total{path=\"default\"} 7\nstrata:gemm_matmuls_total{path=\"mmq\"} 0\n"
        );
    }

    #[test]
    fn numbers_print_like_iostream() {
        assert_eq!(g(0.0), "0");
        assert_eq!(g(5.0), "5");
        assert_eq!(g(0.123456789), "0.123457");
        assert_eq!(g(1234567.0), "1.23457e+06");
        assert_eq!(g(123456.0), "123456");
        assert_eq!(g(0.00001234), "1.234e-05");
        assert_eq!(g(42.5), "42.5");
    }

    #[test]
    fn scrape_names_and_resets_buckets() {
        let mut m = Metrics::default();
        m.on_prompt(10, 2_000_000);
        m.on_prediction(5, 4, 1_000_000);
        m.on_decode(2, 15);
        let text = m.scrape();
        assert!(text.contains("# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"));
        assert!(text.contains("llamacpp:prompt_tokens_seconds 5\n"));
        assert!(text.contains("llamacpp:predicted_tokens_seconds 4\n"));
        assert!(text.contains("llamacpp:n_busy_slots_per_decode 2\n"));
        assert!(m.scrape().contains("llamacpp:prompt_tokens_seconds 0\n"));
    }
}
