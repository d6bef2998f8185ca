use std::path::{Path, PathBuf};

use crate::support::{golden, model, repo, run_server, Server, SERVER};

fn expect_golden(name: &str, args: &[&str]) {
    let out = run_server(args, &[]);
    assert_eq!(out.status.to_string(), golden(&format!("llama-server/{name}.status")).trim(), "exit status of {args:?}");
    assert_eq!(out.stderr, golden(&format!("llama-server/{name}.stderr")), "stderr of {args:?}");
    assert_eq!(out.stdout, golden(&format!("llama-server/{name}.stdout")), "stdout of {args:?}");
}

#[test]
fn help_is_upstreams_followed_by_the_strata_section() {
    let out = run_server(&["--help"], &[]);
    assert_eq!(out.status, 0);
    let upstream = golden("llama-server/help.stdout");
    let rest = out.stdout.strip_prefix(upstream.as_str()).unwrap_or_else(|| {
        let at = out.stdout.bytes().zip(upstream.bytes()).take_while(|(a, b)| a == b).count();
        panic!("--help differs from the pinned llama-server at byte {at}: {:?}", &out.stdout[at.saturating_sub(80)..at + 80])
    });
    assert!(rest.starts_with("\n\n----- strata params -----\n"), "{rest}");
    for flag in ["--mmap-experts", "--expert-profile FILE", "--expert-cache auto|N", "--vram-reserve-mib N", "STRATA_IO_THREADS"] {
        assert!(rest.contains(flag), "{flag} missing from the Strata section");
    }
}

#[test]
fn unknown_flag_fails_like_upstream() {
    expect_golden("unknown-flag", &["--foo"]);
}

#[test]
fn removed_flag_fails_like_upstream() {
    expect_golden("removed-flag", &["--draft-max", "4"]);
}

#[test]
fn bad_value_fails_like_upstream() {
    expect_golden("bad-value", &["--ctx-size", "abc"]);
}

/// Strata's version and commit, then the pin's text as llama-server prints it.
#[test]
fn version_is_strata_then_upstreams() {
    let out = run_server(&["--version"], &[]);
    assert_eq!(out.status.to_string(), golden("llama-server/version.status").trim());
    let (first, rest) = out.stderr.split_once('\n').unwrap();
    let strata = regex::Regex::new(r"^strata-server \d+\.\d+\.\d+ \(commit ([0-9a-f]{12}|unknown)\)$").unwrap();
    assert!(strata.is_match(first), "{first}");
    assert_eq!(rest, golden("llama-server/version.stderr"));
    assert_eq!(out.stdout, golden("llama-server/version.stdout"));
}

#[test]
fn strata_flag_without_value_is_refused() {
    let out = run_server(&["--expert-profile"], &[]);
    assert_eq!(out.status, 1);
    assert!(out.stderr.contains("error while handling argument \"--expert-profile\""), "{}", out.stderr);
}

#[test]
fn an_unknown_or_retired_strata_variable_stops_the_start_and_says_why() {
    let m = model("tiny-qwen3moe.gguf");
    let m = m.to_str().unwrap();
    for (var, want) in [
        ("STRATA_PREFIL_RING", "STRATA_PREFIL_RING is not a variable strata-server reads (did you mean STRATA_PREFILL_RING?)"),
        ("STRATA_RING_EMULATE", "STRATA_RING_EMULATE is no longer read: use STRATA_LAB=emulate-ring"),
    ] {
        let out = run_server(&["-m", m], &[(var, "1")]);
        assert_eq!(out.status, 1, "{}", out.stderr);
        assert!(out.stderr.contains(want) && !out.stderr.contains("loading model"), "{}", out.stderr);
    }
}

#[test]
fn llama_arg_ctx_size_env_is_honoured() {
    let gemma = model("gemma3-270m-q4_k_m.gguf");
    let server = Server::start(&["-m", gemma.to_str().unwrap()], &[("LLAMA_ARG_CTX_SIZE", "512")]);
    let long = "one two three four five six seven eight nine ten ".repeat(60);
    let (status, body) = server.post("/completion", &serde_json::json!({"prompt": long, "n_predict": 1}));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["type"], "exceed_context_size_error");
    assert!(body["error"]["message"].as_str().unwrap().contains("(512 tokens)"), "{body}");
    let (status, body) = server.post("/completion", &serde_json::json!({"prompt": "one two", "n_predict": 1}));
    assert_eq!(status, 200, "{body}");
}

fn upstream_server() -> PathBuf {
    let bin = std::env::var_os("STRATA_UPSTREAM_SERVER").map(PathBuf::from).unwrap_or_else(|| repo().join("target/upstream/bin/llama-server"));
    assert!(bin.exists(), "{} is missing: run tools/build-upstream (tools/test does)", bin.display());
    bin
}

/// A log's text with its timestamps, JSONL times and the backends' directory blanked.
fn blanked(b: &[u8]) -> String {
    let times = regex::Regex::new(r#"\d+\.\d{2}\.\d{3}\.\d{3}|"time":\d+"#).unwrap();
    let libs = regex::Regex::new(r"backend from \S+/").unwrap();
    libs.replace_all(&times.replace_all(&String::from_utf8_lossy(b), "T"), "backend from DIR/").into_owned()
}

/// (status, stdout, stderr) of a run, blanked.
fn run_blanked(bin: &Path, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(bin).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), blanked(&out.stdout), blanked(&out.stderr))
}

/// Options llama.cpp's parser acts on before any server starts (listings, the completion
/// script, removed options): the same output and exit status from both servers.
#[test]
fn exit_options_print_what_upstream_prints() {
    for args in [
        &["--completion-bash"][..],
        &["--list-devices"],
        &["-cl"],
        &["--draft-min", "2"],
        &["--spec-ngram-size-n", "4"],
        &["--spec-ngram-size-m", "8"],
        &["--spec-ngram-min-hits", "2"],
    ] {
        assert_eq!(run_blanked(Path::new(SERVER), args), run_blanked(&upstream_server(), args), "{args:?}");
    }
}

/// The log options shape strata-server's own lines as they shape llama-server's: a start on a
/// model that does not exist logs a dozen lines of both, then fails; each option gives the same
/// output on the terminal and in --log-file, timestamps aside.
#[test]
fn log_options_shape_strata_lines_as_upstreams() {
    let dir = std::env::temp_dir().join(format!("strata-log-options-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("server.log");
    let file_arg = file.display().to_string();
    let cases: [&[&str]; 9] = [
        &[],
        &["--log-disable"],
        &["--no-log-prefix"],
        &["--log-prefix", "--no-log-timestamps"],
        &["--log-colors", "on"],
        &["--log-jsonl"],
        &["--log-file", &file_arg],
        &["-lv", "1"],
        &["-v"],
    ];
    for extra in cases {
        let mut args = vec!["-m", "/nonexistent/model.gguf", "--port", "0"];
        args.extend_from_slice(extra);
        let [strata, upstream] = [PathBuf::from(SERVER), upstream_server()].map(|bin| {
            let _ = std::fs::remove_file(&file);
            let out = run_blanked(&bin, &args);
            (out, blanked(&std::fs::read(&file).unwrap_or_default()))
        });
        assert_eq!(strata.0 .0, 1, "{extra:?}: {}", strata.0 .2);
        assert_eq!(strata, upstream, "{extra:?}");
        if extra.is_empty() {
            assert!(strata.0 .2.contains("E srv  llama_server: exiting due to model loading error"), "{}", strata.0 .2);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
