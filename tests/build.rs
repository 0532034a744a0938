//! Builds stand-ins for `libcuda.so.1` (from `fake_driver/libcuda.rs`) for the loader tests, one
//! per variant, with the rustc cargo builds with. Their folder reaches the tests as
//! `FAKE_DRIVER_DIR`; each variant is `FAKE_DRIVER_DIR/<variant>/libcuda.so.1`.

use std::path::PathBuf;
use std::process::Command;

const VARIANTS: &[&str] =
    &["pools", "mixed", "nopools", "old", "nopoolcalls", "stub", "nodevice", "initnodevice", "noinit"];

fn main() {
    let source = "fake_driver/libcuda.rs";
    println!("cargo:rerun-if-changed={source}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("fake_driver");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    for variant in VARIANTS {
        let dir = out.join(variant);
        std::fs::create_dir_all(&dir).expect("creating the fake driver folder");
        let status = Command::new(&rustc)
            .args(["--edition", "2024", "--crate-type", "cdylib", "--crate-name", "cuda", "-C", "opt-level=1"])
            .arg("--cfg")
            .arg(format!("variant=\"{variant}\""))
            .arg("-o")
            .arg(dir.join("libcuda.so.1"))
            .arg(source)
            .status()
            .expect("running rustc for the fake driver");
        assert!(status.success(), "rustc failed to build the `{variant}` fake driver");
    }
    println!("cargo:rustc-env=FAKE_DRIVER_DIR={}", out.display());
}
