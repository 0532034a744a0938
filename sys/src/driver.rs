//! [`Driver`]: one handle on a CUDA driver, real or simulated, with checked calls.
//!
//! Each method makes one driver call and turns its `CUresult` into a `Result`; names follow the
//! entry points (`mem_pool_trim_to` calls `cuMemPoolTrimTo`). The same arguments reach `libcuda`
//! or the [simulated device](crate::sim), so code above this layer has one path for both.

use std::borrow::Cow;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, Once};

use crate::bindings::*;
use crate::error::{DriverError, DriverVersion, LoadError};
use crate::loader::CudaLibrary;
use crate::sim::{Sim, SimConfig};
use crate::{Width, pool_attribute_width as attribute_width};

/// The legacy default stream, `((CUstream)0x1)` in `cuda.h`.
pub const CU_STREAM_LEGACY: CUstream = 0x1 as CUstream;
/// The calling thread's per-thread default stream, `((CUstream)0x2)` in `cuda.h`.
pub const CU_STREAM_PER_THREAD: CUstream = 0x2 as CUstream;

/// The environment variable that selects the driver (see [`Selection`]).
pub const DEVICE_VARIABLE: &str = "STEPPOOL_DEVICE";

/// Which driver to use: `STEPPOOL_DEVICE=auto|cuda|sim`.
///
/// Nothing falls back to the simulated device unless asked: when `STEPPOOL_DEVICE` is unset,
/// [`Selection::from_env`] and [`Driver::from_env`] mean [`Selection::Cuda`], so a library that
/// embeds steppool gets the GPU or a [`LoadError`] that says why not. Programs that should run
/// anywhere (tests, examples, benchmarks) say so with
/// [`Selection::from_env_or(Selection::Auto)`](Selection::from_env_or).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// The real driver when a device with memory pools answers, otherwise the simulated device
    /// (said once on stderr, with the reason).
    Auto,
    /// The real driver, with memory pools ([`Driver::cuda`]); its absence is an error. The
    /// default when `STEPPOOL_DEVICE` is unset.
    #[default]
    Cuda,
    /// The simulated device, configured by `STEPPOOL_SIM_DEVICES` and `STEPPOOL_SIM_GRANULE`.
    Sim,
}

impl Selection {
    /// Reads `STEPPOOL_DEVICE`: `auto`, `cuda` or `sim`; unset or empty means [`Selection::Cuda`].
    pub fn from_env() -> Result<Self, LoadError> {
        Self::from_env_or(Self::Cuda)
    }

    /// Reads `STEPPOOL_DEVICE`: `auto`, `cuda` or `sim`; unset or empty means `default`.
    pub fn from_env_or(default: Selection) -> Result<Self, LoadError> {
        match std::env::var_os(DEVICE_VARIABLE) {
            None => Ok(default),
            Some(value) => Self::parse_or(&value.to_string_lossy(), default),
        }
    }

    /// Reads a selection: `auto`, `cuda` (or `gpu`) or `sim` (or `simulated`), case-insensitive,
    /// around spaces. Anything else, the empty string included, is a [`LoadError::Selection`].
    pub fn parse(value: &str) -> Result<Self, LoadError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cuda" | "gpu" => Ok(Self::Cuda),
            "sim" | "simulated" => Ok(Self::Sim),
            _ => Err(LoadError::Selection { value: value.to_owned() }),
        }
    }

    /// As [`Selection::parse`], with an empty (or all-space) value meaning `default`.
    pub fn parse_or(value: &str, default: Selection) -> Result<Self, LoadError> {
        if value.trim().is_empty() { Ok(default) } else { Self::parse(value) }
    }

    /// The value of `STEPPOOL_DEVICE` that asks for it: `auto`, `cuda` or `sim`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Cuda => "cuda",
            Self::Sim => "sim",
        }
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether opening the real driver insists on stream-ordered memory pools.
///
/// steppool's pools are `cuMemPool*` pools; a driver without them (before 11.2, or a device
/// reporting no `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`: vGPU slices, Windows TCC) can only
/// serve `cuMemAlloc`/`cuMemFree`, synchronously and without the pool counters. That fallback is
/// taken only when asked for: with [`Driver::cuda_with(PoolRequirement::Optional)`](Driver::cuda_with).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolRequirement {
    /// The driver must be 11.2 or later, export the pool entry points, and have at least one
    /// device that supports pools; otherwise [`LoadError::DriverTooOld`] or
    /// [`LoadError::PoolsUnsupported`]. What [`Driver::cuda`] and [`Driver::from_env`] ask.
    #[default]
    Required,
    /// Any driver that starts and has a device: devices without pools are to be served with
    /// `cuMemAlloc`/`cuMemFree` (check [`Driver::memory_pools_supported`] per device). Simulated
    /// drivers report this one: their [`SimConfig`] says whether they have pools.
    Optional,
}

/// Which kind of driver a [`Driver`] talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverKind {
    /// `libcuda`, loaded at run time.
    Cuda,
    /// The simulated device.
    Simulated,
}

/// Counters of a memory pool, read from its attributes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: bytes the pool holds from the device.
    pub reserved: u64,
    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`.
    pub reserved_high: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`: bytes allocated from the pool.
    pub used: u64,
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    pub used_high: u64,
}

// One backend per driver, behind the driver's `Arc`: boxing the simulated device would add an
// indirection to every simulated call to save memory once per driver.
#[allow(clippy::large_enum_variant)]
enum Backend {
    Cuda(CudaLibrary),
    Sim(Sim),
}

/// A CUDA driver: `libcuda` or the simulated device. Cheap to clone; `Send + Sync`.
///
/// A `Driver` is initialized (`cuInit` has succeeded). Contexts, streams and pools made through
/// it belong to it; handles of one simulated driver mean nothing to another.
///
/// # Handles
///
/// Methods that take a context, stream, event, pool, module, function or device pointer are
/// `unsafe`: the real driver's behaviour on a destroyed or made-up handle is undefined (it may
/// crash), so the caller promises that each handle is live and belongs to this driver. Stream
/// arguments may also be the special handles `NULL`, [`CU_STREAM_LEGACY`] and
/// [`CU_STREAM_PER_THREAD`]. The simulated device checks every handle and returns the driver's
/// error code, which the conformance tests rely on; that is a courtesy, not the contract.
#[derive(Clone)]
pub struct Driver {
    backend: Arc<Backend>,
    pools: PoolRequirement,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Driver").field(&self.describe()).finish()
    }
}

