//! The runtime's promises, one test each: devices and streams, phases and their policies, one
//! pool per (device, stream, phase), buffers, steps and micro-steps, strategies, the raw API and
//! checked mode, out-of-memory recovery and verdicts, the fallback without pools, many threads
//! and several devices, and bad input.
//!
//! Tests that hold on any device run on the driver `STEPPOOL_DEVICE` selects (the simulated device
//! in CI, a GPU unchanged); tests that need a device of a known size or its layout build their own
//! simulated device.

use steppool::{Error, Phase, PhaseSpec, Runtime, Scope, Strategy, TrimPolicy, Verdict};
use steppool_sys::sim::{PoolLayout, SimConfig};
use steppool_sys::{CUmemPool_attribute, CUresult, CUstream_flags, Driver};
use steppool_tests::{pool_slab_runtime, runtime, simulated_runtime};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn layout(runtime: &Runtime, phase: Phase, stream: &steppool::Stream) -> PoolLayout {
    let pool = runtime.pool_handle(phase, stream).unwrap().expect("a device with pools");
    runtime.driver().sim().expect("a simulated device").pool_layout(pool).expect("a pool of this driver")
}

fn stats_of(runtime: &Runtime, phase: Phase, stream: &steppool::Stream) -> steppool::PoolStats {
    runtime
        .stats()
        .unwrap()
        .into_iter()
        .find(|s| s.pool.phase == phase && s.pool.stream == stream.id())
        .expect("the pool")
}

// ----- runtime, devices, streams, events -------------------------------------------------------

#[test]
fn devices_use_the_primary_context_from_any_thread() {
    let rt = runtime();
    let device = rt.device(0).unwrap();
    let primary = rt.driver().primary_context_retain(0).unwrap();
    assert_eq!(device.raw_context(), primary, "the context cudarc, candle and cubecl use");
    // SAFETY: balances the retain above.
    unsafe { rt.driver().primary_context_release(0) }.unwrap();
    let from_thread = std::thread::spawn({
        let device = device.clone();
        let driver = rt.driver().clone();
        move || {
            let stream = device.create_stream().unwrap();
            stream.synchronize().unwrap();
            driver.context_current().unwrap().map(|ctx| ctx as usize)
        }
    });
    assert_eq!(from_thread.join().unwrap(), Some(primary as usize), "made current on the calling thread");
    assert!(matches!(rt.device(rt.device_count()), Err(Error::NoSuchDevice { .. })));
}

#[test]
fn wrapped_streams_stay_with_their_owner_and_owned_ones_are_destroyed() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let driver = rt.driver();
    let framework_stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    // SAFETY: a live stream of this device's primary context, outliving the wrapper.
    let wrapped = unsafe { device.wrap_stream(framework_stream) }.unwrap();
    drop(rt.alloc(Phase::WEIGHTS, MIB, &wrapped).unwrap());
    drop(wrapped);
    // SAFETY: the framework's stream is still live.
    unsafe { driver.stream_synchronize(framework_stream) }.expect("not destroyed by steppool");
    let owned = device.create_stream().unwrap();
    let raw = owned.raw();
    drop(owned);
    // SAFETY: the simulated device checks the handle.
    let gone = unsafe { driver.stream_synchronize(raw) };
    assert_eq!(gone.unwrap_err().code(), Some(CUresult::CUDA_ERROR_INVALID_HANDLE), "destroyed with its last clone");
}

#[test]
fn events_order_streams() {
    let rt = runtime();
    let device = rt.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let event = a.record_event().unwrap();
    b.wait_event(&event).unwrap();
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    b.wait_stream(&a).unwrap();
    b.synchronize().unwrap();
    assert!(b.is_idle().unwrap());
    if let Some(sim) = rt.driver().sim() {
        assert_eq!(sim.is_ordered_after(b.raw(), a.raw()), Some(true));
        assert_eq!(sim.is_ordered_after(a.raw(), b.raw()), Some(false));
    }
}

// ----- phases -----------------------------------------------------------------------------------

#[test]
fn built_in_phases_cover_training() {
    let rt = simulated_runtime(GIB);
    let phases = rt.phases();
    let by_name = |name: &str| phases.iter().find(|(_, spec)| spec.name == name).unwrap().1.clone();
    assert_eq!(by_name("weights").scope, Scope::Persistent);
    assert_eq!(by_name("optimizer_state").scope, Scope::Persistent);
    assert_eq!(by_name("activations").scope, Scope::Step);
    assert_eq!(by_name("gradients").scope, Scope::Step);
    assert_eq!(by_name("workspace").strategy, Strategy::ARENA);
    assert_eq!(rt.phase_named("gradients"), Some(Phase::GRADIENTS));
    assert!(phases.iter().all(|(_, spec)| spec.release_threshold == u64::MAX), "thresholds raised");
}

#[test]
fn phases_are_declared_once_and_fixed_after_first_use() {
    let rt = simulated_runtime(GIB);
    let kv = rt.declare_phase(PhaseSpec::new("kv_cache", Scope::Persistent)).unwrap();
    assert_eq!(rt.phase_spec(kv).unwrap().name, "kv_cache");
    let again = rt.declare_phase(PhaseSpec::new("kv_cache", Scope::Step));
    assert!(matches!(again, Err(Error::DuplicatePhase { name }) if name == "kv_cache"));
    rt.set_phase_spec(Phase::ACTIVATIONS, PhaseSpec::new("activations", Scope::Step).strategy(Strategy::ARENA))
        .unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    drop(rt.alloc(kv, MIB, &stream).unwrap());
    let changed = rt.set_phase_spec(kv, PhaseSpec::new("kv_cache", Scope::Step));
    assert!(matches!(changed, Err(Error::PhaseInUse { phase }) if phase == "kv_cache"));
    for n in rt.phases().len()..steppool::MAX_PHASES {
        rt.declare_phase(PhaseSpec::new(format!("p{n}"), Scope::Step)).unwrap();
    }
    let too_many = rt.declare_phase(PhaseSpec::new("one_more", Scope::Step));
    assert!(matches!(too_many, Err(Error::TooManyPhases { max: 64 })));
}

#[test]
fn a_budget_is_a_clear_error_with_the_numbers() {
    let rt = simulated_runtime(GIB);
    let kv = rt.declare_phase(PhaseSpec::new("kv_cache", Scope::Persistent).budget(100 * MIB)).unwrap();
    let device = rt.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let first = rt.alloc(kv, 60 * MIB, &a).unwrap();
    let over = rt.alloc(kv, 50 * MIB, &b).unwrap_err();
    match &over {
        Error::BudgetExceeded { phase, budget, live, requested } => {
            assert_eq!((phase.as_str(), *budget, *live, *requested), ("kv_cache", 100 * MIB, 60 * MIB, 50 * MIB));
        }
        other => panic!("expected BudgetExceeded, got {other:?}"),
    }
    assert!(over.to_string().contains("100 MiB") && over.to_string().contains("60 MiB"), "{over}");
    drop(first);
    drop(rt.alloc(kv, 100 * MIB, &b).unwrap());
}

// ----- pools -------------------------------------------------------------------------------------

