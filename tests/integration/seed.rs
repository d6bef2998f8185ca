//! The seed's flags as its users type them: what each comes to, said at start-up.

use serde_json::json;

use crate::support::{model, Server};

/// `--spec N` with no drafter named: a model with an MTP head drafts with it (and llama.cpp loads
/// the head for it); a model without one drafts nothing, and start-up says so either way.
#[test]
fn spec_alone_drafts_with_the_mtp_head_or_says_that_nothing_drafts() {
    let body = json!({"prompt": "The tide came in over the rocks and the", "n_predict": 24, "temperature": 0, "cache_prompt": false});
    let mtp = model("tiny-qwen35moe-mtp.gguf");
    let s = Server::start(&["-m", mtp.to_str().unwrap(), "-c", "2048", "--spec", "3"], &[]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("--spec 3: up to 3 draft tokens a step, drafted by the model's MTP head (1 layer(s); --spec-type draft-mtp)"), "{log}");
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    assert!(v["timings"]["draft_n"].as_u64().unwrap() > 0, "{}", v["timings"]);
    // random weights: no draft is accepted, so drafting backs off (steps 0, 1, 3, 7 and 15 of 24
    // draft, at most 3 tokens each, where every step would draft 3)
    let (n, acc) = (v["timings"]["draft_n"].as_u64().unwrap(), v["timings"]["draft_n_accepted"].as_u64().unwrap());
    assert!(acc > 0 || n <= 15, "{}", v["timings"]);
    drop(s);

    let plain = model("tiny-qwen3moe.gguf");
    let s = Server::start(&["-m", plain.to_str().unwrap(), "-c", "2048", "--spec", "3"], &[]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("--spec 3: nothing drafts: the model has no MTP head, and no --spec-type or draft model (-md) is given"), "{log}");
    let (status, v) = s.post("/completion", &body);
    assert_eq!(status, 200, "{v}");
    assert!(v["timings"]["draft_n"].is_null() || v["timings"]["draft_n"] == 0, "{}", v["timings"]);
    drop(s);

    // a drafter named on the command line is the one that drafts
    let s = Server::start(&["-m", mtp.to_str().unwrap(), "-c", "2048", "--spec", "2", "--spec-type", "ngram-simple"], &[]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("--spec 2: up to 2 draft tokens a step, drafted by --spec-type ngram-simple"), "{log}");
}

/// `--expert-profile P --expert-profile-out P`, a profile fed back in as the docs suggest: the
/// run's selections add to the file's instead of replacing them.
#[test]
fn a_profile_fed_back_in_keeps_what_it_had() {
    use crate::experts::{generate, layer_totals, record_profile, tmp, MODEL, SHORT};
    let dir = tmp("profile-in-out");
    let profile = record_profile(&dir);
    let tokens = |p: &std::path::Path| serde_json::from_slice::<serde_json::Value>(&std::fs::read(p).unwrap()).unwrap()["tokens"].as_u64().unwrap();
    let (before, tokens_before) = (layer_totals(&profile), tokens(&profile));
    let p = profile.to_str().unwrap();
    let m = model(MODEL);
    let s = Server::start(
        &["-m", m.to_str().unwrap(), "-c", "2048", "--mmap-experts", "--expert-cache", "30", "--expert-profile", p, "--expert-profile-out", p],
        &[],
    );
    assert!(s.log.lock().unwrap().contains("is the --expert-profile read: this run's selections add to its"), "{}", s.log.lock().unwrap());
    generate(&s, SHORT);
    drop(s);
    let after = layer_totals(&profile);
    assert_eq!(after.len(), before.len());
    for (l, n) in &before {
        assert!(after[l] > *n, "layer {l}: {} after, {n} before", after[l]);
    }
    assert!(tokens(&profile) > tokens_before + 40, "{} tokens after, {tokens_before} before", tokens(&profile));
}