/// Calls entry point `$name` of `$driver`'s backend with the same arguments and checks the
/// result. Expands to a `Result<(), DriverError>`; must be used inside `unsafe`, whose `SAFETY`
/// comment says why the arguments meet the entry point's contract.
macro_rules! call {
    ($driver:expr, $name:ident($($arg:expr),* $(,)?)) => {{
        let driver: &Driver = $driver;
        let name = stringify!($name);
        match &*driver.backend {
            Backend::Cuda(library) => match library.table().$name {
                Some(entry) => driver.check(name, entry($($arg),*)),
                None => Err(library.missing(name)),
            },
            Backend::Sim(sim) if sim.exports(name) => match sim.fault(name) {
                Some(code) => driver.check(name, code),
                None => driver.check(name, sim.$name($($arg),*)),
            },
            Backend::Sim(_) => Err(driver.sim_missing(name)),
        }
    }};
}

static AUTO_NOTICE: Once = Once::new();

/// The properties of pinned device memory on `device`, for the virtual memory management calls.
fn pinned_on(device: CUdevice) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        ..CUmemAllocationProp::default()
    }
}

/// Whether a call failed with `CUDA_ERROR_NO_DEVICE`, what `cuInit` says on a machine whose
/// driver is installed but that has no GPU.
fn is_no_device(error: &DriverError) -> bool {
    error.code() == Some(CUresult::CUDA_ERROR_NO_DEVICE)
}

impl Driver {
    /// The driver `STEPPOOL_DEVICE` selects; when it is unset or empty, the real driver
    /// ([`Selection::Cuda`]): a GPU with memory pools, or a [`LoadError`] saying why there is
    /// none. Nothing falls back to the simulated device unless `STEPPOOL_DEVICE=auto` asks.
    pub fn from_env() -> Result<Self, LoadError> {
        Self::from_env_or(Selection::Cuda)
    }

    /// The driver `STEPPOOL_DEVICE` selects, or `default` when it is unset or empty. Tests and
    /// examples that should run on any machine pass [`Selection::Auto`].
    pub fn from_env_or(default: Selection) -> Result<Self, LoadError> {
        Self::select(Selection::from_env_or(default)?)
    }

    /// The driver `selection` asks for. With [`Selection::Auto`] and no usable GPU, says once on
    /// stderr why it falls back to the simulated device.
    pub fn select(selection: Selection) -> Result<Self, LoadError> {
        match selection {
            Selection::Cuda => Self::cuda(),
            Selection::Sim => Self::simulated(SimConfig::from_env()?),
            Selection::Auto => match Self::cuda() {
                Ok(driver) => Ok(driver),
                Err(reason) => {
                    let config = SimConfig::from_env()?;
                    AUTO_NOTICE.call_once(|| {
                        eprintln!(
                            "steppool: no usable CUDA device ({reason}); using the simulated device ({}). \
                             Set STEPPOOL_DEVICE=cuda to require a GPU.",
                            config.describe()
                        );
                    });
                    Self::simulated(config)
                }
            },
        }
    }

    /// The real driver with memory pools: opens `libcuda` (see [`CudaLibrary::open`]), starts it,
    /// and checks it has a device, is 11.2 or later with the pool entry points, and has a device
    /// that supports pools ([`PoolRequirement::Required`]). Each failure is its own
    /// [`LoadError`] variant, with the paths, versions and counts found.
    pub fn cuda() -> Result<Self, LoadError> {
        Self::cuda_with(PoolRequirement::Required)
    }

    /// The real driver, with memory pools required or not (see [`PoolRequirement`]).
    pub fn cuda_with(pools: PoolRequirement) -> Result<Self, LoadError> {
        Self::from_library_with(CudaLibrary::open()?, pools)
    }

    /// Starts an opened driver library, requiring memory pools as [`Driver::cuda`] does.
    pub fn from_library(library: CudaLibrary) -> Result<Self, LoadError> {
        Self::from_library_with(library, PoolRequirement::Required)
    }

    /// Starts an opened driver library (`cuInit`) and checks that it has a device, and memory
    /// pools if `pools` requires them.
    pub fn from_library_with(library: CudaLibrary, pools: PoolRequirement) -> Result<Self, LoadError> {
        let path = library.path().to_owned();
        let version = library.driver_version();
        let driver = Self { backend: Arc::new(Backend::Cuda(library)), pools };
        let no_device = || LoadError::NoDevice { library: path.clone(), driver_version: version };
        let init_error = |source| LoadError::Init { library: path.clone(), driver_version: version, source };
        // SAFETY: cuInit takes flags only; 0 is the documented value.
        match unsafe { call!(&driver, cuInit(0)) } {
            Ok(()) => {}
            Err(error) if is_no_device(&error) => return Err(no_device()),
            Err(error) => return Err(init_error(error)),
        }
        let devices = driver.device_count().map_err(init_error)?;
        if devices == 0 {
            return Err(no_device());
        }
        if pools == PoolRequirement::Optional {
            return Ok(driver);
        }
        let missing: Vec<&'static str> =
            driver.pool_entry_points().into_iter().filter(|&(_, exported)| !exported).map(|(name, _)| name).collect();
        if !missing.is_empty() || version.is_some_and(|version| version < DriverVersion::MEMORY_POOLS) {
            return Err(LoadError::DriverTooOld {
                library: path,
                driver_version: version,
                required: DriverVersion::MEMORY_POOLS,
                missing,
            });
        }
        for ordinal in 0..devices {
            let device = driver.device(ordinal).map_err(init_error)?;
            if driver.memory_pools_supported(device).map_err(init_error)? {
                return Ok(driver);
            }
        }
        Err(LoadError::PoolsUnsupported { library: path, driver_version: version, devices })
    }

    /// A simulated driver with the given devices, initialized. Its [`SimConfig`] is the explicit
    /// choice of what it offers, pools included, so it reports [`PoolRequirement::Optional`].
    pub fn simulated(config: SimConfig) -> Result<Self, LoadError> {
        let driver = Self { backend: Arc::new(Backend::Sim(Sim::new(config)?)), pools: PoolRequirement::Optional };
        // SAFETY: cuInit takes flags only; 0 is the documented value.
        unsafe { call!(&driver, cuInit(0)) }.map_err(|source| LoadError::Init {
            library: "(simulated)".to_owned(),
            driver_version: driver.sim().map(|sim| DriverVersion(sim.config().driver_version)),
            source,
        })?;
        Ok(driver)
    }

    /// Whether this driver was opened requiring memory pools. With
    /// [`PoolRequirement::Required`], at least one device supports them, and a device that does
    /// not is better refused than served with `cuMemAlloc`; with [`PoolRequirement::Optional`]
    /// (asked for, or a simulated driver), such a device is to be served with `cuMemAlloc`.
    pub fn pool_requirement(&self) -> PoolRequirement {
        self.pools
    }

    /// Which kind of driver this is.
    pub fn kind(&self) -> DriverKind {
        match &*self.backend {
            Backend::Cuda(_) => DriverKind::Cuda,
            Backend::Sim(_) => DriverKind::Simulated,
        }
    }

