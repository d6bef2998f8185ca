//! Strata's own flags: one table drives parsing, `--help` and the docs. Everything else on the
//! command line goes to llama.cpp's parser untouched. Flags that overlap a llama-server flag
//! are rewritten onto it, so llama.cpp sees (and validates) a single setting.

use std::fmt::Write as _;
use std::path::PathBuf;

pub use super::env::Effect;
use super::env::{ENV_VARS, TIERS_ON};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Switch,
    Value(&'static str),
}

/// Rewrites an alias flag's value into llama-server arguments.
pub type MapFn = fn(&str) -> Result<Vec<String>, String>;

/// Parses a flag's value into its typed field.
pub type SetFn = fn(&mut StrataArgs, &str) -> Result<(), String>;

pub struct Flag {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    /// What leaving it out gives.
    pub default: &'static str,
    /// The flag without which it does nothing; "" when it acts alone.
    pub needs: &'static str,
    /// The llama-server arguments this flag stands for, if it is an alias.
    pub maps_to: Option<MapFn>,
    pub effect: Effect,
    pub set: SetFn,
}

const NOT_YET: &str = " (accepted; no effect in this build yet)";

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
    Flag {
        name: "--mmap-experts",
        kind: Kind::Switch,
        help: "serve cold experts from the memory-mapped model file (the SSD fallback tier)",
        default: "off",
        needs: "",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, _| {
            a.mmap_experts = true;
            Ok(())
        },
    },
    Flag {
        name: "--resident-cpu-experts",
        kind: Kind::Switch,
        help: "copy the experts outside the static GPU cache into RAM (needs mmap); on a GPU the copy is page-locked, so decode reads cold experts over the bus, else pageable; where the memory guard admits only part of it, the layers the profile selects most are copied and the rest read from the mapping (start-up says what each flag came to)",
        default: "off",
        needs: "--expert-profile (or --adapt-every N)",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, _| {
            a.resident_cpu_experts = true;
            Ok(())
        },
    },
    Flag {
        name: "--resident-experts",
        kind: Kind::Switch,
        help: "page-lock the RAM expert copy (CUDA; keeps 4 GiB of headroom)",
        default: "off",
        needs: "--expert-profile (or --adapt-every N)",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, _| {
            a.resident_experts = true;
            Ok(())
        },
    },
    Flag {
        name: "--expert-profile",
        kind: Kind::Value("FILE"),
        help: "fixed, ranked expert profile written by tools/expert-profile",
        default: "none: experts taken evenly per layer",
        needs: "",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, v| {
            a.expert_profile = Some(v.into());
            Ok(())
        },
    },
    Flag {
        name: "--expert-profile-out",
        kind: Kind::Value("FILE"),
        help: "count expert selections and write them as a ranked profile to FILE after every request (tools/expert-profile uses it)",
        default: "none",
        needs: "",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, v| {
            a.expert_profile_out = Some(v.into());
            Ok(())
        },
    },
    Flag {
        name: "--expert-cache",
        kind: Kind::Value("auto|N"),
        help: "experts kept in VRAM: auto fills what --vram-reserve-mib leaves after weights, KV and compute buffers",
        default: "auto",
        needs: "",
        maps_to: None,
        effect: Effect::Experts,
        set: set_expert_cache,
    },
    Flag {
        name: "--prefill",
        kind: Kind::Value("N"),
        help: "prompt tokens per step; same as -b N -ub N",
        default: "llama-server's -b and -ub",
        needs: "",
        maps_to: Some(map_prefill),
        effect: Effect::Active,
        set: alias,
    },
    Flag {
        name: "--spec",
        kind: Kind::Value("N"),
        help: "tokens to draft per step; same as --spec-draft-n-max N; with no --spec-type or draft model, a model with an MTP head drafts with it (--spec-type draft-mtp), and start-up says which drafter drafts or that none does",
        default: "llama-server's --spec-draft-n-max",
        needs: "a drafter (--spec-type, a draft model, or the model's MTP head)",
        maps_to: Some(map_spec),
        effect: Effect::Active,
        set: alias,
    },
    Flag {
        name: "--spec-min-p",
        kind: Kind::Value("P"),
        help: "minimum draft probability; same as --spec-draft-p-min P",
        default: "llama-server's --spec-draft-p-min",
        needs: "a drafter (--spec-type or a draft model)",
        maps_to: Some(map_spec_min_p),
        effect: Effect::Active,
        set: alias,
    },
    Flag {
        name: "--max-context",
        kind: Kind::Value("N"),
        help: "context size; same as -c N",
        default: "llama-server's -c",
        needs: "",
        maps_to: Some(map_max_context),
        effect: Effect::Active,
        set: alias,
    },
    Flag {
        name: "--kv",
        kind: Kind::Value("int8|f16"),
        help: "KV cache type; int8 is -ctk q8_0 -ctv q8_0, f16 is -ctk f16 -ctv f16",
        default: "f16",
        needs: "",
        maps_to: Some(map_kv),
        effect: Effect::Active,
        set: alias,
    },
    Flag {
        name: "--kv-resident",
        kind: Kind::Value("N"),
        help: "at most N tokens of a sequence's KV cache on the card: the K and V of sparse-attention (QSA) layers live in page-locked host memory the GPU reads in place (dense attention layers keep theirs; start-up says so)",
        default: "all",
        needs: "",
        maps_to: None,
        effect: Effect::Active,
        set: |a, v| {
            a.kv_resident = Some(number(v)?);
            Ok(())
        },
    },
    Flag {
        name: "--pool-workers",
        kind: Kind::Value("N"),
        help: "CPU workers computing cold experts during decode",
        default: "0: llama.cpp's CPU threads (-t)",
        needs: TIERS_ON,
        maps_to: None,
        effect: Effect::Experts,
        set: |a, v| {
            a.pool_workers = Some(number(v)?);
            Ok(())
        },
    },
    Flag {
        name: "--adapt-every",
        kind: Kind::Value("N"),
        help: "every N batches exchange experts between the VRAM cache and the RAM copy by recent use (0 = fixed placement)",
        default: "0",
        needs: "--resident-experts or --resident-cpu-experts",
        maps_to: None,
        effect: Effect::Experts,
        set: |a, v| {
            a.adapt_every = Some(number(v)?);
            Ok(())
        },
    },
    Flag {
        name: "--pcie-frac",
        kind: Kind::Value("F"),
        help: "share of decode misses uploaded over PCIe instead of computed on the CPU (0 = none)",
        default: "0",
        needs: TIERS_ON,
        maps_to: None,
        effect: Effect::Experts,
        set: set_pcie_frac,
    },
    Flag {
        name: "--ple-mode",
        kind: Kind::Value("ssd|mmap|ram"),
        help: "where a per-layer token embedding (PLE) table lives: ssd = in the file, the rows a batch needs read by STRATA_IO_THREADS direct-I/O workers into a RAM row cache; mmap = in the file, read through the mapping (--lazy-mode on); ram = loaded (--lazy-mode off)",
        default: "llama-server's --lazy-mode",
        needs: "",
        maps_to: None,
        effect: Effect::Active,
        set: set_ple_mode,
    },
    Flag {
        name: "--ple-cache-mib",
        kind: Kind::Value("N"),
        help: "RAM for PLE rows read with --ple-mode ssd, in MiB",
        default: "256",
        needs: "--ple-mode ssd",
        maps_to: None,
        effect: Effect::Active,
        set: |a, v| {
            a.ple_cache_mib = number(v)?;
            Ok(())
        },
    },
    Flag {
        name: "--max-queued",
        kind: Kind::Value("N"),
        help: "most tasks waiting for a slot; a request past it gets 503 with Retry-After",
        default: "4096",
        needs: "",
        maps_to: None,
        effect: Effect::Active,
        set: set_max_queued,
    },
    Flag {
        name: "--vram-reserve-mib",
        kind: Kind::Value("N"),
        help: "VRAM left free for other processes, in MiB",
        default: "0",
        needs: TIERS_ON,
        maps_to: None,
        effect: Effect::Experts,
        set: |a, v| {
            a.vram_reserve_mib = Some(number(v)?);
            Ok(())
        },
    },
];

