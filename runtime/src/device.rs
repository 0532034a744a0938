//! Devices: a GPU reached through its primary context, the context cudarc, candle and cubecl use,
//! so pointers and streams interoperate with them.

use std::fmt;
use std::sync::{Arc, Mutex, Once, PoisonError};

use steppool_sys::bytes::Bytes;
use steppool_sys::{
    CUcontext, CUdevice, CUmemAccess_flags, CUmemAccessDesc, CUmemLocation, CUmemLocationType, CUstream,
    CUstream_flags, Driver, DriverKind,
};

use crate::error::{Error, Result};
use crate::runtime::RuntimeInner;
use crate::stream::{Stream, StreamCore};

/// A device as the runtime holds it. Releases its primary context when the last user goes.
pub(crate) struct DeviceCore {
    pub(crate) driver: Driver,
    pub(crate) ordinal: usize,
    pub(crate) device: CUdevice,
    ctx: CUcontext,
    pub(crate) name: String,
    pub(crate) total_memory: u64,
    /// Whether the device has memory pools; without them, allocation falls back to `cuMemAlloc`.
    pub(crate) pools_supported: bool,
    /// Devices granted access to this device's pools.
    pub(crate) peers: Mutex<Vec<CUdevice>>,
}

// SAFETY: a CUcontext is an opaque driver handle; the driver API may be called with it from any
// thread, and a context may be current on several threads at once (CUDA driver API, "Context
// Management"). Every other field is Send + Sync.
unsafe impl Send for DeviceCore {}
// SAFETY: as above; the handle is never mutated after construction.
unsafe impl Sync for DeviceCore {}

static FALLBACK_NOTICE: Once = Once::new();

impl DeviceCore {
    pub(crate) fn open(driver: &Driver, ordinal: usize) -> Result<Self> {
        let count = driver.device_count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        let device = driver.device(ordinal)?;
        let name = driver.device_name(device)?;
        let total_memory = driver.device_total_memory(device)?;
        let pools_supported = driver.memory_pools_supported(device)?;
        let ctx = driver.primary_context_retain(device)?;
        if !pools_supported {
            let version = driver.driver_version().map(|v| v.to_string()).unwrap_or_else(|_| "unknown".into());
            FALLBACK_NOTICE.call_once(|| {
                eprintln!(
                    "steppool: device {ordinal} ({name}) has no stream-ordered memory pools (driver {version}); \
                     allocating with cuMemAlloc/cuMemFree instead"
                );
            });
        }
        let core = Self {
            driver: driver.clone(),
            ordinal,
            device,
            ctx,
            name,
            total_memory,
            pools_supported,
            peers: Mutex::new(Vec::new()),
        };
        core.make_current()?;
        Ok(core)
    }

    /// Makes the device's primary context current on the calling thread, if it is not.
    pub(crate) fn make_current(&self) -> Result<()> {
        if self.driver.context_current()? != Some(self.ctx) {
            // SAFETY: `ctx` is this driver's primary context, retained until `self` drops.
            unsafe { self.driver.context_set_current(self.ctx) }?;
        }
        Ok(())
    }

    pub(crate) fn peers(&self) -> Vec<CUdevice> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl Drop for DeviceCore {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; everything that used the context (streams,
        // pools, buffers) holds an `Arc` to this core and is gone.
        let _ = unsafe { self.driver.primary_context_release(self.device) };
    }
}

impl fmt::Debug for DeviceCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal).field("name", &self.name).finish_non_exhaustive()
    }
}

/// A device of a [`Runtime`](crate::Runtime). Cheap to clone; `Send + Sync`.
///
/// Calls that need a current context make the device's primary context current on the calling
/// thread first, so a device works from whichever thread uses it.
#[derive(Clone)]
pub struct Device {
    pub(crate) core: Arc<DeviceCore>,
    pub(crate) runtime: Arc<RuntimeInner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({}: {}, {})", self.core.ordinal, self.core.name, Bytes(self.core.total_memory))
    }
}

impl Device {
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.core.ordinal
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// The device's memory in bytes.
    pub fn total_memory(&self) -> u64 {
        self.core.total_memory
    }

    /// Whether allocations use stream-ordered memory pools (otherwise `cuMemAlloc`/`cuMemFree`).
    pub fn memory_pools_supported(&self) -> bool {
        self.core.pools_supported
    }

    /// Whether this is a real GPU rather than the simulated device.
    pub fn is_gpu(&self) -> bool {
        self.core.driver.kind() == DriverKind::Cuda
    }

    /// The primary context's handle, for frameworks that need it.
    pub fn raw_context(&self) -> CUcontext {
        self.core.ctx
    }

    /// A new non-blocking stream, destroyed when the last clone of the [`Stream`] goes.
    pub fn create_stream(&self) -> Result<Stream> {
        self.core.make_current()?;
        let raw = self.core.driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING)?;
        Ok(Stream::new(StreamCore::new(self.core.clone(), raw, true, &self.runtime)))
    }

    /// Wraps a stream that a framework owns (cudarc's `CudaStream::cu_stream()`, candle's or
    /// cubecl's stream). steppool never destroys it. Wrap each stream once and clone the result:
    /// every wrapping gets its own pools.
    ///
    /// # Safety
    ///
    /// `raw` is a live stream of this device's primary context, or one of the special handles
    /// `NULL`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`; it outlives the returned [`Stream`],
    /// its clones, and every buffer allocated on it.
    pub unsafe fn wrap_stream(&self, raw: CUstream) -> Result<Stream> {
        Ok(Stream::new(StreamCore::new(self.core.clone(), raw, false, &self.runtime)))
    }

    /// `(free, total)` bytes of device memory; memory reserved by pools counts as used.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.core.make_current()?;
        Ok(self.core.driver.mem_get_info()?)
    }

    /// Waits for all work on the device.
    pub fn synchronize(&self) -> Result<()> {
        self.core.make_current()?;
        Ok(self.core.driver.context_synchronize()?)
    }

    /// Synchronizes the device and gives back every byte its pools hold without live data, what
    /// `torch.cuda.empty_cache()` does. Returns the bytes released.
    pub fn release_idle(&self) -> Result<u64> {
        self.runtime.trim_device(self.core.ordinal, None)
    }

    /// Lets `peer` access the memory of this device's pools, present and future
    /// (`cuMemPoolSetAccess`); the devices must be peer-capable (`cuDeviceCanAccessPeer`).
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        let driver = &self.core.driver;
        if peer.core.device == self.core.device {
            return Ok(());
        }
        if !driver.device_can_access_peer(peer.core.device, self.core.device)? {
            return Err(Error::PeerAccessUnsupported { device: self.core.ordinal, peer: peer.core.ordinal });
        }
        // Under the creation lock: a pool created meanwhile either sees the new peer or is in
        // the list granted below.
        let _creating = self.runtime.creating.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut peers = self.core.peers.lock().unwrap_or_else(PoisonError::into_inner);
            if !peers.contains(&peer.core.device) {
                peers.push(peer.core.device);
            }
        }
        for pool in self.runtime.pools_on(self.core.ordinal) {
            pool.grant_access(&[peer.core.device])?;
        }
        Ok(())
    }
}

/// The access descriptor that grants `device` read-write access.
pub(crate) fn read_write(device: CUdevice) -> CUmemAccessDesc {
    CUmemAccessDesc {
        location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}
