//! Fetches and patches the pinned llama.cpp (vendor/fetch), builds it with CMake as shared
//! libraries with dynamically loaded backends, compiles the C++ shim over `common`, and
//! generates bindings for llama.h, ggml, gguf, the hook ABI and the shim.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// CPU ISA baseline: a native build dies with SIGILL in ggml's AMX kernel on some hosts, and the
/// GPU host must run the same binary, so the CPU backend targets AVX2-class x86_64 explicitly.
const X86_64_ISA: &[(&str, &str)] = &[
    ("GGML_AVX", "ON"),
    ("GGML_AVX2", "ON"),
    ("GGML_FMA", "ON"),
    ("GGML_F16C", "ON"),
    ("GGML_BMI2", "ON"),
    ("GGML_AVX512", "OFF"),
    ("GGML_AMX_TILE", "OFF"),
    ("GGML_AMX_INT8", "OFF"),
    ("GGML_AMX_BF16", "OFF"),
];

const DEFAULT_CUDA_ARCHS: &str = "90";
const DEFAULT_HIP_TARGETS: &str = "gfx1100";

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let repo = manifest.parent().unwrap().to_path_buf();
    for p in ["vendor/pin.env", "vendor/fetch", "patches", "kernels", "ffi/shim"] {
        println!("cargo:rerun-if-changed={}", repo.join(p).display());
    }
    println!("cargo:rerun-if-env-changed=STRATA_CUDA_ARCHS");
    println!("cargo:rerun-if-env-changed=STRATA_HIP_TARGETS");

    let status = Command::new("bash").arg(repo.join("vendor/fetch")).status().expect("cannot run bash for vendor/fetch");
    if !status.success() {
        panic!("vendor/fetch failed ({status}); its message above says why");
    }
    let src = repo.join("vendor/llama.cpp");
    println!("cargo:rerun-if-changed={}", src.join(".strata-stamp").display());

    let lib_dir = build_llama(&src);
    build_shim(&manifest, &src);
    link(&lib_dir, &src);
    bindings(&manifest, &src);
}

/// One CMake build per backend set, shared by every cargo profile (llama.cpp is always Release).
fn build_llama(src: &Path) -> PathBuf {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let target_dir = out.ancestors().nth(4).expect("OUT_DIR is target/<profile>/build/<pkg>/out");
    let mut variant = String::from("cpu");
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let hip = env::var_os("CARGO_FEATURE_HIP").is_some();
    if cuda {
        variant.push_str("-cuda");
    }
    if hip {
        variant.push_str("-hip");
    }
    let build_root = target_dir.join("llama.cpp").join(&variant);
    std::fs::create_dir_all(&build_root).expect("create the llama.cpp build directory");
    // Canonical paths: checkouts that link to one shared build configure it identically.
    let build_root = build_root.canonicalize().expect("canonical build directory");
    let src = &src.canonicalize().expect("canonical llama.cpp source directory");
    let bin = build_root.join("build").join("bin");

    let mut cfg = cmake::Config::new(src);
    cfg.out_dir(&build_root)
        .profile("Release")
        .build_target("all")
        .define("BUILD_SHARED_LIBS", "ON")
        .define("GGML_BACKEND_DL", "ON")
        .define("GGML_BACKEND_DIR", &bin)
        .define("GGML_NATIVE", "OFF")
        .define("GGML_CPU", "ON")
        // the RPC backend module, for --rpc (llama-server's distributed inference)
        .define("GGML_RPC", "ON")
        .define("LLAMA_BUILD_COMMON", "ON")
        .define("LLAMA_BUILD_TESTS", "OFF")
        .define("LLAMA_BUILD_EXAMPLES", "OFF")
        .define("LLAMA_BUILD_TOOLS", "OFF")
        .define("LLAMA_BUILD_SERVER", "OFF")
        .define("LLAMA_BUILD_APP", "OFF")
        .define("LLAMA_BUILD_UI", "OFF")
        .define("LLAMA_USE_PREBUILT_UI", "OFF")
        // HTTPS for -hf, -mu and the router's downloads, as llama-server's own default build has
        .define("LLAMA_OPENSSL", "ON")
        .define("LLAMA_BUILD_NUMBER", pin_build(src))
        .define("CMAKE_INSTALL_RPATH", "$ORIGIN")
        // The pin is no git checkout: keep build-info from reporting Strata's own commit.
        .env("GIT_CEILING_DIRECTORIES", src.parent().unwrap());
    if which("ninja") {
        cfg.generator("Ninja");
    }
    if env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        for (k, v) in X86_64_ISA {
            cfg.define(k, v);
        }
    }
    if cuda {
        let archs = env::var("STRATA_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_CUDA_ARCHS.into());
        cfg.define("GGML_CUDA", "ON").define("CMAKE_CUDA_ARCHITECTURES", archs);
    }
    if hip {
        let targets = env::var("STRATA_HIP_TARGETS").unwrap_or_else(|_| DEFAULT_HIP_TARGETS.into());
        cfg.define("GGML_HIP", "ON").define("GPU_TARGETS", targets);
    }
    cfg.build();
    bin
}

fn pin_build(src: &Path) -> String {
    let pin = std::fs::read_to_string(src.join("../pin.env")).expect("vendor/pin.env");
    pin.lines().find_map(|l| l.strip_prefix("PIN_BUILD=")).expect("PIN_BUILD in vendor/pin.env").trim().to_string()
}

fn which(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

fn include_dirs(src: &Path) -> Vec<PathBuf> {
    // src: llama-ext.h, llama.cpp's memory accounting per buffer type
    ["include", "common", "ggml/include", "vendor", "src"].iter().map(|d| src.join(d)).collect()
}

fn build_shim(manifest: &Path, src: &Path) {
    // Every .cpp in shim/ is one part of the shim; rerun-if-changed on the folder covers them all.
    let mut parts: Vec<PathBuf> = std::fs::read_dir(manifest.join("shim"))
        .expect("read the shim directory")
        .map(|e| e.expect("read a shim directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    parts.sort();
    let mut b = cc::Build::new();
    b.cpp(true).std("c++17").files(&parts).warnings(false);
    for d in include_dirs(src) {
        b.include(d);
    }
    b.compile("strata_shim");
}

fn link(lib_dir: &Path, src: &Path) {
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    for lib in ["llama-common", "llama", "ggml", "ggml-base"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    // Binaries find the libraries beside themselves first (a carried bundle), then in the build.
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN:{}", lib_dir.display());
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:rustc-env=STRATA_LLAMA_LIB_DIR={}", lib_dir.display());
    println!("cargo:src_dir={}", src.display());
    println!("cargo:rustc-env=STRATA_LLAMA_SRC_DIR={}", src.display());
}

fn bindings(manifest: &Path, src: &Path) {
    let mut b = bindgen::Builder::default()
        .header(manifest.join("shim/bindings.h").to_string_lossy())
        .allowlist_function("(llama|ggml|gguf|strata)_.*")
        .allowlist_type("(llama|ggml|gguf|strata)_.*")
        .allowlist_var("(LLAMA|GGML|GGUF|STRATA)_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for d in include_dirs(src) {
        b = b.clang_arg(format!("-I{}", d.display()));
    }
    b = b.clang_arg(format!("-I{}", manifest.join("shim").display()));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    b.generate().expect("bindgen failed").write_to_file(out.join("bindings.rs")).unwrap();
}
