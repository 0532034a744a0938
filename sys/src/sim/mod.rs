//! The simulated device: the CUDA driver entry points steppool uses, answered on the CPU.
//!
//! [`Sim`] has a method for each entry point, with the C signature and the C error contract:
//! it writes results through out-pointers and returns the `CUresult` the real driver returns for
//! the same call, including for bad handles, bad values, double frees and calls made before
//! `cuInit` or without a current context. [`Driver`](crate::Driver) dispatches to it or to
//! `libcuda` with the same arguments, so code above cannot tell which one it talks to.
//!
//! Those entry points, and making a `Sim`, are private to this crate: other crates make a
//! simulated device with [`Driver::simulated`](crate::Driver::simulated) and call it through
//! [`Driver`](crate::Driver)'s checked methods (the one exception, [`SimLibrary`], is below). What they may reach through
//! [`Driver::sim`](crate::Driver::sim) is inspection ([`Sim::config`], [`Sim::pool_layout`],
//! [`Sim::mapped_ranges`], [`Sim::is_ordered_after`], [`Sim::calls`]) and the test facilities
//! below.
//!
//! # Test facilities
//!
//! - **Calls counted.** With [`SimConfig::count_calls`], every entry point called through
//!   [`Driver`](crate::Driver) or [`SimLibrary`] is counted; [`Sim::calls`] says how often one
//!   was called, so a test can assert that a code path never synchronizes
//!   (`cuStreamSynchronize`). Off by default, since a count costs every call a lock. With
//!   `STEPPOOL_SIM_CALLS=PATH` in the environment, each simulated driver appends its counts to
//!   `PATH` as one JSON object per line when it goes away (how many synchronizations a replay
//!   made, for example).
//! - **Work held incomplete.** The simulated device runs work in zero time, so a query always
//!   finds it complete and code that waits for the GPU only when it must never takes that path.
//!   [`Sim::hold_stream`] holds back the work enqueued on a stream from then on (and work ordered
//!   after it): `cuStreamQuery` and `cuEventQuery` answer `CUDA_ERROR_NOT_READY` for it and
//!   observe none of its frees, until [`Sim::release_stream`] lets it run or a
//!   synchronization (`cuStreamSynchronize`, `cuEventSynchronize`, `cuCtxSynchronize`) waits for
//!   it. Only tests use it; nothing else in the model changes (copies and kernels still take
//!   effect when enqueued).
//!
//! Device memory is not backed by host memory unless [`SimConfig::host_memory`] asks for it
//! (`STEPPOOL_SIM_HOST_MEMORY=1`): pointers are addresses in a simulated address space, never
//! dereferenced. Without it, memset and copies into the device are checked and ordered without
//! effect, and copies back to the host return `CUDA_ERROR_NOT_SUPPORTED`. With it, every reserved
//! unit or segment has a zeroed host block behind it (`memory.rs`), and memset, the `cuMemcpy*` entry
//! points and the repository's fill kernels ([`crate::kernels`]) write it. Other kernels are
//! checked and ordered but do not run.
//!
//! [`SimLibrary`] makes the entry points public for one caller: a C ABI library that stands in
//! for `libcuda` (`sys/libcuda-sim`), so that programs loading the driver by name (cudarc) talk
//! to the simulated device. Everything else goes through [`Driver`](crate::Driver).
//!
//! # The model
//!
//! The driver's placement policy is unpublished; this is steppool's model of it, documented so
//! that its numbers can be read for what they are and calibrated against real GPU runs.
//!
//! **Calibration** (`benches/results/2026-11-27-h200-calibration.md`: an H200, driver
//! 580.159.04, CUDA 13.0). The driver's pool reserves in units of 32 MiB (a one-byte request
//! reserved 32 MiB, 33 MiB reserved 64) and places allocations across the units' boundaries, as
//! in one range that grows; that is this model's default ([`DEFAULT_POOL_UNIT`]), and the tests
//! in `tests.rs` replay the probe that showed it. Replaying 23 traces at the H200's capacity, the
//! driver's peaks equal this model's for the arena on all 23, for the planned strategy (which
//! maps its own pages) on all 23, for phase pools on 13 (0.80 to 1.12 times it on the rest) and
//! for one pool on 10 (0.80 to 1.29 times it; `benches/results/2026-11-27-sim-pool-units.md`).
//! The model before calibration, a segment per growth ([`SimConfig::pool_unit`] `None`,
//! `STEPPOOL_SIM_POOL_UNIT=segments`, `steppool replay --pool-unit segments`), was 0.61 to 1.26
//! times the driver's for one pool and 0.64 to 2.0 for phase pools; it stays for comparison
//! and for worked examples in granules. On 47 traces up to 33 GiB live, since idle units' memory
//! moves as below, one pool's peak equals the driver's on 20 (0.80 to 2.0 times it on the rest)
//! and phase pools' on 29 (0.80 to 1.13;
//! `benches/results/2026-11-28-unit-moves-predicted-plans-simulated.md`).
//!
//! - **Reservations.** A pool is one address range (a second only for a request that fits in no
//!   free piece of the first) and maps memory into it in units of [`SimConfig::pool_unit`],
//!   aligned to the range's base: an allocation maps the units it overlaps that are not mapped
//!   yet, and a unit goes back only when nothing in it is live. An allocation that must map units
//!   first takes the memory of the pool's idle units (nothing live, every free in them one its
//!   stream may reuse), highest address first, whose addresses stay free and unmapped: so a pool
//!   reserves the most units that held a live byte at once, which is what the H200's driver
//!   reserved after each of 149,624 allocations of 17 traces
//!   (`benches/results/2026-11-27-h200-placement.jsonl.gz`). A unit is mapped whole or not at
//!   all, and only while one granule stays free beside it: the H200's driver, asked by
//!   `pool-probe` with its memory filled by `cuMemAlloc`, refused a 1 MiB request needing a new
//!   unit with 33.1 MiB free and granted it with 35.1 MiB free
//!   (`benches/results/2026-11-27-h200-placement.md`). In the segment model a pool
//!   instead reserves, when no free piece fits an allocation, a new segment of the request
//!   rounded up to the granule (`STEPPOOL_SIM_GRANULE`, default 2 MiB), at an address of its
//!   own. A device refuses memory that would take its pools' reservations past its capacity;
//!   before it reports out-of-memory it first releases every idle segment or unit of every pool
//!   on the device, as the driver may release pool memory "to enable an unrelated memory
//!   allocation request in the same process to succeed".
//! - **Placement.** Allocations are rounded up to 512 bytes, which is also their alignment, and
//!   placed best-fit: the smallest free piece that is large enough, the lowest address on ties,
//!   at the start of that piece, preferring a piece in memory already reserved. Freed neighbours
//!   merge; pieces never span two segments, and span units freely. A request of zero bytes
//!   succeeds with a null pointer and places nothing (as the driver answered on an H200).
//! - **Stream order.** Every stream-ordered call moves its stream one position forward; events
//!   carry the position (and everything it was ordered after) at which they were recorded. Memory
//!   freed on stream A is reusable at once on A; on another stream B once B is ordered after the
//!   free by an event wait (`REUSE_FOLLOW_EVENT_DEPENDENCIES`); and on any stream once the host
//!   has observed the free complete (a stream, event or context synchronize, or a query). The
//!   simulated device runs work in zero time, so a query finds work complete; what a query
//!   observes becomes reusable by other streams only in pools with `REUSE_ALLOW_OPPORTUNISTIC`
//!   (a free the GPU has already executed), what a synchronization observes in every pool. When
//!   a pool cannot grow (the device is full, or the pool is at its `maxSize`) and
//!   `REUSE_ALLOW_INTERNAL_DEPENDENCIES` is set, an allocation on B may take memory freed on A
//!   after making B wait for all work enqueued on A so far. The legacy default stream
//!   orders with every blocking stream of its context, both ways; the per-thread default stream
//!   is one blocking stream per thread.
//! - **Giving memory back.** At a synchronization, each pool on the synchronized device whose
//!   reservation exceeds its release threshold (default 0) releases idle segments or units,
//!   largest first, then highest address, while at least the threshold remains.
//!   `cuMemPoolTrimTo(pool, keep)` does the same with `keep`. A segment or unit is idle when
//!   nothing in it is allocated and every free in it has been observed complete; frees not yet
//!   observed count as outstanding, as the driver documents.
//! - **Counters.** `USED_MEM_*` count allocated bytes after rounding to 512; `RESERVED_MEM_*`
//!   count segments or mapped units; `cuMemGetInfo` reports capacity minus everything reserved
//!   on the device.
//! - **`cuMemAlloc`.** Synchronous allocations come from a hidden per-device pool of segments,
//!   whatever the pool unit; `cuMemFree` returns empty segments to the device at once. Releasing the last
//!   retain of the primary context resets it: its streams, events, modules and `cuMemAlloc`
//!   allocations are destroyed; pool allocations, which no context owns, stay.
//! - **Kernels.** Launches are checked against an H100's limits (block 1024 × 1024 × 64 and 1024
//!   threads, grid 2³¹−1 × 65535 × 65535, 48 KiB of dynamic shared memory) and ordered, not run;
//!   on a host-backed device the fill kernels of [`crate::kernels`] (recognized by their exact
//!   PTX) run at launch, and a fill outside every live allocation is
//!   `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! - **Copies and memset.** Work runs when it is enqueued, in zero time, after the checks: the
//!   device range must lie inside one live allocation (`CUDA_ERROR_INVALID_VALUE` otherwise).
//!   The synchronous `cuMemcpy*_v2` and `cuMemsetD8_v2` are the asynchronous call on the legacy
//!   stream followed by its synchronization.
//! - **Stream capture and graphs** (`capture.rs`). The capture conformance tests ran on an H200
//!   (driver 580.159.04, 2026-11-27): the codes and capture states of synchronizations, queries,
//!   `cuMemAlloc`, `cuMemPoolTrimTo`, `cuMemPoolCreate`, `cuMemPoolGetAttribute`,
//!   `cuDeviceGraphMemTrim`, queries of captured events and frees of memory allocated before the
//!   capture are the driver's, in all three modes, as are graph allocations keeping their
//!   addresses across relaunches; rules marked *unconfirmed* have not been seen on a GPU. While a
//!   stream captures, its stream-ordered calls are recorded, not run: `cuMemAllocAsync`/`cuMemAllocFromPoolAsync` become allocation nodes whose address
//!   is reserved at once and fixed for the graph's life (the pool only parameterises the node;
//!   nothing counts against it), `cuMemFreeAsync` a free node that must name a graph allocation
//!   (of memory allocated outside the capture it is `CUDA_ERROR_INVALID_VALUE`, and the capture
//!   goes on), kernels, memsets and copies nodes checked against live memory. A synchronization or query
//!   of a capturing stream is `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture;
//!   later calls on it return `..._INVALIDATED` until `cuStreamEndCapture`, which returns no
//!   graph. Potentially unsafe calls (`cuMemAlloc`, `cuMemFree`, `cuMemPoolTrimTo`,
//!   `cuMemPoolCreate`, `cuMemPoolGetAttribute`, `cuMemPoolSetAttribute`) follow the rules of
//!   `cuThreadExchangeStreamCaptureMode` (global, thread-local, relaxed); `cuDeviceGraphMemTrim`
//!   is allowed in every mode; `cuCtxSynchronize` with a capturing stream in the context is
//!   refused; work on the legacy stream while a blocking stream captures is `..._IMPLICIT`;
//!   events recorded in a capture fork other streams into it, must be joined back
//!   (`..._UNJOINED`), cannot be waited on from another capture (`..._MERGE`), and cannot be
//!   queried or synchronized (`CUDA_ERROR_CAPTURED_EVENT`, invalidating the capture); waiting
//!   in capture on an event recorded outside it is `..._ISOLATION`. Graph memory comes from a per-device graph pool
//!   whose reservation counts against the device: an executable graph's first launch maps its
//!   footprint (the peak of its allocations in node order, each rounded to the granule), which
//!   stays associated with graphs ("used") until the executable graph is destroyed, and
//!   `cuDeviceGraphMemTrim` gives back what is reserved beyond that. A relaunch while an
//!   allocation of an earlier launch is live is `CUDA_ERROR_INVALID_VALUE` unless the graph was
//!   instantiated with auto-free-on-launch. Not modelled: sharing physical memory between
//!   graphs, replay of kernels, memsets and copies at launch, host memory behind graph
//!   allocations, graphs built node by node, destroying a stream or releasing a context while it
//!   captures.
//! - **Virtual memory management.** Reserved address ranges, physical allocations counted
//!   against the device's capacity at granule size, mappings and access: the rules and the codes
//!   for misuse are in `vmm.rs`. Reported by default, as on an H100, H200 or A100; a device
//!   without it (`STEPPOOL_SIM_VMM=0`) refuses those calls with `CUDA_ERROR_NOT_SUPPORTED`.
//! - **Not modelled.** IPC export and import return `CUDA_ERROR_NOT_SUPPORTED`, and pools with
//!   export handle types are refused with it.

