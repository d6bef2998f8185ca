//! Strata's own flags: one table drives parsing, `--help` and the docs. Everything else on the
//! command line goes to llama.cpp's parser untouched. Flags that overlap a llama-server flag
//! are rewritten onto it, so llama.cpp sees (and validates) a single setting.

use std::fmt::Write as _;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Switch,
    Value(&'static str),
}

/// Rewrites an alias flag's value into llama-server arguments.
pub type MapFn = fn(&str) -> Result<Vec<String>, String>;

pub struct Flag {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// The llama-server arguments this flag stands for, if it is an alias.
    pub maps_to: Option<MapFn>,
}

pub struct EnvVar {
    pub name: &'static str,
    pub help: &'static str,
}

fn onto(flags: &[&str], value: &str) -> Vec<String> {
    flags.iter().flat_map(|f| [f.to_string(), value.to_string()]).collect()
}

fn map_prefill(v: &str) -> Result<Vec<String>, String> {
    Ok(onto(&["--batch-size", "--ubatch-size"], v))
}

fn map_spec(v: &str) -> Result<Vec<String>, String> {
    Ok(onto(&["--spec-draft-n-max"], v))
}

fn map_spec_min_p(v: &str) -> Result<Vec<String>, String> {
    Ok(onto(&["--spec-draft-p-min"], v))
}

fn map_max_context(v: &str) -> Result<Vec<String>, String> {
    Ok(onto(&["--ctx-size"], v))
}

fn map_kv(v: &str) -> Result<Vec<String>, String> {
    let ty = match v {
        "int8" => "q8_0",
        "f16" => "f16",
        other => return Err(format!("invalid value '{other}': expected int8 or f16")),
    };
    Ok(onto(&["--cache-type-k", "--cache-type-v"], ty))
}

pub const FLAGS: &[Flag] = &[
    Flag { name: "--mmap-experts", kind: Kind::Switch, help: "serve cold experts from the memory-mapped model file (the SSD fallback tier)", maps_to: None },
    Flag { name: "--resident-cpu-experts", kind: Kind::Switch, help: "copy the experts outside the static GPU cache into ordinary RAM (needs mmap and --expert-profile)", maps_to: None },
    Flag { name: "--resident-experts", kind: Kind::Switch, help: "page-lock the RAM expert copy (CUDA; keeps 4 GiB of headroom)", maps_to: None },
    Flag { name: "--expert-profile", kind: Kind::Value("FILE"), help: "fixed, ranked expert profile written by tools/expert-profile", maps_to: None },
    Flag { name: "--expert-profile-out", kind: Kind::Value("FILE"), help: "count expert selections and write them as a ranked profile to FILE after every request (tools/expert-profile uses it)", maps_to: None },
    Flag { name: "--expert-cache", kind: Kind::Value("auto|N"), help: "experts kept in VRAM: auto fills what --vram-reserve-mib leaves after weights, KV and compute buffers", maps_to: None },
    Flag { name: "--prefill", kind: Kind::Value("N"), help: "prompt tokens per step; same as -b N -ub N", maps_to: Some(map_prefill) },
    Flag { name: "--spec", kind: Kind::Value("N"), help: "tokens to draft per step; same as --spec-draft-n-max N", maps_to: Some(map_spec) },
    Flag { name: "--spec-min-p", kind: Kind::Value("P"), help: "minimum draft probability; same as --spec-draft-p-min P", maps_to: Some(map_spec_min_p) },
    Flag { name: "--max-context", kind: Kind::Value("N"), help: "context size; same as -c N", maps_to: Some(map_max_context) },
    Flag { name: "--kv", kind: Kind::Value("int8|f16"), help: "KV cache type; int8 is -ctk q8_0 -ctv q8_0, f16 is -ctk f16 -ctv f16", maps_to: Some(map_kv) },
    Flag { name: "--kv-resident", kind: Kind::Value("N"), help: "tokens of KV kept resident in VRAM", maps_to: None },
    Flag { name: "--pool-workers", kind: Kind::Value("N"), help: "CPU workers computing cold experts during decode", maps_to: None },
    Flag { name: "--adapt-every", kind: Kind::Value("N"), help: "re-rank the VRAM expert cache every N steps (0 = fixed profile)", maps_to: None },
    Flag { name: "--pcie-frac", kind: Kind::Value("F"), help: "share of decode misses uploaded over PCIe instead of computed on the CPU (0 = none)", maps_to: None },
    Flag { name: "--vram-reserve-mib", kind: Kind::Value("N"), help: "VRAM left free for other processes, in MiB", maps_to: None },
];

