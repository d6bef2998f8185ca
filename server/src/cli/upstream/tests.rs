use super::*;
use std::path::{Path, PathBuf};
use strata_ffi::{ParseOutcome, ServerParams};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The spellings of each option line of a `--help` text.
fn help_options(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in help.lines().filter(|l| l.starts_with('-') && !l.starts_with("-----")) {
        let mut names: Vec<&str> = Vec::new();
        for t in line.split_whitespace() {
            if !t.starts_with('-') || names.last().is_some_and(|n| !n.ends_with(',')) {
                break;
            }
            names.push(t);
        }
        out.push(names.iter().map(|n| n.trim_end_matches(',')).collect::<Vec<_>>().join(", "));
    }
    out
}

#[test]
fn the_table_is_upstreams_help_row_for_row() {
    let help = std::fs::read_to_string(repo().join("tests/golden/llama-server/help.stdout")).unwrap();
    let options = help_options(&help);
    let table: Vec<&str> = table().map(|u| u.option).collect();
    for (i, (h, t)) in options.iter().zip(&table).enumerate() {
        assert_eq!(h, t, "row {i}: the help lists {h:?}, the table {t:?}");
    }
    assert_eq!(options.len(), table.len(), "the help has {} options, the table {} rows", options.len(), table.len());
}

const PARAMETER_KINDS: &[&str] = &["model", "context", "draft_model", "draft_context", "backend", "sampling"];

#[test]
fn every_honoured_row_has_evidence_of_a_known_kind() {
    for u in table() {
        let Class::Honoured(e) = u.class else { continue };
        let kind = e.split_once(':').map_or("", |(k, _)| k);
        assert!(kind == "test" || PARAMETER_KINDS.contains(&kind), "{}: evidence {e:?}", u.option);
    }
}

#[test]
fn every_named_test_exists() {
    for u in table() {
        let Class::Honoured(e) = u.class else { continue };
        let Some(t) = e.strip_prefix("test:") else { continue };
        let (path, name) = t.split_once("::").unwrap_or_else(|| panic!("{}: {e} is not test:PATH::NAME", u.option));
        let text = std::fs::read_to_string(repo().join(path)).unwrap_or_else(|err| panic!("{}: {path}: {err}", u.option));
        let def = if path.ends_with(".rs") {
            format!("fn {name}(")
        } else if path.ends_with(".py") {
            format!("def {name}(")
        } else {
            format!("\"{name}\"")
        };
        assert!(text.contains(&def), "{}: {path} has no {def}", u.option);
    }
}

/// The pin as published, before the patch series.
fn pristine() -> PathBuf {
    let out = std::process::Command::new("bash").arg(repo().join("vendor/fetch")).arg("--pristine").output().unwrap();
    assert!(out.status.success(), "vendor/fetch --pristine: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

#[test]
fn every_inert_row_names_the_pins_line() {
    let pin_root = pristine();
    for u in table() {
        let Class::Inert { pin, text, .. } = u.class else { continue };
        let (path, line) = pin.rsplit_once(':').unwrap();
        let src = std::fs::read_to_string(pin_root.join(path)).unwrap();
        let got = src.lines().nth(line.parse::<usize>().unwrap() - 1).unwrap_or_default();
        assert!(got.contains(text), "{}: {pin} is {got:?}, not {text:?}", u.option);
    }
}

fn parse(args: &[&str]) -> ServerParams {
    let argv: Vec<String> = std::iter::once("strata-server").chain(args.iter().copied()).map(String::from).collect();
    match ServerParams::parse(&argv, None).unwrap() {
        ParseOutcome::Parsed(p) => p,
        ParseOutcome::Rejected => panic!("llama.cpp's parser rejected {args:?}"),
    }
}

/// Test files the samples name as `{dir}/...`.
fn sample_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-upstream-table-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("g.gbnf"), "root ::= \"a\"\n").unwrap();
    std::fs::write(dir.join("schema.json"), "{\"type\": \"object\"}").unwrap();
    dir
}

