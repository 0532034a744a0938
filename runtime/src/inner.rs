//! The runtime's state and what it does with it: the path of an allocation with its
//! out-of-memory recovery, and the step and micro-step boundaries that release step-scoped
//! memory at once. The public handles ([`Runtime`](crate::Runtime), [`Device`](crate::Device),
//! [`Step`](crate::Step), ...) hold an `Arc` of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use steppool_sys::Driver;

use crate::control::Control;
use crate::device_core::DeviceCore;
use crate::error::{Error, ErrorSink, OomReport, PoolUsage, Result};
use crate::hub::Hub;
use crate::phase::{Phase, Scope};
use crate::pool::{PhasePool, PoolGuard, PoolSinks, PoolSlots, StepPools};
use crate::raw_table::RawTable;
use crate::registry::Registry;
use crate::report::{MicroStepReport, PoolStats, StepReport};
use crate::strategy::Served;
use crate::stream_core::StreamCore;
use crate::telemetry::{DeviceMemory, EventKind, History, Metrics};

/// Where an allocation request comes from; decides which scopes it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// [`Runtime::alloc`](crate::Runtime::alloc): persistent phases.
    Runtime,
    /// [`Step::alloc`](crate::Step::alloc): step-scoped phases.
    Step,
    /// [`MicroStep::alloc`](crate::MicroStep::alloc): step- and micro-step-scoped phases.
    MicroStep,
    /// The raw API: any scope, while that scope is active.
    Raw,
}

static NEXT_RUNTIME: AtomicU64 = AtomicU64::new(1);

/// The shared state of a runtime.
#[derive(Debug)]
pub(crate) struct RuntimeInner {
    /// Unique in the process, never reused: streams carry it to refuse other runtimes.
    pub(crate) id: u64,
    pub(crate) driver: Driver,
    pub(crate) registry: Registry,
    pub(crate) control: Control,
    pub(crate) raw: RawTable,
    pub(crate) hub: Hub,
    pub(crate) errors: Arc<ErrorSink>,
    /// The pools the active step's buffers borrow, held until it ends.
    pub(crate) step_pools: StepPools,
}

impl RuntimeInner {
    pub(crate) fn new(driver: Driver, checked: bool) -> Result<Self> {
        // Calibrating the clock takes up to a few hundred milliseconds: here, not in the first
        // allocation.
        crate::telemetry::clock();
        let count = driver.device_count()?;
        Ok(Self {
            id: NEXT_RUNTIME.fetch_add(1, Ordering::Relaxed),
            driver,
            registry: Registry::new(count),
            control: Control::default(),
            raw: RawTable::new(checked),
            hub: Hub::default(),
            errors: Arc::default(),
            step_pools: StepPools::default(),
        })
    }

    pub(crate) fn device(&self, ordinal: usize) -> Result<Arc<DeviceCore>> {
        self.registry.device(&self.driver, ordinal)
    }

