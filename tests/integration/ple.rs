//! --ple-mode ssd: a per-layer embedding table left in the file and read row by row through the
//! direct-I/O readers gives exactly the tokens and probabilities of the table loaded in RAM.

use std::path::PathBuf;

use serde_json::{json, Value};

use crate::support::{model, run_server, Server};

const MODEL: &str = "tiny-gemma4-ple.gguf";
/// gemma3n's table: 256 values per layer and token (fixed in llama.cpp), marked lazy by patches/0004.
const GEMMA3N: &str = "tiny-gemma3n-ple.gguf";
/// qwen4exp's table is indexed by hashed n-gram heads, not by token.
const QWEN4EXP: &str = "tiny-qwen4exp.gguf";

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-ple-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A prompt batch and 24 greedy tokens with their top-5 probabilities.
fn run(name: &str, extra: &[&str], env: &[(&str, &str)]) -> (Value, String) {
    let m = model(name);
    let mut args = vec!["-m", m.to_str().unwrap(), "-c", "512", "-np", "1", "--metrics"];
    args.extend_from_slice(extra);
    let s = Server::start(&args, env);
    let req = json!({"prompt": "The lighthouse keeper counted the ships that passed in the night, one by one", "n_predict": 24, "temperature": 0.0, "n_probs": 5, "return_tokens": true, "cache_prompt": false});
    let (status, body) = s.post("/completion", &req);
    assert_eq!(status, 200, "{body}");
    // a second request repeats most rows: they come from the row cache
    let (status, _) = s.post("/completion", &req);
    assert_eq!(status, 200);
    let metrics = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    (json!({"tokens": body["tokens"], "probs": body["completion_probabilities"]}), metrics)
}

