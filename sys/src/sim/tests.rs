//! Tests of the simulated device's model, through the same [`Driver`] calls the runtime makes.
//!
//! Every handle in these tests comes from the test's own simulated driver, which validates
//! handles; that is what makes the `unsafe` calls sound here (see the `SAFETY` notes).

use super::*;
use crate::{CU_STREAM_LEGACY, CU_STREAM_PER_THREAD, Driver, DriverError, DriverVersion, PoolProps};

const MIB: u64 = 1 << 20;

/// The driver code of a call that must fail (the capture model's tests share it).
pub(super) fn code(result: Result<impl std::fmt::Debug, DriverError>) -> CUresult {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error.code().unwrap_or_else(|| panic!("expected a driver code, got {error}")),
    }
}

struct Fixture {
    driver: Driver,
    stream: CUstream,
    other: CUstream,
    pool: CUmemoryPool,
}

impl Fixture {
    fn new(config: SimConfig) -> Self {
        let driver = Driver::simulated(config).unwrap();
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: `ctx` was just retained from this driver.
        unsafe { driver.context_set_current(ctx) }.unwrap();
        let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let other = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        let pool = driver.mem_pool_create(&PoolProps::device(0).build()).unwrap();
        Self { driver, stream, other, pool }
    }

    /// A device of `capacity` bytes in the segment model, whose figures in 2 MiB granules keep
    /// the tests of rules common to both models (stream order, thresholds, attributes, running
    /// out) small; the unit model's own tests follow the probe below.
    fn with_capacity(capacity: u64) -> Self {
        Self::new(SimConfig { pool_unit: None, ..SimConfig::with_capacity(capacity) })
    }

    fn alloc(&self, bytes: u64, stream: CUstream) -> CUdeviceptr {
        // SAFETY: pool and stream come from this fixture's driver.
        unsafe { self.driver.mem_alloc_from_pool_async(bytes as usize, self.pool, stream) }.unwrap()
    }

    fn free(&self, ptr: CUdeviceptr, stream: CUstream) {
        // SAFETY: `ptr` and `stream` come from this fixture's driver; nothing uses `ptr` after.
        unsafe { self.driver.mem_free_async(ptr, stream) }.unwrap();
    }

    fn layout(&self) -> PoolLayout {
        self.driver.sim().unwrap().pool_layout(self.pool).unwrap()
    }

    fn set(&self, attribute: CUmemPool_attribute, value: u64) {
        // SAFETY: the pool comes from this fixture's driver.
        unsafe { self.driver.mem_pool_set_attribute(self.pool, attribute, value) }.unwrap();
    }

    fn keep_everything(&self) {
        self.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX);
    }

    fn sync(&self, stream: CUstream) {
        // SAFETY: the stream comes from this fixture's driver.
        unsafe { self.driver.stream_synchronize(stream) }.unwrap();
    }
}

#[test]
fn one_byte_reserves_one_granule_and_uses_512_bytes() {
    let f = Fixture::with_capacity(1 << 30);
    let ptr = f.alloc(1, f.stream);
    let layout = f.layout();
    assert_eq!((layout.reserved, layout.used), (2 * MIB, 512));
    assert_eq!(ptr % (2 * MIB), 0, "segments start granule-aligned");
    let second = f.alloc(1000, f.stream);
    assert_eq!(second, ptr + 512, "placed right after, rounded to 512");
    assert_eq!(f.layout().used, 512 + 1024);
}

#[test]
fn pool_unit_and_granule_are_configurable() {
    let f = Fixture::new(SimConfig { granule: 64 << 10, pool_unit: None, ..SimConfig::with_capacity(1 << 30) });
    f.alloc(1, f.stream);
    assert_eq!(f.layout().reserved, 64 << 10, "segments of one granule");
    let f =
        Fixture::new(SimConfig { pool_unit: Some(64 << 10), granule: 128 << 10, ..SimConfig::with_capacity(1 << 30) });
    f.alloc(1, f.stream);
    assert_eq!(f.layout().reserved, 64 << 10, "pools map in units");
    f.driver.mem_alloc(1).unwrap();
    let (free, total) = f.driver.mem_get_info().unwrap();
    assert_eq!(total - free, (64 << 10) + (128 << 10), "cuMemAlloc reserves in granules");
}

// ----- the driver's pool, as an H200 answered (benches/results/2026-11-27-h200-pool-probe.jsonl) ---

/// A device whose pools grow in 32 MiB units, the default.
fn driver_config(capacity: u64) -> SimConfig {
    let config = SimConfig::with_capacity(capacity);
    assert_eq!(config.pool_unit, Some(DEFAULT_POOL_UNIT));
    config
}

/// A fixture with the driver's 32 MiB pool unit and its release threshold raised, as PyTorch's
/// `cudaMallocAsync` backend configures the pool the probe ran through.
fn driver_units() -> Fixture {
    let f = Fixture::new(driver_config(8 << 30));
    f.keep_everything();
    f
}

#[test]
fn one_request_in_an_empty_pool_reserves_its_size_in_32_mib_units() {
    let f = driver_units();
    for (bytes, reserved) in [
        (1, 32),
        (512, 32),
        (MIB, 32),
        (2 * MIB + 1, 32),
        (32 * MIB, 32),
        (33 * MIB, 64),
        (64 * MIB + 1, 96),
        (100 * MIB, 128),
        (1024 * MIB, 1024),
    ] {
        let ptr = f.alloc(bytes, f.stream);
        assert_eq!(f.layout().reserved, reserved * MIB, "{bytes} bytes");
        f.free(ptr, f.stream);
        f.sync(f.stream);
        // SAFETY: the pool comes from this fixture's driver.
        unsafe { f.driver.mem_pool_trim_to(f.pool, 0) }.unwrap();
        assert_eq!(f.layout().reserved, 0);
    }
}

#[test]
fn allocations_cross_the_units_of_one_growing_range() {
    let f = driver_units();
    let mut previous = None;
    for index in 1..=48u64 {
        let ptr = f.alloc(5 * MIB, f.stream);
        assert_eq!(f.layout().reserved, (5 * index).next_multiple_of(32) * MIB, "{index} × 5 MiB");
        if let Some(previous) = previous {
            assert_eq!(ptr, previous + 5 * MIB, "end to end, across unit boundaries");
        }
        previous = Some(ptr);
    }
    let f = driver_units();
    let reserved: Vec<u64> = (0..6)
        .map(|_| {
            f.alloc(24 * MIB, f.stream);
            f.layout().reserved / MIB
        })
        .collect();
    assert_eq!(reserved, [32, 64, 96, 96, 128, 160], "six of 24 MiB, as the H200 answered");
}

