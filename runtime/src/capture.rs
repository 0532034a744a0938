//! Captured steps: a step recorded as a CUDA graph once its plan is packed, and relaunched with
//! no allocator work at all.
//!
//! [`Step::capture`] begins capturing `stream`. In [`CaptureMemory::PlanSlab`] mode (the
//! default), every named phase must be planned and have a packed plan (from its second step, or
//! after a loaded plan): before the capture begins, the phase's planned strategy lends its own
//! slab, holding the plan, to the capture, and allocation *i* of the captured step is served at
//! planned offset *i* of that slab — an index lookup, no driver call. Anything the plan does not
//! cover (an extra allocation, a larger size, a planned range still held by a live allocation) is
//! a [`CaptureError::Deviation`]: the capture is ended, the slabs go back, and the caller runs
//! the step eagerly. [`StepCapture::end`] ends the capture and instantiates the graph; the
//! [`CapturedStep`] holds the graph executable and the slabs for its life, so every
//! [`CapturedStep::launch`] replays the step at the same addresses without allocator code. The
//! slabs go back (stream-ordered, after the last launch) when it is dropped.
//!
//! # The lent slab
//!
//! The slab a captured step holds is the one its phase's eager planned steps are served from,
//! lent for the executable's life (`Allocator::lend_slab`), so a captured run reserves what an
//! eager planned run does, not a second plan beside it. While it is lent the strategy neither
//! resizes, unmaps, frees nor moves it (a step end, a trim or out-of-memory recovery leaves it
//! alone), takes no other slab beside it, and hands none of it out: an eager step of the phase
//! between launches is served apart, from the strategy's fallback chunks, which go back at its
//! end. The graph may run between any two of that step's allocations, and what the graph leaves
//! live after a launch is the step's until it ends, so sharing the slab would need the strategy
//! to know the launches; eager steps between launches are the exception in a captured loop, and
//! pay the chunks for the step instead. Dropping the captured step gives the slab back to the
//! strategy (no driver call: nothing can fail or be owed), which serves from it again in the
//! stream's order, after the last launch. A step end while a slab is lent is an ordinary step end
//! for the rest of the phase; a phase's spec cannot change while it has a pool
//! ([`Error::PhaseInUse`]); and a lent slab holds its pool, its stream
//! and the runtime's state alive, so dropping the [`Runtime`](crate::Runtime) or the
//! [`Stream`] while a captured step lives defers their release until the captured step goes,
//! and it can still launch meanwhile.
//!
//! When the strategy cannot lend its slab — it is lent to another captured step of the phase
//! already, or an allocation made before the capture in the same step lives in it — the capture
//! takes a slab of its own from the pool beside the strategy's, as large as the plan
//! ([`CapturedStep::slab_lent`] says which), given back with a stream-ordered free when the
//! captured step goes (a refused free is owed by the pool and retried, as elsewhere).
//!
//! In [`CaptureMemory::GraphNodes`] mode the driver's own graph memory nodes serve the capture:
//! each allocation is `cuMemAllocFromPoolAsync` on the capturing stream (an allocation node,
//! owned by the device's graph memory pool), each [`StepCapture::free`] a free node; what the step
//! leaves unfreed is freed at the next launch (the graph is instantiated with
//! auto-free-on-launch) or when the captured step is dropped, after which the graph memory is
//! trimmed (`cuDeviceGraphMemTrim`).
//!
//! Around a capture the rest of the runtime is capture-aware (`inner.rs`, `source.rs`): it asks
//! the stream whether it captures at every allocation, driver free and boundary; during a capture
//! it never synchronizes, queries, trims or retries after running out of memory; a driver free of
//! memory allocated before the capture is deferred until the stream no longer captures; an
//! allocation or boundary it cannot serve safely ends the capture and returns
//! [`CaptureError::Unsafe`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use steppool_sys::{CUdeviceptr, CUgraph, CUgraphExec, CUgraphInstantiate_flags, CUstreamCaptureMode};

use crate::error::{CaptureError, Error, Result};
use crate::inner::RuntimeInner;
use crate::phase::{ALIGNMENT, Phase, Strategy};
use crate::pool::PhasePool;
use crate::step::Step;
use crate::stream::Stream;
use crate::stream_core::StreamCore;
use crate::telemetry::EventKind;

/// How a captured step's allocations are served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureMemory {
    /// At the offsets of each phase's packed plan, in a slab taken before the capture and held
    /// by the graph executable for its life: relaunches run no allocator code and the memory is
    /// the pool's (its counters show it).
    #[default]
    PlanSlab,
    /// The driver's graph memory nodes: allocations become graph allocations owned by the
    /// device's graph memory pool, trimmed with `cuDeviceGraphMemTrim` when the captured step
    /// goes.
    GraphNodes,
}