fn metric(text: &str, name: &str) -> u64 {
    let line = text.lines().find(|l| l.starts_with(&format!("strata:{name} "))).unwrap_or_else(|| panic!("no strata:{name} in\n{text}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// In decode, the rows of tokens seen to follow the token just fed are read ahead; on qwen4exp a
/// candidate's rows are new n-grams of the context, so some are read from the file. Reading ahead
/// never changes the output. (Whether it saves time needs a table larger than the row cache,
/// which these tiny models do not have.)
#[test]
fn decode_reads_likely_next_rows_ahead_and_keeps_the_output() {
    let m = model(QWEN4EXP);
    let req = json!({"prompt": "The lighthouse keeper counted the ships", "n_predict": 300, "temperature": 0.0, "ignore_eos": true,
                     "return_tokens": true, "cache_prompt": false});
    let mut outs = Vec::new();
    for mode in ["ram", "ssd"] {
        let s = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1", "--metrics", "--ple-mode", mode], &[]);
        let (status, body) = s.post("/completion", &req);
        assert_eq!(status, 200, "{body}");
        outs.push(body["tokens"].clone());
        if mode == "ssd" {
            let metrics = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
            let (read, used) = (metric(&metrics, "ple_rows_successor_prefetched_total"), metric(&metrics, "ple_rows_successor_used_total"));
            assert!(read > 0 && used <= read, "{metrics}");
        }
    }
    assert_eq!(outs[0], outs[1], "the same tokens with the table in RAM and read from the file");
}

#[test]
fn rows_read_from_the_file_give_the_in_ram_tokens_and_probabilities_exactly() {
    same_as_ram(MODEL);
}

#[test]
fn gemma3n_rows_read_from_the_file_match_too() {
    same_as_ram(GEMMA3N);
}

#[test]
fn qwen4exp_head_rows_read_from_the_file_match_too() {
    same_as_ram(QWEN4EXP);
}

fn same_as_ram(name: &str) {
    let (ram, ram_metrics) = run(name, &["--ple-mode", "ram"], &[]);
    assert_eq!(ram["tokens"].as_array().unwrap().len(), 24, "{ram}");
    assert!(!ram_metrics.contains("strata:ple_"), "no rows are served from the file in ram mode");
    for (extra, env) in [
        (vec!["--ple-mode", "ssd"], vec![]),
        (vec!["--ple-mode", "ssd", "--ple-cache-mib", "0"], vec![("STRATA_IO_THREADS", "1")]),
        (vec!["--ple-mode", "mmap"], vec![]),
    ] {
        let (got, metrics) = run(name, &extra, &env);
        assert_eq!(got, ram, "{name} {extra:?} {env:?}: tokens or probabilities differ from the table in RAM");
        if extra[1] == "ssd" {
            assert!(metric(&metrics, "ple_rows_total") > 0, "{metrics}");
            assert!(metric(&metrics, "ple_reads_total") > 0, "{metrics}");
            assert_eq!(metric(&metrics, "ple_fallbacks_total"), 0, "{metrics}");
            let cached = metric(&metrics, "ple_rows_cached_total");
            let prefetched = metric(&metrics, "ple_rows_prefetched_total");
            if extra.contains(&"0") {
                assert_eq!(cached, 0, "a zero-byte cache keeps nothing: {metrics}");
                assert_eq!(prefetched, 0, "nothing to prefetch into: {metrics}");
            } else {
                assert!(cached > 0, "the second request's rows come from the cache: {metrics}");
                // gemma4's rows are its tokens; qwen4exp's are hashed n-grams of them, computed
                // on the host as llama.cpp does: either way the prompt's batches use what was read
                let used = metric(&metrics, "ple_rows_prefetch_used_total");
                assert!(prefetched > 0 && used == prefetched, "{name}: every prefetched row is used: {metrics}");
            }
        } else {
            assert!(!metrics.contains("strata:ple_"));
        }
    }
}

#[test]
fn bad_ple_inputs_get_clear_errors() {
    let out = run_server(&["-m", model("tiny-llama.gguf").to_str().unwrap(), "--port", "0", "--ple-mode", "ssd"], &[]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("--ple-mode ssd") && out.stderr.contains("no per-layer embedding table"), "{}", out.stderr);

    let out = run_server(&["-m", model(MODEL).to_str().unwrap(), "--port", "0", "--ple-mode", "disk"], &[]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("\"--ple-mode\": invalid value 'disk'"), "{}", out.stderr);

    let out = run_server(&["-m", model(MODEL).to_str().unwrap(), "--port", "0", "--ple-mode", "ssd"], &[("STRATA_IO_THREADS", "lots")]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("STRATA_IO_THREADS: invalid value 'lots'"), "{}", out.stderr);

    // the file ends inside the table
    let dir = tmp("truncated");
    let src = std::fs::read(model(MODEL)).unwrap();
    let info = strata_residency::gguf::parse_header(&src, src.len() as u64).unwrap();
    let table = strata_residency::ple::PleTable::find(&info).unwrap().unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &src[..(table.offset + table.row_bytes) as usize]).unwrap();
    let out = run_server(&["-m", cut.to_str().unwrap(), "--port", "0", "--ple-mode", "ssd"], &[]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("truncated"), "{}", out.stderr);
}

/// The model file cut short under a running server (a download replacing it, a failing disk):
/// the rows a batch needs can be read neither directly nor by the buffered retry, so that
/// request fails with llama-server's compute-error shape (never a read through the mapping,
/// which would kill the process), the server goes on serving, and once the file is whole again
/// the same request gives the same output.
#[test]
fn rows_that_cannot_be_read_fail_the_request_and_the_server_goes_on() {
    let dir = tmp("cut-live");
    let path = dir.join("model.gguf");
    let src = std::fs::read(model(MODEL)).unwrap();
    std::fs::write(&path, &src).unwrap();
    let info = strata_residency::gguf::parse_header(&src, src.len() as u64).unwrap();
    let table = strata_residency::ple::PleTable::find(&info).unwrap().unwrap();
    // --load-mode none: every other tensor is read into RAM, the lazy table alone stays in the file; no row
    // cache, so every batch reads its rows.
    let args = ["-m", path.to_str().unwrap(), "-c", "512", "-np", "1", "--metrics", "--load-mode", "none", "--ple-mode", "ssd", "--ple-cache-mib", "0"];
    let s = Server::start(&args, &[]);
    let req = json!({"prompt": "The lighthouse keeper counted the ships", "n_predict": 8, "temperature": 0.0, "return_tokens": true, "cache_prompt": false});
    let (status, whole) = s.post("/completion", &req);
    assert_eq!(status, 200, "{whole}");

    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(table.offset + table.row_bytes).unwrap();
    let (status, body) = s.post("/completion", &req);
    assert_eq!(status, 500, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.starts_with("Compute error: could not read the model's per-layer embedding rows"), "{body}");
    assert_eq!(body["error"]["type"], "server_error", "{body}");
    let health = ureq::get(&format!("{}/health", s.base)).call().unwrap();
    assert_eq!(health.status(), 200);
    let metrics = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    assert!(metric(&metrics, "ple_read_failures_total") >= 1 && metric(&metrics, "ple_fallbacks_total") >= 1, "{metrics}");

    std::fs::write(&path, &src).unwrap();
    let (status, again) = s.post("/completion", &req);
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["tokens"], whole["tokens"], "the same tokens once the file is whole again");
}