#[test]
fn each_device_stream_and_phase_gets_its_own_pool_on_first_use() {
    let rt = runtime();
    let device = rt.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    assert!(rt.stats().unwrap().is_empty(), "no pool before the first allocation");
    let w = rt.alloc(Phase::WEIGHTS, MIB, &a).unwrap();
    let o = rt.alloc(Phase::OPTIMIZER_STATE, MIB, &a).unwrap();
    let w2 = rt.alloc(Phase::WEIGHTS, MIB, &b).unwrap();
    let pools: Vec<(u32, Phase)> = rt.stats().unwrap().iter().map(|s| (s.pool.stream, s.pool.phase)).collect();
    assert_eq!(pools.len(), 3);
    assert!(pools.contains(&(a.id(), Phase::WEIGHTS)) && pools.contains(&(b.id(), Phase::WEIGHTS)));
    let handles = [
        rt.pool_handle(Phase::WEIGHTS, &a).unwrap(),
        rt.pool_handle(Phase::OPTIMIZER_STATE, &a).unwrap(),
        rt.pool_handle(Phase::WEIGHTS, &b).unwrap(),
    ];
    assert!(handles[0] != handles[1] && handles[0] != handles[2], "distinct CUDA pools");
    let threshold = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    // SAFETY: a live pool of this runtime's driver.
    let value = unsafe { rt.driver().mem_pool_get_attribute(handles[0].unwrap(), threshold) }.unwrap();
    assert_eq!(value, u64::MAX, "created with the release threshold raised");
    drop((w, o, w2));
}

#[test]
fn a_phase_release_threshold_is_applied_to_its_pools() {
    let rt = simulated_runtime(GIB);
    let eager = rt.declare_phase(PhaseSpec::new("eager", Scope::Persistent).release_threshold(0)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    drop(rt.alloc(eager, 64 * MIB, &stream).unwrap());
    drop(rt.alloc(Phase::WEIGHTS, 64 * MIB, &stream).unwrap());
    stream.synchronize().unwrap();
    assert_eq!(stats_of(&rt, eager, &stream).reserved, 0, "threshold 0: given back at the sync");
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).reserved, 64 * MIB, "raised threshold: kept");
}

#[test]
fn stats_come_from_the_pool_and_our_own_accounting() {
    let rt = runtime();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let a = rt.alloc(Phase::WEIGHTS, 1000, &stream).unwrap();
    let b = rt.alloc(Phase::WEIGHTS, 3 * MIB, &stream).unwrap();
    let stats = stats_of(&rt, Phase::WEIGHTS, &stream);
    assert_eq!(stats.used, 1000 + 3 * MIB, "requested bytes");
    assert!(stats.reserved >= stats.used && stats.peak_reserved >= stats.reserved);
    assert_eq!(stats.allocations, 2);
    drop(a);
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).frees, 1);
    drop(b);
}

#[test]
fn trim_policies_give_back_a_spike_once_it_leaves_the_window() {
    let rt = simulated_runtime(4 * GIB);
    let spec = |name: &str, trim| PhaseSpec::new(name, Scope::Step).trim(trim);
    let windowed = rt.declare_phase(spec("windowed", TrimPolicy::KeepRecentPeak { steps: 2 })).unwrap();
    let never = rt.declare_phase(spec("never", TrimPolicy::Never)).unwrap();
    let fixed = rt.declare_phase(spec("fixed", TrimPolicy::KeepBytes(64 * MIB))).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    // A step holding `pieces` buffers of 64 MiB at once: as many segments of the pool.
    let step_with = |pieces: usize| {
        let step = rt.begin_step().unwrap();
        for phase in [windowed, never, fixed] {
            let held: Vec<_> = (0..pieces).map(|_| step.alloc(phase, 64 * MIB, &stream).unwrap()).collect();
            drop(held);
        }
        // Trimming never waits for the GPU: the frees must have been observed to be released.
        stream.synchronize().unwrap();
        step.end().unwrap()
    };
    step_with(8);
    let reserved = |phase| stats_of(&rt, phase, &stream).reserved;
    assert_eq!(reserved(windowed), 512 * MIB, "the spike is the recent peak");
    assert_eq!(reserved(fixed), 64 * MIB, "KeepBytes trims down to its bytes");
    step_with(1);
    assert_eq!(reserved(windowed), 512 * MIB, "still in the window of 2");
    step_with(1);
    step_with(1);
    assert_eq!(reserved(windowed), 64 * MIB, "given back once the spike left the window");
    assert_eq!(reserved(never), 512 * MIB, "Never keeps everything");
}

// ----- buffers ------------------------------------------------------------------------------------

#[test]
fn dropped_buffers_are_reused_within_the_step() {
    let rt = runtime();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    let first = step.alloc(Phase::ACTIVATIONS, 32 * MIB, &stream).unwrap();
    first.fill(0x5a).unwrap();
    let ptr = first.ptr();
    drop(first);
    let second = step.alloc(Phase::ACTIVATIONS, 32 * MIB, &stream).unwrap();
    let reserved = stats_of(&rt, Phase::ACTIVATIONS, &stream).peak_reserved;
    assert!(reserved < 64 * MIB, "reused, not grown: {reserved}");
    if !rt.device(0).unwrap().is_gpu() {
        assert_eq!(second.ptr(), ptr);
    }
    drop(second);
    step.end().unwrap();
}

#[test]
fn a_buffer_used_on_another_stream_is_freed_after_that_stream() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let (owner, reader) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let sim = rt.driver().sim().unwrap();

    let mut buffer = rt.alloc(Phase::WEIGHTS, MIB, &owner).unwrap();
    // SAFETY: the range is the live buffer; the reader stream uses it.
    unsafe { rt.driver().memset_d8_async(buffer.ptr(), 0, MIB as usize, reader.raw()) }.unwrap();
    buffer.record_use(&reader);
    drop(buffer);
    assert_eq!(sim.is_ordered_after(owner.raw(), reader.raw()), Some(true), "the free waited for the reader");

    let (owner, reader) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let unrecorded = rt.alloc(Phase::WEIGHTS, MIB, &owner).unwrap();
    // SAFETY: as above.
    unsafe { rt.driver().memset_d8_async(unrecorded.ptr(), 0, MIB as usize, reader.raw()) }.unwrap();
    drop(unrecorded);
    assert_eq!(sim.is_ordered_after(owner.raw(), reader.raw()), Some(false), "without record_use, no wait");
}

#[test]
fn a_buffer_freed_explicitly_is_freed_once() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let kept = rt.alloc(Phase::WEIGHTS, MIB, &stream).unwrap();
    let freed = rt.alloc(Phase::WEIGHTS, 2 * MIB, &stream).unwrap();
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).used, 3 * MIB);
    freed.free().unwrap();
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).used, MIB, "its bytes went back, no more");
    drop(kept);
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).used, 0);
    assert!(rt.take_errors().is_empty(), "no second free when the freed buffer went out of scope");

    let step = rt.begin_step().unwrap();
    let buffer = step.alloc(Phase::ACTIVATIONS, 4 * MIB, &stream).unwrap();
    buffer.free().unwrap();
    assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).used, 0);
    step.end().unwrap();
    assert!(rt.take_errors().is_empty());
}

// ----- steps ---------------------------------------------------------------------------------------

#[test]
fn ending_a_step_releases_its_raw_allocations_and_leaves_persistent_ones() {
    let rt = simulated_runtime(8 * GIB);
    let device = rt.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let weights = rt.alloc(Phase::WEIGHTS, 256 * MIB, &a).unwrap();
    let step = rt.begin_step().unwrap();
    let mut raw = Vec::new();
    for (i, stream) in [&a, &b, &a, &b].into_iter().enumerate() {
        // SAFETY: nothing uses the pointers; the step end releases them.
        raw.push(unsafe { rt.raw().alloc(Phase::ACTIVATIONS, (i as u64 + 1) * 10 * MIB, stream) }.unwrap());
    }
    // SAFETY: as above.
    raw.push(unsafe { rt.raw().alloc(Phase::GRADIENTS, 64 * MIB, &b) }.unwrap());
    let kept = step.alloc(Phase::GRADIENTS, MIB, &a).unwrap();
    drop(kept);
    let report = step.end().unwrap();

    let activations = report.phase(Phase::ACTIVATIONS).unwrap();
    assert_eq!(activations.released, 100 * MIB, "10+20+30+40 MiB on two streams");
    assert_eq!(activations.peak_used, 100 * MIB);
    assert!(activations.peak_reserved >= 100 * MIB);
    assert_eq!(activations.allocations, 4);
    assert_eq!(report.phase(Phase::GRADIENTS).unwrap().released, 64 * MIB);
    assert_eq!(report.released(), 164 * MIB);
    assert!(report.duration >= report.release_time);
    for stream in [&a, &b] {
        assert!(layout(&rt, Phase::ACTIVATIONS, stream).allocations.is_empty(), "nothing left in the pool");
    }
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &a).used, 256 * MIB, "persistent phases are untouched");
    assert_eq!(layout(&rt, Phase::WEIGHTS, &a).allocations, vec![(weights.ptr(), 256 * MIB)]);
    for ptr in raw {
        // SAFETY: the simulated device and the runtime check the pointer.
        assert!(matches!(unsafe { rt.raw().free(ptr) }, Err(Error::UnknownPointer { .. })));
    }
    assert!(report.to_string().contains("activations"), "{report}");
}