/// The capture mode (`CUstreamCaptureMode`): which other calls the capture forbids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureMode {
    /// Potentially unsafe calls (`cuMemAlloc`, ...) are refused on this thread, and on other
    /// threads in global mode.
    #[default]
    Global,
    /// Potentially unsafe calls are refused on this thread only.
    ThreadLocal,
    /// Nothing is refused; the capture may end on another thread.
    Relaxed,
}

impl CaptureMode {
    fn raw(self) -> CUstreamCaptureMode {
        match self {
            Self::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            Self::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            Self::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// One phase's part of a capture in plan-slab mode.
#[derive(Debug)]
struct Server {
    pool: Arc<PhasePool>,
    slab: CUdeviceptr,
    slab_bytes: u64,
    /// The slab is the strategy's, lent; otherwise the capture took it beside.
    lent: bool,
    sizes: Vec<u64>,
    offsets: Vec<u64>,
    /// The next entry to hand out.
    cursor: usize,
    /// Entries handed out and not freed: `(offset, size)`.
    live: Vec<(u64, u64)>,
}

/// A slab a captured step holds: given back to its pool when the step goes.
#[derive(Debug)]
struct Slab {
    pool: Arc<PhasePool>,
    ptr: CUdeviceptr,
    bytes: u64,
    /// The strategy's slab, lent (see the [module docs](self)); otherwise taken beside it.
    lent: bool,
}

impl Slab {
    /// Gives the slab back: to the strategy that lent it, or to the pool, stream-ordered.
    fn give_back(&self) -> Result<()> {
        let mut guard = self.pool.lock();
        if self.lent { guard.take_back_slab(self.ptr).map(drop) } else { guard.give_slab(self.ptr, self.bytes) }
    }
}

#[derive(Debug, Default)]
struct Progress {
    servers: Vec<(Phase, Server)>,
    /// Graph-node allocations not freed in the graph (graph-nodes mode).
    unfreed: Vec<CUdeviceptr>,
    /// Allocations served, for the report.
    allocations: u64,
    ended: bool,
}

/// A step being captured on a stream; see the [module docs](self). Borrowing the [`Step`], it
/// ends before the step does. Dropped without [`StepCapture::end`], it ends the capture and
/// gives the slabs back.
pub struct StepCapture<'s> {
    runtime: Arc<RuntimeInner>,
    stream: Arc<StreamCore>,
    memory: CaptureMemory,
    phases: Vec<(Phase, Arc<PhasePool>)>,
    progress: Mutex<Progress>,
    _step: PhantomData<&'s Step>,
}

impl fmt::Debug for StepCapture<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepCapture").field("stream", &self.stream.id).field("memory", &self.memory).finish()
    }
}

/// An allocation of a captured step: a pointer valid in the graph, at the same address at every
/// launch. It borrows the capture; dropping it frees nothing (the slab or the graph owns the
/// memory); [`StepCapture::free`] records its free in the step.
#[derive(Debug)]
pub struct CapturedBuffer<'c> {
    ptr: CUdeviceptr,
    bytes: u64,
    phase: Phase,
    _capture: PhantomData<&'c ()>,
}

impl CapturedBuffer<'_> {
    /// The device pointer.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Bytes requested.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Always false: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Its phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }
}

