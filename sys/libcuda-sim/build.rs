//! Gives the library the soname `libcuda.so`, the first name cudarc's loader asks for: once a
//! process has opened the library by its path, the dynamic loader answers a later
//! `dlopen("libcuda.so")` with it (glibc matches names against the sonames of loaded objects
//! before it searches the file system), so cudarc finds it without `LD_LIBRARY_PATH`.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
