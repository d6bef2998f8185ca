//! The expert tiers under conditions a single request does not reach: several slots decoding at
//! once, the prefill ring's copier failing, a context made again and again (sleep and wake).

use serde_json::json;

use crate::experts::{assert_same, counter, generate, guard_root, layer_totals, record_profile, tmp, unsplit, LONG, MODEL, SHORT};
use crate::support::{model, Server};

/// Four slots decoding at once: llama.cpp splits a step's batch into several decode-sized
/// ubatches (one per run of consecutive sequences), each of which writes the zero-copy routing
/// log; every one is counted, so each layer's selections equal those of the same requests
/// served one at a time.
#[test]
fn several_slots_count_every_selection() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let dir = tmp("slots-counts");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    let requests: [(&str, u64); 4] = [(LONG, 24), (SHORT, 6), ("Once upon a time there was a lighthouse", 20), ("The river", 9)];
    let run = |np: &str, concurrent: bool| {
        let out = dir.join(format!("np{np}.json"));
        let args = [
            "-m",
            m,
            "-c",
            "4096",
            "-np",
            np,
            "--resident-cpu-experts",
            "--expert-profile",
            profile.to_str().unwrap(),
            "--expert-cache",
            "24",
            "--expert-profile-out",
            out.to_str().unwrap(),
        ];
        let s = Server::start(&args, &[("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "zero-copy")]);
        let ask = |(prompt, n): (&str, u64)| {
            let body = json!({"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": false, "ignore_eos": true});
            let (status, v) = s.post("/completion", &body);
            assert_eq!(status, 200, "{v}");
            v["tokens_predicted"].as_u64().unwrap()
        };
        let predicted: Vec<u64> = if concurrent {
            std::thread::scope(|sc| requests.map(|r| sc.spawn(move || ask(r))).into_iter().map(|h| h.join().unwrap()).collect())
        } else {
            requests.iter().map(|&r| ask(r)).collect()
        };
        assert_eq!(predicted, requests.map(|r| r.1));
        drop(s);
        layer_totals(&out)
    };
    let one_at_a_time = run("1", false);
    let together = run("4", true);
    assert_eq!(one_at_a_time.len(), 4);
    assert_eq!(together, one_at_a_time, "selections per layer, four slots at once vs one at a time");
}

/// The prefill ring's copier failing (STRATA_LAB=ring-fault): a copy that fails, or a copier
/// thread that dies, ends the request whose prompt batch needed the copies with llama.cpp's
/// error and the server goes on serving the unsplit model's output (another copier started);
/// a copier that cannot start leaves the copies to the graph's own thread, said at start-up.
#[test]
fn a_failed_ring_copy_fails_the_request_and_the_server_goes_on() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(m);
    let args = ["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30"];
    for fault in ["copy:1", "die:1", "no-thread"] {
        let lab = format!("emulate-ring,ring-fault={fault}");
        let s = Server::start(&args, &[("STRATA_LAB", lab.as_str()), ("STRATA_PREFILL_RING", "32")]);
        if fault == "no-thread" {
            let log = s.log.lock().unwrap().clone();
            assert!(log.contains("copier thread could not start: fault injected") && log.contains("copies run on the thread that computes the graph"), "{log}");
        } else {
            let body = json!({"prompt": LONG, "n_predict": 8, "temperature": 0, "cache_prompt": false});
            let (status, v) = s.post("/completion", &body);
            assert_eq!(status, 500, "{fault}: {v}");
            assert_eq!(v["error"]["type"], "server_error", "{v}");
            assert_eq!(v["error"]["message"], "Compute error: the prefill ring could not copy cold experts to the device.", "{v}");
        }
        assert_same(&ref_long, &generate(&s, LONG), &format!("ring-fault={fault}: the next long prompt"));
        assert_same(&ref_short, &generate(&s, SHORT), &format!("ring-fault={fault}: a short prompt"));
        assert_same(&ref_long, &generate(&s, LONG), &format!("ring-fault={fault}: the long prompt again"));
        assert!(counter(&s, "prefill_ring_batches_total") >= 2, "{fault}: prompt batches took the ring");
        let log = s.log.lock().unwrap().clone();
        if fault.starts_with("die") {
            assert!(log.contains("prefill ring: the copier thread stopped; started another"), "{log}");
        }
    }
}

/// --sleep-idle-seconds over tiered experts: each wake makes a new context whose graphs use the
/// same tiers (the prefill ring, zero-copy decode, adaptation). 200 sleep/wake cycles keep the
/// output, and the server's memory does not grow with them.
#[test]
fn two_hundred_sleep_wake_cycles_over_the_tiers() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (_, ref_long) = unsplit(m);
    let dir = tmp("sleep-wake");
    let root = guard_root(&dir, 64 << 20);
    let args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-cache", "24", "--adapt-every", "2", "--sleep-idle-seconds", "1"];
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "emulate-ring,zero-copy"), ("STRATA_PREFILL_RING", "40")];
    let s = Server::start(&args, &env);
    let body = json!({"prompt": LONG, "n_predict": 4, "temperature": 0, "cache_prompt": false, "ignore_eos": true, "return_tokens": true});
    let want = &ref_long["tokens"].as_array().unwrap()[..4];
    let mut rss_at_10 = 0;
    for cycle in 1..=200 {
        let t0 = std::time::Instant::now();
        while s.get("/props").1["is_sleeping"] != true {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "cycle {cycle}: the server did not go to sleep");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (status, v) = s.post("/completion", &body);
        assert_eq!(status, 200, "cycle {cycle}: {v}");
        assert_eq!(v["tokens"].as_array().unwrap()[..], *want, "cycle {cycle}");
        if cycle == 10 {
            rss_at_10 = s.rss_kib();
        }
    }
    let grown = s.rss_kib().saturating_sub(rss_at_10);
    eprintln!("sleep/wake: {grown} KiB more resident after 200 cycles than after 10");
    assert!(grown < 16 << 10, "{grown} KiB more resident after 200 sleep/wake cycles than after 10");
    assert!(counter(&s, "prefill_ring_batches_total") >= 200);
}