impl Step {
    /// Begins capturing the rest of this step on `stream` as a CUDA graph, serving allocations of
    /// `phases` as `memory` says (see [`capture`](crate::capture)). In plan-slab mode each phase
    /// must be planned with a packed plan ([`CaptureError::NoPlan`] otherwise), and its slab is
    /// taken now, before the capture begins. The stream must not be capturing already.
    pub fn capture(
        &self,
        stream: &Stream,
        phases: &[Phase],
        memory: CaptureMemory,
        mode: CaptureMode,
    ) -> Result<StepCapture<'_>> {
        let runtime = self.runtime().clone();
        let core = stream.core.clone();
        core.refuse_capture("capture begin")?;
        let mut pools = Vec::with_capacity(phases.len());
        for &phase in phases {
            pools.push((phase, runtime.pool(&core, &stream.pools, phase)?.clone()));
        }
        let mut progress = Progress::default();
        if memory == CaptureMemory::PlanSlab {
            for (phase, pool) in &pools {
                let give_back = |progress: &mut Progress| release_servers(progress);
                let name = || pool.spec().name.clone();
                if !matches!(pool.spec().strategy, Strategy::Planned { .. }) {
                    give_back(&mut progress);
                    return Err(CaptureError::NoPlan { phase: name() }.into());
                }
                let mut guard = pool.lock();
                let Some(view) = guard.plan_view().filter(|view| view.bytes > 0) else {
                    drop(guard);
                    give_back(&mut progress);
                    return Err(CaptureError::NoPlan { phase: name() }.into());
                };
                // The strategy's slab, lent for the executable's life; a slab of its own beside
                // it when the strategy cannot lend it (lent already, or in use in this step).
                let taken = match guard.lend_slab(view.bytes) {
                    Ok(Some(slab)) => Ok((slab, true)),
                    Ok(None) => guard.take_slab(view.bytes).map(|slab| (slab, false)),
                    Err(error) => Err(error),
                };
                let (slab, lent) = match taken {
                    Ok(taken) => taken,
                    Err(error) => {
                        drop(guard);
                        give_back(&mut progress);
                        return Err(error);
                    }
                };
                let server = Server {
                    pool: pool.clone(),
                    slab,
                    slab_bytes: view.bytes,
                    lent,
                    sizes: view.sizes,
                    offsets: view.offsets,
                    cursor: 0,
                    live: Vec::new(),
                };
                progress.servers.push((*phase, server));
            }
        }
        core.prepare()?;
        // SAFETY: the stream is live while its core is.
        if let Err(error) = unsafe { runtime.driver.stream_begin_capture(core.raw(), mode.raw()) } {
            release_servers(&mut progress);
            return Err(error.into());
        }
        runtime.hub.captures_begun.fetch_add(1, Ordering::Relaxed);
        Ok(StepCapture {
            runtime,
            stream: core,
            memory,
            phases: pools,
            progress: Mutex::new(progress),
            _step: PhantomData,
        })
    }
}

/// Gives back the slabs of a capture that will not become a captured step.
fn release_servers(progress: &mut Progress) {
    for (_, server) in progress.servers.drain(..) {
        let slab = Slab { pool: server.pool, ptr: server.slab, bytes: server.slab_bytes, lent: server.lent };
        if let Err(error) = slab.give_back() {
            slab.pool.errors().record(error);
        }
    }
}

