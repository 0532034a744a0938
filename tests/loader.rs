//! Opening driver libraries: a missing library, the toolkit's stub library, a driver without
//! devices, one without `cuInit`, an old driver, one without the pool entry points, and one whose
//! device has no memory pools each give their own typed error, with a message that names what is
//! missing and the versions found, never a panic. The libraries are stand-ins built by `build.rs`
//! from `fake_driver/libcuda.rs`.

use std::mem::discriminant;
use std::path::PathBuf;
use std::process::Command;

use steppool_sys::{CUresult, CudaLibrary, Driver, DriverError, DriverVersion, LoadError, PoolProps, PoolRequirement};

/// The pool entry points a driver must export for steppool's pools.
const POOL_ENTRY_POINTS: [&str; 7] = [
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
];

fn fake(variant: &str) -> PathBuf {
    PathBuf::from(env!("FAKE_DRIVER_DIR")).join(variant).join("libcuda.so.1")
}

fn open(variant: &str) -> Result<CudaLibrary, LoadError> {
    // SAFETY: the fake libraries export driver entry points with the signatures of cuda.h.
    unsafe { CudaLibrary::open_path(fake(variant)) }
}

/// Starts the fake `variant` as [`Driver::cuda`] would: memory pools required.
fn start(variant: &str) -> Result<Driver, LoadError> {
    Driver::from_library(open(variant).unwrap())
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
fn a_driver_with_pools_opens_with_them_required() {
    let driver = start("pools").unwrap();
    assert_eq!(driver.pool_requirement(), PoolRequirement::Required);
    assert_eq!(driver.driver_version().unwrap(), DriverVersion(12090));
    assert!(driver.memory_pools_supported(0).unwrap());
    assert_eq!(driver.device_name(0).unwrap(), "Fake GPU");
    assert_eq!(driver.describe(), format!("CUDA driver 12.9 ({})", fake("pools").display()));
}

#[test]
fn an_old_driver_is_too_old_for_pools_and_says_which_version_it_is() {
    let error = start("old").unwrap_err();
    match &error {
        LoadError::DriverTooOld { library, driver_version, required, missing } => {
            assert!(library.ends_with("old/libcuda.so.1"), "{library}");
            assert_eq!(*driver_version, Some(DriverVersion(11010)));
            assert_eq!(*required, DriverVersion::MEMORY_POOLS);
            assert_eq!(missing, &POOL_ENTRY_POINTS, "an 11.1 driver has none of them");
        }
        other => panic!("expected DriverTooOld, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("driver 11.1") && text.contains("need driver 11.2 or later"), "{text}");
    assert!(text.contains("it lacks cuMemPoolCreate, cuMemPoolDestroy"), "{text}");
}

#[test]
fn an_old_driver_opens_when_pools_are_optional_and_its_pool_calls_name_the_missing_entry_point() {
    let library = open("old").unwrap();
    assert_eq!(library.driver_version(), Some(DriverVersion(11010)));
    assert!(library.table().cuMemPoolCreate.is_none() && library.table().cuInit.is_some());
    let driver = Driver::from_library_with(library, PoolRequirement::Optional).unwrap();
    assert_eq!(driver.pool_requirement(), PoolRequirement::Optional);
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
fn a_driver_without_the_pool_entry_points_is_too_old_whatever_version_it_reports() {
    let error = start("nopoolcalls").unwrap_err();
    match &error {
        LoadError::DriverTooOld { driver_version, missing, .. } => {
            assert_eq!(*driver_version, Some(DriverVersion(12090)));
            assert_eq!(missing, &POOL_ENTRY_POINTS);
        }
        other => panic!("expected DriverTooOld, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("driver 12.9") && text.contains("it lacks cuMemPoolCreate"), "{text}");
    assert!(text.contains("entry points of driver 11.2 and later") && !text.contains("need driver"), "{text}");
}

#[test]
fn devices_without_pools_are_refused_unless_pools_are_optional() {
    let error = start("nopools").unwrap_err();
    match &error {
        LoadError::PoolsUnsupported { library, driver_version, devices } => {
            assert!(library.ends_with("nopools/libcuda.so.1"), "{library}");
            assert_eq!(*driver_version, Some(DriverVersion(12090)));
            assert_eq!(*devices, 1);
        }
        other => panic!("expected PoolsUnsupported, got {other:?}"),
    }
    let text = error.to_string();
    assert!(text.contains("none of the 1 device(s)") && text.contains("driver 12.9"), "{text}");
    assert!(text.contains("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0"), "{text}");
    assert!(text.contains("PoolRequirement::Optional"), "the way out is named: {text}");

    let driver = Driver::from_library_with(open("nopools").unwrap(), PoolRequirement::Optional).unwrap();
    assert!(!driver.memory_pools_supported(0).unwrap());
}

#[test]
fn a_runtime_refuses_a_device_without_pools_when_the_driver_requires_them() {
    // Device 0 has pools, so the driver opens with them required; device 1 has none.
    let runtime = steppool::Runtime::with_driver(start("mixed").unwrap()).unwrap();
    assert_eq!(runtime.device_count(), 2);
    let error = runtime.device(1).unwrap_err();
    match &error {
        steppool::Error::PoolsUnsupported { ordinal, name, driver_version } => {
            assert_eq!((*ordinal, name.as_str(), driver_version.as_str()), (1, "Fake GPU", "12.9"));
        }
        other => panic!("expected PoolsUnsupported, got {other:?}"),
    }
    assert!(error.to_string().contains("PoolRequirement::Optional"), "the way out is named: {error}");

    // Asked for, the fallback goes on to open the device: here it stops at the first entry point
    // this fake lacks, past the pool check.
    let optional = Driver::from_library_with(open("mixed").unwrap(), PoolRequirement::Optional).unwrap();
    let runtime = steppool::Runtime::with_driver(optional).unwrap();
    match runtime.device(1).unwrap_err() {
        steppool::Error::Driver(DriverError::MissingSymbol { symbol, .. }) => {
            assert_eq!(symbol, "cuDevicePrimaryCtxRetain")
        }
        other => panic!("expected the missing context entry point, got {other:?}"),
    }
}

#[test]
fn the_stub_library_fails_to_start_with_its_code_and_description() {
    let error = start("stub").unwrap_err();
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
fn a_driver_without_devices_says_so_whether_it_starts_or_not() {
    for variant in ["nodevice", "initnodevice"] {
        for pools in [PoolRequirement::Required, PoolRequirement::Optional] {
            let error = Driver::from_library_with(open(variant).unwrap(), pools).unwrap_err();
            match &error {
                LoadError::NoDevice { library, driver_version: Some(DriverVersion(12090)) } => {
                    assert!(library.ends_with(&format!("/{variant}/libcuda.so.1")), "{library}");
                }
                other => panic!("{variant}: expected NoDevice, got {other:?}"),
            }
            assert!(error.to_string().ends_with("(driver 12.9) reports no device"), "{error}");
        }
    }
}

#[test]
fn a_library_without_cuinit_is_refused_at_open() {
    match open("noinit") {
        Err(LoadError::MissingSymbol { symbol: "cuInit", driver_version: Some(DriverVersion(12090)), .. }) => {}
        other => panic!("expected a missing cuInit, got {other:?}"),
    }
}

#[test]
fn every_reason_gets_its_own_variant_and_message() {
    // SAFETY: nothing is loaded: the path does not exist.
    let missing = unsafe { CudaLibrary::open_path("/nonexistent/libcuda.so.1") }.map(|_| ());
    let errors: Vec<LoadError> = [
        missing,
        open("noinit").map(|_| ()),
        start("stub").map(|_| ()),
        start("nodevice").map(|_| ()),
        start("old").map(|_| ()),
        start("nopools").map(|_| ()),
    ]
    .into_iter()
    .map(Result::unwrap_err)
    .collect();
    for (i, a) in errors.iter().enumerate() {
        for b in &errors[i + 1..] {
            assert_ne!(discriminant(a), discriminant(b), "{a:?} and {b:?}");
            assert_ne!(a.to_string(), b.to_string());
        }
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
fn an_unset_or_empty_selection_means_the_real_driver_and_never_falls_back() {
    let library = fake("nodevice");
    for device in [None, Some("")] {
        let mut env = vec![("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap())];
        env.extend(device.map(|value| ("STEPPOOL_DEVICE", value)));
        let (ok, stdout, stderr) = probe(&env);
        assert!(!ok, "{stdout}");
        assert!(stderr.contains("reports no device"), "the reason is given: {stderr}");
        assert!(!stderr.contains("simulated"), "no fallback unless asked: {stderr}");
    }
    let library = fake("pools");
    let (ok, stdout, stderr) = probe(&[("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap())]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("driver: CUDA driver 12.9") && stdout.contains("devices: 1"), "{stdout}");
    assert!(stdout.contains("0: Fake GPU, 16 GiB, compute capability 9.0, memory pools: yes"), "{stdout}");
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn auto_selection_falls_back_to_the_simulated_device_and_says_so_once() {
    for (variant, reason) in [("nodevice", "reports no device"), ("old", "need driver 11.2 or later")] {
        let library = fake(variant);
        let (ok, stdout, stderr) = probe(&[
            ("STEPPOOL_DEVICE", "auto"),
            ("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap()),
            ("STEPPOOL_SIM_DEVICES", "2x16GiB"),
        ]);
        assert!(ok, "{stderr}");
        assert!(stdout.contains("simulated device (2 × 16 GiB, 2 MiB granules, 32 MiB pool units)"), "{stdout}");
        assert!(stdout.contains("devices: 2"), "{stdout}");
        assert_eq!(stderr.matches("using the simulated device").count(), 1, "{stderr}");
        assert!(stderr.contains(reason), "{variant}: the reason is given: {stderr}");
    }
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
fn the_old_fake_driver_is_refused_through_the_environment_with_its_version() {
    let library = fake("old");
    let (ok, stdout, stderr) =
        probe(&[("STEPPOOL_DEVICE", "cuda"), ("STEPPOOL_CUDA_LIBRARY", library.to_str().unwrap())]);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("driver 11.1") && stderr.contains("need driver 11.2 or later"), "{stderr}");
}
