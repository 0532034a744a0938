//! 1. Allocation latency: one allocation and its free, in a loop, for each size from 256 B to
//!    256 MiB, for every allocator of [`Kind`] (see `src/alloc.rs`).
//!
//! - `latency`: alloc + free pairs with nothing else. `steppool_pool` and `steppool_arena` use
//!   the `Buffer` API (`Runtime::alloc` / `Step::alloc`, drop); the others call the driver. The
//!   arena's freed buffer is always the most recent one, so its bump pointer moves back.
//! - `latency_sync`: the same pair followed by a stream synchronization, as a training loop
//!   that reads its loss every step does: where the release threshold is 0 the driver gives the
//!   memory back at each synchronization and maps it again at the next allocation.
//!
//! - `steppool_planned` (in `latency` only): steps of [`PLANNED_PAIRS`] pairs, repeated, so from
//!   the second step of a size on every pair is served at its planned offset; only the pairs are
//!   timed, not the step boundaries. Every step is whole (a shorter one would be another scope,
//!   which the plan does not serve whole): criterion's iteration count is rounded up to whole
//!   steps and the time scaled back to it.
//!
//! Goals (measured, never asserted): `steppool_pool` within 1.1× of `driver_pool`;
//! `steppool_arena` under 50 ns per pair; `steppool_planned` under 50 ns per pair.

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use steppool::{PhaseSpec, Scope, Strategy};
use steppool_benches::alloc::Kind;
use steppool_benches::record::{Line, emit};
use steppool_benches::sequence::Lifetime;
use steppool_benches::{SIZES, SMOKE_SIZES, bench_config, device_info, driver, pick, runtime};

/// Pairs per step of the `steppool_planned` rows.
const PLANNED_PAIRS: u64 = 256;

const DRIVER_KINDS: [Kind; 4] = [Kind::CudaMalloc, Kind::DefaultPoolT0, Kind::DefaultPool, Kind::DriverPool];

fn latency(c: &mut Criterion, group_name: &str, sync: bool) {
    let sizes = pick(&SIZES, &SMOKE_SIZES);
    let mut group = c.benchmark_group(group_name);
    group.throughput(Throughput::Elements(1));
    for kind in DRIVER_KINDS {
        if sync && kind == Kind::CudaMalloc {
            // cuMemFree already waits for the device.
            continue;
        }
        let mut allocator = kind.make().expect("an allocator");
        for &size in &sizes {
            group.bench_with_input(BenchmarkId::new(kind.name(), size), &size, |b, &size| {
                b.iter(|| {
                    let ptr = allocator.alloc(0, size, Lifetime::Persistent).unwrap();
                    allocator.free(0, black_box(ptr)).unwrap();
                    if sync {
                        allocator.end_step().unwrap();
                    }
                });
            });
        }
        allocator.finish().expect("finish");
    }

    let runtime = runtime();
    let stream = runtime.device(0).expect("device 0").create_stream().expect("a stream");
    let persistent = runtime.declare_phase(PhaseSpec::new("bench_pool", Scope::Persistent)).expect("a pool phase");
    let arena = runtime
        .declare_phase(PhaseSpec::new("bench_arena", Scope::Step).strategy(Strategy::ARENA))
        .expect("an arena phase");
    let planned = runtime
        .declare_phase(PhaseSpec::new("bench_planned", Scope::Step).strategy(Strategy::PLANNED))
        .expect("a planned phase");
    for &size in &sizes {
        group.bench_with_input(BenchmarkId::new("steppool_pool", size), &size, |b, &size| {
            b.iter(|| {
                drop(black_box(runtime.alloc(persistent, size, &stream).unwrap()));
                if sync {
                    stream.synchronize().unwrap();
                }
            });
        });
        let step = runtime.begin_step().expect("a step");
        group.bench_with_input(BenchmarkId::new("steppool_arena", size), &size, |b, &size| {
            b.iter(|| {
                drop(black_box(step.alloc(arena, size, &stream).unwrap()));
                if sync {
                    stream.synchronize().unwrap();
                }
            });
        });
        step.end().expect("end of step");
        if !sync {
            group.bench_with_input(BenchmarkId::new("steppool_planned", size), &size, |b, &size| {
                b.iter_custom(|iters| {
                    // Whole steps only: a shorter last step would be a scope of another length,
                    // which its plan does not serve whole. The time of `iters` pairs is the
                    // steps' time scaled down.
                    let steps = iters.div_ceil(PLANNED_PAIRS);
                    let mut timed = Duration::ZERO;
                    for _ in 0..steps {
                        let step = runtime.begin_step().expect("a step");
                        let started = Instant::now();
                        for _ in 0..PLANNED_PAIRS {
                            drop(black_box(step.alloc(planned, size, &stream).unwrap()));
                        }
                        timed += started.elapsed();
                        step.end().expect("end of step");
                    }
                    timed.mul_f64(iters as f64 / (steps * PLANNED_PAIRS) as f64)
                });
            });
        }
    }
    group.finish();
    stream.synchronize().expect("synchronize");
}

fn alloc_free_pairs(c: &mut Criterion) {
    emit(&Line::Device(device_info(&driver())));
    latency(c, "latency", false);
}

fn alloc_free_sync(c: &mut Criterion) {
    latency(c, "latency_sync", true);
}

criterion_group! {
    name = benches;
    config = bench_config();
    targets = alloc_free_pairs, alloc_free_sync
}
criterion_main!(benches);