#[test]
fn freed_neighbours_merge_across_units_and_holes_are_fitted_before_growing() {
    let f = driver_units();
    let a = f.alloc(20 * MIB, f.stream);
    let b = f.alloc(20 * MIB, f.stream);
    assert_eq!(f.layout().reserved, 64 * MIB);
    f.free(a, f.stream);
    f.free(b, f.stream);
    assert_eq!(f.alloc(40 * MIB, f.stream), a, "one free piece across the unit boundary");
    assert_eq!(f.layout().reserved, 64 * MIB);

    let f = driver_units();
    let ptrs: Vec<_> = (0..8).map(|_| f.alloc(8 * MIB, f.stream)).collect();
    assert_eq!(f.layout().reserved, 64 * MIB);
    for &ptr in ptrs.iter().step_by(2) {
        f.free(ptr, f.stream);
    }
    let c = f.alloc(4 * MIB, f.stream);
    assert_eq!(c, ptrs[0], "a hole that fits, lowest first");
    f.alloc(16 * MIB, f.stream);
    assert_eq!(f.layout().reserved, 96 * MIB, "no hole holds 16 MiB: the range grows");
}

#[test]
fn a_unit_goes_back_only_when_nothing_in_it_is_live() {
    let f = Fixture::new(driver_config(1 << 30));
    let a = f.alloc(20 * MIB, f.stream);
    let b = f.alloc(20 * MIB, f.stream);
    let c = f.alloc(30 * MIB, f.stream);
    assert_eq!(f.layout().reserved, 96 * MIB);
    f.free(a, f.stream);
    f.free(c, f.stream);
    f.sync(f.stream);
    let layout = f.layout();
    assert_eq!(layout.reserved, 64 * MIB, "the third unit, idle, went back; b spans the first two");
    assert_eq!(layout.mapped, vec![(a, 64 * MIB)]);
    assert_eq!(layout.total_free(), 44 * MIB, "free bytes of mapped memory only: 0..20 and 40..64");
    f.free(b, f.stream);
    f.sync(f.stream);
    assert_eq!(f.layout().reserved, 0);
    assert_eq!(f.alloc(MIB, f.stream), a, "the range's addresses stay the pool's");
}

#[test]
fn an_idle_units_memory_moves_to_where_the_range_grows() {
    // The H200's driver reserved, after each of 149,624 allocations of 17 traces, the most units
    // that had held a live byte at once: a unit nothing uses is mapped where the range grows.
    let f = driver_units();
    let a = f.alloc(32 * MIB, f.stream);
    let b = f.alloc(32 * MIB, f.stream);
    f.free(a, f.stream);
    let c = f.alloc(48 * MIB, f.stream);
    assert_eq!(c, b + 32 * MIB, "no free piece holds it: the range grows");
    let layout = f.layout();
    assert_eq!(layout.reserved, 96 * MIB, "three units held a live byte at once, not four");
    assert_eq!(layout.mapped, vec![(b, 96 * MIB)], "the first unit's addresses are free, unmapped");
    assert_eq!(f.alloc(32 * MIB, f.stream), a, "and are the pool's still");
    assert_eq!(f.layout().reserved, 128 * MIB);

    // Memory freed on a stream the allocating one is not ordered after stays where it is.
    let f = driver_units();
    let a = f.alloc(32 * MIB, f.stream);
    let b = f.alloc(32 * MIB, f.stream);
    f.free(a, f.stream);
    let c = f.alloc(48 * MIB, f.other);
    assert_eq!(c, b + 32 * MIB);
    assert_eq!(f.layout().reserved, 128 * MIB, "the free is not known complete to the other stream");
    f.free(c, f.other);
    f.sync(f.stream);
    f.sync(f.other);
    f.free(b, f.stream);
    let d = f.alloc(96 * MIB, f.other);
    assert_eq!(d, c);
    let layout = f.layout();
    assert_eq!(layout.reserved, 128 * MIB, "once complete, the first unit's memory moves for any stream");
    assert_eq!(layout.mapped, vec![(b, 128 * MIB)], "b's unit, freed where `other` is not ordered, stays");
}

#[test]
fn same_stream_reuses_a_free_at_once() {
    let f = Fixture::with_capacity(1 << 30);
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    assert_eq!(f.alloc(MIB, f.stream), a);
    assert_eq!(f.layout().reserved, 2 * MIB);
}

#[test]
fn another_stream_reuses_only_once_ordered_after_the_free() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let a = f.alloc(2 * MIB, f.stream);
    f.free(a, f.stream);
    let b = f.alloc(2 * MIB, f.other);
    assert_ne!(a, b, "unordered: a new segment");
    assert_eq!(f.layout().reserved, 4 * MIB);

    // An event recorded after the free and waited on by the other stream orders it.
    let event = f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    let c = f.alloc(2 * MIB, f.stream);
    f.free(c, f.stream);
    // SAFETY: event and streams come from this driver.
    unsafe {
        f.driver.event_record(event, f.stream).unwrap();
        f.driver.stream_wait_event(f.other, event).unwrap();
    }
    assert_eq!(f.alloc(2 * MIB, f.other), c);

    // With the policy off, the same pattern needs a new segment.
    f.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, 0);
    let d = f.alloc(2 * MIB, f.stream);
    f.free(d, f.stream);
    // SAFETY: as above.
    unsafe {
        f.driver.event_record(event, f.stream).unwrap();
        f.driver.stream_wait_event(f.other, event).unwrap();
    }
    assert_ne!(f.alloc(2 * MIB, f.other), d);
}

#[test]
fn synchronization_makes_frees_reusable_by_every_stream() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    f.sync(f.stream);
    assert_eq!(f.alloc(MIB, f.other), a);
}

#[test]
fn a_query_that_finds_work_done_observes_the_frees() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    // SAFETY: the stream comes from this driver.
    assert!(unsafe { f.driver.stream_query(f.stream) }.unwrap());
    assert_eq!(f.alloc(MIB, f.other), a);
}

/// Event and stream calls on the fixture's own handles, for the tests of held work.
struct Events<'a>(&'a Fixture);

