//! cudarc's driver API over steppool: contexts, streams, allocation, free, memset and copies made
//! by real cudarc code, with the memory served by steppool's pools.
//!
//! Where the device tests run on the simulated device (no GPU, or `STEPPOOL_DEVICE=sim`), both
//! halves use the libcuda stand-in `sys/libcuda-sim`: the runtime opens it by path (cargo builds
//! it beside this executable, as a dependency of this crate), and cudarc's loader, asking for
//! `libcuda.so`, gets the same library through its soname. With `STEPPOOL_DEVICE=cuda` the same
//! tests use the real `libcuda`.
//!
//! The device's current pool is global, so the tests take turns ([`serial`]).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, CudaStream};
use steppool::interop::cudarc::{InteropError, StreamPair, route_allocations};
use steppool::interop::route;
use steppool::{Phase, PhaseSpec, Runtime, Scope, TrimPolicy};
use steppool_sys::{CUmemoryPool, CudaLibrary, Driver, DriverKind};

/// The file name of the libcuda stand-in, as cargo builds it.
const STAND_IN: &str = "libsteppool_libcuda_sim.so";

/// The stand-in beside this executable (`target/<profile>/deps`), or one folder up.
fn stand_in_path() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let folder = exe.parent().expect("the executable's folder");
    [folder.join(STAND_IN), folder.join("..").join(STAND_IN)]
        .into_iter()
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{STAND_IN} is not beside {}: build steppool-libcuda-sim", exe.display()))
}

/// The driver both the runtime and cudarc use, opened once per process: the GPU's when the
/// harness selects it, otherwise the stand-in, which must be loaded before cudarc's first call.
fn driver() -> Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let selected = steppool_tests::driver();
            if selected.kind() == DriverKind::Cuda {
                return selected;
            }
            let path = stand_in_path();
            // SAFETY: the stand-in is this workspace's own library; opening it runs no
            // initializer beyond Rust's, and its entry points have the driver's signatures.
            let library = unsafe { CudaLibrary::open_path(&path) }
                .unwrap_or_else(|error| panic!("opening {}: {error}", path.display()));
            Driver::from_library(library).unwrap_or_else(|error| panic!("starting {}: {error}", path.display()))
        })
        .clone()
}

/// One test at a time: routing changes the device's current pool for every thread.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Setup {
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    _serial: MutexGuard<'static, ()>,
}

fn setup() -> Setup {
    let serial = serial();
    let runtime = Runtime::with_driver(driver()).expect("a runtime over the shared driver");
    let ctx = CudaContext::new(0).expect("cudarc's context on device 0");
    Setup { runtime, ctx, _serial: serial }
}

impl Setup {
    /// A cudarc stream with a steppool stream over it.
    fn pair(&self) -> (Arc<CudaStream>, StreamPair) {
        let stream = self.ctx.new_stream().expect("a cudarc stream");
        let device = self.runtime.device(0).unwrap();
        // SAFETY: the pair lives to the end of the test, after every buffer made on it.
        let pair = unsafe { StreamPair::from_cudarc(&device, &stream) }.expect("pairing the streams");
        (stream, pair)
    }

    /// The bytes in use in `pool`, by the driver's counters.
    fn pool_used(&self, pool: CUmemoryPool) -> u64 {
        // SAFETY: `pool` is a live pool of this runtime's driver (its stream is alive).
        unsafe { self.runtime.driver().mem_pool_counters(pool) }.expect("the pool's counters").used
    }

    fn assert_no_errors(&self) {
        let errors = self.runtime.take_errors();
        assert!(errors.is_empty(), "the runtime recorded errors: {errors:?}");
    }
}

fn pattern(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761)).collect()
}

