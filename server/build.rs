use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    // Lets the binary find libllama and the backend modules from the ffi build (rpath), since
    // link arguments of a dependency's build script do not reach this crate's binaries.
    let lib_dir = std::env::var("DEP_LLAMA_LIB_DIR").expect("strata-ffi exports lib_dir");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN:{lib_dir}");

    let repo = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).parent().unwrap().to_path_buf();
    println!("cargo:rustc-env=STRATA_GIT_COMMIT={}", git_commit(&repo));
    let table = ui_table(&repo.join("target/ui"));
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("ui_assets.rs");
    std::fs::write(&out, table).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}

/// The web UI that tools/build-ui prepared, as the source of a `&[Asset]` for src/ui.rs: one
/// `include_bytes!` per gzipped asset, or an empty table when there is no manifest.
fn ui_table(ui: &Path) -> String {
    let manifest = ui.join("manifest.tsv");
    println!("cargo:rerun-if-changed={}", manifest.display());
    let text = match std::fs::read_to_string(&manifest) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let hint = "run tools/build-ui, or STRATA_NO_UI=1 tools/build-ui to build without it";
            println!("cargo:warning=building without the web UI: {} is missing ({hint})", manifest.display());
            String::new()
        }
        Err(e) => panic!("{}: {e}", manifest.display()),
    };
    let mut table = String::from("&[\n");
    for line in text.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        let [name, etag, mime] = fields[..] else {
            panic!("{}: malformed line {line:?}; run tools/build-ui again", manifest.display());
        };
        let data = ui.join("gz").join(name);
        writeln!(table, "    Asset {{ name: {name:?}, etag: {etag:?}, mime: {mime:?}, data: include_bytes!({data:?}) }},").unwrap();
    }
    table.push(']');
    table
}

/// The commit the binary is built from (12 hex digits), or "unknown" outside a git checkout;
/// the build script runs again when HEAD moves.
fn git_commit(repo: &Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) else { return "unknown".into() };
    for path in ["HEAD", "packed-refs"]
        .iter()
        .map(|p| git(&["rev-parse", "--git-path", p]))
        .chain([git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r]))])
        .flatten()
    {
        let p = if Path::new(&path).is_absolute() { PathBuf::from(&path) } else { repo.join(&path) };
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    commit
}