impl Events<'_> {
    fn record(&self, stream: CUstream) -> CUevent {
        let event = self.0.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
        self.rerecord(event, stream);
        event
    }

    fn rerecord(&self, event: CUevent, stream: CUstream) {
        // SAFETY: the event and the stream come from this fixture's driver.
        unsafe { self.0.driver.event_record(event, stream) }.unwrap();
    }

    fn done(&self, event: CUevent) -> bool {
        // SAFETY: the event comes from this fixture's driver.
        unsafe { self.0.driver.event_query(event) }.unwrap()
    }

    fn stream_done(&self, stream: CUstream) -> bool {
        // SAFETY: the stream comes from this fixture's driver.
        unsafe { self.0.driver.stream_query(stream) }.unwrap()
    }
}

#[test]
fn held_work_is_not_ready_until_released() {
    let f = Fixture::with_capacity(1 << 30);
    let (sim, e) = (f.driver.sim().unwrap(), Events(&f));
    let before = e.record(f.stream);
    sim.hold_stream(f.stream).unwrap();
    assert!(e.done(before), "work enqueued before the hold is done");
    let held = e.record(f.stream);
    assert!(!e.done(held));
    assert!(!e.stream_done(f.stream));
    assert!(e.stream_done(f.other), "another stream is not held");
    // Work ordered after held work is held too.
    // SAFETY: the stream and the event come from this driver.
    unsafe { f.driver.stream_wait_event(f.other, held) }.unwrap();
    let after = e.record(f.other);
    assert!(!e.done(after));
    assert!(!e.done(held), "a query does not complete held work");
    sim.release_stream(f.stream).unwrap();
    assert!(e.done(held) && e.done(after));
    assert!(e.stream_done(f.stream));
    assert_eq!(sim.hold_stream(0xdead_0000 as CUstream), Err(CUresult::CUDA_ERROR_INVALID_HANDLE));
}

#[test]
fn a_synchronization_completes_held_work_and_the_hold_goes_on() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let (sim, e) = (f.driver.sim().unwrap(), Events(&f));
    sim.hold_stream(f.stream).unwrap();
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    assert!(!e.stream_done(f.stream));
    assert_ne!(f.alloc(MIB, f.other), a, "a free held back is not observed by a query");
    let event = e.record(f.stream);
    // SAFETY: the event comes from this driver.
    unsafe { f.driver.event_synchronize(event) }.unwrap();
    assert!(e.done(event), "waited for, so done");
    assert_eq!(f.alloc(MIB, f.other), a, "a synchronization observes the held free");
    e.rerecord(event, f.stream);
    assert!(!e.done(event), "work enqueued after the wait is held again");
    f.sync(f.stream);
    assert!(e.done(event));
}

#[test]
#[should_panic(expected = "does not count")]
fn calls_are_not_read_from_a_driver_that_does_not_count_them() {
    let f = Fixture::with_capacity(1 << 30);
    f.sync(f.stream);
    f.driver.sim().unwrap().calls("cuStreamSynchronize");
}

#[test]
fn calls_are_counted_by_entry_point() {
    let f = Fixture::new(SimConfig { count_calls: true, ..SimConfig::with_capacity(1 << 30) });
    let sim = f.driver.sim().unwrap();
    let (syncs, queries) = (sim.calls("cuStreamSynchronize"), sim.calls("cuStreamQuery"));
    f.sync(f.stream);
    f.sync(f.other);
    assert!(Events(&f).stream_done(f.stream));
    assert_eq!(sim.calls("cuStreamSynchronize"), syncs + 2);
    assert_eq!(sim.calls("cuStreamQuery"), queries + 1);
    assert_eq!(sim.calls("cuNoSuchCall"), 0);
}

#[test]
fn release_threshold_applies_at_the_next_synchronization() {
    let f = Fixture::with_capacity(1 << 30);
    let a = f.alloc(3 * MIB, f.stream);
    f.free(a, f.stream);
    assert_eq!(f.layout().reserved, 4 * MIB, "no release before a synchronization");
    f.sync(f.stream);
    assert_eq!(f.layout().reserved, 0, "threshold 0 releases idle memory");

    f.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 4 * MIB);
    let b = f.alloc(3 * MIB, f.stream);
    let c = f.alloc(5 * MIB, f.stream);
    f.free(b, f.stream);
    f.free(c, f.stream);
    f.sync(f.stream);
    assert_eq!(f.layout().reserved, 4 * MIB, "the 6 MiB segment goes, keeping the threshold");
}

#[test]
fn trim_releases_largest_idle_segments_while_keeping_the_minimum() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let ptrs: Vec<_> = [2 * MIB, 4 * MIB, 8 * MIB].into_iter().map(|size| f.alloc(size, f.stream)).collect();
    for &ptr in &ptrs {
        f.free(ptr, f.stream);
    }
    // SAFETY: the pool comes from this driver.
    unsafe { f.driver.mem_pool_trim_to(f.pool, 0) }.unwrap();
    assert_eq!(f.layout().reserved, 14 * MIB, "frees not observed complete count as outstanding");
    f.sync(f.stream);
    // SAFETY: as above.
    unsafe { f.driver.mem_pool_trim_to(f.pool, 5 * MIB) }.unwrap();
    assert_eq!(f.layout().reserved, 6 * MIB, "8 MiB released; 4 or 2 more would drop below 5 MiB");
    // SAFETY: as above.
    unsafe { f.driver.mem_pool_trim_to(f.pool, 0) }.unwrap();
    assert_eq!(f.layout().reserved, 0);
}