fn sample(u: &U, dir: &Path) -> Vec<String> {
    u.sample.iter().map(|a| a.replace("{dir}", &dir.display().to_string())).collect()
}

/// The sample without the row's own option (and its value): what the option is compared with.
fn without_own(u: &U, args: &[String]) -> Vec<String> {
    let own: Vec<&str> = u.option.split(", ").collect();
    let mut out = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(a) = it.next() {
        if own.contains(&a.as_str()) {
            it.next_if(|v| !v.starts_with('-'));
        } else {
            out.push(a.clone());
        }
    }
    out
}

/// Each row whose evidence is a field of llama.cpp's parameters or of the default sampling
/// settings: its sample changes that field against the same arguments without the option.
#[test]
fn every_parameter_row_reaches_llama_cpps_parameters() {
    let dir = sample_dir();
    let mut checked = 0;
    for u in table() {
        let Class::Honoured(e) = u.class else { continue };
        let Some((kind, field)) = e.split_once(':').filter(|(k, _)| PARAMETER_KINDS.contains(k)) else { continue };
        assert!(!u.sample.is_empty(), "{}: no sample", u.option);
        let args = sample(u, &dir);
        let view = |args: &[String]| {
            let mut p = parse(&args.iter().map(String::as_str).collect::<Vec<_>>());
            p.apply_server_defaults().unwrap();
            if kind == "sampling" {
                strata_ffi::sampling_settings(Some(&p), &serde_json::json!({}), 0).unwrap()[field].clone()
            } else {
                p.llama_params_json().unwrap()[kind][field].clone()
            }
        };
        let (got, want) = (view(&args), view(&without_own(u, &args)));
        assert!(!got.is_null(), "{}: {e}: no such field", u.option);
        assert_ne!(got, want, "{}: {args:?} leaves {e} at {want}", u.option);
        checked += 1;
    }
    assert!(checked > 80, "{checked}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn refusals_name_the_option_and_only_for_changed_keys() {
    let defaults = ServerParams::defaults_json().unwrap();
    assert!(refusals(&parse(&[]).to_json().unwrap(), &defaults).is_empty());
    assert!(refusals(&parse(&["-dev", "none", "--no-mmproj"]).to_json().unwrap(), &defaults).is_empty());
    let r = refusals(&parse(&["--image-max-tokens", "9"]).to_json().unwrap(), &defaults);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(r[0].starts_with("--image-max-tokens: strata-server does not serve images"), "{r:?}");
    for u in table() {
        if let Class::Refused { key, .. } = u.class {
            assert!(defaults.get(key).is_some(), "{}: the shim's JSON has no {key}", u.option);
        }
    }
}

/// strata-server started with each refused row's sample stops before loading, naming it;
/// every refused key has a row with a sample that starts without the network.
#[test]
fn every_refused_option_stops_start_up_naming_it() {
    let exe = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().join("strata-server");
    let mut shown = Vec::new();
    for u in table() {
        let Class::Refused { key, why } = u.class else { continue };
        if u.sample.is_empty() {
            continue;
        }
        let out = std::process::Command::new(&exe).args(["-m", "absent.gguf", "--port", "0"]).args(u.sample).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", u.option);
        // -mmdev none is --no-mmproj-offload by value: either name will do
        let named = table().any(|v| {
            matches!(v.class, Class::Refused { key: k, why: w } if k == key || w == why) && stderr.contains(&format!("E srv  llama_server: {}: ", v.option))
        });
        assert!(named, "{}: {stderr}", u.option);
        shown.push(key);
    }
    for u in table() {
        if let Class::Refused { key, .. } = u.class {
            assert!(shown.contains(&key), "{}: no row refusing {key} has a sample", u.option);
        }
    }
}

#[test]
fn docs_upstream_flags_md_is_the_table() {
    let path = repo().join("docs/llama-server-flags.md");
    if std::env::var_os("STRATA_BLESS").is_some() {
        std::fs::write(&path, markdown()).unwrap();
    }
    assert_eq!(std::fs::read_to_string(&path).unwrap_or_default(), markdown(), "run with STRATA_BLESS=1 to rewrite {}", path.display());
}
