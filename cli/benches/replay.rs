//! Replay speed: a generated training trace of about a million events, replayed once through the
//! runtime on the simulated device under each strategy and through each PyTorch model (no
//! bisection), and its offline limit packed.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use steppool_cli::limit::limit;
use steppool_cli::replay::{ReplayOptions, Silent, run, select};
use steppool_cli::synth::{Shape, training_trace};
use steppool_trace::analysis::analyse;
use steppool_trace::steps::infer;

fn replay_million(c: &mut Criterion) {
    let mut trace = training_trace(Shape::with_events(1_000_000));
    infer(&mut trace);
    let analysis = analyse(&trace).expect("a synthetic trace analyses");
    let options = ReplayOptions::new(80 << 30);
    let mut group = c.benchmark_group("replay");
    group.sample_size(10);
    group.throughput(Throughput::Elements(trace.events.len() as u64));
    for def in select("all").expect("every strategy") {
        group.bench_function(format!("{}/{}_events", def.name(), trace.events.len()), |b| {
            b.iter(|| {
                let run = run(&trace, &analysis, def, options.capacity, &options, &Silent).expect("replay");
                black_box(run.peak_reserved_bytes)
            })
        });
    }
    group.bench_function(format!("limit/{}_events", trace.events.len()), |b| {
        b.iter(|| black_box(limit(&analysis).expect("a valid packing").bytes))
    });
    group.finish();
}

criterion_group!(benches, replay_million);
criterion_main!(benches);