#[test]
fn micro_steps_release_their_phases_and_steps_keep_theirs() {
    let rt = simulated_runtime(8 * GIB);
    let micro_phase = rt.declare_phase(PhaseSpec::new("micro_activations", Scope::MicroStep)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    let gradients = step.alloc(Phase::GRADIENTS, 64 * MIB, &stream).unwrap();
    for i in 0..4 {
        let micro = step.begin_micro_step().unwrap();
        assert_eq!(micro.index(), i);
        let _activations = micro.alloc(micro_phase, 128 * MIB, &stream).unwrap();
        // SAFETY: released at the micro-step end; nothing uses it.
        unsafe { rt.raw().alloc(micro_phase, 32 * MIB, &stream) }.unwrap();
        let also_step = micro.alloc(Phase::ACTIVATIONS, MIB, &stream).unwrap();
        drop(also_step);
        drop(_activations);
        let report = micro.end().unwrap();
        assert_eq!(report.released, 32 * MIB, "the raw allocation");
        assert_eq!(stats_of(&rt, micro_phase, &stream).used, 0);
        assert_eq!(stats_of(&rt, Phase::GRADIENTS, &stream).used, 64 * MIB, "gradients live across micro-steps");
    }
    drop(gradients);
    let report = step.end().unwrap();
    assert_eq!(report.micro_steps, 4);
    assert_eq!(report.phase(micro_phase).unwrap().peak_used, 160 * MIB);
}

#[test]
fn phases_are_allocated_only_where_their_scope_allows() {
    let rt = simulated_runtime(GIB);
    let micro_phase = rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let scope_error = |result: steppool::Result<steppool::Buffer<'_>>, from: &str| match result {
        Err(Error::PhaseScope { from: f, .. }) => assert_eq!(f, from),
        other => panic!("expected PhaseScope from {from}, got {other:?}"),
    };
    scope_error(rt.alloc(Phase::ACTIVATIONS, MIB, &stream), "a Step");
    scope_error(rt.alloc(micro_phase, MIB, &stream), "a MicroStep");
    let step = rt.begin_step().unwrap();
    scope_error(step.alloc(Phase::WEIGHTS, MIB, &stream), "the Runtime");
    scope_error(step.alloc(micro_phase, MIB, &stream), "a MicroStep");
    let micro = step.begin_micro_step().unwrap();
    assert!(matches!(step.begin_micro_step(), Err(Error::MicroStepActive { index: 0, .. })));
    scope_error(micro.alloc(Phase::WEIGHTS, MIB, &stream), "the Runtime");
    micro.end().unwrap();
    assert!(matches!(rt.begin_step(), Err(Error::StepActive { .. })));
    step.end().unwrap();
}

/// Where a step end stands, as the thread ending it publishes it: before, during, after.
const BEFORE: u8 = 0;
const DURING: u8 = 1;
const AFTER: u8 = 2;

/// Whether a call that saw `started` when it began and `finished` when it returned ran while
/// the step end was in progress.
fn overlapped(started: u8, finished: u8) -> bool {
    started == DURING || finished == DURING || (started == BEFORE && finished == AFTER)
}

#[test]
fn the_release_is_atomic_for_other_threads() {
    use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
    let rt = simulated_runtime(16 * GIB);
    let device = rt.device(0).unwrap();
    let streams: Vec<_> = (0..4).map(|_| device.create_stream().unwrap()).collect();
    let live = 4 * 50 * 3 * MIB;
    let used =
        || -> u64 { rt.stats().unwrap().iter().filter(|s| s.pool.phase == Phase::ACTIVATIONS).map(|s| s.used).sum() };
    // Steps until a read has run while a release was in progress (each read brackets itself
    // with the release's progress); every read, those above all, sees all or nothing.
    let (mut overlapping, mut reads) = (0usize, 0usize);
    for _attempt in 0..1000 {
        let step = rt.begin_step().unwrap();
        for stream in &streams {
            for _ in 0..50 {
                // SAFETY: released at the step end; nothing uses them.
                unsafe { rt.raw().alloc(Phase::ACTIVATIONS, 3 * MIB, stream) }.unwrap();
            }
        }
        let progress = AtomicU8::new(BEFORE);
        let watching = AtomicBool::new(true);
        let ready = AtomicUsize::new(0);
        let observed: Vec<(u8, u64, u8)> = std::thread::scope(|scope| {
            let watchers: Vec<_> = (0..3)
                .map(|_| {
                    scope.spawn(|| {
                        let mut seen = Vec::new();
                        while watching.load(Ordering::Acquire) {
                            let started = progress.load(Ordering::Acquire);
                            let value = used();
                            seen.push((started, value, progress.load(Ordering::Acquire)));
                            if seen.len() == 1 {
                                ready.fetch_add(1, Ordering::AcqRel);
                            }
                        }
                        seen
                    })
                })
                .collect();
            // Every watcher reads the full step at least once before the release begins.
            while ready.load(Ordering::Acquire) < 3 {
                std::thread::yield_now();
            }
            progress.store(DURING, Ordering::Release);
            step.end().unwrap();
            progress.store(AFTER, Ordering::Release);
            // A read after the release, then stop.
            std::thread::sleep(std::time::Duration::from_millis(1));
            watching.store(false, Ordering::Release);
            watchers.into_iter().flat_map(|w| w.join().unwrap()).collect()
        });
        for &(started, value, finished) in &observed {
            assert!(value == live || value == 0, "a half-released step was seen: {value} of {live} bytes");
            if started == AFTER {
                assert_eq!(value, 0, "a read that began after the step end saw memory of the step");
            }
            if finished == BEFORE {
                assert_eq!(value, live, "a read that ended before the step end missed memory of the step");
            }
        }
        reads += observed.len();
        overlapping += observed.iter().filter(|&&(s, _, f)| overlapped(s, f)).count();
        if overlapping > 0 {
            break;
        }
    }
    assert!(overlapping > 0, "no read ran during a release in 1000 steps ({reads} reads)");
}

