//! 3. Step release: the cost of ending a step against the number of allocations still live in
//!    it, per strategy. Each iteration begins a step, allocates `live` buffers of 64 KiB through
//!    the raw API (untimed), and times `RawApi::end_step`, which releases them all at once.
//!
//! Goal (measured, never asserted): release under 0.1 % of step time; the kernel-step
//! benchmark records that share on a real step, this one how the cost grows with `live`.

#![allow(missing_docs)]

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use steppool::{PhaseSpec, Scope, Strategy};
use steppool_benches::record::{Line, emit};
use steppool_benches::{Mode, bench_config, device_info, driver, pick, runtime};

const SIZE: u64 = 64 << 10;
const LIVE: [u64; 5] = [1, 16, 256, 1024, 4096];
const SMOKE_LIVE: [u64; 2] = [1, 64];

fn step_release(c: &mut Criterion) {
    emit(&Line::Device(device_info(&driver())));
    let mut group = c.benchmark_group("step_release");
    // The untimed setup of each iteration costs more than the release it prepares; keep the
    // sampling short so the benchmark stays within minutes (smoke mode is shorter still).
    if Mode::current() == Mode::Full {
        group.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    }
    let strategies = [
        ("steppool_pool", Strategy::Direct),
        ("steppool_arena", Strategy::ARENA),
        ("steppool_planned", Strategy::PLANNED),
    ];
    for (name, strategy) in strategies {
        let runtime = runtime();
        let stream = runtime.device(0).expect("device 0").create_stream().expect("a stream");
        let phase = runtime.declare_phase(PhaseSpec::new("bench_step", Scope::Step).strategy(strategy)).expect("phase");
        for live in pick(&LIVE, &SMOKE_LIVE) {
            group.bench_with_input(BenchmarkId::new(name, live), &live, |b, &live| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        runtime.raw().begin_step().unwrap();
                        for _ in 0..live {
                            // SAFETY: never used; released by the step's end below.
                            unsafe { runtime.raw().alloc(phase, SIZE, &stream) }.unwrap();
                        }
                        let start = Instant::now();
                        // SAFETY: nothing uses the released pointers.
                        unsafe { runtime.raw().end_step() }.unwrap();
                        total += start.elapsed();
                    }
                    total
                });
            });
        }
        stream.synchronize().expect("synchronize");
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = bench_config();
    targets = step_release
}
criterion_main!(benches);
