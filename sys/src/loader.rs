//! Opening `libcuda` at run time. Nothing in steppool links against CUDA: a machine without a
//! driver builds and runs, and finds out here, as a [`LoadError`], that it has none.

use std::ffi::OsStr;
use std::fmt;

use crate::bindings::FunctionTable;
use crate::error::{DriverError, DriverVersion, LoadError};

/// The names tried, in order, by [`CudaLibrary::open`].
#[cfg(not(windows))]
pub const LIBRARY_CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];
/// The names tried, in order, by [`CudaLibrary::open`].
#[cfg(windows)]
pub const LIBRARY_CANDIDATES: &[&str] = &["nvcuda.dll"];

/// The environment variable that names a driver library to open instead of the candidates.
pub const LIBRARY_VARIABLE: &str = "STEPPOOL_CUDA_LIBRARY";

/// An opened CUDA driver library and its resolved entry points.
///
/// Entry points the library lacks are `None` in [`CudaLibrary::table`]; calling one through
/// [`Driver`](crate::Driver) is a [`DriverError::MissingSymbol`] naming it and the driver version.
pub struct CudaLibrary {
    table: FunctionTable,
    path: String,
    driver_version: Option<DriverVersion>,
    // Declared last: dropped after the table whose pointers point into it.
    _library: libloading::Library,
}

impl fmt::Debug for CudaLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaLibrary")
            .field("path", &self.path)
            .field("driver_version", &self.driver_version)
            .finish_non_exhaustive()
    }
}

impl CudaLibrary {
    /// Opens the library named by `STEPPOOL_CUDA_LIBRARY` (when set and not empty), or else the
    /// first of [`LIBRARY_CANDIDATES`] that opens.
    pub fn open() -> Result<Self, LoadError> {
        if let Some(path) = std::env::var_os(LIBRARY_VARIABLE).filter(|path| !path.is_empty()) {
            // SAFETY: the user names the CUDA driver library to use, as with LD_LIBRARY_PATH;
            // loading it runs the driver's own initializers.
            return unsafe { Self::open_path(path) };
        }
        // The first candidate is the driver's soname; its failure is the one worth reporting.
        let mut reason = String::new();
        for name in LIBRARY_CANDIDATES {
            // SAFETY: these are the sonames under which the NVIDIA driver installs libcuda;
            // whatever is installed under them is the CUDA driver, as the dynamic linker assumes.
            match unsafe { Self::open_path(name) } {
                Ok(library) => return Ok(library),
                Err(LoadError::LibraryNotFound { reason: why, .. }) if reason.is_empty() => reason = why,
                Err(LoadError::LibraryNotFound { .. }) => {}
                Err(other) => return Err(other),
            }
        }
        Err(LoadError::LibraryNotFound { tried: LIBRARY_CANDIDATES.iter().map(|&n| n.to_owned()).collect(), reason })
    }

    /// Opens the driver library at `path` (a file path, or a name the dynamic loader searches).
    ///
    /// Fails with [`LoadError::LibraryNotFound`] when it cannot be opened, and with
    /// [`LoadError::MissingSymbol`] when it lacks an entry point nothing works without (error
    /// names, `cuInit`, the version and device queries).
    ///
    /// # Safety
    ///
    /// `path` must name a CUDA driver library: every exported symbol with the name of a driver
    /// entry point must have the signature `cuda.h` gives it. Opening runs its initializers.
    pub unsafe fn open_path(path: impl AsRef<OsStr>) -> Result<Self, LoadError> {
        let path = path.as_ref();
        let shown = path.to_string_lossy().into_owned();
        // SAFETY: the caller guarantees `path` is a CUDA driver library.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|error| LoadError::LibraryNotFound { tried: vec![shown.clone()], reason: error.to_string() })?;
        // SAFETY: as above: the symbols have the signatures `cuda.h` declares.
        let table = unsafe { FunctionTable::resolve(&library) };
        let driver_version = table.cuDriverGetVersion.and_then(|get| {
            let mut version = 0;
            // SAFETY: `version` is a valid out-pointer; cuDriverGetVersion needs no cuInit.
            unsafe { get(&mut version) }.is_success().then_some(DriverVersion(version))
        });
        let required = [
            ("cuGetErrorName", table.cuGetErrorName.is_some()),
            ("cuGetErrorString", table.cuGetErrorString.is_some()),
            ("cuInit", table.cuInit.is_some()),
            ("cuDriverGetVersion", table.cuDriverGetVersion.is_some()),
            ("cuDeviceGetCount", table.cuDeviceGetCount.is_some()),
            ("cuDeviceGet", table.cuDeviceGet.is_some()),
            ("cuDeviceGetAttribute", table.cuDeviceGetAttribute.is_some()),
        ];
        if let Some((symbol, _)) = required.iter().find(|(_, present)| !present) {
            return Err(LoadError::MissingSymbol { symbol, library: shown, driver_version });
        }
        Ok(Self { table, path: shown, driver_version, _library: library })
    }

    /// The resolved entry points.
    pub fn table(&self) -> &FunctionTable {
        &self.table
    }

    /// The path or name the library was opened by.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The version `cuDriverGetVersion` reported, if it succeeded.
    pub fn driver_version(&self) -> Option<DriverVersion> {
        self.driver_version
    }

    /// The error for calling an entry point this library lacks.
    pub(crate) fn missing(&self, symbol: &'static str) -> DriverError {
        DriverError::MissingSymbol { symbol, library: self.path.clone(), driver_version: self.driver_version }
    }
}