#[test]
fn out_of_memory_at_capacity() {
    let f = Fixture::with_capacity(16 * MIB);
    let a = f.alloc(10 * MIB, f.stream);
    // SAFETY: pool and stream come from this driver.
    let second = unsafe { f.driver.mem_alloc_from_pool_async((10 * MIB) as usize, f.pool, f.stream) };
    assert_eq!(code(second), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    // SAFETY: as above.
    let huge = unsafe { f.driver.mem_alloc_from_pool_async(usize::MAX, f.pool, f.stream) };
    assert_eq!(code(huge), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
    f.free(a, f.stream);
    assert_eq!(f.alloc(10 * MIB, f.stream), a, "the failed calls left nothing behind");
}

#[test]
fn the_device_releases_idle_memory_of_other_pools_before_failing() {
    let f = Fixture::with_capacity(16 * MIB);
    f.keep_everything();
    let a = f.alloc(10 * MIB, f.stream);
    f.free(a, f.stream);
    f.sync(f.stream);
    assert_eq!(f.layout().reserved, 10 * MIB, "kept: the threshold is at its maximum");
    let default_pool = f.driver.device_default_mem_pool(0).unwrap();
    // SAFETY: the stream comes from this driver.
    let b = unsafe { f.driver.mem_alloc_async((10 * MIB) as usize, f.stream) }.unwrap();
    assert_eq!(f.layout().reserved, 0, "released to make room");
    let default_layout = f.driver.sim().unwrap().pool_layout(default_pool).unwrap();
    assert_eq!(default_layout.allocations, vec![(b, 10 * MIB)]);
}

#[test]
fn a_full_device_reuses_another_streams_free_by_waiting_for_it() {
    let f = Fixture::with_capacity(16 * MIB);
    let a = f.alloc(12 * MIB, f.stream);
    f.free(a, f.stream);
    assert_eq!(f.alloc(12 * MIB, f.other), a, "internal dependency inserted");
    // The other stream now waits for the first: what was freed there before is reusable.
    f.free(a, f.other);

    let g = Fixture::with_capacity(16 * MIB);
    g.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, 0);
    let a = g.alloc(12 * MIB, g.stream);
    g.free(a, g.stream);
    // SAFETY: pool and stream come from this driver.
    let refused = unsafe { g.driver.mem_alloc_from_pool_async((12 * MIB) as usize, g.pool, g.other) };
    assert_eq!(code(refused), CUresult::CUDA_ERROR_OUT_OF_MEMORY);
}

#[test]
fn the_legacy_stream_orders_with_blocking_streams_only() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let blocking = f.driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT).unwrap();
    let a = f.alloc(MIB, blocking);
    f.free(a, blocking);
    assert_eq!(f.alloc(MIB, CU_STREAM_LEGACY), a, "legacy work follows blocking streams");

    let b = f.alloc(4 * MIB, f.stream);
    f.free(b, f.stream);
    assert_ne!(f.alloc(4 * MIB, std::ptr::null_mut()), b, "non-blocking streams are not ordered");
}

#[test]
fn per_thread_default_streams_are_distinct_streams() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    let a = f.alloc(MIB, CU_STREAM_PER_THREAD);
    f.free(a, CU_STREAM_PER_THREAD);
    let driver = f.driver.clone();
    let pool = f.pool as usize;
    let from_other_thread = std::thread::spawn(move || {
        let ctx = driver.primary_context_retain(0).unwrap();
        // SAFETY: the context, pool and streams come from this driver.
        unsafe {
            driver.context_set_current(ctx).unwrap();
            driver.mem_alloc_from_pool_async(MIB as usize, pool as CUmemoryPool, CU_STREAM_PER_THREAD).unwrap()
        }
    })
    .join()
    .unwrap();
    assert_ne!(from_other_thread, a, "another thread's per-thread stream is another stream");
    assert_eq!(f.alloc(MIB, CU_STREAM_PER_THREAD), a, "this thread's is the same stream");
}

#[test]
fn destroying_a_pool_with_outstanding_allocations_defers_its_release() {
    let f = Fixture::with_capacity(1 << 30);
    let a = f.alloc(MIB, f.stream);
    // SAFETY: the pool comes from this driver and is not used for allocation again.
    unsafe { f.driver.mem_pool_destroy(f.pool) }.unwrap();
    // SAFETY: the handles come from this driver; the simulated device checks them.
    let after = unsafe { f.driver.mem_alloc_from_pool_async(512, f.pool, f.stream) };
    assert_eq!(code(after), CUresult::CUDA_ERROR_INVALID_VALUE, "the handle is gone");
    assert_eq!(f.driver.mem_get_info().unwrap().0, (1 << 30) - 2 * MIB, "its memory is not");
    f.free(a, f.stream);
    // SAFETY: as above.
    assert_eq!(code(unsafe { f.driver.mem_free_async(a, f.stream) }), CUresult::CUDA_ERROR_INVALID_VALUE);
    f.sync(f.stream);
    assert_eq!(f.driver.sim().unwrap().pool_layout(f.pool), None, "reclaimed once the free completed");
    assert_eq!(f.driver.mem_get_info().unwrap().0, 1 << 30);
}