/// Strata's flags, parsed once from the table: typed values, and every flag given as written (for
/// warnings and for a router's children).
#[derive(Debug, Clone, PartialEq)]
pub struct StrataArgs {
    /// Each Strata flag given and its value as written ("" for a switch), in order.
    pub given: Vec<(&'static str, String)>,
    pub mmap_experts: bool,
    pub resident_cpu_experts: bool,
    pub resident_experts: bool,
    pub expert_profile: Option<PathBuf>,
    pub expert_profile_out: Option<PathBuf>,
    pub expert_cache: Option<CacheSize>,
    pub kv_resident: Option<u64>,
    pub pool_workers: Option<i32>,
    pub adapt_every: Option<u64>,
    pub pcie_frac: Option<f64>,
    pub max_queued: usize,
    pub vram_reserve_mib: Option<u64>,
    pub ple_mode: Option<PleMode>,
    pub ple_cache_mib: u64,
}

/// --ple-mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PleMode {
    Ssd,
    Mmap,
    Ram,
}

/// --expert-cache: `auto` (what VRAM allows) or a number of experts.
pub use strata_residency::plan::Cache as CacheSize;

impl Default for StrataArgs {
    fn default() -> Self {
        StrataArgs {
            given: Vec::new(),
            mmap_experts: false,
            resident_cpu_experts: false,
            resident_experts: false,
            expert_profile: None,
            expert_profile_out: None,
            expert_cache: None,
            kv_resident: None,
            pool_workers: None,
            adapt_every: None,
            pcie_frac: None,
            max_queued: crate::engine::DEFAULT_MAX_QUEUED,
            vram_reserve_mib: None,
            ple_mode: None,
            ple_cache_mib: DEFAULT_PLE_CACHE_MIB,
        }
    }
}

