//! The engine through HTTP: streaming, stop strings, prompt reuse, parallel slots, cancellation.

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::{model, Server};

fn gemma(extra: &[&str]) -> Server {
    let m = model("gemma3-270m-q4_k_m.gguf");
    let mut args = vec!["-m", m.to_str().unwrap(), "-c", "2048"];
    args.extend_from_slice(extra);
    Server::start(&args, &[])
}

fn greedy(prompt: &str, n: usize) -> Value {
    json!({"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": true})
}

#[test]
fn streaming_sends_the_same_text_as_one_response() {
    let server = gemma(&[]);
    let (status, whole) = server.post("/completion", &greedy("The capital of France is", 16));
    assert_eq!(status, 200, "{whole}");
    let mut req = greedy("The capital of France is", 16);
    req["stream"] = json!(true);
    let chunks = server.post_stream("/completion", &req);
    let last = chunks.last().unwrap();
    assert_eq!(last["stop"], true);
    assert_eq!(last["stop_type"], "limit");
    assert_eq!(last["timings"]["predicted_n"], 16);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["stop"] == false));
    let text: String = chunks.iter().map(|c| c["content"].as_str().unwrap()).collect();
    assert_eq!(text, whole["content"].as_str().unwrap());
}

#[test]
fn a_stop_string_ends_generation_before_it() {
    let server = gemma(&[]);
    let (_, whole) = server.post("/completion", &greedy("The capital of France is", 24));
    let content = whole["content"].as_str().unwrap().to_string();
    let word = content.split_whitespace().nth(2).expect("three words").to_string();
    let mut req = greedy("The capital of France is", 24);
    req["stop"] = json!([word]);
    let (_, cut) = server.post("/completion", &req);
    assert_eq!(cut["stop_type"], "word", "{cut}");
    assert_eq!(cut["stopping_word"], word.as_str());
    assert_eq!(cut["content"].as_str().unwrap(), &content[..content.find(&word).unwrap()]);
}

#[test]
fn a_repeated_prompt_reuses_the_slot_cache() {
    let m = model("tiny-qwen3moe.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1"], &[]);
    let req = greedy("Once upon a time, in a quiet village by the sea, there lived", 4);
    let (_, first) = server.post("/completion", &req);
    let (_, second) = server.post("/completion", &req);
    let n_prompt = first["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(first["timings"]["cache_n"], 0);
    assert_eq!(second["timings"]["cache_n"].as_u64().unwrap(), n_prompt - 1, "{second}");
    assert_eq!(second["timings"]["prompt_n"], 1);
    assert_eq!(first["tokens"], second["tokens"]);
    let mut nocache = req.clone();
    nocache["cache_prompt"] = json!(false);
    let (_, third) = server.post("/completion", &nocache);
    assert_eq!(third["timings"]["cache_n"], 0);
    assert_eq!(third["tokens"], first["tokens"]);
}

/// With one unified KV cache, starting a task moves the idle slots' prompts to host RAM; a
/// prompt that comes back is restored from there instead of recomputed, with the same tokens.
#[test]
fn an_evicted_prompt_comes_back_from_the_ram_cache() {
    let m = model("tiny-qwen3moe.gguf");
    let args = ["-m", m.to_str().unwrap(), "-c", "1024", "-np", "2", "-kvu", "--cache-ram", "64"];
    let server = Server::start(&args, &[]);
    let mut long = greedy("Once upon a time, in a quiet village by the sea, there lived an old fisherman", 4);
    long["id_slot"] = json!(0);
    let (_, first) = server.post("/completion", &long);
    let mut other = greedy("The quick brown fox", 4);
    other["id_slot"] = json!(1);
    server.post("/completion", &other);
    long.as_object_mut().unwrap().remove("id_slot");
    let (_, again) = server.post("/completion", &long);
    let n_prompt = first["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(again["timings"]["cache_n"].as_u64().unwrap(), n_prompt - 1, "{again}");
    assert_eq!(again["tokens"], first["tokens"]);

    let off = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "2", "-kvu", "--cache-ram", "0"], &[]);
    long["id_slot"] = json!(0);
    off.post("/completion", &long);
    other["id_slot"] = json!(1);
    off.post("/completion", &other);
    long.as_object_mut().unwrap().remove("id_slot");
    let (_, lru) = off.post("/completion", &long);
    assert_eq!(lru["timings"]["cache_n"].as_u64().unwrap(), n_prompt - 1, "without the RAM cache slot 0 kept its KV");
}

