//! --fit beside Strata's expert tiers, which upstream has no counterpart for. The rest of what
//! llama-server's common_init_from_params does is compared with upstream in
//! tests/python/test_init_parity.py.

use crate::support::{model, Server};

const SKIPPED: &str = "srv    load_model: --fit is skipped: the expert tiers size the model's use of GPU memory themselves";
const FITTING: &str = "cmn  common_init_: fitting params to device memory ...";

fn log_of(args: &[&str]) -> String {
    let s = Server::start(args, &[]);
    let log = s.log.lock().unwrap().clone();
    log
}

#[test]
fn fit_stands_aside_for_the_expert_tiers() {
    let m = model("tiny-qwen3moe-iq3.gguf");
    let m = m.to_str().unwrap();
    let plain = ["-m", m, "-c", "2048", "-lv", "4"];
    let tiers = [&plain[..], &["--mmap-experts", "--expert-cache", "30"]].concat();

    let log = log_of(&tiers);
    assert!(log.contains(SKIPPED) && !log.contains(FITTING), "{log}");
    let log = log_of(&[&tiers[..], &["-fit", "off"]].concat());
    assert!(!log.contains(SKIPPED) && !log.contains(FITTING), "{log}");
    let log = log_of(&plain);
    assert!(!log.contains(SKIPPED) && log.contains(FITTING), "{log}");
}
