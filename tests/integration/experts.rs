//! Expert tiers on the CPU: the split model (hot tier in host buffers, cold experts from the
//! mapping or a RAM copy) against the unsplit one, and the errors for bad profiles and files.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::support::{model, run_server, Server};

pub(crate) const MODEL: &str = "tiny-qwen3moe-iq3.gguf";
/// Largest |difference| of a top-3 log-probability between split and unsplit runs.
const TOL: f64 = 1e-3;

pub(crate) const SHORT: &str = "The tide came in over the rocks";
/// Over 32 tokens, so that its batch takes the prompt path (the cold tier as an offloadable mul_mat_id).
pub(crate) const LONG: &str = "Write a long story about the sea and the ships that sail on it, with many details about the \
                    sailors and their lives, their food, their songs, the storms they meet and the ports they reach. \
                    Tell it as an old captain would, slowly, by the fire, to the children of the harbour town.";

pub(crate) fn generate(s: &Server, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "n_predict": 48, "temperature": 0, "n_probs": 3, "cache_prompt": false,
                      "ignore_eos": true, "return_tokens": true});
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    v
}

/// Same tokens, and top-3 log-probabilities within TOL wherever both list the same token.
pub(crate) fn assert_same(a: &Value, b: &Value, what: &str) {
    assert_eq!(a["tokens"], b["tokens"], "{what}: greedy tokens differ");
    let (pa, pb) = (a["completion_probabilities"].as_array().unwrap(), b["completion_probabilities"].as_array().unwrap());
    assert_eq!(pa.len(), pb.len(), "{what}");
    for (x, y) in pa.iter().zip(pb) {
        for (ex, ey) in x["top_logprobs"].as_array().unwrap().iter().zip(y["top_logprobs"].as_array().unwrap()) {
            if ex["id"] == ey["id"] {
                let d = (ex["logprob"].as_f64().unwrap() - ey["logprob"].as_f64().unwrap()).abs();
                assert!(d <= TOL, "{what}: log-probability differs by {d}: {ex} vs {ey}");
            }
        }
    }
}

pub(crate) fn metric(s: &Server, name: &str, tier: &str) -> u64 {
    labelled(s, name, "tier", tier)
}

fn labelled(s: &Server, name: &str, label: &str, value: &str) -> u64 {
    let text = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    let key = format!("strata:{name}{{{label}=\"{value}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).unwrap_or_else(|| panic!("no {key} in\n{text}")).parse().unwrap()
}

/// The unsplit model's answers to SHORT and LONG, without repacking, as the split runs keep
/// every expert in GGUF layout.
pub(crate) fn unsplit(m: &str) -> (Value, Value) {
    let reference = Server::start(&["-m", m, "-c", "2048", "--no-repack"], &[]);
    (generate(&reference, SHORT), generate(&reference, LONG))
}

/// A cgroup-v2 fixture root for the memory guard: no limits, `avail_kib` of MemAvailable.
pub(crate) fn guard_root(dir: &Path, avail_kib: u64) -> PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::create_dir_all(root.join("sys/fs/cgroup")).unwrap();
    std::fs::write(root.join("proc/self/cgroup"), "0::/\n").unwrap();
    std::fs::write(root.join("proc/self/mountinfo"), "30 25 0:26 / /sys/fs/cgroup rw,relatime shared:4 - cgroup2 cgroup2 rw\n").unwrap();
    std::fs::write(root.join("proc/meminfo"), format!("MemTotal: {avail_kib} kB\nMemAvailable: {avail_kib} kB\n")).unwrap();
    root
}

pub(crate) fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strata-experts-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Records a profile of MODEL with --expert-profile-out over two prompts.
pub(crate) fn record_profile(dir: &Path) -> PathBuf {
    record_profile_of(MODEL, &[], dir)
}

fn record_profile_of(name: &str, extra: &[&str], dir: &Path) -> PathBuf {
    let m = model(name);
    let out = dir.join("profile.json");
    let mut args = vec!["-m", m.to_str().unwrap(), "-c", "2048", "--expert-profile-out", out.to_str().unwrap()];
    args.extend(extra);
    let s = Server::start(&args, &[]);
    generate(&s, LONG);
    generate(&s, SHORT);
    drop(s);
    out
}

