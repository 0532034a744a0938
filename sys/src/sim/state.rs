//! The state of a simulated driver and the rules it follows; see the [module docs](super) for
//! the model. Every operation returns the `CUresult` a real driver would return for it.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::ThreadId;

use super::SimConfig;
use super::clock::{Clock, StreamId};
use super::handle::{Kind, decode, encode};
use super::memory::HostMemory;
use super::space::{AddressSpace, FreeSpace, Readiness};
use super::vmm::{MappedPiece, Vmm};
use crate::bindings::*;

// Stream capture and graphs: a child module, so that its hooks below stay one line each.
#[path = "capture.rs"]
mod capture;
use capture::Captures;

pub(crate) type R<T> = Result<T, CUresult>;

/// Alignment and rounding of every allocation inside a pool.
pub(crate) const ALIGNMENT: u64 = 512;
/// Size of each device's slice of the simulated address space.
const DEVICE_SPAN: u64 = 1 << 46;
/// Largest dynamic shared memory a launch may ask for without the `cuFuncSetAttribute` opt-in,
/// which steppool does not bind.
const MAX_SHARED_MEMORY: u32 = 48 << 10;
/// Largest block dimensions (x, y, z) and threads per block.
const MAX_BLOCK: [u32; 3] = [1024, 1024, 64];
const MAX_THREADS: u64 = 1024;
/// Largest grid dimensions (x, y, z).
const MAX_GRID: [u32; 3] = [i32::MAX as u32, 65535, 65535];

pub(crate) const SUCCESS: CUresult = CUresult::CUDA_SUCCESS;
pub(crate) const INVALID_VALUE: CUresult = CUresult::CUDA_ERROR_INVALID_VALUE;
pub(crate) const NOT_READY: CUresult = CUresult::CUDA_ERROR_NOT_READY;
pub(crate) const OUT_OF_MEMORY: CUresult = CUresult::CUDA_ERROR_OUT_OF_MEMORY;
pub(crate) const NOT_INITIALIZED: CUresult = CUresult::CUDA_ERROR_NOT_INITIALIZED;
pub(crate) const INVALID_DEVICE: CUresult = CUresult::CUDA_ERROR_INVALID_DEVICE;
pub(crate) const INVALID_CONTEXT: CUresult = CUresult::CUDA_ERROR_INVALID_CONTEXT;
pub(crate) const CONTEXT_IS_DESTROYED: CUresult = CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED;
pub(crate) const INVALID_HANDLE: CUresult = CUresult::CUDA_ERROR_INVALID_HANDLE;
pub(crate) const INVALID_IMAGE: CUresult = CUresult::CUDA_ERROR_INVALID_IMAGE;
pub(crate) const NOT_FOUND: CUresult = CUresult::CUDA_ERROR_NOT_FOUND;
pub(crate) const NOT_SUPPORTED: CUresult = CUresult::CUDA_ERROR_NOT_SUPPORTED;
pub(crate) const ILLEGAL_ADDRESS: CUresult = CUresult::CUDA_ERROR_ILLEGAL_ADDRESS;

thread_local! {
    /// Each thread's context stack, per simulated driver (keyed by its unique id).
    static CONTEXT_STACKS: RefCell<Vec<(u64, Vec<u32>)>> = const { RefCell::new(Vec::new()) };
}

fn with_stack<T>(sim: u64, f: impl FnOnce(&mut Vec<u32>) -> T) -> T {
    CONTEXT_STACKS.with_borrow_mut(|stacks| {
        let index = match stacks.iter().position(|(id, _)| *id == sim) {
            Some(index) => index,
            None => {
                stacks.push((sim, Vec::new()));
                stacks.len() - 1
            }
        };
        f(&mut stacks[index].1)
    })
}

/// A device's primary context. It is active while retained at least once.
#[derive(Debug)]
struct Context {
    device: usize,
    retained: u32,
    /// The legacy default stream, while active.
    legacy: Option<StreamId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamKind {
    /// The legacy default stream (`NULL`, `CU_STREAM_LEGACY`): orders with all blocking streams.
    Legacy,
    /// A thread's per-thread default stream (`CU_STREAM_PER_THREAD`): a blocking stream.
    PerThread,
    /// Made by `cuStreamCreate`.
    Created,
}

#[derive(Debug)]
struct Stream {
    id: StreamId,
    ctx: u32,
    device: usize,
    kind: StreamKind,
    /// Waits for the legacy stream before each operation (created without `NON_BLOCKING`).
    blocking: bool,
    /// Operations enqueued so far.
    position: u64,
    /// What its next operation is ordered after.
    clock: Clock,
    /// Destroyed by the caller; kept until its work is observed complete.
    destroyed: bool,
}

impl Stream {
    /// The clock of its latest operation: everything up to and including it.
    fn frontier(&self) -> Clock {
        let mut clock = self.clock.clone();
        clock.advance(self.id, self.position);
        clock
    }
}

#[derive(Debug)]
struct Event {
    ctx: u32,
    device: usize,
    timing: bool,
    recorded: Option<Clock>,
}

#[derive(Debug)]
struct Module {
    ctx: u32,
    entries: Vec<String>,
    /// Whether the image is one of the repository's fill kernels (`crate::kernels`), which a
    /// host-backed device runs.
    fill: bool,
}

#[derive(Debug)]
struct Function {
    module: u32,
}

/// A checked device range inside one live pool or graph allocation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Range {
    addr: u64,
    len: usize,
    /// Host memory may stand behind it (graph allocations never have any).
    host: bool,
}

/// A checked device range: inside one pool allocation, or in mapped memory (`vmm.rs`).
#[derive(Debug)]
enum Span {
    Pool(Range),
    Mapped(Vec<MappedPiece>),
}

/// A live allocation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    pub(crate) pool: u32,
    /// Bytes held: the request rounded up to [`ALIGNMENT`].
    pub(crate) size: u64,
    /// The base of the pool's address range that holds it.
    pub(crate) extent: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PoolKind {
    /// A device's default pool, which cannot be destroyed.
    Default,
    /// Made by `cuMemPoolCreate`.
    Created,
    /// Backs `cuMemAlloc`: frees are immediate and idle units go back at once.
    Raw,
}

/// Largest address range a pool reserves at once; an allocation that fits in none of its ranges
/// gets a range of its own size. Keeps a device's slice of the address space for about a
/// thousand pools however large the device.
const EXTENT_MAX: u64 = 64 << 30;

/// How a pool maps device memory into its address ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// Each growth maps one segment, the request rounded up to `granule`, in an address range of
    /// its own; allocations never span two segments (the simulated device's default model).
    Segments { granule: u64 },
    /// Ranges grow in units of this many bytes, aligned to the range's base, and allocations are
    /// placed across unit boundaries (the driver's pool as an H200 answered, with 32 MiB).
    Units(u64),
}

/// A unit of device memory mapped into a pool's address range.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unit {
    /// Its size in bytes.
    pub(crate) size: u64,
    /// Live allocations that overlap it.
    pub(crate) live: u32,
}

#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) device: usize,
    pub(crate) kind: PoolKind,
    pub(crate) destroyed: bool,
    pub(crate) max_size: u64,
    pub(crate) follow_event_dependencies: bool,
    pub(crate) allow_opportunistic: bool,
    pub(crate) allow_internal_dependencies: bool,
    pub(crate) release_threshold: u64,
    pub(crate) used: u64,
    pub(crate) used_high: u64,
    pub(crate) reserved: u64,
    pub(crate) reserved_high: u64,
    /// How the pool maps device memory into its ranges.
    pub(crate) mapping: Mapping,
    /// Address ranges reserved for the pool, as base → length.
    pub(crate) extents: BTreeMap<u64, u64>,
    /// Units mapped, by base address; each lies inside one extent, aligned to its base.
    pub(crate) units: BTreeMap<u64, Unit>,
    /// Free addresses of the extents, mapped or not.
    pub(crate) free: FreeSpace,
    /// Access granted to other devices.
    access: BTreeMap<usize, CUmemAccess_flags>,
}

