//! Tests of the capture model (`capture.rs`), one or more per rule, through the same [`Driver`]
//! calls the runtime makes.
//!
//! Every handle in these tests comes from the test's own simulated driver, which validates
//! handles; that is what makes the `unsafe` calls sound here (see the `SAFETY` notes).

use crate::bindings::*;
use crate::sim::tests::code;
use crate::sim::{FaultCode, FaultPlan, SimConfig};
use crate::{CU_STREAM_LEGACY, Driver, DriverError, PoolCounters, PoolProps};

const MIB: u64 = 1 << 20;
const GLOBAL: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
const THREAD_LOCAL: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
const RELAXED: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
const ACTIVE: CUstreamCaptureStatus = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE;
const INVALIDATED: CUstreamCaptureStatus = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED;
const NONE: CUstreamCaptureStatus = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
const AUTO_FREE: u64 = CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0 as u64;

struct Fixture {
    driver: Driver,
    ctx: CUcontext,
    /// A non-blocking stream.
    stream: CUstream,
    /// Another non-blocking stream.
    other: CUstream,
    pool: CUmemoryPool,
}

impl Fixture {
    fn new() -> Self {
        Self::with(SimConfig::with_capacity(64 * MIB))
    }

    fn with(config: SimConfig) -> Self {
        let driver = Driver::simulated(config).unwrap();
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.unwrap();
        let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let other = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let pool = driver.mem_pool_create(&PoolProps::device(0).build()).unwrap();
        Self { driver, ctx, stream, other, pool }
    }

    fn begin(&self, stream: CUstream, mode: CUstreamCaptureMode) -> Result<(), DriverError> {
        // SAFETY: the stream comes from this fixture's driver (or is a special handle).
        unsafe { self.driver.stream_begin_capture(stream, mode) }
    }

    fn end(&self, stream: CUstream) -> Result<CUgraph, DriverError> {
        // SAFETY: as above.
        unsafe { self.driver.stream_end_capture(stream) }
    }

    fn status(&self, stream: CUstream) -> CUstreamCaptureStatus {
        // SAFETY: as above.
        unsafe { self.driver.stream_capture_info(stream) }.unwrap().status
    }

    fn alloc(&self, bytes: u64, stream: CUstream) -> Result<CUdeviceptr, DriverError> {
        // SAFETY: pool and stream come from this fixture's driver.
        unsafe { self.driver.mem_alloc_from_pool_async(bytes as usize, self.pool, stream) }
    }

    fn free(&self, ptr: CUdeviceptr, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: the stream comes from this driver; the simulated device checks the pointer.
        unsafe { self.driver.mem_free_async(ptr, stream) }
    }

    fn instantiate(&self, graph: CUgraph, flags: u64) -> Result<CUgraphExec, DriverError> {
        // SAFETY: the graph comes from this driver, which checks it.
        unsafe { self.driver.graph_instantiate(graph, flags) }
    }

    fn launch(&self, exec: CUgraphExec, stream: CUstream) -> Result<(), DriverError> {
        // SAFETY: exec and stream come from this driver.
        unsafe { self.driver.graph_launch(exec, stream) }
    }

    fn graph_memory(&self) -> PoolCounters {
        self.driver.device_graph_mem_counters(0).unwrap()
    }

    /// The pool's used bytes, read in relaxed mode: a pool attribute is a potentially unsafe
    /// call, which a global capture prohibits.
    fn pool_used(&self) -> u64 {
        let mode = self.driver.thread_exchange_capture_mode(RELAXED).unwrap();
        // SAFETY: the pool comes from this driver.
        let used = unsafe { self.driver.mem_pool_counters(self.pool) }.unwrap().used;
        self.driver.thread_exchange_capture_mode(mode).unwrap();
        used
    }

