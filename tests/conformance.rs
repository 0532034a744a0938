//! Conformance of the device layer: the same tests run on the simulated device (CI) and on a
//! real GPU (`STEPPOOL_DEVICE=cuda STEPPOOL_REQUIRE_GPU=1`). They assert what the CUDA
//! documentation promises, so a difference between the simulated device and the driver shows up
//! as a failure here, and they record what the documentation leaves open (the reservation
//! granule, alignment, cross-stream reuse before a synchronization) as facts: printed, and
//! appended to the file named by `STEPPOOL_FACTS`.
//!
//! Handles passed to the driver in these tests are live handles of the test's own driver, which
//! is what the `unsafe` calls require.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use steppool_sys::kernels::{FILL_BYTES, FILL_BYTES_PTX};
use steppool_sys::{
    CUdevice_attribute, CUdeviceptr, CUmemAllocationType, CUmemPool_attribute, CUresult, DriverError, PoolProps,
};
use steppool_tests::{Device, Fact, record_fact};

const MIB: u64 = 1 << 20;

/// Tests that look at what a pool holds share the device; a request for more than the device has
/// excludes them all: before answering out-of-memory, the driver may release every pool's idle
/// memory in the process, raised release thresholds included (seen on an H200 as a pool emptied
/// while another test's oversized request ran).
static DEVICE_WIDE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    DEVICE_WIDE.read().unwrap_or_else(PoisonError::into_inner)
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    DEVICE_WIDE.write().unwrap_or_else(PoisonError::into_inner)
}

fn code<T: std::fmt::Debug>(result: Result<T, DriverError>) -> CUresult {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => error.code().unwrap_or_else(|| panic!("expected a driver error code, got {error}")),
    }
}

#[test]
fn driver_and_device_describe_themselves() {
    let d = Device::open();
    let version = d.driver.driver_version().unwrap();
    assert!(version.major() >= 11, "driver {version}");
    assert!(d.driver.device_count().unwrap() >= 1);
    let name = d.driver.device_name(d.device).unwrap();
    let total = d.driver.device_total_memory(d.device).unwrap();
    assert!(!name.is_empty() && total > 0);
    let pools = d.driver.memory_pools_supported(d.device).unwrap();
    assert!(pools, "steppool's GPU tests need a device with memory pools");
    let major = d.driver.device_attribute(d.device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    let minor = d.driver.device_attribute(d.device, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    record_fact(&d.driver, "driver_version", Fact::Text(version.to_string()));
    record_fact(&d.driver, "device_name", Fact::Text(name));
    record_fact(&d.driver, "device_total_memory", Fact::Bytes(total));
    record_fact(&d.driver, "compute_capability", Fact::Text(format!("{}.{}", major.unwrap(), minor.unwrap())));
}

#[test]
fn the_primary_context_is_shared_and_current() {
    let d = Device::open();
    let again = d.driver.primary_context_retain(d.device).unwrap();
    assert_eq!(again, d.ctx, "one primary context per device");
    assert_eq!(d.driver.context_current().unwrap(), Some(d.ctx));
    assert_eq!(d.driver.context_device().unwrap(), d.device);
    let stream = d.stream();
    // SAFETY: a live stream of this driver.
    assert_eq!(unsafe { d.driver.stream_context(stream.raw) }.unwrap(), d.ctx);
    drop(stream);
    // SAFETY: balances the retain above.
    unsafe { d.driver.primary_context_release(d.device) }.unwrap();
}

#[test]
fn a_one_byte_allocation_reserves_a_granule_and_counts_as_used() {
    let _shared = shared();
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    // SAFETY: live handles of this driver.
    let counters = || unsafe { d.driver.mem_pool_counters(pool.raw) }.unwrap();
    assert_eq!(counters().reserved, 0, "a new pool reserves nothing");
    // SAFETY: live handles of this driver.
    let ptr = unsafe { d.driver.mem_alloc_from_pool_async(1, pool.raw, stream.raw) }.unwrap();
    let after = counters();
    assert!(after.used >= 1 && after.reserved >= after.used, "{after:?}");
    assert_eq!(ptr % 256, 0, "CUDA guarantees at least 256-byte alignment");
    record_fact(&d.driver, "reserved_after_1_byte", Fact::Bytes(after.reserved));
    record_fact(&d.driver, "used_after_1_byte", Fact::Bytes(after.used));

    // SAFETY: `ptr` is live and nothing uses it after this.
    unsafe { d.driver.mem_free_async(ptr, stream.raw) }.unwrap();
    stream.sync();
    assert_eq!(counters().used, 0);
    assert_eq!(counters().reserved, 0, "threshold 0: idle memory goes back at the synchronization");
}

#[test]
fn allocations_are_aligned() {
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    let sizes = [1u64, 100, 255, 257, 1000, 4097, 65_537, MIB + 1];
    let ptrs: Vec<CUdeviceptr> = sizes
        .iter()
        // SAFETY: live handles of this driver.
        .map(|&size| unsafe { d.driver.mem_alloc_from_pool_async(size as usize, pool.raw, stream.raw) }.unwrap())
        .collect();
    let alignment = ptrs.iter().map(|ptr| 1u64 << ptr.trailing_zeros()).min().unwrap();
    assert!(alignment >= 256, "smallest alignment seen: {alignment}");
    record_fact(&d.driver, "smallest_alignment_seen", Fact::Bytes(alignment));
    let mut sorted: Vec<(CUdeviceptr, u64)> = ptrs.iter().copied().zip(sizes).collect();
    sorted.sort_unstable();
    for pair in sorted.windows(2) {
        assert!(pair[0].0 + pair[0].1 <= pair[1].0, "allocations overlap: {pair:?}");
    }
    for ptr in ptrs {
        // SAFETY: each pointer is live and nothing uses it after this.
        unsafe { d.driver.mem_free_async(ptr, stream.raw) }.unwrap();
    }
    stream.sync();
}

#[test]
fn a_raised_release_threshold_keeps_memory_until_trimmed() {
    let _shared = shared();
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    // SAFETY: live handles of this driver.
    unsafe {
        let threshold = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        d.driver.mem_pool_set_attribute(pool.raw, threshold, u64::MAX).unwrap();
        assert_eq!(d.driver.mem_pool_get_attribute(pool.raw, threshold).unwrap(), u64::MAX);
        let ptr = d.driver.mem_alloc_from_pool_async((64 * MIB) as usize, pool.raw, stream.raw).unwrap();
        d.driver.mem_free_async(ptr, stream.raw).unwrap();
        stream.sync();
        let kept = d.driver.mem_pool_counters(pool.raw).unwrap();
        assert!(kept.reserved >= 64 * MIB && kept.used == 0, "{kept:?}");
        d.driver.mem_pool_trim_to(pool.raw, 0).unwrap();
        assert_eq!(d.driver.mem_pool_counters(pool.raw).unwrap().reserved, 0);
        assert!(d.driver.mem_pool_counters(pool.raw).unwrap().reserved_high >= 64 * MIB);
    }
}

#[test]
fn the_same_stream_reuses_freed_memory_without_growing() {
    let _shared = shared();
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    // SAFETY: live handles of this driver; each pointer is freed once and not used after.
    unsafe {
        let a = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, stream.raw).unwrap();
        let reserved = d.driver.mem_pool_counters(pool.raw).unwrap().reserved;
        d.driver.mem_free_async(a, stream.raw).unwrap();
        let b = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, stream.raw).unwrap();
        assert_eq!(d.driver.mem_pool_counters(pool.raw).unwrap().reserved, reserved);
        record_fact(&d.driver, "same_stream_reuse_same_pointer", Fact::Bool(a == b));
        d.driver.mem_free_async(b, stream.raw).unwrap();
    }
    stream.sync();
}

