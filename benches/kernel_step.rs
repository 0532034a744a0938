//! 4. Kernel-level step: a training step of the fixed-shape transformer
//!    ([`fixed_transformer`]), where every allocation is written whole by the `fill_v4` kernel
//!    (PTX in `sys/kernels/`, loaded with `cuModuleLoadData`, launched with `cuLaunchKernel`)
//!    between the step's allocations and frees. One iteration is one step, ended by a stream
//!    synchronization, for every allocator and for `preallocated`: every buffer made once
//!    beforehand, the floor where allocation costs nothing.
//!
//! The first step (which also allocates the optimizer state) runs once untimed; the timed steps
//! are identical. For steppool, the share of each step spent releasing it at the boundary is
//! recorded too (`release_share`, the median over the timed steps).
//!
//! Goals (measured, never asserted): step time within 1 % of `preallocated`; release under
//! 0.1 % of step time. On the simulated device kernels do not run: times are host costs alone.

#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use steppool_benches::alloc::{Allocator, Kind, Preallocated};
use steppool_benches::kernel::Fill;
use steppool_benches::record::{Line, Record, emit};
use steppool_benches::replay::Replayer;
use steppool_benches::sequence::{Lifetime, Op, fixed_transformer, transformer};
use steppool_benches::{Mode, bench_config, device_info, driver};

const WORKLOAD: &str = "transformer_fixed";

fn kernel_step(c: &mut Criterion) {
    emit(&Line::Device(device_info(&driver())));
    let sequence = transformer(WORKLOAD, fixed_transformer(Mode::current() == Mode::Smoke), 2);
    sequence.validate().expect("a valid sequence");
    let boundary = sequence.ops.iter().rposition(|op| *op == Op::Step).expect("two steps");
    let (first, steady) = (&sequence.ops[..boundary], &sequence.ops[boundary + 1..]);
    assert!(
        steady.iter().all(|op| !matches!(op, Op::Alloc { lifetime: Lifetime::Persistent, .. })),
        "later steps allocate nothing persistent"
    );
    let mut group = c.benchmark_group("kernel_step");
    group.sample_size(20);

    for kind in Kind::ALL {
        let mut allocator = kind.make().expect("an allocator");
        run(&mut group, allocator.as_mut(), &sequence, first, steady);
    }
    let mut preallocated = Preallocated::new(sequence.allocations()).expect("preallocated buffers");
    run(&mut group, &mut preallocated, &sequence, first, steady);
    group.finish();
}

fn run(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    allocator: &mut dyn Allocator,
    sequence: &steppool_benches::sequence::Sequence,
    first: &[Op],
    steady: &[Op],
) {
    let name = allocator.name();
    let fill = Fill::load(allocator.driver()).expect("the fill_v4 kernel");
    let mut replayer = Replayer::new(allocator, sequence).fill(&fill);
    replayer.run(first).expect("the first step");
    replayer.run(&[Op::Step]).expect("the first step's end");
    let before = replayer.step_times().len();
    group.bench_function(BenchmarkId::new(name, WORKLOAD), |b| {
        b.iter(|| {
            replayer.run(steady).unwrap();
            replayer.run(&[Op::Step]).unwrap();
        });
    });
    let mut shares: Vec<f64> =
        replayer.step_times()[before..].iter().map(|t| t.release_ns / t.step_ns.max(1.0)).collect();
    if !shares.is_empty() {
        shares.sort_by(f64::total_cmp);
        let median = shares[shares.len() / 2];
        emit(&Line::Record(Record::rust("kernel_step", name, "release_share", median).workload(WORKLOAD)));
    }
    replayer.finish().expect("finish");
}

criterion_group! {
    name = benches;
    config = bench_config();
    targets = kernel_step
}
criterion_main!(benches);