impl StrataArgs {
    /// Flags taken that are not aliases of a llama-server flag.
    pub fn own_flags(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.given.iter().filter(|(n, _)| FLAGS.iter().any(|f| f.name == *n && f.maps_to.is_none())).map(|(n, _)| *n)
    }

    #[cfg(test)]
    pub fn is_set(&self, name: &str) -> bool {
        self.given.iter().any(|(n, _)| *n == name)
    }
}

fn alias(_: &mut StrataArgs, _: &str) -> Result<(), String> {
    Ok(())
}

fn number<T: std::str::FromStr>(v: &str) -> Result<T, String> {
    v.trim().parse::<T>().map_err(|_| format!("invalid value '{v}'"))
}

fn set_expert_cache(a: &mut StrataArgs, v: &str) -> Result<(), String> {
    a.expert_cache = Some(match v {
        "auto" => CacheSize::Auto,
        n => CacheSize::Experts(n.parse().map_err(|_| format!("invalid value '{n}': expected auto or a number of experts"))?),
    });
    Ok(())
}

fn set_pcie_frac(a: &mut StrataArgs, v: &str) -> Result<(), String> {
    let f: f64 = number(v)?;
    if !(0.0..=1.0).contains(&f) {
        return Err(format!("{f} is not between 0 and 1"));
    }
    a.pcie_frac = Some(f);
    Ok(())
}

/// --ple-cache-mib's default.
pub const DEFAULT_PLE_CACHE_MIB: u64 = 256;

fn set_ple_mode(a: &mut StrataArgs, v: &str) -> Result<(), String> {
    a.ple_mode = Some(match v {
        "ssd" => PleMode::Ssd,
        "mmap" => PleMode::Mmap,
        "ram" => PleMode::Ram,
        other => return Err(format!("invalid value '{other}': expected ssd, mmap or ram")),
    });
    Ok(())
}

impl PleMode {
    /// The pin's --lazy-mode that keeps the table where this mode wants it.
    pub fn llama_args(self) -> [&'static str; 2] {
        match self {
            PleMode::Ssd | PleMode::Mmap => ["--lazy-mode", "on"],
            PleMode::Ram => ["--lazy-mode", "off"],
        }
    }
}

fn set_max_queued(a: &mut StrataArgs, v: &str) -> Result<(), String> {
    a.max_queued = v.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("expected a positive integer, got '{v}'"))?;
    Ok(())
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
        (flag.set)(&mut strata, &value).map_err(|e| format!("error while handling argument \"{name}\": {e}"))?;
        strata.given.push((flag.name, value));
    }
    Ok((strata, rest))
}