#[test]
fn an_event_orders_reuse_across_streams() {
    let _shared = shared();
    let d = Device::open();
    let (pool, first, second, event) = (d.pool(), d.stream(), d.stream(), d.event());
    // SAFETY: live handles of this driver; each pointer is freed once and not used after.
    unsafe {
        let a = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, first.raw).unwrap();
        let reserved = d.driver.mem_pool_counters(pool.raw).unwrap().reserved;
        d.driver.mem_free_async(a, first.raw).unwrap();
        d.driver.event_record(event.raw, first.raw).unwrap();
        d.driver.stream_wait_event(second.raw, event.raw).unwrap();
        let b = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, second.raw).unwrap();
        assert_eq!(d.driver.mem_pool_counters(pool.raw).unwrap().reserved, reserved, "reuse follows the event");
        d.driver.mem_free_async(b, second.raw).unwrap();
    }
    second.sync();
}

#[test]
fn reuse_across_unordered_streams_before_a_synchronization() {
    let _shared = shared();
    let d = Device::open();
    let (pool, first, second) = (d.pool(), d.stream(), d.stream());
    // SAFETY: live handles of this driver; each pointer is freed once and not used after.
    unsafe {
        let a = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, first.raw).unwrap();
        d.driver.mem_free_async(a, first.raw).unwrap();
        let b = d.driver.mem_alloc_from_pool_async((4 * MIB) as usize, pool.raw, second.raw).unwrap();
        // Documented as allowed but not promised (opportunistic reuse): a fact, not an assertion.
        record_fact(&d.driver, "unordered_cross_stream_reuse_before_sync", Fact::Bool(a == b));
        d.driver.mem_free_async(b, second.raw).unwrap();
    }
    first.sync();
    second.sync();
}

#[test]
fn mem_get_info_counts_pool_reservations_as_used() {
    let _shared = shared();
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    let (free_before, total) = d.driver.mem_get_info().unwrap();
    assert!(free_before <= total);
    // SAFETY: live handles of this driver; the pointer is freed once and not used after.
    unsafe {
        let ptr = d.driver.mem_alloc_from_pool_async((256 * MIB) as usize, pool.raw, stream.raw).unwrap();
        let (free_after, _) = d.driver.mem_get_info().unwrap();
        record_fact(&d.driver, "mem_get_info_drop_for_256_mib", Fact::Bytes(free_before.saturating_sub(free_after)));
        if !d.is_gpu() {
            // Other processes may change a real GPU's free memory; the simulated device is ours.
            assert_eq!(free_before - free_after, 256 * MIB);
        }
        d.driver.mem_free_async(ptr, stream.raw).unwrap();
    }
    stream.sync();
}