    /// Captures on `stream`: allocations of `sizes`, each freed in the graph when `free_all`.
    fn capture(&self, sizes: &[u64], free_all: bool) -> (CUgraph, Vec<CUdeviceptr>) {
        self.begin(self.stream, GLOBAL).unwrap();
        let ptrs: Vec<_> = sizes.iter().map(|&b| self.alloc(b, self.stream).unwrap()).collect();
        if free_all {
            for &ptr in &ptrs {
                self.free(ptr, self.stream).unwrap();
            }
        }
        (self.end(self.stream).unwrap(), ptrs)
    }
}

#[test]
fn a_capture_begins_reports_itself_and_ends_with_its_graph() {
    let f = Fixture::new();
    assert_eq!(f.status(f.stream), NONE);
    f.begin(f.stream, GLOBAL).unwrap();
    // SAFETY: handles of this driver.
    let info = unsafe { f.driver.stream_capture_info(f.stream) }.unwrap();
    assert_eq!(info.status, ACTIVE);
    assert!(info.capturing() && info.id != 0 && !info.graph.is_null());
    // SAFETY: as above.
    assert_eq!(unsafe { f.driver.stream_is_capturing(f.stream) }.unwrap(), ACTIVE);
    assert_eq!(f.status(f.other), NONE, "other streams are not capturing");
    let graph = f.end(f.stream).unwrap();
    assert_eq!(graph, info.graph);
    assert_eq!(f.status(f.stream), NONE);
    f.begin(f.stream, RELAXED).unwrap();
    // SAFETY: as above.
    let second = unsafe { f.driver.stream_capture_info(f.stream) }.unwrap();
    assert_ne!(second.id, info.id, "each sequence has its own id");
    f.end(f.stream).unwrap();
}

