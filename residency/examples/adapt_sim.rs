//! Replays `--adapt-every` offline: decode steps route each layer's tokens by a recorded expert
//! profile (n_expert_used distinct experts a token, drawn in proportion to the profile's hits + 1),
//! the adaptation policy of `strata_residency::adapt` moves experts between the hot tier and the
//! RAM copy as the server does (an interval every N steps, at most `--per-batch` swaps made after
//! each step), and the hot tier's hit rate is printed per window of steps.
//!
//!   cargo run --release -p strata-residency --example adapt_sim -- --profile P.json \
//!       [--truth T.json] [--start profile|even|stale] [--hot-frac F] [--steps N] [--every N]
//!       [--window N] [--per-batch N] [--seed N] [--decay X] [--hysteresis X] [--margin X]
//!       [--prior-weight X] [--max-swaps N] [--z X] [--base-us X] [--read-us X] [--swap-us X]
//!
//! It also prints a modelled decode speed: a step takes `--base-us` plus `--read-us` per cold
//! selection plus `--swap-us` per swap made after it. The defaults are fitted to an H100 trace at
//! 24 GiB, skew 0.3 (bench/results/h100-2026-12-05d-table/call4-row12-03-trace: 111.0 t/s at a hit
//! rate of 0.801, 66.9 at 0.356, 110.8 at 0.824 with 0.96 swaps a step).
//! `--truth` is the profile the routing follows (default: `--profile`); `--start stale` places and
//! primes the policy with the profile's ranking reversed per layer, as tools/expert-profile
//! --reverse writes it; `--start even` starts without a profile (the first ids of each layer).

use std::collections::VecDeque;

use strata_residency::adapt::{Adapter, Policy, Start};
use strata_residency::profile::Profile;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

fn hits_by_layer(p: &Profile) -> Vec<(u32, Vec<u64>)> {
    let mut out: Vec<(u32, Vec<u64>)> = p.layers().into_iter().map(|l| (l, vec![0; p.n_expert as usize])).collect();
    for e in &p.ranked {
        if let Some((_, h)) = out.iter_mut().find(|(l, _)| *l == e.layer) {
            h[e.expert as usize] = e.hits;
        }
    }
    out
}

/// The same hits with each layer's ranking reversed: the most used expert gets the least's count.
fn reversed(hits: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..hits.len()).collect();
    order.sort_by(|&a, &b| hits[b].cmp(&hits[a]).then(a.cmp(&b)));
    let mut out = vec![0; hits.len()];
    for (i, &e) in order.iter().enumerate() {
        out[e] = hits[order[hits.len() - 1 - i]];
    }
    out
}