#[test]
fn cudarc_and_the_runtime_share_one_device() {
    let s = setup();
    let device = s.runtime.device(0).unwrap();
    assert_eq!(s.ctx.cu_ctx() as usize, device.raw_context() as usize, "one primary context");
    assert_eq!(s.ctx.total_mem().unwrap() as u64, device.total_memory());
    // Memory the runtime writes, cudarc reads.
    let (stream, pair) = s.pair();
    let buffer = s.runtime.alloc(Phase::WEIGHTS, 4096, pair.steppool()).unwrap();
    buffer.fill(0x5A).unwrap();
    let view = pair.view::<u8>(buffer).unwrap();
    assert_eq!(stream.clone_dtoh(&view).unwrap(), vec![0x5A; 4096]);
    drop(view);
    s.assert_no_errors();
}

#[test]
fn cudarc_allocations_are_routed_into_a_phase_pool() {
    let s = setup();
    let (stream, pair) = s.pair();
    let device = s.runtime.driver().device(0).unwrap();
    let before = s.runtime.driver().device_mem_pool(device).unwrap();
    let route = route_allocations(&s.runtime, Phase::WEIGHTS, pair.steppool()).unwrap();
    assert_eq!(s.runtime.driver().device_mem_pool(device).unwrap(), route.pool());
    let data = pattern(1024);
    let a = stream.clone_htod(&data).unwrap();
    let mut b = stream.alloc_zeros::<u32>(1024).unwrap();
    assert!(s.pool_used(route.pool()) >= 8192, "both slices come from the phase's pool");
    assert_eq!(stream.clone_dtoh(&b).unwrap(), vec![0; 1024]);
    stream.memcpy_dtod(&a, &mut b).unwrap();
    assert_eq!(stream.clone_dtoh(&b).unwrap(), data);
    stream.memset_zeros(&mut b).unwrap();
    assert_eq!(stream.clone_dtoh(&b).unwrap(), vec![0; 1024]);
    let pool = route.pool();
    drop((a, b));
    stream.synchronize().unwrap();
    assert_eq!(s.pool_used(pool), 0, "cudarc's frees went back into the phase's pool");
    route.end().unwrap();
    assert_eq!(s.runtime.driver().device_mem_pool(device).unwrap(), before, "the previous pool is current again");
    s.assert_no_errors();
}

#[test]
fn views_of_step_buffers_take_cudarc_copies_on_any_stream() {
    let s = setup();
    let (stream, pair) = s.pair();
    let other = s.ctx.new_stream().unwrap();
    let data = pattern(2048);
    let step = s.runtime.begin_step().unwrap();
    let mut view = pair.view::<u32>(step.alloc(Phase::ACTIVATIONS, 8192, pair.steppool()).unwrap()).unwrap();
    stream.memcpy_htod(&data, &mut view).unwrap();
    assert_eq!(stream.clone_dtoh(&view).unwrap(), data);
    // Another stream waits for the view's stream before it reads.
    assert_eq!(other.clone_dtoh(&view).unwrap(), data);
    other.memset_zeros(&mut view).unwrap();
    assert_eq!(stream.clone_dtoh(&view).unwrap(), vec![0; 2048]);
    drop(view);
    let report = step.end().unwrap();
    assert_eq!(report.released(), 0, "the view freed its buffer; the step had nothing left");
    s.assert_no_errors();
}

#[test]
fn a_lent_slice_never_frees_steppool_memory() {
    let s = setup();
    let (stream, pair) = s.pair();
    let pool = s.runtime.pool_handle(Phase::WEIGHTS, pair.steppool()).unwrap().expect("a pool");
    let mut view = pair.view::<u32>(s.runtime.alloc(Phase::WEIGHTS, 4096, pair.steppool()).unwrap()).unwrap();
    let data = pattern(1024);
    view.with_slice(|slice| stream.memcpy_htod(&data, slice)).unwrap();
    // A panic while the slice is lent does not free it either.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        view.with_slice(|_slice| panic!("a framework call fails"));
    }));
    assert!(panicked.is_err());
    assert_eq!(stream.clone_dtoh(&view).unwrap(), data, "the memory is still the buffer's");
    drop(view);
    stream.synchronize().unwrap();
    assert_eq!(s.pool_used(pool), 0);
    // A second free of the buffer's pointer would have been refused and recorded.
    s.assert_no_errors();
}