    /// The pool of `phase` on a stream, created on first use.
    #[inline]
    pub(crate) fn pool<'s>(
        &self,
        stream: &Arc<StreamCore>,
        slots: &'s PoolSlots,
        phase: Phase,
    ) -> Result<&'s Arc<PhasePool>> {
        if stream.runtime != self.id {
            return Err(Error::ForeignStream);
        }
        let sinks = || PoolSinks {
            errors: self.errors.clone(),
            recorder: self.hub.recorder.clone(),
            retired: self.hub.retired.clone(),
        };
        // A step in progress measures the new pool from its creation.
        let created = |pool: &PhasePool| if self.control.step_active() { pool.lock().begin_step() } else { Ok(()) };
        self.registry.pool(stream, slots, phase, sinks, created)
    }

    // ----- the path of an allocation ---------------------------------------------------------

    /// Allocates from the pool of (stream, `phase`) for `caller`, recovering once from
    /// out-of-memory: every pool of the device gives back what its live allocations do not need
    /// (the failing one too: a planned slab's free pages, empty chunks), the device is
    /// synchronized and its pools trimmed, and the allocation is tried again.
    /// Returns the pool, borrowed from `slots`, and the allocation.
    #[inline]
    pub(crate) fn allocate<'s>(
        &self,
        phase: Phase,
        bytes: u64,
        stream: &Arc<StreamCore>,
        slots: &'s PoolSlots,
        caller: Caller,
    ) -> Result<(&'s Arc<PhasePool>, Served)> {
        self.errors.guard(|| self.allocate_checked(phase, bytes, stream, slots, caller))
    }

    #[inline]
    fn allocate_checked<'s>(
        &self,
        phase: Phase,
        bytes: u64,
        stream: &Arc<StreamCore>,
        slots: &'s PoolSlots,
        caller: Caller,
    ) -> Result<(&'s Arc<PhasePool>, Served)> {
        // Under a capture the runtime does not own, an allocation it served would be reused by
        // the graph's relaunches behind its back; it ends the capture instead (`capture.rs`).
        // Asked first: a stream's first allocation in a phase creates its pool, and the driver
        // refuses `cuMemPoolCreate` during a global capture (measured on an H200, driver
        // 580.159.04), invalidating it.
        stream.refuse_capture("allocation")?;
        let pool = self.pool(stream, slots, phase)?;
        let spec = pool.spec();
        let allowed = matches!(
            (spec.scope, caller),
            (Scope::Persistent, Caller::Runtime | Caller::Raw)
                | (Scope::Step, Caller::Step | Caller::MicroStep | Caller::Raw)
                | (Scope::MicroStep, Caller::MicroStep | Caller::Raw)
        );
        if !allowed {
            let from = match spec.scope {
                Scope::Persistent => "the Runtime",
                Scope::Step => "a Step",
                Scope::MicroStep => "a MicroStep",
            };
            return Err(Error::PhaseScope { phase: spec.name.clone(), scope: spec.scope, from });
        }
        if bytes == 0 {
            return Err(Error::ZeroSize { phase: spec.name.clone() });
        }
        let device = &stream.device;
        if bytes > device.total_memory {
            return Err(Error::ExceedsDevice {
                requested: bytes,
                phase: spec.name.clone(),
                device: device.ordinal,
                device_total: device.total_memory,
            });
        }
        let raw = caller == Caller::Raw;
        match self.try_allocate(pool, bytes, raw) {
            Ok(ptr) => Ok((pool, ptr)),
            Err(Error::Driver(error)) if error.is_out_of_memory() => {
                self.recover(pool, bytes, raw).map(|ptr| (pool, ptr))
            }
            Err(other) => Err(other),
        }
    }

    /// [`RuntimeInner::allocate`] after the pool ran out of memory: the device's pools give
    /// back what they can and the allocation is tried once more. Kept off the path of every
    /// allocation, so that the first try is inlined into it.
    #[cold]
    #[inline(never)]
    fn recover(&self, pool: &Arc<PhasePool>, bytes: u64, raw: bool) -> Result<Served> {
        self.trim_device(pool.device_ordinal())?;
        match self.try_allocate(pool, bytes, raw) {
            Ok(ptr) => {
                self.hub.oom_recoveries.fetch_add(1, Ordering::Relaxed);
                pool.lock().note_oom(true);
                Ok(ptr)
            }
            Err(Error::Driver(error)) if error.is_out_of_memory() => {
                pool.lock().note_oom(false);
                let report = self.oom_report(pool, bytes)?;
                let device_free = report.device_free;
                self.hub.recorder.record(EventKind::Oom { pool: pool.id(), bytes, device_free });
                Err(Error::OutOfMemory(Box::new(report)))
            }
            Err(other) => Err(other),
        }
    }

    #[inline(always)]
    fn try_allocate(&self, pool: &Arc<PhasePool>, bytes: u64, raw: bool) -> Result<Served> {
        let mut guard = pool.lock();
        if raw {
            // Under the pool's lock: an allocation either lands before the release (and is
            // released) or is refused.
            self.control.admit_raw(pool.scope())?;
        }
        let served = guard.allocate(bytes)?;
        if raw {
            guard.insert_raw(served, bytes);
            self.raw.register(served.ptr, bytes, pool);
        }
        Ok(served)
    }

    /// Gives back the idle memory of every pool on `device`: strategies first return what their
    /// scope has not touched or no longer needs (an arena's spare slabs, empty chunks, a planned
    /// slab's free pages) to their CUDA pools or the device, the device is synchronized so every
    /// free is complete, then every pool is trimmed. Returns the bytes released to the device.
    pub(crate) fn trim_device(&self, device: usize) -> Result<u64> {
        let pools: Vec<Arc<PhasePool>> = self.registry.pools_on(device);
        // Never synchronize while a stream captures: that would invalidate the capture.
        for pool in &pools {
            pool.stream.refuse_capture("device trim")?;
        }
        for pool in &pools {
            pool.lock().release_unused()?;
        }
        self.device(device)?.make_current()?;
        self.driver.context_synchronize()?;
        let mut released = 0;
        for pool in &pools {
            released += pool.lock().release_idle()?;
        }
        Ok(released)
    }

    fn oom_report(&self, failing: &Arc<PhasePool>, bytes: u64) -> Result<OomReport> {
        let device = &failing.stream.device;
        device.make_current()?;
        let (device_free, device_total) = self.driver.mem_get_info()?;
        let mut pools = Vec::new();
        for pool in self.registry.pools_on(device.ordinal) {
            let stats = pool.lock().stats()?;
            pools.push(PoolUsage {
                pool: stats.pool,
                phase: stats.phase_name,
                reserved: stats.reserved,
                used: stats.used,
                largest_free: stats.free_space.map(|space| space.largest_free),
            });
        }
        let verdict = OomReport::judge(bytes, device_free, &pools);
        Ok(OomReport {
            requested: bytes,
            pool: failing.id(),
            phase: failing.spec().name.clone(),
            step: self.hub.recorder.step().or_else(|| self.control.active_step_unlocked()),
            device_free,
            device_total,
            pools,
            verdict,
        })
    }

    // ----- boundaries ------------------------------------------------------------------------

    pub(crate) fn begin_step(&self, guarded: bool) -> Result<u64> {
        self.errors.guard(|| self.begin_step_checked(guarded))
    }

    fn begin_step_checked(&self, guarded: bool) -> Result<u64> {
        let mut steps = self.control.lock();
        steps.check_begin()?;
        let pools = self.registry.pools();
        for pool in &pools {
            pool.lock().begin_step()?;
        }
        // No step is active: nothing of a step- or micro-step-scoped pool lives in a bin.
        lend_tails(&pools);
        let index = steps.begin(&self.control, guarded);
        self.hub.recorder.set_step(Some(index));
        self.hub.recorder.record(EventKind::StepBegin { step: index });
        Ok(index)
    }

    pub(crate) fn begin_micro_step(&self, guarded: bool) -> Result<(u64, u32)> {
        self.errors.check()?;
        let mut steps = self.control.lock();
        let (step, micro) = steps.begin_micro(&self.control, guarded)?;
        self.hub.recorder.record(EventKind::MicroBegin { step, micro });
        Ok((step, micro))
    }

    /// Ends the active micro-step. `guarded` says whether a [`MicroStep`](crate::MicroStep) guard
    /// asks; the raw API may not end a guard's micro-step.
    pub(crate) fn end_micro_step(&self, guarded: bool) -> Result<MicroStepReport> {
        self.errors.guard(|| self.end_micro_step_checked(guarded))
    }

    fn end_micro_step_checked(&self, guarded: bool) -> Result<MicroStepReport> {
        let mut steps = self.control.lock();
        let (step, micro) = steps.end_micro(&self.control, guarded)?;
        let started = Instant::now();
        let released = self.release(&[Scope::MicroStep], step.index)?;
        let release_time = started.elapsed();
        step.release_time += release_time;
        self.hub.recorder.record(EventKind::MicroEnd { step: step.index, micro: micro.index });
        Ok(MicroStepReport {
            step: step.index,
            index: micro.index,
            duration: micro.started.elapsed(),
            release_time,
            released,
        })
    }

    /// Ends the active step, and its micro-step if one is still active.
    pub(crate) fn end_step(&self, guarded: bool) -> Result<StepReport> {
        self.errors.guard(|| self.end_step_checked(guarded))
    }

    fn end_step_checked(&self, guarded: bool) -> Result<StepReport> {
        let mut steps = self.control.lock();
        let mut step = steps.end(&self.control, guarded)?;
        // The step's buffers are gone (its guard ends it only once nothing borrows it): the pools
        // they borrowed may go, after the release.
        let _borrowed = self.step_pools.take();
        let started = Instant::now();
        let released = self.release(&[Scope::MicroStep, Scope::Step], step.index);
        step.release_time += started.elapsed();
        self.hub.recorder.set_step(None);
        self.hub.recorder.record(EventKind::StepEnd { step: step.index });
        self.hub.steps_ended.fetch_add(1, Ordering::Relaxed);
        released?;
        let pools = self.pool_stats()?;
        let mut report = StepReport::new(
            step.index,
            step.started.elapsed(),
            step.release_time,
            step.micro_steps,
            pools,
            self.errors.len(),
        );
        report.graph_launches = self.hub.graph_launches.swap(0, Ordering::Relaxed);
        if self.hub.captures_begun.load(Ordering::Relaxed) > 0 {
            for core in self.registry.open_devices() {
                let counters = self.driver.device_graph_mem_counters(core.ordinal as i32)?;
                self.hub.recorder.record(EventKind::GraphMemory {
                    device: core.ordinal,
                    reserved: counters.reserved,
                    used: counters.used,
                });
                report.graph_memory.add(&counters);
            }
        }
        let memory = |ordinal: usize| {
            let core = self.registry.opened(ordinal)?;
            core.make_current().ok()?;
            self.driver.mem_get_info().ok()
        };
        report.warnings = self.hub.evaluate(&report, &memory);
        drop(steps);
        self.hub.dispatch(&report.warnings, &self.errors);
        Ok(report)
    }

    /// Releases every pool of the given scopes at once: all their locks are taken (in registry
    /// order) before anything is released and given back after, so no allocation or statistic
    /// sees the release half done. Returns the bytes released.
    fn release(&self, scopes: &[Scope], step: u64) -> Result<u64> {
        let pools: Vec<Arc<PhasePool>> =
            self.registry.pools().into_iter().filter(|pool| scopes.contains(&pool.scope())).collect();
        let mut first_error = None;
        // A release frees and trims on each pool's stream: a capture still open on one is ended
        // first (its graph is lost, the error says so), so the release never invalidates it.
        let mut asked = Vec::new();
        for pool in &pools {
            if !asked.contains(&pool.stream.id) {
                asked.push(pool.stream.id);
                if let Err(error) = pool.stream.end_any_capture("step end") {
                    first_error.get_or_insert(error);
                }
            }
        }
        let mut guards: Vec<PoolGuard<'_>> = pools.iter().map(|pool| pool.lock()).collect();
        let mut total = 0;
        for guard in &mut guards {
            let released = guard.end_scope();
            total += released.bytes;
            self.raw.forget(guard, &released.raw, Some(step));
            if let Some(error) = released.error {
                first_error.get_or_insert(error);
            }
        }
        drop(guards);
        match first_error {
            Some(error) => Err(error),
            None => Ok(total),
        }
    }

    // ----- what it tells -----------------------------------------------------------------------

    /// The numbers of every pool now (the caller holds the boundary lock, so no release is half
    /// done).
    pub(crate) fn pool_stats(&self) -> Result<Vec<PoolStats>> {
        let mut pools = self.registry.pools().iter().map(|pool| pool.lock().stats()).collect::<Result<Vec<_>>>()?;
        crate::report::attribute_overhead(&mut pools);
        Ok(pools)
    }

    /// Every counter now.
    pub(crate) fn metrics(&self) -> Result<Metrics> {
        let _steps = self.control.lock();
        let mut pools = Vec::new();
        for pool in self.registry.pools() {
            pools.push(pool.lock().metrics()?);
        }
        pools.extend(self.hub.retired.pools());
        let mut devices = Vec::new();
        for core in self.registry.open_devices() {
            core.make_current()?;
            let (free, total) = self.driver.mem_get_info()?;
            let graph = if self.hub.captures_begun.load(Ordering::Relaxed) > 0 {
                self.driver.device_graph_mem_counters(core.ordinal as i32)?
            } else {
                steppool_sys::PoolCounters::default()
            };
            devices.push(DeviceMemory {
                device: core.ordinal,
                free,
                total,
                graph_reserved: graph.reserved,
                graph_used: graph.used,
                mapped_high: core.mapped.high(),
            });
        }
        Ok(Metrics {
            pools,
            devices,
            steps: self.hub.steps_ended.load(Ordering::Relaxed),
            fragmentation: self.hub.last_fragmentation(),
            overhead: self.hub.overhead(),
            warnings: self.hub.warning_counts(),
        })
    }

    /// A copy of the recorded history, with the runtime's phases, driver and devices.
    pub(crate) fn history(&self) -> History {
        let mut history = self.hub.recorder.history();
        history.phases =
            self.registry.phases().iter().map(|entry| (entry.spec.name.clone(), entry.spec.scope)).collect();
        history.driver = self.driver.describe();
        history.devices = self.registry.open_devices().iter().map(|core| (core.ordinal, core.total_memory)).collect();
        history
    }

    /// The name of a phase, or `#index` for one the runtime does not have.
    pub(crate) fn phase_name(&self, phase: Phase) -> String {
        self.registry.phase(phase).map_or_else(|_| format!("#{}", phase.index()), |entry| entry.spec.name.clone())
    }
}