#[test]
fn split_experts_match_the_unsplit_model() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(m);

    // Decode-sized batches: cold experts from the mapping, computed by the CPU kernels.
    let mapped = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30"], &[]);
    assert_same(&ref_short, &generate(&mapped, SHORT), "mapped cold tier, short prompt");
    let long = generate(&mapped, LONG);
    assert!(long["tokens_evaluated"].as_u64().unwrap() >= 32, "{}", long["tokens_evaluated"]);
    assert_same(&ref_long, &long, "mapped cold tier, long prompt");
    assert_eq!(metric(&mapped, "experts_resident", "vram"), 30);
    assert_eq!(metric(&mapped, "experts_resident", "mmap"), 4 * 16 - 30);
    assert!(metric(&mapped, "expert_selections_total", "vram") > 0);
    assert!(metric(&mapped, "expert_selections_total", "mmap") > 0);
    let log = mapped.log.lock().unwrap().clone();
    assert!(log.contains("experts: 4 MoE layers x 16 experts; vram 30 (0.00 GiB) in host memory (no GPU), ram 0 (0.00 GiB) in a RAM copy, mmap 34"), "{log}");
    drop(mapped);

    // No hot tier: every expert through the CPU kernels; every expert hot: no cold path; nearly
    // all hot: prompt batches expect few cold selections and keep them on the CPU too.
    for (cache, what) in [("0", "all cold"), ("64", "all hot"), ("60", "nearly all hot")] {
        let s = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", cache], &[]);
        assert_same(&ref_short, &generate(&s, SHORT), &format!("{what}, short prompt"));
        assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt"));
        let served = if cache == "0" { "mmap" } else { "vram" };
        assert!(metric(&s, "expert_selections_total", served) > 0, "{what}");
    }

    // Cold experts of decode batches on a dedicated worker pool (launch, then join after the hot tier).
    let pooled = Server::start(&["-m", m, "-c", "2048", "--mmap-experts", "--expert-cache", "30", "--pool-workers", "2"], &[]);
    assert_same(&ref_short, &generate(&pooled, SHORT), "worker pool, short prompt");
    assert_same(&ref_long, &generate(&pooled, LONG), "worker pool, long prompt");
    let log = pooled.log.lock().unwrap().clone();
    assert!(log.contains("cold experts in decode on a pool of 2 workers"), "{log}");
    drop(pooled);
    // ...and prompt batches with few cold selections on the pool as well.
    let pooled = Server::start(&["-m", m, "-c", "2048", "--mmap-experts", "--expert-cache", "60", "--pool-workers", "2"], &[]);
    assert_same(&ref_long, &generate(&pooled, LONG), "worker pool, nearly all hot, long prompt");
    drop(pooled);

    // --pcie-frac: half of each decode step's misses go to the staging slots, the rest to the pool.
    let uploading =
        Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30", "--pool-workers", "2", "--pcie-frac", "0.5"], &[]);
    assert_same(&ref_short, &generate(&uploading, SHORT), "uploading half the misses, short prompt");
    assert_same(&ref_long, &generate(&uploading, LONG), "uploading half the misses, long prompt");
    let text = ureq::get(&format!("{}/metrics", uploading.base)).call().unwrap().into_string().unwrap();
    let uploads: u64 = text.lines().find_map(|l| l.strip_prefix("strata:expert_uploads_total ")).expect("uploads metric").parse().unwrap();
    assert!(uploads > 0 && uploads < metric(&uploading, "expert_selections_total", "mmap"), "{text}");
    drop(uploading);

    // The graph GPUs get: one expert per mul_mat_id column, as the pad and stand-in ids repeat.
    let flat = Server::start(&["-m", m, "-c", "2048", "--mmap-experts", "--expert-cache", "30"], &[("STRATA_LAB", "flat-ids")]);
    assert_same(&ref_short, &generate(&flat, SHORT), "one expert per column, short prompt");
    assert_same(&ref_long, &generate(&flat, LONG), "one expert per column, long prompt");
    drop(flat);

    // A RAM copy from a recorded profile: prompt batches run the cold tier as mul_mat_id.
    let dir = tmp("split");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap())];
    let args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "24"];
    let resident = Server::start(&args, &env);
    assert_same(&ref_short, &generate(&resident, SHORT), "RAM copy, short prompt");
    assert_same(&ref_long, &generate(&resident, LONG), "RAM copy, long prompt");
    assert_eq!(metric(&resident, "experts_resident", "ram"), 4 * 16 - 24);
    assert!(metric(&resident, "expert_selections_total", "ram") > 0);
    let log = resident.log.lock().unwrap().clone();
    assert!(log.contains("profile hit rate of the hot tier"), "{log}");
    assert!(log.contains("host MemAvailable"), "{log}");
    drop(resident);
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "flat-ids")];
    let resident = Server::start(&args, &env);
    assert_same(&ref_long, &generate(&resident, LONG), "RAM copy, one expert per column, long prompt");
}

/// The zero-copy decode graph a GPU runs, here on the CPU (STRATA_LAB=zero-copy): one
/// mul_mat_id per matrix reads every expert through a table of pointers (patches/0007), hot ones
/// from the hot tier and cold ones from the RAM copy; the down projection's kernels log the
/// routing (patches/0008), which is counted after each step as the CPU kernels count it.
#[test]
fn zero_copy_decode_matches_the_unsplit_model_and_counts_as_the_cpu_path_does() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(m);

    let dir = tmp("zero-copy");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    // 24 of 64 experts hot, then every expert hot: no layer has cold experts, and zero-copy
    // decode still logs the routing (a RAM copy of the pad alone per layer) instead of counting
    // with a CPU op, as the CPU path does; then 3 hot, which leaves layers without hot experts.
    for cache in ["24", "64", "3"] {
        let args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", cache];
        let mut selections = Vec::new();
        for lab in ["", "zero-copy"] {
            let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", lab)];
            let s = Server::start(&args, &env);
            let what = format!("{cache} hot, STRATA_LAB={lab:?}");
            assert_same(&ref_short, &generate(&s, SHORT), &format!("{what}, short prompt"));
            assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt"));
            selections.push([metric(&s, "expert_selections_total", "vram"), metric(&s, "expert_selections_total", "ram")]);
            let log = s.log.lock().unwrap().clone();
            assert!(log.contains(&format!("experts: {cache} of 64 in the hot tier")), "{log}");
            let zero_copy = log.contains(
                "from the page-locked RAM copy in 4 of 4 tiered layers (zero-copy: one device graph a step, one mul_mat_id per matrix through tables",
            );
            assert_eq!(zero_copy, !lab.is_empty(), "{log}");
        }
        assert!(selections[0][0] > 0 && (selections[0][1] > 0) == (cache != "64"), "{selections:?}");
        assert_eq!(selections[0], selections[1], "{cache} hot: selections by tier (vram, ram): CPU decode vs zero-copy decode");
    }
    let out = run_server(&["-m", m, "--mmap-experts"], &[("STRATA_LAB", "zero-copy,decode-stage")]);
    assert_eq!(out.status, 1);
    assert!(out.stderr.contains("STRATA_LAB: unknown item 'decode-stage'"), "{}", out.stderr);
}