    /// A one-line description: `CUDA driver 12.9 (libcuda.so.1)` or
    /// `simulated device (1 × 80 GiB, 2 MiB granules)`.
    pub fn describe(&self) -> String {
        match &*self.backend {
            Backend::Cuda(library) => match library.driver_version() {
                Some(version) => format!("CUDA driver {version} ({})", library.path()),
                None => format!("CUDA driver ({})", library.path()),
            },
            Backend::Sim(sim) => format!("simulated device ({})", sim.config().describe()),
        }
    }

    /// The simulated device behind this driver, if it is one, for inspection: its
    /// configuration, pool layouts and stream order, which no real driver publishes. Its entry
    /// points are reached only through this driver's methods.
    pub fn sim(&self) -> Option<&Sim> {
        match &*self.backend {
            Backend::Sim(sim) => Some(sim),
            Backend::Cuda(_) => None,
        }
    }

    /// A number that moves before any stream of this driver begins or joins a capture (and when
    /// a stream or context goes away), where the driver can know: a stream that
    /// [`Driver::stream_capture_info`] found outside capture while it read *n* is still outside
    /// capture while it reads *n*, so the question need not be asked again. The simulated device
    /// sees every call made to it ([`Sim::capture_epoch`]); `None` for the real driver, whose
    /// other callers (cudarc, PyTorch) begin captures without this `Driver` seeing it, and for
    /// the simulated device while faults are injected.
    #[inline]
    pub fn capture_epoch(&self) -> Option<u64> {
        match &*self.backend {
            Backend::Sim(sim) => sim.capture_epoch(),
            Backend::Cuda(_) => None,
        }
    }

    /// The loaded library behind this driver, if it is the real one.
    pub fn library(&self) -> Option<&CudaLibrary> {
        match &*self.backend {
            Backend::Cuda(library) => Some(library),
            Backend::Sim(_) => None,
        }
    }

    /// Whether two handles talk to the same driver instance.
    pub fn same(&self, other: &Driver) -> bool {
        Arc::ptr_eq(&self.backend, &other.backend)
    }

    fn check(&self, call: &'static str, code: CUresult) -> Result<(), DriverError> {
        if code.is_success() {
            Ok(())
        } else {
            Err(DriverError::Call { call, code, description: self.error_string(code) })
        }
    }

    fn sim_missing(&self, symbol: &'static str) -> DriverError {
        let version = self.sim().map(|sim| DriverVersion(sim.config().driver_version));
        DriverError::MissingSymbol { symbol, library: "the simulated driver".to_owned(), driver_version: version }
    }

    // ----- errors, version, devices ---------------------------------------------------------------

    /// `cuGetErrorName`: `CUDA_ERROR_OUT_OF_MEMORY`, or `None` for a code the driver does not know.
    pub fn error_name(&self, code: CUresult) -> Option<String> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: `text` is a valid out-pointer; the driver stores a pointer to a static string.
        unsafe { call!(self, cuGetErrorName(code, &mut text)) }.ok()?;
        // SAFETY: on success the driver returned a NUL-terminated string that lives as long as
        // the library, which `self` keeps loaded; it is copied before returning.
        (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }

