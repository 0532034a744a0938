//! The allocators the benchmarks compare, behind one small interface so that every one replays
//! the same sequences the same way.
//!
//! | name | what it calls |
//! | --- | --- |
//! | `cuda_malloc` | `cuMemAlloc` / `cuMemFree` (after synchronizing the stream, as `cudaFree` does the device) |
//! | `default_pool_t0` | `cuMemAllocAsync` / `cuMemFreeAsync` on the device's default pool, release threshold 0 (the driver's default) |
//! | `default_pool` | the same with the release threshold raised to `u64::MAX` |
//! | `driver_pool` | `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool of its own, threshold raised: the bare call steppool's `Pool` wraps, and the baseline of every ratio |
//! | `steppool_pool` | steppool's raw API, step-lifetime allocations in a step-scoped phase with the `Pool` strategy |
//! | `steppool_arena` | the same phase with the `Arena` strategy (64 MiB slabs) |
//! | `steppool_planned` | the same phase with the `Planned` strategy (8 plans, signatures of 4 sizes) |
//!
//! Persistent allocations go to a persistent `Pool` phase in every steppool variant.

use steppool::sys::{CUdeviceptr, CUmemPool_attribute, CUmemoryPool, CUstream, Driver, PoolProps};
use steppool::{Phase, PhaseSpec, Runtime, Scope, StepReport, Strategy, Stream};

use crate::sequence::Lifetime;
use crate::{Result, runtime};

/// Timings of one step boundary, where the allocator has them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTimes {
    /// Time spent releasing the step's memory, in ns.
    pub release_ns: f64,
    /// The step's time from its beginning to the end of the release, in ns.
    pub step_ns: f64,
}

impl From<&StepReport> for StepTimes {
    fn from(report: &StepReport) -> Self {
        Self { release_ns: report.release_time.as_secs_f64() * 1e9, step_ns: report.duration.as_secs_f64() * 1e9 }
    }
}

/// An allocator under test: allocations and frees on one stream, with step boundaries.
pub trait Allocator {
    /// Its name in records.
    fn name(&self) -> &'static str;

    /// The driver it calls.
    fn driver(&self) -> &Driver;

    /// The stream its allocations are ordered on, to launch work on.
    fn stream(&self) -> CUstream;

    /// Allocates `bytes` for allocation `id` of a sequence.
    fn alloc(&mut self, id: u32, bytes: u64, lifetime: Lifetime) -> Result<CUdeviceptr>;

    /// Frees allocation `id` at `ptr`; no work enqueued after this uses it.
    fn free(&mut self, id: u32, ptr: CUdeviceptr) -> Result<()>;

    /// Ends the current step and begins the next: synchronizes the stream, as a training loop
    /// does when it reads its loss, and releases what the allocator releases at boundaries.
    fn end_step(&mut self) -> Result<Option<StepTimes>>;

    /// Waits for the stream and gives back what the allocator holds without live data, so the
    /// next allocator starts from an empty device.
    fn finish(&mut self) -> Result<()>;
}

/// The allocators of [`Kind::make`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc` / `cuMemFree`.
    CudaMalloc,
    /// The device's default pool with the release threshold at 0.
    DefaultPoolT0,
    /// The device's default pool with the release threshold raised.
    DefaultPool,
    /// A pool of its own with the release threshold raised: the baseline.
    DriverPool,
    /// steppool, `Pool` strategy.
    SteppoolPool,
    /// steppool, `Arena` strategy.
    SteppoolArena,
    /// steppool, `Planned` strategy.
    SteppoolPlanned,
}

impl Kind {
    /// Every allocator, slowest first.
    pub const ALL: [Kind; 7] = [
        Kind::CudaMalloc,
        Kind::DefaultPoolT0,
        Kind::DefaultPool,
        Kind::DriverPool,
        Kind::SteppoolPool,
        Kind::SteppoolArena,
        Kind::SteppoolPlanned,
    ];

    /// The name in records.
    pub fn name(self) -> &'static str {
        match self {
            Kind::CudaMalloc => "cuda_malloc",
            Kind::DefaultPoolT0 => "default_pool_t0",
            Kind::DefaultPool => "default_pool",
            Kind::DriverPool => "driver_pool",
            Kind::SteppoolPool => "steppool_pool",
            Kind::SteppoolArena => "steppool_arena",
            Kind::SteppoolPlanned => "steppool_planned",
        }
    }

    /// A fresh allocator of this kind on the benchmark driver, with its own stream (and, for
    /// steppool, its own runtime), inside a step.
    pub fn make(self) -> Result<Box<dyn Allocator>> {
        Ok(match self {
            Kind::CudaMalloc => Box::new(CudaMalloc::new()?),
            Kind::DefaultPoolT0 => Box::new(DriverPool::default_pool(0, "default_pool_t0")?),
            Kind::DefaultPool => Box::new(DriverPool::default_pool(u64::MAX, "default_pool")?),
            Kind::DriverPool => Box::new(DriverPool::own()?),
            Kind::SteppoolPool => Box::new(Steppool::new(Strategy::Direct, "steppool_pool")?),
            Kind::SteppoolArena => Box::new(Steppool::new(Strategy::ARENA, "steppool_arena")?),
            Kind::SteppoolPlanned => Box::new(Steppool::new(Strategy::PLANNED, "steppool_planned")?),
        })
    }
}

