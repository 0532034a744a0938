//! Opening driver libraries: a missing library, a library without the pool entry points (an old
//! driver), the toolkit's stub library, a driver without devices, and one without `cuInit` each
//! give a typed error that names what is missing, never a panic. The libraries are stand-ins
//! built by `build.rs` from `fake_driver/libcuda.rs`.

use std::path::PathBuf;
use std::process::Command;

use steppool_sys::{CUresult, CudaLibrary, Driver, DriverError, DriverVersion, LoadError, PoolProps};

fn fake(variant: &str) -> PathBuf {
    PathBuf::from(env!("FAKE_DRIVER_DIR")).join(variant).join("libcuda.so.1")
}

fn open(variant: &str) -> Result<CudaLibrary, LoadError> {
    // SAFETY: the fake libraries export driver entry points with the signatures of cuda.h.
    unsafe { CudaLibrary::open_path(fake(variant)) }
}

#[test]
fn a_missing_library_is_a_typed_error_naming_the_path() {
    // SAFETY: nothing is loaded: the path does not exist.
    let error = unsafe { CudaLibrary::open_path("/nonexistent/libcuda.so.1") }.unwrap_err();
    match &error {
        LoadError::LibraryNotFound { tried, reason } => {
            assert_eq!(tried, &["/nonexistent/libcuda.so.1"]);
            assert!(!reason.is_empty());
        }
        other => panic!("expected LibraryNotFound, got {other:?}"),
    }
    assert!(error.to_string().contains("/nonexistent/libcuda.so.1"), "{error}");
}

#[test]
fn an_old_driver_opens_but_its_pool_calls_name_the_missing_entry_point() {
    let library = open("old").unwrap();
    assert_eq!(library.driver_version(), Some(DriverVersion(11010)));
    assert!(library.table().cuMemPoolCreate.is_none() && library.table().cuInit.is_some());
    let driver = Driver::from_library(library).unwrap();
    assert_eq!(driver.driver_version().unwrap(), DriverVersion(11010));
    assert!(!driver.memory_pools_supported(0).unwrap(), "11.1 predates memory pools");
    let error = driver.mem_pool_create(&PoolProps::device(0).build()).unwrap_err();
    match &error {
        DriverError::MissingSymbol { symbol, driver_version, library } => {
            assert_eq!(*symbol, "cuMemPoolCreate");
            assert_eq!(*driver_version, Some(DriverVersion(11010)));
            assert!(library.ends_with("old/libcuda.so.1"), "{library}");
        }
        other => panic!("expected MissingSymbol, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("cuMemPoolCreate") && text.contains("11.1"), "{text}");
    // SAFETY: the stream handle is never dereferenced: the entry point is missing.
    let alloc = unsafe { driver.mem_alloc_async(512, std::ptr::null_mut()) };
    assert!(matches!(alloc, Err(DriverError::MissingSymbol { symbol: "cuMemAllocAsync", .. })));
}

#[test]
fn the_stub_library_fails_to_start_with_its_code_and_description() {
    let error = Driver::from_library(open("stub").unwrap()).unwrap_err();
    match &error {
        LoadError::Init { source, driver_version, .. } => {
            assert_eq!(source.code(), Some(CUresult::CUDA_ERROR_STUB_LIBRARY));
            assert_eq!(*driver_version, Some(DriverVersion(12090)));
        }
        other => panic!("expected Init, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("cuInit") && text.contains("CUDA_ERROR_STUB_LIBRARY (34)"), "{text}");
    assert!(text.contains("fake driver: this is a stub library"), "the driver's own description: {text}");
}

#[test]
fn a_driver_without_devices_says_so() {
    let error = Driver::from_library(open("nodevice").unwrap()).unwrap_err();
    assert!(matches!(error, LoadError::NoDevice { driver_version: DriverVersion(12090), .. }), "{error:?}");
}

#[test]
fn a_library_without_cuinit_is_refused_at_open() {
    match open("noinit") {
        Err(LoadError::MissingSymbol { symbol: "cuInit", driver_version: Some(DriverVersion(12090)), .. }) => {}
        other => panic!("expected a missing cuInit, got {other:?}"),
    }
}

/// Runs `device-probe` with the given environment (and none of the caller's steppool variables).
fn probe(env: &[(&str, &str)]) -> (bool, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_device-probe"));
    for variable in ["STEPPOOL_DEVICE", "STEPPOOL_CUDA_LIBRARY", "STEPPOOL_SIM_DEVICES", "STEPPOOL_SIM_GRANULE"] {
        command.env_remove(variable);
    }
    let output = command.envs(env.iter().copied()).output().expect("running device-probe");
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (output.status.success(), text(output.stdout), text(output.stderr))
}

#[test]
fn cuda_selection_without_a_driver_fails_with_the_loader_error() {
    let (ok, _, stderr) = probe(&[("STEPPOOL_DEVICE", "cuda"), ("STEPPOOL_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")]);
    assert!(!ok);
    assert!(stderr.contains("could not open the CUDA driver library") && stderr.contains("/nonexistent"), "{stderr}");
}

#[test]
fn auto_selection_falls_back_to_the_simulated_device_and_says_so_once() {
    let library = fake("nodevice");
    let (ok, stdout, stderr) =
        probe(&[("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap()), ("STEPPOOL_SIM_DEVICES", "2x16GiB")]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("simulated device (2 × 16 GiB, 2 MiB granules)"), "{stdout}");
    assert!(stdout.contains("devices: 2"), "{stdout}");
    assert_eq!(stderr.matches("using the simulated device").count(), 1, "{stderr}");
    assert!(stderr.contains("reports no device"), "the reason is given: {stderr}");
}

#[test]
fn sim_selection_and_bad_values_are_explicit() {
    let (ok, stdout, stderr) = probe(&[("STEPPOOL_DEVICE", "sim"), ("STEPPOOL_SIM_GRANULE", "64KiB")]);
    assert!(ok && stdout.contains("1 × 80 GiB, 64 KiB granules") && stderr.is_empty(), "{stdout}{stderr}");
    let (ok, _, stderr) = probe(&[("STEPPOOL_DEVICE", "gpu-please")]);
    assert!(!ok && stderr.contains("STEPPOOL_DEVICE=`gpu-please`"), "{stderr}");
    let (ok, _, stderr) = probe(&[("STEPPOOL_DEVICE", "sim"), ("STEPPOOL_SIM_DEVICES", "lots")]);
    assert!(!ok && stderr.contains("lots"), "{stderr}");
}

#[test]
fn the_old_fake_driver_is_usable_through_the_environment() {
    let library = fake("old");
    let (ok, stdout, stderr) =
        probe(&[("STEPPOOL_DEVICE", "cuda"), ("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap())]);
    assert!(!ok, "the probe needs device names, which the fake lacks: {stdout}");
    assert!(stderr.contains("cuDeviceGetName") && stderr.contains("11.1"), "{stderr}");
}