pub const ENV_VARS: &[EnvVar] = &[
    EnvVar { name: "STRATA_PREFILL_MMQ", help: "1 = use MMQ kernels for prompt processing on HIP" },
    EnvVar { name: "STRATA_HIPBLASLT_TUNING", help: "calibrated hipBLASLt/cuBLASLt GEMM table (guarded by arch and library version)" },
    EnvVar { name: "STRATA_PREFILL_RING", help: "GPU slots of the prefill ring that streams cold experts to prompt batches (unset: sized to the largest cold tier of a layer, twice; 0: off)" },
    EnvVar { name: "STRATA_RING_TRACE", help: "write the prefill ring's per-layer timeline to FILE (one JSON line per layer and prompt batch)" },
    EnvVar { name: "STRATA_IO_THREADS", help: "direct-I/O workers reading PLE rows from SSD" },
];

/// Strata flag values, by flag name; switches hold "".
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StrataArgs {
    pub values: Vec<(&'static str, String)>,
}

impl StrataArgs {
    /// Flags taken that are not aliases of a llama-server flag.
    pub fn own_flags(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.values
            .iter()
            .filter(|(n, _)| FLAGS.iter().any(|f| f.name == *n && f.maps_to.is_none()))
            .map(|(n, _)| *n)
    }

    #[cfg(test)]
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.iter().rev().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[cfg(test)]
    pub fn is_set(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

/// Splits argv into Strata's flags and the arguments for llama.cpp's parser (argv[0] kept),
/// with alias flags rewritten. Errors use llama.cpp's wording so scripts see one style.
pub fn split(args: &[String]) -> Result<(StrataArgs, Vec<String>), String> {
    let mut strata = StrataArgs::default();
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.iter();
    if let Some(argv0) = it.next() {
        rest.push(argv0.clone());
    }
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let Some(flag) = FLAGS.iter().find(|f| f.name == name) else {
            rest.push(arg.clone());
            continue;
        };
        let value = match flag.kind {
            Kind::Switch => String::new(),
            Kind::Value(_) => match inline.or_else(|| it.next().cloned()) {
                Some(v) => v,
                None => return Err(format!("error while handling argument \"{name}\": expected value for argument")),
            },
        };
        if let Some(map) = flag.maps_to {
            let mapped = map(&value).map_err(|e| format!("error while handling argument \"{name}\": {e}"))?;
            rest.extend(mapped);
        }
        strata.values.push((flag.name, value));
    }
    Ok((strata, rest))
}

/// The help section printed after llama-server's own.
pub fn help_section() -> String {
    let mut s = String::from("\n\n----- strata params -----\n\n");
    for f in FLAGS {
        let left = match f.kind {
            Kind::Switch => f.name.to_string(),
            Kind::Value(hint) => format!("{} {hint}", f.name),
        };
        let _ = writeln!(s, "{left:<40}{}", f.help);
    }
    s.push_str("\nenvironment:\n");
    for e in ENV_VARS {
        let _ = writeln!(s, "{:<40}{}", e.name, e.help);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        std::iter::once("strata-server").chain(s.split_whitespace()).map(String::from).collect()
    }

    #[test]
    fn passes_llama_flags_through_untouched() {
        let (strata, rest) = split(&argv("-m x.gguf -ngl 99 --port 0")).unwrap();
        assert!(strata.values.is_empty());
        assert_eq!(rest, argv("-m x.gguf -ngl 99 --port 0"));
    }

    #[test]
    fn takes_strata_flags_and_maps_aliases() {
        let (strata, rest) = split(&argv("--mmap-experts -m x.gguf --prefill 8192 --kv int8 --expert-cache=auto --spec 4")).unwrap();
        assert!(strata.is_set("--mmap-experts"));
        assert_eq!(strata.get("--expert-cache"), Some("auto"));
        assert_eq!(strata.get("--prefill"), Some("8192"));
        assert_eq!(
            rest,
            argv("-m x.gguf --batch-size 8192 --ubatch-size 8192 --cache-type-k q8_0 --cache-type-v q8_0 --spec-draft-n-max 4")
        );
    }

    #[test]
    fn missing_value_and_bad_kv_are_errors() {
        assert!(split(&argv("--expert-profile")).unwrap_err().contains("expected value"));
        assert!(split(&argv("--kv int4")).unwrap_err().contains("expected int8 or f16"));
    }

    #[test]
    fn help_lists_every_flag_and_variable() {
        let h = help_section();
        for f in FLAGS {
            assert!(h.contains(f.name), "{} missing from help", f.name);
        }
        for e in ENV_VARS {
            assert!(h.contains(e.name));
        }
    }
}