#[test]
fn a_routed_slice_outlives_its_step_and_is_freed_once() {
    let s = setup();
    let (stream, pair) = s.pair();
    let scratch = s.runtime.declare_phase(PhaseSpec::new("cudarc_scratch", Scope::Step)).unwrap();
    let data = pattern(4096);
    let step = s.runtime.begin_step().unwrap();
    let route = route_allocations(&s.runtime, scratch, pair.steppool()).unwrap();
    let pool = route.pool();
    let slice = stream.clone_htod(&data).unwrap();
    route.end().unwrap();
    let report = step.end().unwrap();
    // The step end released only what steppool handed out: the slice is cudarc's, still intact.
    assert_eq!(report.released(), 0);
    assert_eq!(stream.clone_dtoh(&slice).unwrap(), data);
    assert!(s.pool_used(pool) >= 16384);
    drop(slice);
    stream.synchronize().unwrap();
    assert_eq!(s.pool_used(pool), 0);
    s.assert_no_errors();
}

#[test]
fn a_steppool_stream_serves_cudarc() {
    let s = setup();
    let device = s.runtime.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    // SAFETY: the pair, and the cudarc stream inside it, end with the test, before `stream`.
    let pair = unsafe { StreamPair::from_steppool(&device, &s.ctx, &stream) }.unwrap();
    assert_eq!(pair.cudarc().cu_stream() as usize, stream.raw() as usize);
    let data = pattern(512);
    let mut view = pair.view::<u32>(s.runtime.alloc(Phase::WEIGHTS, 2048, &stream).unwrap()).unwrap();
    pair.cudarc().memcpy_htod(&data, &mut view).unwrap();
    assert_eq!(pair.cudarc().clone_dtoh(&view).unwrap(), data);
    drop(view);
    s.assert_no_errors();
}

#[test]
fn pairing_checks_what_it_is_given() {
    let s = setup();
    let (_stream, pair) = s.pair();
    let odd = s.runtime.alloc(Phase::WEIGHTS, 4098, pair.steppool()).unwrap();
    assert!(matches!(pair.view::<u32>(odd), Err(InteropError::Length { bytes: 4098, element: 4 })));
    let elsewhere = s.runtime.device(0).unwrap().create_stream().unwrap();
    let buffer = s.runtime.alloc(Phase::WEIGHTS, 4096, &elsewhere).unwrap();
    assert!(matches!(pair.view::<u32>(buffer), Err(InteropError::WrongStream { .. })));
    // A runtime on a simulated device of its own cannot meet cudarc.
    let separate = steppool_tests::simulated_runtime(1 << 30);
    let device = separate.device(0).unwrap();
    // SAFETY: refused before anything is wrapped.
    let refused = unsafe { StreamPair::from_cudarc(&device, pair.cudarc()) };
    assert!(matches!(refused, Err(InteropError::NotShared { .. })), "{refused:?}");
    let separate_stream = device.create_stream().unwrap();
    let refused = route_allocations(&separate, Phase::WEIGHTS, &separate_stream);
    assert!(matches!(refused, Err(InteropError::NotShared { .. })), "{refused:?}");
    s.assert_no_errors();
}