#[test]
fn frees_of_unknown_or_freed_pointers_are_refused() {
    let f = Fixture::with_capacity(1 << 30);
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    // SAFETY: the simulated device checks pointers; see the module docs.
    unsafe {
        assert_eq!(code(f.driver.mem_free_async(a, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(code(f.driver.mem_free_async(a + 512, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(code(f.driver.mem_free_async(0, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(code(f.driver.mem_free(a)), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn bad_handles_get_the_drivers_codes() {
    let f = Fixture::with_capacity(1 << 30);
    let other = Fixture::with_capacity(1 << 30);
    let event = f.driver.event_create(CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let bogus_stream = 0xdead_beef as CUstream;
    // SAFETY: the simulated device checks every handle; see the module docs.
    unsafe {
        assert_eq!(code(f.driver.stream_synchronize(bogus_stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(f.driver.stream_synchronize(other.stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(f.driver.event_record(0x1234 as CUevent, f.stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(f.driver.event_record(event, other.stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        let pool_as_stream = f.pool as usize as CUstream;
        assert_eq!(code(f.driver.mem_alloc_async(512, pool_as_stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        let stream_as_pool = f.stream as usize as CUmemoryPool;
        let wrong = f.driver.mem_alloc_from_pool_async(512, stream_as_pool, f.stream);
        assert_eq!(code(wrong), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(code(f.driver.mem_pool_trim_to(other.pool, 0)), CUresult::CUDA_ERROR_INVALID_VALUE);
        f.driver.stream_destroy(f.other).unwrap();
        assert_eq!(code(f.driver.stream_synchronize(f.other)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(f.driver.stream_destroy(f.other)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(f.driver.stream_destroy(CU_STREAM_LEGACY)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        let default_pool = f.driver.device_default_mem_pool(0).unwrap();
        assert_eq!(code(f.driver.mem_pool_destroy(default_pool)), CUresult::CUDA_ERROR_INVALID_VALUE);
        f.driver.event_destroy(event).unwrap();
        assert_eq!(code(f.driver.event_destroy(event)), CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
}

#[test]
fn calls_before_init_and_null_out_pointers_are_refused() {
    let sim = Sim::new(SimConfig::default()).unwrap();
    let mut count = 0;
    let mut version = 0;
    // SAFETY: the out-pointers are valid or null, as each call documents.
    unsafe {
        assert_eq!(sim.cuDeviceGetCount(&mut count), CUresult::CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(sim.cuDriverGetVersion(&mut version), CUresult::CUDA_SUCCESS, "needs no cuInit");
        assert_eq!(version, DEFAULT_DRIVER_VERSION);
        assert_eq!(sim.cuInit(1), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sim.cuInit(0), CUresult::CUDA_SUCCESS);
        assert_eq!(sim.cuDeviceGetCount(std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sim.cuDeviceGetCount(&mut count), CUresult::CUDA_SUCCESS);
        assert_eq!(count, 1);
        let mut ptr = 0;
        assert_eq!(sim.cuMemAllocAsync(&mut ptr, 512, std::ptr::null_mut()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(sim.cuMemPoolCreate(std::ptr::null_mut(), std::ptr::null()), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn a_current_context_is_needed_and_released_contexts_are_gone() {
    let driver = Driver::simulated(SimConfig::default()).unwrap();
    let no_context = driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT);
    assert_eq!(code(no_context), CUresult::CUDA_ERROR_INVALID_CONTEXT);
    let ctx = driver.primary_context_retain(0).unwrap();
    // SAFETY: `ctx` was retained from this driver.
    unsafe { driver.context_set_current(ctx) }.unwrap();
    assert_eq!(driver.context_current().unwrap(), Some(ctx));
    assert_eq!(driver.context_device().unwrap(), 0);
    let stream = driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT).unwrap();
    // SAFETY: handles of this driver; the simulated device checks them after the release.
    unsafe {
        assert_eq!(driver.stream_context(stream).unwrap(), ctx);
        driver.primary_context_release(0).unwrap();
        assert_eq!(code(driver.stream_synchronize(stream)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(code(driver.primary_context_release(0)), CUresult::CUDA_ERROR_INVALID_CONTEXT);
    }
    let destroyed = driver.stream_create(CUstream_flags::CU_STREAM_DEFAULT);
    assert_eq!(code(destroyed), CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED);
    assert_eq!(driver.context_pop_current().unwrap(), ctx);
    assert_eq!(driver.context_current().unwrap(), None);
    assert_eq!(code(driver.context_pop_current()), CUresult::CUDA_ERROR_INVALID_CONTEXT);
}

#[test]
fn pool_attributes_have_their_defaults_widths_and_rules() {
    use CUmemPool_attribute as A;
    let f = Fixture::with_capacity(1 << 30);
    // SAFETY: the pool comes from this driver.
    let get = |attribute| unsafe { f.driver.mem_pool_get_attribute(f.pool, attribute) }.unwrap();
    assert_eq!(get(A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES), 1);
    assert_eq!(get(A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC), 1);
    assert_eq!(get(A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES), 1);
    assert_eq!(get(A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), 0);
    f.keep_everything();
    assert_eq!(get(A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), u64::MAX, "64-bit value round-trips");

    let a = f.alloc(5 * MIB, f.stream);
    f.free(a, f.stream);
    f.alloc(MIB, f.stream);
    // SAFETY: as above.
    let counters = unsafe { f.driver.mem_pool_counters(f.pool) }.unwrap();
    assert_eq!(
        counters,
        crate::PoolCounters { reserved: 6 * MIB, reserved_high: 6 * MIB, used: MIB, used_high: 5 * MIB }
    );
    // SAFETY: as above.
    unsafe {
        for read_only in [A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT] {
            assert_eq!(code(f.driver.mem_pool_set_attribute(f.pool, read_only, 0)), CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let nonzero = f.driver.mem_pool_set_attribute(f.pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 7);
        assert_eq!(code(nonzero), CUresult::CUDA_ERROR_INVALID_VALUE, "high-water marks reset only to 0");
        f.driver.mem_pool_set_attribute(f.pool, A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0).unwrap();
        let newer = f.driver.mem_pool_get_attribute(f.pool, CUmemPool_attribute(13));
        assert!(matches!(newer, Err(DriverError::Call { ref description, .. }) if description.contains("13")));
    }
    assert_eq!(get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH), MIB);
}

#[test]
fn pool_access_is_read_write_on_its_device_and_opt_in_for_peers() {
    use CUmemAccess_flags as F;
    let device = |id| CUmemLocation { type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id };
    let grant = |id, flags| CUmemAccessDesc { location: device(id), flags };
    let f = Fixture::new(SimConfig { capacities: vec![1 << 30; 2], ..SimConfig::default() });
    // SAFETY: the pool comes from this driver.
    unsafe {
        assert_eq!(f.driver.mem_pool_get_access(f.pool, device(0)).unwrap(), F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        assert_eq!(f.driver.mem_pool_get_access(f.pool, device(1)).unwrap(), F::CU_MEM_ACCESS_FLAGS_PROT_NONE);
        let revoke_own = f.driver.mem_pool_set_access(f.pool, &[grant(0, F::CU_MEM_ACCESS_FLAGS_PROT_NONE)]);
        assert_eq!(code(revoke_own), CUresult::CUDA_ERROR_INVALID_VALUE);
        f.driver.mem_pool_set_access(f.pool, &[grant(1, F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)]).unwrap();
        assert_eq!(f.driver.mem_pool_get_access(f.pool, device(1)).unwrap(), F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        let bad_device = f.driver.mem_pool_set_access(f.pool, &[grant(5, F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)]);
        assert_eq!(code(bad_device), CUresult::CUDA_ERROR_INVALID_DEVICE);
    }
    assert!(f.driver.device_can_access_peer(0, 1).unwrap());
    assert!(!f.driver.device_can_access_peer(0, 0).unwrap());

    let isolated = Fixture::new(SimConfig { capacities: vec![1 << 30; 2], peer_access: false, ..SimConfig::default() });
    // SAFETY: as above.
    let refused = unsafe {
        isolated.driver.mem_pool_set_access(isolated.pool, &[grant(1, F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE)])
    };
    assert_eq!(code(refused), CUresult::CUDA_ERROR_INVALID_DEVICE);
    assert!(!isolated.driver.device_can_access_peer(0, 1).unwrap());
}

#[test]
fn devices_without_pools_refuse_the_pool_calls_but_allocate_synchronously() {
    let driver = Driver::simulated(SimConfig { memory_pools_supported: false, ..SimConfig::default() }).unwrap();
    assert!(!driver.memory_pools_supported(0).unwrap());
    let ctx = driver.primary_context_retain(0).unwrap();
    // SAFETY: `ctx` was retained from this driver.
    unsafe { driver.context_set_current(ctx) }.unwrap();
    assert_eq!(code(driver.mem_pool_create(&PoolProps::device(0).build())), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    let ptr = driver.mem_alloc(1).unwrap();
    assert_eq!(driver.mem_get_info().unwrap(), (DEFAULT_CAPACITY - 2 * MIB, DEFAULT_CAPACITY));
    // SAFETY: `ptr` was allocated above and nothing uses it.
    unsafe { driver.mem_free(ptr) }.unwrap();
    assert_eq!(driver.mem_get_info().unwrap(), (DEFAULT_CAPACITY, DEFAULT_CAPACITY), "raw segments go back at once");
}

#[test]
fn an_old_driver_lacks_the_pool_entry_points() {
    let driver = Driver::simulated(SimConfig { driver_version: 11010, ..SimConfig::default() }).unwrap();
    assert_eq!(driver.driver_version().unwrap(), DriverVersion(11010));
    assert!(!driver.memory_pools_supported(0).unwrap());
    match driver.mem_pool_create(&PoolProps::device(0).build()) {
        Err(DriverError::MissingSymbol {
            symbol: "cuMemPoolCreate",
            driver_version: Some(DriverVersion(11010)),
            ..
        }) => {}
        other => panic!("expected a missing cuMemPoolCreate, got {other:?}"),
    }
}

#[test]
fn memset_stays_inside_live_allocations() {
    let f = Fixture::with_capacity(1 << 30);
    let a = f.alloc(1000, f.stream);
    // SAFETY: the simulated device checks ranges; see the module docs.
    unsafe {
        f.driver.memset_d8_async(a, 0xab, 1024, f.stream).unwrap();
        f.driver.memset_d8_async(a + 100, 0, 10, f.stream).unwrap();
        assert_eq!(code(f.driver.memset_d8_async(a, 0, 1025, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
        f.free(a, f.stream);
        assert_eq!(code(f.driver.memset_d8_async(a, 0, 1, f.stream)), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn modules_expose_their_entries_and_launches_are_checked() {
    let f = Fixture::with_capacity(1 << 30);
    let ptx = c".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry fill_bytes(\n.param .u64 p)\n{ ret; }\n";
    let module = f.driver.module_load_ptx(ptx).unwrap();
    assert_eq!(code(f.driver.module_load_ptx(c"not a module")), CUresult::CUDA_ERROR_INVALID_IMAGE);
    // SAFETY: module, function and stream come from this driver; the simulated device does not
    // run the kernel, so the parameter need not point anywhere.
    unsafe {
        let function = f.driver.module_function(module, c"fill_bytes").unwrap();
        assert_eq!(code(f.driver.module_function(module, c"missing")), CUresult::CUDA_ERROR_NOT_FOUND);
        let mut arg = 0u64;
        let mut params = [(&raw mut arg).cast::<c_void>()];
        f.driver.launch_kernel(function, [4, 1, 1], [256, 1, 1], 0, f.stream, &mut params).unwrap();
        let too_big = f.driver.launch_kernel(function, [1, 1, 1], [2048, 1, 1], 0, f.stream, &mut params);
        assert_eq!(code(too_big), CUresult::CUDA_ERROR_INVALID_VALUE);
        let empty_grid = f.driver.launch_kernel(function, [0, 1, 1], [32, 1, 1], 0, f.stream, &mut params);
        assert_eq!(code(empty_grid), CUresult::CUDA_ERROR_INVALID_VALUE);
        f.driver.module_unload(module).unwrap();
        let unloaded = f.driver.launch_kernel(function, [1, 1, 1], [32, 1, 1], 0, f.stream, &mut params);
        assert_eq!(code(unloaded), CUresult::CUDA_ERROR_INVALID_HANDLE);
    }
}

#[test]
fn devices_answer_queries_from_the_configuration() {
    let driver = Driver::simulated(SimConfig { capacities: vec![80 << 30, 16 << 30], ..SimConfig::default() }).unwrap();
    assert_eq!(driver.device_count().unwrap(), 2);
    assert_eq!(driver.device_total_memory(1).unwrap(), 16 << 30);
    assert!(driver.device_name(0).unwrap().contains("80 GiB"));
    assert_eq!(code(driver.device(2)), CUresult::CUDA_ERROR_INVALID_DEVICE);
    let attribute = |a| driver.device_attribute(0, a);
    assert_eq!(attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).unwrap(), 1);
    assert_eq!(attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).unwrap(), 9);
    assert_eq!(code(attribute(CUdevice_attribute(100_000))), CUresult::CUDA_ERROR_INVALID_VALUE);
    assert!(driver.memory_pools_supported(1).unwrap());
}

#[test]
fn errors_have_names_and_descriptions() {
    let driver = Driver::simulated(SimConfig::default()).unwrap();
    assert_eq!(driver.error_name(CUresult::CUDA_ERROR_OUT_OF_MEMORY).as_deref(), Some("CUDA_ERROR_OUT_OF_MEMORY"));
    assert_eq!(driver.error_string(CUresult::CUDA_ERROR_OUT_OF_MEMORY), "out of memory");
    assert_eq!(driver.error_name(CUresult(123_456)), None);
    assert_eq!(driver.error_string(CUresult(123_456)), "unrecognized error code");
    let message = code_message(&driver);
    assert!(message.contains("cuMemAllocAsync") && message.contains("CUDA_ERROR_INVALID_CONTEXT (201)"), "{message}");
}

fn code_message(driver: &Driver) -> String {
    // SAFETY: the legacy stream handle is always acceptable; there is no current context.
    unsafe { driver.mem_alloc_async(512, std::ptr::null_mut()) }.unwrap_err().to_string()
}

#[test]
fn the_current_pool_serves_mem_alloc_async_until_destroyed() {
    let f = Fixture::with_capacity(1 << 30);
    let default_pool = f.driver.device_default_mem_pool(0).unwrap();
    assert_eq!(f.driver.device_mem_pool(0).unwrap(), default_pool);
    // SAFETY: handles of this driver.
    unsafe {
        f.driver.device_set_mem_pool(0, f.pool).unwrap();
        let a = f.driver.mem_alloc_async(MIB as usize, f.stream).unwrap();
        assert_eq!(f.layout().allocations, vec![(a, MIB)]);
        f.free(a, f.stream);
        f.driver.mem_pool_destroy(f.pool).unwrap();
    }
    assert_eq!(f.driver.device_mem_pool(0).unwrap(), default_pool);
}

#[test]
fn timing_events_are_zero_apart_and_need_recording() {
    let f = Fixture::with_capacity(1 << 30);
    let start = f.driver.event_create(CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let end = f.driver.event_create(CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    // SAFETY: handles of this driver.
    unsafe {
        assert_eq!(code(f.driver.event_elapsed_ms(start, end)), CUresult::CUDA_ERROR_INVALID_HANDLE);
        f.driver.event_record(start, f.stream).unwrap();
        f.driver.event_record(end, f.stream).unwrap();
        f.driver.event_synchronize(end).unwrap();
        assert!(f.driver.event_query(end).unwrap());
        assert_eq!(f.driver.event_elapsed_ms(start, end).unwrap(), 0.0);
    }
    let interprocess = f.driver.event_create(CUevent_flags::CU_EVENT_INTERPROCESS);
    assert_eq!(code(interprocess), CUresult::CUDA_ERROR_INVALID_VALUE, "needs DISABLE_TIMING");
}

#[test]
fn ipc_is_not_modelled() {
    let f = Fixture::with_capacity(1 << 30);
    let props = PoolProps::device(0).handle_types(CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    assert_eq!(code(f.driver.mem_pool_create(&props.build())), CUresult::CUDA_ERROR_NOT_SUPPORTED);
    // SAFETY: the pool comes from this driver.
    assert_eq!(code(unsafe { f.driver.mem_pool_export_posix_fd(f.pool) }), CUresult::CUDA_ERROR_NOT_SUPPORTED);
}

#[test]
fn releasing_the_last_primary_context_reference_destroys_its_allocations() {
    let driver = Driver::simulated(SimConfig::with_capacity(1 << 30)).unwrap();
    let ctx = driver.primary_context_retain(0).unwrap();
    // SAFETY: `ctx` was retained from this driver.
    unsafe { driver.context_set_current(ctx) }.unwrap();
    let raw = driver.mem_alloc(MIB as usize).unwrap();
    let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
    let pool = driver.mem_pool_create(&PoolProps::device(0).build()).unwrap();
    // SAFETY: handles of this driver; the simulated device checks them after the reset.
    unsafe {
        let pooled = driver.mem_alloc_from_pool_async(MIB as usize, pool, stream).unwrap();
        driver.primary_context_release(0).unwrap();
        let again = driver.primary_context_retain(0).unwrap();
        driver.context_set_current(again).unwrap();
        assert_eq!(code(driver.mem_free(raw)), CUresult::CUDA_ERROR_INVALID_VALUE, "reset destroyed it");
        let fresh = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).unwrap();
        driver.mem_free_async(pooled, fresh).expect("pool allocations belong to no context");
        driver.stream_synchronize(fresh).unwrap();
    }
    assert_eq!(driver.mem_get_info().unwrap().0, 1 << 30);
}

#[test]
fn launches_respect_the_device_limits() {
    let f = Fixture::with_capacity(1 << 30);
    let ptx = c".version 8.0\n.target sm_90\n.visible .entry k()\n{ ret; }\n";
    let module = f.driver.module_load_ptx(ptx).unwrap();
    // SAFETY: handles of this driver; the kernel takes no parameters and does not run.
    unsafe {
        let function = f.driver.module_function(module, c"k").unwrap();
        let launch = |grid, block, shared| f.driver.launch_kernel(function, grid, block, shared, f.stream, &mut []);
        launch([65535, 65535, 65535], [32, 32, 1], 48 << 10).unwrap();
        assert_eq!(code(launch([1, 1, 1], [1, 1, 128], 0)), CUresult::CUDA_ERROR_INVALID_VALUE, "block z ≤ 64");
        assert_eq!(code(launch([1, 70_000, 1], [32, 1, 1], 0)), CUresult::CUDA_ERROR_INVALID_VALUE, "grid y ≤ 65535");
        assert_eq!(code(launch([1, 1, 1], [32, 1, 1], 64 << 10)), CUresult::CUDA_ERROR_INVALID_VALUE, "48 KiB shared");
    }
    let attribute = |a| f.driver.device_attribute(0, a).unwrap();
    assert_eq!(attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z), 64);
}

#[test]
fn without_opportunistic_reuse_only_a_synchronization_shares_frees() {
    let f = Fixture::with_capacity(1 << 30);
    f.keep_everything();
    f.set(CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC, 0);
    let a = f.alloc(MIB, f.stream);
    f.free(a, f.stream);
    // SAFETY: the stream comes from this driver.
    assert!(unsafe { f.driver.stream_query(f.stream) }.unwrap());
    let b = f.alloc(MIB, f.other);
    assert_ne!(a, b, "a query is not enough without the policy");
    f.free(b, f.other);
    f.sync(f.stream);
    assert_eq!(f.alloc(MIB, f.other), a, "a synchronization is");
}

#[test]
fn pool_props_are_checked_against_the_driver_version() {
    let f = Fixture::with_capacity(1 << 30);
    let mut props = PoolProps::device(7).build();
    assert_eq!(code(f.driver.mem_pool_create(&props)), CUresult::CUDA_ERROR_INVALID_VALUE, "no device 7");
    props.location.id = 0;
    props.usage = 0x2;
    assert_eq!(code(f.driver.mem_pool_create(&props)), CUresult::CUDA_ERROR_NOT_SUPPORTED, "no decompression");
    let old = Driver::simulated(SimConfig { driver_version: 12010, ..SimConfig::default() }).unwrap();
    let capped = PoolProps::device(0).max_size(1 << 30).build();
    assert_eq!(code(old.mem_pool_create(&capped)), CUresult::CUDA_ERROR_INVALID_VALUE, "maxSize is 12.2+");
    old.mem_pool_create(&PoolProps::device(0).build()).unwrap();
    let attribute = CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES;
    let v11_2 = Driver::simulated(SimConfig { driver_version: 11020, ..SimConfig::default() }).unwrap();
    assert_eq!(
        code(v11_2.device_attribute(0, attribute)),
        CUresult::CUDA_ERROR_INVALID_VALUE,
        "attribute 119 is 11.3+"
    );
}

#[test]
fn waits_take_no_external_flag_and_unknown_codes_have_no_name() {
    let f = Fixture::with_capacity(1 << 30);
    let event = f.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    let sim = f.driver.sim().unwrap();
    let external = CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL.0;
    let mut name: *const std::ffi::c_char = std::ptr::dangling();
    // SAFETY: live handles of this driver; `name` is a valid out-pointer.
    unsafe {
        assert_eq!(sim.cuStreamWaitEvent(f.stream, event, external), CUresult::CUDA_ERROR_INVALID_VALUE);
        assert_eq!(sim.cuGetErrorName(CUresult(123_456), &mut name), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    assert!(name.is_null(), "set to NULL, as documented");
}

/// A fixture whose device memory is backed by host memory, its `Sim` for the copy entry points.
fn host_backed() -> Fixture {
    Fixture::new(SimConfig { host_memory: true, ..SimConfig::with_capacity(1 << 30) })
}

#[test]
fn host_backed_memory_keeps_what_memset_and_copies_write() {
    let f = host_backed();
    let sim = f.driver.sim().unwrap();
    let a = f.alloc(4096, f.stream);
    let b = f.alloc(4096, f.stream);
    let mut out = [0u8; 8];
    // SAFETY: pointers and stream come from this driver; `out` and `data` live through each call.
    unsafe {
        assert_eq!(sim.cuMemsetD8Async(a, 7, 4096, f.stream), CUresult::CUDA_SUCCESS);
        assert_eq!(sim.cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), a + 100, 8, f.stream), CUresult::CUDA_SUCCESS);
        assert_eq!(out, [7; 8]);
        let data: Vec<u8> = (0..16).collect();
        assert_eq!(sim.cuMemcpyHtoDAsync_v2(b + 8, data.as_ptr().cast(), 16, f.stream), CUresult::CUDA_SUCCESS);
        assert_eq!(sim.cuMemcpyDtoDAsync_v2(a, b + 8, 16, f.stream), CUresult::CUDA_SUCCESS);
        let mut back = [0u8; 18];
        assert_eq!(sim.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), a, 18), CUresult::CUDA_SUCCESS);
        assert_eq!(&back[..16], &data[..]);
        assert_eq!(&back[16..], &[7, 7]);
        // A range that runs past the allocation is refused, as the driver refuses it.
        let past = sim.cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), a + 4090, 18, f.stream);
        assert_eq!(past, CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // A unit released and mapped again starts zeroed: freed memory keeps no old bytes.
    f.free(a, f.stream);
    f.free(b, f.stream);
    f.driver.context_synchronize().unwrap();
    // SAFETY: the pool comes from this driver.
    unsafe { f.driver.mem_pool_trim_to(f.pool, 0) }.unwrap();
    let c = f.alloc(4096, f.stream);
    // SAFETY: as above.
    unsafe {
        assert_eq!(sim.cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), c, 8, f.stream), CUresult::CUDA_SUCCESS);
    }
    assert_eq!(out, [0; 8]);
}

#[test]
fn host_backed_allocations_that_span_units_keep_their_bytes() {
    let f =
        Fixture::new(SimConfig { host_memory: true, pool_unit: Some(64 << 10), ..SimConfig::with_capacity(1 << 30) });
    let sim = f.driver.sim().unwrap();
    let a = f.alloc(40 << 10, f.stream);
    let b = f.alloc(100 << 10, f.stream);
    assert_eq!(f.layout().mapped, vec![(a, 192 << 10)], "b spans three units");
    let data: Vec<u8> = (0..100 << 10).map(|i: usize| (i % 251) as u8).collect();
    let mut back = vec![0u8; data.len()];
    // SAFETY: pointers and stream come from this driver; `data` and `back` live through each call.
    unsafe {
        assert_eq!(sim.cuMemcpyHtoDAsync_v2(b, data.as_ptr().cast(), data.len(), f.stream), CUresult::CUDA_SUCCESS);
        assert_eq!(sim.cuMemsetD8Async(b + 1000, 9, 30 << 10, f.stream), CUresult::CUDA_SUCCESS);
        assert_eq!(sim.cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), b, back.len()), CUresult::CUDA_SUCCESS);
    }
    let mut expected = data.clone();
    expected[1000..1000 + (30 << 10)].fill(9);
    assert!(back == expected, "bytes across the unit boundaries read back as written");
}

#[test]
fn without_host_memory_copies_out_are_refused() {
    let f = Fixture::with_capacity(1 << 30);
    let sim = f.driver.sim().unwrap();
    let a = f.alloc(4096, f.stream);
    let mut out = [1u8; 8];
    // SAFETY: pointer and stream come from this driver; `out` lives through the calls.
    unsafe {
        assert_eq!(sim.cuMemcpyHtoDAsync_v2(a, out.as_ptr().cast(), 8, f.stream), CUresult::CUDA_SUCCESS);
        let back = sim.cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), a, 8, f.stream);
        assert_eq!(back, CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    assert_eq!(out, [1; 8]);
}

#[test]
fn host_backed_devices_run_the_fill_kernels() {
    let f = host_backed();
    let sim = f.driver.sim().unwrap();
    let a = f.alloc(1000, f.stream);
    for (ptx, name) in [
        (crate::kernels::FILL_BYTES_PTX, crate::kernels::FILL_BYTES),
        (crate::kernels::FILL_V4_PTX, crate::kernels::FILL_V4),
    ] {
        let module = f.driver.module_load_ptx(ptx).unwrap();
        // SAFETY: module, function, pointer and stream come from this driver; the parameters
        // are the kernel's `(u64 dst, u64 len, u32 value)` and live through the launch.
        unsafe {
            let function = f.driver.module_function(module, name).unwrap();
            let (mut dst, mut len, mut value) = (a + 10, 990u64, 0x1ABu32);
            let mut params =
                [(&raw mut dst).cast::<c_void>(), (&raw mut len).cast::<c_void>(), (&raw mut value).cast::<c_void>()];
            f.driver.launch_kernel(function, [2, 1, 1], [128, 1, 1], 0, f.stream, &mut params).unwrap();
            let mut out = [0u8; 1000];
            assert_eq!(sim.cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), a, 1000), CUresult::CUDA_SUCCESS);
            assert!(out[10..].iter().all(|&byte| byte == 0xAB), "{name:?} filled every byte of its range");
            params[1].cast::<u64>().write(1 << 20);
            let outside = f.driver.launch_kernel(function, [2, 1, 1], [128, 1, 1], 0, f.stream, &mut params);
            assert_eq!(code(outside), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(sim.cuMemsetD8Async(a, 0, 1000, f.stream), CUresult::CUDA_SUCCESS);
        }
    }
}
