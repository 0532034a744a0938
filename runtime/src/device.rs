//! [`Device`]: a GPU of a runtime, the handle users hold.

use std::fmt;
use std::sync::{Arc, PoisonError};

use steppool_sys::bytes::Bytes;
use steppool_sys::{CUcontext, CUstream, CUstream_flags, DriverKind};

use crate::device_core::DeviceCore;
use crate::error::{Error, Result};
use crate::inner::RuntimeInner;
use crate::stream::Stream;
use crate::stream_core::StreamCore;

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
        self.core.ctx.raw()
    }

    /// A new non-blocking stream, destroyed when the last clone of the [`Stream`] goes.
    pub fn create_stream(&self) -> Result<Stream> {
        self.core.make_current()?;
        let raw = self.core.driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING)?;
        Ok(Stream::new(StreamCore::new(self.core.clone(), raw, true, self.runtime.id)))
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
        Ok(Stream::new(StreamCore::new(self.core.clone(), raw, false, self.runtime.id)))
    }

    /// The most bytes of pages mapped at once into the address ranges of steppool's pools on this
    /// device (planned slabs, arenas and chunked ranges that grow in place, where the device has
    /// virtual memory management), over the runtime's life. Exact where a sum of the pools'
    /// high-water marks ([`Usage::reserved_high`](crate::telemetry::Usage)) only bounds
    /// the device's peak from above: a page one pool gave back and another mapped counts once.
    /// Memory the pools' CUDA pools hold comes beside it
    /// ([`Usage::pool_reserved_high`](crate::telemetry::Usage)).
    pub fn mapped_high_bytes(&self) -> u64 {
        self.core.mapped.high()
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
        self.runtime.trim_device(self.core.ordinal)
    }

    /// Lets `peer` access the memory of this device's pools, present and future
    /// (`cuMemPoolSetAccess`); the devices must be peer-capable (`cuDeviceCanAccessPeer`).
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.core.device == self.core.device {
            return Ok(());
        }
        if !self.core.driver.device_can_access_peer(peer.core.device, self.core.device)? {
            return Err(Error::PeerAccessUnsupported { device: self.core.ordinal, peer: peer.core.ordinal });
        }
        // Under the creation lock: a pool created meanwhile either sees the new peer or is in
        // the list granted below.
        let _creating = self.runtime.registry.creating();
        {
            let mut peers = self.core.peers.lock().unwrap_or_else(PoisonError::into_inner);
            if !peers.contains(&peer.core.device) {
                peers.push(peer.core.device);
            }
        }
        for pool in self.runtime.registry.pools_on(self.core.ordinal) {
            pool.lock().grant_access(&[peer.core.device])?;
        }
        Ok(())
    }
}