mod abi;
mod clock;
mod config;
mod faults;
mod handle;
mod memory;
mod space;
mod state;
mod vmm;

pub use abi::SimLibrary;
pub use faults::{FaultCode, FaultPlan, FaultPlanError, Trigger};

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uchar, c_uint, c_ulonglong, c_void};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

pub use config::{
    DEFAULT_CAPACITY, DEFAULT_DRIVER_VERSION, DEFAULT_GRANULE, DEFAULT_POOL_UNIT, MAX_CAPACITY, MAX_DEVICES, SimConfig,
    SimConfigError, parse_pool_unit,
};
use faults::Faults;
use space::Readiness;
use state::{INVALID_VALUE, Launch, Mapping, NOT_SUPPORTED, R, SUCCESS, State};

use crate::bindings::*;
use crate::{CU_STREAM_LEGACY, Width, pool_attribute_width as attribute_width};

/// Entry points that a driver older than 11.2 does not export; a simulated driver configured
/// with such a version lacks them as well.
const SINCE_11_2: &[&str] = &[
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolSetAccess",
    "cuMemPoolGetAccess",
    "cuDeviceGetDefaultMemPool",
    "cuDeviceGetMemPool",
    "cuDeviceSetMemPool",
    "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer",
    "cuMemPoolImportPointer",
];