pub(crate) fn counter(s: &Server, name: &str) -> u64 {
    let text = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    let key = format!("strata:{name} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).unwrap_or_else(|| panic!("no {key} in\n{text}")).parse().unwrap()
}

#[test]
fn the_prefill_ring_emulated_on_the_cpu_matches_the_unsplit_model() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(m);

    // Cold experts from the mapping through the staging buffer; a half holds a whole layer.
    let trace = tmp("ring-trace").join("trace.jsonl");
    let lab = format!("emulate-ring,ring-trace={}", trace.display());
    let env = [("STRATA_LAB", lab.as_str()), ("STRATA_PREFILL_RING", "32")];
    let s = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30"], &env);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("prefill ring: 32 slots in two halves (emulated on the CPU"), "{log}");
    assert!(log.contains("4 of 4 tiered layers windowed"), "{log}");
    assert!(log.contains("cost model: copy"), "{log}");
    assert_same(&ref_short, &generate(&s, SHORT), "ring, short prompt");
    assert_same(&ref_long, &generate(&s, LONG), "ring, long prompt");
    let batches = counter(&s, "prefill_ring_batches_total");
    assert!(batches >= 1, "the long prompt's batch took the ring");
    let (fills, bytes) = (counter(&s, "prefill_ring_fills_total"), counter(&s, "prefill_ring_h2d_bytes_total"));
    assert!(fills > 0 && bytes > 0, "fills {fills}, bytes {bytes}");
    let text = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    assert!(counter(&s, "prefill_ring_h2d_bytes_last_batch") > 0, "{text}");
    // Again: the prefetch of each next layer now finds some of its experts already in the ring.
    assert_same(&ref_long, &generate(&s, LONG), "ring, long prompt again");
    assert!(counter(&s, "prefill_ring_batches_total") > batches);
    assert!(counter(&s, "prefill_ring_hits_total") > 0, "prefetched experts were used");
    drop(s);
    // The per-layer timeline: one line per fill step of both batches (the last layer computes
    // only the output token, a decode-sized batch, so it has none).
    let lines: Vec<Value> = std::fs::read_to_string(&trace).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.iter().map(|l| l["layer"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2, 0, 1, 2], "{lines:?}");
    assert!(lines.iter().all(|l| l["n_tok"].as_u64().unwrap() >= 32 && l["fill_ms"].as_f64().is_some()), "{lines:?}");
    assert!(lines[1]["since_prev_ms"].as_f64().is_some());

    // A RAM copy (pageable: gathered into the staging buffer) and one that takes the ring directly.
    let dir = tmp("ring");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "emulate-ring,ring-pace-kib=8"), ("STRATA_PREFILL_RING", "40")];
    let args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "24"];
    let s = Server::start(&args, &env);
    assert_same(&ref_long, &generate(&s, LONG), "ring from the RAM copy, long prompt");
    assert_same(&ref_short, &generate(&s, SHORT), "ring from the RAM copy, short prompt");
    assert!(counter(&s, "prefill_ring_batches_total") >= 1);
    drop(s);

    // A half smaller than a layer's cold tier. One pass: the most-selected cold experts take the
    // ring, the rest go to the zero pads on the device and to the CPU (its own ops, or the worker
    // pool). Two passes (waves): a second half's worth through the other half, the rest on the
    // CPU. Four: every used cold expert through the ring, nothing on the CPU.
    // The copier paced (a run of 8 KiB, then a wait) in two of them; in two, only cold experts
    // more likely used than not are prefetched (the rest copied when a batch needs them).
    for (workers, waves, pace, min_p) in [("0", "1", "0", ""), ("2", "1", "8", "0.5"), ("0", "2", "0", ""), ("2", "2", "0", "1"), ("0", "4", "8", "")] {
        let mut lab = format!("emulate-ring,ring-waves={waves},ring-pace-kib={pace}");
        if !min_p.is_empty() {
            lab += &format!(",ring-prefetch-min-p={min_p}");
        }
        let env = [("STRATA_LAB", lab.as_str()), ("STRATA_PREFILL_RING", "8")];
        let s = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30", "--pool-workers", workers], &env);
        let log = s.log.lock().unwrap().clone();
        assert!(log.contains("prefill ring: 8 slots in two halves") && log.contains("4 of 4 tiered layers windowed"), "{log}");
        let what = format!("ring of 8 slots, {workers} workers, {waves} passes");
        let prefetch = format!("prefetch: cold experts used with a chance of at least {}", if min_p.is_empty() { "0.02" } else { min_p });
        assert!(log.contains(&prefetch), "{what}: {log}");
        let paced = if pace == "0" { "copies unpaced".to_string() } else { format!("copies paced, {pace} KiB at a time") };
        assert!(log.contains(&paced), "{what}: {log}");
        assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt"));
        assert_same(&ref_short, &generate(&s, SHORT), &format!("{what}, short prompt"));
        assert!(counter(&s, "prefill_ring_batches_total") >= 1);
        let (passes, cpu) = (counter(&s, "prefill_ring_waves_total"), metric(&s, "expert_selections_total", "mmap"));
        assert!(cpu > 0, "{what}: cold selections counted");
        match waves {
            "1" => assert_eq!(passes, 0, "{what}"),
            _ => assert!(passes > 0, "{what}: later passes computed cold experts"),
        }
        drop(s);
    }

    // --pcie-frac uploads go through the ring's staging buffer and copier when there is a ring.
    let env = [("STRATA_LAB", "emulate-ring"), ("STRATA_PREFILL_RING", "32")];
    let s = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30", "--pool-workers", "2", "--pcie-frac", "0.5"], &env);
    assert_same(&ref_short, &generate(&s, SHORT), "ring and uploads, short prompt");
    let before = counter(&s, "prefill_ring_h2d_bytes_total");
    assert!(counter(&s, "expert_uploads_total") > 0);
    assert!(before > 0, "decode uploads counted as ring copies");
    assert_same(&ref_long, &generate(&s, LONG), "ring and uploads, long prompt");
    drop(s);

    // Without a GPU and without emulation the ring is off and says so; 0 turns it off.
    let s = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "30"], &[]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("prefill ring: off (no GPU)"), "{log}");
    drop(s);
    let out = run_server(&["-m", m, "--mmap-experts"], &[("STRATA_PREFILL_RING", "many")]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("STRATA_PREFILL_RING: invalid value 'many'"), "{}", out.stderr);
    for (bad, says) in [("ring-pace-kib=-1", "0 to 4194304"), ("ring-prefetch-min-p=1.5", "0 to 1"), ("ring-waves=9", "expected the most passes")] {
        let out = run_server(&["-m", m, "--mmap-experts"], &[("STRATA_LAB", bad)]);
        assert_eq!(out.status, 1);
        assert!(out.stderr.contains(&format!("STRATA_LAB: invalid value '{bad}': ")) && out.stderr.contains(says), "{}", out.stderr);
    }
}