/// The help section printed after llama-server's own.
pub fn help_section() -> String {
    let mut s = String::from("\n\n----- strata params -----\n\n");
    for f in FLAGS {
        let _ = writeln!(s, "{:<40}{}", flag_left(f), row_help(f.help, f.default, f.needs, f.effect));
    }
    s.push_str("\nenvironment (any other STRATA_ name stops the start):\n");
    for e in ENV_VARS {
        let _ = writeln!(s, "{:<40}{}", format!("{}={}", e.name, e.value), row_help(e.help, e.default, e.needs, e.effect));
    }
    s
}

fn flag_left(f: &Flag) -> String {
    match f.kind {
        Kind::Switch => f.name.to_string(),
        Kind::Value(hint) => format!("{} {hint}", f.name),
    }
}

/// A row's help with its default and what it needs, as `--help` and docs/flags.md print it.
fn row_help(help: &str, default: &str, needs: &str, effect: Effect) -> String {
    let needs = if needs.is_empty() { String::new() } else { format!("; needs {needs}") };
    let not_yet = if effect == Effect::NotYet { NOT_YET } else { "" };
    format!("{help} (default: {default}{needs}){not_yet}")
}

/// docs/flags.md: the same table as `--help`, as Markdown.
#[cfg(test)]
pub fn markdown() -> String {
    let mut s = String::from("# Strata's own flags and variables\n\nGenerated from `server/src/cli/flags.rs` and `server/src/cli/env.rs` (the tables that also parse them and\nwrite `--help`); `cargo test -p strata-server docs_flags` fails when this file and the tables differ\n(`STRATA_BLESS=1` rewrites it). A `STRATA_` variable not listed here stops the start.\n\n| flag | what it does |\n|---|---|\n");
    for f in FLAGS {
        let _ = writeln!(s, "| `{}` | {} |", flag_left(f), row_help(f.help, f.default, f.needs, f.effect).replace('|', "\\|"));
    }
    s.push_str("\n| environment variable | what it does |\n|---|---|\n");
    for e in ENV_VARS {
        let _ = writeln!(s, "| `{}={}` | {} |", e.name, e.value, row_help(e.help, e.default, e.needs, e.effect).replace('|', "\\|"));
    }
    s
}

/// Start-up warnings: flags taken that do nothing here (the expert flags without a tier), and
/// variables set (`set`, by name) that do nothing without them.
/// A start-up line for each alias given: the llama-server arguments it stood for (`--spec` has
/// a line of its own, naming the drafter: cli::spec).
pub fn alias_lines(strata: &StrataArgs) -> Vec<String> {
    let mut out = Vec::new();
    for (name, value) in &strata.given {
        let Some(map) = FLAGS.iter().find(|f| f.name == *name && *name != "--spec").and_then(|f| f.maps_to) else { continue };
        if let Ok(args) = map(value) {
            out.push(format!("{name} {value}: {}", args.join(" ")));
        }
    }
    out
}

