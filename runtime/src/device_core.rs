//! The device as the runtime holds it: a GPU through its primary context, the context cudarc,
//! candle and cubecl use, so pointers and streams interoperate with them.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, PoisonError, Weak};

use steppool_sys::handle::ContextHandle;
use steppool_sys::{
    CUdevice, CUmemAccess_flags, CUmemAccessDesc, CUmemLocation, CUmemLocationType, Driver, PoolRequirement,
};

use crate::error::{Error, Result};

/// A device as the runtime holds it. Releases its primary context when the last user goes.
pub(crate) struct DeviceCore {
    pub(crate) driver: Driver,
    pub(crate) ordinal: usize,
    pub(crate) device: CUdevice,
    pub(crate) ctx: ContextHandle,
    pub(crate) name: String,
    pub(crate) total_memory: u64,
    /// Whether the device has memory pools; without them, allocation falls back to `cuMemAlloc`.
    pub(crate) pools_supported: bool,
    /// Devices granted access to this device's pools.
    pub(crate) peers: Mutex<Vec<CUdevice>>,
    /// The granularity of physical memory mapped into reserved address ranges, where the device
    /// has virtual memory management (slabs that grow in place); `None` elsewhere.
    pub(crate) vmm_granularity: Option<u64>,
    /// The unit in which the device's CUDA pools reserve memory, which the driver does not
    /// publish: on a GPU the 32 MiB an H200's driver was measured to use
    /// ([`DEFAULT_POOL_UNIT`](steppool_sys::sim::DEFAULT_POOL_UNIT)); on the simulated device its
    /// configured unit, or its granule in the segment model.
    pub(crate) pool_unit: u64,
    /// Pools that keep the pages of memory freed in a step mapped, and give them back when the
    /// device needs more.
    pub(crate) freed: FreedPages,
    /// The pages mapped into the ranges of every pool on the device, now and at most.
    pub(crate) mapped: MappedPages,
}

/// The bytes of pages mapped into the address ranges of every pool on a device: now, and the
/// most at once over the runtime's life. Unlike the sum of the pools' high-water marks, the
/// high-water mark is the device's own: pages one pool gave back before another mapped its own
/// count once.
#[derive(Debug, Default)]
pub(crate) struct MappedPages {
    now: AtomicU64,
    high: AtomicU64,
}

impl MappedPages {
    /// `bytes` of pages were mapped.
    pub(crate) fn add(&self, bytes: u64) {
        let now = self.now.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.high.fetch_max(now, Ordering::AcqRel);
    }

    /// `bytes` of pages were unmapped.
    pub(crate) fn sub(&self, bytes: u64) {
        self.now.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// The most mapped at once.
    pub(crate) fn high(&self) -> u64 {
        self.high.load(Ordering::Acquire)
    }
}

/// A pool that may keep pages of freed memory mapped ([`FreedPages`]).
pub(crate) trait GivesBackFreed: Send + Sync {
    /// Gives back pages of freed memory it keeps mapped, `bytes` of them or all it keeps if
    /// fewer, unless its lock is taken (then it is the pool asking, or one another thread is
    /// serving). Returns the bytes given back.
    fn give_back_freed(&self, bytes: u64) -> u64;
}

/// Pages of freed memory the device's pools keep mapped, given back only when something on the
/// device is about to take more memory.
///
/// A pool that serves a step without a plan frees memory its later allocations often take again
/// (activations freed by the backward pass, taken by the next forward pass; a buffer freed and
/// allocated again at the same size). Unmapping such pages at every free and mapping them again
/// at the next allocation cost some 50 µs a page on an H200, and made a PyTorch training step
/// three times slower. Kept mapped, they cost nothing until another pool on the device (the
/// persistent pool taking the optimizer state, say) or the pool itself must take new memory:
/// then, first, the pools holding such pages give back as much as is about to be taken. The
/// device's reservation does not rise while freed pages could make room, so its peak is what it
/// would be had every free given its pages back at once; and a pool that asks for little takes
/// little from the others, which would map it again.
#[derive(Default)]
pub(crate) struct FreedPages {
    /// How many pools hold such pages now: growth asks nobody while it is 0.
    holding: AtomicUsize,
    /// Every pool that may hold them, weakly.
    pools: Mutex<Vec<Weak<dyn GivesBackFreed>>>,
}

impl FreedPages {
    /// Adds a pool to those asked.
    pub(crate) fn register(&self, pool: Weak<dyn GivesBackFreed>) {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools.retain(|pool| pool.strong_count() > 0);
        pools.push(pool);
    }

    /// A pool starts (`true`) or stops holding pages of freed memory.
    pub(crate) fn hold(&self, holding: bool) {
        if holding {
            self.holding.fetch_add(1, Ordering::AcqRel);
        } else {
            self.holding.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// `bytes` of memory are about to be taken from the device: the pools that hold pages of
    /// freed memory, and whose locks are free, give back as much first.
    pub(crate) fn before_growth(&self, bytes: u64) {
        if self.holding.load(Ordering::Acquire) == 0 || bytes == 0 {
            return;
        }
        let pools: Vec<_> =
            self.pools.lock().unwrap_or_else(PoisonError::into_inner).iter().filter_map(Weak::upgrade).collect();
        let mut wanted = bytes;
        for pool in pools {
            wanted = wanted.saturating_sub(pool.give_back_freed(wanted));
            if wanted == 0 {
                break;
            }
        }
    }
}

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
        if !pools_supported {
            let version = driver.driver_version().map(|v| v.to_string()).unwrap_or_else(|_| "unknown".into());
            if driver.pool_requirement() == PoolRequirement::Required {
                return Err(Error::PoolsUnsupported { ordinal, name, driver_version: version });
            }
            FALLBACK_NOTICE.call_once(|| {
                eprintln!(
                    "steppool: device {ordinal} ({name}) has no stream-ordered memory pools (driver {version}); \
                     allocating with cuMemAlloc/cuMemFree instead"
                );
            });
        }
        // Virtual memory management is an optimization: a device or driver without it (or one
        // that fails to answer) gets pool slabs instead.
        let vmm_granularity = driver
            .vmm_supported(device)
            .unwrap_or(false)
            .then(|| driver.mem_allocation_granularity(device, false).ok())
            .flatten()
            .filter(|&granularity| granularity > 0);
        let pool_unit = match driver.sim() {
            Some(sim) => sim.config().pool_unit.unwrap_or(sim.config().granule),
            None => steppool_sys::sim::DEFAULT_POOL_UNIT,
        };
        let ctx = ContextHandle::from_raw(driver.primary_context_retain(device)?);
        let core = Self {
            driver: driver.clone(),
            ordinal,
            device,
            ctx,
            name,
            total_memory,
            pools_supported,
            peers: Mutex::new(Vec::new()),
            vmm_granularity,
            pool_unit,
            freed: FreedPages::default(),
            mapped: MappedPages::default(),
        };
        core.make_current()?;
        Ok(core)
    }

    /// Makes the device's primary context current on the calling thread, if it is not.
    pub(crate) fn make_current(&self) -> Result<()> {
        if self.driver.context_current()? != Some(self.ctx.raw()) {
            // SAFETY: `ctx` is this driver's primary context, retained until `self` drops.
            unsafe { self.driver.context_set_current(self.ctx.raw()) }?;
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

/// The access descriptor that grants `device` read-write access.
pub(crate) fn read_write(device: CUdevice) -> CUmemAccessDesc {
    CUmemAccessDesc {
        location: CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: device },
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}
