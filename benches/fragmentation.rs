//! 5. Fragmentation: every sequence (the RMM-format traces of `cli/tests/data/` or `STEPPOOL_TRACES`, and the
//!    variable-length transformer) replayed through every allocator on one stream, with the
//!    device's footprint sampled after each allocation (see `src/replay.rs`). Records per
//!    allocator and sequence: `peak_reserved_bytes`, and once per sequence `peak_live_bytes` (the
//!    least any allocator must hold). criterion also times each replay (`replay` group).
//!
//! Goal (measured, never asserted): steppool's peak reserved at or below every peer's on every
//! sequence. On the simulated device the placement inside a pool is steppool's documented model
//! of the driver, not NVIDIA's.

#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use steppool_benches::alloc::Kind;
use steppool_benches::record::{Line, Record, emit};
use steppool_benches::replay::Replayer;
use steppool_benches::sequence::{Sequence, traces, varlen_transformer};
use steppool_benches::{Mode, bench_config, device_info, driver, traces_dir};

/// Every sequence of the benchmark: the traces, then the synthetic transformer.
fn sequences() -> Vec<Sequence> {
    let mut sequences = Vec::new();
    let dir = traces_dir();
    let files = traces(&dir);
    if files.is_empty() {
        eprintln!("fragmentation: no traces in {} (set STEPPOOL_TRACES)", dir.display());
    }
    for csv in files {
        sequences.push(Sequence::read(&csv).unwrap_or_else(|error| panic!("{error}")));
    }
    sequences.push(varlen_transformer(Mode::current() == Mode::Smoke));
    sequences
}

fn fragmentation(c: &mut Criterion) {
    emit(&Line::Device(device_info(&driver())));
    let mut group = c.benchmark_group("replay");
    group.sample_size(10);
    for sequence in sequences() {
        sequence.validate().expect("a valid sequence");
        let name = sequence.name.as_str();
        emit(&Line::Record(
            Record::rust("fragmentation", "sequence", "peak_live_bytes", sequence.peak_live() as f64).workload(name),
        ));
        for kind in Kind::ALL {
            let mut allocator = kind.make().expect("an allocator");
            let mut replayer = Replayer::new(allocator.as_mut(), &sequence).measure_footprint().expect("footprint");
            replayer.run(&sequence.ops).expect("the replay");
            let peak = replayer.peak_reserved().expect("measured");
            replayer.finish().expect("finish");
            emit(&Line::Record(
                Record::rust("fragmentation", kind.name(), "peak_reserved_bytes", peak as f64).workload(name),
            ));
            group.bench_function(BenchmarkId::new(kind.name(), name), |b| {
                b.iter(|| {
                    let mut replayer = Replayer::new(allocator.as_mut(), &sequence);
                    replayer.run(&sequence.ops).unwrap();
                    replayer.finish().unwrap();
                });
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = bench_config();
    targets = fragmentation
}
criterion_main!(benches);