/// Speculative decoding never changes greedy output: a draft the model always rejects (a
/// 3-bit copy of random weights) and one it always accepts (the model itself) both give the
/// tokens of plain decoding, and the timings count the drafts.
#[test]
fn speculative_decoding_keeps_greedy_output() {
    let m = model("tiny-qwen3moe.gguf");
    let req = json!({"prompt": "I believe the meaning of life is", "n_predict": 24, "temperature": 0, "return_tokens": true});
    let plain = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1"], &[]);
    let (_, want) = plain.post("/completion", &req);
    assert!(want["timings"].get("draft_n").is_none(), "{want}");
    drop(plain);
    for (draft, all_accepted) in [("tiny-qwen3moe-iq3.gguf", false), ("tiny-qwen3moe.gguf", true)] {
        let d = model(draft);
        let args = [
            "-m",
            m.to_str().unwrap(),
            "-c",
            "1024",
            "-np",
            "1",
            "--spec-type",
            "draft-simple",
            "--model-draft",
            d.to_str().unwrap(),
            "--spec-draft-n-max",
            "6",
        ];
        let server = Server::start(&args, &[]);
        // with a drafter the prompt cache is off, which start-up says; it does not blame
        // --cache-idle-slots on a missing --cache-ram the user never left out
        let log = server.log.lock().unwrap().clone();
        assert!(log.contains("prompt cache (--cache-ram) is off with a draft model") && !log.contains("--cache-idle-slots requires --cache-ram"), "{log}");
        let (_, got) = server.post("/completion", &req);
        assert_eq!(got["tokens"], want["tokens"], "draft {draft}");
        let (drafted, accepted) = (got["timings"]["draft_n"].as_u64().unwrap(), got["timings"]["draft_n_accepted"].as_u64().unwrap());
        assert!(drafted > 0, "{got}");
        assert_eq!(accepted == drafted, all_accepted, "draft {draft}: {accepted}/{drafted}");
        let stream_text =
            server.post_stream("/completion", &json!({"prompt": "I believe the meaning of life is", "n_predict": 24, "temperature": 0, "stream": true}));
        let text: String = stream_text.iter().filter_map(|c| c["content"].as_str()).collect();
        assert_eq!(text, got["content"].as_str().unwrap(), "streamed speculative text");
    }

    // A draft model with no --spec-type gives no drafter: llama-server loads it and serves
    // without speculative decoding; so does strata-server.
    let args = ["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1", "-md", m.to_str().unwrap(), "--spec-draft-n-max", "3"];
    let server = Server::start(&args, &[]);
    let (_, got) = server.post("/completion", &req);
    assert_eq!(got["tokens"], want["tokens"], "-md without --spec-type");
    assert!(got["timings"].get("draft_n").is_none(), "{got}");
}