#[test]
fn raw_allocations_racing_a_step_end_are_released_or_refused() {
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
    let rt = simulated_runtime(16 * GIB);
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    // Steps until an allocation has run while a step end was in progress; its outcome, like
    // every other, is either memory the step end released or `NoActiveStep`.
    let (mut overlapping, mut released, mut refused) = (0usize, 0usize, 0usize);
    for _attempt in 0..1000 {
        rt.raw().begin_step().unwrap();
        let progress = AtomicU8::new(BEFORE);
        let granted = AtomicUsize::new(0);
        let outcomes = std::thread::scope(|scope| {
            let allocator = scope.spawn(|| {
                let mut outcomes = Vec::new();
                // Until refused: the step end comes while this thread allocates.
                loop {
                    let started = progress.load(Ordering::Acquire);
                    // SAFETY: nothing uses the pointers.
                    let outcome = unsafe { rt.raw().alloc(Phase::ACTIVATIONS, MIB, &stream) };
                    let finished = progress.load(Ordering::Acquire);
                    let refused = outcome.is_err();
                    granted.fetch_add(usize::from(!refused), Ordering::AcqRel);
                    outcomes.push((started, outcome, finished));
                    if refused {
                        return outcomes;
                    }
                }
            });
            // The step ends once the thread has been granted some memory.
            while granted.load(Ordering::Acquire) == 0 {
                std::thread::yield_now();
            }
            progress.store(DURING, Ordering::Release);
            // SAFETY: nothing uses the released pointers.
            unsafe { rt.raw().end_step() }.unwrap();
            progress.store(AFTER, Ordering::Release);
            allocator.join().unwrap()
        });
        for (started, outcome, finished) in outcomes {
            overlapping += usize::from(overlapped(started, finished));
            match outcome {
                Ok(ptr) => {
                    // SAFETY: the runtime checks the pointer.
                    let freed = unsafe { rt.raw().free(ptr) };
                    assert!(matches!(freed, Err(Error::UnknownPointer { .. })), "not released: {freed:?}");
                    assert_ne!(started, AFTER, "granted after the step ended");
                    released += 1;
                }
                Err(error) => {
                    assert!(matches!(error, Error::NoActiveStep), "{error}");
                    assert_ne!(finished, BEFORE, "refused before the step ended");
                    refused += 1;
                }
            }
        }
        assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).used, 0, "nothing leaked into the next step");
        if overlapping > 0 {
            break;
        }
    }
    assert!(overlapping > 0, "no allocation ran during a step end in 1000 steps");
    assert!(released > 0 && refused > 0, "both outcomes: {released} released, {refused} refused");
}

#[test]
fn a_panic_inside_a_step_releases_the_step_and_leaves_the_runtime_usable() {
    let rt = simulated_runtime(GIB);
    let micro_phase = rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let weights = rt.alloc(Phase::WEIGHTS, 64 * MIB, &stream).unwrap();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let step = rt.begin_step().unwrap();
        let _activations = step.alloc(Phase::ACTIVATIONS, 32 * MIB, &stream).unwrap();
        let micro = step.begin_micro_step().unwrap();
        let _scratch = micro.alloc(micro_phase, 16 * MIB, &stream).unwrap();
        // SAFETY: released at the step end; nothing uses it.
        unsafe { rt.raw().alloc(Phase::ACTIVATIONS, 8 * MIB, &stream) }.unwrap();
        assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).used, 40 * MIB);
        panic!("the user's model failed mid-step");
    }));
    let payload = unwound.expect_err("the closure panicked");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the user's model failed mid-step"));
    // The unwinding dropped the buffers, then the micro-step, then the step: each ended cleanly.
    assert_eq!(rt.active_step(), None);
    assert!(rt.take_errors().is_empty(), "no error while unwinding");
    assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).used, 0);
    assert_eq!(stats_of(&rt, micro_phase, &stream).used, 0);
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).used, 64 * MIB, "persistent memory untouched");
    // The next step runs as any other.
    let step = rt.begin_step().unwrap();
    let again = step.alloc(Phase::ACTIVATIONS, 32 * MIB, &stream).unwrap();
    drop(again);
    let report = step.end().unwrap();
    assert_eq!(report.phase(Phase::ACTIVATIONS).unwrap().peak_used, 32 * MIB);
    drop(weights);
}

// ----- strategies ------------------------------------------------------------------------------------

#[test]
fn the_arena_bumps_resets_keeps_slabs_and_returns_the_surplus() {
    let rt = pool_slab_runtime(8 * GIB);
    let scratch = rt
        .declare_phase(
            PhaseSpec::new("scratch", Scope::Step)
                .strategy(Strategy::Arena { slab_bytes: 64 * MIB })
                .trim(TrimPolicy::KeepRecentPeak { steps: 1 }),
        )
        .unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    let a = step.alloc(scratch, 1000, &stream).unwrap();
    let b = step.alloc(scratch, 100, &stream).unwrap();
    assert_eq!(b.ptr(), a.ptr() + 1024, "bump, 512-byte aligned");
    let base = a.ptr();
    drop(a);
    let c = step.alloc(scratch, 512, &stream).unwrap();
    assert_eq!(c.ptr(), base + 1536, "free is a no-op: no reuse within the step");
    let big = step.alloc(scratch, 100 * MIB, &stream).unwrap();
    assert_eq!(layout(&rt, scratch, &stream).allocations.len(), 2, "a slab and an oversize slab");
    let space = stats_of(&rt, scratch, &stream).free_space.unwrap();
    assert_eq!(space.total_free, 64 * MIB - 2048, "the first slab's tail");
    drop((b, c, big));
    let report = step.end().unwrap();
    assert_eq!(report.phase(scratch).unwrap().peak_used, 100 * MIB + 612, "b, c and big at once");

    let step = rt.begin_step().unwrap();
    let again = step.alloc(scratch, 4096, &stream).unwrap();
    assert_eq!(again.ptr(), base, "reset in O(1): the first slab is reused");
    drop(again);
    step.end().unwrap();
    assert_eq!(layout(&rt, scratch, &stream).allocations.len(), 1, "the unused oversize slab went back");
    stream.synchronize().unwrap();
    rt.begin_step().unwrap().end().unwrap();
    assert_eq!(stats_of(&rt, scratch, &stream).reserved, 64 * MIB, "and its memory, once the free was observed");
}

#[test]
fn the_arena_bumps_through_one_range_that_grows_in_place() {
    // With virtual memory management (the simulated device's default, as a GPU's) the arena's
    // slabs are one reserved range: nothing comes from the pool, pages are mapped as the bump
    // passes, an oversize request continues the bump instead of taking a slab of its own.
    let rt = simulated_runtime(8 * GIB);
    let scratch = rt
        .declare_phase(
            PhaseSpec::new("scratch", Scope::Step)
                .strategy(Strategy::Arena { slab_bytes: 64 * MIB })
                .trim(TrimPolicy::KeepRecentPeak { steps: 1 }),
        )
        .unwrap();
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let mapped = || rt.driver().sim().unwrap().mapped_ranges().iter().map(|r| r.size).sum::<u64>();
    let step = rt.begin_step().unwrap();
    let a = step.alloc(scratch, 1000, &stream).unwrap();
    let b = step.alloc(scratch, 100, &stream).unwrap();
    assert_eq!(b.ptr(), a.ptr() + 1024, "bump, 512-byte aligned");
    let base = a.ptr();
    drop(a);
    let c = step.alloc(scratch, 512, &stream).unwrap();
    assert_eq!(c.ptr(), base + 1536, "free is a no-op: no reuse within the step");
    let big = step.alloc(scratch, 100 * MIB, &stream).unwrap();
    assert!(big.ptr() >= base + 2048 && big.ptr() < base + 64 * MIB, "in the same range: {:#x}", big.ptr());
    assert!(layout(&rt, scratch, &stream).allocations.is_empty(), "nothing from the pool");
    let reserved = stats_of(&rt, scratch, &stream).reserved;
    assert_eq!(reserved, mapped(), "the phase reserves what is mapped");
    assert_eq!(reserved, (big.ptr() - base + 100 * MIB).next_multiple_of(2 * MIB), "pages up to the bump");
    drop((b, c, big));
    let report = step.end().unwrap();
    assert_eq!(report.phase(scratch).unwrap().peak_used, 100 * MIB + 612, "b, c and big at once");

    let step = rt.begin_step().unwrap();
    let again = step.alloc(scratch, 4096, &stream).unwrap();
    assert_eq!(again.ptr(), base, "reset in O(1): the range is reused from its start");
    drop(again);
    step.end().unwrap();
    assert!(stats_of(&rt, scratch, &stream).reserved < reserved, "pages past the recent peak went back");
    assert_eq!(stats_of(&rt, scratch, &stream).reserved, mapped());
    device.release_idle().unwrap();
    assert_eq!((stats_of(&rt, scratch, &stream).reserved, mapped()), (0, 0), "release_idle unmaps the rest");
}