impl Pool {
    fn new(device: usize, kind: PoolKind, max_size: u64, mapping: Mapping) -> Self {
        Self {
            device,
            kind,
            destroyed: false,
            max_size,
            follow_event_dependencies: true,
            allow_opportunistic: true,
            allow_internal_dependencies: true,
            release_threshold: 0,
            used: 0,
            used_high: 0,
            reserved: 0,
            reserved_high: 0,
            mapping,
            extents: BTreeMap::new(),
            units: BTreeMap::new(),
            free: FreeSpace::default(),
            access: BTreeMap::new(),
        }
    }

    /// The bases of the units that `[addr, addr + len)` of the extent at `extent` overlaps.
    fn units_of(&self, extent: u64, addr: u64, len: u64) -> Vec<u64> {
        match self.mapping {
            Mapping::Segments { .. } => vec![extent],
            Mapping::Units(unit) => {
                let first = extent + (addr - extent) / unit * unit;
                let end = extent + (addr + len - extent).div_ceil(unit) * unit;
                (first..end).step_by(unit as usize).collect()
            }
        }
    }

    /// The size of each unit of the extent at `extent` once mapped.
    fn unit_size(&self, extent: u64) -> u64 {
        match self.mapping {
            Mapping::Segments { .. } => self.extents[&extent],
            Mapping::Units(unit) => unit,
        }
    }

    /// Idle units in release order, largest first, then highest address: nothing allocated in
    /// them and every free in them observed complete.
    fn idle_units(&self) -> Vec<(u64, u64)> {
        let mut idle: Vec<(u64, u64)> = self
            .units
            .iter()
            .filter(|&(&base, unit)| unit.live == 0 && self.free.covers_ready(base, unit.size))
            .map(|(&base, unit)| (unit.size, base))
            .collect();
        idle.sort_unstable_by(|a, b| b.cmp(a));
        idle
    }
}

#[derive(Debug)]
struct Device {
    capacity: u64,
    /// Bytes reserved by all its pools.
    reserved: u64,
    space: AddressSpace,
    default_pool: u32,
    current_pool: u32,
    raw_pool: u32,
}

/// Everything a simulated driver knows; guarded by the [`Sim`](super::Sim)'s lock.
#[derive(Debug)]
pub(crate) struct State {
    /// Unique id of this simulated driver, for the thread-local context stacks.
    id: u64,
    /// The 16 bits of `id` that handles carry.
    tag: u16,
    pub(crate) config: SimConfig,
    initialized: bool,
    devices: Vec<Device>,
    contexts: BTreeMap<u32, Context>,
    streams: BTreeMap<StreamId, Stream>,
    per_thread: HashMap<(ThreadId, u32), StreamId>,
    events: BTreeMap<u32, Event>,
    pub(crate) pools: BTreeMap<u32, Pool>,
    modules: BTreeMap<u32, Module>,
    functions: BTreeMap<u32, Function>,
    pub(crate) allocations: BTreeMap<u64, Allocation>,
    /// The host memory behind the pools' units, when the configuration asks for it.
    host: Option<HostMemory>,
    /// Positions the host has observed complete.
    completed: Clock,
    /// Streams whose work is held incomplete (a test facility, [`State::hold`]): the position
    /// each had when the hold began. Work past it is not done until the hold is lifted or a
    /// synchronization waits for it.
    held: BTreeMap<StreamId, u64>,
    next_id: u32,
    /// Capture sequences, graphs, executable graphs and graph memory (`capture.rs`), boxed: most
    /// drivers never capture.
    capture: Box<Captures>,
    /// Reserved address ranges and physical allocations (`vmm.rs`).
    pub(crate) vmm: Box<Vmm>,
    /// Changes before any stream can begin or join a capture, and when a stream or context goes
    /// away: read without the lock by [`Sim::capture_epoch`](super::Sim::capture_epoch).
    pub(crate) capture_epoch: Arc<AtomicU64>,
}