impl<'s> StepCapture<'s> {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Allocates `bytes` of `phase` inside the captured step. A deviation from the plan ends the
    /// capture ([`CaptureError::Deviation`]); the caller runs the step eagerly.
    pub fn alloc(&self, phase: Phase, bytes: u64) -> Result<CapturedBuffer<'_>> {
        let mut progress = self.progress();
        if progress.ended {
            return Err(CaptureError::Ended.into());
        }
        let served = match self.memory {
            CaptureMemory::PlanSlab => Self::serve_from_plan(&mut progress, phase, bytes, &self.phases),
            CaptureMemory::GraphNodes => self.serve_from_graph(&mut progress, phase, bytes),
        };
        match served {
            Ok(ptr) => {
                progress.allocations += 1;
                Ok(CapturedBuffer { ptr, bytes, phase, _capture: PhantomData })
            }
            Err(error) => {
                self.abort(&mut progress);
                Err(error)
            }
        }
    }

    fn serve_from_plan(
        progress: &mut Progress,
        phase: Phase,
        bytes: u64,
        phases: &[(Phase, Arc<PhasePool>)],
    ) -> Result<CUdeviceptr> {
        let name = || phases.iter().find(|(p, _)| *p == phase).map(|(_, pool)| pool.spec().name.clone());
        let Some((_, server)) = progress.servers.iter_mut().find(|(p, _)| *p == phase) else {
            return Err(CaptureError::PhaseNotCaptured {
                phase: name().unwrap_or_else(|| format!("#{}", phase.index())),
            }
            .into());
        };
        let index = server.cursor;
        let size = bytes.next_multiple_of(ALIGNMENT);
        let planned = server.sizes.get(index).copied();
        let deviation =
            || CaptureError::Deviation { phase: server.pool.spec().name.clone(), index, requested: bytes, planned };
        let Some(planned_size) = planned else { return Err(deviation().into()) };
        let offset = server.offsets[index];
        let overlaps = server.live.iter().any(|&(o, s)| o < offset + size && offset < o + s);
        if size == 0 || size > planned_size || overlaps {
            return Err(deviation().into());
        }
        server.cursor += 1;
        server.live.push((offset, size));
        Ok(server.slab + offset)
    }

    fn serve_from_graph(&self, progress: &mut Progress, phase: Phase, bytes: u64) -> Result<CUdeviceptr> {
        let Some((_, pool)) = self.phases.iter().find(|(p, _)| *p == phase) else {
            return Err(CaptureError::PhaseNotCaptured { phase: self.runtime.phase_name(phase) }.into());
        };
        let Some(handle) = pool.handle() else {
            return Err(CaptureError::NoPlan { phase: pool.spec().name.clone() }.into());
        };
        // SAFETY: the pool and the stream are live while the capture holds them; under capture
        // this records an allocation node.
        let ptr = unsafe { self.runtime.driver.mem_alloc_from_pool_async(bytes as usize, handle, self.stream.raw()) }?;
        progress.unfreed.push(ptr);
        Ok(ptr)
    }

    /// Frees a captured allocation inside the step: in plan-slab mode its range may be handed out
    /// again by a later entry; in graph-nodes mode it records a free node.
    pub fn free(&self, buffer: CapturedBuffer<'_>) -> Result<()> {
        let mut progress = self.progress();
        if progress.ended {
            return Err(CaptureError::Ended.into());
        }
        match self.memory {
            CaptureMemory::PlanSlab => {
                if let Some((_, server)) = progress.servers.iter_mut().find(|(p, _)| *p == buffer.phase) {
                    let offset = buffer.ptr - server.slab;
                    server.live.retain(|&(o, _)| o != offset);
                }
                Ok(())
            }
            CaptureMemory::GraphNodes => {
                // SAFETY: a graph allocation of this capture, freed once (the buffer is consumed).
                let freed = unsafe { self.runtime.driver.mem_free_async(buffer.ptr, self.stream.raw()) };
                match freed {
                    Ok(()) => {
                        progress.unfreed.retain(|&p| p != buffer.ptr);
                        Ok(())
                    }
                    Err(error) => {
                        self.abort(&mut progress);
                        Err(error.into())
                    }
                }
            }
        }
    }

    /// Ends the capture without a graph and gives the slabs back.
    fn abort(&self, progress: &mut Progress) {
        if progress.ended {
            return;
        }
        progress.ended = true;
        // SAFETY: the stream is live while its core is.
        if let Ok(graph) = unsafe { self.runtime.driver.stream_end_capture(self.stream.raw()) } {
            // SAFETY: just returned by the driver; nobody else has it.
            let _ = unsafe { self.runtime.driver.graph_destroy(graph) };
        }
        progress.unfreed.clear();
        release_servers(progress);
        self.runtime.hub.captures_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the capture and instantiates the graph. The step's work is not run yet: launch the
    /// [`CapturedStep`] (in this step and the following ones).
    pub fn end(self) -> Result<CapturedStep> {
        let mut progress = self.progress();
        if progress.ended {
            return Err(CaptureError::Ended.into());
        }
        progress.ended = true;
        let driver = &self.runtime.driver;
        // SAFETY: the stream is live while its core is.
        let graph = match unsafe { driver.stream_end_capture(self.stream.raw()) } {
            Ok(graph) => graph,
            Err(error) => {
                release_servers(&mut progress);
                self.runtime.hub.captures_failed.fetch_add(1, Ordering::Relaxed);
                let invalidated = error.code() == Some(steppool_sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
                return Err(if invalidated {
                    CaptureError::Invalidated { stream: self.stream.id, id: 0 }.into()
                } else {
                    error.into()
                });
            }
        };
        let flags = if progress.unfreed.is_empty() {
            0
        } else {
            CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64
        };
        // SAFETY: the graph was just captured.
        let exec = match unsafe { driver.graph_instantiate(graph, flags) } {
            Ok(exec) => exec,
            Err(error) => {
                // SAFETY: as above; nobody else has it.
                let _ = unsafe { driver.graph_destroy(graph) };
                release_servers(&mut progress);
                return Err(error.into());
            }
        };
        let slabs = progress
            .servers
            .drain(..)
            .map(|(_, server)| Slab {
                pool: server.pool,
                ptr: server.slab,
                bytes: server.slab_bytes,
                lent: server.lent,
            })
            .collect();
        Ok(CapturedStep {
            runtime: self.runtime.clone(),
            stream: self.stream.clone(),
            memory: self.memory,
            graph,
            exec,
            slabs,
            unfreed: std::mem::take(&mut progress.unfreed),
            allocations: progress.allocations,
            launched: Mutex::new(false),
        })
    }
}

impl Drop for StepCapture<'_> {
    fn drop(&mut self) {
        let mut progress = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
        if !progress.ended {
            self.abort(&mut progress);
        }
    }
}