pub fn warnings(strata: &StrataArgs, tiers: bool, set: &[&str]) -> Vec<String> {
    let effect = |n: &str| FLAGS.iter().find(|f| f.name == n).map(|f| f.effect);
    let mut out: Vec<String> = Vec::new();
    for n in strata.own_flags() {
        match effect(n) {
            Some(Effect::NotYet) => out.push(format!("{n} is accepted but has no effect in this build yet")),
            Some(Effect::Experts) if !tiers => out.push(format!("{n} has no effect without the expert tiers: add {TIERS_ON}")),
            _ => {}
        }
    }
    for e in ENV_VARS.iter().filter(|e| set.contains(&e.name)) {
        match e.effect {
            Effect::NotYet => out.push(format!("{} is set but has no effect in this build yet", e.name)),
            Effect::Experts if !tiers => out.push(format!("{} is set but has no effect without the expert tiers: add {TIERS_ON}", e.name)),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        std::iter::once("strata-server").chain(s.split_whitespace()).map(String::from).collect()
    }

    #[test]
    fn each_alias_given_says_what_it_stood_for() {
        let (strata, _) = split(&argv("--prefill 8192 --kv int8 --max-context 262144 --spec 4 --spec-min-p 0.5 --mmap-experts")).unwrap();
        assert_eq!(
            alias_lines(&strata),
            [
                "--prefill 8192: --batch-size 8192 --ubatch-size 8192",
                "--kv int8: --cache-type-k q8_0 --cache-type-v q8_0",
                "--max-context 262144: --ctx-size 262144",
                "--spec-min-p 0.5: --spec-draft-p-min 0.5",
            ]
        );
    }

    #[test]
    fn passes_llama_flags_through_untouched() {
        let (strata, rest) = split(&argv("-m x.gguf -ngl 99 --port 0")).unwrap();
        assert!(strata.given.is_empty());
        assert_eq!(rest, argv("-m x.gguf -ngl 99 --port 0"));
    }

    #[test]
    fn takes_strata_flags_and_maps_aliases() {
        let (strata, rest) = split(&argv("--mmap-experts -m x.gguf --prefill 8192 --kv int8 --expert-cache=auto --spec 4")).unwrap();
        assert!(strata.is_set("--mmap-experts"));
        assert_eq!(strata.expert_cache, Some(CacheSize::Auto));
        assert!(strata.is_set("--prefill"));
        assert_eq!(rest, argv("-m x.gguf --batch-size 8192 --ubatch-size 8192 --cache-type-k q8_0 --cache-type-v q8_0 --spec-draft-n-max 4"));
    }

    #[test]
    fn max_queued_defaults_and_refuses_nonsense() {
        assert_eq!(split(&argv("")).unwrap().0.max_queued, crate::engine::DEFAULT_MAX_QUEUED);
        assert_eq!(split(&argv("--max-queued 8")).unwrap().0.max_queued, 8);
        for bad in ["0", "-1", "x"] {
            let e = split(&argv(&format!("--max-queued {bad}"))).unwrap_err();
            assert!(e.contains("--max-queued") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn missing_value_and_bad_kv_are_errors() {
        assert!(split(&argv("--expert-profile")).unwrap_err().contains("expected value"));
        assert!(split(&argv("--kv int4")).unwrap_err().contains("expected int8 or f16"));
        assert!(split(&argv("--ple-mode disk")).unwrap_err().contains("expected ssd, mmap or ram"));
        let (ple, rest) = split(&argv("--ple-mode ssd --ple-cache-mib 64")).unwrap();
        assert_eq!((ple.ple_mode, ple.ple_cache_mib), (Some(PleMode::Ssd), 64));
        assert_eq!(rest, argv(""));
        let e = split(&argv("--expert-cache lots")).unwrap_err();
        assert!(e.contains("\"--expert-cache\"") && e.contains("invalid value 'lots'"), "{e}");
        assert!(split(&argv("--pcie-frac 2")).unwrap_err().contains("between 0 and 1"));
        assert!(split(&argv("--pool-workers many")).unwrap_err().contains("\"--pool-workers\": invalid value 'many'"));
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
        assert!(ENV_VARS.len() <= 10, "--help lists at most 10 variables; experiments go in STRATA_LAB");
        for line in h.lines().filter(|l| l.starts_with("--") && !l.starts_with("---") || l.starts_with("STRATA_")) {
            assert!(line.contains("(default: "), "a row without its default: {line}");
        }
        let marked: Vec<&str> = h.lines().filter(|l| l.ends_with(NOT_YET)).map(|l| l.split_whitespace().next().unwrap_or("")).collect();
        assert!(marked.is_empty(), "flags that do nothing yet: {marked:?}");
    }

    #[test]
    fn warnings_name_what_does_nothing() {
        let (strata, _) = split(&argv("--adapt-every 0 --pool-workers 4 --prefill 512")).unwrap();
        let w = warnings(&strata, false, &["STRATA_HIPBLASLT_TUNING", "STRATA_PREFILL_RING"]);
        let off = "has no effect without the expert tiers: add --mmap-experts, --resident-cpu-experts or --resident-experts (or --expert-cache N)";
        assert_eq!(w, [format!("--adapt-every {off}"), format!("--pool-workers {off}"), format!("STRATA_PREFILL_RING is set but {off}")]);
        assert!(warnings(&strata, true, &[]).is_empty());
        let (strata, _) = split(&argv("--kv-resident 1024")).unwrap();
        assert!(warnings(&strata, false, &[]).is_empty());
    }

    #[test]
    fn docs_flags_md_is_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/flags.md");
        if std::env::var_os("STRATA_BLESS").is_some() {
            std::fs::write(&path, markdown()).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(have == markdown(), "docs/flags.md differs from the flag table; STRATA_BLESS=1 cargo test -p strata-server docs_flags rewrites it");
    }
}