/// A runtime, its device's context current on this thread, and a stream: what every allocator
/// stands on (the driver allocators use only the context and the stream).
struct Base {
    runtime: Runtime,
    stream: Stream,
}

impl Base {
    fn new() -> Result<Self> {
        let runtime = runtime();
        let stream = runtime.device(0)?.create_stream()?;
        Ok(Self { runtime, stream })
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// `cuMemAlloc` / `cuMemFree`.
struct CudaMalloc {
    base: Base,
}

impl CudaMalloc {
    fn new() -> Result<Self> {
        Ok(Self { base: Base::new()? })
    }
}

impl Allocator for CudaMalloc {
    fn name(&self) -> &'static str {
        "cuda_malloc"
    }

    fn driver(&self) -> &Driver {
        self.base.runtime.driver()
    }

    fn stream(&self) -> CUstream {
        self.base.stream.raw()
    }

    fn alloc(&mut self, _id: u32, bytes: u64, _lifetime: Lifetime) -> Result<CUdeviceptr> {
        Ok(self.driver().mem_alloc(bytes as usize)?)
    }

    fn free(&mut self, _id: u32, ptr: CUdeviceptr) -> Result<()> {
        // cuMemFree assumes the memory is idle; cudaFree makes it so by synchronizing the device.
        self.base.synchronize()?;
        // SAFETY: `ptr` came from `mem_alloc` and the stream that used it is idle.
        unsafe { self.driver().mem_free(ptr) }?;
        Ok(())
    }

    fn end_step(&mut self) -> Result<Option<StepTimes>> {
        self.base.synchronize()?;
        Ok(None)
    }

    fn finish(&mut self) -> Result<()> {
        self.base.synchronize()
    }
}

/// A driver pool: the device's default one (threshold as given) or one of its own.
struct DriverPool {
    base: Base,
    pool: CUmemoryPool,
    own: bool,
    name: &'static str,
}

impl DriverPool {
    fn own() -> Result<Self> {
        let base = Base::new()?;
        let driver = base.runtime.driver().clone();
        let pool = driver.mem_pool_create(&PoolProps::device(0).build())?;
        let pool = Self { base, pool, own: true, name: "driver_pool" };
        pool.set_threshold(u64::MAX)?;
        Ok(pool)
    }

    fn default_pool(threshold: u64, name: &'static str) -> Result<Self> {
        let base = Base::new()?;
        let pool = base.runtime.driver().device_default_mem_pool(0)?;
        let pool = Self { base, pool, own: false, name };
        pool.set_threshold(threshold)?;
        Ok(pool)
    }

    fn set_threshold(&self, threshold: u64) -> Result<()> {
        let attribute = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        // SAFETY: the pool is live: the device's default pool, or ours until drop.
        unsafe { self.base.runtime.driver().mem_pool_set_attribute(self.pool, attribute, threshold) }?;
        Ok(())
    }
}

impl Allocator for DriverPool {
    fn name(&self) -> &'static str {
        self.name
    }

    fn driver(&self) -> &Driver {
        self.base.runtime.driver()
    }

    fn stream(&self) -> CUstream {
        self.base.stream.raw()
    }

    fn alloc(&mut self, _id: u32, bytes: u64, _lifetime: Lifetime) -> Result<CUdeviceptr> {
        let stream = self.stream();
        if self.own {
            // SAFETY: pool and stream are live.
            Ok(unsafe { self.driver().mem_alloc_from_pool_async(bytes as usize, self.pool, stream) }?)
        } else {
            // SAFETY: the stream is live; its device's current pool is the default one.
            Ok(unsafe { self.driver().mem_alloc_async(bytes as usize, stream) }?)
        }
    }

    fn free(&mut self, _id: u32, ptr: CUdeviceptr) -> Result<()> {
        let stream = self.stream();
        // SAFETY: `ptr` is a live allocation of this pool; the caller enqueues nothing after
        // this that uses it; the stream is live.
        unsafe { self.driver().mem_free_async(ptr, stream) }?;
        Ok(())
    }

    fn end_step(&mut self) -> Result<Option<StepTimes>> {
        self.base.synchronize()?;
        Ok(None)
    }

    fn finish(&mut self) -> Result<()> {
        self.base.synchronize()?;
        // SAFETY: the pool is live.
        unsafe { self.driver().mem_pool_trim_to(self.pool, 0) }?;
        Ok(())
    }
}

impl Drop for DriverPool {
    fn drop(&mut self) {
        let _ = self.base.synchronize();
        let driver = self.base.runtime.driver().clone();
        if self.own {
            // SAFETY: our pool; its allocations were freed and the stream is idle.
            let _ = unsafe { driver.mem_pool_destroy(self.pool) };
        } else {
            // Leave the default pool as the driver made it.
            let _ = self.set_threshold(0);
            // SAFETY: the default pool is always live.
            let _ = unsafe { driver.mem_pool_trim_to(self.pool, 0) };
        }
    }
}