/// Entry points new in 11.0 (`cuDevicePrimaryCtxRelease_v2`).
const SINCE_11_0: &[&str] = &["cuDevicePrimaryCtxRelease_v2"];

/// `cuStreamGetCaptureInfo_v2`, new in 11.3.
const SINCE_11_3: &[&str] = &["cuStreamGetCaptureInfo_v2"];

/// Entry points of graph memory nodes, new in 11.4.
const SINCE_11_4: &[&str] = &[
    "cuGraphInstantiateWithFlags",
    "cuDeviceGraphMemTrim",
    "cuDeviceGetGraphMemAttribute",
    "cuDeviceSetGraphMemAttribute",
];

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A simulated CUDA driver with one or more devices. See the [module docs](self) for the model.
///
/// Each `Sim` is independent: its handles and pointers mean nothing to another one. It is
/// `Send + Sync`; every entry point takes one lock. Other crates see one through
/// [`Driver::sim`](crate::Driver::sim), for inspection.
#[derive(Debug)]
pub struct Sim {
    state: Mutex<State>,
    config: SimConfig,
    /// The fault plan being carried out (see `faults.rs`).
    faults: Mutex<Faults>,
    /// Whether a plan is set or a fault poisoned the driver: calls look at `faults` only then.
    faulting: AtomicBool,
    /// The state's capture epoch (see [`Sim::capture_epoch`]), readable without its lock.
    capture_epoch: Arc<AtomicU64>,
    /// Whether calls are counted ([`SimConfig::count_calls`], or `STEPPOOL_SIM_CALLS` set).
    counting: bool,
    /// Calls made, by entry point (see [`Sim::calls`]).
    calls: Mutex<HashMap<&'static str, u64>>,
    /// Where the counts go when the driver goes away (`STEPPOOL_SIM_CALLS`), if anywhere.
    call_log: Option<PathBuf>,
}

/// A snapshot of one pool's memory, which only the simulated device can give: the driver
/// publishes no layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolLayout {
    /// The device ordinal the pool lives on.
    pub device: usize,
    /// Bytes reserved: the mapped units.
    pub reserved: u64,
    /// Bytes allocated, after rounding to 512.
    pub used: u64,
    /// The unit in which the pool maps memory: [`SimConfig::pool_unit`] where set, otherwise
    /// the granule, to which each segment is rounded.
    pub unit: u64,
    /// The address ranges the pool places allocations in, as `(base, size)`, by address; units
    /// are aligned to their range's base.
    pub ranges: Vec<(u64, u64)>,
    /// Mapped memory as `(base, size)` runs of adjacent units, by address.
    pub mapped: Vec<(u64, u64)>,
    /// Live allocations as `(address, size after rounding)`, by address.
    pub allocations: Vec<(u64, u64)>,
    /// Free pieces of mapped memory, by address (an allocation may span units, so a piece may too).
    pub free: Vec<FreePiece>,
}

/// A range of physical memory mapped into a reserved address range (`cuMemMap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    /// The device ordinal whose memory it is.
    pub device: usize,
    /// Its address.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// A free range inside a pool's mapped memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreePiece {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Whether every stream may reuse it now; otherwise it waits for a free to be ordered or
    /// observed complete.
    pub ready: bool,
}

impl PoolLayout {
    /// The largest free piece, in bytes.
    pub fn largest_free(&self) -> u64 {
        self.free.iter().map(|p| p.len).max().unwrap_or(0)
    }

    /// All free bytes inside the pool's mapped memory.
    pub fn total_free(&self) -> u64 {
        self.free.iter().map(|p| p.len).sum()
    }
}

impl Sim {
    /// A simulated driver with the given devices, once [`SimConfig::validate`] accepts them.
    pub(crate) fn new(config: SimConfig) -> Result<Self, SimConfigError> {
        config.validate()?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let faulting = AtomicBool::new(config.faults.is_some());
        let faults = Mutex::new(Faults::new(config.faults.clone()));
        let state = State::new(id, config.clone());
        let capture_epoch = state.capture_epoch.clone();
        let call_log = std::env::var_os("STEPPOOL_SIM_CALLS").filter(|path| !path.is_empty()).map(PathBuf::from);
        let calls = Mutex::new(HashMap::new());
        let counting = config.count_calls || call_log.is_some();
        Ok(Self { state: Mutex::new(state), config, faults, faulting, capture_epoch, counting, calls, call_log })
    }

    /// How many times `entry_point` (its exported name, such as `cuStreamSynchronize`) was
    /// called so far, failed calls included. A test facility (see the [module docs](self)).
    ///
    /// # Panics
    ///
    /// When the driver does not count ([`SimConfig::count_calls`] off and `STEPPOOL_SIM_CALLS`
    /// unset): every count would read 0, and a test of "no such call" could not fail.
    pub fn calls(&self, entry_point: &str) -> u64 {
        assert!(self.counting, "Sim::calls on a driver that does not count: set SimConfig::count_calls");
        self.calls.lock().unwrap_or_else(PoisonError::into_inner).get(entry_point).copied().unwrap_or(0)
    }

    /// Holds back the work enqueued on `stream` from now on, and work ordered after it: queries
    /// answer `CUDA_ERROR_NOT_READY` for it until [`Sim::release_stream`] or a synchronization
    /// that waits for it. A test facility (see the [module docs](self)); the special handles need
    /// a current context. `Err` with the driver's code for a handle it does not know.
    pub fn hold_stream(&self, stream: CUstream) -> Result<(), CUresult> {
        self.lock().hold(stream)
    }

    /// Lets the work [`Sim::hold_stream`] held back on `stream` run: the next query finds it
    /// complete.
    pub fn release_stream(&self, stream: CUstream) -> Result<(), CUresult> {
        self.lock().release(stream)
    }

    /// A number that moves before any stream of this driver begins or joins a capture, and when
    /// a stream or context goes away: a stream that `cuStreamGetCaptureInfo` found outside
    /// capture while the number was *n* is still outside capture, with the same answer, while
    /// it reads *n* — every call to this device goes through this `Sim`. `None` while a fault
    /// plan is set or a fault poisoned the driver: then every call must reach the plan. Read
    /// without the state's lock.
    #[inline]
    pub fn capture_epoch(&self) -> Option<u64> {
        if self.faulting.load(Ordering::Acquire) {
            return None;
        }
        Some(self.capture_epoch.load(Ordering::SeqCst))
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Replaces the fault plan (`None`: no more faults) and counts calls afresh. A driver a
    /// sticky error or a shutdown poisoned stays poisoned.
    pub fn set_faults(&self, plan: Option<FaultPlan>) {
        let mut faults = self.faults.lock().unwrap_or_else(PoisonError::into_inner);
        self.faulting.store(plan.is_some() || faults.poisoned().is_some(), Ordering::Release);
        faults.set(plan);
    }

    /// How many calls the fault plans made fail so far.
    pub fn faults_fired(&self) -> u64 {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner).fired()
    }