#[test]
fn a_step_served_online_keeps_freed_pages_until_another_pool_takes_memory() {
    // The first step of a planned phase is served online, best fit in a range that grows in
    // place. What it frees stays mapped, with no driver call, until something on the device is
    // about to take memory: then the pages go back first, in stream order. With the GPU behind
    // the host (the stream's work held incomplete), nothing waits for it: the pages stay mapped
    // and counted until a later call finds the stream past them.
    let config = SimConfig { count_calls: true, ..SimConfig::with_capacity(8 * GIB) };
    let rt = Runtime::builder().simulated(config).build().unwrap();
    let acts = rt.declare_phase(PhaseSpec::new("acts", Scope::Step).strategy(Strategy::PLANNED)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let sim = rt.driver().sim().unwrap();
    let mapped = || sim.mapped_ranges().iter().map(|r| r.size).sum::<u64>();
    let step = rt.begin_step().unwrap();
    let mut buffers: Vec<_> = (0..64).map(|_| step.alloc(acts, 2 * MIB, &stream).unwrap()).collect();
    let full = mapped();
    assert_eq!(full, 128 * MIB);
    let driver_calls = || ["cuMemMap", "cuMemUnmap", "cuMemCreate", "cuMemRelease"].map(|call| sim.calls(call));
    let calls = driver_calls();
    let last = buffers.pop().unwrap();
    drop(buffers.drain(..32));
    for _ in 0..10 {
        // Freed and taken again within what the step holds: no driver call.
        drop(step.alloc(acts, 2 * MIB, &stream).unwrap());
    }
    assert_eq!((driver_calls(), mapped()), (calls, full), "the freed pages stay mapped");
    sim.hold_stream(stream.raw()).unwrap();
    let syncs = sim.calls("cuStreamSynchronize");
    // A persistent pool takes 64 MiB: first the step's pool gives its 32 freed pages back.
    let weights = rt.alloc(Phase::WEIGHTS, 64 * MIB, &stream).unwrap();
    assert_eq!(sim.calls("cuStreamSynchronize"), syncs, "no wait for the stream");
    assert_eq!(stats_of(&rt, acts, &stream).reserved, full, "still mapped while the stream may use them, and counted");
    sim.release_stream(stream.raw()).unwrap();
    // The next call on the pool finds the stream past them: unmapped.
    let again = step.alloc(acts, 2 * MIB, &stream).unwrap();
    assert_eq!(stats_of(&rt, acts, &stream).reserved, full - 31 * 2 * MIB, "one freed page mapped again");
    drop((again, last, buffers, weights));
    step.end().unwrap();
}

#[test]
fn arena_frees_in_stack_order_give_memory_back_across_slabs() {
    let rt = pool_slab_runtime(GIB);
    let stack =
        rt.declare_phase(PhaseSpec::new("stack", Scope::Step).strategy(Strategy::Arena { slab_bytes: MIB })).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    let first = step.alloc(stack, 600 << 10, &stream).unwrap();
    let base = first.ptr();
    let second = step.alloc(stack, 600 << 10, &stream).unwrap();
    let third = step.alloc(stack, 600 << 10, &stream).unwrap();
    assert_eq!(layout(&rt, stack, &stream).allocations.len(), 3, "one slab each: two do not fit in 1 MiB");
    let space = stats_of(&rt, stack, &stream).free_space.unwrap();
    assert_eq!((space.total_free, space.largest_free), (3 * (424 << 10), 424 << 10), "two tails passed over");
    drop(third);
    drop(second);
    let again = step.alloc(stack, 300 << 10, &stream).unwrap();
    assert_eq!(again.ptr(), base + (600 << 10), "back in the first slab, right after `first`");
    drop(again);
    drop(first);
    assert_eq!(step.alloc(stack, 4096, &stream).unwrap().ptr(), base, "the whole stack unwound");
    step.end().unwrap();
}

// ----- raw API and checked mode ---------------------------------------------------------------------------

#[test]
fn the_raw_api_reports_misuse() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    // SAFETY: the runtime checks every pointer; none is used on the device.
    unsafe {
        assert!(matches!(rt.raw().alloc(Phase::ACTIVATIONS, MIB, &stream), Err(Error::NoActiveStep)));
        let ptr = rt.raw().alloc(Phase::WEIGHTS, MIB, &stream).unwrap();
        rt.raw().check_range(ptr, MIB).unwrap();
        assert!(matches!(rt.raw().check_range(ptr, MIB + 1), Err(Error::OutOfBounds { .. })));
        rt.raw().free(ptr).unwrap();
        assert!(matches!(rt.raw().free(ptr), Err(Error::UnknownPointer { ptr: p }) if p == ptr), "double free");
        assert!(matches!(rt.raw().free(0x1234), Err(Error::UnknownPointer { .. })));
        assert!(matches!(rt.raw().end_step(), Err(Error::NoActiveStep)));
        rt.raw().begin_step().unwrap();
        assert!(matches!(rt.raw().begin_step(), Err(Error::StepActive { .. })));
        let micro = rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
        assert!(matches!(rt.raw().alloc(micro, MIB, &stream), Err(Error::NoActiveMicroStep)));
        rt.raw().end_step().unwrap();
        assert!(matches!(rt.raw().end_step(), Err(Error::NoActiveStep)), "ending a step twice");
        let guard = rt.begin_step().unwrap();
        assert!(matches!(rt.raw().end_step(), Err(Error::OwnedByGuard { .. })));
        guard.end().unwrap();
    }
}

#[test]
fn checked_mode_names_the_step_that_released_a_pointer() {
    let rt = Runtime::builder().simulated(SimConfig::with_capacity(GIB)).checked(true).build().unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    rt.raw().begin_step().unwrap();
    // SAFETY: the runtime checks the pointer after the release; nothing uses it on the device.
    unsafe {
        let ptr = rt.raw().alloc(Phase::ACTIVATIONS, 4 * MIB, &stream).unwrap();
        rt.raw().check_range(ptr + MIB, MIB).unwrap();
        rt.raw().end_step().unwrap();
        for error in [rt.raw().check_range(ptr + 100, 8).unwrap_err(), rt.raw().free(ptr).unwrap_err()] {
            match error {
                Error::UseAfterRelease { ptr: p, phase, step } => {
                    assert_eq!((p, phase.as_str(), step), (if p == ptr { ptr } else { ptr + 100 }, "activations", 0));
                }
                other => panic!("expected UseAfterRelease, got {other:?}"),
            }
        }
        rt.raw().begin_step().unwrap();
        let reused = rt.raw().alloc(Phase::ACTIVATIONS, 4 * MIB, &stream).unwrap();
        assert_eq!(reused, ptr, "the address is reused by the next step");
        rt.raw().check_range(ptr, 4 * MIB).expect("a new allocation at the address is live, not released");
        rt.raw().end_step().unwrap();
    }
}

#[test]
fn raw_uses_on_other_streams_order_the_release() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let (owner, other) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    rt.raw().begin_step().unwrap();
    // SAFETY: the other stream uses the allocation and is recorded; the step end releases it.
    unsafe {
        let ptr = rt.raw().alloc(Phase::ACTIVATIONS, MIB, &owner).unwrap();
        rt.driver().memset_d8_async(ptr, 1, MIB as usize, other.raw()).unwrap();
        rt.raw().record_use(ptr, &other).unwrap();
        rt.raw().end_step().unwrap();
    }
    assert_eq!(rt.driver().sim().unwrap().is_ordered_after(owner.raw(), other.raw()), Some(true));
}

// ----- out of memory ----------------------------------------------------------------------------------

