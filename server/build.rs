// Lets the binary find libllama and the backend modules from the ffi build (rpath), since
// link arguments of a dependency's build script do not reach this crate's binaries.
fn main() {
    let lib_dir = std::env::var("DEP_LLAMA_LIB_DIR").expect("strata-ffi exports lib_dir");
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN:{lib_dir}");
}
