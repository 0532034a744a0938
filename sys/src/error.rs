//! Errors of the device layer: loading a driver ([`LoadError`]) and calling it ([`DriverError`]),
//! plus `CUresult` and driver-version formatting.

use std::borrow::Cow;
use std::fmt;

use crate::bindings::CUresult;
use crate::sim::SimConfigError;

impl CUresult {
    /// `CUDA_SUCCESS`.
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for CUresult {
    /// `CUDA_ERROR_OUT_OF_MEMORY (2)`; a code the header does not know prints as `CUresult(1234)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "CUresult({})", self.0),
        }
    }
}

/// A CUDA driver version as `cuDriverGetVersion` reports it: `1000 * major + 10 * minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion(pub i32);

impl DriverVersion {
    /// CUDA 11.2, the first driver with stream-ordered allocation and memory pools.
    pub const MEMORY_POOLS: DriverVersion = DriverVersion(11020);

    /// The major version, `12` for 12.9.
    pub const fn major(self) -> i32 {
        self.0 / 1000
    }

    /// The minor version, `9` for 12.9.
    pub const fn minor(self) -> i32 {
        (self.0 % 1000) / 10
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major(), self.minor())
    }
}

/// Formats an optional driver version for messages.
struct MaybeVersion(Option<DriverVersion>);

impl fmt::Display for MaybeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(version) => write!(f, "driver {version}"),
            None => f.write_str("driver version unknown"),
        }
    }
}

/// A driver call that failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DriverError {
    /// The driver returned an error code.
    #[error("{call} failed with {code}: {description}")]
    Call {
        /// The entry point, by its exported name (`cuMemAllocFromPoolAsync`).
        call: &'static str,
        /// What it returned.
        code: CUresult,
        /// The driver's description of the code (`cuGetErrorString`).
        description: Cow<'static, str>,
    },
    /// The loaded driver does not export the entry point: it predates it.
    #[error(
        "the CUDA driver library {library} ({version}) has no entry point {symbol}; \
         a newer driver is needed for it",
        version = MaybeVersion(*driver_version)
    )]
    MissingSymbol {
        /// The entry point asked for.
        symbol: &'static str,
        /// The library that lacks it.
        library: String,
        /// The version of the loaded driver, when it could be read.
        driver_version: Option<DriverVersion>,
    },
}

impl DriverError {
    /// The code the driver returned, if the call was made.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            DriverError::Call { code, .. } => Some(*code),
            DriverError::MissingSymbol { .. } => None,
        }
    }

    /// Whether the driver reported `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.code() == Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Whether the error leaves the context unusable, so that every later call fails too: the
    /// sticky errors of a faulting kernel (illegal address or instruction, misaligned address,
    /// invalid address space or program counter, hardware stack error, launch failure, an
    /// uncorrectable ECC error), and a driver shutting down (`CUDA_ERROR_DEINITIALIZED`).
    pub fn is_sticky(&self) -> bool {
        self.code().is_some_and(|code| {
            [
                CUresult::CUDA_ERROR_DEINITIALIZED,
                CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
                CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
                CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR,
                CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
                CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
                CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE,
                CUresult::CUDA_ERROR_INVALID_PC,
                CUresult::CUDA_ERROR_LAUNCH_FAILED,
            ]
            .contains(&code)
        })
    }
}

/// Why no driver could be opened.
///
/// [`Driver::cuda`](crate::Driver::cuda) gives one variant per reason, in the order it checks
/// them: the library ([`LibraryNotFound`](Self::LibraryNotFound),
/// [`MissingSymbol`](Self::MissingSymbol)), the driver's start ([`Init`](Self::Init)), its devices
/// ([`NoDevice`](Self::NoDevice)), then memory pools ([`DriverTooOld`](Self::DriverTooOld),
/// [`PoolsUnsupported`](Self::PoolsUnsupported)).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate library could be opened.
    #[error("could not open the CUDA driver library (tried {tried}): {reason}", tried = .tried.join(", "))]
    LibraryNotFound {
        /// The names or paths tried, in order.
        tried: Vec<String>,
        /// The loader's message for the first one (the driver's soname, or the path asked for).
        reason: String,
    },
    /// The library lacks an entry point steppool cannot work without.
    #[error(
        "the CUDA driver library {library} ({version}) has no entry point {symbol}",
        version = MaybeVersion(*driver_version)
    )]
    MissingSymbol {
        /// The entry point.
        symbol: &'static str,
        /// The library that lacks it.
        library: String,
        /// The version of the loaded driver, when it could be read.
        driver_version: Option<DriverVersion>,
    },
    /// `cuInit` or a device query failed: typically no kernel driver, or the toolkit's stub library.
    #[error("the CUDA driver {library} ({version}) did not start: {source}", version = MaybeVersion(*driver_version))]
    Init {
        /// The library that was loaded (`(simulated)` for the simulated device).
        library: String,
        /// Its version, when it could be read.
        driver_version: Option<DriverVersion>,
        /// The failed call.
        source: DriverError,
    },
    /// The driver started, or `cuInit` said `CUDA_ERROR_NO_DEVICE`, but there is no device.
    #[error("the CUDA driver {library} ({version}) reports no device", version = MaybeVersion(*driver_version))]
    NoDevice {
        /// The library that was loaded.
        library: String,
        /// Its version, when it could be read.
        driver_version: Option<DriverVersion>,
    },
    /// The driver predates stream-ordered memory pools: its version is below
    /// [`DriverVersion::MEMORY_POOLS`], or it lacks the pool entry points.
    #[error(
        "the CUDA driver {library} ({version}) has no stream-ordered memory pools: {why}",
        version = MaybeVersion(*driver_version),
        why = TooOld { found: *driver_version, required: *required, missing }
    )]
    DriverTooOld {
        /// The library that was loaded.
        library: String,
        /// Its version, when it could be read.
        driver_version: Option<DriverVersion>,
        /// The version memory pools need: [`DriverVersion::MEMORY_POOLS`] (11.2).
        required: DriverVersion,
        /// The pool entry points the library does not export, by exported name.
        missing: Vec<&'static str>,
    },
    /// No device of the driver supports memory pools (`CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`
    /// is 0 on every one, as on vGPU slices and Windows TCC drivers).
    #[error(
        "none of the {devices} device(s) of the CUDA driver {library} ({version}) supports \
         stream-ordered memory pools (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED is 0); open it with \
         PoolRequirement::Optional to allocate with cuMemAlloc/cuMemFree instead",
        version = MaybeVersion(*driver_version)
    )]
    PoolsUnsupported {
        /// The library that was loaded.
        library: String,
        /// Its version, when it could be read.
        driver_version: Option<DriverVersion>,
        /// How many devices it has, none with pools.
        devices: usize,
    },
    /// `STEPPOOL_DEVICE` has a value other than `auto`, `cuda` or `sim`.
    #[error("STEPPOOL_DEVICE=`{value}` is not one of `auto`, `cuda`, `sim`")]
    Selection {
        /// The value that was read.
        value: String,
    },
    /// The simulated device's configuration was refused.
    #[error("simulated device: {0}")]
    SimConfig(#[from] SimConfigError),
}