#[test]
fn out_of_memory_from_demand_says_so() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let held = rt.alloc(Phase::WEIGHTS, 700 * MIB, &stream).unwrap();
    let error = rt.alloc(Phase::OPTIMIZER_STATE, 400 * MIB, &stream).unwrap_err();
    let report = error.oom_report().expect("an OOM report");
    assert_eq!(report.verdict, Verdict::Demand);
    assert_eq!((report.requested, report.device_total), (400 * MIB, GIB));
    // The pool maps whole 32 MiB units, as the driver does: 704 MiB for 700.
    assert_eq!(report.device_free, GIB - 704 * MIB);
    assert_eq!(report.pools.iter().map(|p| p.used).sum::<u64>(), 700 * MIB);
    assert!(error.to_string().contains("verdict: demand"), "{error}");
    drop(held);
}

#[test]
fn out_of_memory_from_fragmentation_says_so() {
    // 1 GiB of units, and the granule the driver keeps free beside them.
    let rt = simulated_runtime(GIB + 2 * MIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    // One range spanning the device, then filled with 16 MiB pieces, every other one freed:
    // half the device holds no live data, but in 16 MiB holes.
    drop(rt.alloc(Phase::WEIGHTS, GIB, &stream).unwrap());
    let mut pieces: Vec<_> = (0..64).map(|_| rt.alloc(Phase::WEIGHTS, 16 * MIB, &stream).unwrap()).collect();
    let mut index = 0;
    pieces.retain(|_| {
        index += 1;
        index % 2 == 0
    });
    let error = rt.alloc(Phase::WEIGHTS, 32 * MIB, &stream).unwrap_err();
    let report = error.oom_report().expect("an OOM report");
    assert_eq!(report.verdict, Verdict::Fragmentation);
    assert_eq!(report.reserved_unused(), 512 * MIB);
    assert!(error.to_string().contains("verdict: fragmentation"), "{error}");
}

#[test]
fn out_of_memory_recovers_by_synchronizing_and_trimming_other_pools() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    // 800 MiB freed on stream a but not yet observed: the device cannot reuse it on stream b.
    drop(rt.alloc(Phase::WEIGHTS, 800 * MIB, &a).unwrap());
    let recovered = rt.alloc(Phase::OPTIMIZER_STATE, 800 * MIB, &b).unwrap();
    assert_eq!(rt.telemetry().oom_recoveries(), 1);
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &a).reserved, 0, "the other pool was trimmed");
    drop(recovered);
}

#[test]
fn out_of_memory_recovery_reaches_the_slabs_arenas_and_plans_keep() {
    for strategy in [Strategy::Arena { slab_bytes: 256 * MIB }, Strategy::PLANNED] {
        let rt = simulated_runtime(2 * GIB);
        let spec = PhaseSpec::new("activations", Scope::Step).strategy(strategy).trim(TrimPolicy::Never);
        rt.set_phase_spec(Phase::ACTIVATIONS, spec).unwrap();
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        for _ in 0..3 {
            let step = rt.begin_step().unwrap();
            let buffers: Vec<_> = (0..3).map(|_| step.alloc(Phase::ACTIVATIONS, 200 * MIB, &stream).unwrap()).collect();
            drop(buffers);
            step.end().unwrap();
        }
        // Between steps the phase keeps its slabs (trim policy `Never`); a persistent request
        // that needs them back gets them: the arena's through recovery, the planned slab's idle
        // pages before the request takes memory at all, as another pool's growth asks.
        let big = rt.alloc(Phase::WEIGHTS, 1600 * MIB, &stream);
        assert!(big.is_ok(), "{strategy:?}: {:?}", big.err());
        let recoveries = if strategy == Strategy::PLANNED { 0 } else { 1 };
        assert_eq!(rt.telemetry().oom_recoveries(), recoveries, "{strategy:?}");
        drop(big);
        // And the phase takes memory again in the next step.
        let step = rt.begin_step().unwrap();
        drop(step.alloc(Phase::ACTIVATIONS, 200 * MIB, &stream).unwrap());
        step.end().unwrap();
    }
}

#[test]
fn release_idle_gives_back_an_arenas_spare_slabs_in_one_call() {
    let rt = pool_slab_runtime(4 * GIB);
    let spec = PhaseSpec::new("activations", Scope::Step)
        .strategy(Strategy::Arena { slab_bytes: 256 * MIB })
        .trim(TrimPolicy::Never);
    rt.set_phase_spec(Phase::ACTIVATIONS, spec).unwrap();
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    let buffers: Vec<_> = (0..3).map(|_| step.alloc(Phase::ACTIVATIONS, 200 * MIB, &stream).unwrap()).collect();
    drop(buffers);
    step.end().unwrap();
    assert_eq!(device.release_idle().unwrap(), 768 * MIB);
    assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).reserved, 0);
}

#[test]
fn impossible_requests_are_refused_up_front() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    assert!(matches!(rt.alloc(Phase::WEIGHTS, 0, &stream), Err(Error::ZeroSize { phase }) if phase == "weights"));
    match rt.alloc(Phase::WEIGHTS, 2 * GIB, &stream) {
        Err(error @ Error::ExceedsDevice { .. }) => {
            let text = error.to_string();
            assert!(text.contains("2 GiB") && text.contains("1 GiB"), "{text}");
        }
        other => panic!("expected ExceedsDevice, got {other:?}"),
    }
    assert_eq!(rt.telemetry().oom_recoveries(), 0, "no recovery attempted");
    let unknown = rt.alloc(phase_of_another_runtime(40), MIB, &stream);
    assert!(matches!(unknown, Err(Error::UnknownPhase { index: 40, count: 5 })));
}

/// A phase of another runtime, which has `index + 1` phases.
fn phase_of_another_runtime(index: u16) -> Phase {
    let other = simulated_runtime(GIB);
    let mut phase = Phase::WEIGHTS;
    for n in 5..=index {
        phase = other.declare_phase(PhaseSpec::new(format!("p{n}"), Scope::Persistent)).unwrap();
    }
    phase
}

// ----- fallback, threads, devices, foreign objects -------------------------------------------------

#[test]
fn without_pools_the_same_api_runs_on_cu_mem_alloc() {
    for config in [
        SimConfig { memory_pools_supported: false, ..SimConfig::with_capacity(GIB) },
        SimConfig { driver_version: 11010, ..SimConfig::with_capacity(GIB) },
    ] {
        let rt = Runtime::builder().simulated(config).build().unwrap();
        let device = rt.device(0).unwrap();
        assert!(!device.memory_pools_supported());
        let stream = device.create_stream().unwrap();
        assert_eq!(rt.pool_handle(Phase::WEIGHTS, &stream).unwrap(), None);
        let weights = rt.alloc(Phase::WEIGHTS, 100 * MIB, &stream).unwrap();
        for _ in 0..3 {
            let step = rt.begin_step().unwrap();
            drop(step.alloc(Phase::ACTIVATIONS, 300 * MIB, &stream).unwrap());
            drop(step.alloc(Phase::WORKSPACE, 10 * MIB, &stream).unwrap());
            // SAFETY: released at the step end.
            unsafe { rt.raw().alloc(Phase::GRADIENTS, 200 * MIB, &stream) }.unwrap();
            let report = step.end().unwrap();
            assert_eq!(report.phase(Phase::GRADIENTS).unwrap().released, 200 * MIB);
        }
        // Deferred frees wait for the stream; recovery waits for them when memory runs out.
        let big = rt.alloc(Phase::OPTIMIZER_STATE, 800 * MIB, &stream).unwrap();
        assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).reserved, 100 * MIB);
        drop((weights, big));
        assert!(rt.take_errors().is_empty());
    }
}

#[test]
fn the_runtime_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<Runtime>();
    shared::<steppool::Device>();
    shared::<steppool::Stream>();
    shared::<steppool::Step>();
    shared::<steppool::Buffer<'static>>();
}