/// Between steps, each planned pool that packs the top of its plans into a bin (see
/// [`Allocator::lend_tail`](crate::strategy::Allocator)) keeps its loan while it is still the end
/// of its lender's last page, or gives it back and takes that end as it is now, from a persistent
/// pool of the same stream. Two pools, each with a partly used last page, then pay one between
/// them: on small runs (tens of MiB) that page decides whether a plan beats one pool. One lock at
/// a time: a borrower's, then its lender's, then the borrower's again.
fn lend_tails(pools: &[Arc<PhasePool>]) {
    for borrower in pools {
        let Some((current, wants, lender)) = borrower.lock().bin() else { continue };
        if current.is_none() && !wants {
            continue;
        }
        let lenders = lender.into_iter().chain(
            pools
                .iter()
                .filter(|pool| {
                    pool.scope() == Scope::Persistent
                        && pool.stream.id == borrower.stream.id
                        && pool.device_ordinal() == borrower.device_ordinal()
                })
                .cloned(),
        );
        let mut lent = None;
        let mut returned = current.is_none();
        for lender in lenders {
            if !returned {
                // The loan's own lender first: it keeps it, lends its end anew, or takes it back.
                returned = true;
                let bin = lender.lock().lend_tail(current, wants);
                if let Some(bin) = bin {
                    lent = Some((bin, lender));
                    break;
                }
                continue;
            }
            if !wants {
                break;
            }
            let bin = lender.lock().lend_tail(None, true);
            if let Some(bin) = bin {
                lent = Some((bin, lender));
                break;
            }
        }
        match lent {
            Some((bin, lender)) => borrower.lock().set_bin(Some(bin), Some(lender)),
            None if current.is_some() => borrower.lock().set_bin(None, None),
            None => {}
        }
    }
}
