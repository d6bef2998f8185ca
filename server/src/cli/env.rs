//! Strata's environment variables: one table (name, value, default, what it needs, help) that
//! parses them once at start-up into `Settings`, writes their part of `--help` and docs/flags.md.
//! This module is the only code in the server that reads the process environment.

use std::path::PathBuf;

use strata_ffi::moe::Lab;
use strata_residency::gemm::Device;

/// What a flag or variable does in this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Read by the expert tiers (no effect unless one of their flags makes tiers).
    Experts,
    /// Rewritten onto llama-server flags, or read where its help says.
    Active,
    /// Accepted so that the seed's command lines run; warns that it does nothing yet.
    NotYet,
}

/// The environment as read at start-up, typed.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// STRATA_PREFILL_RING: slots of the prefill ring (None: sized automatically; 0: off).
    pub prefill_ring: Option<usize>,
    pub sampler_argmax: bool,
    pub step_trace: Option<PathBuf>,
    pub op_profile: Option<PathBuf>,
    pub lab: Lab,
    pub memguard_root: PathBuf,
    pub prefill_mmq: bool,
    pub gemm_table: Option<PathBuf>,
    pub gemm_device: Option<Device>,
    pub io_threads: usize,
    /// The table's variables that are set (non-empty), in table order.
    pub set: Vec<&'static str>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            prefill_ring: None,
            sampler_argmax: true,
            step_trace: None,
            op_profile: None,
            lab: Lab::default(),
            memguard_root: PathBuf::from("/"),
            prefill_mmq: false,
            gemm_table: None,
            gemm_device: None,
            io_threads: DEFAULT_IO_THREADS,
            set: Vec::new(),
        }
    }
}

/// STRATA_IO_THREADS's default: enough readers to keep an NVMe queue busy with one batch's rows.
pub const DEFAULT_IO_THREADS: usize = 8;

pub type SetFn = fn(&mut Settings, &str) -> Result<(), String>;

pub struct EnvVar {
    pub name: &'static str,
    /// What the value is, as `--help` shows it.
    pub value: &'static str,
    /// What unset means.
    pub default: &'static str,
    /// The flag (or variable) without which it does nothing; "" when it always acts.
    pub needs: &'static str,
    pub help: &'static str,
    pub effect: Effect,
    pub set: SetFn,
}

/// The flags that turn the expert tiers on, as a row's `needs` and a warning name them.
pub const TIERS_ON: &str = "--mmap-experts, --resident-cpu-experts or --resident-experts (or --expert-cache N)";

