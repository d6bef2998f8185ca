use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::repo;

fn tmp(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fetch(env: &[(&str, &Path)]) -> (i32, String) {
    let out = Command::new("bash").arg(repo().join("vendor/fetch")).envs(env.iter().map(|(k, v)| (*k, v.as_os_str()))).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn pin_file() -> String {
    let pin = std::fs::read_to_string(repo().join("vendor/pin.env")).unwrap();
    pin.lines().find_map(|l| l.strip_prefix("PIN_FILE=")).unwrap().to_string()
}

#[test]
fn a_tarball_with_the_wrong_checksum_is_refused() {
    let cache = tmp("fetch-bad-sum");
    std::fs::write(cache.join(pin_file()), b"not the pinned release").unwrap();
    let out = cache.join("out");
    let (code, err) = fetch(&[("STRATA_VENDOR_CACHE", &cache), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(!out.exists(), "nothing may be extracted from a bad tarball");
}

#[test]
fn a_series_with_a_broken_patch_is_refused_and_a_good_one_applies_once() {
    let patches = tmp("fetch-patches");
    let out = patches.join("out");
    for e in std::fs::read_dir(repo().join("patches")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, patches.join(p.file_name().unwrap())).unwrap();
    }
    let (code, err) = fetch(&[("STRATA_PATCHES", &patches), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.join("include/strata-hooks.h").exists());
    assert!(out.join("ggml/src/ggml-cuda/strata/expert-windows.cuh").exists());
    let (code, err) = fetch(&[("STRATA_PATCHES", &patches), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 0);
    assert!(!err.contains("applying"), "a second run must be a no-op: {err}");

    std::fs::write(
        patches.join("9999-broken.patch"),
        "--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n-this line is not in llama.cpp\n+nor is this\n context\n",
    )
    .unwrap();
    let mut series = std::fs::read_to_string(patches.join("series")).unwrap();
    series.push_str("9999-broken.patch\n");
    std::fs::write(patches.join("series"), series).unwrap();
    let (code, err) = fetch(&[("STRATA_PATCHES", &patches), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("patch 9999-broken.patch does not apply"), "{err}");
    assert!(out.join("include/strata-hooks.h").exists(), "a failed re-apply must keep the last good tree");
}

#[test]
fn the_kernels_the_patches_include_are_installed_and_a_change_to_them_re_applies() {
    let dir = tmp("fetch-kernels");
    let kernels = dir.join("kernels");
    let out = dir.join("out");
    assert!(Command::new("cp").arg("-R").arg(repo().join("kernels")).arg(&kernels).status().unwrap().success());
    let (code, err) = fetch(&[("STRATA_KERNELS", &kernels), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 0, "{err}");
    let cu = std::fs::read_to_string(out.join("ggml/src/ggml-cuda/ggml-cuda.cu")).unwrap();
    let included: Vec<&str> = cu.lines().filter_map(|l| l.strip_prefix("#include \"strata/")).map(|l| l.trim_end_matches('"')).collect();
    assert!(included.len() >= 2, "{included:?}");
    for f in &included {
        let installed = std::fs::read(out.join("ggml/src/ggml-cuda/strata").join(f)).unwrap();
        assert_eq!(installed, std::fs::read(kernels.join("cuda").join(f)).unwrap(), "{f}");
    }

    std::fs::write(kernels.join("README.md"), "not part of the build\n").unwrap();
    let (code, err) = fetch(&[("STRATA_KERNELS", &kernels), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("applying"), "the README is not part of the build: {err}");

    let changed = kernels.join("cuda").join(included[0]);
    let mut src = std::fs::read_to_string(&changed).unwrap();
    src.push_str("// changed\n");
    std::fs::write(&changed, &src).unwrap();
    let (code, err) = fetch(&[("STRATA_KERNELS", &kernels), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("applying"), "a changed kernel must re-apply: {err}");
    assert_eq!(std::fs::read_to_string(out.join("ggml/src/ggml-cuda/strata").join(included[0])).unwrap(), src);

    let (code, err) = fetch(&[("STRATA_KERNELS", &dir.join("none")), ("STRATA_VENDOR_OUT", &out)]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("no kernels/install"), "{err}");
}

#[test]
fn a_missing_tool_is_named() {
    let bin = tmp("fetch-path");
    for tool in ["bash", "tar", "sha256sum", "dirname", "cat", "grep", "cut", "mkdir"] {
        let real = which(tool);
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    let out = Command::new(bin.join("bash")).arg(repo().join("vendor/fetch")).env("PATH", &bin).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("missing tool 'patch'"), "{err}");
}

fn which(tool: &str) -> PathBuf {
    let out = Command::new("bash").args(["-c", &format!("command -v {tool}")]).output().unwrap();
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A small tree holding only the files the series touches (read from the patches), copied from
/// the pristine pin.
fn mini_tree(name: &str) -> PathBuf {
    let out = Command::new("bash").arg(repo().join("vendor/fetch")).arg("--pristine").output().unwrap();
    let pristine = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let tree = tmp(name);
    // include/llama.h marks a llama.cpp tree for tools/repin.
    let mut files: Vec<String> = vec!["include/llama.h".into()];
    for entry in std::fs::read_dir(repo().join("patches")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "patch") {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                if let Some(f) = line.strip_prefix("+++ b/") {
                    files.push(f.to_string());
                }
            }
        }
    }
    files.sort();
    files.dedup();
    for f in files.iter().filter(|f| pristine.join(f).exists()) {
        std::fs::create_dir_all(tree.join(f).parent().unwrap()).unwrap();
        std::fs::copy(pristine.join(f), tree.join(f)).unwrap();
    }
    tree
}

fn repin(tree: &Path) -> (i32, String) {
    let out = Command::new(repo().join("tools/repin")).arg(tree).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn results(report: &str) -> Vec<&str> {
    report.lines().skip(1).map(|l| l.split_whitespace().next().unwrap()).collect()
}

fn edit(path: &Path, from: &str, to: &str) {
    let s = std::fs::read_to_string(path).unwrap();
    assert!(s.contains(from));
    std::fs::write(path, s.replacen(from, to, 1)).unwrap();
}

#[test]
fn repin_reports_applied_fuzzed_and_failed() {
    let (code, report) = repin(&mini_tree("repin-same"));
    assert_eq!(code, 0, "{report}");
    assert!(results(&report).iter().all(|r| *r == "applied"), "{report}");
    assert!(report.lines().last().unwrap().ends_with(" kernels/"), "{report}");

    let fuzzy = mini_tree("repin-fuzzy");
    edit(&fuzzy.join("src/llama-model.cpp"), "#include \"llama-ext.h\"", "#include \"llama-ext-renamed.h\"");
    let (code, report) = repin(&fuzzy);
    assert_eq!(code, 0, "{report}");
    assert_eq!(results(&report)[0], "fuzzed", "{report}");

    let broken = mini_tree("repin-broken");
    edit(
        &broken.join("src/llama-model.cpp"),
        "void llama_model_free(llama_model * model) {\n    delete model;",
        "void llama_model_free(llama_model * m) {\n    delete m;",
    );
    let (code, report) = repin(&broken);
    assert_eq!(code, 1, "{report}");
    assert_eq!(results(&report)[0], "failed", "{report}");
}
