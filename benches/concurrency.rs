//! 2. Concurrency: 1 to 16 threads, each on its own stream, allocating and freeing 64 KiB in a
//!    loop. One iteration is one pair on every thread at once, so criterion's time per
//!    iteration gives the throughput (`threads / time`) and its scaling against one thread.
//!
//! - `driver_pool`: one pool of its own (threshold raised) shared by all threads, each
//!   allocating on its own stream: the driver's own scaling.
//! - `default_pool`: the device's default pool, threshold raised.
//! - `steppool_pool`: a persistent `Pool` phase; each stream gets its own pool.
//! - `steppool_arena`: a step-scoped `Arena` phase through the raw API; each stream its own arena.
//!
//! Goal (measured, never asserted): 8 threads at 6× or more of one thread's throughput.

#![allow(missing_docs)]

use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use steppool::sys::{CUmemPool_attribute, CUmemoryPool, PoolProps};
use steppool::{PhaseSpec, Scope, Strategy, Stream};
use steppool_benches::record::{Line, emit};
use steppool_benches::{bench_config, device_info, driver, pick, runtime};

const SIZE: u64 = 64 << 10;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const SMOKE_THREADS: [usize; 2] = [1, 2];

/// Runs `work(thread, iters)` on `threads` threads released together; returns the wall time from
/// the first thread's start to the last one's end.
fn on_threads(threads: usize, iters: u64, work: &(dyn Fn(usize, u64) + Sync)) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    work(thread, iters);
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a benchmark thread panicked")).collect()
    });
    let start = spans.iter().map(|s| s.0).min().expect("at least one thread");
    let end = spans.iter().map(|s| s.1).max().expect("at least one thread");
    end - start
}

/// A driver handle (pool, context) that threads share; the driver API is thread-safe.
#[derive(Clone, Copy)]
struct Shared<T>(T);
// SAFETY: pool and context handles are opaque driver handles; the driver synchronizes calls on
// them internally.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    fn get(&self) -> T {
        self.0
    }
}

fn concurrency(c: &mut Criterion) {
    emit(&Line::Device(device_info(&driver())));
    let threads_list = pick(&THREADS, &SMOKE_THREADS);
    let max_threads = *threads_list.iter().max().expect("thread counts");
    let runtime = runtime();
    let device = runtime.device(0).expect("device 0");
    let driver = runtime.driver().clone();
    let ctx = Shared(device.raw_context());
    let streams: Vec<Stream> = (0..max_threads).map(|_| device.create_stream().expect("a stream")).collect();
    let persistent = runtime.declare_phase(PhaseSpec::new("bench_pool", Scope::Persistent)).expect("phase");
    let arena =
        runtime.declare_phase(PhaseSpec::new("bench_arena", Scope::Step).strategy(Strategy::ARENA)).expect("phase");
    let own: Shared<CUmemoryPool> = Shared(driver.mem_pool_create(&PoolProps::device(0).build()).expect("a pool"));
    let default = Shared(driver.device_default_mem_pool(0).expect("the default pool"));
    let threshold = CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
    for pool in [own, default] {
        // SAFETY: both pools are live.
        unsafe { driver.mem_pool_set_attribute(pool.get(), threshold, u64::MAX) }.expect("release threshold");
    }

    let mut group = c.benchmark_group("concurrency");
    for &threads in &threads_list {
        group.throughput(Throughput::Elements(threads as u64));
        for (name, pool) in [("driver_pool", own), ("default_pool", default)] {
            let work = |thread: usize, iters: u64| {
                let stream = streams[thread].raw();
                // SAFETY: the device's primary context, retained by the runtime.
                unsafe { driver.context_set_current(ctx.get()) }.expect("current context");
                for _ in 0..iters {
                    // SAFETY: pool and stream are live; the pointer is freed at once, unused.
                    unsafe {
                        let ptr = driver.mem_alloc_from_pool_async(SIZE as usize, pool.get(), stream).unwrap();
                        driver.mem_free_async(black_box(ptr), stream).unwrap();
                    }
                }
            };
            group.bench_with_input(BenchmarkId::new(name, threads), &threads, |b, &threads| {
                b.iter_custom(|iters| on_threads(threads, iters, &work));
            });
        }
        let work = |thread: usize, iters: u64| {
            for _ in 0..iters {
                drop(black_box(runtime.alloc(persistent, SIZE, &streams[thread]).unwrap()));
            }
        };
        group.bench_with_input(BenchmarkId::new("steppool_pool", threads), &threads, |b, &threads| {
            b.iter_custom(|iters| on_threads(threads, iters, &work));
        });
        runtime.raw().begin_step().expect("a step");
        let work = |thread: usize, iters: u64| {
            for _ in 0..iters {
                // SAFETY: the pointer is freed at once and never used; the stream outlives it.
                unsafe {
                    let ptr = runtime.raw().alloc(arena, SIZE, &streams[thread]).unwrap();
                    runtime.raw().free(black_box(ptr)).unwrap();
                }
            }
        };
        group.bench_with_input(BenchmarkId::new("steppool_arena", threads), &threads, |b, &threads| {
            b.iter_custom(|iters| on_threads(threads, iters, &work));
        });
        // SAFETY: every pointer of the step was freed and is not used again.
        unsafe { runtime.raw().end_step() }.expect("end of step");
    }
    group.finish();
    for stream in &streams {
        stream.synchronize().expect("synchronize");
    }
    // SAFETY: every allocation was freed and the streams are idle; the default pool stays.
    unsafe {
        driver.mem_pool_destroy(own.get()).expect("destroy pool");
        driver.mem_pool_set_attribute(default.get(), threshold, 0).expect("release threshold");
        driver.mem_pool_trim_to(default.get(), 0).expect("trim");
    }
}

criterion_group! {
    name = benches;
    config = bench_config();
    targets = concurrency
}
criterion_main!(benches);