/// --cache-reuse: when a chunk is cut out of the middle of a cached prompt, the tail after it is
/// moved into place by KV shifting instead of recomputed; n_cache_reuse = 0 in the request
/// turns that off.
#[test]
fn cache_reuse_shifts_a_shared_tail_into_place() {
    let m = model("tiny-qwen3moe.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1", "--cache-ram", "0", "--cache-reuse", "4"], &[]);
    let head = "The history of the old lighthouse on the northern cape is long and strange. ";
    let tail = "Every night the keeper climbed the spiral stairs, trimmed the wick, and watched the dark sea until dawn.";
    let full = greedy(&format!("{head}It was built in 1820 by a merchant. {tail}"), 2);
    let cut = greedy(&format!("{head}{tail}"), 2);
    let (_, head_only) = server.post("/tokenize", &json!({"content": head, "add_special": true}));
    let n_head = head_only["tokens"].as_array().unwrap().len() as u64;

    server.post("/completion", &full);
    let (_, reused) = server.post("/completion", &cut);
    let n_prompt = reused["tokens_evaluated"].as_u64().unwrap();
    assert_eq!(reused["timings"]["cache_n"].as_u64().unwrap(), n_prompt - 1, "{reused}");

    server.post("/completion", &full);
    let mut off = cut.clone();
    off["n_cache_reuse"] = json!(0);
    let (_, plain) = server.post("/completion", &off);
    let cache_n = plain["timings"]["cache_n"].as_u64().unwrap();
    assert!(cache_n <= n_head && cache_n + 2 >= n_head, "only the common prefix: {cache_n} vs {n_head}");

    let mut bad = cut.clone();
    bad["n_cache_reuse"] = json!(-2);
    let (status, err) = server.post("/completion", &bad);
    assert_eq!(status, 400, "{err}");
}

