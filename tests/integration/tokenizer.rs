use std::path::Path;

use strata_ffi::{Model, ModelParams};

/// Splits a pin vocab test pair (.inp / .out) into (text, expected tokens), as
/// tests/test-tokenizer-0.cpp in the pin reads them.
fn cases(inp: &Path, out: &Path) -> Vec<(String, Vec<i32>)> {
    let raw = std::fs::read_to_string(inp).unwrap();
    let mut texts: Vec<&str> = raw.split("\n__ggml_vocab_test__\n").collect();
    // A trailing separator ends the last case rather than starting an empty one.
    if raw.ends_with("\n__ggml_vocab_test__\n") {
        texts.pop();
    }
    let outs: Vec<Vec<i32>> = std::fs::read_to_string(out).unwrap().lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(texts.len(), outs.len(), "{}: input and output counts differ", inp.display());
    texts.into_iter().map(String::from).zip(outs).collect()
}

#[test]
fn every_pin_vocab_tokenizes_exactly_like_its_reference_vectors() {
    crate::support::quiet_llama_logs();
    let dir = Path::new(strata_ffi::LLAMA_SRC_DIR).join("models");
    let mut vocabs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .filter(|p| p.with_extension("gguf.inp").exists() && p.with_extension("gguf.out").exists())
        .collect();
    vocabs.sort();
    assert!(vocabs.len() >= 10, "expected the pin's vocab test files in {}", dir.display());
    let mut failures = Vec::new();
    let mut checked = 0;
    for v in &vocabs {
        let model = Model::load(v, &ModelParams::vocab_only()).unwrap();
        let vocab = model.vocab();
        for (text, want) in cases(&v.with_extension("gguf.inp"), &v.with_extension("gguf.out")) {
            let got = vocab.tokenize(&text, false, false).unwrap();
            checked += 1;
            if got != want {
                failures.push(format!("{}: {text:?}: got {got:?}, want {want:?}", v.file_name().unwrap().to_string_lossy()));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {checked} cases differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked > 300, "only {checked} cases checked");
}
