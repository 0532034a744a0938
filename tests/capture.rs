//! Captured steps and the capture-aware runtime, on the simulated device in CI and unchanged on a
//! GPU (`STEPPOOL_DEVICE=cuda`): a planned step captured from its second step and relaunched
//! with no allocator work at the same addresses, deviations and missing plans as typed errors
//! that leave the stream usable, captures the runtime does not own ended cleanly, frees deferred
//! past a capture, and the driver's graph memory nodes as the other mode.

use steppool::{
    CaptureError, CaptureMemory, CaptureMode, CapturedStep, Error, Phase, PhaseSpec, PoolStats, Runtime, Scope,
    Strategy, Stream,
};
use steppool_sys::{CUresult, CUstreamCaptureMode, CUstreamCaptureStatus, PoolProps};
use steppool_tests::{Device, Fact, record_fact, runtime as any_runtime};

const KIB: u64 = 1 << 10;

/// One test at a time: on a GPU every test shares the driver, and a capture in global mode
/// forbids other threads' potentially unsafe calls.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
const MIB: u64 = 1 << 20;

/// A step's allocations: `(bytes, freed at once)` in order; the rest are freed at the end.
const SEQUENCE: [(u64, bool); 5] =
    [(MIB, false), (2 * MIB, true), (512 * KIB, false), (3 * MIB, true), (64 * KIB, false)];

fn setup(strategy: Strategy) -> (Runtime, Phase, Stream) {
    let rt = any_runtime();
    let phase = rt.declare_phase(PhaseSpec::new("captured", Scope::Step).strategy(strategy)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    (rt, phase, stream)
}

fn status(rt: &Runtime, stream: &Stream) -> CUstreamCaptureStatus {
    // SAFETY: the runtime's own live stream.
    unsafe { rt.driver().stream_capture_info(stream.raw()) }.unwrap().status
}

/// Bytes allocated in the phase's CUDA pool, where the simulated device shows its layout; 0 on a
/// GPU.
fn cuda_pool_used(rt: &Runtime, phase: Phase, stream: &Stream) -> u64 {
    let (Some(sim), Some(handle)) = (rt.driver().sim(), rt.pool_handle(phase, stream).unwrap()) else { return 0 };
    sim.pool_layout(handle).map_or(0, |layout| layout.used)
}

fn pool(rt: &Runtime, phase: Phase, stream: &Stream) -> PoolStats {
    rt.stats().unwrap().into_iter().find(|s| s.pool.phase == phase && s.pool.stream == stream.id()).expect("the pool")
}

/// One eager step of [`SEQUENCE`].
fn eager_step(rt: &Runtime, phase: Phase, stream: &Stream) {
    let step = rt.begin_step().unwrap();
    let mut kept = Vec::new();
    for (bytes, freed) in SEQUENCE {
        let buffer = step.alloc(phase, bytes, stream).unwrap();
        buffer.fill(1).unwrap();
        if freed { drop(buffer) } else { kept.push(buffer) }
    }
    drop(kept);
    step.end().unwrap();
}

/// Captures [`SEQUENCE`] in the active step; returns the captured step and its pointers.
fn capture_step(
    step: &steppool::Step,
    phase: Phase,
    stream: &Stream,
    memory: CaptureMemory,
) -> Result<(CapturedStep, Vec<(u64, u64)>), Error> {
    let capture = step.capture(stream, &[phase], memory, CaptureMode::Global)?;
    let mut ranges = Vec::new();
    let mut kept = Vec::new();
    for (bytes, freed) in SEQUENCE {
        let buffer = capture.alloc(phase, bytes)?;
        ranges.push((buffer.ptr(), bytes));
        if freed { capture.free(buffer)? } else { kept.push(buffer) }
    }
    for buffer in kept {
        capture.free(buffer)?;
    }
    Ok((capture.end()?, ranges))
}

#[test]
fn a_planned_step_is_captured_from_its_second_step_and_relaunched_without_allocator_work() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);

    let step = rt.begin_step().unwrap();
    let (captured, ranges) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    assert_eq!(captured.allocations(), SEQUENCE.len() as u64);
    assert!(captured.slab_bytes() >= 3 * MIB + MIB + 512 * KIB, "the plan holds the peak: {}", captured.slab_bytes());
    // Every allocation lies in the slab, and those alive together do not overlap (the 2 MiB
    // and 3 MiB ones were freed at once, so they may share a range).
    let base = ranges.iter().map(|r| r.0).min().unwrap();
    for &(ptr, bytes) in &ranges {
        assert!(ptr + bytes <= base + captured.slab_bytes(), "{ptr:#x}+{bytes} outside the slab");
    }
    let kept: Vec<_> = SEQUENCE.iter().zip(&ranges).filter(|(s, _)| !s.1).map(|(_, r)| *r).collect();
    for (i, a) in kept.iter().enumerate() {
        for b in &kept[i + 1..] {
            assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "{a:x?} overlaps {b:x?}");
        }
    }
    captured.launch().unwrap();
    let report = step.end().unwrap();
    assert_eq!(report.graph_launches, 1);
    assert_eq!(pool(&rt, phase, &stream).allocations, 0, "the captured step allocated nothing through the pool");

    for _ in 0..3 {
        let step = rt.begin_step().unwrap();
        captured.launch().unwrap();
        let report = step.end().unwrap();
        assert_eq!(report.graph_launches, 1, "ran captured");
        let stats = pool(&rt, phase, &stream);
        assert_eq!((stats.allocations, stats.frees), (0, 0), "a relaunch runs no allocator code");
        assert!(stats.reserved >= captured.slab_bytes(), "the executable holds its slab in the pool");
    }
    let reserved_while_held = pool(&rt, phase, &stream).reserved;
    drop(captured);
    stream.synchronize().unwrap();
    rt.device(0).unwrap().release_idle().unwrap();
    let after = pool(&rt, phase, &stream).reserved;
    assert!(after < reserved_while_held, "the slab went back with the executable: {after} < {reserved_while_held}");
    assert!(rt.take_errors().is_empty());
    // An eager step runs on as before.
    eager_step(&rt, phase, &stream);
}