/// Says why a driver has no memory pools, for [`LoadError::DriverTooOld`].
struct TooOld<'a> {
    found: Option<DriverVersion>,
    required: DriverVersion,
    missing: &'a [&'static str],
}

impl fmt::Display for TooOld<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let old = self.found.is_some_and(|found| found < self.required);
        if old {
            write!(f, "they need driver {} or later", self.required)?;
        }
        if !self.missing.is_empty() {
            let separator = if old { "; it lacks " } else { "it lacks " };
            write!(f, "{separator}{}", self.missing.join(", "))?;
            if !old {
                write!(f, ", entry points of driver {} and later", self.required)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_print_their_names() {
        assert_eq!(CUresult::CUDA_ERROR_OUT_OF_MEMORY.to_string(), "CUDA_ERROR_OUT_OF_MEMORY (2)");
        assert_eq!(CUresult(123_456).to_string(), "CUresult(123456)");
        assert!(CUresult::CUDA_SUCCESS.is_success());
        assert_eq!(CUresult::CUDA_ERROR_INVALID_VALUE.c_name(), Some(c"CUDA_ERROR_INVALID_VALUE"));
    }

    #[test]
    fn versions_print_as_major_minor() {
        assert_eq!(DriverVersion(12090).to_string(), "12.9");
        assert_eq!(DriverVersion(11020).to_string(), "11.2");
        assert!(DriverVersion(11010) < DriverVersion::MEMORY_POOLS);
    }

    #[test]
    fn missing_symbol_names_symbol_library_and_version() {
        let error = DriverError::MissingSymbol {
            symbol: "cuMemPoolCreate",
            library: "libcuda.so.1".into(),
            driver_version: Some(DriverVersion(11010)),
        };
        let text = error.to_string();
        assert!(text.contains("cuMemPoolCreate") && text.contains("libcuda.so.1") && text.contains("11.1"), "{text}");
    }

    #[test]
    fn load_errors_give_the_versions_counts_and_entry_points_found() {
        let library = || "/opt/libcuda.so.1".to_owned();
        let pools = vec!["cuMemPoolCreate", "cuMemAllocFromPoolAsync"];
        let old = LoadError::DriverTooOld {
            library: library(),
            driver_version: Some(DriverVersion(11010)),
            required: DriverVersion::MEMORY_POOLS,
            missing: pools.clone(),
        };
        assert_eq!(
            old.to_string(),
            "the CUDA driver /opt/libcuda.so.1 (driver 11.1) has no stream-ordered memory pools: they need \
             driver 11.2 or later; it lacks cuMemPoolCreate, cuMemAllocFromPoolAsync"
        );
        let stripped = LoadError::DriverTooOld {
            library: library(),
            driver_version: Some(DriverVersion(12090)),
            required: DriverVersion::MEMORY_POOLS,
            missing: pools,
        };
        assert_eq!(
            stripped.to_string(),
            "the CUDA driver /opt/libcuda.so.1 (driver 12.9) has no stream-ordered memory pools: it lacks \
             cuMemPoolCreate, cuMemAllocFromPoolAsync, entry points of driver 11.2 and later"
        );
        let unsupported = LoadError::PoolsUnsupported { library: library(), driver_version: None, devices: 2 };
        let text = unsupported.to_string();
        assert!(
            text.starts_with("none of the 2 device(s) of the CUDA driver /opt/libcuda.so.1 (driver version unknown)")
        );
        assert!(
            text.contains("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED") && text.contains("PoolRequirement::Optional")
        );
        let none = LoadError::NoDevice { library: library(), driver_version: Some(DriverVersion(12090)) };
        assert_eq!(none.to_string(), "the CUDA driver /opt/libcuda.so.1 (driver 12.9) reports no device");
    }
}