    /// The code every call now returns, if an injected sticky error or shutdown poisoned the
    /// driver.
    pub fn poisoned(&self) -> Option<FaultCode> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner).poisoned()
    }

    /// The code the call of `entry_point` about to run returns instead of running, if the fault
    /// plan makes it fail (or a fault poisoned the driver). Counts the call ([`Sim::calls`]).
    #[inline]
    pub(crate) fn fault(&self, entry_point: &'static str) -> Option<CUresult> {
        if self.counting {
            *self.calls.lock().unwrap_or_else(PoisonError::into_inner).entry(entry_point).or_insert(0) += 1;
        }
        if !self.faulting.load(Ordering::Acquire) {
            return None;
        }
        self.faults.lock().unwrap_or_else(PoisonError::into_inner).check(entry_point)
    }

    /// Whether this driver exports `symbol`, given the version it pretends to be.
    pub(crate) fn exports(&self, symbol: &str) -> bool {
        let version = self.config.driver_version;
        if (version < 11040 && SINCE_11_4.contains(&symbol)) || (version < 11030 && SINCE_11_3.contains(&symbol)) {
            return false;
        }
        if version >= 11020 {
            return true;
        }
        !(SINCE_11_2.contains(&symbol) || (version < 11000 && SINCE_11_0.contains(&symbol)))
    }

    /// The layout of `pool`: its mapped memory, live allocations and free pieces. `None` for a handle
    /// that is not a pool of this driver.
    pub fn pool_layout(&self, pool: CUmemoryPool) -> Option<PoolLayout> {
        let state = self.lock();
        let id = state.pool_id_for_inspection(pool)?;
        let pool = &state.pools[&id];
        let allocations =
            state.allocations.iter().filter(|(_, a)| a.pool == id).map(|(&addr, a)| (addr, a.size)).collect();
        let mut mapped: Vec<(u64, u64)> = Vec::new();
        for &base in pool.units.keys() {
            match mapped.last_mut() {
                // Segments stay apart, as each is its own range; units of one range join.
                Some((start, size)) if *start + *size == base && matches!(pool.mapping, Mapping::Units(_)) => {
                    *size += pool.units[&base].size
                }
                _ => mapped.push((base, pool.units[&base].size)),
            }
        }
        // Free pieces cover the pool's whole address ranges; keep their mapped parts.
        let mut free = Vec::new();
        for (addr, piece) in pool.free.pieces() {
            let end = addr + piece.len;
            let first = mapped.partition_point(|&(base, size)| base + size <= addr);
            for &(base, size) in mapped[first..].iter().take_while(|&&(base, _)| base < end) {
                let (from, to) = (addr.max(base), end.min(base + size));
                free.push(FreePiece { addr: from, len: to - from, ready: piece.readiness == Readiness::Ready });
            }
        }
        Some(PoolLayout {
            device: pool.device,
            reserved: pool.reserved,
            used: pool.used,
            unit: match pool.mapping {
                Mapping::Segments { granule } => granule,
                Mapping::Units(unit) => unit,
            },
            ranges: pool.extents.iter().map(|(&base, &len)| (base, len)).collect(),
            mapped,
            allocations,
            free,
        })
    }

    /// Every range mapped with `cuMemMap`, by address: the device whose memory it is, its address
    /// and size. The driver publishes this no more than a pool's layout.
    pub fn mapped_ranges(&self) -> Vec<MappedRange> {
        self.lock().vmm.mapped().into_iter().map(|(device, base, size)| MappedRange { device, base, size }).collect()
    }

    /// Whether work enqueued on `waiter` from now on runs after all work enqueued so far on
    /// `other`: the stream order the model derives from events and waits. `None` for a stream
    /// handle this driver does not know (special handles need a current context).
    pub fn is_ordered_after(&self, waiter: CUstream, other: CUstream) -> Option<bool> {
        self.lock().is_ordered_after(waiter, other).ok()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No entry point panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn call(&self, f: impl FnOnce(&mut State) -> R<()>) -> CUresult {
        match f(&mut self.lock()) {
            Ok(()) => SUCCESS,
            Err(code) => code,
        }
    }

    /// Runs `f` and writes its value through `out`.
    ///
    /// # Safety
    ///
    /// `out` must be null or valid for a write of `T`.
    unsafe fn out<T>(&self, out: *mut T, f: impl FnOnce(&mut State) -> R<T>) -> CUresult {
        if out.is_null() {
            return INVALID_VALUE;
        }
        match f(&mut self.lock()) {
            Ok(value) => {
                // SAFETY: `out` is not null and the caller guarantees it is valid for a write.
                unsafe { out.write(value) };
                SUCCESS
            }
            Err(code) => code,
        }
    }
}

impl Drop for Sim {
    /// Appends the call counts to `STEPPOOL_SIM_CALLS`, if set; a file that cannot be written
    /// is skipped (a diagnostic, never a panic).
    fn drop(&mut self) {
        let Some(path) = &self.call_log else { return };
        let calls = self.calls.get_mut().unwrap_or_else(PoisonError::into_inner);
        let mut counts: Vec<(&&str, &u64)> = calls.iter().collect();
        counts.sort();
        let fields: Vec<String> = counts.into_iter().map(|(name, count)| format!("\"{name}\":{count}")).collect();
        let line = format!("{{{}}}\n", fields.join(","));
        if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = file.write_all(line.as_bytes());
        }
    }
}

/// Writes `text` through `out`, or NULL for a code without one (as `cuGetErrorName` documents).
///
/// # Safety
///
/// `out` must be null or valid for a write.
unsafe fn error_text(out: *mut *const c_char, text: Option<&'static CStr>) -> CUresult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: `out` is not null and the caller guarantees it is valid for a write.
    unsafe { out.write(text.map_or(std::ptr::null(), CStr::as_ptr)) };
    if text.is_some() { SUCCESS } else { INVALID_VALUE }
}

/// Descriptions the simulated driver gives for codes, in the spirit of `cuGetErrorString`.
fn describe(code: CUresult) -> Option<&'static CStr> {
    use CUresult as C;
    Some(match code {
        C::CUDA_SUCCESS => c"no error",
        C::CUDA_ERROR_INVALID_VALUE => c"invalid argument",
        C::CUDA_ERROR_OUT_OF_MEMORY => c"out of memory",
        C::CUDA_ERROR_NOT_INITIALIZED => c"initialization error",
        C::CUDA_ERROR_DEINITIALIZED => c"driver shutting down",
        C::CUDA_ERROR_STUB_LIBRARY => c"CUDA driver is a stub library",
        C::CUDA_ERROR_NO_DEVICE => c"no CUDA-capable device is detected",
        C::CUDA_ERROR_INVALID_DEVICE => c"invalid device ordinal",
        C::CUDA_ERROR_INVALID_IMAGE => c"device kernel image is invalid",
        C::CUDA_ERROR_INVALID_CONTEXT => c"invalid device context",
        C::CUDA_ERROR_INVALID_HANDLE => c"invalid resource handle",
        C::CUDA_ERROR_NOT_FOUND => c"named symbol not found",
        C::CUDA_ERROR_NOT_READY => c"device not ready",
        C::CUDA_ERROR_CONTEXT_IS_DESTROYED => c"context is destroyed",
        C::CUDA_ERROR_NOT_PERMITTED => c"operation not permitted",
        C::CUDA_ERROR_NOT_SUPPORTED => c"operation not supported",
        C::CUDA_ERROR_UNKNOWN => c"unknown error",
        other => return other.c_name(),
    })
}