/// LoRA adapters: the global scale (/lora-adapters) and per-request scales give the same tokens
/// for the same scales, scale 0 is the base model, and requests with different scales running
/// at once each get their own (they never share a batch).
#[test]
fn lora_scales_global_and_per_request() {
    let m = model("tiny-llama.gguf");
    let lora = model("tiny-llama-lora.gguf");
    let req = json!({"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "return_tokens": true});
    let base = Server::start(&["-m", m.to_str().unwrap(), "-np", "1"], &[]);
    let (_, plain) = base.post("/completion", &req);
    drop(base);

    let server = Server::start(&["-m", m.to_str().unwrap(), "-np", "2", "--lora", lora.to_str().unwrap()], &[]);
    let (_, list) = server.get("/lora-adapters");
    assert_eq!(list[0]["id"], 0);
    assert_eq!(list[0]["scale"], 1.0);
    assert!(list[0]["path"].as_str().unwrap().ends_with("tiny-llama-lora.gguf"), "{list}");
    let (_, on) = server.post("/completion", &req);
    assert_ne!(on["tokens"], plain["tokens"], "the adapter changes greedy output");
    let (status, ok) = server.post("/lora-adapters", &json!([{"id": 0, "scale": 0.0}]));
    assert_eq!((status, ok), (200, json!({"success": true})));
    let (_, off) = server.post("/completion", &req);
    assert_eq!(off["tokens"], plain["tokens"], "scale 0 is the base model");

    let with = |scale: f64| {
        let mut r = req.clone();
        r["lora"] = json!([{"id": 0, "scale": scale}]);
        r
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| server.post("/completion", &with(1.0)).1);
        let b = s.spawn(|| server.post("/completion", &with(0.0)).1);
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a["tokens"], on["tokens"]);
    assert_eq!(b["tokens"], plain["tokens"]);

    let mut bad = req.clone();
    bad["lora"] = json!({"id": 0});
    assert_eq!(server.post("/completion", &bad).0, 400);
    assert_eq!(server.post("/lora-adapters", &json!({"id": 0})).0, 400);
}

/// An activated LoRA (aLoRA) applies from the last occurrence of its invocation tokens on: a
/// prompt without them runs on the base model, the prompt before them is decoded without the
/// adapter (so a plain prompt's cache serves it), and only one aLoRA runs per request.
#[test]
fn alora_applies_from_its_invocation_on() {
    let m = model("tiny-llama.gguf");
    let alora = model("tiny-llama-alora.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "-np", "1", "--lora", alora.to_str().unwrap(), "--lora", alora.to_str().unwrap()], &[]);
    let (_, list) = server.get("/lora-adapters");
    assert_eq!(list[0]["alora_invocation_tokens"], json!([2538, 2818, 1286, 29901]), "{list}");
    assert_eq!(list[0]["alora_invocation_string"], " Respond now:");
    let req = |prompt: &str, scales: [f64; 2], cache: bool| {
        json!({"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": true, "cache_prompt": cache,
               "lora": [{"id": 0, "scale": scales[0]}, {"id": 1, "scale": scales[1]}]})
    };
    let head = "Once upon a time there was a little girl who lived in a village near the forest.";
    let invoked = format!("{head} Respond now:");

    let (_, base) = server.post("/completion", &req(head, [0.0, 0.0], false));
    let (_, absent) = server.post("/completion", &req(head, [1.0, 0.0], false));
    assert_eq!(absent["tokens"], base["tokens"], "without its invocation the aLoRA is off");

    let (_, fresh) = server.post("/completion", &req(&invoked, [1.0, 0.0], false));
    let (_, plain) = server.post("/completion", &req(&invoked, [0.0, 0.0], false));
    assert_ne!(fresh["tokens"], plain["tokens"], "the invoked adapter changes greedy output");

    server.post("/completion", &req(head, [0.0, 0.0], true));
    let (_, reused) = server.post("/completion", &req(&invoked, [1.0, 0.0], true));
    assert!(reused["timings"]["cache_n"].as_u64().unwrap() > 0, "the plain prompt's cache serves the aLoRA: {}", reused["timings"]);
    assert_eq!(reused["tokens"], fresh["tokens"]);

    let (status, err) = server.post("/completion", &req(&invoked, [1.0, 1.0], true));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["message"], "Cannot run multiple aLoRAs in a single request");
}

/// Gemma 3 has sliding-window attention: a cached prefix is usable while the window before its
/// end is still in the cache, else from a context checkpoint, else the prompt is processed
/// again; each way gives the tokens of a fresh prompt.
#[test]
fn a_sliding_window_model_reuses_only_what_its_window_still_holds() {
    let server = gemma(&["-np", "1", "-c", "4096", "--cache-ram", "0"]);
    let req = greedy("Once upon a time, in a quiet village by the sea, there lived", 8);
    let (_, first) = server.post("/completion", &req);
    let (_, second) = server.post("/completion", &req);
    let n_prompt = first["tokens_evaluated"].as_u64().unwrap();
    // as llama-server: a repeated prompt resumes from the checkpoint before its last 4 tokens,
    // which it trusts up to the position before that checkpoint's end
    assert_eq!(second["timings"]["cache_n"].as_u64().unwrap(), n_prompt - 5);
    assert_eq!(first["tokens"], second["tokens"]);

    // far past Gemma 3's 512-token window: a prefix that ends long before the cache does has
    // lost its window, one that continues the cache has not
    let long: String = (0..160).map(|i| format!("Line {i} of the ledger lists a barrel of apples. ")).collect();
    let (_, base) = server.post("/completion", &greedy(&long, 4));
    let n_long = base["tokens_evaluated"].as_u64().unwrap();
    assert!(n_long > 1500, "{n_long}");
    let continued = format!("{long}{}", base["content"].as_str().unwrap());
    let (_, cont) = server.post("/completion", &greedy(&format!("{continued} And then"), 4));
    assert!(cont["timings"]["cache_n"].as_u64().unwrap() >= n_long, "{}", cont["timings"]);
    let head: String = long[..long.len() / 2].to_string();
    let (_, cut) = server.post("/completion", &greedy(&format!("{head} Something else."), 4));
    assert_eq!(cut["timings"]["cache_n"], 0, "the window for a prefix that short is gone");

    // reprocessed in full, the prompt gives exactly what a fresh server gives
    let fresh = gemma(&["-np", "1", "-c", "4096", "--cache-ram", "0"]);
    let (_, want) = fresh.post("/completion", &greedy(&format!("{head} Something else."), 4));
    assert_eq!(cut["tokens"], want["tokens"]);

    // a prefix ending just past the checkpoint taken 4 + n_ubatch tokens before the end of the
    // prompt: the window has moved on, the checkpoint still holds it
    server.post("/completion", &greedy(&long, 4));
    let (_, toks) = server.post("/tokenize", &json!({"content": long, "add_special": true}));
    let toks = toks["tokens"].as_array().unwrap();
    let n_ckpt = toks.len() - 4 - 512;
    let mut branch: Vec<Value> = toks[..n_ckpt + 2].to_vec();
    branch.extend([json!(1437), json!(603), json!(1037)]);
    let req = json!({"prompt": branch, "n_predict": 4, "temperature": 0, "return_tokens": true});
    let (_, restored) = server.post("/completion", &req);
    assert_eq!(restored["timings"]["cache_n"], n_ckpt - 1, "{}", restored["timings"]);
    let (_, want) = fresh.post("/completion", &req);
    assert_eq!(restored["tokens"], want["tokens"]);
}

#[test]
fn parallel_requests_share_the_batch_and_all_finish() {
    let server = gemma(&["-np", "4"]);
    let prompts = ["The capital of France is", "Water boils at", "My favourite colour is", "In 1969, humans"];
    let results: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| server.post("/completion", &greedy(p, 24)).1)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let slots: std::collections::BTreeSet<u64> = results.iter().map(|r| r["id_slot"].as_u64().unwrap()).collect();
    assert_eq!(slots.len(), 4, "each request should get its own slot: {results:?}");
    for r in &results {
        assert_eq!(r["tokens_predicted"], 24, "{r}");
        assert!(!r["content"].as_str().unwrap().is_empty());
    }
}

