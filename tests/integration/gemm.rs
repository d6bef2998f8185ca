//! The GEMM table variables on a machine without a GPU: a table made for another GPU is refused
//! with the mismatch named and the server serves with the default kernels; bad values of the
//! variables stop it with a clear message.

use serde_json::json;

use crate::support::{model, run_server, Server};

const MODEL: &str = "tiny-qwen3moe-iq3.gguf";

fn table(dir: &std::path::Path, arch: &str) -> std::path::PathBuf {
    let p = dir.join(format!("gemm-{arch}.txt"));
    let text = format!(
        "strata-gemm-table 1\nvalidator arch {arch}\nvalidator runtime 13000\nvalidator blaslt 130100\nf16 f32 4096 512 2048 2048 2048 4096 blaslt 3 1048576 1.21\n"
    );
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_table_for_another_gpu_is_refused_and_the_server_serves() {
    let m = model(MODEL);
    let m = m.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("strata-gemm-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wrong = table(&dir, "sm_89");
    let env = [("STRATA_HIPBLASLT_TUNING", wrong.to_str().unwrap()), ("STRATA_GEMM_DEVICE", "sm_90 13000 130100")];
    let s = Server::start(&["-m", m, "-c", "1024", "--metrics"], &env);
    let (status, v) = s.post("/completion", &json!({"prompt": "The tide", "n_predict": 8, "temperature": 0}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tokens_predicted"], 8);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("refused: the table is for arch sm_89, this machine has arch sm_90: tune it here with tools/tune-gemm"), "{log}");
    assert!(!log.contains("has no effect"), "{log}");
    drop(s);

    // The table of this (described) device is accepted; without a GPU backend it cannot be installed.
    let right = table(&dir, "sm_90");
    let env = [("STRATA_HIPBLASLT_TUNING", right.to_str().unwrap()), ("STRATA_GEMM_DEVICE", "sm_90 13000 130100")];
    let s = Server::start(&["-m", m, "-c", "1024"], &env);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("1 tuned shapes for sm_90 (runtime 13000, BLASLt 130100), median speedup 1.21x"), "{log}");
    assert!(log.contains("GEMM dispatch not installed: no GPU backend"), "{log}");
    drop(s);

    // A file that is not a table, and one that is not there: refused, the server serves.
    let garbage = dir.join("garbage.bin");
    std::fs::write(&garbage, [0u8, 159, 146, 150, 255, 10, 1]).unwrap();
    let missing = dir.join("missing.txt");
    for (path, want) in [(&garbage, "refused: not a Strata GEMM table"), (&missing, "refused: No such file or directory")] {
        let env = [("STRATA_HIPBLASLT_TUNING", path.to_str().unwrap()), ("STRATA_GEMM_DEVICE", "sm_90 13000 130100")];
        let s = Server::start(&["-m", m, "-c", "1024"], &env);
        let (status, _) = s.post("/completion", &json!({"prompt": "The tide", "n_predict": 2}));
        assert_eq!(status, 200);
        let log = s.log.lock().unwrap().clone();
        assert!(log.contains(want), "{log}");
    }

    // No description and no GPU: nothing to check the table against.
    let s = Server::start(&["-m", m, "-c", "1024"], &[("STRATA_HIPBLASLT_TUNING", right.to_str().unwrap())]);
    let log = s.log.lock().unwrap().clone();
    assert!(log.contains("refused: there is no GPU backend with Strata's GEMM dispatch to check it against"), "{log}");
    drop(s);

    for (var, value, want) in [
        ("STRATA_PREFILL_MMQ", "yes", "STRATA_PREFILL_MMQ: invalid value 'yes': expected 1, true, on or enabled"),
        ("STRATA_GEMM_DEVICE", "sm_90", "STRATA_GEMM_DEVICE: invalid value 'sm_90'"),
    ] {
        let mut env = vec![(var, value)];
        if var == "STRATA_GEMM_DEVICE" {
            env.push(("STRATA_HIPBLASLT_TUNING", right.to_str().unwrap()));
        }
        let out = run_server(&["-m", m], &env);
        assert_eq!(out.status, 1, "{}", out.stderr);
        assert!(out.stderr.contains(want), "{}", out.stderr);
    }
}