#[test]
fn routes_nest_and_an_out_of_order_end_is_reported() {
    let s = setup();
    let (stream, pair) = s.pair();
    let driver = s.runtime.driver().clone();
    let device = driver.device(0).unwrap();
    let before = driver.device_mem_pool(device).unwrap();
    // In order: the inner route serves while it lives, then the outer one again.
    let outer = route::route_allocations(&s.runtime, Phase::WEIGHTS, pair.steppool()).unwrap();
    let inner = route::route_allocations(&s.runtime, Phase::WORKSPACE, pair.steppool()).unwrap();
    let in_inner = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    assert!(inner.counters().unwrap().used >= 1 << 20, "the inner route's pool serves");
    assert_eq!(outer.counters().unwrap().used, 0);
    inner.end().unwrap();
    let in_outer = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    assert!(outer.counters().unwrap().used >= 1 << 20, "the outer route's pool serves again");
    outer.end().unwrap();
    assert_eq!(driver.device_mem_pool(device).unwrap(), before);
    drop((in_inner, in_outer));
    // Out of order: the outer guard finds the inner pool current, says so and leaves it.
    let outer = route::route_allocations(&s.runtime, Phase::WEIGHTS, pair.steppool()).unwrap();
    let inner = route::route_allocations(&s.runtime, Phase::WORKSPACE, pair.steppool()).unwrap();
    let (outer_pool, inner_pool) = (outer.pool(), inner.pool());
    let ended = outer.end();
    assert!(
        matches!(ended, Err(InteropError::RouteChanged { device: 0, routed, found })
            if routed == outer_pool as usize && found == inner_pool as usize),
        "{ended:?}"
    );
    assert_eq!(driver.device_mem_pool(device).unwrap(), inner_pool, "left as found");
    inner.end().unwrap();
    assert_eq!(driver.device_mem_pool(device).unwrap(), outer_pool, "the inner route restores what it found");
    // SAFETY: `before` is the device's default pool or one that outlives the test.
    unsafe { driver.device_set_mem_pool(device, before) }.unwrap();
    stream.synchronize().unwrap();
    s.assert_no_errors();
}

#[test]
fn a_step_end_trims_what_routed_code_freed() {
    let s = setup();
    let (stream, pair) = s.pair();
    let phase = s
        .runtime
        .declare_phase(PhaseSpec::new("routed_activations", Scope::Step).trim(TrimPolicy::KeepBytes(0)))
        .unwrap();
    let step = s.runtime.begin_step().unwrap();
    let route = route::route_allocations(&s.runtime, phase, pair.steppool()).unwrap();
    let slices: Vec<_> = (0..4).map(|_| stream.alloc_zeros::<f32>(4 << 20).unwrap()).collect();
    let held = route.counters().unwrap();
    assert!(held.used >= 64 << 20 && held.reserved >= held.used, "{held:?}");
    drop(slices); // the framework frees its activations before the step ends
    stream.synchronize().unwrap();
    route.end().unwrap();
    let report = step.end().unwrap();
    let phase = report.phase(phase).expect("the routed phase is in the report");
    assert_eq!(phase.released, 0, "routed memory is the framework's: the step end frees none of it");
    assert!(phase.peak_reserved >= 64 << 20, "the report's reservation counts routed memory");
    assert_eq!(phase.reserved, 0, "the step end trimmed what the framework freed");
    s.assert_no_errors();
}

/// cubecl-cuda's storage (burn's CUDA backend) takes its pages with cudarc's result layer,
/// `malloc_async(stream, bytes)`, and frees them with `free_async` at its memory cleanup: the
/// same calls, made here on the stand-in, land in the routed phase and are trimmed at the step end.
#[test]
fn pages_taken_with_cuda_mem_alloc_async_land_in_the_routed_phase() {
    let s = setup();
    let (stream, pair) = s.pair();
    let phase = s.runtime.declare_phase(PhaseSpec::new("pages", Scope::Step).trim(TrimPolicy::KeepBytes(0))).unwrap();
    let step = s.runtime.begin_step().unwrap();
    let route = route::route_allocations(&s.runtime, phase, pair.steppool()).unwrap();
    let pages: Vec<_> = (0..3)
        // SAFETY: a live stream of the current context; each page is freed once, below.
        .map(|_| unsafe { cudarc::driver::result::malloc_async(stream.cu_stream(), 8 << 20) }.unwrap())
        .collect();
    assert_eq!(route.counters().unwrap().used, 24 << 20, "every page is the routed pool's");
    route.end().unwrap();
    for page in pages {
        // SAFETY: allocated above on this stream, freed once.
        unsafe { cudarc::driver::result::free_async(page, stream.cu_stream()) }.unwrap();
    }
    stream.synchronize().unwrap();
    let report = step.end().unwrap();
    let phase = report.phase(phase).expect("the routed phase is in the report");
    assert!(phase.peak_reserved >= 24 << 20);
    assert_eq!(phase.reserved, 0, "the step end trimmed the freed pages");
    s.assert_no_errors();
}