/// The entry points, with the signatures of `cuda.h` for their exported names. Private to this
/// crate: [`Driver`](crate::Driver) is their only caller outside the simulated device's tests.
///
/// # Safety
///
/// This section is the `# Safety` of every entry point below. Each has the contract of the
/// driver function of the same name: pointer arguments must be null or valid for the reads and
/// writes that function documents. Handles may be anything; invalid ones are refused with the
/// driver's error code.
#[allow(non_snake_case)]
impl Sim {
    pub(crate) unsafe fn cuGetErrorName(&self, error: CUresult, pStr: *mut *const c_char) -> CUresult {
        // SAFETY: forwarded contract: `pStr` is null or valid for a write.
        unsafe { error_text(pStr, error.c_name()) }
    }

    pub(crate) unsafe fn cuGetErrorString(&self, error: CUresult, pStr: *mut *const c_char) -> CUresult {
        // SAFETY: forwarded contract: `pStr` is null or valid for a write.
        unsafe { error_text(pStr, describe(error)) }
    }

    pub(crate) unsafe fn cuInit(&self, Flags: c_uint) -> CUresult {
        self.call(|s| s.init(Flags))
    }

    pub(crate) unsafe fn cuDriverGetVersion(&self, driverVersion: *mut c_int) -> CUresult {
        let version = self.config.driver_version;
        // SAFETY: forwarded contract.
        unsafe { self.out(driverVersion, |_| Ok(version)) }
    }

