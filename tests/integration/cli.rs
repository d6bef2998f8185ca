use crate::support::{golden, model, run_server, Server};

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

#[test]
fn version_is_upstreams() {
    expect_golden("version", &["--version"]);
}

#[test]
fn strata_flag_without_value_is_refused() {
    let out = run_server(&["--expert-profile"], &[]);
    assert_eq!(out.status, 1);
    assert!(out.stderr.contains("error while handling argument \"--expert-profile\""), "{}", out.stderr);
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