#[test]
fn pools_are_per_device_and_peers_are_granted_access_on_request() {
    let rt =
        Runtime::builder().simulated(SimConfig { capacities: vec![GIB; 2], ..SimConfig::default() }).build().unwrap();
    let (d0, d1) = (rt.device(0).unwrap(), rt.device(1).unwrap());
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let before = rt.alloc(Phase::WEIGHTS, MIB, &s0).unwrap();
    let other = rt.alloc(Phase::WEIGHTS, MIB, &s1).unwrap();
    let devices: Vec<usize> = rt.stats().unwrap().iter().map(|s| s.pool.device).collect();
    assert_eq!(devices, vec![0, 1]);
    let location =
        steppool_sys::CUmemLocation { type_: steppool_sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 1 };
    let access = |phase| {
        let pool = rt.pool_handle(phase, &s0).unwrap().unwrap();
        // SAFETY: a live pool of this runtime's driver.
        unsafe { rt.driver().mem_pool_get_access(pool, location) }.unwrap()
    };
    assert_eq!(access(Phase::WEIGHTS), steppool_sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE, "opt-in");
    d0.enable_peer_access(&d1).unwrap();
    let rw = steppool_sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    assert_eq!(access(Phase::WEIGHTS), rw, "existing pools");
    assert_eq!(access(Phase::OPTIMIZER_STATE), rw, "pools created later");
    drop((before, other));
}

#[test]
fn objects_of_another_runtime_are_refused() {
    let (one, two) = (simulated_runtime(GIB), simulated_runtime(GIB));
    let stream = one.device(0).unwrap().create_stream().unwrap();
    assert!(matches!(two.alloc(Phase::WEIGHTS, MIB, &stream), Err(Error::ForeignStream)));
    assert!(matches!(two.pool_handle(Phase::WEIGHTS, &stream), Err(Error::ForeignStream)));
    // SAFETY: the runtimes check the pointer.
    unsafe {
        let ptr = one.raw().alloc(Phase::WEIGHTS, MIB, &stream).unwrap();
        assert!(matches!(two.raw().free(ptr), Err(Error::UnknownPointer { .. })));
        one.raw().free(ptr).unwrap();
    }
}

#[test]
fn dropping_guards_ends_their_scope_and_keeps_errors_for_later() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    {
        let step = rt.begin_step().unwrap();
        let micro = step.begin_micro_step().unwrap();
        drop(micro);
        // SAFETY: released when the step guard drops.
        unsafe { rt.raw().alloc(Phase::ACTIVATIONS, MIB, &stream) }.unwrap();
    }
    assert_eq!(rt.active_step(), None, "the dropped guard ended the step");
    assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &stream).used, 0);
    assert!(rt.take_errors().is_empty());
    let step = rt.begin_step().unwrap();
    assert_eq!(step.index(), 1);
    step.end().unwrap();
}

#[test]
fn runtimes_share_one_driver_without_sharing_pools() {
    let driver = Driver::simulated(SimConfig::with_capacity(GIB)).unwrap();
    let (one, two) = (Runtime::with_driver(driver.clone()).unwrap(), Runtime::with_driver(driver).unwrap());
    let (s1, s2) = (one.device(0).unwrap().create_stream().unwrap(), two.device(0).unwrap().create_stream().unwrap());
    let a = one.alloc(Phase::WEIGHTS, 300 * MIB, &s1).unwrap();
    let b = two.alloc(Phase::WEIGHTS, 300 * MIB, &s2).unwrap();
    assert_ne!(one.pool_handle(Phase::WEIGHTS, &s1).unwrap(), two.pool_handle(Phase::WEIGHTS, &s2).unwrap());
    drop((a, b));
}

// ----- regressions ----------------------------------------------------------------------------------

#[test]
fn a_wrapped_streams_pools_go_with_it_while_it_is_still_live() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let raw = rt.driver().stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    // SAFETY: a live stream of the device's primary context, destroyed only after the wrapper,
    // its clones and its buffers are gone, as the contract asks.
    let stream = unsafe { device.wrap_stream(raw) }.unwrap();
    let step = rt.begin_step().unwrap();
    drop(step.alloc(Phase::WORKSPACE, MIB, &stream).unwrap());
    step.end().unwrap();
    assert_eq!(rt.stats().unwrap().len(), 1);
    drop(stream);
    assert!(rt.stats().unwrap().is_empty(), "the pool went with its stream");
    // SAFETY: nothing of steppool uses the stream any more.
    unsafe { rt.driver().stream_destroy(raw) }.unwrap();
    for _ in 0..10 {
        rt.begin_step().unwrap().end().expect("later boundaries never touch the destroyed stream");
    }
    assert!(rt.take_errors().is_empty());
}

#[test]
fn a_step_keeps_the_pools_its_buffers_borrow_until_it_ends() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let raw = rt.driver().stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    // SAFETY: a live stream of the device's primary context, destroyed only after the wrapper,
    // its clones and its buffers are gone.
    let wrapped = unsafe { device.wrap_stream(raw) }.unwrap();
    let step = rt.begin_step().unwrap();
    let buffer = step.alloc(Phase::WORKSPACE, MIB, &stream).unwrap();
    let on_wrapped = step.alloc(Phase::WORKSPACE, MIB, &wrapped).unwrap();
    let (owned_id, wrapped_id) = (stream.id(), wrapped.id());
    drop((stream, wrapped));
    // Each buffer's pool outlives its stream's handles: used and freed in its stream's order.
    buffer.fill(7).unwrap();
    on_wrapped.fill(7).unwrap();
    drop((buffer, on_wrapped));
    let streams = |rt: &Runtime| rt.stats().unwrap().iter().map(|s| s.pool.stream).collect::<Vec<_>>();
    // A wrapped stream's pool went with its last buffer, so the caller may destroy the stream
    // now; the runtime's own stream's pool is held by the step its buffer borrowed.
    assert_eq!(streams(&rt), [owned_id], "{wrapped_id} went with its buffer");
    // SAFETY: the wrapper, its clones and its buffers are gone.
    unsafe { rt.driver().stream_destroy(raw) }.unwrap();
    step.end().unwrap();
    assert!(streams(&rt).is_empty(), "the pool went at the end of the step");
    rt.begin_step().unwrap().end().unwrap();
    assert!(rt.take_errors().is_empty());
}

#[test]
fn threads_freeing_raw_pointers_on_one_stream_never_free_each_other() {
    let rt = simulated_runtime(GIB);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for _ in 0..40_000 {
                    // SAFETY: each thread frees only what it allocated; nothing uses the memory.
                    unsafe {
                        let ptr = rt.raw().alloc(Phase::WEIGHTS, 4096, &stream).unwrap();
                        rt.raw().free(ptr).expect("a thread's own pointer is never unregistered by another");
                    }
                }
            });
        }
    });
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &stream).used, 0);
}

#[test]
fn uses_and_waits_across_devices_record_in_the_other_devices_context() {
    let rt =
        Runtime::builder().simulated(SimConfig { capacities: vec![GIB; 2], ..SimConfig::default() }).build().unwrap();
    let (d0, d1) = (rt.device(0).unwrap(), rt.device(1).unwrap());
    d0.enable_peer_access(&d1).unwrap();
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    s0.wait_stream(&s1).unwrap();
    let mut buffer = rt.alloc(Phase::WEIGHTS, 4096, &s0).unwrap();
    buffer.record_use(&s1);
    drop(buffer);
    assert!(rt.take_errors().is_empty());
    assert_eq!(stats_of(&rt, Phase::WEIGHTS, &s0).used, 0);
    assert_eq!(rt.driver().sim().unwrap().is_ordered_after(s0.raw(), s1.raw()), Some(true));
}