#[test]
fn a_deviation_during_capture_is_a_typed_error_and_the_step_falls_back_to_eager() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let capture = step.capture(&stream, &[phase], CaptureMemory::PlanSlab, CaptureMode::Global).unwrap();
    capture.alloc(phase, MIB).unwrap();
    match capture.alloc(phase, 8 * MIB) {
        Err(Error::Capture(CaptureError::Deviation { index, requested, planned, .. })) => {
            assert_eq!((index, requested, planned), (1, 8 * MIB, Some(2 * MIB)));
        }
        other => panic!("a larger size than planned deviates: {other:?}"),
    }
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE, "ended cleanly");
    assert!(matches!(capture.alloc(phase, MIB), Err(Error::Capture(CaptureError::Ended))));
    assert!(matches!(capture.end(), Err(Error::Capture(CaptureError::Ended))));
    // The fallback: the same step, eagerly.
    let buffer = step.alloc(phase, 8 * MIB, &stream).unwrap();
    buffer.fill(3).unwrap();
    drop(buffer);
    let report = step.end().unwrap();
    assert_eq!(report.graph_launches, 0);
    assert!(rt.take_errors().is_empty());

    // One allocation more than planned deviates too (the eager step above replanned: record
    // the sequence again first).
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let capture = step.capture(&stream, &[phase], CaptureMemory::PlanSlab, CaptureMode::Global).unwrap();
    for (bytes, freed) in SEQUENCE {
        let buffer = capture.alloc(phase, bytes).unwrap();
        if freed {
            capture.free(buffer).unwrap();
        }
    }
    match capture.alloc(phase, 64 * KIB) {
        Err(Error::Capture(CaptureError::Deviation { index, planned: None, .. })) => assert_eq!(index, SEQUENCE.len()),
        other => panic!("an allocation past the plan deviates: {other:?}"),
    }
    drop(capture);
    step.end().unwrap();
    assert!(rt.take_errors().is_empty());
}

#[test]
fn a_step_without_a_packed_plan_cannot_be_captured_on_its_plan() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    let step = rt.begin_step().unwrap();
    match step.capture(&stream, &[phase], CaptureMemory::PlanSlab, CaptureMode::Global) {
        Err(Error::Capture(CaptureError::NoPlan { phase })) => assert_eq!(phase, "captured"),
        other => panic!("the first step has no plan yet: {other:?}"),
    }
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    step.end().unwrap();
    let (rt, phase, stream) = setup(Strategy::Direct);
    let step = rt.begin_step().unwrap();
    let refused = step.capture(&stream, &[phase], CaptureMemory::PlanSlab, CaptureMode::Global).map(drop);
    assert!(matches!(refused, Err(Error::Capture(CaptureError::NoPlan { .. }))), "{refused:?}");
    step.end().unwrap();
}