pub const ENV_VARS: &[EnvVar] = &[
    EnvVar {
        name: "STRATA_PREFILL_RING",
        value: "N",
        default: "twice the largest cold tier of a layer",
        needs: TIERS_ON,
        help: "GPU slots of the prefill ring that streams cold experts to prompt batches (0: off, the CPU computes them)",
        effect: Effect::Experts,
        set: |s, v| {
            s.prefill_ring = Some(v.parse().map_err(|_| "expected a number of slots (0 turns the ring off)".to_string())?);
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_SAMPLER_ARGMAX",
        value: "BOOL",
        default: "1",
        needs: "",
        help: "1 = where a request's sampling settings make llama.cpp's sampler chain pick the highest logit (top-k 1 or temperature <= 0, with penalties, DRY, XTC, typical-p, top-n-sigma, grammars, the reasoning budget and mirostat off), a scan of the logits picks it, and the chain runs when that token is tied or biased; 0 = every token goes through the chain",
        effect: Effect::Active,
        set: |s, v| {
            s.sampler_argmax = boolean(v)?;
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_STEP_TRACE",
        value: "FILE",
        default: "none",
        needs: "",
        help: "write the host's time around decode steps to FILE: the llama_decode call, the wait for the device, the host's own time between steps with the sampler's and the expert tiers' bookkeeping's shares (diagnostics: one JSON line of medians and means per 256 steps)",
        effect: Effect::Active,
        set: |s, v| {
            s.step_trace = Some(v.into());
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_OP_PROFILE",
        value: "FILE",
        default: "none",
        needs: "",
        help: "write per-op times of each prompt batch to FILE (diagnostics: runs the graph node by node, without kernel fusion)",
        effect: Effect::Active,
        set: |s, v| {
            s.op_profile = Some(v.into());
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_LAB",
        value: "ITEMS",
        default: "none (the product path)",
        needs: TIERS_ON,
        help: "comma-separated settings of the expert tiers for tests and experiments (docs/lab.md): emulate-ring, zero-copy, pageable-copy, flat-ids, ring-trace=FILE, ring-waves=N, ring-pace-kib=N, ring-prefetch-min-p=P, ring-fault=copy:N|die:N|no-thread, qsa-gather=N; an unknown item stops the start",
        effect: Effect::Experts,
        set: |s, v| {
            s.lab = super::lab::parse(v)?;
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_MEMGUARD_ROOT",
        value: "DIR",
        default: "/",
        needs: TIERS_ON,
        help: "root under which the memory guard reads /proc and the cgroup-v2 files",
        effect: Effect::Experts,
        set: |s, v| {
            s.memguard_root = v.into();
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_PREFILL_MMQ",
        value: "BOOL",
        default: "0",
        needs: "a GPU backend",
        help: "1 = quantized prompt matmuls without a tuned row take MMQ kernels",
        effect: Effect::Active,
        set: |s, v| {
            s.prefill_mmq = boolean(v)?;
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_HIPBLASLT_TUNING",
        value: "FILE",
        default: "none",
        needs: "a GPU backend",
        help: "calibrated GEMM table from tools/tune-gemm (cuBLASLt on NVIDIA; refused whole when made for another GPU or library version)",
        effect: Effect::Active,
        set: |s, v| {
            s.gemm_table = Some(v.into());
            Ok(())
        },
    },
    EnvVar {
        name: "STRATA_GEMM_DEVICE",
        value: "\"ARCH RUNTIME BLASLT\"",
        default: "the GPU's own",
        needs: "STRATA_HIPBLASLT_TUNING",
        help: "the device to check the GEMM table against instead of the GPU's own description (tests, diagnostics)",
        effect: Effect::Active,
        set: |s, v| match v.split_whitespace().collect::<Vec<_>>()[..] {
            [arch, runtime, blaslt] => {
                s.gemm_device = Some(Device { arch: arch.into(), runtime: runtime.into(), blaslt: blaslt.into() });
                Ok(())
            }
            _ => Err("expected \"ARCH RUNTIME BLASLT\", e.g. \"sm_90 13000 130100\"".into()),
        },
    },
    EnvVar {
        name: "STRATA_IO_THREADS",
        value: "N",
        default: "8",
        needs: "--ple-mode ssd",
        help: "direct-I/O workers reading PLE rows, 1 to 1024",
        effect: Effect::Active,
        set: |s, v| {
            s.io_threads = v.parse::<usize>().ok().filter(|n| (1..=1024).contains(n)).ok_or("expected 1 to 1024 readers")?;
            Ok(())
        },
    },
];

/// Names the project's tools, tests and build scripts read. The server does not: it leaves them
/// alone when they are set in its environment (the tools start it with their own settings set).
pub const TOOL_VARS: &[&str] = &[
    "STRATA_ACCEPT",
    "STRATA_ADAPT_EVERY",
    "STRATA_ARM_DEPTHS",
    "STRATA_BIN",
    "STRATA_BLESS",
    "STRATA_BUDGET",
    "STRATA_CACHE",
    "STRATA_CGROUP_GIB",
    "STRATA_COMPAT_OUT",
    "STRATA_COMPAT_TIMEOUT",
    "STRATA_CONTROL_ARGS",
    "STRATA_CUDA_ARCHS",
    "STRATA_CUDA_FA",
    "STRATA_CUDA_WHEELS",
    "STRATA_DEADLINE",
    "STRATA_DEPTHS",
    "STRATA_DEPTH_ARMS",
    "STRATA_DEPTH_GIB",
    "STRATA_DIAG_ARMS",
    "STRATA_DIAG_GIB",
    "STRATA_DIAG_SLOTS",
    "STRATA_DIAG_TIMEOUT",
    "STRATA_FUZZ_CASES",
    "STRATA_GEMM_MODELS",
    "STRATA_GIT_COMMIT",
    "STRATA_HIP_ARCH",
    "STRATA_HIP_MIRROR",
    "STRATA_HIP_ROOT",
    "STRATA_HIP_TARGETS",
    "STRATA_KERNELS",
    "STRATA_KPROF_ARMS",
    "STRATA_KPROF_PREDICT",
    "STRATA_KPROF_TIMEOUT",
    "STRATA_LLAMA_LIB_DIR",
    "STRATA_LLAMA_SRC",
    "STRATA_LLAMA_SRC_DIR",
    "STRATA_MIN_P",
    "STRATA_MODELS",
    "STRATA_NKVO_NCMOE",
    "STRATA_NO_UI",
    "STRATA_ONLY_PATCHED",
    "STRATA_OPPROF_CACHE",
    "STRATA_OPPROF_TIMEOUT",
    "STRATA_PACE_KIB",
    "STRATA_PARITY_EXTRA",
    "STRATA_PARITY_TIMEOUT",
    "STRATA_PARITY_TOKENS",
    "STRATA_PATCHES",
    "STRATA_PATCH_WORK",
    "STRATA_PLE_REPEAT",
    "STRATA_PLE_TIMEOUT",
    "STRATA_PLE_TOKENS",
    "STRATA_PYTHON",
    "STRATA_RETUNE",
    "STRATA_RETURN_CUDA",
    "STRATA_ROWS",
    "STRATA_ROW_TIMEOUT",
    "STRATA_RPC_SERVER",
    "STRATA_SERVER",
    "STRATA_SKEW",
    "STRATA_SKIP_M07",
    "STRATA_STEPS",
    "STRATA_TINY",
    "STRATA_TRACE_GIB",
    "STRATA_TRACE_TIMEOUT",
    "STRATA_TRACE_WINDOWS",
    "STRATA_TUNE_BATCHES",
    "STRATA_TUNE_TIMEOUT",
    "STRATA_UPSTREAM_BUILD",
    "STRATA_UPSTREAM_SERVER",
    "STRATA_UPSTREAM_SRC",
    "STRATA_VENDOR_CACHE",
    "STRATA_VENDOR_OUT",
    "STRATA_VERSION",
    "STRATA_WAVES",
    "STRATA_WAVES_RING",
];

/// Variables earlier builds read, and what a user setting one now should do instead.
const RETIRED: &[(&str, &str)] = &[
    ("STRATA_COLD_DECODE", "decode reads cold experts over the bus with --resident-experts on a GPU, else the CPU computes them"),
    ("STRATA_WORKERS_MIN_COLD", "decode reads cold experts over the bus with --resident-experts on a GPU, else the CPU computes them"),
    ("STRATA_DECODE_STAGE", "decode reads cold experts over the bus with --resident-experts on a GPU, else the CPU computes them"),
    ("STRATA_MOE_HOST_OP", "decode reads cold experts over the bus with --resident-experts on a GPU, else the CPU computes them"),
    ("STRATA_DECODE_TABLE", "zero-copy decode always reads through tables"),
    ("STRATA_RING_LEND", "the prefill ring no longer lends its slots to decode"),
    ("STRATA_RING_EMULATE", "use STRATA_LAB=emulate-ring"),
    ("STRATA_MOE_FLAT_IDS", "use STRATA_LAB=flat-ids"),
    ("STRATA_RING_TRACE", "use STRATA_LAB=ring-trace=FILE"),
    ("STRATA_RING_WAVES", "use STRATA_LAB=ring-waves=N"),
    ("STRATA_RING_COPY_PACE_KIB", "use STRATA_LAB=ring-pace-kib=N"),
    ("STRATA_RING_PREFETCH_MIN_P", "use STRATA_LAB=ring-prefetch-min-p=P"),
];

/// llama.cpp's boolean values, as its own variables take them.
pub fn boolean(v: &str) -> Result<bool, String> {
    match v {
        "1" | "true" | "on" | "enabled" => Ok(true),
        "0" | "false" | "off" | "disabled" => Ok(false),
        _ => Err("expected 1, true, on or enabled, or 0, false, off or disabled".into()),
    }
}

/// Reads the process environment.
pub fn read() -> Result<Settings, String> {
    parse(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned()))))
}

/// Parses `vars` (the environment's pairs): every `STRATA_*` name must be one of the table's, a
/// tool's, or a retired one (an error that says what replaced it); an empty value is unset.
pub fn parse(vars: impl IntoIterator<Item = (String, String)>) -> Result<Settings, String> {
    let mut values: Vec<(String, String)> = vars.into_iter().filter(|(k, _)| k.starts_with("STRATA_")).collect();
    values.sort();
    let mut s = Settings::default();
    for (name, _) in &values {
        if let Some(&(_, instead)) = RETIRED.iter().find(|(n, _)| n == name) {
            return Err(format!("{name} is no longer read: {instead} (docs/lab.md)"));
        }
        if TOOL_VARS.contains(&name.as_str()) || ENV_VARS.iter().any(|e| e.name == name) {
            continue;
        }
        let hint = closest(name).map_or(String::new(), |n| format!(" (did you mean {n}?)"));
        return Err(format!("{name} is not a variable strata-server reads{hint}; its variables are listed at the end of --help"));
    }
    for e in ENV_VARS {
        let Some((_, raw)) = values.iter().find(|(n, _)| n == e.name) else { continue };
        let v = raw.trim();
        if v.is_empty() {
            continue;
        }
        (e.set)(&mut s, v).map_err(|why| format!("{}: invalid value '{v}': {why}", e.name))?;
        s.set.push(e.name);
    }
    Ok(s)
}

/// The table's name nearest `name`, when a typo or two away.
fn closest(name: &str) -> Option<&'static str> {
    ENV_VARS.iter().map(|e| (distance(name, e.name), e.name)).filter(|&(d, _)| d <= 3).min().map(|(_, n)| n)
}

fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let here = (prev + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = here;
        }
    }
    row[b.len()]
}

/// Variables of llama-server (not Strata's) that the server reads where its API needs them.
pub fn upstream(name: Upstream) -> Option<String> {
    std::env::var(name.as_str()).ok()
}

/// Whether an upstream variable is set to anything non-empty.
pub fn upstream_set(name: Upstream) -> bool {
    upstream(name).is_some_and(|v| !v.is_empty())
}

/// What a router sets for each child it starts: the router's port, and the child's mode.
pub const ROUTER_PORT: &str = "LLAMA_SERVER_ROUTER_PORT";
pub const CHILD_MODE: &str = "LLAMA_SERVER_CHILD_MODE";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// Where `~` of an agent tool's path points.
    Home,
    /// Google Vertex AI's prediction container contract.
    AipMode,
    AipHealthRoute,
    AipPredictRoute,
    AipHttpPort,
    /// Pins the media marker of multimodal prompts (llama-server's get_media_marker).
    MediaMarker,
    /// The router's fake timings (llama-server's tests).
    FakeTiming,
    /// Set by a router for the children it starts.
    RouterPort,
    ChildMode,
}