/// A RAM copy whose memory guard cannot read its limits (a cgroup-v1 memory controller) stops the
/// start before the model loads, and the error says what to do instead.
#[test]
fn a_memory_guard_without_cgroup_v2_stops_the_start_before_the_model_loads() {
    let dir = crate::experts::tmp("guard-v1");
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(root.join("proc/self/cgroup"), "5:memory:/x\n0::/\n").unwrap();
    std::fs::write(root.join("proc/self/mountinfo"), "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:4 - cgroup cgroup rw,memory\n").unwrap();
    std::fs::write(root.join("proc/meminfo"), "MemTotal: 67108864 kB\nMemAvailable: 67108864 kB\n").unwrap();
    let m = model(crate::experts::MODEL);
    let out = crate::support::run_server(
        &["-m", m.to_str().unwrap(), "--port", "0", "--resident-cpu-experts", "--adapt-every", "8"],
        &[("STRATA_MEMGUARD_ROOT", root.to_str().unwrap())],
    );
    assert_eq!(out.status, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("--resident-cpu-experts: the memory guard needs cgroup v2") && out.stderr.contains("run strata-server in a cgroup-v2 hierarchy"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--mmap-experts without the RAM copy flags"), "{}", out.stderr);
    assert!(!out.stderr.contains("llama_model_loader") && !out.stderr.contains("load_tensors"), "the model loaded first:\n{}", out.stderr);
}

/// The RAM rule: where the memory guard admits only part of the RAM copy, that part is copied
/// (the layers whose cold experts the profile selects most) and the other layers' cold experts
/// are read from the mapping, with the unsplit model's output, on the CPU path and with the
/// GPU's mechanisms on the CPU (zero-copy decode beside CPU layers, the ring copying from both);
/// a guard that admits nothing leaves every cold expert in the mapping. It used to refuse to load.
#[test]
fn a_ram_copy_larger_than_the_guard_allows_copies_part_and_maps_the_rest() {
    use crate::experts::{assert_same, generate, guard_root, metric, record_profile, tmp, unsplit, LONG, MODEL, SHORT};
    let m = model(MODEL);
    let ms = m.to_str().unwrap();
    let (ref_short, ref_long) = unsplit(ms);
    let dir = tmp("ram-rule");
    let profile = record_profile(&dir);
    let (_, layout) = strata_residency::gguf::validate(&m).unwrap();
    // 8 GiB of headroom plus about half the copy of 40 cold experts and 4 pads
    let part = (8 << 20) + layout.total_expert_bytes() / 3 / 1024;
    for (avail_kib, lab) in [(part, ""), (part, "zero-copy,emulate-ring"), (4 << 20, "")] {
        let root = guard_root(&dir, avail_kib);
        let env = [("STRATA_MEMGUARD_ROOT", root.to_str().unwrap()), ("STRATA_LAB", lab)];
        let args = ["-m", ms, "-c", "2048", "--metrics", "--resident-cpu-experts", "--expert-profile", profile.to_str().unwrap(), "--expert-cache", "24"];
        let s = Server::start(&args, &env);
        let what = format!("{avail_kib} KiB available, STRATA_LAB={lab:?}");
        assert_same(&ref_short, &generate(&s, SHORT), &format!("{what}, short prompt"));
        assert_same(&ref_long, &generate(&s, LONG), &format!("{what}, long prompt"));
        let log = s.log.lock().unwrap().clone();
        let copied: usize = log
            .split("layers copied")
            .next()
            .and_then(|head| head.rsplit(": ").next())
            .and_then(|t| t.split(" of ").next())
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{what}: no RAM rule line in\n{log}"));
        assert!(log.contains("those whose cold experts the profile selects most per byte"), "{log}");
        let (ram, mapped) = (metric(&s, "experts_resident", "ram"), metric(&s, "experts_resident", "mmap"));
        assert_eq!(ram + mapped, 64 - 24, "{what}");
        if avail_kib == part {
            assert!((1..4).contains(&copied), "{what}: {copied} of 4 layers copied\n{log}");
            assert!(ram > 0 && mapped > 0, "{what}: {ram} in RAM, {mapped} mapped");
            assert!(metric(&s, "expert_selections_total", "ram") > 0 && metric(&s, "expert_selections_total", "mmap") > 0, "{what}");
        } else {
            assert_eq!((copied, ram), (0, 0), "{what}");
        }
        if lab.contains("zero-copy") {
            assert!(log.contains(&format!("from the page-locked RAM copy in {copied} of 4 tiered layers (zero-copy")), "{log}");
        }
    }
}