impl State {
    /// A stream's answer to `cuStreamGetCaptureInfo` may change from here on (a capture begins
    /// or a stream joins one, a stream or context goes away): the epoch moves first, under the
    /// lock, so a reader that still sees the old epoch is ordered before the change.
    pub(crate) fn capture_may_change(&self) {
        self.capture_epoch.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn new(id: u64, config: SimConfig) -> Self {
        let config_host_memory = config.host_memory;
        let mut state = Self {
            id,
            tag: id as u16,
            config,
            initialized: false,
            devices: Vec::new(),
            contexts: BTreeMap::new(),
            streams: BTreeMap::new(),
            per_thread: HashMap::new(),
            events: BTreeMap::new(),
            pools: BTreeMap::new(),
            modules: BTreeMap::new(),
            functions: BTreeMap::new(),
            allocations: BTreeMap::new(),
            host: None,
            completed: Clock::default(),
            held: BTreeMap::new(),
            next_id: 0,
            capture: Box::default(),
            vmm: Box::new(Vmm::new(id, config_host_memory)),
            capture_epoch: Arc::default(),
        };
        state.host = state.config.host_memory.then(HostMemory::default);
        // Each driver instance and device gets its own slice of a 64-bit address space.
        let instance_base = ((id % 0xFF) + 1) << 52;
        for (device, &capacity) in state.config.capacities.clone().iter().enumerate() {
            let default_pool = state.next();
            state.pools.insert(default_pool, Pool::new(device, PoolKind::Default, 0, state.pool_mapping()));
            let raw_pool = state.next();
            state.pools.insert(
                raw_pool,
                Pool::new(device, PoolKind::Raw, 0, Mapping::Segments { granule: state.config.granule }),
            );
            let base = instance_base + device as u64 * DEVICE_SPAN;
            state.devices.push(Device {
                capacity,
                reserved: 0,
                space: AddressSpace::new(base, DEVICE_SPAN),
                default_pool,
                current_pool: default_pool,
                raw_pool,
            });
            state.contexts.insert(device as u32 + 1, Context { device, retained: 0, legacy: None });
        }
        state
    }

    fn next(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// A fresh object id, for handles made outside this file.
    pub(crate) fn next_id(&mut self) -> u32 {
        self.next()
    }

    /// The 16 bits of this driver's id that its handles carry.
    pub(crate) fn tag(&self) -> u16 {
        self.tag
    }

    /// Counts `bytes` of physical memory against `device`'s capacity, after releasing every idle
    /// pool segment of the device if they do not fit; `false` when they still do not.
    pub(crate) fn charge(&mut self, device: usize, bytes: u64) -> bool {
        let fits = |state: &Self| {
            state.devices[device]
                .reserved
                .checked_add(bytes)
                .is_some_and(|total| total <= state.devices[device].capacity)
        };
        if !fits(self) {
            self.release_idle_on_device(device);
            if !fits(self) {
                return false;
            }
        }
        self.devices[device].reserved += bytes;
        true
    }

    /// Gives back `bytes` counted with [`State::charge`].
    pub(crate) fn uncharge(&mut self, device: usize, bytes: u64) {
        self.devices[device].reserved -= bytes;
    }

    // ----- handles -------------------------------------------------------------------------------

    pub(crate) fn handle(&self, kind: Kind, id: u32) -> usize {
        encode(self.tag, kind, id)
    }

    pub(crate) fn require_init(&self) -> R<()> {
        if self.initialized { Ok(()) } else { Err(NOT_INITIALIZED) }
    }

    fn require_pools(&self) -> R<()> {
        self.require_init()?;
        if self.config.memory_pools_supported { Ok(()) } else { Err(NOT_SUPPORTED) }
    }

    pub(crate) fn device(&self, ordinal: CUdevice) -> R<usize> {
        self.require_init()?;
        usize::try_from(ordinal).ok().filter(|&d| d < self.devices.len()).ok_or(INVALID_DEVICE)
    }

    fn context(&self, raw: CUcontext) -> R<u32> {
        decode(self.tag, Kind::Context, raw as usize).filter(|id| self.contexts.contains_key(id)).ok_or(INVALID_CONTEXT)
    }

    /// The calling thread's current context, which must be active.
    fn current(&self) -> R<u32> {
        self.require_init()?;
        let ctx = with_stack(self.id, |stack| stack.last().copied()).ok_or(INVALID_CONTEXT)?;
        match self.contexts.get(&ctx) {
            Some(context) if context.retained > 0 => Ok(ctx),
            _ => Err(CONTEXT_IS_DESTROYED),
        }
    }

    /// Resolves a stream handle, including `NULL`, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
    fn stream(&mut self, raw: CUstream) -> R<StreamId> {
        self.require_init()?;
        match raw as usize {
            0 | 1 => {
                let ctx = self.current()?;
                self.contexts[&ctx].legacy.ok_or(CONTEXT_IS_DESTROYED)
            }
            2 => {
                let ctx = self.current()?;
                let key = (std::thread::current().id(), ctx);
                if let Some(&id) = self.per_thread.get(&key) {
                    return Ok(id);
                }
                let id = self.new_stream(ctx, StreamKind::PerThread, true);
                self.per_thread.insert(key, id);
                Ok(id)
            }
            raw => decode(self.tag, Kind::Stream, raw)
                .filter(|id| self.streams.get(id).is_some_and(|s| !s.destroyed))
                .ok_or(INVALID_HANDLE),
        }
    }

    fn new_stream(&mut self, ctx: u32, kind: StreamKind, blocking: bool) -> StreamId {
        let id = self.next();
        let device = self.contexts[&ctx].device;
        let stream = Stream { id, ctx, device, kind, blocking, position: 0, clock: Clock::default(), destroyed: false };
        self.streams.insert(id, stream);
        id
    }

    fn event(&self, raw: CUevent) -> R<u32> {
        self.require_init()?;
        decode(self.tag, Kind::Event, raw as usize).filter(|id| self.events.contains_key(id)).ok_or(INVALID_HANDLE)
    }

    /// A pool that may be used: created or default, not destroyed.
    fn pool(&self, raw: CUmemoryPool) -> R<u32> {
        self.require_pools()?;
        decode(self.tag, Kind::Pool, raw as usize)
            .filter(|id| self.pools.get(id).is_some_and(|p| !p.destroyed && p.kind != PoolKind::Raw))
            .ok_or(INVALID_VALUE)
    }

    /// The pool behind `raw` for inspection, including one destroyed but not yet reclaimed.
    pub(crate) fn pool_id_for_inspection(&self, raw: CUmemoryPool) -> Option<u32> {
        decode(self.tag, Kind::Pool, raw as usize).filter(|id| self.pools.contains_key(id))
    }

    // ----- stream order ----------------------------------------------------------------------------

    /// What the next operation on `stream` is ordered after, including the legacy stream's
    /// implicit synchronization.
    fn op_clock(&self, stream: StreamId) -> Clock {
        let s = &self.streams[&stream];
        let mut clock = s.clock.clone();
        match s.kind {
            StreamKind::Legacy => {
                for other in self.streams.values() {
                    if other.ctx == s.ctx && other.blocking && !other.destroyed {
                        clock.join(&other.frontier());
                    }
                }
            }
            _ if s.blocking => {
                if let Some(legacy) = self.contexts[&s.ctx].legacy {
                    clock.join(&self.streams[&legacy].frontier());
                }
            }
            _ => {}
        }
        clock
    }

    /// Enqueues an operation on `stream`, ordered after `clock`; returns its position.
    fn commit(&mut self, stream: StreamId, clock: Clock) -> u64 {
        let s = self.streams.get_mut(&stream).expect("resolved stream");
        s.clock = clock;
        s.position += 1;
        s.position
    }

    /// The host has observed everything `clock` covers (a query found it complete, or a
    /// synchronization waited for it). Frees it covers become reusable by any stream: after a
    /// synchronization in every pool, after a query only in pools that allow opportunistic
    /// reuse. Destroyed objects whose work is done are reclaimed.
    fn observe(&mut self, clock: &Clock, synchronized: bool) {
        self.completed.join(clock);
        for pool in self.pools.values_mut() {
            if synchronized || pool.allow_opportunistic {
                pool.free.promote(&self.completed);
            }
        }
        let completed = &self.completed;
        self.streams.retain(|&id, s| !(s.destroyed && completed.get(id) >= s.position));
        self.reclaim_destroyed_pools();
    }

    /// A synchronization: observe `clock`, then pools of `device` above their release threshold
    /// give memory back to it.
    fn synchronize(&mut self, clock: &Clock, device: usize) {
        self.observe(clock, true);
        let pools: Vec<u32> = self.pools.iter().filter(|(_, p)| p.device == device).map(|(&id, _)| id).collect();
        for id in pools {
            let threshold = self.pools[&id].release_threshold;
            if self.pools[&id].reserved > threshold {
                self.trim(id, threshold);
            }
        }
    }

    // ----- reservations ---------------------------------------------------------------------------

    /// How the configuration says stream-ordered pools map memory.
    fn pool_mapping(&self) -> Mapping {
        match self.config.pool_unit {
            Some(unit) => Mapping::Units(unit),
            None => Mapping::Segments { granule: self.config.granule },
        }
    }

    /// Reserves a new address range for pool `id` that holds at least `size` bytes, and returns
    /// its base (a free piece now), or `None` when the device's address space has no room.
    fn new_extent(&mut self, id: u32, size: u64) -> Option<u64> {
        let pool = &self.pools[&id];
        let len = match pool.mapping {
            Mapping::Segments { granule } => size.checked_next_multiple_of(granule)?,
            Mapping::Units(unit) => {
                let capacity = self.devices[pool.device].capacity;
                size.max(capacity.min(EXTENT_MAX)).checked_next_multiple_of(unit)?
            }
        };
        let base = self.devices[pool.device].space.reserve(len)?;
        let pool = self.pools.get_mut(&id).expect("pool");
        pool.extents.insert(base, len);
        pool.free.insert(base, len, base, Readiness::Ready);
        Some(base)
    }

    /// Gives the address range at `base` of pool `id` back to the device; nothing in it is
    /// mapped, and it is one free piece.
    fn drop_extent(&mut self, id: u32, base: u64) {
        let pool = self.pools.get_mut(&id).expect("pool");
        let len = pool.extents.remove(&base).expect("extent");
        pool.free.remove(base);
        self.devices[pool.device].space.release(base, len);
    }

    /// Maps every unit of pool `id` that `[addr, addr + size)` of the extent at `extent` overlaps
    /// and that is not mapped yet, for an allocation on `stream` that `knowledge` orders; `false`
    /// (and nothing mapped) when the pool's maximum size or the device's capacity does not allow
    /// it, once every idle unit on the device is released.
    ///
    /// Where ranges grow in units, the memory of a mapped unit that nothing uses (every byte of it
    /// free, and reusable by `stream`) moves to the new place first; only what that does not cover
    /// is reserved. So a pool reserves the most units that held a live byte at once, however far
    /// its allocations have wandered through its addresses: an H200's driver did exactly this on
    /// all 149,624 allocations of 17 traces replayed on one pool
    /// (`benches/results/2026-11-27-h200-placement.jsonl.gz`), where keeping every unit mapped at
    /// its address overstated the reservation by up to a third (train_eval_big21: 7,872 MiB against
    /// the driver's 5,920).
    fn map_units(
        &mut self,
        id: u32,
        extent: u64,
        addr: u64,
        size: u64,
        stream: Option<StreamId>,
        knowledge: &Clock,
    ) -> bool {
        let missing = |state: &Self| -> Vec<u64> {
            let pool = &state.pools[&id];
            pool.units_of(extent, addr, size).into_iter().filter(|base| !pool.units.contains_key(base)).collect()
        };
        let (device, unit, max_size) = {
            let pool = &self.pools[&id];
            (pool.device, pool.unit_size(extent), pool.max_size)
        };
        let idle = |state: &Self, wanted: usize| -> Vec<u64> {
            let pool = &state.pools[&id];
            if wanted == 0 || !matches!(pool.mapping, Mapping::Units(_)) {
                return Vec::new();
            }
            let covered = pool.units_of(extent, addr, size);
            pool.units
                .iter()
                .rev()
                .filter(|&(base, u)| {
                    u.live == 0
                        && !covered.contains(base)
                        && pool.free.covers_reusable(*base, u.size, stream, knowledge, pool.follow_event_dependencies)
                })
                .map(|(&base, _)| base)
                .take(wanted)
                .collect()
        };
        let mut new = missing(self);
        let mut moved = idle(self, new.len());
        let bytes = |new: &Vec<u64>, moved: &Vec<u64>| (new.len() - moved.len()) as u64 * unit;
        if max_size != 0 && self.pools[&id].reserved + bytes(&new, &moved) > max_size {
            return false;
        }
        // Units are mapped only while the device keeps a granule free beside them, as an H200's
        // driver refused a 32 MiB unit with 33.1 MiB free and mapped one with 35.1 MiB free.
        let keep = match self.pools[&id].mapping {
            Mapping::Units(_) => self.config.granule,
            Mapping::Segments { .. } => 0,
        };
        let fits = |state: &Self, new: &Vec<u64>, moved: &Vec<u64>| {
            new.len() == moved.len()
                || state.devices[device].reserved + bytes(new, moved) + keep <= state.devices[device].capacity
        };
        if !fits(self, &new, &moved) {
            self.release_idle_on_device(device);
            new = missing(self);
            moved = idle(self, new.len());
            if !fits(self, &new, &moved) {
                return false;
            }
        }
        for (index, &base) in new.iter().enumerate() {
            if let Some(host) = &mut self.host
                && !host.reserve(base, unit)
            {
                for &mapped in &new[..index] {
                    host.release(mapped);
                }
                return false;
            }
        }
        // The idle units' memory is what the new ones map: their addresses stay free, unmapped.
        for &base in &moved {
            self.pools.get_mut(&id).expect("pool").units.remove(&base);
            if let Some(host) = &mut self.host {
                host.release(base);
            }
        }
        self.devices[device].reserved += bytes(&new, &moved);
        let pool = self.pools.get_mut(&id).expect("pool");
        pool.units.extend(new.iter().map(|&base| (base, Unit { size: unit, live: 0 })));
        pool.reserved += bytes(&new, &moved);
        pool.reserved_high = pool.reserved_high.max(pool.reserved);
        true
    }

    /// Unmaps the idle unit at `base` of pool `id`. Its addresses stay the pool's, free, where
    /// ranges grow in units; a segment's range goes back with it.
    fn release_unit(&mut self, id: u32, base: u64) {
        let pool = self.pools.get_mut(&id).expect("pool");
        let unit = pool.units.remove(&base).expect("mapped unit");
        pool.reserved -= unit.size;
        self.devices[pool.device].reserved -= unit.size;
        if let Some(host) = &mut self.host {
            host.release(base);
        }
        if matches!(self.pools[&id].mapping, Mapping::Segments { .. }) {
            self.drop_extent(id, base);
        }
    }

    /// Releases idle units of pool `id`, largest first, while at least `keep` bytes remain.
    fn trim(&mut self, id: u32, keep: u64) {
        for (size, base) in self.pools[&id].idle_units() {
            if self.pools[&id].reserved >= keep + size {
                self.release_unit(id, base);
            }
        }
    }

    /// The driver's implicit release before it reports out-of-memory: every idle unit of every
    /// pool on the device goes back, whatever the release thresholds.
    fn release_idle_on_device(&mut self, device: usize) {
        let pools: Vec<u32> = self.pools.iter().filter(|(_, p)| p.device == device).map(|(&id, _)| id).collect();
        for id in pools {
            self.trim(id, 0);
        }
    }

    /// Pools destroyed while they still had outstanding allocations go away once those are
    /// freed and the frees observed, and their address ranges with them.
    fn reclaim_destroyed_pools(&mut self) {
        let done: Vec<u32> = self
            .pools
            .iter()
            .filter(|(_, p)| p.destroyed && p.used == 0 && p.idle_units().len() == p.units.len())
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            self.trim(id, 0);
            let pool = self.pools.remove(&id).expect("pool");
            for (base, len) in pool.extents {
                self.devices[pool.device].space.release(base, len);
            }
        }
    }

    // ----- allocation ----------------------------------------------------------------------------

    /// Places `bytes` in pool `id` for `stream` (`None` for a synchronous allocation).
    ///
    /// In order: the best-fit free piece the stream may reuse that lies in mapped memory; the
    /// best-fit free piece the stream may reuse anywhere in the pool's address ranges (a new range
    /// if none is large enough), mapping the units it lies in that are not mapped yet; and, if
    /// those cannot be mapped and the pool allows internal dependencies, a piece freed on another
    /// stream, after making the allocating stream wait for all work enqueued so far on that
    /// stream.
    fn place(&mut self, id: u32, bytes: u64, stream: Option<StreamId>) -> R<u64> {
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        let size = bytes.checked_next_multiple_of(ALIGNMENT).ok_or(OUT_OF_MEMORY)?;
        let knowledge = stream.map(|s| self.op_clock(s)).unwrap_or_default();
        let pool = &self.pools[&id];
        let (follow, internal) = (pool.follow_event_dependencies, pool.allow_internal_dependencies);
        let extent_of = |state: &Self, addr: u64| state.pools[&id].free.piece(addr).expect("free piece").segment;
        // Every segment is mapped whole: only ranges of units need the check, on each candidate.
        let segments = matches!(pool.mapping, Mapping::Segments { .. });
        let mapped = |addr: u64| {
            segments
                || pool.units_of(extent_of(self, addr), addr, size).iter().all(|base| pool.units.contains_key(base))
        };
        let mut fresh = None;
        let found = match pool.free.best_fit_where(size, stream, &knowledge, follow, mapped) {
            Some(addr) => Some(addr),
            None => match pool.free.best_fit(size, stream, &knowledge, follow) {
                Some(addr) => Some(addr),
                None => {
                    fresh = self.new_extent(id, size);
                    fresh
                }
            },
        };
        let mut wait_for = None;
        let addr = match found.filter(|&addr| self.map_units(id, extent_of(self, addr), addr, size, stream, &knowledge))
        {
            Some(addr) => addr,
            None => {
                // A segment's range is reserved only with its memory.
                if let Some(base) = fresh
                    && matches!(self.pools[&id].mapping, Mapping::Segments { .. })
                {
                    self.drop_extent(id, base);
                }
                let elsewhere = if internal { self.pools[&id].free.best_fit_elsewhere(size, stream) } else { None };
                let (addr, other) = elsewhere.filter(|_| stream.is_some()).ok_or(OUT_OF_MEMORY)?;
                if !self.map_units(id, extent_of(self, addr), addr, size, stream, &knowledge) {
                    return Err(OUT_OF_MEMORY);
                }
                wait_for = Some(other);
                addr
            }
        };
        if let Some(s) = stream {
            let mut clock = knowledge;
            if let Some(other) = wait_for {
                clock.join(&self.streams[&other].frontier());
            }
            self.commit(s, clock);
        }
        let pool = self.pools.get_mut(&id).expect("pool");
        let extent = pool.free.take(addr, size).segment;
        for base in pool.units_of(extent, addr, size) {
            pool.units.get_mut(&base).expect("mapped unit").live += 1;
        }
        pool.used += size;
        pool.used_high = pool.used_high.max(pool.used);
        self.allocations.insert(addr, Allocation { pool: id, size, extent });
        Ok(addr)
    }

    /// Returns a live allocation to its pool's free space with the given readiness.
    fn unplace(&mut self, ptr: u64, readiness: Readiness) -> u32 {
        let allocation = self.allocations.remove(&ptr).expect("live allocation");
        let pool = self.pools.get_mut(&allocation.pool).expect("pool of a live allocation");
        pool.used -= allocation.size;
        for base in pool.units_of(allocation.extent, ptr, allocation.size) {
            pool.units.get_mut(&base).expect("mapped unit").live -= 1;
        }
        pool.free.insert(ptr, allocation.size, allocation.extent, readiness);
        allocation.pool
    }

    /// Whether the next operation on `waiter` is ordered after everything enqueued so far on
    /// `other` (through events, the legacy stream, or an inserted dependency).
    pub(crate) fn is_ordered_after(&mut self, waiter: CUstream, other: CUstream) -> R<bool> {
        let (waiter, other) = (self.stream(waiter)?, self.stream(other)?);
        let position = self.streams[&other].position;
        Ok(waiter == other || self.op_clock(waiter).get(other) >= position)
    }

    // ----- entry points: initialization and devices ------------------------------------------------

    pub(crate) fn init(&mut self, flags: u32) -> R<()> {
        if flags != 0 {
            return Err(INVALID_VALUE);
        }
        self.initialized = true;
        Ok(())
    }

    pub(crate) fn device_count(&self) -> R<i32> {
        self.require_init()?;
        Ok(self.devices.len() as i32)
    }

    pub(crate) fn device_get(&self, ordinal: i32) -> R<CUdevice> {
        self.device(ordinal).map(|d| d as CUdevice)
    }

    pub(crate) fn device_name(&self, dev: CUdevice) -> R<String> {
        let d = self.device(dev)?;
        Ok(format!("steppool simulated device {d} ({})", crate::bytes::Bytes(self.devices[d].capacity)))
    }

    pub(crate) fn device_total_mem(&self, dev: CUdevice) -> R<usize> {
        let d = self.device(dev)?;
        Ok(self.devices[d].capacity as usize)
    }

    /// Device attributes the simulated device answers, with an H100's values where they are
    /// hardware facts. Unlike a real device, which answers every attribute of the enum, it
    /// refuses the others with `CUDA_ERROR_INVALID_VALUE` rather than invent values.
    pub(crate) fn device_attribute(&self, attribute: CUdevice_attribute, dev: CUdevice) -> R<i32> {
        use CUdevice_attribute as A;
        self.device(dev)?;
        Ok(match attribute {
            A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK => MAX_THREADS as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X => MAX_BLOCK[0] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y => MAX_BLOCK[1] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z => MAX_BLOCK[2] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X => MAX_GRID[0] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y => MAX_GRID[1] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z => MAX_GRID[2] as i32,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK => MAX_SHARED_MEMORY as i32,
            A::CU_DEVICE_ATTRIBUTE_WARP_SIZE => 32,
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT => 132,
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR => 9,
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR => 0,
            A::CU_DEVICE_ATTRIBUTE_INTEGRATED => 0,
            A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS => 1,
            A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING => 1,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 227 << 10,
            A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => i32::from(self.config.vmm_supported),
            A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED => i32::from(self.config.memory_pools_supported),
            // Added in 11.3; older drivers refuse it.
            A::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES if self.config.driver_version >= 11030 => 0,
            _ => return Err(INVALID_VALUE),
        })
    }

    pub(crate) fn can_access_peer(&self, dev: CUdevice, peer: CUdevice) -> R<i32> {
        let (d, p) = (self.device(dev)?, self.device(peer)?);
        Ok(i32::from(d != p && self.config.peer_access))
    }

    // ----- entry points: contexts --------------------------------------------------------------------

    pub(crate) fn primary_ctx_retain(&mut self, dev: CUdevice) -> R<CUcontext> {
        let d = self.device(dev)?;
        let ctx = d as u32 + 1;
        if self.contexts[&ctx].retained == 0 {
            let legacy = self.new_stream(ctx, StreamKind::Legacy, false);
            self.contexts.get_mut(&ctx).expect("context").legacy = Some(legacy);
        }
        self.contexts.get_mut(&ctx).expect("context").retained += 1;
        Ok(self.handle(Kind::Context, ctx) as CUcontext)
    }

    /// Drops one retain; the last one destroys the context's streams, events and modules after
    /// synchronizing with their work, as the real driver does.
    pub(crate) fn primary_ctx_release(&mut self, dev: CUdevice) -> R<()> {
        let d = self.device(dev)?;
        let ctx = d as u32 + 1;
        let context = self.contexts.get_mut(&ctx).expect("context");
        if context.retained == 0 {
            return Err(INVALID_CONTEXT);
        }
        context.retained -= 1;
        if context.retained > 0 {
            return Ok(());
        }
        context.legacy = None;
        self.capture_may_change();
        let mut clock = Clock::default();
        for stream in self.streams.values().filter(|s| s.ctx == ctx) {
            clock.join(&stream.frontier());
        }
        self.synchronize(&clock, d);
        self.streams.retain(|_, s| s.ctx != ctx);
        self.per_thread.retain(|&(_, c), _| c != ctx);
        self.events.retain(|_, e| e.ctx != ctx);
        let modules: Vec<u32> = self.modules.iter().filter(|(_, m)| m.ctx == ctx).map(|(&id, _)| id).collect();
        for module in modules {
            self.modules.remove(&module);
            self.functions.retain(|_, f| f.module != module);
        }
        // The reset destroys the context's allocations: everything `cuMemAlloc` made on the
        // device. Pool memory is not tied to a context and stays (to be confirmed on a GPU).
        let raw_pool = self.devices[d].raw_pool;
        let doomed: Vec<u64> =
            self.allocations.iter().filter(|(_, a)| a.pool == raw_pool).map(|(&ptr, _)| ptr).collect();
        for ptr in doomed {
            self.unplace(ptr, Readiness::Ready);
        }
        self.trim(raw_pool, 0);
        Ok(())
    }

    pub(crate) fn ctx_get_current(&self) -> R<CUcontext> {
        self.require_init()?;
        let top = with_stack(self.id, |stack| stack.last().copied());
        Ok(top.map_or(std::ptr::null_mut(), |ctx| self.handle(Kind::Context, ctx) as CUcontext))
    }

    pub(crate) fn ctx_set_current(&mut self, raw: CUcontext) -> R<()> {
        self.require_init()?;
        if raw.is_null() {
            with_stack(self.id, |stack| stack.pop());
            return Ok(());
        }
        let ctx = self.context(raw)?;
        with_stack(self.id, |stack| match stack.last_mut() {
            Some(top) => *top = ctx,
            None => stack.push(ctx),
        });
        Ok(())
    }

    pub(crate) fn ctx_push_current(&mut self, raw: CUcontext) -> R<()> {
        self.require_init()?;
        let ctx = self.context(raw)?;
        with_stack(self.id, |stack| stack.push(ctx));
        Ok(())
    }

    pub(crate) fn ctx_pop_current(&mut self) -> R<CUcontext> {
        self.require_init()?;
        let ctx = with_stack(self.id, |stack| stack.pop()).ok_or(INVALID_CONTEXT)?;
        Ok(self.handle(Kind::Context, ctx) as CUcontext)
    }

    pub(crate) fn ctx_get_device(&self) -> R<CUdevice> {
        let ctx = self.current()?;
        Ok(self.contexts[&ctx].device as CUdevice)
    }

    pub(crate) fn ctx_synchronize(&mut self) -> R<()> {
        let ctx = self.current()?;
        self.capture_forbids_context_wait(ctx)?;
        let mut clock = Clock::default();
        for stream in self.streams.values().filter(|s| s.ctx == ctx) {
            clock.join(&stream.frontier());
        }
        let device = self.contexts[&ctx].device;
        self.synchronize(&clock, device);
        Ok(())
    }

    // ----- entry points: streams ---------------------------------------------------------------------

    pub(crate) fn stream_create(&mut self, flags: u32) -> R<CUstream> {
        let ctx = self.current()?;
        if flags & !CUstream_flags::CU_STREAM_NON_BLOCKING.0 != 0 {
            return Err(INVALID_VALUE);
        }
        let blocking = flags & CUstream_flags::CU_STREAM_NON_BLOCKING.0 == 0;
        let id = self.new_stream(ctx, StreamKind::Created, blocking);
        Ok(self.handle(Kind::Stream, id) as CUstream)
    }

    pub(crate) fn stream_destroy(&mut self, raw: CUstream) -> R<()> {
        self.require_init()?;
        let id = decode(self.tag, Kind::Stream, raw as usize)
            .filter(|id| self.streams.get(id).is_some_and(|s| !s.destroyed && s.kind == StreamKind::Created))
            .ok_or(INVALID_HANDLE)?;
        self.capture_may_change();
        let stream = self.streams.get_mut(&id).expect("stream");
        stream.destroyed = true;
        if self.completed.get(id) >= stream.position {
            self.streams.remove(&id);
        }
        Ok(())
    }

    pub(crate) fn stream_synchronize(&mut self, raw: CUstream) -> R<()> {
        let id = self.stream(raw)?;
        self.capture_forbids_wait(id)?;
        let (frontier, device) = (self.streams[&id].frontier(), self.streams[&id].device);
        self.synchronize(&frontier, device);
        Ok(())
    }

    /// The simulated device runs work in zero time, so a query finds it complete; like a real
    /// query that returns `CUDA_SUCCESS`, it lets later allocations reuse the stream's frees.
    /// Work held back ([`State::hold`]) is not complete: `CUDA_ERROR_NOT_READY`, nothing observed.
    pub(crate) fn stream_query(&mut self, raw: CUstream) -> R<()> {
        let id = self.stream(raw)?;
        self.capture_forbids_wait(id)?;
        let frontier = self.streams[&id].frontier();
        if self.holds_back(&frontier) {
            return Err(NOT_READY);
        }
        self.observe(&frontier, false);
        Ok(())
    }

    pub(crate) fn stream_wait_event(&mut self, raw: CUstream, event: CUevent, flags: u32) -> R<()> {
        let id = self.stream(raw)?;
        let event = self.event(event)?;
        if self.capture_wait(id, event, flags)? {
            return Ok(());
        }
        // CU_EVENT_WAIT_EXTERNAL is only valid during stream capture (`capture_wait`).
        if flags != CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT.0 {
            return Err(INVALID_VALUE);
        }
        let mut clock = self.op_clock(id);
        if let Some(recorded) = &self.events[&event].recorded {
            clock.join(recorded);
        }
        self.commit(id, clock);
        Ok(())
    }

    pub(crate) fn stream_get_ctx(&mut self, raw: CUstream) -> R<CUcontext> {
        let id = self.stream(raw)?;
        Ok(self.handle(Kind::Context, self.streams[&id].ctx) as CUcontext)
    }

    // ----- entry points: events ----------------------------------------------------------------------

    pub(crate) fn event_create(&mut self, flags: u32) -> R<CUevent> {
        let ctx = self.current()?;
        let (blocking, no_timing, interprocess) = (
            CUevent_flags::CU_EVENT_BLOCKING_SYNC.0,
            CUevent_flags::CU_EVENT_DISABLE_TIMING.0,
            CUevent_flags::CU_EVENT_INTERPROCESS.0,
        );
        if flags & !(blocking | no_timing | interprocess) != 0 || (flags & interprocess != 0 && flags & no_timing == 0)
        {
            return Err(INVALID_VALUE);
        }
        let id = self.next();
        let device = self.contexts[&ctx].device;
        self.events.insert(id, Event { ctx, device, timing: flags & no_timing == 0, recorded: None });
        Ok(self.handle(Kind::Event, id) as CUevent)
    }

    pub(crate) fn event_destroy(&mut self, raw: CUevent) -> R<()> {
        let id = self.event(raw)?;
        self.events.remove(&id);
        Ok(())
    }

    pub(crate) fn event_record(&mut self, raw: CUevent, stream: CUstream) -> R<()> {
        let event = self.event(raw)?;
        let id = self.stream(stream)?;
        if self.streams[&id].ctx != self.events[&event].ctx {
            return Err(INVALID_HANDLE);
        }
        let sequence = self.capture_gate(id)?;
        self.capture_event_record(event, id, sequence);
        if sequence.is_some() {
            return Ok(());
        }
        let clock = self.op_clock(id);
        self.commit(id, clock);
        let frontier = self.streams[&id].frontier();
        self.events.get_mut(&event).expect("event").recorded = Some(frontier);
        Ok(())
    }

    /// Like [`Self::stream_query`]: recorded work is found complete and observed, unless it is
    /// held back ([`State::hold`]).
    pub(crate) fn event_query(&mut self, raw: CUevent) -> R<()> {
        let id = self.event(raw)?;
        self.capture_forbids_event(id)?;
        if let Some(clock) = self.events[&id].recorded.clone() {
            if self.holds_back(&clock) {
                return Err(NOT_READY);
            }
            self.observe(&clock, false);
        }
        Ok(())
    }

    // ----- test facility: work held incomplete ------------------------------------------------------

    /// From now on, work enqueued on stream `raw` (and work ordered after it) is not complete
    /// until [`State::release`] or a synchronization that waits for it: queries answer
    /// `CUDA_ERROR_NOT_READY`. Work enqueued before stays as it was. Holding a held stream changes
    /// nothing.
    pub(crate) fn hold(&mut self, raw: CUstream) -> R<()> {
        let id = self.stream(raw)?;
        let position = self.streams[&id].position;
        self.held.entry(id).or_insert(position);
        Ok(())
    }

    /// The work of stream `raw` runs again: what it held is complete for the next query.
    pub(crate) fn release(&mut self, raw: CUstream) -> R<()> {
        let id = self.stream(raw)?;
        self.held.remove(&id);
        Ok(())
    }

    /// Whether `clock` covers work that a hold keeps incomplete: a position of a held stream past
    /// both the hold's start and what the host has observed complete.
    fn holds_back(&self, clock: &Clock) -> bool {
        self.held.iter().any(|(&stream, &from)| {
            let position = clock.get(stream);
            position > from && position > self.completed.get(stream)
        })
    }

    pub(crate) fn event_synchronize(&mut self, raw: CUevent) -> R<()> {
        let id = self.event(raw)?;
        self.capture_forbids_event(id)?;
        if let Some(clock) = self.events[&id].recorded.clone() {
            let device = self.events[&id].device;
            self.synchronize(&clock, device);
        }
        Ok(())
    }

    /// The simulated device runs work in zero time: any two recorded timing events are 0 ms apart.
    pub(crate) fn event_elapsed_time(&self, start: CUevent, end: CUevent) -> R<f32> {
        let (start, end) = (self.event(start)?, self.event(end)?);
        let ok = |id: u32| self.events[&id].timing && self.events[&id].recorded.is_some();
        if ok(start) && ok(end) { Ok(0.0) } else { Err(INVALID_HANDLE) }
    }

    // ----- entry points: memory ------------------------------------------------------------------------

    pub(crate) fn mem_get_info(&self) -> R<(usize, usize)> {
        let ctx = self.current()?;
        let device = &self.devices[self.contexts[&ctx].device];
        Ok(((device.capacity - device.reserved) as usize, device.capacity as usize))
    }

    /// `cuMemAlloc`: a synchronous allocation from the device's raw pool.
    pub(crate) fn mem_alloc(&mut self, bytes: usize) -> R<CUdeviceptr> {
        let ctx = self.current()?;
        self.capture_forbids_unsafe_call()?;
        let raw_pool = self.devices[self.contexts[&ctx].device].raw_pool;
        self.place(raw_pool, bytes as u64, None)
    }

    /// `cuMemFree`: frees any allocation at once; the driver "assumes that all accesses to the
    /// allocation are complete". Idle raw units go back to the device immediately.
    pub(crate) fn mem_free(&mut self, ptr: CUdeviceptr) -> R<()> {
        self.current()?;
        self.capture_forbids_unsafe_call()?;
        if let Some(result) = self.graph_free(ptr) {
            return result;
        }
        if !self.allocations.contains_key(&ptr) {
            return Err(INVALID_VALUE);
        }
        let pool = self.unplace(ptr, Readiness::Ready);
        if self.pools[&pool].kind == PoolKind::Raw {
            self.trim(pool, 0);
        }
        self.reclaim_destroyed_pools();
        Ok(())
    }

    pub(crate) fn memset_d8_async(&mut self, ptr: CUdeviceptr, value: u8, len: usize, stream: CUstream) -> R<()> {
        let id = self.stream(stream)?;
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_work(sequence, id, &[(ptr, len)]);
        }
        let span = self.span(ptr, len, self.streams[&id].device).ok_or(INVALID_VALUE)?;
        let clock = self.op_clock(id);
        self.commit(id, clock);
        self.span_fill(span, value);
        Ok(())
    }