#[test]
fn captures_refuse_the_legacy_stream_nesting_bad_modes_and_ends_without_a_begin() {
    let f = Fixture::new();
    assert_eq!(code(f.begin(CU_STREAM_LEGACY, GLOBAL)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(code(f.begin(f.stream, CUstreamCaptureMode(7))), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_ILLEGAL_STATE);
    f.begin(f.stream, GLOBAL).unwrap();
    assert_eq!(code(f.begin(f.stream, GLOBAL)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(f.status(f.stream), ACTIVE, "a refused nested begin leaves the capture as it was");
    f.end(f.stream).unwrap();
}

#[test]
fn allocations_under_capture_are_graph_nodes_that_take_no_memory_until_launch() {
    let f = Fixture::new();
    f.begin(f.stream, GLOBAL).unwrap();
    let ptr = f.alloc(3 * MIB, f.stream).unwrap();
    assert_ne!(ptr, 0);
    assert_eq!(f.pool_used(), 0, "the pool only parameterises the node");
    assert_eq!(f.graph_memory(), PoolCounters::default(), "nothing is mapped at capture");
    let (free, total) = f.driver.mem_get_info().unwrap();
    assert_eq!(free, total);
    let graph = f.end(f.stream).unwrap();
    let exec = f.instantiate(graph, AUTO_FREE).unwrap();
    assert_eq!(f.graph_memory().used, 0, "instantiation maps nothing in this model");
    f.launch(exec, f.stream).unwrap();
    let memory = f.graph_memory();
    assert_eq!((memory.used, memory.reserved), (4 * MIB, 4 * MIB), "3 MiB rounded to 2 MiB granules");
    assert_eq!(f.driver.mem_get_info().unwrap().0, 60 * MIB, "graph memory counts against the device");
}

#[test]
fn a_synchronize_or_query_of_a_capturing_stream_invalidates_the_capture() {
    let f = Fixture::new();
    type Wait = fn(&Fixture) -> Result<(), DriverError>;
    let waits: [(&str, Wait); 3] = [
        // SAFETY: handles of this fixture's driver.
        ("stream synchronize", |f| unsafe { f.driver.stream_synchronize(f.stream) }),
        // SAFETY: handles of this fixture's driver, which checks them.
        ("stream query", |f| unsafe { f.driver.stream_query(f.stream) }.map(drop)),
        ("context synchronize", |f| f.driver.context_synchronize()),
    ];
    for (name, wait) in waits {
        f.begin(f.stream, GLOBAL).unwrap();
        f.alloc(MIB, f.stream).unwrap();
        assert_eq!(code(wait(&f)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "{name}");
        assert_eq!(f.status(f.stream), INVALIDATED, "{name}");
        assert_eq!(code(f.alloc(MIB, f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{name}");
        assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{name}");
        assert_eq!(f.status(f.stream), NONE, "{name}: the end closes the capture");
        // SAFETY: as above.
        unsafe { f.driver.stream_synchronize(f.stream) }.unwrap();
    }
    assert_eq!(f.graph_memory(), PoolCounters::default());
}

#[test]
fn a_free_under_capture_must_name_a_graph_allocation() {
    let f = Fixture::new();
    let eager = f.alloc(MIB, f.stream).unwrap();
    f.begin(f.stream, GLOBAL).unwrap();
    // Refused, and the capture goes on, as on an H200.
    assert_eq!(code(f.free(eager, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(f.status(f.stream), ACTIVE);
    let graph = f.end(f.stream).unwrap();
    // SAFETY: just returned; nothing else holds it.
    unsafe { f.driver.graph_destroy(graph) }.unwrap();
    f.free(eager, f.stream).unwrap();
    f.begin(f.stream, GLOBAL).unwrap();
    let ptr = f.alloc(MIB, f.stream).unwrap();
    f.free(ptr, f.stream).unwrap();
    assert_eq!(code(f.free(ptr, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE, "freed twice in one capture");
    assert_eq!(f.status(f.stream), ACTIVE);
    let graph = f.end(f.stream).unwrap();
    // SAFETY: just returned; nothing else holds it.
    unsafe { f.driver.graph_destroy(graph) }.unwrap();
}

#[test]
fn relaunching_a_graph_whose_allocation_was_never_freed_fails_unless_auto_free() {
    let f = Fixture::new();
    let (graph, ptrs) = f.capture(&[MIB], false);
    let exec = f.instantiate(graph, 0).unwrap();
    f.launch(exec, f.stream).unwrap();
    assert_eq!(code(f.launch(exec, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
    // Freed outside the graph, the allocation no longer blocks a relaunch, at the same address.
    f.free(ptrs[0], f.stream).unwrap();
    assert_eq!(code(f.free(ptrs[0], f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE, "not live any more");
    f.launch(exec, f.stream).unwrap();
    // SAFETY: a live graph allocation of this driver.
    unsafe { f.driver.memset_d8_async(ptrs[0], 7, MIB as usize, f.stream) }.unwrap();
    // SAFETY: as above.
    unsafe { f.driver.graph_exec_destroy(exec) }.unwrap();
    // Auto-free frees what the earlier launch left live, and the address does not move.
    let exec = f.instantiate(graph, AUTO_FREE).unwrap();
    for _ in 0..3 {
        f.launch(exec, f.stream).unwrap();
        // SAFETY: as above.
        unsafe { f.driver.memset_d8_async(ptrs[0], 7, MIB as usize, f.stream) }.unwrap();
    }
    f.free(ptrs[0], f.stream).unwrap();
}

#[test]
fn graph_memory_stays_associated_until_the_executable_goes_and_trim_gives_it_back() {
    let f = Fixture::new();
    let (graph, ptrs) = f.capture(&[MIB, 3 * MIB, MIB], true);
    assert_eq!(ptrs.len(), 3);
    let exec = f.instantiate(graph, 0).unwrap();
    assert_eq!(code(f.instantiate(graph, 0)), CUresult::CUDA_ERROR_INVALID_VALUE, "one executable at a time");
    for _ in 0..3 {
        f.launch(exec, f.stream).unwrap();
    }
    // The three are alive together: 2 + 4 + 2 MiB of granules.
    let memory = f.graph_memory();
    assert_eq!((memory.used, memory.reserved, memory.used_high), (8 * MIB, 8 * MIB, 8 * MIB));
    assert_eq!(code(f.free(ptrs[0], f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE, "freed in the graph");
    f.driver.device_graph_mem_trim(0).unwrap();
    assert_eq!(f.graph_memory().reserved, 8 * MIB, "a live executable keeps its memory");
    // SAFETY: handles of this driver.
    unsafe { f.driver.graph_exec_destroy(exec) }.unwrap();
    let memory = f.graph_memory();
    assert_eq!((memory.used, memory.reserved), (0, 8 * MIB), "reserved until trimmed");
    f.driver.device_graph_mem_trim(0).unwrap();
    assert_eq!(f.graph_memory().reserved, 0);
    assert_eq!(f.graph_memory().reserved_high, 8 * MIB);
    let (free, total) = f.driver.mem_get_info().unwrap();
    assert_eq!(free, total);
    f.instantiate(graph, 0).unwrap();
    // SAFETY: as above.
    unsafe { f.driver.graph_destroy(graph) }.unwrap();
    // SAFETY: as above.
    assert_eq!(code(unsafe { f.driver.graph_destroy(graph) }), CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn a_destroyed_executable_leaves_its_unfreed_allocations_live_and_counted() {
    let f = Fixture::new();
    let (graph, ptrs) = f.capture(&[MIB, MIB], false);
    let exec = f.instantiate(graph, 0).unwrap();
    f.launch(exec, f.stream).unwrap();
    // SAFETY: handles of this driver.
    unsafe { f.driver.graph_exec_destroy(exec) }.unwrap();
    // SAFETY: as above.
    unsafe { f.driver.graph_destroy(graph) }.unwrap();
    assert_eq!(f.graph_memory().used, 4 * MIB, "two live allocations of 2 MiB granules");
    f.free(ptrs[0], f.stream).unwrap();
    // SAFETY: a live graph allocation, freed once; nothing uses it.
    unsafe { f.driver.mem_free(ptrs[1]) }.unwrap();
    assert_eq!(f.graph_memory().used, 0);
    f.driver.device_graph_mem_trim(0).unwrap();
    assert_eq!(f.graph_memory().reserved, 0);
}

#[test]
fn a_launch_the_device_cannot_hold_is_out_of_memory_and_changes_nothing() {
    // The segment model, for a device of a few granules.
    let f = Fixture::with(SimConfig { pool_unit: None, ..SimConfig::with_capacity(8 * MIB) });
    let held = f.alloc(6 * MIB, f.other).unwrap();
    let (graph, _) = f.capture(&[4 * MIB], true);
    let exec = f.instantiate(graph, 0).unwrap();
    assert_eq!(code(f.launch(exec, f.stream)), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(f.graph_memory(), PoolCounters::default());
    f.free(held, f.other).unwrap();
    // SAFETY: handles of this driver.
    unsafe { f.driver.stream_synchronize(f.other) }.unwrap();
    f.launch(exec, f.stream).unwrap();
    assert_eq!(f.graph_memory().used, 4 * MIB);
}

#[test]
// SAFETY: handles of this fixture's driver, which checks them.
fn unsafe_calls_follow_the_capture_modes() {
    // The calling thread's own capture: global and thread-local prohibit, relaxed does not.
    for (mode, prohibited) in [(GLOBAL, true), (THREAD_LOCAL, true), (RELAXED, false)] {
        let f = Fixture::new();
        f.begin(f.stream, mode).unwrap();
        let result = f.driver.mem_alloc(4096);
        if prohibited {
            assert_eq!(code(result), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "{mode:?}");
            assert_eq!(f.status(f.stream), INVALIDATED, "{mode:?}");
            // SAFETY: the pool comes from this driver.
            assert_eq!(
                // SAFETY: handles of this fixture's driver, which checks them.
                code(unsafe { f.driver.mem_pool_trim_to(f.pool, 0) }),
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            );
            assert_eq!(
                // SAFETY: handles of this fixture's driver, which checks them.
                code(unsafe { f.driver.mem_pool_counters(f.pool) }),
                CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            );
            let props = crate::PoolProps::device(0).build();
            assert_eq!(code(f.driver.mem_pool_create(&props)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            // Graph memory may be trimmed in every mode.
            f.driver.device_graph_mem_trim(0).unwrap();
        } else {
            let ptr = result.unwrap();
            // SAFETY: allocated just above; nothing uses it.
            unsafe { f.driver.mem_free(ptr) }.unwrap();
            f.driver.device_graph_mem_trim(0).unwrap();
            assert_eq!(f.status(f.stream), ACTIVE);
        }
        f.end(f.stream).map(drop).unwrap_or_else(|e| assert!(prohibited, "{e}"));
    }
    // A thread in relaxed mode may make them even during its own global capture.
    let f = Fixture::new();
    f.begin(f.stream, GLOBAL).unwrap();
    assert_eq!(f.driver.thread_exchange_capture_mode(RELAXED).unwrap(), GLOBAL);
    let ptr = f.driver.mem_alloc(4096).unwrap();
    assert_eq!(f.driver.thread_exchange_capture_mode(GLOBAL).unwrap(), RELAXED);
    // SAFETY: allocated just above; nothing uses it.
    assert_eq!(code(unsafe { f.driver.mem_free(ptr) }), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(code(f.driver.thread_exchange_capture_mode(CUstreamCaptureMode(9))), CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn another_threads_global_capture_prohibits_global_mode_threads_only() {
    let f = Fixture::new();
    f.begin(f.stream, GLOBAL).unwrap();
    let (driver, ctx) = (&f.driver, f.ctx as usize);
    let (in_global, in_thread_local) = std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: the fixture's context, retained for its whole life.
                unsafe { driver.context_set_current(ctx as CUcontext) }.unwrap();
                let thread_local_mode = driver.thread_exchange_capture_mode(THREAD_LOCAL).unwrap();
                assert_eq!(thread_local_mode, GLOBAL, "each thread starts in global mode");
                let allowed = driver.mem_alloc(4096);
                driver.thread_exchange_capture_mode(GLOBAL).unwrap();
                let refused = driver.mem_alloc(4096);
                (refused.map(drop), allowed)
            })
            .join()
            .unwrap()
    });
    assert_eq!(code(in_global), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    let ptr = in_thread_local.unwrap();
    assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "the refusal invalidated it");
    // SAFETY: allocated above; nothing uses it.
    unsafe { f.driver.mem_free(ptr) }.unwrap();
}

#[test]
fn a_non_relaxed_capture_must_end_on_its_own_thread() {
    let f = Fixture::new();
    for (mode, expected) in [(GLOBAL, Some(CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)), (RELAXED, None)] {
        f.begin(f.stream, mode).unwrap();
        let (driver, stream, ctx) = (&f.driver, f.stream as usize, f.ctx as usize);
        let ended = std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    // SAFETY: the fixture's context and stream, alive for its whole life.
                    unsafe { driver.context_set_current(ctx as CUcontext) }.unwrap();
                    // SAFETY: as above.
                    unsafe { driver.stream_end_capture(stream as CUstream) }.map(|g| g as usize)
                })
                .join()
                .unwrap()
        });
        match expected {
            Some(expected) => {
                assert_eq!(code(ended), expected);
                assert_eq!(f.status(f.stream), ACTIVE, "the capture goes on");
                f.end(f.stream).unwrap();
            }
            None => assert_ne!(ended.unwrap(), 0),
        }
    }
}

#[test]
fn the_legacy_stream_cannot_be_used_while_a_blocking_stream_captures() {
    let f = Fixture::new();
    let blocking = f.driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT).unwrap();
    f.begin(f.stream, GLOBAL).unwrap();
    // SAFETY: special handle; a current context is set.
    unsafe { f.driver.stream_synchronize(CU_STREAM_LEGACY) }.unwrap();
    f.end(f.stream).unwrap();
    f.begin(blocking, GLOBAL).unwrap();
    // SAFETY: as above.
    let asked = unsafe { f.driver.stream_is_capturing(CU_STREAM_LEGACY) };
    assert_eq!(code(asked), CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    assert_eq!(f.status(blocking), ACTIVE, "asking does not invalidate");
    assert_eq!(code(f.alloc(MIB, CU_STREAM_LEGACY)), CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    assert_eq!(f.status(blocking), INVALIDATED);
    assert_eq!(code(f.end(blocking)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    f.alloc(MIB, CU_STREAM_LEGACY).unwrap();
}

#[test]
fn events_fork_streams_into_a_capture_which_must_join_them_back() {
    let f = Fixture::new();
    let (fork, join) = (
        f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap(),
        f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap(),
    );
    // An event recorded in a capture cannot be queried or waited for from the host: refused, and
    // the capture is invalidated (as on an H200).
    for query in [true, false] {
        f.begin(f.stream, GLOBAL).unwrap();
        // SAFETY: events and streams of this driver.
        let asked = unsafe {
            f.driver.event_record(fork, f.stream).unwrap();
            if query { f.driver.event_query(fork).map(drop) } else { f.driver.event_synchronize(fork) }
        };
        assert_eq!(code(asked), CUresult::CUDA_ERROR_CAPTURED_EVENT);
        assert_eq!(f.status(f.stream), INVALIDATED);
        assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    for joined in [false, true] {
        f.begin(f.stream, GLOBAL).unwrap();
        // SAFETY: events and streams of this driver.
        unsafe {
            f.driver.event_record(fork, f.stream).unwrap();
            f.driver.stream_wait_event(f.other, fork).unwrap();
        }
        assert_eq!(f.status(f.other), ACTIVE, "the wait forked `other` into the capture");
        let ptr = f.alloc(MIB, f.other).unwrap();
        f.free(ptr, f.other).unwrap();
        if joined {
            // SAFETY: as above.
            unsafe {
                f.driver.event_record(join, f.other).unwrap();
                f.driver.stream_wait_event(f.stream, join).unwrap();
            }
        }
        assert_eq!(code(f.end(f.other)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "not its origin");
        let ended = f.end(f.stream);
        if joined {
            ended.unwrap();
        } else {
            assert_eq!(code(ended), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
        }
        assert_eq!(f.status(f.other), NONE, "the end releases the forked stream");
    }
}

#[test]
fn captures_are_isolated_from_outside_events_and_from_each_other() {
    let f = Fixture::new();
    let event = f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    // SAFETY: events and streams of this driver.
    unsafe { f.driver.event_record(event, f.other) }.unwrap();
    f.begin(f.stream, GLOBAL).unwrap();
    assert_eq!(
        // SAFETY: handles of this fixture's driver, which checks them.
        code(unsafe { f.driver.stream_wait_event(f.stream, event) }),
        CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
    );
    assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    f.begin(f.stream, GLOBAL).unwrap();
    f.begin(f.other, GLOBAL).unwrap();
    // SAFETY: handles of this fixture's driver, which checks them.
    unsafe { f.driver.event_record(event, f.other) }.unwrap();
    // SAFETY: handles of this fixture's driver, which checks them.
    assert_eq!(code(unsafe { f.driver.stream_wait_event(f.stream, event) }), CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE);
    assert_eq!(f.status(f.stream), INVALIDATED);
    assert_eq!(f.status(f.other), INVALIDATED);
    assert!(f.end(f.stream).is_err() && f.end(f.other).is_err());
}

#[test]
fn captured_work_is_checked_against_live_and_captured_memory() {
    let f = Fixture::new();
    let eager = f.alloc(MIB, f.other).unwrap();
    f.begin(f.stream, GLOBAL).unwrap();
    let ptr = f.alloc(MIB, f.stream).unwrap();
    // SAFETY: ranges checked by the simulated device; streams of this driver.
    unsafe {
        f.driver.memset_d8_async(ptr, 1, MIB as usize, f.stream).unwrap();
        f.driver.memset_d8_async(eager, 1, MIB as usize, f.stream).unwrap();
        assert_eq!(
            code(f.driver.memset_d8_async(ptr, 1, 2 * MIB as usize, f.stream)),
            CUresult::CUDA_ERROR_INVALID_VALUE
        );
    }
    assert_eq!(code(f.end(f.stream)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    // The failed capture's graph is gone, and its allocation's address with it.
    // SAFETY: as above.
    assert_eq!(code(unsafe { f.driver.memset_d8_async(ptr, 1, 1, f.other) }), CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn graph_memory_attributes_reset_only_their_high_water_marks() {
    use CUgraphMem_attribute as A;
    let f = Fixture::new();
    let (graph, _) = f.capture(&[MIB], true);
    let exec = f.instantiate(graph, 0).unwrap();
    f.launch(exec, f.stream).unwrap();
    // SAFETY: handles of this driver.
    unsafe { f.driver.graph_exec_destroy(exec) }.unwrap();
    f.driver.device_graph_mem_trim(0).unwrap();
    assert_eq!(f.graph_memory(), PoolCounters { reserved: 0, reserved_high: 2 * MIB, used: 0, used_high: 2 * MIB });
    f.driver.device_set_graph_mem_attribute(0, A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, 0).unwrap();
    f.driver.device_set_graph_mem_attribute(0, A::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH, 0).unwrap();
    assert_eq!(f.graph_memory(), PoolCounters::default());
    for (attribute, value) in [(A::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, 5), (A::CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, 0)] {
        let refused = f.driver.device_set_graph_mem_attribute(0, attribute, value);
        assert_eq!(code(refused), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    assert_eq!(code(f.driver.device_graph_mem_attribute(0, A(17))), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(code(f.driver.device_graph_mem_trim(3)), CUresult::CUDA_ERROR_INVALID_DEVICE);
}

#[test]
fn graph_handles_are_checked_and_flags_known() {
    let f = Fixture::new();
    f.begin(f.stream, GLOBAL).unwrap();
    // SAFETY: the simulated device checks every handle.
    let capturing = unsafe { f.driver.stream_capture_info(f.stream) }.unwrap().graph;
    assert_eq!(code(f.instantiate(capturing, 0)), CUresult::CUDA_ERROR_INVALID_VALUE, "still being captured");
    let graph = f.end(f.stream).unwrap();
    assert_eq!(code(f.instantiate(graph, 1 << 9)), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert_eq!(code(f.instantiate(f.stream as CUgraph, 0)), CUresult::CUDA_ERROR_INVALID_VALUE);
    let exec = f.instantiate(graph, 0).unwrap();
    let second = f.instantiate(graph, 0).unwrap();
    assert_ne!(exec, second, "a graph without memory nodes may have several executables");
    // SAFETY: handles of this fixture's driver, which checks them.
    unsafe { f.driver.graph_exec_destroy(exec) }.unwrap();
    assert_eq!(code(f.launch(exec, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
    // SAFETY: handles of this fixture's driver, which checks them.
    assert_eq!(code(unsafe { f.driver.graph_exec_destroy(exec) }), CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn a_graph_with_memory_nodes_cannot_be_launched_into_a_capture() {
    let f = Fixture::new();
    let (graph, _) = f.capture(&[MIB], true);
    let exec = f.instantiate(graph, 0).unwrap();
    f.begin(f.other, GLOBAL).unwrap();
    assert_eq!(code(f.launch(exec, f.other)), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(code(f.end(f.other)), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
}

#[test]
fn older_drivers_lack_the_graph_memory_entry_points() {
    let f = Fixture::with(SimConfig { driver_version: 11020, ..SimConfig::with_capacity(64 * MIB) });
    match f.driver.device_graph_mem_trim(0) {
        Err(DriverError::MissingSymbol { symbol, .. }) => assert_eq!(symbol, "cuDeviceGraphMemTrim"),
        other => panic!("11.2 has no graph memory nodes: {other:?}"),
    }
    // SAFETY: a stream of this driver.
    let info = unsafe { f.driver.stream_capture_info(f.stream) };
    assert!(matches!(info, Err(DriverError::MissingSymbol { .. })));
    f.begin(f.stream, GLOBAL).unwrap();
    f.end(f.stream).unwrap();
}

#[test]
fn the_fault_plan_covers_the_capture_entry_points() {
    let f = Fixture::new();
    let sim = f.driver.sim().unwrap();
    for name in ["cuStreamBeginCapture_v2", "cuStreamGetCaptureInfo_v2", "cuGraphLaunch", "cuDeviceGraphMemTrim"] {
        sim.set_faults(Some(FaultPlan::nth(1, FaultCode::CaptureInvalidated).calls(&[name])));
        let result = match name {
            "cuStreamBeginCapture_v2" => f.begin(f.stream, GLOBAL),
            // SAFETY: a stream of this driver.
            "cuStreamGetCaptureInfo_v2" => unsafe { f.driver.stream_capture_info(f.stream) }.map(drop),
            "cuGraphLaunch" => f.launch(std::ptr::null_mut(), f.stream),
            _ => f.driver.device_graph_mem_trim(0),
        };
        assert_eq!(code(result), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{name}");
    }
    sim.set_faults(None);
    assert_eq!(sim.faults_fired(), 4);
    f.begin(f.stream, GLOBAL).unwrap();
}

#[test]
fn the_capture_epoch_moves_before_a_stream_begins_or_joins_a_capture() {
    let f = Fixture::new();
    let epoch = || f.driver.capture_epoch().expect("the simulated device has a capture epoch");
    let fork = f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    let start = epoch();
    // Questions, allocations and work outside capture leave it where it is.
    assert_eq!(f.status(f.stream), NONE);
    let ptr = f.alloc(MIB, f.stream).unwrap();
    f.free(ptr, f.stream).unwrap();
    // SAFETY: an event and a stream of this driver.
    unsafe { f.driver.event_record(fork, f.other) }.unwrap();
    // SAFETY: as above.
    unsafe { f.driver.stream_wait_event(f.stream, fork) }.unwrap();
    assert_eq!(epoch(), start, "nothing began a capture");

    f.begin(f.stream, GLOBAL).unwrap();
    let begun = epoch();
    assert_ne!(begun, start, "a capture began");
    // SAFETY: as above.
    unsafe { f.driver.event_record(fork, f.stream) }.unwrap();
    assert_eq!(epoch(), begun, "recording in a capture joins nobody");
    // SAFETY: as above.
    unsafe { f.driver.stream_wait_event(f.other, fork) }.unwrap();
    assert_eq!(f.status(f.other), ACTIVE);
    let joined = epoch();
    assert_ne!(joined, begun, "`other` joined the capture");
    // SAFETY: as above.
    unsafe { f.driver.event_record(fork, f.other) }.unwrap();
    // SAFETY: as above.
    unsafe { f.driver.stream_wait_event(f.stream, fork) }.unwrap();
    f.end(f.stream).unwrap();
    let doomed = f.driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    let ended = epoch();
    // SAFETY: a stream of this driver that nothing uses.
    unsafe { f.driver.stream_destroy(doomed) }.unwrap();
    assert_ne!(epoch(), ended, "a stream went away");

    // While faults are injected every call must reach the plan: no epoch to skip them by.
    let sim = f.driver.sim().unwrap();
    sim.set_faults(Some(FaultPlan::nth(1, FaultCode::CaptureInvalidated).calls(&["cuStreamGetCaptureInfo_v2"])));
    assert_eq!(f.driver.capture_epoch(), None);
    sim.set_faults(None);
    assert!(f.driver.capture_epoch().is_some());
}