#[test]
fn a_failing_release_still_ends_the_step_and_forgets_every_pointer() {
    let rt = Runtime::builder().simulated(SimConfig::with_capacity(GIB)).checked(true).build().unwrap();
    let device = rt.device(0).unwrap();
    let healthy = device.create_stream().unwrap();
    let raw = rt.driver().stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    // SAFETY: a live stream; it is destroyed early below on purpose, breaking the contract, so
    // that the simulated device (which checks handles) fails the release's frees.
    let doomed = unsafe { device.wrap_stream(raw) }.unwrap();
    rt.raw().begin_step().unwrap();
    // SAFETY: the runtime checks the pointers; nothing uses them on the device.
    let (lost, kept) = unsafe {
        let lost: Vec<_> = (0..3).map(|_| rt.raw().alloc(Phase::ACTIVATIONS, MIB, &doomed).unwrap()).collect();
        (lost, rt.raw().alloc(Phase::ACTIVATIONS, MIB, &healthy).unwrap())
    };
    // SAFETY: breaking the wrap contract on purpose (see above).
    unsafe { rt.driver().stream_destroy(raw) }.unwrap();
    // SAFETY: nothing uses the released pointers.
    let error = unsafe { rt.raw().end_step() }.unwrap_err();
    assert!(error.to_string().contains("cuMemFreeAsync"), "{error}");
    assert_eq!(rt.active_step(), None, "the step ended anyway");
    for ptr in lost.into_iter().chain([kept]) {
        assert!(matches!(rt.raw().check_range(ptr, 1), Err(Error::UseAfterRelease { step: 0, .. })), "forgotten");
    }
    assert_eq!(stats_of(&rt, Phase::ACTIVATIONS, &healthy).used, 0, "the healthy stream's memory was released");
    rt.raw().begin_step().unwrap();
    // SAFETY: as above.
    unsafe { rt.raw().end_step() }.unwrap();
}

#[test]
fn a_new_runtime_never_accepts_a_stream_of_a_dropped_one() {
    let first = simulated_runtime(GIB);
    let stream = first.device(0).unwrap().create_stream().unwrap();
    drop(first);
    for _ in 0..8 {
        let next = simulated_runtime(GIB);
        assert!(matches!(next.alloc(Phase::WEIGHTS, MIB, &stream), Err(Error::ForeignStream)));
    }
}

#[test]
fn phase_specs_the_runtime_cannot_serve_are_refused() {
    let rt = simulated_runtime(GIB);
    for slab_bytes in [0, u64::MAX] {
        let spec = PhaseSpec::new("huge", Scope::Step).strategy(Strategy::Arena { slab_bytes });
        assert!(matches!(rt.declare_phase(spec), Err(Error::InvalidPhaseSpec { phase, .. }) if phase == "huge"));
    }
    let unnamed = rt.set_phase_spec(Phase::WORKSPACE, PhaseSpec::new("", Scope::Step));
    assert!(matches!(unnamed, Err(Error::InvalidPhaseSpec { .. })));
}

#[test]
fn an_arena_waits_for_streams_that_used_a_leaked_buffer_before_reusing_it() {
    let rt = simulated_runtime(GIB);
    let device = rt.device(0).unwrap();
    let (owner, reader) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let step = rt.begin_step().unwrap();
    let mut scratch = step.alloc(Phase::WORKSPACE, MIB, &owner).unwrap();
    // SAFETY: the range is the live buffer; the reader stream uses it.
    unsafe { rt.driver().memset_d8_async(scratch.ptr(), 0, MIB as usize, reader.raw()) }.unwrap();
    scratch.record_use(&reader);
    std::mem::forget(scratch);
    step.end().unwrap();
    assert_eq!(rt.driver().sim().unwrap().is_ordered_after(owner.raw(), reader.raw()), Some(true));
    assert_eq!(stats_of(&rt, Phase::WORKSPACE, &owner).used, 0, "the arena reclaimed the leaked buffer");
}

#[test]
fn the_device_counts_pages_two_pools_took_turns_with_once() {
    const MIB: u64 = 1 << 20;
    let rt = simulated_runtime(1 << 30);
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let chunked = Strategy::Chunked { chunk_bytes: 64 * MIB };
    let first = rt.declare_phase(PhaseSpec::new("first", Scope::Persistent).strategy(chunked)).unwrap();
    let second = rt.declare_phase(PhaseSpec::new("second", Scope::Persistent).strategy(chunked)).unwrap();
    // 64 MiB in the first pool's range, freed: its pages stay mapped until the second pool's
    // range is about to map 64 MiB, and go back first.
    drop(rt.alloc(first, 64 * MIB, &stream).unwrap());
    let held = rt.alloc(second, 64 * MIB, &stream).unwrap();
    assert_eq!(stats_of(&rt, first, &stream).reserved, 0, "the first pool gave its pages back");
    assert_eq!(device.mapped_high_bytes(), 64 * MIB, "the device never held more than one pool's 64 MiB");
    let metrics = rt.telemetry().metrics().unwrap();
    let usage = metrics.total();
    assert_eq!(usage.reserved_high, 128 * MIB, "each pool's own mark: their sum counts the memory twice");
    assert_eq!(usage.pool_reserved_high, 0, "nothing came from the CUDA pools");
    // The page traffic: the first pool mapped 64 MiB and unmapped them, the second mapped them.
    let pages = |phase| metrics.pools.iter().find(|p| p.pool.phase == phase).unwrap().usage.pages;
    assert_eq!((pages(first).mapped, pages(first).unmapped), (64 * MIB, 64 * MIB));
    assert_eq!((pages(second).mapped, pages(second).unmapped), (64 * MIB, 0));
    drop(held);
}

#[test]
fn a_step_phase_gives_back_as_many_pages_as_another_phase_maps() {
    // A training step as PyTorch runs it with its backward threads routed into the step phase:
    // activations and gradients in the step phase, freed; then the optimizer's temporaries in
    // the persistent phase, which maps pages for them in steps of 64 MiB chunks. The step phase
    // keeps its freed pages mapped and gives back, each time, as many as the persistent phase is
    // about to map: in all, about what it maps. (A planned phase once filed a range punched
    // over several such calls once per call; the bytes already punched, summed over the
    // overlapping entries, grew with each call, until one call gave back the whole slab. A
    // chunked phase gave back whole free ranges, whatever it was asked for. On an H200 either
    // meant gigabytes of pages unmapped and mapped again every step.)
    const GIB: u64 = 1 << 30;
    const GRANULE: u64 = 2 * MIB;
    let chunked = Strategy::Chunked { chunk_bytes: 64 * MIB };
    for strategy in [Strategy::PLANNED, chunked] {
        let rt = Runtime::builder().simulated(SimConfig::with_capacity(16 * GIB)).build().unwrap();
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        let untagged = rt.declare_phase(PhaseSpec::new("untagged", Scope::Persistent).strategy(chunked)).unwrap();
        let acts = rt.declare_phase(PhaseSpec::new("forward_backward", Scope::Step).strategy(strategy)).unwrap();
        for (index, length) in [3u64, 5, 7].into_iter().enumerate() {
            let step = rt.begin_step().unwrap();
            let live: Vec<_> =
                (0..48u64).map(|k| step.alloc(acts, length * (k % 3 + 1) * 4 * MIB, &stream).unwrap()).collect();
            // The gradients, made as the activations go: the free activations lie below them.
            let grads: Vec<_> = (0..4).map(|_| step.alloc(acts, 16 * MIB, &stream).unwrap()).collect();
            drop(live);
            let temps: Vec<_> = (0..24).map(|k| rt.alloc(untagged, (8 + k % 4 * 6) * MIB, &stream).unwrap()).collect();
            drop(temps);
            drop(grads);
            let report = step.end().unwrap();
            let pages = |phase| report.phases.iter().find(|p| p.phase == phase).unwrap().pages;
            let (given, taken) = (pages(acts).unmapped, pages(untagged).mapped);
            let name = strategy.name();
            assert!(taken > 0 || index > 0, "{name} step {index}: the persistent phase mapped its temporaries");
            // Each ask is for the persistent phase's next chunk, given back in whole pages.
            assert!(given <= taken + 24 * GRANULE, "{name} step {index}: {given} bytes given back for {taken} mapped");
        }
    }
}