#[test]
fn a_client_that_disconnects_frees_its_slot() {
    let server = gemma(&["-np", "1"]);
    let mut req = greedy("Count from one to a thousand:", 1500);
    req["stream"] = json!(true);
    let res = ureq::post(&format!("{}/completion", server.base)).send_json(req).unwrap();
    let mut lines = BufReader::new(res.into_reader()).lines();
    let first = lines.find(|l| l.as_ref().is_ok_and(|l| l.starts_with("data: ")));
    assert!(first.is_some());
    drop(lines);
    std::thread::sleep(Duration::from_millis(200));
    let (status, body) = server.post("/completion", &greedy("Hello", 4));
    assert_eq!(status, 200, "the only slot must be free again: {body}");
    assert_eq!(body["tokens_predicted"], 4);
}

/// Waits until the server's own gauge of tasks waiting for a slot reads `n`, so the steps below
/// follow the server's state, not the clock of a loaded machine.
fn wait_deferred(server: &Server, n: u64) {
    let url = format!("{}/metrics", server.base);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        let text = ureq::get(&url).call().unwrap().into_string().unwrap();
        last = text.lines().find(|l| l.starts_with("llamacpp:requests_deferred ")).unwrap_or_default().to_string();
        if last.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()) == Some(n as f64) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("requests_deferred never reached {n}: {last}");
}

