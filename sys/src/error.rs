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
}

/// Why no driver could be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate library could be opened.
    #[error("could not open the CUDA driver library (tried {tried}): {reason}", tried = .tried.join(", "))]
    LibraryNotFound {
        /// The names or paths tried, in order.
        tried: Vec<String>,
        /// The loader's message for the last one.
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
    /// `cuInit` or a device query failed: typically no GPU, no kernel driver, or the stub library.
    #[error("the CUDA driver {library} ({version}) did not start: {source}", version = MaybeVersion(*driver_version))]
    Init {
        /// The library that was loaded.
        library: String,
        /// Its version, when it could be read.
        driver_version: Option<DriverVersion>,
        /// The failed call.
        source: DriverError,
    },
    /// The driver started but reports no device.
    #[error("the CUDA driver {library} (driver {driver_version}) reports no device")]
    NoDevice {
        /// The library that was loaded.
        library: String,
        /// Its version.
        driver_version: DriverVersion,
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
}