/// The prefill ring and zero-copy decode together: prompt batches through the ring's slots,
/// decode through the tables, from the same RAM copy.
/// A prompt of one ubatch and a few tokens splits into a prompt-sized ubatch and a decode-sized
/// one in the same llama_decode: the tail must not compute with what the prompt ubatch left in
/// the ring or the tables.
#[test]
fn a_prompt_whose_last_ubatch_is_decode_sized_keeps_the_output() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let dir = tmp("ubatch-tails");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "emulate-ring,zero-copy"), ("STRATA_PREFILL_RING", "40")];
    for (ub, lens) in [("32", 33..=36), ("256", 258..=260)] {
        let base = ["-m", m, "-c", "2048", "-b", "512", "-ub", ub];
        let reference = Server::start(&[&base[..], &["--no-repack"]].concat(), &[]);
        let (status, t) = reference.post("/tokenize", &json!({"content": LONG}));
        assert_eq!(status, 200, "{t}");
        let ids: Vec<Value> = t["tokens"].as_array().unwrap().iter().cycle().take(300).cloned().collect();
        let ask = |s: &Server, n: usize| {
            let body = json!({"prompt": ids[..n], "n_predict": 12, "temperature": 0, "n_probs": 3, "cache_prompt": false,
                              "ignore_eos": true, "return_tokens": true});
            let (status, v) = s.post("/completion", &body);
            assert_eq!(status, 200, "{v}");
            v
        };
        let want: Vec<Value> = lens.clone().map(|n| ask(&reference, n)).collect();
        drop(reference);
        let tiers = ["--metrics", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "24"];
        let s = Server::start(&[&base[..], &tiers[..]].concat(), &env);
        for (n, w) in lens.zip(&want) {
            assert_same(w, &ask(&s, n), &format!("-ub {ub}, a prompt of {n} tokens"));
        }
        assert!(counter(&s, "prefill_ring_batches_total") >= 1, "-ub {ub}: the prompt ubatches took the ring");
    }
}

#[test]
fn the_prefill_ring_beside_zero_copy_decode_keeps_the_output() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(m);
    let dir = tmp("ring-zero-copy");
    let profile = record_profile(&dir);
    let root = guard_root(&dir, 64 << 20);
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "emulate-ring,zero-copy"), ("STRATA_PREFILL_RING", "40")];
    // From the profile's placement; then adapting from an even one, whose swaps rewrite the
    // tables and the ring's record between batches.
    for extra in [&["--expert-profile", profile.to_str().unwrap()][..], &["--adapt-every", "4"][..]] {
        let mut args = vec!["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-cache", "24"];
        args.extend_from_slice(extra);
        let s = Server::start(&args, &env);
        let log = s.log.lock().unwrap().clone();
        assert!(log.contains("prefill ring: 40 slots") && log.contains("(zero-copy: one device graph a step"), "{log}");
        let what = format!("ring and zero-copy decode {extra:?}");
        assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt"));
        assert_same(&ref_short, &generate(&s, SHORT), &format!("{what}, short prompt"));
        assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt again"));
        assert!(counter(&s, "prefill_ring_batches_total") >= 1, "{what}");
        assert!(metric(&s, "expert_selections_total", "ram") > 0, "{what}");
        if extra[0] == "--adapt-every" {
            assert!(counter(&s, "expert_swaps_total") > 0, "{what}: swaps ran");
        }
    }
}