#[test]
fn an_allocation_under_a_capture_the_runtime_does_not_own_ends_it_cleanly() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::Direct);
    let step = rt.begin_step().unwrap();
    // SAFETY: the runtime's own live stream.
    unsafe { rt.driver().stream_begin_capture(stream.raw(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }
        .unwrap();
    match step.alloc(phase, MIB, &stream) {
        Err(Error::Capture(CaptureError::Unsafe { operation, stream: id, .. })) => {
            assert_eq!((operation, id), ("allocation", stream.id()));
        }
        other => panic!("an allocation under a foreign capture is refused: {other:?}"),
    }
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE, "not left invalid");
    step.alloc(phase, MIB, &stream).unwrap().fill(0).unwrap();
    step.end().unwrap();

    // A step end while a capture is open on one of its streams ends the capture and still
    // releases the step.
    let step = rt.begin_step().unwrap();
    let buffer = step.alloc(phase, MIB, &stream).unwrap();
    drop(buffer);
    // SAFETY: as above.
    unsafe { rt.driver().stream_begin_capture(stream.raw(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }
        .unwrap();
    match step.end() {
        Err(Error::Capture(CaptureError::Unsafe { operation, .. })) => assert_eq!(operation, "step end"),
        other => panic!("a boundary under a foreign capture is refused: {other:?}"),
    }
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    assert_eq!(pool(&rt, phase, &stream).used, 0, "the step was released");
    rt.begin_step().unwrap().end().unwrap();
}

/// Ends the capture `origin` began, whatever state it is in.
fn end_foreign_capture(rt: &Runtime, origin: &Stream) {
    // SAFETY: the runtime's own live stream.
    if let Ok(graph) = unsafe { rt.driver().stream_end_capture(origin.raw()) } {
        // SAFETY: the graph was just returned and nothing else holds it.
        unsafe { rt.driver().graph_destroy(graph) }.unwrap();
    }
}

#[test]
fn a_capture_begun_after_plan_served_allocations_is_still_seen_by_the_next_one() {
    let _serial = serial();
    for strategy in [Strategy::PLANNED, Strategy::ARENA] {
        let (rt, phase, stream) = setup(strategy);
        let other = rt.device(0).unwrap().create_stream().unwrap();
        eager_step(&rt, phase, &stream);
        let step = rt.begin_step().unwrap();
        // Served (at planned offsets: the step repeats the first) while the stream is not
        // capturing, so the runtime has found it outside capture.
        for (bytes, _) in SEQUENCE {
            drop(step.alloc(phase, bytes, &stream).unwrap());
        }
        if strategy == Strategy::PLANNED {
            let plan = pool(&rt, phase, &stream).plan.expect("planned stats");
            assert_eq!(plan.planned, SEQUENCE.len() as u64, "served from the plan: {plan:?}");
        }

        // A capture begun on the stream behind the runtime's back.
        // SAFETY: the runtime's own live stream.
        unsafe { rt.driver().stream_begin_capture(stream.raw(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }
            .unwrap();
        match step.alloc(phase, MIB, &stream) {
            Err(Error::Capture(CaptureError::Unsafe { operation, stream: id, .. })) => {
                assert_eq!((operation, id), ("allocation", stream.id()), "{strategy:?}");
            }
            other => panic!("{strategy:?}: an allocation under a capture begun since the last one: {other:?}"),
        }
        assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
        drop(step.alloc(phase, MIB, &stream).unwrap());

        // The stream joins a capture begun on another stream by waiting on an event recorded
        // in it.
        let driver = rt.driver();
        let event = driver.event_create(steppool_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        // SAFETY: the runtime's own live streams and an event made here.
        unsafe {
            driver.stream_begin_capture(other.raw(), CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
            driver.event_record(event, other.raw()).unwrap();
        }
        // Found outside capture again, after `other`'s capture began.
        drop(step.alloc(phase, MIB, &stream).unwrap());
        // SAFETY: as above.
        unsafe { driver.stream_wait_event(stream.raw(), event) }.unwrap();
        assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE, "joined");
        let refused = step.alloc(phase, MIB, &stream).map(drop);
        assert!(matches!(refused, Err(Error::Capture(CaptureError::Unsafe { .. }))), "{strategy:?}: {refused:?}");
        end_foreign_capture(&rt, &other);
        // SAFETY: the event is not used again.
        unsafe { driver.event_destroy(event) }.unwrap();
        assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
        drop(step.alloc(phase, MIB, &stream).unwrap());
        step.end().unwrap();
        assert!(rt.take_errors().is_empty(), "{strategy:?}");
    }
}

#[test]
fn frees_of_memory_allocated_before_a_capture_are_deferred_past_it() {
    let _serial = serial();
    let rt = any_runtime();
    let planned = rt.declare_phase(PhaseSpec::new("captured", Scope::Step).strategy(Strategy::PLANNED)).unwrap();
    let direct = rt.declare_phase(PhaseSpec::new("scratch", Scope::Step).strategy(Strategy::Direct)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    eager_step(&rt, planned, &stream);
    let step = rt.begin_step().unwrap();
    let before = step.alloc(direct, MIB, &stream).unwrap();
    let capture = step.capture(&stream, &[planned], CaptureMemory::PlanSlab, CaptureMode::Global).unwrap();
    let buffer = capture.alloc(planned, MIB).unwrap();
    // Freed during the capture: the driver free would be recorded into the graph or invalidate
    // it, so it waits; the CUDA pool still holds the allocation.
    let handle = rt.pool_handle(direct, &stream).unwrap().expect("a CUDA pool");
    // SAFETY: the runtime's own live pool. Read outside the capture: a pool attribute is a
    // potentially unsafe call, which a global capture prohibits.
    let driver_used = || unsafe { rt.driver().mem_pool_counters(handle) }.unwrap().used;
    drop(before);
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE);
    capture.free(buffer).unwrap();
    let captured = capture.end().unwrap();
    let held = driver_used();
    assert!(held >= MIB, "deferred: the CUDA pool still holds it after the capture ({held} bytes)");
    captured.launch().unwrap();
    let report = step.end().unwrap();
    let workspace = report.pools.iter().find(|p| p.pool.phase == direct).unwrap();
    assert_eq!((workspace.frees, workspace.used), (1, 0));
    assert_eq!(driver_used(), 0, "made at the step end, once the capture was over");
    assert!(rt.take_errors().is_empty());
}

#[test]
fn graph_memory_nodes_serve_a_capture_and_are_trimmed_when_the_captured_step_goes() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::Direct);
    let step = rt.begin_step().unwrap();
    let capture = step.capture(&stream, &[phase], CaptureMemory::GraphNodes, CaptureMode::Global).unwrap();
    let a = capture.alloc(phase, 3 * MIB).unwrap();
    let b = capture.alloc(phase, MIB).unwrap();
    let (a_ptr, b_ptr) = (a.ptr(), b.ptr());
    assert_ne!(a_ptr, b_ptr);
    capture.free(a).unwrap();
    let _left = b; // never freed in the graph: the executable frees it at each relaunch
    let captured = capture.end().unwrap();
    assert_eq!(captured.memory(), CaptureMemory::GraphNodes);
    assert_eq!(pool(&rt, phase, &stream).used, 0, "graph allocations are not the pool's");
    for _ in 0..3 {
        captured.launch().unwrap();
    }
    let report = step.end().unwrap();
    assert_eq!(report.graph_launches, 3);
    assert!(report.graph_memory.used >= 4 * MIB, "graph memory in use: {:?}", report.graph_memory);
    assert!(report.graph_memory.reserved >= report.graph_memory.used);
    let metrics = rt.telemetry().metrics().unwrap();
    let device = metrics.devices.iter().find(|d| d.device == 0).unwrap();
    assert_eq!((device.graph_reserved, device.graph_used), (report.graph_memory.reserved, report.graph_memory.used));
    let line = steppool::telemetry::json::step_json(&report).to_string();
    assert!(line.contains("\"graph_launches\":3"), "{line}");
    let text = metrics.to_prometheus();
    let line = format!("steppool_device_graph_reserved_bytes{{device=\"0\"}} {}", device.graph_reserved);
    assert!(text.contains(&line), "{line} in\n{text}");
    drop(captured);
    let report = rt.begin_step().unwrap().end().unwrap();
    assert_eq!(report.graph_memory.used, 0, "{:?}", report.graph_memory);
    assert_eq!(report.graph_memory.reserved, 0, "trimmed when the captured step went: {:?}", report.graph_memory);
    assert!(rt.take_errors().is_empty());
}

#[test]
fn a_capture_invalidated_behind_the_runtime_is_ended_and_reported() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let capture = step.capture(&stream, &[phase], CaptureMemory::PlanSlab, CaptureMode::Global).unwrap();
    capture.alloc(phase, MIB).unwrap();
    // Someone synchronizes the capturing stream: the driver invalidates the capture.
    assert!(stream.synchronize().is_err());
    match capture.end() {
        Err(Error::Capture(CaptureError::Invalidated { stream: id, .. })) => assert_eq!(id, stream.id()),
        other => panic!("an invalidated capture ends without a graph: {other:?}"),
    }
    assert_eq!(status(&rt, &stream), CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    step.end().unwrap();
    eager_step(&rt, phase, &stream);
    assert!(rt.take_errors().is_empty());
}

/// What a call made during a capture returned, and the capture's status after it.
fn during_capture(
    d: &Device,
    stream: &steppool_tests::Stream<'_>,
    mode: CUstreamCaptureMode,
    call: &dyn Fn() -> Result<(), steppool_sys::DriverError>,
) -> (CUresult, CUstreamCaptureStatus) {
    // SAFETY: the harness's live stream, of this driver.
    unsafe { d.driver.stream_begin_capture(stream.raw, mode) }.unwrap();
    let code = match call() {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(error) => error.code().expect("a driver code"),
    };
    // SAFETY: handles of the harness's device, live for the whole test.
    let status = unsafe { d.driver.stream_capture_info(stream.raw) }.unwrap().status;
    // SAFETY: handles of the harness's device, live for the whole test.
    if let Ok(graph) = unsafe { d.driver.stream_end_capture(stream.raw) } {
        // SAFETY: just returned; nobody else has it.
        unsafe { d.driver.graph_destroy(graph) }.unwrap();
    }
    (code, status)
}

/// The capture conformance table: the return code of each call the runtime must avoid during a
/// capture, per capture mode, and whether it invalidated the capture. Recorded as facts and
/// checked against the simulated device's model, on the simulated device and on a GPU alike
/// (the model follows what an H200 answered); every difference is reported at once.
#[test]
fn calls_during_capture_return_the_modelled_codes_in_every_mode() {
    let _serial = serial();
    use CUresult as C;
    use CUstreamCaptureStatus as S;
    let d = Device::open();
    let stream = d.stream();
    let pool = d.pool();
    let event = d.event();
    let mut differences = Vec::new();
    let modes = [
        ("global", CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL),
        ("thread_local", CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        ("relaxed", CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED),
    ];
    for (mode_name, mode) in modes {
        let relaxed = mode == CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: handles of the harness's device, live for the whole test.
        let unsafe_call = if relaxed {
            (C::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_ACTIVE)
        } else {
            (C::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, S::CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        };
        let invalidating = (C::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, S::CU_STREAM_CAPTURE_STATUS_INVALIDATED);
        // SAFETY: handles of the harness's device, live for the whole test.
        let eager = unsafe { d.driver.mem_alloc_from_pool_async(4096, pool.raw, stream.raw) }.unwrap();
        stream.sync();
        type Call<'a> = Box<dyn Fn() -> Result<(), steppool_sys::DriverError> + 'a>;
        let calls: Vec<(&str, Call<'_>, (C, S))> = vec![
            // SAFETY: handles of the harness's device, live for the whole test.
            ("stream_synchronize", Box::new(|| unsafe { d.driver.stream_synchronize(stream.raw) }), invalidating),
            // SAFETY: handles of the harness's device, live for the whole test.
            ("stream_query", Box::new(|| unsafe { d.driver.stream_query(stream.raw) }.map(drop)), invalidating),
            ("context_synchronize", Box::new(|| d.driver.context_synchronize()), invalidating),
            (
                "mem_alloc",
                Box::new(|| {
                    d.driver.mem_alloc(4096).map(|p| {
                        // SAFETY: allocated just above; nothing uses it.
                        let _ = unsafe { d.driver.mem_free(p) };
                    })
                }),
                // SAFETY: handles of the harness's device, live for the whole test.
                unsafe_call,
            ),
            // SAFETY: handles of the harness's device, live for the whole test.
            ("mem_pool_trim_to", Box::new(|| unsafe { d.driver.mem_pool_trim_to(pool.raw, 0) }), unsafe_call),
            (
                "mem_pool_get_attribute",
                // SAFETY: handles of the harness's device, live for the whole test.
                Box::new(|| unsafe { d.driver.mem_pool_counters(pool.raw) }.map(drop)),
                unsafe_call,
            ),
            (
                "mem_pool_create",
                Box::new(|| {
                    d.driver.mem_pool_create(&PoolProps::device(d.device).build()).map(|created| {
                        // SAFETY: created just above; nothing uses it.
                        let _ = unsafe { d.driver.mem_pool_destroy(created) };
                    })
                }),
                unsafe_call,
            ),
            (
                "device_graph_mem_trim",
                Box::new(|| d.driver.device_graph_mem_trim(d.device)),
                (C::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_ACTIVE),
            ),
            (
                "event_query_captured",
                Box::new(|| {
                    // SAFETY: handles of the harness's device, live for the whole test.
                    unsafe { d.driver.event_record(event.raw, stream.raw) }?;
                    // SAFETY: handles of the harness's device, live for the whole test.
                    unsafe { d.driver.event_query(event.raw) }.map(drop)
                }),
                (C::CUDA_ERROR_CAPTURED_EVENT, S::CU_STREAM_CAPTURE_STATUS_INVALIDATED),
            ),
            (
                "mem_free_async_of_eager_memory",
                // SAFETY: handles of the harness's device, live for the whole test.
                Box::new(|| unsafe { d.driver.mem_free_async(eager, stream.raw) }),
                (C::CUDA_ERROR_INVALID_VALUE, S::CU_STREAM_CAPTURE_STATUS_ACTIVE),
            ),
        ];
        for (name, call, expected) in &calls {
            let (code, status) = during_capture(&d, &stream, mode, call.as_ref());
            let seen = format!("{} {:?}", code.name().unwrap_or("?"), status);
            record_fact(&d.driver, &format!("capture_{mode_name}_{name}"), Fact::Text(seen.clone()));
            if (code, status) != *expected {
                differences.push(format!("{mode_name} {name}: {seen}, modelled {expected:?}"));
            }
        }
        // Re-record the event outside capture so it can be queried again, and free the eager
        // allocation if the capture did not take its free.
        // SAFETY: handles of the harness's device, live for the whole test.
        unsafe { d.driver.event_record(event.raw, stream.raw) }.unwrap();
        // SAFETY: handles of the harness's device, live for the whole test.
        let _ = unsafe { d.driver.mem_free_async(eager, stream.raw) };
        stream.sync();
    }
    assert!(differences.is_empty(), "the driver and the model differ:\n{}", differences.join("\n"));
}

/// A graph allocation keeps its address across relaunches, and memory is there at each one.
#[test]
fn a_graph_allocation_keeps_its_address_across_relaunches() {
    let _serial = serial();
    let d = Device::open();
    let stream = d.stream();
    let pool = d.pool();
    // SAFETY: handles of the harness's device, live for the whole test.
    unsafe { d.driver.stream_begin_capture(stream.raw, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }.unwrap();
    // SAFETY: handles of the harness's device, live for the whole test.
    let ptr = unsafe { d.driver.mem_alloc_from_pool_async(MIB as usize, pool.raw, stream.raw) }.unwrap();
    // SAFETY: handles of the harness's device, live for the whole test.
    unsafe { d.driver.memset_d8_async(ptr, 1, MIB as usize, stream.raw) }.unwrap();
    // SAFETY: handles of the harness's device, live for the whole test.
    let graph = unsafe { d.driver.stream_end_capture(stream.raw) }.unwrap();
    let auto_free = steppool_sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64;
    // SAFETY: handles of the harness's device, live for the whole test.
    let exec = unsafe { d.driver.graph_instantiate(graph, auto_free) }.unwrap();
    for _ in 0..3 {
        // SAFETY: handles of the harness's device, live for the whole test.
        unsafe { d.driver.graph_launch(exec, stream.raw) }.unwrap();
        // The allocation is live at its captured address after each launch.
        // SAFETY: handles of the harness's device, live for the whole test.
        unsafe { d.driver.memset_d8_async(ptr, 2, MIB as usize, stream.raw) }.unwrap();
    }
    stream.sync();
    let counters = d.driver.device_graph_mem_counters(d.device).unwrap();
    record_fact(&d.driver, "graph_memory_used_after_relaunches", Fact::Bytes(counters.used));
    record_fact(&d.driver, "graph_memory_reserved_after_relaunches", Fact::Bytes(counters.reserved));
    assert!(counters.used >= MIB && counters.reserved >= counters.used, "{counters:?}");
    // SAFETY: handles of the harness's device, live for the whole test.
    unsafe { d.driver.mem_free_async(ptr, stream.raw) }.unwrap();
    // SAFETY: handles of the harness's device, live for the whole test.
    unsafe { d.driver.graph_exec_destroy(exec) }.unwrap();
    // SAFETY: handles of the harness's device, live for the whole test.
    unsafe { d.driver.graph_destroy(graph) }.unwrap();
    stream.sync();
    d.driver.device_graph_mem_trim(d.device).unwrap();
    let trimmed = d.driver.device_graph_mem_counters(d.device).unwrap();
    record_fact(&d.driver, "graph_memory_reserved_after_trim", Fact::Bytes(trimmed.reserved));
    assert_eq!(trimmed.used, 0, "{trimmed:?}");
}

/// Peak reserved of the captured phase's pool over steps 1.. of a run of `steps` steps: eager
/// throughout, or captured from step 1 and relaunched after.
fn peak_reserved_from_step_one(captured: bool, steps: usize) -> (u64, Option<bool>) {
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);
    let mut graph: Option<CapturedStep> = None;
    let mut peak = 0;
    for _ in 1..steps {
        let step = rt.begin_step().unwrap();
        if !captured {
            drop(step);
            eager_step(&rt, phase, &stream);
        } else {
            if graph.is_none() {
                graph = Some(capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap().0);
            }
            graph.as_ref().unwrap().launch().unwrap();
            assert_eq!(step.end().unwrap().graph_launches, 1);
        }
        peak = peak.max(pool(&rt, phase, &stream).peak_reserved);
    }
    assert!(rt.take_errors().is_empty());
    (peak, graph.map(|graph| graph.slab_lent()))
}

#[test]
fn a_captured_run_reserves_no_more_than_an_eager_planned_run() {
    let _serial = serial();
    let (eager, _) = peak_reserved_from_step_one(false, 5);
    let (captured, lent) = peak_reserved_from_step_one(true, 5);
    assert_eq!(lent, Some(true), "the executable holds the strategy's slab");
    assert!(eager >= 3 * MIB + MIB + 512 * KIB, "the eager run holds its plan: {eager}");
    assert!(captured <= eager, "captured {captured} reserves no more than eager {eager}");
}

/// The ranges of `a` that overlap a range of `b`.
fn overlapping(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    a.iter().copied().filter(|x| b.iter().any(|y| x.0 < y.0 + y.1 && y.0 < x.0 + x.1)).collect()
}

/// One eager step of [`SEQUENCE`] in `step`, with `between` run after each allocation; returns
/// the ranges it was served.
fn eager_in(step: &steppool::Step, phase: Phase, stream: &Stream, between: &dyn Fn()) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    let mut kept = Vec::new();
    for (bytes, freed) in SEQUENCE {
        let buffer = step.alloc(phase, bytes, stream).unwrap();
        buffer.fill(7).unwrap();
        ranges.push((buffer.ptr(), bytes));
        between();
        if freed { drop(buffer) } else { kept.push(buffer) }
    }
    ranges
}

#[test]
fn eager_steps_between_launches_are_served_apart_from_the_lent_slab_until_it_comes_back() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let (captured, graph_ranges) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    assert!(captured.slab_lent());
    captured.launch().unwrap();
    step.end().unwrap();
    let held = pool(&rt, phase, &stream).reserved;

    // An eager step of the phase between launches, the graph launched between its allocations:
    // none of its memory is the graph's.
    let step = rt.begin_step().unwrap();
    let eager = eager_in(&step, phase, &stream, &|| captured.launch().unwrap());
    assert_eq!(overlapping(&eager, &graph_ranges), vec![], "eager {eager:x?} apart from the graph's {graph_ranges:x?}");
    let report = step.end().unwrap();
    assert_eq!(report.graph_launches, SEQUENCE.len() as u64);
    stream.synchronize().unwrap();
    rt.device(0).unwrap().release_idle().unwrap();
    assert_eq!(pool(&rt, phase, &stream).reserved, held, "what it was served apart went back; the slab stayed");
    // The slab stayed mapped at the graph's addresses through the step end and the trim.
    for &(ptr, bytes) in &graph_ranges {
        // SAFETY: the runtime's own live stream; the range is the captured step's.
        unsafe { rt.driver().memset_d8_async(ptr, 0, bytes as usize, stream.raw()) }.unwrap();
    }
    let step = rt.begin_step().unwrap();
    captured.launch().unwrap();
    step.end().unwrap();

    // Dropped, the captured step gives the slab back to the strategy: eager steps are served
    // from it again, and nothing is taken beside it.
    drop(captured);
    let step = rt.begin_step().unwrap();
    let eager = eager_in(&step, phase, &stream, &|| ());
    assert_eq!(overlapping(&eager, &graph_ranges).len(), eager.len(), "{eager:x?} back in the slab {graph_ranges:x?}");
    step.end().unwrap();
    let stats = pool(&rt, phase, &stream);
    assert_eq!(stats.peak_reserved, held, "served from the slab it got back, nothing beside it");
    // And it can be lent again.
    let step = rt.begin_step().unwrap();
    let (again, _) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    assert!(again.slab_lent());
    // The plan may have been repacked since (a plan laid out in allocation order is packed once
    // its sequence repeats), but it is served from the same slab: nothing is taken beside it.
    assert_eq!(pool(&rt, phase, &stream).reserved, held, "lent again, nothing taken beside it");
    again.launch().unwrap();
    step.end().unwrap();
    assert!(rt.take_errors().is_empty());
}

#[test]
fn a_second_captured_step_of_a_phase_takes_a_slab_of_its_own() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let (first, first_ranges) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    let (second, second_ranges) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    assert!(first.slab_lent() && !second.slab_lent());
    assert_eq!(overlapping(&second_ranges, &first_ranges), vec![], "two graphs, two slabs");
    first.launch().unwrap();
    second.launch().unwrap();
    let with_both = (pool(&rt, phase, &stream).reserved, cuda_pool_used(&rt, phase, &stream));
    drop(second);
    step.end().unwrap();
    stream.synchronize().unwrap();
    rt.device(0).unwrap().release_idle().unwrap();
    let with_first = (pool(&rt, phase, &stream).reserved, cuda_pool_used(&rt, phase, &stream));
    // Its pages were unmapped, or, a pool slab, its memory is free in the CUDA pool (whose 32 MiB
    // unit the two slabs may share, so that the pool keeps it).
    assert!(
        with_first.0 < with_both.0 || with_first.1 < with_both.1,
        "the second slab went back: (reserved, pool used) {with_first:?} against {with_both:?}"
    );
    let with_first = with_first.0;
    assert!(with_first >= first.slab_bytes(), "the lent one stayed");
    drop(first);
    assert!(rt.take_errors().is_empty());
}

#[test]
fn a_lent_slab_outlives_the_runtime_handle_and_its_stream_until_the_captured_step_goes() {
    let _serial = serial();
    let (rt, phase, stream) = setup(Strategy::PLANNED);
    let driver = rt.driver().clone();
    eager_step(&rt, phase, &stream);
    let step = rt.begin_step().unwrap();
    let (captured, _) = capture_step(&step, phase, &stream, CaptureMemory::PlanSlab).unwrap();
    captured.launch().unwrap();
    step.end().unwrap();
    // A phase's spec cannot change under it.
    let spec = PhaseSpec::new("captured", Scope::Step).strategy(Strategy::PLANNED);
    assert!(matches!(rt.set_phase_spec(phase, spec), Err(Error::PhaseInUse { .. })));
    drop(stream);
    drop(rt);
    // The pool, its stream and the slab are held by the captured step: it still launches, at
    // the same addresses, and the memory is there.
    let before_drop = device_reserved(&driver);
    assert!(before_drop >= captured.slab_bytes(), "the slab is still held: {before_drop}");
    for _ in 0..2 {
        captured.launch().unwrap();
    }
    drop(captured);
    if driver.kind() == steppool_sys::DriverKind::Simulated {
        assert_eq!(device_reserved(&driver), 0, "everything went back with the captured step");
    }
}

/// Bytes device 0 holds in all (total − free), read through its primary context.
fn device_reserved(driver: &steppool_sys::Driver) -> u64 {
    let ordinal = driver.device(0).unwrap();
    let ctx = driver.primary_context_retain(ordinal).unwrap();
    // SAFETY: the context was just retained.
    unsafe { driver.context_set_current(ctx) }.unwrap();
    let (free, total) = driver.mem_get_info().unwrap();
    // SAFETY: balances the retain above.
    unsafe { driver.primary_context_release(ordinal) }.unwrap();
    total - free
}