fn top(hits: &[u64], n: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..hits.len() as u32).collect();
    order.sort_by(|&a, &b| hits[b as usize].cmp(&hits[a as usize]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let num = |name: &str, default: f64| get(name).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name}: not a number: {v}")));
    let read = |path: &str| Profile::parse(&std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"))).unwrap_or_else(|e| panic!("{path}: {e}"));
    let profile_path = get("--profile").expect("--profile FILE");
    let profile = read(&profile_path);
    let truth = get("--truth").map_or_else(|| profile.clone(), |p| read(&p));
    let start = get("--start").unwrap_or_else(|| "profile".into());
    let d = Policy::default();
    let policy = Policy {
        decay: num("--decay", d.decay),
        hysteresis: num("--hysteresis", d.hysteresis),
        margin: num("--margin", d.margin),
        prior_weight: num("--prior-weight", d.prior_weight),
        max_swaps: num("--max-swaps", d.max_swaps as f64) as usize,
        z: num("--z", d.z),
    };
    let (steps, every, window, per_batch) =
        (num("--steps", 1200.0) as u64, num("--every", 64.0) as u64, num("--window", 100.0) as u64, num("--per-batch", 4.0) as usize);
    let n_expert = profile.n_expert as usize;
    let n_used = profile.n_expert_used as usize;
    let n_hot = ((num("--hot-frac", 0.62) * n_expert as f64).round() as usize).min(n_expert);
    let mut rng = Rng(num("--seed", 1.0) as u64);
    let (base_us, read_us, swap_us) = (num("--base-us", 6300.0), num("--read-us", 35.0), num("--swap-us", 375.0));
    let (mut us, mut late_us) = (0.0f64, 0.0f64);

    let own = hits_by_layer(&profile);
    let weights: Vec<Vec<f64>> = hits_by_layer(&truth).into_iter().map(|(_, h)| h.iter().map(|&x| x as f64 + 1.0).collect()).collect();
    let starts: Vec<Start> = own
        .iter()
        .map(|(l, h)| {
            let (hot, prior) = match start.as_str() {
                "profile" => (top(h, n_hot), Some(h.clone())),
                "stale" => {
                    let r = reversed(h);
                    (top(&r, n_hot), Some(r))
                }
                "even" => ((0..n_hot as u32).collect(), None),
                s => panic!("--start {s}: expected profile, even or stale"),
            };
            Start { layer: *l as i32, n_expert, hot, profile_hits: prior }
        })
        .collect();
    // slot -> expert as the device holds it (swaps land a few per step after their interval).
    let mut device: Vec<Vec<u32>> = starts.iter().map(|s| s.hot.clone()).collect();
    let mut adapter = Adapter::new(policy, starts);
    let mut pending = VecDeque::new();
    let (mut hits, mut total, mut swaps, mut all_swaps) = (0u64, 0u64, 0u64, 0u64);
    let (mut late_hits, mut late_total) = (0u64, 0u64);
    println!("policy {policy:?}, start {start}, {n_hot} of {n_expert} hot per layer, every {every} steps, {per_batch} swaps a step");
    let mut keys = vec![0.0f64; n_expert];
    for step in 1..=steps {
        for (li, (l, _)) in own.iter().enumerate() {
            let w = &weights[li];
            // n_used distinct experts in proportion to w (Efraimidis-Spirakis keys).
            for (k, &x) in keys.iter_mut().zip(w) {
                *k = rng.unit().ln() / x;
            }
            let mut ids: Vec<usize> = (0..n_expert).collect();
            ids.select_nth_unstable_by(n_used - 1, |&a, &b| keys[b].total_cmp(&keys[a]));
            let sel: Vec<i32> = ids[..n_used].iter().map(|&e| e as i32).collect();
            let on_device = &device[li];
            let h = sel.iter().filter(|&&e| on_device.contains(&(e as u32))).count() as u64;
            let t = read_us * (n_used as u64 - h) as f64;
            us += t;
            if step > steps / 2 {
                late_us += t;
            }
            hits += h;
            total += n_used as u64;
            if step > steps / 2 {
                late_hits += h;
                late_total += n_used as u64;
            }
            adapter.observe(*l as i32, &sel);
        }
        if step % every == 0 {
            let room = (every as usize * per_batch).saturating_sub(pending.len());
            pending.extend(adapter.interval_at_most(room));
        }
        let t = base_us + swap_us * pending.len().min(per_batch) as f64;
        us += t;
        if step > steps / 2 {
            late_us += t;
        }
        for _ in 0..per_batch {
            let Some(s) = pending.pop_front() else { break };
            if let Some(li) = own.iter().position(|(l, _)| *l as i32 == s.layer) {
                device[li][s.slot] = s.into;
            }
            swaps += 1;
            all_swaps += 1;
        }
        if step % window == 0 {
            println!("steps {step:>6}: hit rate {:.4}, swaps {swaps}, modelled {:.1} t/s", hits as f64 / total.max(1) as f64, window as f64 * 1e6 / us);
            (hits, total, swaps, us) = (0, 0, 0, 0.0);
        }
    }
    println!(
        "second half: hit rate {:.4}, modelled {:.1} t/s; {all_swaps} swaps in {steps} steps ({:.2} a step)",
        late_hits as f64 / late_total.max(1) as f64,
        (steps - steps / 2) as f64 * 1e6 / late_us,
        all_swaps as f64 / steps as f64
    );
}