    pub(crate) unsafe fn cuDeviceGet(&self, device: *mut CUdevice, ordinal: c_int) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(device, |s| s.device_get(ordinal)) }
    }

    pub(crate) unsafe fn cuDeviceGetCount(&self, count: *mut c_int) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(count, |s| s.device_count()) }
    }

    pub(crate) unsafe fn cuDeviceGetName(&self, name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
        if name.is_null() || len <= 0 {
            return INVALID_VALUE;
        }
        let text = match self.lock().device_name(dev) {
            Ok(text) => text,
            Err(code) => return code,
        };
        let bytes = &text.as_bytes()[..text.len().min(len as usize - 1)];
        // SAFETY: the caller gives `len` writable bytes at `name`; we write at most `len`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), name, bytes.len());
            name.add(bytes.len()).write(0);
        }
        SUCCESS
    }

    pub(crate) unsafe fn cuDeviceGetAttribute(
        &self,
        pi: *mut c_int,
        attrib: CUdevice_attribute,
        dev: CUdevice,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pi, |s| s.device_attribute(attrib, dev)) }
    }

    pub(crate) unsafe fn cuDeviceTotalMem_v2(&self, bytes: *mut usize, dev: CUdevice) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(bytes, |s| s.device_total_mem(dev)) }
    }

    pub(crate) unsafe fn cuDeviceCanAccessPeer(
        &self,
        canAccessPeer: *mut c_int,
        dev: CUdevice,
        peerDev: CUdevice,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(canAccessPeer, |s| s.can_access_peer(dev, peerDev)) }
    }

    pub(crate) unsafe fn cuDevicePrimaryCtxRetain(&self, pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pctx, |s| s.primary_ctx_retain(dev)) }
    }

    pub(crate) unsafe fn cuDevicePrimaryCtxRelease_v2(&self, dev: CUdevice) -> CUresult {
        self.call(|s| s.primary_ctx_release(dev))
    }

    pub(crate) unsafe fn cuCtxGetCurrent(&self, pctx: *mut CUcontext) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pctx, |s| s.ctx_get_current()) }
    }

    pub(crate) unsafe fn cuCtxSetCurrent(&self, ctx: CUcontext) -> CUresult {
        self.call(|s| s.ctx_set_current(ctx))
    }

    pub(crate) unsafe fn cuCtxPushCurrent_v2(&self, ctx: CUcontext) -> CUresult {
        self.call(|s| s.ctx_push_current(ctx))
    }

    pub(crate) unsafe fn cuCtxPopCurrent_v2(&self, pctx: *mut CUcontext) -> CUresult {
        let mut state = self.lock();
        match state.ctx_pop_current() {
            Ok(ctx) => {
                if !pctx.is_null() {
                    // SAFETY: `pctx` is not null and the caller guarantees it is writable.
                    unsafe { pctx.write(ctx) };
                }
                SUCCESS
            }
            Err(code) => code,
        }
    }

    pub(crate) unsafe fn cuCtxGetDevice(&self, device: *mut CUdevice) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(device, |s| s.ctx_get_device()) }
    }

    pub(crate) unsafe fn cuCtxSynchronize(&self) -> CUresult {
        self.call(|s| s.ctx_synchronize())
    }

    pub(crate) unsafe fn cuStreamCreate(&self, phStream: *mut CUstream, Flags: c_uint) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(phStream, |s| s.stream_create(Flags)) }
    }

    pub(crate) unsafe fn cuStreamDestroy_v2(&self, hStream: CUstream) -> CUresult {
        self.call(|s| s.stream_destroy(hStream))
    }

    pub(crate) unsafe fn cuStreamSynchronize(&self, hStream: CUstream) -> CUresult {
        self.call(|s| s.stream_synchronize(hStream))
    }

    pub(crate) unsafe fn cuStreamQuery(&self, hStream: CUstream) -> CUresult {
        self.call(|s| s.stream_query(hStream))
    }

    pub(crate) unsafe fn cuStreamWaitEvent(&self, hStream: CUstream, hEvent: CUevent, Flags: c_uint) -> CUresult {
        self.call(|s| s.stream_wait_event(hStream, hEvent, Flags))
    }

    pub(crate) unsafe fn cuStreamGetCtx(&self, hStream: CUstream, pctx: *mut CUcontext) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pctx, |s| s.stream_get_ctx(hStream)) }
    }

    pub(crate) unsafe fn cuEventCreate(&self, phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(phEvent, |s| s.event_create(Flags)) }
    }

    pub(crate) unsafe fn cuEventDestroy_v2(&self, hEvent: CUevent) -> CUresult {
        self.call(|s| s.event_destroy(hEvent))
    }

    pub(crate) unsafe fn cuEventRecord(&self, hEvent: CUevent, hStream: CUstream) -> CUresult {
        self.call(|s| s.event_record(hEvent, hStream))
    }

    pub(crate) unsafe fn cuEventQuery(&self, hEvent: CUevent) -> CUresult {
        self.call(|s| s.event_query(hEvent))
    }

    pub(crate) unsafe fn cuEventSynchronize(&self, hEvent: CUevent) -> CUresult {
        self.call(|s| s.event_synchronize(hEvent))
    }

    pub(crate) unsafe fn cuEventElapsedTime(
        &self,
        pMilliseconds: *mut f32,
        hStart: CUevent,
        hEnd: CUevent,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pMilliseconds, |s| s.event_elapsed_time(hStart, hEnd)) }
    }

    pub(crate) unsafe fn cuMemGetInfo_v2(&self, free: *mut usize, total: *mut usize) -> CUresult {
        if free.is_null() || total.is_null() {
            return INVALID_VALUE;
        }
        match self.lock().mem_get_info() {
            Ok((f, t)) => {
                // SAFETY: both pointers are non-null and the caller guarantees they are writable.
                unsafe {
                    free.write(f);
                    total.write(t);
                }
                SUCCESS
            }
            Err(code) => code,
        }
    }

    pub(crate) unsafe fn cuMemAlloc_v2(&self, dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(dptr, |s| s.mem_alloc(bytesize)) }
    }

    pub(crate) unsafe fn cuMemFree_v2(&self, dptr: CUdeviceptr) -> CUresult {
        self.call(|s| s.mem_free(dptr))
    }

    pub(crate) unsafe fn cuMemsetD8Async(
        &self,
        dstDevice: CUdeviceptr,
        uc: c_uchar,
        N: usize,
        hStream: CUstream,
    ) -> CUresult {
        self.call(|s| s.memset_d8_async(dstDevice, uc, N, hStream))
    }

    pub(crate) unsafe fn cuMemsetD8_v2(&self, dstDevice: CUdeviceptr, uc: c_uchar, N: usize) -> CUresult {
        self.call(|s| {
            s.memset_d8_async(dstDevice, uc, N, CU_STREAM_LEGACY)?;
            s.stream_synchronize(CU_STREAM_LEGACY)
        })
    }

    pub(crate) unsafe fn cuMemcpyHtoDAsync_v2(
        &self,
        dstDevice: CUdeviceptr,
        srcHost: *const c_void,
        ByteCount: usize,
        hStream: CUstream,
    ) -> CUresult {
        // SAFETY: forwarded contract: `srcHost` is readable for `ByteCount` bytes.
        let Some(src) = (unsafe { host_slice(srcHost.cast::<u8>(), ByteCount) }) else { return INVALID_VALUE };
        self.call(|s| s.memcpy_htod_async(dstDevice, src, hStream))
    }

    pub(crate) unsafe fn cuMemcpyDtoHAsync_v2(
        &self,
        dstHost: *mut c_void,
        srcDevice: CUdeviceptr,
        ByteCount: usize,
        hStream: CUstream,
    ) -> CUresult {
        // SAFETY: forwarded contract: `dstHost` is writable for `ByteCount` bytes, and nothing
        // else reads or writes it during the call.
        let Some(dst) = (unsafe { host_slice_mut(dstHost.cast::<u8>(), ByteCount) }) else { return INVALID_VALUE };
        self.call(|s| s.memcpy_dtoh_async(dst, srcDevice, hStream))
    }

    pub(crate) unsafe fn cuMemcpyDtoDAsync_v2(
        &self,
        dstDevice: CUdeviceptr,
        srcDevice: CUdeviceptr,
        ByteCount: usize,
        hStream: CUstream,
    ) -> CUresult {
        self.call(|s| s.memcpy_dtod_async(dstDevice, srcDevice, ByteCount, hStream))
    }

    pub(crate) unsafe fn cuMemcpyHtoD_v2(
        &self,
        dstDevice: CUdeviceptr,
        srcHost: *const c_void,
        ByteCount: usize,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        let Some(src) = (unsafe { host_slice(srcHost.cast::<u8>(), ByteCount) }) else { return INVALID_VALUE };
        self.call(|s| {
            s.memcpy_htod_async(dstDevice, src, CU_STREAM_LEGACY)?;
            s.stream_synchronize(CU_STREAM_LEGACY)
        })
    }

    pub(crate) unsafe fn cuMemcpyDtoH_v2(
        &self,
        dstHost: *mut c_void,
        srcDevice: CUdeviceptr,
        ByteCount: usize,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        let Some(dst) = (unsafe { host_slice_mut(dstHost.cast::<u8>(), ByteCount) }) else { return INVALID_VALUE };
        self.call(|s| {
            s.memcpy_dtoh_async(dst, srcDevice, CU_STREAM_LEGACY)?;
            s.stream_synchronize(CU_STREAM_LEGACY)
        })
    }

    pub(crate) unsafe fn cuMemcpyDtoD_v2(
        &self,
        dstDevice: CUdeviceptr,
        srcDevice: CUdeviceptr,
        ByteCount: usize,
    ) -> CUresult {
        self.call(|s| {
            s.memcpy_dtod_async(dstDevice, srcDevice, ByteCount, CU_STREAM_LEGACY)?;
            s.stream_synchronize(CU_STREAM_LEGACY)
        })
    }

    pub(crate) unsafe fn cuMemAllocAsync(
        &self,
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        hStream: CUstream,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(dptr, |s| s.mem_alloc_async(bytesize, hStream)) }
    }

    pub(crate) unsafe fn cuMemFreeAsync(&self, dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
        self.call(|s| s.mem_free_async(dptr, hStream))
    }

    pub(crate) unsafe fn cuMemAllocFromPoolAsync(
        &self,
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        pool: CUmemoryPool,
        hStream: CUstream,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(dptr, |s| s.mem_alloc_from_pool_async(bytesize, pool, hStream)) }
    }

    pub(crate) unsafe fn cuMemPoolCreate(&self, pool: *mut CUmemoryPool, poolProps: *const CUmemPoolProps) -> CUresult {
        if poolProps.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees it points to a `CUmemPoolProps`.
        let props = unsafe { &*poolProps };
        // SAFETY: forwarded contract.
        unsafe { self.out(pool, |s| s.mem_pool_create(props)) }
    }

    pub(crate) unsafe fn cuMemPoolDestroy(&self, pool: CUmemoryPool) -> CUresult {
        self.call(|s| s.mem_pool_destroy(pool))
    }

    pub(crate) unsafe fn cuMemPoolTrimTo(&self, pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
        self.call(|s| s.mem_pool_trim_to(pool, minBytesToKeep))
    }

    pub(crate) unsafe fn cuMemPoolSetAttribute(
        &self,
        pool: CUmemoryPool,
        attr: CUmemPool_attribute,
        value: *mut c_void,
    ) -> CUresult {
        let Some(width) = attribute_width(attr) else { return INVALID_VALUE };
        if value.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller passes an `int` for attributes 1-3 and a
        // `cuuint64_t` for 4-8, as `cuMemPoolSetAttribute` documents.
        let value = unsafe {
            match width {
                Width::Int => value.cast::<c_int>().read() as u64,
                Width::U64 => value.cast::<u64>().read(),
            }
        };
        self.call(|s| s.mem_pool_set_attribute(pool, attr, value))
    }

    pub(crate) unsafe fn cuMemPoolGetAttribute(
        &self,
        pool: CUmemoryPool,
        attr: CUmemPool_attribute,
        value: *mut c_void,
    ) -> CUresult {
        let Some(width) = attribute_width(attr) else { return INVALID_VALUE };
        if value.is_null() {
            return INVALID_VALUE;
        }
        match self.lock().mem_pool_get_attribute(pool, attr) {
            Ok(v) => {
                // SAFETY: non-null, and the caller passes storage of the documented width.
                unsafe {
                    match width {
                        Width::Int => value.cast::<c_int>().write(v as c_int),
                        Width::U64 => value.cast::<u64>().write(v),
                    }
                }
                SUCCESS
            }
            Err(code) => code,
        }
    }

    pub(crate) unsafe fn cuMemPoolSetAccess(
        &self,
        pool: CUmemoryPool,
        map: *const CUmemAccessDesc,
        count: usize,
    ) -> CUresult {
        let descriptors = if count == 0 {
            &[][..]
        } else if map.is_null() {
            return INVALID_VALUE;
        } else {
            // SAFETY: non-null, and the caller guarantees `count` descriptors at `map`.
            unsafe { std::slice::from_raw_parts(map, count) }
        };
        self.call(|s| s.mem_pool_set_access(pool, descriptors))
    }

    pub(crate) unsafe fn cuMemPoolGetAccess(
        &self,
        flags: *mut CUmemAccess_flags,
        memPool: CUmemoryPool,
        location: *mut CUmemLocation,
    ) -> CUresult {
        if location.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees it points to a `CUmemLocation`.
        let location = unsafe { *location };
        // SAFETY: forwarded contract.
        unsafe { self.out(flags, |s| s.mem_pool_get_access(memPool, &location)) }
    }

    pub(crate) unsafe fn cuDeviceGetDefaultMemPool(&self, pool_out: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pool_out, |s| s.device_get_default_mem_pool(dev)) }
    }

    pub(crate) unsafe fn cuDeviceGetMemPool(&self, pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(pool, |s| s.device_get_mem_pool(dev)) }
    }

    pub(crate) unsafe fn cuDeviceSetMemPool(&self, dev: CUdevice, pool: CUmemoryPool) -> CUresult {
        self.call(|s| s.device_set_mem_pool(dev, pool))
    }

    pub(crate) unsafe fn cuMemPoolExportToShareableHandle(
        &self,
        _handle_out: *mut c_void,
        _pool: CUmemoryPool,
        _handleType: CUmemAllocationHandleType,
        _flags: c_ulonglong,
    ) -> CUresult {
        NOT_SUPPORTED
    }

    pub(crate) unsafe fn cuMemPoolImportFromShareableHandle(
        &self,
        _pool_out: *mut CUmemoryPool,
        _handle: *mut c_void,
        _handleType: CUmemAllocationHandleType,
        _flags: c_ulonglong,
    ) -> CUresult {
        NOT_SUPPORTED
    }

    pub(crate) unsafe fn cuMemPoolExportPointer(
        &self,
        _shareData_out: *mut CUmemPoolPtrExportData,
        _ptr: CUdeviceptr,
    ) -> CUresult {
        NOT_SUPPORTED
    }

    pub(crate) unsafe fn cuMemPoolImportPointer(
        &self,
        _ptr_out: *mut CUdeviceptr,
        _pool: CUmemoryPool,
        _shareData: *mut CUmemPoolPtrExportData,
    ) -> CUresult {
        NOT_SUPPORTED
    }

    pub(crate) unsafe fn cuMemAddressReserve(
        &self,
        ptr: *mut CUdeviceptr,
        size: usize,
        alignment: usize,
        _addr: CUdeviceptr,
        flags: c_ulonglong,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(ptr, |s| s.mem_address_reserve(size, alignment, flags)) }
    }

    pub(crate) unsafe fn cuMemAddressFree(&self, ptr: CUdeviceptr, size: usize) -> CUresult {
        self.call(|s| s.mem_address_free(ptr, size))
    }

    pub(crate) unsafe fn cuMemCreate(
        &self,
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: c_ulonglong,
    ) -> CUresult {
        if prop.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees it points to a `CUmemAllocationProp`.
        let prop = unsafe { &*prop };
        // SAFETY: forwarded contract.
        unsafe { self.out(handle, |s| s.mem_create(size, prop, flags)) }
    }

    pub(crate) unsafe fn cuMemRelease(&self, handle: CUmemGenericAllocationHandle) -> CUresult {
        self.call(|s| s.mem_release(handle))
    }

    pub(crate) unsafe fn cuMemMap(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        offset: usize,
        handle: CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    ) -> CUresult {
        self.call(|s| s.mem_map(ptr, size, offset, handle, flags))
    }

    pub(crate) unsafe fn cuMemUnmap(&self, ptr: CUdeviceptr, size: usize) -> CUresult {
        self.call(|s| s.mem_unmap(ptr, size))
    }

    pub(crate) unsafe fn cuMemSetAccess(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        desc: *const CUmemAccessDesc,
        count: usize,
    ) -> CUresult {
        if desc.is_null() || count == 0 {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees `count` descriptors at `desc`.
        let descriptors = unsafe { std::slice::from_raw_parts(desc, count) };
        self.call(|s| s.mem_set_access(ptr, size, descriptors))
    }

    pub(crate) unsafe fn cuMemGetAllocationGranularity(
        &self,
        granularity: *mut usize,
        prop: *const CUmemAllocationProp,
        option: CUmemAllocationGranularity_flags,
    ) -> CUresult {
        if prop.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees it points to a `CUmemAllocationProp`.
        let prop = unsafe { &*prop };
        // SAFETY: forwarded contract.
        unsafe { self.out(granularity, |s| s.mem_get_allocation_granularity(prop, option)) }
    }

    pub(crate) unsafe fn cuModuleLoadData(&self, module: *mut CUmodule, image: *const c_void) -> CUresult {
        if image.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: a PTX image is a NUL-terminated string, which the caller guarantees; a cubin
        // (ELF) image starts with 0x7f, where reading stops.
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) };
        // SAFETY: forwarded contract.
        unsafe { self.out(module, |s| s.module_load_data(text.to_bytes())) }
    }

    pub(crate) unsafe fn cuModuleUnload(&self, hmod: CUmodule) -> CUresult {
        self.call(|s| s.module_unload(hmod))
    }

    pub(crate) unsafe fn cuModuleGetFunction(
        &self,
        hfunc: *mut CUfunction,
        hmod: CUmodule,
        name: *const c_char,
    ) -> CUresult {
        if name.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees a NUL-terminated string.
        let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else { return CUresult::CUDA_ERROR_NOT_FOUND };
        // SAFETY: forwarded contract.
        unsafe { self.out(hfunc, |s| s.module_get_function(hmod, name)) }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn cuLaunchKernel(
        &self,
        f: CUfunction,
        gridDimX: c_uint,
        gridDimY: c_uint,
        gridDimZ: c_uint,
        blockDimX: c_uint,
        blockDimY: c_uint,
        blockDimZ: c_uint,
        sharedMemBytes: c_uint,
        hStream: CUstream,
        kernelParams: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult {
        let launch = Launch {
            grid: [gridDimX, gridDimY, gridDimZ],
            block: [blockDimX, blockDimY, blockDimZ],
            shared_memory: sharedMemBytes,
            has_params: !kernelParams.is_null(),
            has_extra: !extra.is_null(),
        };
        self.call(|s| {
            let ran = s.launch_kernel(f, launch, hStream)?;
            if !(ran && s.host_backed() && s.is_fill_kernel(f)) {
                return Ok(());
            }
            if kernelParams.is_null() {
                return Err(INVALID_VALUE);
            }
            // SAFETY: forwarded contract: `kernelParams` holds one pointer per kernel parameter,
            // each to a value of that parameter's type; the fill kernels take
            // `(u64 dst, u64 len, u32 value)`.
            let (dst, len, value) = unsafe {
                (
                    kernelParams.read().cast::<u64>().read_unaligned(),
                    kernelParams.add(1).read().cast::<u64>().read_unaligned(),
                    kernelParams.add(2).read().cast::<u32>().read_unaligned(),
                )
            };
            s.run_fill(dst, len, value as u8)
        })
    }
}

/// The entry points of stream capture and graphs (`capture.rs`), under the same `# Safety` as the
/// block above.
#[allow(non_snake_case)]
impl Sim {
    pub(crate) unsafe fn cuStreamBeginCapture_v2(&self, hStream: CUstream, mode: CUstreamCaptureMode) -> CUresult {
        self.call(|s| s.stream_begin_capture(hStream, mode))
    }

    pub(crate) unsafe fn cuStreamEndCapture(&self, hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
        if phGraph.is_null() {
            return INVALID_VALUE;
        }
        let result = self.lock().stream_end_capture(hStream);
        let (graph, code) = match result {
            Ok(graph) => (graph, SUCCESS),
            Err(code) => (std::ptr::null_mut(), code),
        };
        // SAFETY: non-null, and the caller guarantees it is valid for a write. A failed capture
        // returns a NULL graph, as `cuStreamEndCapture` documents.
        unsafe { phGraph.write(graph) };
        code
    }

    pub(crate) unsafe fn cuStreamIsCapturing(
        &self,
        hStream: CUstream,
        captureStatus: *mut CUstreamCaptureStatus,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(captureStatus, |s| s.stream_is_capturing(hStream)) }
    }

    pub(crate) unsafe fn cuStreamGetCaptureInfo_v2(
        &self,
        hStream: CUstream,
        captureStatus_out: *mut CUstreamCaptureStatus,
        id_out: *mut cuuint64_t,
        graph_out: *mut CUgraph,
        dependencies_out: *mut *const CUgraphNode,
        numDependencies_out: *mut usize,
    ) -> CUresult {
        if captureStatus_out.is_null() {
            return INVALID_VALUE;
        }
        let (status, id, graph) = match self.lock().stream_get_capture_info(hStream) {
            Ok(info) => info,
            Err(code) => return code,
        };
        // SAFETY: each pointer is null or, as the caller guarantees, valid for a write. The
        // model keeps no graph nodes, so the dependency set it reports is empty.
        unsafe {
            captureStatus_out.write(status);
            if !id_out.is_null() {
                id_out.write(id);
            }
            if !graph_out.is_null() {
                graph_out.write(graph);
            }
            if !dependencies_out.is_null() {
                dependencies_out.write(std::ptr::null());
            }
            if !numDependencies_out.is_null() {
                numDependencies_out.write(0);
            }
        }
        SUCCESS
    }

    pub(crate) unsafe fn cuThreadExchangeStreamCaptureMode(&self, mode: *mut CUstreamCaptureMode) -> CUresult {
        if mode.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and the caller guarantees it holds a mode.
        let new = unsafe { mode.read() };
        // SAFETY: forwarded contract.
        unsafe { self.out(mode, |s| s.thread_exchange_capture_mode(new)) }
    }

    pub(crate) unsafe fn cuGraphInstantiateWithFlags(
        &self,
        phGraphExec: *mut CUgraphExec,
        hGraph: CUgraph,
        flags: c_ulonglong,
    ) -> CUresult {
        // SAFETY: forwarded contract.
        unsafe { self.out(phGraphExec, |s| s.graph_instantiate(hGraph, flags)) }
    }

    pub(crate) unsafe fn cuGraphLaunch(&self, hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
        self.call(|s| s.graph_launch(hGraphExec, hStream))
    }

    pub(crate) unsafe fn cuGraphExecDestroy(&self, hGraphExec: CUgraphExec) -> CUresult {
        self.call(|s| s.graph_exec_destroy(hGraphExec))
    }

    pub(crate) unsafe fn cuGraphDestroy(&self, hGraph: CUgraph) -> CUresult {
        self.call(|s| s.graph_destroy(hGraph))
    }

    pub(crate) unsafe fn cuDeviceGraphMemTrim(&self, device: CUdevice) -> CUresult {
        self.call(|s| s.device_graph_mem_trim(device))
    }

    pub(crate) unsafe fn cuDeviceGetGraphMemAttribute(
        &self,
        device: CUdevice,
        attr: CUgraphMem_attribute,
        value: *mut c_void,
    ) -> CUresult {
        // SAFETY: forwarded contract: every graph memory attribute is a `cuuint64_t`.
        unsafe { self.out(value.cast::<u64>(), |s| s.device_get_graph_mem_attribute(device, attr)) }
    }

    pub(crate) unsafe fn cuDeviceSetGraphMemAttribute(
        &self,
        device: CUdevice,
        attr: CUgraphMem_attribute,
        value: *mut c_void,
    ) -> CUresult {
        if value.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, and every graph memory attribute is a `cuuint64_t`.
        let value = unsafe { value.cast::<u64>().read() };
        self.call(|s| s.device_set_graph_mem_attribute(device, attr, value))
    }
}

/// `len` bytes at `ptr` as a slice; `None` for a null pointer with a non-zero length.
///
/// # Safety
///
/// A non-null `ptr` must be readable for `len` bytes, not written during the borrow.
unsafe fn host_slice<'a>(ptr: *const u8, len: usize) -> Option<&'a [u8]> {
    if len == 0 {
        return Some(&[]);
    }
    // SAFETY: non-null (checked) and readable for `len` bytes (the caller's promise).
    (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// `len` writable bytes at `ptr` as a slice; `None` for a null pointer with a non-zero length.
///
/// # Safety
///
/// A non-null `ptr` must be writable for `len` bytes, and not otherwise accessed during the
/// borrow.
unsafe fn host_slice_mut<'a>(ptr: *mut u8, len: usize) -> Option<&'a mut [u8]> {
    if len == 0 {
        return Some(&mut []);
    }
    // SAFETY: non-null (checked) and exclusively writable for `len` bytes (the caller's promise).
    (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

#[cfg(test)]
mod tests;