/// A captured step: a graph executable and the slabs its allocations live in, relaunched with
/// [`CapturedStep::launch`] at the same addresses with no allocator work. Dropping it destroys
/// the executable and gives the slabs back in the stream's order (after its last launch).
pub struct CapturedStep {
    runtime: Arc<RuntimeInner>,
    stream: Arc<StreamCore>,
    memory: CaptureMemory,
    graph: CUgraph,
    exec: CUgraphExec,
    slabs: Vec<Slab>,
    /// Graph-node allocations the graph leaves live after a launch (graph-nodes mode).
    unfreed: Vec<CUdeviceptr>,
    allocations: u64,
    /// Whether it was launched at least once (its unfreed allocations are then live).
    launched: Mutex<bool>,
}

// SAFETY: the graph and executable handles are opaque driver handles, valid from any thread;
// the driver serializes calls on one executable (one launch at a time is the caller's duty,
// which `launch` takes `&self` for but orders on one stream).
unsafe impl Send for CapturedStep {}
// SAFETY: as above; `launched` is behind a mutex.
unsafe impl Sync for CapturedStep {}

impl fmt::Debug for CapturedStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CapturedStep")
            .field("stream", &self.stream.id)
            .field("memory", &self.memory)
            .field("allocations", &self.allocations)
            .field("slab_bytes", &self.slab_bytes())
            .finish()
    }
}

impl CapturedStep {
    /// Runs the captured step on its stream: no allocator code runs. Counted in the active
    /// step's report ([`StepReport::graph_launches`](crate::StepReport::graph_launches)).
    pub fn launch(&self) -> Result<()> {
        self.stream.prepare()?;
        // SAFETY: the executable and the stream are live while this captured step is; the slabs
        // its work uses are held until it is dropped.
        unsafe { self.runtime.driver.graph_launch(self.exec, self.stream.raw()) }?;
        *self.launched.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.runtime.hub.graph_launches.fetch_add(1, Ordering::Relaxed);
        let recorder = &self.runtime.hub.recorder;
        recorder.record(EventKind::GraphLaunch {
            device: self.stream.device.ordinal,
            stream: self.stream.id,
            step: recorder.step(),
        });
        Ok(())
    }

    /// How the step's allocations are served.
    pub fn memory(&self) -> CaptureMemory {
        self.memory
    }

    /// Allocations the captured step makes at each launch.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Bytes of slab it holds (plan-slab mode), counted in its phases' pools.
    pub fn slab_bytes(&self) -> u64 {
        self.slabs.iter().map(|slab| slab.bytes).sum()
    }

    /// Whether every slab it holds is its phase's planned slab, lent by the strategy for its
    /// life, so that it reserves nothing beside what eager planned steps reserve (plan-slab mode;
    /// see [the lent slab](self#the-lent-slab)). False in graph-nodes mode, and when a phase's
    /// slab could not be lent and the capture took one of its own.
    pub fn slab_lent(&self) -> bool {
        !self.slabs.is_empty() && self.slabs.iter().all(|slab| slab.lent)
    }

    /// The id of the stream it launches on.
    pub fn stream_id(&self) -> u32 {
        self.stream.id
    }

    fn release(&mut self) -> Result<()> {
        let driver = &self.runtime.driver;
        let mut first: Result<()> = Ok(());
        let mut note = |result: Result<()>| {
            if first.is_ok() {
                first = result;
            }
        };
        note(self.stream.prepare());
        let launched = *self.launched.lock().unwrap_or_else(PoisonError::into_inner);
        if launched {
            for ptr in self.unfreed.drain(..) {
                // SAFETY: a graph allocation the last launch left live; freed once, after the
                // launches in stream order.
                note(unsafe { driver.mem_free_async(ptr, self.stream.raw()) }.map_err(Error::from));
            }
        }
        // SAFETY: the executable and graph are not used after this.
        note(unsafe { driver.graph_exec_destroy(self.exec) }.map_err(Error::from));
        // SAFETY: as above.
        note(unsafe { driver.graph_destroy(self.graph) }.map_err(Error::from));
        // After the executable: nothing can launch on the slabs any more.
        for slab in self.slabs.drain(..) {
            note(slab.give_back());
        }
        if self.memory == CaptureMemory::GraphNodes && self.stream.capture().ok().flatten().is_none() {
            note(driver.device_graph_mem_trim(self.stream.device.ordinal as i32).map_err(Error::from));
        }
        first
    }
}

impl Drop for CapturedStep {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            self.runtime.errors.record(error);
        }
    }
}