    // ----- host-backed memory: copies and the fill kernels ------------------------------------------

    /// The range `[ptr, ptr + len)` when it lies inside one live allocation (an empty range
    /// anywhere is accepted, as the driver accepts zero-length copies).
    fn live_range(&self, ptr: CUdeviceptr, len: usize) -> Option<Range> {
        if len == 0 {
            return Some(Range { addr: ptr, len: 0, host: true });
        }
        if self.graph_range(ptr, len).is_some() {
            return Some(Range { addr: ptr, len, host: false });
        }
        let (&start, allocation) = self.allocations.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len as u64)?;
        if end > start + allocation.size {
            return None;
        }
        Some(Range { addr: ptr, len, host: true })
    }

    /// The range `[ptr, ptr + len)` when it lies inside one live allocation, or in memory mapped
    /// with read-write access for `device` (see `vmm.rs`).
    fn span(&self, ptr: CUdeviceptr, len: usize, device: usize) -> Option<Span> {
        match self.live_range(ptr, len) {
            Some(range) => Some(Span::Pool(range)),
            None => self.vmm.pieces(ptr, len, device).map(Span::Mapped),
        }
    }

    /// The host memory behind a checked pool range, on a host-backed device.
    fn pool_host(&mut self, range: Range) -> Option<&mut HostMemory> {
        self.host.as_mut().filter(|_| range.host)
    }

    /// Fills a checked span with `value`, on a host-backed device.
    fn span_fill(&mut self, span: Span, value: u8) {
        match span {
            Span::Pool(range) => {
                if let Some(host) = self.pool_host(range) {
                    host.for_each_part(range.addr, range.len, |_, bytes| bytes.fill(value));
                }
            }
            Span::Mapped(pieces) => self.vmm.fill(&pieces, value),
        }
    }

    /// Writes `src` into a checked span of its length, on a host-backed device.
    fn span_write(&mut self, span: Span, src: &[u8]) {
        match span {
            Span::Pool(range) => {
                if let Some(host) = self.pool_host(range) {
                    host.for_each_part(range.addr, range.len, |at, bytes| {
                        bytes.copy_from_slice(&src[at..at + bytes.len()]);
                    });
                }
            }
            Span::Mapped(pieces) => self.vmm.write(&pieces, src),
        }
    }

    /// Reads a checked span into `dst` of its length, on a host-backed device.
    fn span_read(&mut self, span: Span, dst: &mut [u8]) {
        match span {
            Span::Pool(range) => {
                if let Some(host) = self.pool_host(range) {
                    host.for_each_part(range.addr, range.len, |at, bytes| {
                        dst[at..at + bytes.len()].copy_from_slice(bytes);
                    });
                }
            }
            Span::Mapped(pieces) => self.vmm.read(&pieces, dst),
        }
    }

    /// Whether device memory is backed by host memory.
    pub(crate) fn host_backed(&self) -> bool {
        self.host.is_some()
    }

    /// Enqueues a copy on `stream` (the work itself takes no time) and checks the device side.
    /// Host bytes move only on a host-backed device; elsewhere copies into device memory are
    /// ordered without effect, and copies out are refused with `CUDA_ERROR_NOT_SUPPORTED`
    /// because nothing could be read back.
    pub(crate) fn memcpy_htod_async(&mut self, dst: CUdeviceptr, src: &[u8], stream: CUstream) -> R<()> {
        let id = self.stream(stream)?;
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_work(sequence, id, &[(dst, src.len())]);
        }
        let span = self.span(dst, src.len(), self.streams[&id].device).ok_or(INVALID_VALUE)?;
        let clock = self.op_clock(id);
        self.commit(id, clock);
        self.span_write(span, src);
        Ok(())
    }

    /// See [`State::memcpy_htod_async`].
    pub(crate) fn memcpy_dtoh_async(&mut self, dst: &mut [u8], src: CUdeviceptr, stream: CUstream) -> R<()> {
        let id = self.stream(stream)?;
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_work(sequence, id, &[(src, dst.len())]);
        }
        let span = self.span(src, dst.len(), self.streams[&id].device).ok_or(INVALID_VALUE)?;
        // Graph allocations have no host memory behind them.
        let readable = self.host_backed() && !matches!(span, Span::Pool(Range { host: false, .. }));
        if !readable && !dst.is_empty() {
            return Err(NOT_SUPPORTED);
        }
        let clock = self.op_clock(id);
        self.commit(id, clock);
        self.span_read(span, dst);
        Ok(())
    }

    /// See [`State::memcpy_htod_async`]. Overlapping ranges copy as `memmove` does.
    pub(crate) fn memcpy_dtod_async(
        &mut self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        len: usize,
        stream: CUstream,
    ) -> R<()> {
        let id = self.stream(stream)?;
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_work(sequence, id, &[(src, len), (dst, len)]);
        }
        let device = self.streams[&id].device;
        let from = self.span(src, len, device).ok_or(INVALID_VALUE)?;
        let to = self.span(dst, len, device).ok_or(INVALID_VALUE)?;
        let clock = self.op_clock(id);
        self.commit(id, clock);
        if self.host_backed() {
            let mut copy = vec![0; len];
            self.span_read(from, &mut copy);
            self.span_write(to, &copy);
        }
        Ok(())
    }

    /// Whether `function` is an entry of one of the repository's fill kernels, which a
    /// host-backed device runs at launch.
    pub(crate) fn is_fill_kernel(&self, function: CUfunction) -> bool {
        decode(self.tag, Kind::Function, function as usize)
            .and_then(|id| self.functions.get(&id))
            .and_then(|f| self.modules.get(&f.module))
            .is_some_and(|module| module.fill)
    }

    /// Runs a fill kernel launched on a host-backed device: `dst[..len] = value`. A range outside
    /// every live allocation is `CUDA_ERROR_ILLEGAL_ADDRESS`, which a real kernel would hit.
    pub(crate) fn run_fill(&mut self, dst: CUdeviceptr, len: u64, value: u8) -> R<()> {
        let len = usize::try_from(len).map_err(|_| ILLEGAL_ADDRESS)?;
        let device = self.contexts[&self.current()?].device;
        let span = self.span(dst, len, device).ok_or(ILLEGAL_ADDRESS)?;
        self.span_fill(span, value);
        Ok(())
    }

    pub(crate) fn mem_alloc_async(&mut self, bytes: usize, stream: CUstream) -> R<CUdeviceptr> {
        self.require_pools()?;
        let id = self.stream(stream)?;
        if bytes == 0 {
            return Ok(0);
        }
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_alloc(sequence, id, bytes as u64);
        }
        let pool = self.devices[self.streams[&id].device].current_pool;
        self.place(pool, bytes as u64, Some(id))
    }

    pub(crate) fn mem_alloc_from_pool_async(
        &mut self,
        bytes: usize,
        pool: CUmemoryPool,
        stream: CUstream,
    ) -> R<CUdeviceptr> {
        let pool = self.pool(pool)?;
        let id = self.stream(stream)?;
        if bytes == 0 {
            return Ok(0);
        }
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_alloc(sequence, id, bytes as u64);
        }
        self.place(pool, bytes as u64, Some(id))
    }

    /// `cuMemFreeAsync`: the memory becomes reusable by `stream` at once and by other streams
    /// once ordered after the free, or once the host observes it complete.
    pub(crate) fn mem_free_async(&mut self, ptr: CUdeviceptr, stream: CUstream) -> R<()> {
        self.require_pools()?;
        let id = self.stream(stream)?;
        if let Some(sequence) = self.capture_gate(id)? {
            return self.capture_free(sequence, id, ptr);
        }
        if let Some(result) = self.graph_free(ptr) {
            let clock = self.op_clock(id);
            self.commit(id, clock);
            return result;
        }
        if !self.allocations.contains_key(&ptr) {
            return Err(INVALID_VALUE);
        }
        let clock = self.op_clock(id);
        let position = self.commit(id, clock);
        self.unplace(ptr, Readiness::Pending { stream: id, position });
        Ok(())
    }

    // ----- entry points: pools -------------------------------------------------------------------------

    pub(crate) fn mem_pool_create(&mut self, props: &CUmemPoolProps) -> R<CUmemoryPool> {
        self.require_pools()?;
        self.capture_forbids_unsafe_call()?;
        // Before 12.2 `maxSize` was part of the reserved bytes, which must be zero.
        let max_size_known = self.config.driver_version >= 12020;
        if props.allocType != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
            || props.reserved.iter().any(|&b| b != 0)
            || (props.maxSize != 0 && !max_size_known)
        {
            return Err(INVALID_VALUE);
        }
        match props.location.type_ {
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE => {}
            CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA => return Err(NOT_SUPPORTED),
            _ => return Err(INVALID_VALUE),
        }
        let device = self.device(props.location.id).map_err(|_| INVALID_VALUE)?;
        if props.handleTypes != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE || props.usage != 0 {
            return Err(NOT_SUPPORTED);
        }
        let id = self.next();
        self.pools.insert(id, Pool::new(device, PoolKind::Created, props.maxSize as u64, self.pool_mapping()));
        Ok(self.handle(Kind::Pool, id) as CUmemoryPool)
    }

    /// Destroys a created pool; with allocations still outstanding it goes away once they are
    /// freed, as `cuMemPoolDestroy` documents. The handle is invalid from now on.
    pub(crate) fn mem_pool_destroy(&mut self, raw: CUmemoryPool) -> R<()> {
        let id = self.pool(raw)?;
        if self.pools[&id].kind != PoolKind::Created {
            return Err(INVALID_VALUE);
        }
        let device = self.pools[&id].device;
        if self.devices[device].current_pool == id {
            self.devices[device].current_pool = self.devices[device].default_pool;
        }
        self.pools.get_mut(&id).expect("pool").destroyed = true;
        self.reclaim_destroyed_pools();
        Ok(())
    }

    pub(crate) fn mem_pool_trim_to(&mut self, raw: CUmemoryPool, keep: usize) -> R<()> {
        let id = self.pool(raw)?;
        self.capture_forbids_unsafe_call()?;
        self.trim(id, keep as u64);
        Ok(())
    }

    pub(crate) fn mem_pool_set_attribute(
        &mut self,
        raw: CUmemoryPool,
        attribute: CUmemPool_attribute,
        value: u64,
    ) -> R<()> {
        use CUmemPool_attribute as A;
        let id = self.pool(raw)?;
        self.capture_forbids_unsafe_call()?;
        let pool = self.pools.get_mut(&id).expect("pool");
        match attribute {
            A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES => pool.follow_event_dependencies = value != 0,
            A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC => pool.allow_opportunistic = value != 0,
            A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => pool.allow_internal_dependencies = value != 0,
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => pool.release_threshold = value,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH if value == 0 => pool.reserved_high = pool.reserved,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH if value == 0 => pool.used_high = pool.used,
            _ => return Err(INVALID_VALUE),
        }
        Ok(())
    }

    pub(crate) fn mem_pool_get_attribute(&mut self, raw: CUmemoryPool, attribute: CUmemPool_attribute) -> R<u64> {
        use CUmemPool_attribute as A;
        let id = self.pool(raw)?;
        self.capture_forbids_unsafe_call()?;
        let pool = &self.pools[&id];
        Ok(match attribute {
            A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES => u64::from(pool.follow_event_dependencies),
            A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC => u64::from(pool.allow_opportunistic),
            A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => u64::from(pool.allow_internal_dependencies),
            A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => pool.release_threshold,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => pool.reserved,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => pool.reserved_high,
            A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT => pool.used,
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH => pool.used_high,
            _ => return Err(INVALID_VALUE),
        })
    }

    /// Grants or revokes other devices' access. The resident device always has read-write access
    /// and it cannot be changed; peers need `peer_access` in the configuration.
    pub(crate) fn mem_pool_set_access(&mut self, raw: CUmemoryPool, descriptors: &[CUmemAccessDesc]) -> R<()> {
        use CUmemAccess_flags as F;
        let id = self.pool(raw)?;
        let resident = self.pools[&id].device;
        let mut changes = Vec::with_capacity(descriptors.len());
        for descriptor in descriptors {
            if descriptor.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(INVALID_VALUE);
            }
            let device = self.device(descriptor.location.id)?;
            let flags = descriptor.flags;
            if ![
                F::CU_MEM_ACCESS_FLAGS_PROT_NONE,
                F::CU_MEM_ACCESS_FLAGS_PROT_READ,
                F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            ]
            .contains(&flags)
            {
                return Err(INVALID_VALUE);
            }
            if device == resident {
                if flags != F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
                    return Err(INVALID_VALUE);
                }
                continue;
            }
            if !self.config.peer_access {
                return Err(INVALID_DEVICE);
            }
            changes.push((device, flags));
        }
        let pool = self.pools.get_mut(&id).expect("pool");
        pool.access.extend(changes);
        Ok(())
    }

    pub(crate) fn mem_pool_get_access(&self, raw: CUmemoryPool, location: &CUmemLocation) -> R<CUmemAccess_flags> {
        let id = self.pool(raw)?;
        if location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(INVALID_VALUE);
        }
        let device = self.device(location.id)?;
        let pool = &self.pools[&id];
        Ok(if device == pool.device {
            CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            pool.access.get(&device).copied().unwrap_or(CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE)
        })
    }

    pub(crate) fn device_get_default_mem_pool(&self, dev: CUdevice) -> R<CUmemoryPool> {
        self.require_pools()?;
        let d = self.device(dev)?;
        Ok(self.handle(Kind::Pool, self.devices[d].default_pool) as CUmemoryPool)
    }

    pub(crate) fn device_get_mem_pool(&self, dev: CUdevice) -> R<CUmemoryPool> {
        self.require_pools()?;
        let d = self.device(dev).map_err(|_| INVALID_VALUE)?;
        Ok(self.handle(Kind::Pool, self.devices[d].current_pool) as CUmemoryPool)
    }

    pub(crate) fn device_set_mem_pool(&mut self, dev: CUdevice, raw: CUmemoryPool) -> R<()> {
        let d = self.device(dev).map_err(|_| INVALID_VALUE)?;
        let id = self.pool(raw)?;
        if self.pools[&id].device != d {
            return Err(INVALID_VALUE);
        }
        self.devices[d].current_pool = id;
        Ok(())
    }

    // ----- entry points: modules and launches ----------------------------------------------------------

    /// Loads PTX text. The simulated device does not execute kernels; it keeps the names of the
    /// `.entry` functions so that launches can be checked and ordered.
    pub(crate) fn module_load_data(&mut self, ptx: &[u8]) -> R<CUmodule> {
        let ctx = self.current()?;
        let text = std::str::from_utf8(ptx).map_err(|_| INVALID_IMAGE)?;
        if !text.contains(".version") || !text.contains(".target") {
            return Err(INVALID_IMAGE);
        }
        let entries = text
            .split(".entry")
            .skip(1)
            .filter_map(|rest| {
                let name: String = rest
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
                    .collect();
                (!name.is_empty()).then_some(name)
            })
            .collect();
        let fill =
            [crate::kernels::FILL_BYTES_PTX, crate::kernels::FILL_V4_PTX].iter().any(|kernel| kernel.to_bytes() == ptx);
        let id = self.next();
        self.modules.insert(id, Module { ctx, entries, fill });
        Ok(self.handle(Kind::Module, id) as CUmodule)
    }

    pub(crate) fn module_unload(&mut self, raw: CUmodule) -> R<()> {
        self.require_init()?;
        let id = decode(self.tag, Kind::Module, raw as usize)
            .filter(|id| self.modules.contains_key(id))
            .ok_or(INVALID_HANDLE)?;
        self.modules.remove(&id);
        self.functions.retain(|_, f| f.module != id);
        Ok(())
    }

    pub(crate) fn module_get_function(&mut self, raw: CUmodule, name: &str) -> R<CUfunction> {
        self.require_init()?;
        let id = decode(self.tag, Kind::Module, raw as usize)
            .filter(|id| self.modules.contains_key(id))
            .ok_or(INVALID_HANDLE)?;
        if !self.modules[&id].entries.iter().any(|entry| entry == name) {
            return Err(NOT_FOUND);
        }
        let function = self.next();
        self.functions.insert(function, Function { module: id });
        Ok(self.handle(Kind::Function, function) as CUfunction)
    }

    /// Checks a launch's configuration and enqueues it; the kernel itself does not run. `false`
    /// when it was captured into a graph instead of enqueued.
    pub(crate) fn launch_kernel(&mut self, function: CUfunction, launch: Launch, stream: CUstream) -> R<bool> {
        self.require_init()?;
        decode(self.tag, Kind::Function, function as usize)
            .filter(|id| self.functions.contains_key(id))
            .ok_or(INVALID_HANDLE)?;
        let id = self.stream(stream)?;
        let threads = launch.block.iter().map(|&b| u64::from(b)).product::<u64>();
        let within = |dims: [u32; 3], max: [u32; 3]| dims.iter().zip(max).all(|(&d, m)| (1..=m).contains(&d));
        if !within(launch.grid, MAX_GRID)
            || !within(launch.block, MAX_BLOCK)
            || threads > MAX_THREADS
            || launch.shared_memory > MAX_SHARED_MEMORY
            || (launch.has_params && launch.has_extra)
        {
            return Err(INVALID_VALUE);
        }
        if let Some(sequence) = self.capture_gate(id)? {
            self.capture_work(sequence, id, &[])?;
            return Ok(false);
        }
        let clock = self.op_clock(id);
        self.commit(id, clock);
        Ok(true)
    }
}

/// The shape of a kernel launch, as checked by [`State::launch_kernel`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Launch {
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_memory: u32,
    pub(crate) has_params: bool,
    pub(crate) has_extra: bool,
}
