//! Allocation latency: one allocation and its free, in a loop, for each size.
//!
//! - `driver_pool`: `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` on a pool with the release
//!   threshold raised, straight through `steppool-sys`: the floor steppool's `Pool` is measured
//!   against (goal: within 1.1×).
//! - `steppool_pool`: a persistent phase with the `Pool` strategy (`Runtime::alloc`, drop).
//! - `steppool_arena`: a step-scoped arena; each freed buffer is the most recent one, so the bump
//!   pointer moves back and no memory grows (goal: tens of nanoseconds).

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use steppool::sys::{CUmemPool_attribute, PoolProps};
use steppool::{Phase, PhaseSpec, Scope, Strategy};
use steppool_benches::{SIZES, runtime};

fn alloc_free_pairs(c: &mut Criterion) {
    let runtime = runtime();
    let device = runtime.device(0).expect("device 0");
    let stream = device.create_stream().expect("a stream");
    let driver = runtime.driver().clone();
    let mut group = c.benchmark_group(format!("alloc_free_pair/{}", if device.is_gpu() { "gpu" } else { "sim" }));
    group.throughput(Throughput::Elements(1));

    let pool = driver.mem_pool_create(&PoolProps::device(0).build()).expect("a pool");
    // SAFETY: the pool was just created.
    unsafe { driver.mem_pool_set_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX) }
        .expect("release threshold");
    let arena = runtime
        .declare_phase(PhaseSpec::new("bench_arena", Scope::Step).strategy(Strategy::Arena { slab_bytes: 512 << 20 }))
        .expect("an arena phase");

    for size in SIZES {
        group.bench_with_input(BenchmarkId::new("driver_pool", size), &size, |b, &size| {
            b.iter(|| {
                // SAFETY: pool and stream are live; the pointer is freed at once and never used.
                unsafe {
                    let ptr = driver.mem_alloc_from_pool_async(size as usize, pool, stream.raw()).unwrap();
                    driver.mem_free_async(black_box(ptr), stream.raw()).unwrap();
                }
            });
        });
        group.bench_with_input(BenchmarkId::new("steppool_pool", size), &size, |b, &size| {
            b.iter(|| drop(black_box(runtime.alloc(Phase::WEIGHTS, size, &stream).unwrap())));
        });
        let step = runtime.begin_step().expect("a step");
        group.bench_with_input(BenchmarkId::new("steppool_arena", size), &size, |b, &size| {
            b.iter(|| drop(black_box(step.alloc(arena, size, &stream).unwrap())));
        });
        step.end().expect("end of step");
    }
    group.finish();
    stream.synchronize().expect("synchronize");
    // SAFETY: every allocation from the pool was freed; it is not used again.
    unsafe { driver.mem_pool_destroy(pool) }.expect("destroy pool");
}

criterion_group!(benches, alloc_free_pairs);
criterion_main!(benches);