#[test]
fn a_recorded_profile_ranks_every_expert_and_is_tied_to_the_model() {
    let dir = tmp("profile");
    let profile = record_profile(&dir);
    let p: Value = serde_json::from_slice(&std::fs::read(&profile).unwrap()).unwrap();
    assert_eq!(p["format"], "strata-expert-profile");
    assert_eq!(p["model"]["n_expert"], 16);
    let ranked = p["ranked"].as_array().unwrap();
    assert_eq!(ranked.len(), 4 * 16);
    let hits: Vec<u64> = ranked.iter().map(|e| e[2].as_u64().unwrap()).collect();
    assert!(hits.windows(2).all(|w| w[0] >= w[1]), "not ranked: {hits:?}");
    assert!(p["tokens"].as_u64().unwrap() > 48);

    // The same profile on another model of the same shape is refused, naming both hashes.
    let other = model("tiny-qwen3moe.gguf");
    let out = run_server(&["-m", other.to_str().unwrap(), "--port", "0", "--mmap-experts", "--expert-profile", profile.to_str().unwrap()], &[]);
    assert_ne!(out.status, 0);
    assert!(out.stderr.contains("--expert-profile") && out.stderr.contains("made for another model"), "{}", out.stderr);
}

#[test]
fn bad_expert_inputs_get_clear_errors() {
    let dir = tmp("bad");
    let m = model(MODEL);
    let ms = m.to_str().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = vec!["--port", "0"];
        all.extend_from_slice(args);
        let out = run_server(&all, env);
        assert_ne!(out.status, 0, "{args:?} should fail:\n{}", out.stderr);
        out.stderr
    };

    let e = run(&["-m", ms, "--resident-cpu-experts"], &[]);
    assert!(e.contains("needs a fixed ranked --expert-profile"), "{e}");
    let e = run(&["-m", ms, "--mmap-experts", "--load-mode", "none"], &[]);
    assert!(e.contains("needs the model file mapped"), "{e}");

    let garbage = dir.join("garbage.json");
    std::fs::write(&garbage, b"{\"format\": \"strata-expert-profile\", \"version\": 7}").unwrap();
    let e = run(&["-m", ms, "--expert-profile", garbage.to_str().unwrap()], &[]);
    assert!(e.contains("version 7 is not supported"), "{e}");

    // A truncated file: the header still parses, an expert tensor runs past the end.
    let bytes = std::fs::read(&m).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 4096]).unwrap();
    let e = run(&["-m", cut.to_str().unwrap(), "--mmap-experts"], &[]);
    assert!(e.contains("runs past the end of the file"), "{e}");

    // A dense model has no experts to place.
    let dense = model("tiny-llama.gguf");
    let e = run(&["-m", dense.to_str().unwrap(), "--mmap-experts"], &[]);
    assert!(e.contains("the model has no routed experts"), "{e}");
}

/// Selections per layer in a profile written by --expert-profile-out.
pub(crate) fn layer_totals(profile: &Path) -> std::collections::BTreeMap<u64, u64> {
    let v: Value = serde_json::from_slice(&std::fs::read(profile).unwrap()).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for e in v["ranked"].as_array().unwrap() {
        *out.entry(e[0].as_u64().unwrap()).or_insert(0) += e[2].as_u64().unwrap();
    }
    out
}