impl Upstream {
    pub fn as_str(self) -> &'static str {
        match self {
            Upstream::Home => "HOME",
            Upstream::AipMode => "AIP_MODE",
            Upstream::AipHealthRoute => "AIP_HEALTH_ROUTE",
            Upstream::AipPredictRoute => "AIP_PREDICT_ROUTE",
            Upstream::AipHttpPort => "AIP_HTTP_PORT",
            Upstream::MediaMarker => "LLAMA_MEDIA_MARKER",
            Upstream::FakeTiming => "LLAMA_SERVER_DEBUG_FAKE_TIMING",
            Upstream::RouterPort => ROUTER_PORT,
            Upstream::ChildMode => CHILD_MODE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<Settings, String> {
        parse(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())))
    }

    #[test]
    fn unset_gives_the_defaults() {
        let s = env(&[("PATH", "/bin"), ("STRATA_MODELS", "/m"), ("STRATA_IO_THREADS", " ")]).unwrap();
        assert_eq!(s, Settings::default());
        assert!(s.sampler_argmax && s.io_threads == DEFAULT_IO_THREADS && s.memguard_root == std::path::Path::new("/"));
    }

    #[test]
    fn each_kind_parses_once() {
        let s = env(&[
            ("STRATA_PREFILL_RING", "0"),
            ("STRATA_SAMPLER_ARGMAX", "off"),
            ("STRATA_PREFILL_MMQ", "true"),
            ("STRATA_IO_THREADS", "3"),
            ("STRATA_GEMM_DEVICE", "sm_90 13000 130100"),
            ("STRATA_LAB", "emulate-ring"),
        ])
        .unwrap();
        assert_eq!((s.prefill_ring, s.sampler_argmax, s.prefill_mmq, s.io_threads), (Some(0), false, true, 3));
        assert_eq!(s.gemm_device.map(|d| d.arch), Some("sm_90".into()));
        assert!(s.lab.emulate_ring);
        assert_eq!(s.set, ["STRATA_PREFILL_RING", "STRATA_SAMPLER_ARGMAX", "STRATA_LAB", "STRATA_PREFILL_MMQ", "STRATA_GEMM_DEVICE", "STRATA_IO_THREADS"]);
    }

    #[test]
    fn bad_values_and_names_are_errors_that_say_what() {
        for (pair, says) in [
            (("STRATA_PREFILL_MMQ", "yes"), "STRATA_PREFILL_MMQ: invalid value 'yes': expected 1, true"),
            (("STRATA_SAMPLER_ARGMAX", "2"), "STRATA_SAMPLER_ARGMAX: invalid value '2'"),
            (("STRATA_IO_THREADS", "0"), "expected 1 to 1024"),
            (("STRATA_PREFILL_RING", "-1"), "expected a number of slots"),
            (("STRATA_GEMM_DEVICE", "sm_90"), "ARCH RUNTIME BLASLT"),
            (("STRATA_LAB", "nope"), "unknown item 'nope'"),
            (("STRATA_PREFIL_RING", "0"), "STRATA_PREFIL_RING is not a variable strata-server reads (did you mean STRATA_PREFILL_RING?)"),
            (("STRATA_WHATEVER", "1"), "STRATA_WHATEVER is not a variable strata-server reads; its variables"),
            (("STRATA_RING_EMULATE", "1"), "STRATA_RING_EMULATE is no longer read: use STRATA_LAB=emulate-ring"),
        ] {
            let e = env(&[pair]).unwrap_err();
            assert!(e.contains(says), "{pair:?}: {e}");
        }
    }

    #[test]
    fn booleans_are_llama_cpps() {
        for t in ["1", "true", "on", "enabled"] {
            assert_eq!(boolean(t), Ok(true));
        }
        for f in ["0", "false", "off", "disabled"] {
            assert_eq!(boolean(f), Ok(false));
        }
        assert!(boolean("yes").is_err() && boolean("").is_err());
    }

    /// The source tree's own reads of the environment: only this file calls std::env::var*, and
    /// every STRATA_ name the project's tools, tests and build scripts use is in a table here.
    #[test]
    fn only_this_module_reads_the_environment() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut readers = Vec::new();
        for f in files(&root, &["server/src", "ffi/src", "residency/src"]).into_iter().filter(|f| f.extension().is_some_and(|e| e == "rs")) {
            let text = std::fs::read_to_string(&f).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or("");
            // test modules (a tests.rs, or the part after #[cfg(test)]) may set up their own
            if f.ends_with("cli/env.rs") || f.ends_with("tests.rs") {
                continue;
            }
            if ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("].iter().any(|p| code.contains(p)) {
                readers.push(f.strip_prefix(&root).unwrap().display().to_string());
            }
        }
        assert!(readers.is_empty(), "read the environment outside server/src/cli/env.rs: {readers:?}");

        let mut used = std::collections::BTreeSet::new();
        for f in files(&root, &["tools", "tests", ".ci", "ffi/build.rs", "server/build.rs", "server/src"]) {
            if f.ends_with("cli/env.rs") || f.extension().is_some_and(|e| ["cpp", "cuh", "h", "md", "pyc"].iter().any(|x| e == *x)) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&f) else { continue };
            for (i, _) in text.match_indices("STRATA_") {
                let name: String = text[i..].chars().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_').collect();
                if name.len() > "STRATA_".len() {
                    used.insert(name);
                }
            }
        }
        let known: std::collections::BTreeSet<String> =
            ENV_VARS.iter().map(|e| e.name).chain(TOOL_VARS.iter().copied()).chain(RETIRED.iter().map(|r| r.0)).map(String::from).collect();
        // the misspelling tests/integration/cli.rs sets to see the start refused
        used.remove("STRATA_PREFIL_RING");
        let unlisted: Vec<&String> = used.difference(&known).collect();
        assert!(unlisted.is_empty(), "STRATA_ names the tools read that the server would refuse: add them to TOOL_VARS: {unlisted:?}");
        let stale: Vec<&&str> = TOOL_VARS.iter().filter(|n| !used.contains(**n)).collect();
        assert!(stale.is_empty(), "TOOL_VARS names no tool reads: {stale:?}");
    }

    fn files(root: &std::path::Path, dirs: &[&str]) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack: Vec<PathBuf> = dirs.iter().map(|d| root.join(d)).collect();
        while let Some(p) = stack.pop() {
            if p.is_dir() {
                if !p.ends_with("__pycache__") {
                    stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
                }
            } else {
                out.push(p);
            }
        }
        out
    }
}
