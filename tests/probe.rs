//! `device-probe`: which driver steppool selects here, and what its devices are.
//!
//! Honours `STEPPOOL_DEVICE`, `STEPPOOL_CUDA_LIBRARY` and `STEPPOOL_SIM_DEVICES` as
//! [`Driver::from_env`] does: with `STEPPOOL_DEVICE` unset it asks for the real driver, with
//! memory pools, and says why it cannot have one; `STEPPOOL_DEVICE=auto` allows the simulated
//! device. Exits with status 1 and the loader's message when no driver can be used.

use std::process::ExitCode;

use steppool_sys::bytes::Bytes;
use steppool_sys::{CUdevice_attribute, Driver};

fn main() -> ExitCode {
    let driver = match Driver::from_env() {
        Ok(driver) => driver,
        Err(error) => {
            eprintln!("device-probe: {error}");
            return ExitCode::FAILURE;
        }
    };
    match describe(&driver) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("device-probe: {error}");
            ExitCode::FAILURE
        }
    }
}

fn describe(driver: &Driver) -> Result<String, steppool_sys::DriverError> {
    use CUdevice_attribute as A;
    let mut text = format!("driver: {}\n", driver.describe());
    text += &format!("driver version: {}\n", driver.driver_version()?);
    let count = driver.device_count()?;
    text += &format!("devices: {count}\n");
    for ordinal in 0..count {
        let device = driver.device(ordinal)?;
        let major = driver.device_attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = driver.device_attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        text += &format!(
            "  {ordinal}: {}, {}, compute capability {major}.{minor}, memory pools: {}\n",
            driver.device_name(device)?,
            Bytes(driver.device_total_memory(device)?),
            if driver.memory_pools_supported(device)? { "yes" } else { "no" },
        );
    }
    Ok(text)
}