/// steppool through its raw API: a persistent `Pool` phase and a step-scoped phase with the
/// strategy under test.
struct Steppool {
    base: Base,
    persistent: Phase,
    step: Phase,
    name: &'static str,
}

impl Steppool {
    fn new(strategy: Strategy, name: &'static str) -> Result<Self> {
        let base = Base::new()?;
        let persistent = base.runtime.declare_phase(PhaseSpec::new("bench_persistent", Scope::Persistent))?;
        let step = base.runtime.declare_phase(PhaseSpec::new("bench_step", Scope::Step).strategy(strategy))?;
        base.runtime.raw().begin_step()?;
        Ok(Self { base, persistent, step, name })
    }

    /// The runtime, for benchmarks that drive it directly.
    fn runtime(&self) -> &Runtime {
        &self.base.runtime
    }
}

impl Allocator for Steppool {
    fn name(&self) -> &'static str {
        self.name
    }

    fn driver(&self) -> &Driver {
        self.runtime().driver()
    }

    fn stream(&self) -> CUstream {
        self.base.stream.raw()
    }

    fn alloc(&mut self, _id: u32, bytes: u64, lifetime: Lifetime) -> Result<CUdeviceptr> {
        let phase = match lifetime {
            Lifetime::Persistent => self.persistent,
            Lifetime::Step => self.step,
        };
        // SAFETY: the replay uses the memory only in this stream's order, and not after it frees
        // it or (for step-lifetime allocations) after the step ends; the stream outlives it.
        Ok(unsafe { self.base.runtime.raw().alloc(phase, bytes, &self.base.stream) }?)
    }

    fn free(&mut self, _id: u32, ptr: CUdeviceptr) -> Result<()> {
        // SAFETY: the caller enqueues no work after this that uses the memory.
        unsafe { self.base.runtime.raw().free(ptr) }?;
        Ok(())
    }

    fn end_step(&mut self) -> Result<Option<StepTimes>> {
        self.base.synchronize()?;
        // SAFETY: the replay frees every step-lifetime allocation within its step and uses no
        // released pointer afterwards.
        let report = unsafe { self.base.runtime.raw().end_step() }?;
        self.base.runtime.raw().begin_step()?;
        Ok(Some(StepTimes::from(&report)))
    }

    fn finish(&mut self) -> Result<()> {
        self.base.synchronize()?;
        self.runtime().device(0)?.release_idle()?;
        Ok(())
    }
}

impl Drop for Steppool {
    fn drop(&mut self) {
        if self.base.runtime.active_step().is_some() {
            // SAFETY: nothing is used after the allocator goes.
            let _ = unsafe { self.base.runtime.raw().end_step() };
        }
    }
}

/// Every allocation of a sequence made once and kept, from a pool of its own: the floor of the
/// kernel-step benchmark, where allocation costs nothing. The first `alloc` of an id makes its
/// buffer; later ones hand the same buffer out again; `free` does nothing.
pub struct Preallocated {
    inner: DriverPool,
    buffers: Vec<CUdeviceptr>,
}

impl std::fmt::Debug for Preallocated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preallocated").field("buffers", &self.buffers.len()).finish()
    }
}

impl Preallocated {
    /// Room for the ids `0..allocations`.
    pub fn new(allocations: usize) -> Result<Self> {
        let mut inner = DriverPool::own()?;
        inner.name = "preallocated";
        Ok(Self { inner, buffers: vec![0; allocations] })
    }
}

impl Allocator for Preallocated {
    fn name(&self) -> &'static str {
        "preallocated"
    }

    fn driver(&self) -> &Driver {
        self.inner.driver()
    }

    fn stream(&self) -> CUstream {
        self.inner.stream()
    }

    fn alloc(&mut self, id: u32, bytes: u64, lifetime: Lifetime) -> Result<CUdeviceptr> {
        let slot = id as usize;
        if self.buffers[slot] == 0 {
            self.buffers[slot] = self.inner.alloc(id, bytes, lifetime)?;
        }
        Ok(self.buffers[slot])
    }

    fn free(&mut self, _id: u32, _ptr: CUdeviceptr) -> Result<()> {
        Ok(())
    }

    fn end_step(&mut self) -> Result<Option<StepTimes>> {
        self.inner.end_step()
    }

    fn finish(&mut self) -> Result<()> {
        self.inner.base.synchronize()
    }
}

impl Drop for Preallocated {
    fn drop(&mut self) {
        let stream = self.inner.stream();
        for &ptr in self.buffers.iter().filter(|&&ptr| ptr != 0) {
            // SAFETY: each buffer is a live allocation of the inner pool, freed once, after
            // which nothing uses it.
            let _ = unsafe { self.inner.driver().mem_free_async(ptr, stream) };
        }
    }
}