#[test]
fn past_max_queued_a_request_gets_503_and_a_gone_client_leaves_the_queue() {
    let server = gemma(&["-np", "1", "--max-queued", "1", "--metrics", "-c", "8192"]);
    // A holds the only slot until its client goes: no end of text, more tokens than the test lasts.
    let mut a = greedy("Count from one to a thousand:", 8000);
    a["stream"] = json!(true);
    a["ignore_eos"] = json!(true);
    let res = ureq::post(&format!("{}/completion", server.base)).send_json(a).unwrap();
    let mut a_lines = BufReader::new(res.into_reader()).lines();
    assert!(a_lines.find(|l| l.as_ref().is_ok_and(|l| l.starts_with("data: "))).is_some());

    // B queues, then its client goes away before B reaches a slot: B must leave the queue.
    let addr = server.base.trim_start_matches("http://").to_string();
    let body = greedy("Hello", 4).to_string();
    let mut b = std::net::TcpStream::connect(&addr).unwrap();
    write!(b, "POST /completion HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    wait_deferred(&server, 1);
    drop(b);
    wait_deferred(&server, 0);

    // C takes the one place in the queue that B left.
    let c_url = format!("{}/completion", server.base);
    let c = std::thread::spawn(move || match ureq::post(&c_url).send_json(greedy("Hello", 4)) {
        Ok(r) => (200, r.into_json::<Value>().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json::<Value>().unwrap_or_default()),
        Err(e) => panic!("{e}"),
    });
    wait_deferred(&server, 1);

    // D finds the queue full.
    match ureq::post(&format!("{}/completion", server.base)).send_json(greedy("Hi", 4)) {
        Err(ureq::Error::Status(503, r)) => {
            assert_eq!(r.header("Retry-After"), Some("1"));
            let e: Value = r.into_json().unwrap();
            assert_eq!(e["error"]["code"], 503, "{e}");
            assert_eq!(e["error"]["type"], "unavailable_error", "{e}");
            assert!(e["error"]["message"].as_str().unwrap().contains("--max-queued 1"), "{e}");
        }
        other => panic!("expected 503 while C waits: {:?}", other.map(|r| r.status())),
    }

    drop(a_lines);
    let (status, c) = c.join().unwrap();
    assert_eq!(status, 200, "C must have been queued, not refused (B's place was not given back?): {c}");
    assert_eq!(c["tokens_predicted"], 4);
    // and the queue is open again
    let (status, _) = server.post("/completion", &greedy("Hi", 2));
    assert_eq!(status, 200);
}

#[test]
fn chat_completions_stream_and_choices() {
    let server = gemma(&["-np", "2"]);
    let msgs = json!([{"role": "user", "content": "Name a colour."}]);
    // no prompt reuse: a prompt decoded in one batch and one decoded on top of a cached prefix
    // differ by rounding, enough to flip this small Q4 model's greedy choice
    let req = json!({"messages": msgs, "max_tokens": 8, "temperature": 0.0, "logprobs": true, "top_logprobs": 3, "cache_prompt": false});
    let (status, whole) = server.post("/v1/chat/completions", &req);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let lp = &whole["choices"][0]["logprobs"]["content"];
    assert_eq!(lp.as_array().unwrap().len(), 8, "{whole}");
    assert_eq!(lp[0]["top_logprobs"].as_array().unwrap().len(), 3);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let chunks = server.post_stream("/v1/chat/completions", &sreq);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 8);

    let mut nreq = req.clone();
    nreq["n"] = json!(2);
    let (_, two) = server.post("/v1/chat/completions", &nreq);
    let choices = two["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_eq!(choices[0]["message"]["content"], choices[1]["message"]["content"], "greedy choices agree");
}

#[test]
fn slots_save_erase_restore_and_no_path_escapes() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("slot-save");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let save_path = format!("{}/", dir.display());
    let m = model("tiny-qwen3moe.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "-c", "1024", "-np", "1", "--slot-save-path", &save_path], &[]);
    let req = greedy("The quick brown fox jumps over the lazy dog", 4);
    let (_, first) = server.post("/completion", &req);
    let (s, saved) = server.post("/slots/0?action=save", &json!({"filename": "fox.bin"}));
    assert_eq!(s, 200, "{saved}");
    assert!(saved["n_saved"].as_u64().unwrap() > 0);
    assert!(dir.join("fox.bin").is_file());
    let (_, erased) = server.post("/slots/0?action=erase", &json!({}));
    assert_eq!(erased["n_erased"], saved["n_saved"]);
    let (_, restored) = server.post("/slots/0?action=restore", &json!({"filename": "fox.bin"}));
    assert_eq!(restored["n_restored"], saved["n_saved"], "{restored}");
    let (_, again) = server.post("/completion", &req);
    assert!(again["timings"]["cache_n"].as_u64().unwrap() > 0, "the restored cache is used: {again}");
    assert_eq!(again["tokens"], first["tokens"]);

    for bad in ["../escape.bin", "/etc/passwd", "a/b.bin"] {
        let (s, body) = server.post("/slots/0?action=save", &json!({"filename": bad}));
        assert_eq!(s, 400, "{bad}: {body}");
        assert_eq!(body["error"]["message"], "Invalid filename");
    }
    let (s, _) = server.post("/slots/0?action=restore", &json!({"filename": "missing.bin"}));
    assert_eq!(s, 400);
    // as llama-server's get_slot_by_id, an id past the last slot wraps around
    let (s, body) = server.post("/slots/7?action=erase", &json!({}));
    assert_eq!((s, &body["id_slot"]), (200, &json!(7)), "{body}");
    let (s, _) = server.post("/slots/x?action=erase", &json!({}));
    assert_eq!(s, 400);
    let (s, _) = server.post("/slots/0?action=dance", &json!({}));
    assert_eq!(s, 400);
}

#[test]
fn sleep_idle_seconds_frees_the_context_and_a_request_wakes_it() {
    let m = model("tiny-llama.gguf");
    let server = Server::start(&["-m", m.to_str().unwrap(), "--sleep-idle-seconds", "1"], &[]);
    let t0 = std::time::Instant::now();
    while server.get("/props").1["is_sleeping"] != true {
        assert!(t0.elapsed() < Duration::from_secs(10), "the server did not go to sleep");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(server.get("/health").0, 200);
    assert_eq!(server.get("/props").1["is_sleeping"], true, "read-only routes do not wake it");
    let (status, body) = server.post("/completion", &json!({"prompt": "Hello", "n_predict": 2}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.get("/props").1["is_sleeping"], false);

    while server.get("/props").1["is_sleeping"] != true {
        assert!(t0.elapsed() < Duration::from_secs(20), "the server did not go back to sleep");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, _) = server.post("/tokenize", &json!({"content": "Hello"}));
    assert_eq!(status, 200);
    assert_eq!(server.get("/props").1["is_sleeping"], false, "tokenizing wakes it, as upstream");
}

#[test]
fn context_shift_keeps_generating_past_a_full_context() {
    let m = model("tiny-llama.gguf");
    let args = ["-m", m.to_str().unwrap(), "-c", "256", "-np", "1", "--context-shift"];
    let server = Server::start(&args, &[]);
    let (status, body) = server.post("/completion", &json!({"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": true}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["timings"]["predicted_n"], 400, "{body}");
    assert_eq!(body["truncated"], true);
    assert!(server.log.lock().unwrap().contains("slot context shift, n_keep = "));

    let plain = Server::start(&["-m", m.to_str().unwrap(), "-c", "256", "-np", "1"], &[]);
    let (_, body) = plain.post("/completion", &json!({"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": true}));
    assert_eq!(body["truncated"], true);
    assert!(body["timings"]["predicted_n"].as_u64().unwrap() < 256, "{body}");
}

/// A token that ends inside a UTF-8 character gets no probabilities entry and no stream chunk of
/// its own: as in llama-server, the next token's entry carries its bytes.
#[test]
fn tokens_inside_a_utf8_character_report_with_the_next_one() {
    let m = model("tiny-qwen3moe-iq3.gguf");
    let s = Server::start(&["-m", m.to_str().unwrap(), "-c", "2048"], &[]);
    // With this prompt the model writes a token ending in the first two bytes of a 3-byte character.
    let src = std::fs::read(std::path::Path::new(strata_ffi::LLAMA_SRC_DIR).join("src/llama-batch.h")).unwrap();
    let prompt = String::from_utf8_lossy(&src[..3000]).into_owned();
    let body = json!({"prompt": prompt, "n_predict": 128, "temperature": 0, "n_probs": 2, "ignore_eos": true,
                      "return_tokens": true, "cache_prompt": false});
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    let probs = v["completion_probabilities"].as_array().unwrap();
    let n_tokens = v["tokens"].as_array().unwrap().len();
    assert!(probs.len() < n_tokens, "no token was held back ({} entries, {n_tokens} tokens): the test needs another prompt", probs.len());
    let mut all = Vec::new();
    for p in probs {
        let bytes: Vec<u8> = p["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        let tail = std::str::from_utf8(&bytes).err().and_then(|e| e.error_len().is_none().then_some(e.valid_up_to()));
        assert!(tail.is_none(), "entry {p} ends inside a UTF-8 character");
        all.extend(bytes);
    }
    assert_eq!(String::from_utf8_lossy(&all), v["content"].as_str().unwrap());

    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let chunks = s.post_stream("/completion", &stream);
    let partials = chunks.iter().filter(|c| c["stop"] == false).count();
    assert_eq!(partials, probs.len(), "one stream chunk per reported token");
}
