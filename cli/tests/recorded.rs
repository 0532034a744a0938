//! A trace the runtime records reads back, phases and steps included, and replays: recording and
//! replay agree on what the workload did.

use steppool::sys::sim::SimConfig;
use steppool::{Phase, PhaseSpec, Runtime, Scope, Strategy};
use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::read::read_trace;
use steppool_trace::{StepSource, TraceFormat};

const MIB: u64 = 1 << 20;

/// Records three steps with micro-steps and a boundary release, and returns the trace file's text
/// and the peak of live bytes the runtime saw.
fn record() -> (Vec<u8>, u64) {
    let runtime =
        Runtime::builder().simulated(SimConfig::with_capacity(4 << 30)).record_history(1 << 16).build().unwrap();
    let micro =
        runtime.declare_phase(PhaseSpec::new("micro_activations", Scope::MicroStep).strategy(Strategy::ARENA)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let weights = runtime.alloc(Phase::WEIGHTS, 100 * MIB, &stream).unwrap();
    let mut peak = 0;
    for index in 0..3u64 {
        let step = runtime.begin_step().unwrap();
        let grads = step.alloc(Phase::GRADIENTS, 50 * MIB, &stream).unwrap();
        for m in 0..2u64 {
            let micro_step = step.begin_micro_step().unwrap();
            let a = micro_step.alloc(micro, (10 + index + m) * MIB, &stream).unwrap();
            let b = micro_step.alloc(micro, 5 * MIB, &stream).unwrap();
            peak = peak.max(150 * MIB + (15 + index + m) * MIB);
            drop((b, a));
            micro_step.end().unwrap();
        }
        // A raw allocation left for the boundary to release.
        // SAFETY: never used; the step's end releases it.
        unsafe { runtime.raw().alloc(Phase::ACTIVATIONS, 7 * MIB, &stream) }.unwrap();
        drop(grads);
        step.end().unwrap();
    }
    drop(weights);
    let mut bytes = Vec::new();
    runtime.telemetry().history().write_trace(&mut bytes).unwrap();
    (bytes, peak)
}

#[test]
fn a_recorded_trace_reads_back_with_its_phases_and_steps() {
    let (bytes, peak) = record();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("recorded.jsonl");
    std::fs::write(&path, bytes).unwrap();
    let trace = read_trace(&path).unwrap();
    assert_eq!(trace.format, TraceFormat::Steppool);
    assert_eq!(trace.steps, StepSource::Trace);
    assert!(trace.warnings.is_empty(), "{:?}", trace.warnings);
    let names: Vec<&str> = trace.phases.iter().map(|p| p.name.as_str()).collect();
    for name in ["weights", "gradients", "activations", "micro_activations"] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    let analysis = analyse(&trace).unwrap();
    assert_eq!(analysis.steps, 3);
    assert_eq!(analysis.peak_live_bytes, peak.max(150 * MIB + 7 * MIB));
    assert_eq!(analysis.live_at_end, 0);
}

#[test]
fn a_recorded_trace_replays_under_every_strategy() {
    let (bytes, _) = record();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("recorded.jsonl");
    std::fs::write(&path, bytes).unwrap();
    let trace = read_trace(&path).unwrap();
    let analysis = analyse(&trace).unwrap();
    let results = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    assert_eq!(results.len(), select("all").unwrap().len());
    for result in &results {
        assert!(result.run.completed(), "{}", result.run.strategy);
        assert_eq!(result.run.peak_live_bytes, analysis.peak_live_bytes);
        assert!(result.run.peak_reserved_bytes >= analysis.peak_live_bytes);
    }
}