    /// `cuGetErrorString`: the driver's description of `code`, or its name when it has none.
    pub fn error_string(&self, code: CUresult) -> Cow<'static, str> {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: as in `error_name`.
        let described = unsafe { call!(self, cuGetErrorString(code, &mut text)) };
        if described.is_ok() && !text.is_null() {
            // SAFETY: as in `error_name`: a static NUL-terminated string, copied at once.
            return Cow::Owned(unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned());
        }
        Cow::Borrowed(code.name().unwrap_or("unrecognized error code"))
    }

    /// `cuDriverGetVersion`.
    pub fn driver_version(&self) -> Result<DriverVersion, DriverError> {
        let mut version: c_int = 0;
        // SAFETY: `version` is a valid out-pointer.
        unsafe { call!(self, cuDriverGetVersion(&mut version)) }?;
        Ok(DriverVersion(version))
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<usize, DriverError> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer.
        unsafe { call!(self, cuDeviceGetCount(&mut count)) }?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// `cuDeviceGet`: the device with this ordinal.
    pub fn device(&self, ordinal: usize) -> Result<CUdevice, DriverError> {
        let mut device: CUdevice = 0;
        let ordinal = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        // SAFETY: `device` is a valid out-pointer.
        unsafe { call!(self, cuDeviceGet(&mut device, ordinal)) }?;
        Ok(device)
    }

    /// `cuDeviceGetName`.
    pub fn device_name(&self, device: CUdevice) -> Result<String, DriverError> {
        let mut name = [0 as c_char; 256];
        // SAFETY: `name` has `name.len()` writable bytes, the length passed.
        unsafe { call!(self, cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, device)) }?;
        // SAFETY: the driver wrote a NUL-terminated string into `name`, which ends in a NUL at
        // worst at its last byte.
        Ok(unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// `cuDeviceTotalMem`: the device's memory in bytes.
    pub fn device_total_memory(&self, device: CUdevice) -> Result<u64, DriverError> {
        let mut bytes = 0usize;
        // SAFETY: `bytes` is a valid out-pointer.
        unsafe { call!(self, cuDeviceTotalMem_v2(&mut bytes, device)) }?;
        Ok(bytes as u64)
    }

    /// `cuDeviceGetAttribute`.
    pub fn device_attribute(&self, device: CUdevice, attribute: CUdevice_attribute) -> Result<i32, DriverError> {
        let mut value: c_int = 0;
        // SAFETY: `value` is a valid out-pointer.
        unsafe { call!(self, cuDeviceGetAttribute(&mut value, attribute, device)) }?;
        Ok(value)
    }

    /// `cuDeviceCanAccessPeer`.
    pub fn device_can_access_peer(&self, device: CUdevice, peer: CUdevice) -> Result<bool, DriverError> {
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer.
        unsafe { call!(self, cuDeviceCanAccessPeer(&mut can, device, peer)) }?;
        Ok(can != 0)
    }

    /// Whether `device` supports memory pools: a driver of 11.2 or later that exports the pool
    /// entry points and reports `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED`. Without them,
    /// memory comes from `cuMemAlloc`/`cuMemFree` (vGPU slices, Windows TCC, old drivers), which
    /// a driver opened with [`PoolRequirement::Required`] has on no device.
    pub fn memory_pools_supported(&self, device: CUdevice) -> Result<bool, DriverError> {
        if self.driver_version()? < DriverVersion::MEMORY_POOLS {
            return Ok(false);
        }
        let exported = self.pool_entry_points().iter().all(|&(_, exported)| exported);
        Ok(exported
            && self.device_attribute(device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// The entry points of the stream-ordered allocator that steppool's pools call, each with
    /// whether this driver exports it.
    fn pool_entry_points(&self) -> [(&'static str, bool); 7] {
        macro_rules! exported {
            ($($name:ident),*) => {
                match &*self.backend {
                    Backend::Cuda(library) => [$((stringify!($name), library.table().$name.is_some())),*],
                    Backend::Sim(sim) => [$((stringify!($name), sim.exports(stringify!($name)))),*],
                }
            };
        }
        exported!(
            cuMemPoolCreate,
            cuMemPoolDestroy,
            cuMemAllocFromPoolAsync,
            cuMemFreeAsync,
            cuMemPoolTrimTo,
            cuMemPoolSetAttribute,
            cuMemPoolGetAttribute
        )
    }

    // ----- contexts -----------------------------------------------------------------------------

    /// `cuDevicePrimaryCtxRetain`: the device's primary context, the one cudarc, candle and
    /// cubecl use, so pointers and streams interoperate with them. Balance with
    /// [`Driver::primary_context_release`].
    pub fn primary_context_retain(&self, device: CUdevice) -> Result<CUcontext, DriverError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        unsafe { call!(self, cuDevicePrimaryCtxRetain(&mut ctx, device)) }?;
        Ok(ctx)
    }

    /// `cuDevicePrimaryCtxRelease`.
    ///
    /// # Safety
    ///
    /// Balances an earlier retain. After the last release the context is destroyed: none of its
    /// streams, events or modules may be used again.
    pub unsafe fn primary_context_release(&self, device: CUdevice) -> Result<(), DriverError> {
        // SAFETY: the caller balances a retain and stops using the context's handles.
        unsafe { call!(self, cuDevicePrimaryCtxRelease_v2(device)) }
    }

    /// `cuCtxGetCurrent`: the calling thread's current context, if any.
    pub fn context_current(&self) -> Result<Option<CUcontext>, DriverError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        unsafe { call!(self, cuCtxGetCurrent(&mut ctx)) }?;
        Ok((!ctx.is_null()).then_some(ctx))
    }

    /// `cuCtxSetCurrent`: binds `ctx` to the calling thread (null unbinds).
    ///
    /// # Safety
    ///
    /// `ctx` is null or a live context of this driver (see [Handles](Driver#handles)).
    pub unsafe fn context_set_current(&self, ctx: CUcontext) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuCtxSetCurrent(ctx)) }
    }

    /// `cuCtxPushCurrent`.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context of this driver.
    pub unsafe fn context_push_current(&self, ctx: CUcontext) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuCtxPushCurrent_v2(ctx)) }
    }

    /// `cuCtxPopCurrent`: pops and returns the calling thread's current context.
    pub fn context_pop_current(&self) -> Result<CUcontext, DriverError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        unsafe { call!(self, cuCtxPopCurrent_v2(&mut ctx)) }?;
        Ok(ctx)
    }

    /// `cuCtxGetDevice`: the device of the calling thread's current context.
    pub fn context_device(&self) -> Result<CUdevice, DriverError> {
        let mut device: CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer.
        unsafe { call!(self, cuCtxGetDevice(&mut device)) }?;
        Ok(device)
    }

    /// `cuCtxSynchronize`: waits for all work of the current context.
    pub fn context_synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: no arguments; the driver checks for a current context.
        unsafe { call!(self, cuCtxSynchronize()) }
    }

    // ----- streams ----------------------------------------------------------------------------------

    /// `cuStreamCreate` in the current context.
    pub fn stream_create(&self, flags: CUstream_flags) -> Result<CUstream, DriverError> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer.
        unsafe { call!(self, cuStreamCreate(&mut stream, flags.0)) }?;
        Ok(stream)
    }

    /// `cuStreamDestroy`. Work already enqueued still completes.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream made by [`Driver::stream_create`]; it is not used again.
    pub unsafe fn stream_destroy(&self, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuStreamDestroy_v2(stream)) }
    }

    /// `cuStreamSynchronize`.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_synchronize(&self, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuStreamSynchronize(stream)) }
    }

    /// `cuStreamQuery`: `true` when all work enqueued on `stream` is complete.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_query(&self, stream: CUstream) -> Result<bool, DriverError> {
        // SAFETY: the caller guarantees the handle.
        match unsafe { call!(self, cuStreamQuery(stream)) } {
            Ok(()) => Ok(true),
            Err(error) if error.code() == Some(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// `cuStreamWaitEvent`: work enqueued on `stream` from now on waits for `event`.
    ///
    /// # Safety
    ///
    /// `stream` and `event` are live handles of this driver.
    pub unsafe fn stream_wait_event(&self, stream: CUstream, event: CUevent) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handles.
        unsafe { call!(self, cuStreamWaitEvent(stream, event, 0)) }
    }

    /// `cuStreamGetCtx`: the context `stream` belongs to.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_context(&self, stream: CUstream) -> Result<CUcontext, DriverError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: the caller guarantees the handle; `ctx` is a valid out-pointer.
        unsafe { call!(self, cuStreamGetCtx(stream, &mut ctx)) }?;
        Ok(ctx)
    }

    // ----- events -----------------------------------------------------------------------------------

    /// `cuEventCreate` in the current context.
    pub fn event_create(&self, flags: CUevent_flags) -> Result<CUevent, DriverError> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: `event` is a valid out-pointer.
        unsafe { call!(self, cuEventCreate(&mut event, flags.0)) }?;
        Ok(event)
    }

    /// `cuEventDestroy`.
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver; it is not used again.
    pub unsafe fn event_destroy(&self, event: CUevent) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuEventDestroy_v2(event)) }
    }

    /// `cuEventRecord`: `event` completes when the work enqueued on `stream` so far does.
    ///
    /// # Safety
    ///
    /// `event` and `stream` are live handles of this driver, of the same context.
    pub unsafe fn event_record(&self, event: CUevent, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handles.
        unsafe { call!(self, cuEventRecord(event, stream)) }
    }

    /// `cuEventQuery`: `true` when the recorded work is complete.
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver.
    pub unsafe fn event_query(&self, event: CUevent) -> Result<bool, DriverError> {
        // SAFETY: the caller guarantees the handle.
        match unsafe { call!(self, cuEventQuery(event)) } {
            Ok(()) => Ok(true),
            Err(error) if error.code() == Some(CUresult::CUDA_ERROR_NOT_READY) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// `cuEventSynchronize`.
    ///
    /// # Safety
    ///
    /// `event` is a live event of this driver.
    pub unsafe fn event_synchronize(&self, event: CUevent) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuEventSynchronize(event)) }
    }

    /// `cuEventElapsedTime`: milliseconds between two completed timing events.
    ///
    /// # Safety
    ///
    /// `start` and `end` are live events of this driver.
    pub unsafe fn event_elapsed_ms(&self, start: CUevent, end: CUevent) -> Result<f32, DriverError> {
        let mut ms = 0f32;
        // SAFETY: the caller guarantees the handles; `ms` is a valid out-pointer.
        unsafe { call!(self, cuEventElapsedTime(&mut ms, start, end)) }?;
        Ok(ms)
    }

    // ----- memory -----------------------------------------------------------------------------------

    /// `cuMemGetInfo`: `(free, total)` bytes of the current context's device. Memory reserved by
    /// pools counts as used.
    pub fn mem_get_info(&self) -> Result<(u64, u64), DriverError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-pointers.
        unsafe { call!(self, cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok((free as u64, total as u64))
    }

    /// `cuMemAlloc`: synchronous allocation in the current context, for devices without pools.
    pub fn mem_alloc(&self, bytes: usize) -> Result<CUdeviceptr, DriverError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer.
        unsafe { call!(self, cuMemAlloc_v2(&mut ptr, bytes)) }?;
        Ok(ptr)
    }

    /// `cuMemFree`: frees at once, assuming all work using the memory is complete.
    ///
    /// # Safety
    ///
    /// `ptr` was allocated by this driver, is not freed yet, and no enqueued work still uses it.
    pub unsafe fn mem_free(&self, ptr: CUdeviceptr) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the pointer.
        unsafe { call!(self, cuMemFree_v2(ptr)) }
    }

    /// `cuMemsetD8Async`: sets `len` bytes at `ptr` to `value`, in stream order.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + len)` lies inside a live allocation of this driver that `stream` may use;
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn memset_d8_async(
        &self,
        ptr: CUdeviceptr,
        value: u8,
        len: usize,
        stream: CUstream,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range and the handle.
        unsafe { call!(self, cuMemsetD8Async(ptr, value, len, stream)) }
    }

    /// `cuMemAllocAsync`: `bytes` from the current pool of `stream`'s device, in stream order.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn mem_alloc_async(&self, bytes: usize, stream: CUstream) -> Result<CUdeviceptr, DriverError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the caller guarantees the handle; `ptr` is a valid out-pointer.
        unsafe { call!(self, cuMemAllocAsync(&mut ptr, bytes, stream)) }?;
        Ok(ptr)
    }

    /// `cuMemAllocFromPoolAsync`: `bytes` from `pool`, in `stream` order.
    ///
    /// # Safety
    ///
    /// `pool` and `stream` are live handles of this driver.
    pub unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: CUmemoryPool,
        stream: CUstream,
    ) -> Result<CUdeviceptr, DriverError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the caller guarantees the handles; `ptr` is a valid out-pointer.
        unsafe { call!(self, cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream)) }?;
        Ok(ptr)
    }

    /// `cuMemFreeAsync`: frees `ptr` once `stream` reaches this point.
    ///
    /// # Safety
    ///
    /// `ptr` is a live allocation of this driver; no work enqueued after this on any stream
    /// uses it; `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn mem_free_async(&self, ptr: CUdeviceptr, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the pointer and the handle.
        unsafe { call!(self, cuMemFreeAsync(ptr, stream)) }
    }

    // ----- memory pools -----------------------------------------------------------------------------

    /// `cuMemPoolCreate` (see [`PoolProps`](crate::PoolProps) for the props).
    pub fn mem_pool_create(&self, props: &CUmemPoolProps) -> Result<CUmemoryPool, DriverError> {
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `props` is a valid reference; `pool` is a valid out-pointer.
        unsafe { call!(self, cuMemPoolCreate(&mut pool, props)) }?;
        Ok(pool)
    }

    /// `cuMemPoolDestroy`. Allocations still outstanding keep the memory until they are freed.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool made by [`Driver::mem_pool_create`]; it is not used again.
    pub unsafe fn mem_pool_destroy(&self, pool: CUmemoryPool) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuMemPoolDestroy(pool)) }
    }

    /// `cuMemPoolTrimTo`: releases unused memory while at least `keep` bytes stay reserved.
    /// Frees whose completion the host has not observed may still count as in use.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_trim_to(&self, pool: CUmemoryPool, keep: u64) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuMemPoolTrimTo(pool, keep as usize)) }
    }

    /// `cuMemPoolSetAttribute`, passing the value at the width the attribute takes (`int` for the
    /// reuse policies, `cuuint64_t` for the rest).
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_set_attribute(
        &self,
        pool: CUmemoryPool,
        attribute: CUmemPool_attribute,
        value: u64,
    ) -> Result<(), DriverError> {
        match attribute_width(attribute) {
            Some(Width::Int) => {
                let mut value = c_int::from(value != 0);
                // SAFETY: the caller guarantees the handle; `value` is the `int` it expects.
                unsafe { call!(self, cuMemPoolSetAttribute(pool, attribute, (&raw mut value).cast::<c_void>())) }
            }
            Some(Width::U64) => {
                let mut value = value;
                // SAFETY: the caller guarantees the handle; `value` is the `cuuint64_t` it expects.
                unsafe { call!(self, cuMemPoolSetAttribute(pool, attribute, (&raw mut value).cast::<c_void>())) }
            }
            None => Err(self.unknown_attribute("cuMemPoolSetAttribute", attribute)),
        }
    }

    /// `cuMemPoolGetAttribute`, reading the value at the width the attribute has.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_get_attribute(
        &self,
        pool: CUmemoryPool,
        attribute: CUmemPool_attribute,
    ) -> Result<u64, DriverError> {
        match attribute_width(attribute) {
            Some(Width::Int) => {
                let mut value: c_int = 0;
                // SAFETY: the caller guarantees the handle; `value` is the `int` it writes.
                unsafe { call!(self, cuMemPoolGetAttribute(pool, attribute, (&raw mut value).cast::<c_void>())) }?;
                Ok(value as u64)
            }
            Some(Width::U64) => {
                let mut value: u64 = 0;
                // SAFETY: the caller guarantees the handle; `value` is the `cuuint64_t` it writes.
                unsafe { call!(self, cuMemPoolGetAttribute(pool, attribute, (&raw mut value).cast::<c_void>())) }?;
                Ok(value)
            }
            None => Err(self.unknown_attribute("cuMemPoolGetAttribute", attribute)),
        }
    }

    fn unknown_attribute(&self, call: &'static str, attribute: CUmemPool_attribute) -> DriverError {
        let description =
            format!("pool attribute {} is newer than the bound cuda.h; its value width is unknown", attribute.0);
        DriverError::Call { call, code: CUresult::CUDA_ERROR_INVALID_VALUE, description: Cow::Owned(description) }
    }

    /// The four counters of `pool`.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_counters(&self, pool: CUmemoryPool) -> Result<PoolCounters, DriverError> {
        use CUmemPool_attribute as A;
        // SAFETY: the caller guarantees the handle.
        unsafe {
            Ok(PoolCounters {
                reserved: self.mem_pool_get_attribute(pool, A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
                reserved_high: self.mem_pool_get_attribute(pool, A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
                used: self.mem_pool_get_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
                used_high: self.mem_pool_get_attribute(pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            })
        }
    }

    /// `cuMemPoolSetAccess`: grants (or revokes) devices' access to `pool`.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_set_access(
        &self,
        pool: CUmemoryPool,
        access: &[CUmemAccessDesc],
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle; `access` is `access.len()` descriptors.
        unsafe { call!(self, cuMemPoolSetAccess(pool, access.as_ptr(), access.len())) }
    }

    /// `cuMemPoolGetAccess`: the access `location` has to `pool`.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_get_access(
        &self,
        pool: CUmemoryPool,
        location: CUmemLocation,
    ) -> Result<CUmemAccess_flags, DriverError> {
        let mut location = location;
        let mut flags = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
        // SAFETY: the caller guarantees the handle; both pointers are valid.
        unsafe { call!(self, cuMemPoolGetAccess(&mut flags, pool, &mut location)) }?;
        Ok(flags)
    }

    /// `cuDeviceGetDefaultMemPool`.
    pub fn device_default_mem_pool(&self, device: CUdevice) -> Result<CUmemoryPool, DriverError> {
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer.
        unsafe { call!(self, cuDeviceGetDefaultMemPool(&mut pool, device)) }?;
        Ok(pool)
    }

    /// `cuDeviceGetMemPool`: the pool `cuMemAllocAsync` on `device` allocates from.
    pub fn device_mem_pool(&self, device: CUdevice) -> Result<CUmemoryPool, DriverError> {
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer.
        unsafe { call!(self, cuDeviceGetMemPool(&mut pool, device)) }?;
        Ok(pool)
    }

    /// `cuDeviceSetMemPool`: routes every `cuMemAllocAsync` on `device` (cudarc, candle, cubecl)
    /// to `pool`.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver on `device`.
    pub unsafe fn device_set_mem_pool(&self, device: CUdevice, pool: CUmemoryPool) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuDeviceSetMemPool(device, pool)) }
    }

    /// `cuMemPoolExportToShareableHandle` for a pool made with
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a file descriptor another process can import.
    ///
    /// # Safety
    ///
    /// `pool` is a live pool of this driver.
    pub unsafe fn mem_pool_export_posix_fd(&self, pool: CUmemoryPool) -> Result<i32, DriverError> {
        let mut fd: c_int = -1;
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: the caller guarantees the handle; a POSIX handle is written as an `int`.
        unsafe { call!(self, cuMemPoolExportToShareableHandle((&raw mut fd).cast::<c_void>(), pool, kind, 0)) }?;
        Ok(fd)
    }

    /// `cuMemPoolImportFromShareableHandle` for a file descriptor from
    /// [`Driver::mem_pool_export_posix_fd`] in another process.
    ///
    /// # Safety
    ///
    /// `fd` is a pool file descriptor received from the exporting process.
    pub unsafe fn mem_pool_import_posix_fd(&self, fd: i32) -> Result<CUmemoryPool, DriverError> {
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        let kind = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // A POSIX handle is passed by value, cast to a pointer, as `cuda.h` documents.
        let handle = fd as isize as *mut c_void;
        // SAFETY: the caller guarantees the descriptor; `pool` is a valid out-pointer.
        unsafe { call!(self, cuMemPoolImportFromShareableHandle(&mut pool, handle, kind, 0)) }?;
        Ok(pool)
    }

    /// `cuMemPoolExportPointer`: the 64 opaque bytes that let another process import `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` is a live allocation from an exportable pool of this driver.
    pub unsafe fn mem_pool_export_pointer(&self, ptr: CUdeviceptr) -> Result<CUmemPoolPtrExportData, DriverError> {
        let mut data = CUmemPoolPtrExportData::default();
        // SAFETY: the caller guarantees the pointer; `data` is a valid out-pointer.
        unsafe { call!(self, cuMemPoolExportPointer(&mut data, ptr)) }?;
        Ok(data)
    }

    /// `cuMemPoolImportPointer`: the pointer another process exported from an imported pool.
    ///
    /// # Safety
    ///
    /// `pool` is a pool imported into this process; `data` came from its exporter.
    pub unsafe fn mem_pool_import_pointer(
        &self,
        pool: CUmemoryPool,
        data: CUmemPoolPtrExportData,
    ) -> Result<CUdeviceptr, DriverError> {
        let mut data = data;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: the caller guarantees the handle; both pointers are valid.
        unsafe { call!(self, cuMemPoolImportPointer(&mut ptr, pool, &mut data)) }?;
        Ok(ptr)
    }

    // ----- virtual memory management -------------------------------------------------------------

    /// Whether `device` supports virtual memory management (reserved address ranges with
    /// physical memory mapped on demand): the driver exports the entry points and reports
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
    pub fn vmm_supported(&self, device: CUdevice) -> Result<bool, DriverError> {
        macro_rules! exported {
            ($($name:ident),*) => {
                match &*self.backend {
                    Backend::Cuda(library) => true $(&& library.table().$name.is_some())*,
                    Backend::Sim(sim) => true $(&& sim.exports(stringify!($name)))*,
                }
            };
        }
        let exported = exported!(
            cuMemAddressReserve,
            cuMemAddressFree,
            cuMemCreate,
            cuMemRelease,
            cuMemMap,
            cuMemUnmap,
            cuMemSetAccess,
            cuMemGetAllocationGranularity
        );
        Ok(exported
            && self.device_attribute(
                device,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )? != 0)
    }

    /// `cuMemGetAllocationGranularity` for pinned memory on `device`: the size that physical
    /// allocations, mappings and their addresses are multiples of (`recommended`, or the minimum).
    pub fn mem_allocation_granularity(&self, device: CUdevice, recommended: bool) -> Result<u64, DriverError> {
        let prop = pinned_on(device);
        let option = if recommended {
            CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        } else {
            CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        };
        let mut granularity: usize = 0;
        // SAFETY: `granularity` is a valid out-pointer and `prop` a valid reference.
        unsafe { call!(self, cuMemGetAllocationGranularity(&mut granularity, &prop, option)) }?;
        Ok(granularity as u64)
    }

    /// `cuMemAddressReserve`: `bytes` of virtual addresses (a multiple of the granularity), with
    /// no memory behind them, aligned to `alignment` (0: the granularity).
    pub fn mem_address_reserve(&self, bytes: u64, alignment: u64) -> Result<CUdeviceptr, DriverError> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer.
        unsafe { call!(self, cuMemAddressReserve(&mut ptr, bytes as usize, alignment as usize, 0, 0)) }?;
        Ok(ptr)
    }

    /// `cuMemAddressFree`: gives back a reserved range, whole.
    ///
    /// # Safety
    ///
    /// `ptr` and `bytes` are a range from [`Driver::mem_address_reserve`] of this driver, with
    /// nothing mapped in it any more; it is not used again.
    pub unsafe fn mem_address_free(&self, ptr: CUdeviceptr, bytes: u64) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range.
        unsafe { call!(self, cuMemAddressFree(ptr, bytes as usize)) }
    }

    /// `cuMemCreate`: `bytes` (a multiple of the granularity) of pinned memory on `device`, as a
    /// handle to map. The memory counts against the device at once.
    pub fn mem_create(&self, device: CUdevice, bytes: u64) -> Result<CUmemGenericAllocationHandle, DriverError> {
        let prop = pinned_on(device);
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer and `prop` a valid reference.
        unsafe { call!(self, cuMemCreate(&mut handle, bytes as usize, &prop, 0)) }?;
        Ok(handle)
    }

    /// `cuMemRelease`: the memory goes back to the device once its last mapping is unmapped.
    ///
    /// # Safety
    ///
    /// `handle` is a live handle from [`Driver::mem_create`] of this driver; it is not used again.
    pub unsafe fn mem_release(&self, handle: CUmemGenericAllocationHandle) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuMemRelease(handle)) }
    }

    /// `cuMemMap`: maps the first `bytes` of `handle` at `ptr`, inside a reserved range where
    /// nothing is mapped. The mapping has no access until [`Driver::mem_set_access`].
    ///
    /// # Safety
    ///
    /// `handle` is a live handle of this driver, and `[ptr, ptr + bytes)` lies in a range this
    /// driver reserved.
    pub unsafe fn mem_map(
        &self,
        ptr: CUdeviceptr,
        bytes: u64,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle and the range.
        unsafe { call!(self, cuMemMap(ptr, bytes as usize, 0, handle, 0)) }
    }

    /// `cuMemUnmap`: unmaps what one [`Driver::mem_map`] mapped at `ptr`, whole.
    ///
    /// # Safety
    ///
    /// No work that may still run uses `[ptr, ptr + bytes)` (unmapping does not wait for the
    /// GPU): the caller has synchronized with every stream that used it.
    pub unsafe fn mem_unmap(&self, ptr: CUdeviceptr, bytes: u64) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range is mapped and idle.
        unsafe { call!(self, cuMemUnmap(ptr, bytes as usize)) }
    }

    /// `cuMemSetAccess`: grants (or revokes) devices' access to a contiguous mapped range.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + bytes)` is mapped memory of this driver.
    pub unsafe fn mem_set_access(
        &self,
        ptr: CUdeviceptr,
        bytes: u64,
        access: &[CUmemAccessDesc],
    ) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the range; `access` is `access.len()` descriptors.
        unsafe { call!(self, cuMemSetAccess(ptr, bytes as usize, access.as_ptr(), access.len())) }
    }

    // ----- modules and kernels ----------------------------------------------------------------------

    /// `cuModuleLoadData` with PTX text, in the current context.
    pub fn module_load_ptx(&self, ptx: &CStr) -> Result<CUmodule, DriverError> {
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a PTX image is a NUL-terminated string, which `ptx` is; `module` is valid.
        unsafe { call!(self, cuModuleLoadData(&mut module, ptx.as_ptr().cast::<c_void>())) }?;
        Ok(module)
    }

    /// `cuModuleUnload`.
    ///
    /// # Safety
    ///
    /// `module` is a live module of this driver; its functions are not used again.
    pub unsafe fn module_unload(&self, module: CUmodule) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuModuleUnload(module)) }
    }

    /// `cuModuleGetFunction`: the kernel `name` of `module`.
    ///
    /// # Safety
    ///
    /// `module` is a live module of this driver.
    pub unsafe fn module_function(&self, module: CUmodule, name: &CStr) -> Result<CUfunction, DriverError> {
        let mut function: CUfunction = std::ptr::null_mut();
        // SAFETY: the caller guarantees the handle; `name` is NUL-terminated; `function` is valid.
        unsafe { call!(self, cuModuleGetFunction(&mut function, module, name.as_ptr())) }?;
        Ok(function)
    }

    /// `cuLaunchKernel` with kernel parameters (no `extra`).
    ///
    /// # Safety
    ///
    /// `function` and `stream` are live handles of this driver; `params` holds one pointer per
    /// kernel parameter, each to a value of that parameter's type; the memory the kernel touches
    /// is valid for it in `stream` order.
    pub unsafe fn launch_kernel(
        &self,
        function: CUfunction,
        grid: [u32; 3],
        block: [u32; 3],
        shared_memory: u32,
        stream: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<(), DriverError> {
        let params = if params.is_empty() { std::ptr::null_mut() } else { params.as_mut_ptr() };
        // SAFETY: the caller guarantees the handles, the parameters and the memory.
        unsafe {
            call!(
                self,
                cuLaunchKernel(
                    function,
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    shared_memory,
                    stream,
                    params,
                    std::ptr::null_mut(),
                )
            )
        }
    }
}