#[test]
fn a_kernel_writes_every_byte_of_a_pool_allocation() {
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    let module = d.driver.module_load_ptx(FILL_BYTES_PTX).unwrap();
    // SAFETY: live handles of this driver; the kernel writes `len` bytes of the allocation, which
    // is live until the free enqueued after it on the same stream.
    unsafe {
        let function = d.driver.module_function(module, FILL_BYTES).unwrap();
        let len = 3 * MIB + 17;
        let mut ptr = d.driver.mem_alloc_from_pool_async(len as usize, pool.raw, stream.raw).unwrap();
        let mut count = len;
        let mut value = 0xA5u32;
        let mut params = [
            (&raw mut ptr).cast::<std::ffi::c_void>(),
            (&raw mut count).cast::<std::ffi::c_void>(),
            (&raw mut value).cast::<std::ffi::c_void>(),
        ];
        d.driver.launch_kernel(function, [64, 1, 1], [256, 1, 1], 0, stream.raw, &mut params).unwrap();
        d.driver.mem_free_async(ptr, stream.raw).unwrap();
        // A fault in the kernel (an unmapped byte) would surface here as an error.
        stream.sync();
        d.driver.module_unload(module).unwrap();
    }
}

#[test]
fn bad_requests_get_the_documented_codes() {
    let _exclusive = exclusive();
    let d = Device::open();
    let (pool, stream) = (d.pool(), d.stream());
    let total = d.driver.device_total_memory(d.device).unwrap();
    // SAFETY: live handles of this driver; freed pointers are only passed back to the driver,
    // which looks them up, after the stream synchronized.
    unsafe {
        // A zero-byte request is no error: a null pointer (an H200, driver 580.159.04).
        let zero = d.driver.mem_alloc_from_pool_async(0, pool.raw, stream.raw);
        assert_eq!(zero.map_err(|e| e.code()), Ok(0), "a zero-byte request");
        let beyond = d.driver.mem_alloc_from_pool_async((total + (1 << 30)) as usize, pool.raw, stream.raw);
        assert_eq!(code(beyond), CUresult::CUDA_ERROR_OUT_OF_MEMORY, "more than the device has");

        let ptr = d.driver.mem_alloc_from_pool_async(MIB as usize, pool.raw, stream.raw).unwrap();
        d.driver.mem_free_async(ptr, stream.raw).unwrap();
        stream.sync();
        assert_eq!(code(d.driver.mem_free_async(ptr, stream.raw)), CUresult::CUDA_ERROR_INVALID_VALUE, "double free");

        let read_only =
            d.driver.mem_pool_set_attribute(pool.raw, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, 0);
        assert_eq!(code(read_only), CUresult::CUDA_ERROR_INVALID_VALUE, "a read-only attribute");
    }
    let count = d.driver.device_count().unwrap();
    assert_eq!(code(d.driver.device(count)), CUresult::CUDA_ERROR_INVALID_DEVICE);
    let mut props = PoolProps::device(d.device).build();
    props.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_INVALID;
    assert_eq!(code(d.driver.mem_pool_create(&props)), CUresult::CUDA_ERROR_INVALID_VALUE);
    let unknown = d.driver.device_attribute(d.device, CUdevice_attribute(100_000));
    assert_eq!(code(unknown), CUresult::CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn a_pool_destroyed_with_live_allocations_still_takes_their_frees() {
    let d = Device::open();
    let stream = d.stream();
    let pool = d.driver.mem_pool_create(&PoolProps::device(d.device).build()).unwrap();
    // SAFETY: live handles of this driver; the pool is not used after its destruction except
    // through the allocation it still owns, as cuMemPoolDestroy allows.
    unsafe {
        let ptr = d.driver.mem_alloc_from_pool_async(MIB as usize, pool, stream.raw).unwrap();
        d.driver.mem_pool_destroy(pool).unwrap();
        d.driver.mem_free_async(ptr, stream.raw).unwrap();
        stream.sync();
        assert_eq!(code(d.driver.mem_free_async(ptr, stream.raw)), CUresult::CUDA_ERROR_INVALID_VALUE);
    }
}

#[test]
fn streams_and_events_complete_in_order() {
    let d = Device::open();
    let stream = d.stream();
    let start = d.driver.event_create(steppool_sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let end = d.driver.event_create(steppool_sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    // SAFETY: live handles of this driver.
    unsafe {
        d.driver.event_record(start, stream.raw).unwrap();
        d.driver.event_record(end, stream.raw).unwrap();
        d.driver.event_synchronize(end).unwrap();
        assert!(d.driver.event_query(end).unwrap());
        assert!(d.driver.stream_query(stream.raw).unwrap());
        assert!(d.driver.event_elapsed_ms(start, end).unwrap() >= 0.0);
        d.driver.event_destroy(start).unwrap();
        d.driver.event_destroy(end).unwrap();
    }
    d.driver.context_synchronize().unwrap();
}