/// The MTP head's layer has experts too: it is tiered like the trunk, and drafting with it keeps
/// the greedy output of the unsplit model. Its draft context is a second context over the same
/// tiers: with zero-copy decode and adaptation swapping experts after every batch of either
/// context, the output stays the unsplit model's, and every layer counts the selections of both
/// contexts' batches as the CPU kernels do (the draft context's decodes used to overwrite each
/// other's routing logs).
#[test]
fn mtp_drafting_over_tiered_experts_keeps_the_output() {
    let m = model("tiny-qwen35moe-mtp.gguf");
    let m = m.to_str().unwrap();
    let reference = Server::start(&["-m", m, "-c", "4096", "--no-repack", "--spec-type", "draft-mtp"], &[]);
    let want = generate(&reference, LONG);
    drop(reference);
    let dir = tmp("mtp-zero-copy");
    let kernels_counts = dir.join("kernels.json");
    let s = Server::start(
        &[
            "-m",
            m,
            "-c",
            "4096",
            "--spec-type",
            "draft-mtp",
            "--mmap-experts",
            "--expert-cache",
            "20",
            "--expert-profile-out",
            kernels_counts.to_str().unwrap(),
        ],
        &[],
    );
    let got = generate(&s, LONG);
    assert_same(&want, &got, "MTP drafting over tiers");
    assert!(got["timings"]["draft_n"].as_u64().unwrap() > 0, "{}", got["timings"]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("experts: 5 MoE layers x 16 experts"), "{log}");
    drop(s);

    // The verify batches (2-5 tokens) and the draft context's steps through the zero-copy graph,
    // run on the CPU, with the hot tier starting even and adapting after every batch.
    let root = guard_root(&dir, 64 << 20);
    let zero_copy_counts = dir.join("zero-copy.json");
    let args = [
        "-m",
        m,
        "-c",
        "4096",
        "--metrics",
        "--spec-type",
        "draft-mtp",
        "--resident-cpu-experts",
        "--expert-cache",
        "20",
        "--adapt-every",
        "1",
        "--expert-profile-out",
        zero_copy_counts.to_str().unwrap(),
    ];
    let s = Server::start(&args, &[("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "zero-copy")]);
    let got = generate(&s, LONG);
    assert_same(&want, &got, "MTP drafting over zero-copy decode with adaptation");
    assert!(got["timings"]["draft_n"].as_u64().unwrap() > 0, "{}", got["timings"]);
    assert!(counter(&s, "expert_swaps_total") > 0, "adaptation swapped no expert");
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("(zero-copy: one device graph a step"), "{log}");
    drop(s);
    let (k, z) = (layer_totals(&kernels_counts), layer_totals(&zero_copy_counts));
    assert_eq!(k.len(), 5, "{k:?}");
    assert_eq!(k, z, "selections per layer: CPU kernels vs zero-copy logs (layer 4 is the MTP head's)");
}

/// A model with MTP layers served without MTP drafting: llama.cpp does not load those layers, and
/// the tiers place the trunk's experts alone (the server refused to start before).
#[test]
fn mtp_layers_without_drafting_stay_out_of_the_tiers() {
    for name in ["tiny-qwen35moe-mtp.gguf", "tiny-qwen4exp.gguf"] {
        let m = model(name);
        let m = m.to_str().unwrap();
        let reference = Server::start(&["-m", m, "-c", "4096", "--no-repack"], &[]);
        let want = generate(&reference, LONG);
        drop(reference);
        let s = Server::start(&["-m", m, "-c", "4096", "--metrics", "--mmap-experts", "--expert-cache", "20"], &[]);
        assert_same(&want, &generate(&s, LONG), &format!("{name}: tiers without MTP drafting"));
        let log = s.log.lock().unwrap().clone();
        assert!(log.contains("experts: MTP layer 4 not loaded (llama.cpp loads it only for --spec-type draft-mtp); not placed"), "{log}");
        assert!(log.contains("experts: 4 MoE layers x 16 experts"), "{log}");
        assert!(metric(&s, "expert_selections_total", "mmap") > 0);
        drop(s);
        // A profile recorded without drafting covers the MTP layer too (no selections), so it
        // serves with drafting on as well as off.
        let dir = tmp(&format!("mtp-off-{name}"));
        let profile = record_profile_of(name, &[], &dir);
        let root = guard_root(&dir, 64 << 20);
        for spec in [&[][..], &["--spec-type", "draft-mtp"][..]] {
            let mut args = vec!["-m", m, "-c", "4096", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "20"];
            args.extend(spec);
            let s = Server::start(&args, &[("STRATA_MEMGUARD_ROOT", root.to_str().unwrap())]);
            assert_same(&want, &generate(&s, LONG), &format!("{name}: profile recorded without drafting, {spec:?}"));
        }
    }
}

/// Selections served by the hot tier over the requests of `run` (SHORT and LONG twice each), as
/// a share of all, counting only the last two.
fn hot_share_of_repeats(s: &Server, refs: &(Value, Value), what: &str) -> f64 {
    for _ in 0..2 {
        assert_same(&refs.1, &generate(s, LONG), &format!("{what}, long prompt"));
        assert_same(&refs.0, &generate(s, SHORT), &format!("{what}, short prompt"));
    }
    let before = [metric(s, "expert_selections_total", "vram"), metric(s, "expert_selections_total", "ram")];
    for _ in 0..2 {
        assert_same(&refs.1, &generate(s, LONG), &format!("{what}, long prompt again"));
        assert_same(&refs.0, &generate(s, SHORT), &format!("{what}, short prompt again"));
    }
    let hot = metric(s, "expert_selections_total", "vram") - before[0];
    let cold = metric(s, "expert_selections_total", "ram") - before[1];
    hot as f64 / (hot + cold) as f64
}

/// A server variant: what it tests, extra flags, extra environment.
type Variant<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// --adapt-every without a profile: the hot tier starts even (the lowest-numbered experts of each
/// layer) and follows the routing by exchanging experts with the RAM copy between batches. Every
/// decode path keeps the unsplit model's output through the swaps, and the hot tier serves more
/// of the same requests than the fixed even placement does.
#[test]
fn adaptation_follows_the_routing_and_keeps_the_output() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let refs = unsplit(m);
    let dir = tmp("adapt");
    let root = guard_root(&dir, 64 << 20);
    let root = root.to_str().unwrap();

    let fixed = Server::start(&["-m", m, "-c", "2048", "--metrics", "--mmap-experts", "--expert-cache", "24"], &[]);
    for _ in 0..2 {
        generate(&fixed, LONG);
        generate(&fixed, SHORT);
    }
    let before = [metric(&fixed, "expert_selections_total", "vram"), metric(&fixed, "expert_selections_total", "mmap")];
    for _ in 0..2 {
        generate(&fixed, LONG);
        generate(&fixed, SHORT);
    }
    let hot = metric(&fixed, "expert_selections_total", "vram") - before[0];
    let fixed_share = hot as f64 / (hot + metric(&fixed, "expert_selections_total", "mmap") - before[1]) as f64;
    drop(fixed);

    let args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-cache", "24", "--adapt-every", "4"];
    let learned = dir.join("learned.json");
    let mut first = args.to_vec();
    first.extend(["--expert-profile-out", learned.to_str().unwrap()]);
    let s = Server::start(&first, &[("STRATA_MEMGUARD_ROOT", root)]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("experts: adapting 4 of 4 tiered layers every 4 batches from an even placement"), "{log}");
    let share = hot_share_of_repeats(&s, &refs, "adapting, CPU decode");
    let (swaps, bytes) = (counter(&s, "expert_swaps_total"), counter(&s, "expert_swap_bytes_total"));
    let us = [labelled(&s, "expert_swap_microseconds_total", "part", "copies"), labelled(&s, "expert_swap_microseconds_total", "part", "maps")];
    assert!(swaps > 0 && bytes > 0 && us[0] + us[1] > 0 && counter(&s, "expert_adapt_intervals_total") > 0, "swaps {swaps}, bytes {bytes}, us {us:?}");
    assert!(share > fixed_share + 0.05, "hot-tier share {share:.3} adapting vs {fixed_share:.3} fixed");
    drop(s);

    // What the adapting server saw, saved by --expert-profile-out, places a fixed hot tier that
    // serves the same requests better than the even one.
    let fixed_args = ["-m", m, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-profile", learned.to_str().unwrap(), "--expert-cache", "24"];
    let s = Server::start(&fixed_args, &[("STRATA_MEMGUARD_ROOT", root)]);
    let learned_share = hot_share_of_repeats(&s, &refs, "the learned profile, fixed");
    assert!(learned_share > fixed_share + 0.05, "hot-tier share {learned_share:.3} from the learned profile vs {fixed_share:.3} even");
    drop(s);

    // The other decode paths read the maps a swap rewrites: zero-copy decode's tables, the
    // worker pool, the prefill ring's record of which expert is where.
    let variants: [Variant; 3] = [
        ("zero-copy decode", &[], &[("STRATA_LAB", "zero-copy")]),
        ("worker pool", &["--pool-workers", "2"], &[]),
        ("prefill ring", &[], &[("STRATA_LAB", "emulate-ring"), ("STRATA_PREFILL_RING", "40")]),
    ];
    for (what, extra, env) in variants {
        let mut a = args.to_vec();
        a.extend(extra);
        let mut e = vec![("STRATA_MEMGUARD_ROOT", root)];
        e.extend(env);
        let s = Server::start(&a, &e);
        let share = hot_share_of_repeats(&s, &refs, &format!("adapting, {what}"));
        assert!(counter(&s, "expert_swaps_total") > 0, "{what}");
        assert!(share > fixed_share + 0.05, "{what}: hot-tier share {share:.3} adapting vs {fixed_share:.3} fixed");
        if what == "prefill ring" {
            assert!(counter(&s, "prefill_ring_batches_total") >= 1);
        }
    }
}

/// Cold-expert workers with nothing to do sleep: between requests (and through zero-copy decode,
/// which gives them no jobs) they do not spin on the host's cores.
#[test]
fn idle_cold_expert_workers_use_no_cpu() {
    let m = model(MODEL);
    let dir = tmp("idle-workers");
    let root = guard_root(&dir, 64 << 20);
    let args = ["-m", m.to_str().unwrap(), "-c", "2048", "--resident-cpu-experts", "--expert-cache", "24", "--adapt-every", "64", "--pool-workers", "4"];
    let s = Server::start(&args, &[("STRATA_MEMGUARD_ROOT", root.to_str().unwrap())]);
    generate(&s, SHORT);
    // past the spin after the last job
    std::thread::sleep(std::time::Duration::from_secs(1));
    let before = s.cpu_ticks();
    std::thread::sleep(std::time::Duration::from_secs(2));
    let used = s.cpu_ticks() - before;
    eprintln!("idle workers: {used} ticks of CPU in 2 s");
    let hz: u64 = String::from_utf8(std::process::Command::new("getconf").arg("CLK_TCK").output().unwrap().stdout).unwrap().trim().parse().unwrap();
    assert!(used * 8 < hz, "{used} ticks of CPU in 2 s idle ({hz} a second)");
}

/// The seed's measured configuration as one command line (its flags, "matching MTP runtime",
/// "Keep PLE on SSD" and its four variables) on a tiny qwen4exp, the architecture it was measured
/// on (MoE, MTP, a PLE table): it starts on a machine without a GPU, says what it cannot use
/// here, and keeps the greedy output of the same model served plainly with the same KV type and
/// placement and drafting.
#[test]
fn the_seed_command_line_serves_and_keeps_the_output() {
    let m = model("tiny-qwen4exp.gguf");
    let m = m.to_str().unwrap();
    let dir = tmp("seed");
    let profile = record_profile_of("tiny-qwen4exp.gguf", &["--spec-type", "draft-mtp"], &dir);
    let root = guard_root(&dir, 64 << 20);
    let table = dir.join("gfx1100-hipblaslt-100100.txt");
    std::fs::write(&table, "strata-gemm-table 1\nvalidator arch gfx1100\nvalidator runtime 70151\nvalidator blaslt 100100\n").unwrap();

    let plain =
        ["-m", m, "-c", "262144", "--no-repack", "--kv", "int8", "--kv-resident", "32768", "--spec-type", "draft-mtp", "--spec", "4", "--spec-min-p", "0.5"];
    let reference = Server::start(&plain, &[]);
    let want = generate(&reference, LONG);
    drop(reference);

    #[rustfmt::skip]
    let seed = [
        "-m", m, "-ngl", "99",
        "--mmap-experts", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "auto",
        "--prefill", "8192", "--spec", "4", "--spec-min-p", "0.5",
        "--max-context", "262144", "--kv", "int8", "--kv-resident", "32768", "--pool-workers", "15",
        "--adapt-every", "0", "--pcie-frac", "0", "--vram-reserve-mib", "1024", "--ple-mode", "ssd", "--metrics",
    ];
    let env = [
        ("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()),
        ("STRATA_PREFILL_MMQ", "1"),
        ("STRATA_HIPBLASLT_TUNING", table.to_str().unwrap()),
        ("STRATA_PREFILL_RING", "96"),
        ("STRATA_IO_THREADS", "32"),
    ];
    let s = Server::start(&seed, &env);
    let got = generate(&s, LONG);
    assert_same(&want, &got, "the seed's command line");
    let (status, props) = s.get("/props");
    assert_eq!(status, 200);
    // --max-context is -c: a 262144-token context, each slot capped at the tiny model's
    // training context as llama-server caps it
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("the slot context (262144) exceeds the training context of the model (4096) - capping"), "{log}");
    assert_eq!(props["default_generation_settings"]["n_ctx"], 4096);
    for line in [
        "(auto: no GPU, no hot tier)",
        "prefill ring: off (no GPU)",
        "stays in the file; a batch's rows are read by 32 direct-I/O readers",
        "STRATA_HIPBLASLT_TUNING",
        "creating MTP draft context",
        "--prefill 8192: --batch-size 8192 --ubatch-size 8192",
        "--kv int8: --cache-type-k q8_0 --cache-type-v q8_0",
        "--max-context 262144: --ctx-size 262144",
        "--spec 4: up to 4 draft tokens a step, drafted by the model's MTP head (1 layer(s); --spec-type draft-mtp)",
        "--kv-resident 32768: the K and V of 2 QSA layers (98.0 MiB for 262144 tokens a sequence) live in host memory",
        // each expert flag's effect, one line each
        "--mmap-experts: the experts stay in the file mapping; 0 cold experts (0.0 MiB) are read from it",
        "--resident-cpu-experts: a pageable RAM copy of 80 cold experts",
        &format!("--expert-profile {}: ranks the hot tier: profile hit rate of the hot tier", profile.display()),
        "--expert-cache auto: 0 experts hot",
        &format!(
            "--pool-workers 15: {} workers compute the cold experts of decode in 5 of 5 tiered layers",
            std::thread::available_parallelism().map_or(1, |n| n.get()).min(15)
        ),
        "--adapt-every 0: off, the hot tier keeps its placement",
        "--pcie-frac 0: no decode step uploads cold experts",
        "--vram-reserve-mib 1024: no GPU, nothing to reserve",
    ] {
        assert!(log.contains(line), "no '{line}' in\n{log}");
    }
    assert!(metric(&s, "expert_selections_total", "ram") > 0, "cold experts served from the RAM copy");
    let text = ureq::get(&format!("{}/metrics", s.base)).call().unwrap().into_string().unwrap();
    let supply: f64 = text.lines().find_map(|l| l.strip_prefix("strata:ple_supply_seconds_total ")).expect("PLE supply time").parse().unwrap();
    assert!(supply > 0.0, "batches waited for PLE rows read from the file: {supply} s");
}

/// STRATA_STEP_TRACE through a server with zero-copy decode and adaptation: a line per 256 steps
/// whose host time between steps has the sampler's and the tiers' bookkeeping's shares.
#[test]
fn the_step_trace_has_the_tiers_bookkeeping_of_zero_copy_decode() {
    let m = model(MODEL);
    let dir = tmp("step-trace");
    let root = guard_root(&dir, 64 << 20);
    let trace = dir.join("steps.jsonl");
    let args = ["-m", m.to_str().unwrap(), "-c", "2048", "--resident-cpu-experts", "--expert-cache", "24", "--adapt-every", "64"];
    let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", "zero-copy"), ("STRATA_STEP_TRACE", trace.to_str().unwrap())];
    let s = Server::start(&args, &env);
    let body = json!({"prompt": SHORT, "n_predict": 300, "temperature": 0, "ignore_eos": true, "cache_prompt": false});
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    drop(s);
    let text = std::fs::read_to_string(&trace).unwrap();
    let line: Value = serde_json::from_str(text.lines().next().expect("no line after 300 steps")).unwrap();
    assert_eq!(line["steps"], 256, "{line}");
    for part in ["launch_us", "wait_us", "host_us", "sample_us", "tiers_us"] {
        assert!(line[part]["median"].as_f64().is_some_and(|x| x > 0.0), "{part}: {line}");
    }
}

/// The tiers' own --cpu-moe needs the file mapping that llama.cpp's loader advises against:
/// a tiered start gives no such advice, a plain --cpu-moe start still does.
#[test]
fn a_tiered_start_gives_no_advice_that_its_flags_refuse() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let advice = "tensor overrides to CPU are used with mmap enabled";
    let tiered = Server::start(&["-m", m, "-c", "512", "--mmap-experts", "--expert-cache", "30"], &[]);
    assert!(!tiered.log.lock().unwrap().contains(advice), "{}", tiered.log.lock().unwrap());
    drop(tiered);
    let plain = Server::start(&["-m", m, "-c", "512", "--cpu-moe"], &[]);
    assert!(plain.log.lock().unwrap().contains(advice), "{}", plain.log.lock().unwrap());
}

/// A value the server cannot use as given is clamped with a warning that says the value used.
#[test]
fn clamped_expert_settings_say_the_value_used() {
    let m = model(MODEL);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let s = Server::start(&["-m", m.to_str().unwrap(), "-c", "2048", "--mmap-experts", "--expert-cache", "999999", "--pool-workers", "999"], &[]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("--expert-cache 999999: the model has 64 routed experts (layers x experts); all 64 can be hot, so 64 is used"), "{log}");
    assert!(
        log.contains(&format!(
            "--pool-workers 999: this machine runs {cores} threads at once; workers beyond that only wait on each other, so {cores} are used"
        )),
        "{log}"
    );
    assert!(log.contains("experts: 64 of 64 in the hot tier"), "{log}");
}