/// What `cuStreamGetCaptureInfo` says of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureInfo {
    /// Not capturing, capturing, or capturing but invalidated (the capture must still be ended).
    pub status: CUstreamCaptureStatus,
    /// The capture sequence's id, unique in the process; 0 when not capturing.
    pub id: u64,
    /// The graph being captured into; null when not capturing.
    pub graph: CUgraph,
}

impl CaptureInfo {
    /// Whether the stream is in a capture sequence, active or invalidated.
    pub fn capturing(&self) -> bool {
        self.status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }
}

/// Stream capture and graphs: capture status, instantiation, launch, graph memory.
impl Driver {
    /// `cuStreamBeginCapture_v2`: work enqueued on `stream` from now on is captured into a graph
    /// instead of run, until [`Driver::stream_end_capture`].
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_begin_capture(&self, stream: CUstream, mode: CUstreamCaptureMode) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuStreamBeginCapture_v2(stream, mode)) }
    }

    /// `cuStreamEndCapture`: the captured graph. An invalidated capture ends too, with
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` and no graph.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_end_capture(&self, stream: CUstream) -> Result<CUgraph, DriverError> {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: the caller guarantees the handle; `graph` is a valid out-pointer.
        unsafe { call!(self, cuStreamEndCapture(stream, &mut graph)) }?;
        Ok(graph)
    }

    /// `cuStreamIsCapturing`.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_is_capturing(&self, stream: CUstream) -> Result<CUstreamCaptureStatus, DriverError> {
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller guarantees the handle; `status` is a valid out-pointer.
        unsafe { call!(self, cuStreamIsCapturing(stream, &mut status)) }?;
        Ok(status)
    }

    /// `cuStreamGetCaptureInfo_v2`: status, sequence id and graph (dependencies not asked for).
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this driver or a special stream handle.
    pub unsafe fn stream_capture_info(&self, stream: CUstream) -> Result<CaptureInfo, DriverError> {
        let mut info = CaptureInfo {
            status: CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
            id: 0,
            graph: std::ptr::null_mut(),
        };
        let (no_deps, no_count) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the caller guarantees the handle; the three out-pointers are valid, the
        // dependency outputs are NULL, which the entry point allows.
        unsafe {
            call!(
                self,
                cuStreamGetCaptureInfo_v2(stream, &mut info.status, &mut info.id, &mut info.graph, no_deps, no_count)
            )
        }?;
        Ok(info)
    }

    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's capture mode and returns
    /// the one it had.
    pub fn thread_exchange_capture_mode(&self, mode: CUstreamCaptureMode) -> Result<CUstreamCaptureMode, DriverError> {
        let mut mode = mode;
        // SAFETY: `mode` is a valid in/out pointer.
        unsafe { call!(self, cuThreadExchangeStreamCaptureMode(&mut mode)) }?;
        Ok(mode)
    }

    /// `cuGraphInstantiateWithFlags`: an executable graph. `flags` are
    /// `CUgraphInstantiate_flags` bits, such as `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`.
    ///
    /// # Safety
    ///
    /// `graph` is a live graph of this driver.
    pub unsafe fn graph_instantiate(&self, graph: CUgraph, flags: u64) -> Result<CUgraphExec, DriverError> {
        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: the caller guarantees the handle; `exec` is a valid out-pointer.
        unsafe { call!(self, cuGraphInstantiateWithFlags(&mut exec, graph, flags)) }?;
        Ok(exec)
    }

    /// `cuGraphLaunch`: runs `exec` in `stream` order.
    ///
    /// # Safety
    ///
    /// `exec` and `stream` are live handles of this driver; the memory the graph's work touches
    /// is valid for it in `stream` order.
    pub unsafe fn graph_launch(&self, exec: CUgraphExec, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handles and the memory.
        unsafe { call!(self, cuGraphLaunch(exec, stream)) }
    }

    /// `cuGraphExecDestroy`.
    ///
    /// # Safety
    ///
    /// `exec` is a live executable graph of this driver; it is not used again.
    pub unsafe fn graph_exec_destroy(&self, exec: CUgraphExec) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuGraphExecDestroy(exec)) }
    }

    /// `cuGraphDestroy`.
    ///
    /// # Safety
    ///
    /// `graph` is a live graph of this driver; it is not used again.
    pub unsafe fn graph_destroy(&self, graph: CUgraph) -> Result<(), DriverError> {
        // SAFETY: the caller guarantees the handle.
        unsafe { call!(self, cuGraphDestroy(graph)) }
    }

    /// `cuDeviceGraphMemTrim`: gives back graph memory no graph is using.
    pub fn device_graph_mem_trim(&self, device: CUdevice) -> Result<(), DriverError> {
        // SAFETY: a device ordinal, checked by the driver.
        unsafe { call!(self, cuDeviceGraphMemTrim(device)) }
    }

    /// `cuDeviceGetGraphMemAttribute`: one counter of the device's graph memory, in bytes.
    pub fn device_graph_mem_attribute(
        &self,
        device: CUdevice,
        attribute: CUgraphMem_attribute,
    ) -> Result<u64, DriverError> {
        let mut value = 0u64;
        // SAFETY: every graph memory attribute is a `cuuint64_t`, which `value` is.
        unsafe { call!(self, cuDeviceGetGraphMemAttribute(device, attribute, (&raw mut value).cast::<c_void>())) }?;
        Ok(value)
    }

    /// The four graph memory counters of `device`, as [`PoolCounters`] (reserved: held by the
    /// graph memory pool; used: associated with graphs).
    pub fn device_graph_mem_counters(&self, device: CUdevice) -> Result<PoolCounters, DriverError> {
        use CUgraphMem_attribute as A;
        Ok(PoolCounters {
            reserved: self.device_graph_mem_attribute(device, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)?,
            reserved_high: self.device_graph_mem_attribute(device, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)?,
            used: self.device_graph_mem_attribute(device, A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT)?,
            used_high: self.device_graph_mem_attribute(device, A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)?,
        })
    }

    /// `cuDeviceSetGraphMemAttribute`: the driver accepts only the two high-water marks, set to
    /// 0 (which resets them).
    pub fn device_set_graph_mem_attribute(
        &self,
        device: CUdevice,
        attribute: CUgraphMem_attribute,
        value: u64,
    ) -> Result<(), DriverError> {
        let mut value = value;
        // SAFETY: every graph memory attribute is a `cuuint64_t`, which `value` is.
        unsafe { call!(self, cuDeviceSetGraphMemAttribute(device, attribute, (&raw mut value).cast::<c_void>())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse_with_the_caller_default_for_empty_values() {
        assert_eq!(Selection::parse("auto").unwrap(), Selection::Auto);
        assert_eq!(Selection::parse(" CUDA ").unwrap(), Selection::Cuda);
        assert_eq!(Selection::parse("gpu").unwrap(), Selection::Cuda);
        assert_eq!(Selection::parse("Simulated").unwrap(), Selection::Sim);
        assert_eq!(Selection::parse_or("", Selection::Auto).unwrap(), Selection::Auto);
        assert_eq!(Selection::parse_or("  ", Selection::Cuda).unwrap(), Selection::Cuda);
        assert_eq!(Selection::parse_or("sim", Selection::Cuda).unwrap(), Selection::Sim);
        match Selection::parse("") {
            Err(LoadError::Selection { value }) => assert_eq!(value, ""),
            other => panic!("an empty value names no driver: {other:?}"),
        }
        let error = Selection::parse_or("gpu-please", Selection::Auto).unwrap_err();
        assert_eq!(error.to_string(), "STEPPOOL_DEVICE=`gpu-please` is not one of `auto`, `cuda`, `sim`");
    }

    #[test]
    fn the_default_selection_is_the_real_driver_and_names_round_trip() {
        assert_eq!(Selection::default(), Selection::Cuda);
        assert_eq!(PoolRequirement::default(), PoolRequirement::Required);
        for selection in [Selection::Auto, Selection::Cuda, Selection::Sim] {
            assert_eq!(Selection::parse(&selection.to_string()).unwrap(), selection);
        }
    }

    #[test]
    fn simulated_drivers_offer_what_their_configuration_says() {
        let driver = Driver::simulated(SimConfig::default()).unwrap();
        assert_eq!(driver.pool_requirement(), PoolRequirement::Optional);
        assert!(driver.memory_pools_supported(0).unwrap());
        assert!(driver.pool_entry_points().iter().all(|&(_, exported)| exported));
        let old = Driver::simulated(SimConfig { driver_version: 11010, ..SimConfig::default() }).unwrap();
        assert!(!old.memory_pools_supported(0).unwrap());
        assert!(old.pool_entry_points().iter().all(|&(_, exported)| !exported), "11.1 has none of them");
        let without = Driver::simulated(SimConfig { memory_pools_supported: false, ..SimConfig::default() }).unwrap();
        assert!(!without.memory_pools_supported(0).unwrap());
    }
}
