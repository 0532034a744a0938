//! Telemetry: counters, step reports' free space, each warning rule firing and staying silent,
//! the OOM report, and every exporter's format read back by a real parser.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};

use serde_pickle::{DeOptions, HashableValue, Value};
use steppool::telemetry::json::{JsonLines, oom_json, step_json};
use steppool::telemetry::{
    FragmentationRule, GroupKey, LowHeadroomRule, MAX_REQUEST_BYTES, ReservedCreepRule, ScatteredFreeRule,
    ServeOptions, Warning, WarningKind, WarningRules,
};
use steppool::{
    Breakdown, CaptureMemory, CaptureMode, Error, PageTraffic, Phase, PhaseSpec, Runtime, Scope, Strategy, TrimPolicy,
    Verdict,
};
use steppool_tests::{pool_slab_runtime, segment_runtime, simulated_runtime};

const MIB: u64 = 1 << 20;

fn only(rules: WarningRules) -> Runtime {
    let runtime = simulated_runtime(1 << 30);
    runtime.telemetry().set_warning_rules(rules);
    runtime
}

fn collect(runtime: &Runtime) -> Arc<Mutex<Vec<Warning>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    runtime.telemetry().on_warning(move |warning| sink.lock().unwrap().push(warning.clone()));
    seen
}

// ----- counters ---------------------------------------------------------------------------------

#[test]
fn counters_add_up_per_pool_phase_stream_and_device() {
    let runtime = simulated_runtime(4 << 30);
    let device = runtime.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let weights = runtime.alloc(Phase::WEIGHTS, 10 * MIB, &a).unwrap();
    let more = runtime.alloc(Phase::WEIGHTS, 6 * MIB, &b).unwrap();
    for _ in 0..3 {
        let step = runtime.begin_step().unwrap();
        let x = step.alloc(Phase::ACTIVATIONS, 8 * MIB, &a).unwrap();
        let y = step.alloc(Phase::ACTIVATIONS, 4 * MIB, &b).unwrap();
        drop((x, y));
        step.end().unwrap();
    }
    drop(more);
    let metrics = runtime.telemetry().metrics().unwrap();
    assert_eq!(metrics.steps, 3);
    let pool = |phase: Phase, stream: u32| {
        metrics.pools.iter().find(|p| p.pool.phase == phase && p.pool.stream == stream).unwrap().usage
    };
    let (sa, sb) = (a.id(), b.id());
    assert_eq!(pool(Phase::WEIGHTS, sa).used, 10 * MIB);
    assert_eq!(pool(Phase::WEIGHTS, sb).used, 0);
    assert_eq!(pool(Phase::WEIGHTS, sb).used_high, 6 * MIB);
    assert_eq!(pool(Phase::WEIGHTS, sb).frees, 1);
    assert_eq!(pool(Phase::ACTIVATIONS, sa).allocations, 3);
    assert_eq!(pool(Phase::ACTIVATIONS, sa).requested_bytes, 24 * MIB);
    assert_eq!(pool(Phase::ACTIVATIONS, sb).requested_bytes, 12 * MIB);
    assert!(pool(Phase::ACTIVATIONS, sa).reserved_high >= 8 * MIB);

    let by_phase: HashMap<GroupKey, _> = metrics.by_phase().into_iter().collect();
    let activations = by_phase[&GroupKey::Phase { device: 0, phase: "activations".into() }];
    assert_eq!(activations.allocations, 6);
    assert_eq!(activations.requested_bytes, 36 * MIB);
    let by_stream: HashMap<GroupKey, _> = metrics.by_stream().into_iter().collect();
    assert_eq!(by_stream[&GroupKey::Stream { device: 0, stream: sa }].allocations, 4);
    let total = metrics.by_device()[0].1;
    assert_eq!(total.allocations, 8);
    assert_eq!(total.used, 10 * MIB);
    assert_eq!(metrics.total(), total);
    assert_eq!(metrics.devices.len(), 1);
    assert_eq!(metrics.devices[0].total, 4 << 30);
    // A stream's pools go with it; their counts stay, so counters never go back.
    drop((weights, a, b));
    let after = runtime.telemetry().metrics().unwrap();
    assert!(after.pools.iter().all(|p| p.retired));
    assert_eq!(after.total().allocations, 8);
    assert_eq!(after.total().requested_bytes, total.requested_bytes);
    assert!(after.by_stream().is_empty());
    assert!(
        after
            .to_prometheus()
            .contains(r#"steppool_allocations_total{device="0",stream="retired",phase="activations"} 6"#)
    );
}

#[test]
fn failures_recoveries_and_ooms_are_counted() {
    let runtime = simulated_runtime(256 * MIB);
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let capped = runtime.declare_phase(PhaseSpec::new("capped", Scope::Persistent).budget(MIB)).unwrap();
    assert!(matches!(runtime.alloc(capped, 2 * MIB, &stream), Err(Error::BudgetExceeded { .. })));
    // Idle memory held by another pool is given back on out-of-memory, and the retry succeeds.
    let idle = runtime.alloc(Phase::OPTIMIZER_STATE, 200 * MIB, &stream).unwrap();
    drop(idle);
    let big = runtime.alloc(Phase::WEIGHTS, 200 * MIB, &stream).unwrap();
    let failed = runtime.alloc(Phase::WEIGHTS, 200 * MIB, &stream);
    assert!(matches!(failed, Err(Error::OutOfMemory(_))));
    let metrics = runtime.telemetry().metrics().unwrap();
    let usage = |name: &str| metrics.pools.iter().find(|p| p.phase_name == name).unwrap().usage;
    assert_eq!(usage("capped").failures, 1);
    assert_eq!(usage("weights").oom_recoveries, 1);
    assert_eq!(usage("weights").ooms, 1);
    assert_eq!(usage("weights").failures, 1);
    assert_eq!(usage("weights").allocations, 1);
    drop(big);
}

// ----- step reports -----------------------------------------------------------------------------

#[test]
fn step_reports_know_the_free_space_where_the_layout_is_known() {
    // The arena's 16 MiB pool slab, or (virtual memory management) the pages mapped in its range.
    for (runtime, arena_free) in [(pool_slab_runtime(1 << 30), 11 * MIB), (simulated_runtime(1 << 30), MIB)] {
        free_space_of_a_step(runtime, arena_free);
    }
}

fn free_space_of_a_step(runtime: Runtime, arena_free: u64) {
    let arena = runtime
        .declare_phase(PhaseSpec::new("scratch", Scope::Step).strategy(Strategy::Arena { slab_bytes: 16 * MIB }))
        .unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    let keep = step.alloc(Phase::ACTIVATIONS, 6 * MIB, &stream).unwrap();
    let gone = step.alloc(Phase::ACTIVATIONS, 6 * MIB, &stream).unwrap();
    let tail = step.alloc(Phase::ACTIVATIONS, 6 * MIB, &stream).unwrap();
    let scratch = step.alloc(arena, 5 * MIB, &stream).unwrap();
    drop(gone);
    // Mid-step: the activations pool has a 6 MiB hole between live buffers.
    let stats = runtime.stats().unwrap();
    let activations = stats.iter().find(|p| p.pool.phase == Phase::ACTIVATIONS).unwrap();
    // A Direct pool's layout is the CUDA pool's, which no driver publishes: absent on the
    // simulated device too.
    assert_eq!(activations.free_space, None);
    let arena_space = stats.iter().find(|p| p.pool.phase == arena).unwrap().free_space.unwrap();
    assert_eq!(arena_space.largest_free, arena_free);
    assert_eq!(arena_space.fragmentation(), 0.0);
    drop((keep, scratch, tail));
    let report = step.end().unwrap();
    let phase = report.phase(Phase::ACTIVATIONS).unwrap();
    assert_eq!(phase.peak_used, 18 * MIB);
    assert_eq!(phase.free_space, None, "the layout of a Direct pool is not known");
    let pool = report.pools.iter().find(|p| p.pool.phase == Phase::ACTIVATIONS).unwrap();
    assert_eq!(pool.largest_request, 6 * MIB);
    let text = report.to_string();
    assert!(text.contains("largest free") && text.contains("free frag"), "{text}");
}

/// The step's overhead, split as `steppool replay` splits it, at each pool's peak: the parts sum
/// to peak reserved − peak used for every pool, phase and step, and on the simulated device's
/// known placement (in its segment model: segments of the request rounded up to 2 MiB) each part
/// is what the layout says.
#[test]
fn step_reports_split_the_overhead_at_the_peak() {
    let runtime = segment_runtime(1 << 30);
    let declare = |name: &str| {
        let spec = PhaseSpec::new(name, Scope::Step).strategy(Strategy::Direct).trim(TrimPolicy::Never);
        runtime.declare_phase(spec).unwrap()
    };
    let (act, grad) = (declare("act"), declare("grad"));
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let run = |act_sizes: &[u64], grad_sizes: &[u64]| {
        let step = runtime.begin_step().unwrap();
        let grads: Vec<_> = grad_sizes.iter().map(|&bytes| step.alloc(grad, bytes, &stream).unwrap()).collect();
        drop(grads);
        let acts: Vec<_> = act_sizes.iter().map(|&bytes| step.alloc(act, bytes, &stream).unwrap()).collect();
        drop(acts);
        step.end().unwrap()
    };
    let exact = |report: &steppool::StepReport| {
        let total = |reserved: u64, used: u64| reserved as i64 - used as i64;
        assert_eq!(report.breakdown.total(), total(report.peak_reserved(), report.peak_used()));
        for phase in &report.phases {
            assert_eq!(phase.breakdown.total(), total(phase.peak_reserved, phase.peak_used), "{}", phase.name);
        }
        for pool in &report.pools {
            assert_eq!(pool.breakdown.total(), total(pool.peak_reserved, pool.peak_used), "{}", pool.phase_name);
        }
    };
    let of = |report: &steppool::StepReport, phase: Phase| report.phase(phase).unwrap().breakdown;
    let split = |rounding, tail, segregation, holes| Breakdown {
        rounding_bytes: rounding,
        granule_tail_bytes: tail,
        segregation_bytes: segregation,
        hole_bytes: holes,
        ..Breakdown::default()
    };

    // Step 0: act takes segments of 4 and 4 MiB for 3 MiB + 100 B and 4 MiB (served as
    // 3 MiB + 512 B: 412 B of rounding, and the first segment's last granule is unused from
    // there: 1 MiB − 512 B of tail). grad takes 2 and 4 MiB for 1 and 4 MiB: 1 MiB of tail.
    let first = run(&[3 * MIB + 100, 4 * MIB], &[MIB, 4 * MIB]);
    exact(&first);
    assert_eq!(of(&first, act), split(412, MIB - 512, 0, 0));
    assert_eq!(of(&first, grad), split(0, MIB, 0, 0));
    // Step 1: act takes a 12 MiB segment (its 8 MiB of old segments are holes); grad holds its
    // 6 MiB with 1 MiB live: 1 MiB of tail and 4 MiB held idle while act peaks.
    let second = run(&[12 * MIB], &[MIB]);
    exact(&second);
    assert_eq!(of(&second, act), split(0, 0, 0, 8 * MIB));
    assert_eq!(of(&second, grad), split(0, MIB, 4 * MIB, 0));
    assert_eq!(second.breakdown, split(0, MIB, 4 * MIB, 8 * MIB));
    let text = second.to_string();
    assert!(
        text.contains("overhead 13 MiB: rounding 0 B, granule tails 1 MiB, segregation 4 MiB, holes 8 MiB"),
        "{text}"
    );
    // Step 2: act, the only pool that allocated, holds the holes; grad, idle, is all segregation.
    let third = run(&[MIB], &[]);
    exact(&third);
    assert_eq!(of(&third, act), split(0, MIB, 0, 18 * MIB));
    assert_eq!(of(&third, grad), split(0, 0, 6 * MIB, 0));

    // The metrics: the last step's split per (device, phase), and the run's peak (step 1: the
    // most reserved, 26 MiB, then the most used).
    let metrics = runtime.telemetry().metrics().unwrap();
    let overhead = |name: &str| {
        let group = GroupKey::Phase { device: 0, phase: name.into() };
        metrics.overhead.iter().find(|o| o.group == group).unwrap().clone()
    };
    assert_eq!((overhead("act").last_step, overhead("act").run_peak), (of(&third, act), of(&second, act)));
    assert_eq!((overhead("grad").last_step, overhead("grad").run_peak), (of(&third, grad), of(&second, grad)));
    // Mid-step statistics split the step so far the same way.
    let step = runtime.begin_step().unwrap();
    let live = step.alloc(grad, 3 * MIB, &stream).unwrap();
    let stats = runtime.stats().unwrap();
    let grad_pool = stats.iter().find(|p| p.pool.phase == grad).unwrap();
    assert_eq!((grad_pool.peak_served, grad_pool.granule), (3 * MIB, 2 * MIB));
    assert_eq!(grad_pool.breakdown, split(0, MIB, 0, 2 * MIB));
    drop(live);
    step.end().unwrap();
}

// ----- warning rules ----------------------------------------------------------------------------

/// The same split in pools of the driver's 32 MiB units (the simulated device's default), where
/// allocations span units: the tail is the unused end of the last unit the live data would reach
/// packed from the pool's start, the rest holes (the runtime does not see the CUDA pool's
/// layout; `steppool replay`, which does, counts 26 MiB of tail above the data and 20 MiB of
/// hole below it).
#[test]
fn step_reports_split_the_overhead_in_32_mib_units() {
    let runtime = simulated_runtime(1 << 30);
    let spec = PhaseSpec::new("act", Scope::Step).strategy(Strategy::Direct).trim(TrimPolicy::Never);
    let act = runtime.declare_phase(spec).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    // 20 + 20 MiB fill the first unit and part of the second; the first 20 MiB is freed, too
    // small a hole for 30 MiB, which goes above, across into a third unit.
    let first = step.alloc(act, 20 * MIB, &stream).unwrap();
    let second = step.alloc(act, 20 * MIB, &stream).unwrap();
    drop(first);
    let third = step.alloc(act, 30 * MIB, &stream).unwrap();
    drop((second, third));
    let report = step.end().unwrap();
    let phase = report.phase(act).unwrap();
    assert_eq!((phase.peak_reserved, phase.peak_used), (96 * MIB, 50 * MIB));
    assert_eq!(report.pools.iter().find(|p| p.pool.phase == act).unwrap().granule, 32 * MIB);
    assert_eq!(
        phase.breakdown,
        Breakdown { granule_tail_bytes: 14 * MIB, hole_bytes: 32 * MIB, ..Breakdown::default() }
    );
}

fn fragmentation_rules(threshold: f64, steps: u32) -> WarningRules {
    let rule = FragmentationRule { threshold, steps, window: 1, min_waste: 0.0 };
    WarningRules { fragmentation: Some(rule), ..WarningRules::none() }
}

/// A step of one `bytes` allocation in a persistent `Pool` phase that keeps its memory.
fn step_with(runtime: &Runtime, phase: Phase, stream: &steppool::Stream, bytes: u64) -> steppool::StepReport {
    let step = runtime.begin_step().unwrap();
    drop(runtime.alloc(phase, bytes, stream).unwrap());
    step.end().unwrap()
}

#[test]
fn fragmentation_fires_once_per_episode_after_k_steps_beyond_the_window() {
    let rule = FragmentationRule { threshold: 0.5, steps: 2, window: 3, min_waste: 0.0 };
    let runtime = only(WarningRules { fragmentation: Some(rule), ..WarningRules::none() });
    let seen = collect(&runtime);
    let phase = runtime.declare_phase(PhaseSpec::new("kept", Scope::Persistent).release_threshold(u64::MAX)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    // 128 MiB reserved by a long step, then short steps of 8 MiB: the reservation is waste only
    // once no step of the window needed it.
    let long = [0, 5];
    let mut fired = Vec::new();
    for index in 0..10 {
        let step = runtime.begin_step().unwrap();
        if long.contains(&index) {
            let pair =
                (runtime.alloc(phase, 64 * MIB, &stream).unwrap(), runtime.alloc(phase, 64 * MIB, &stream).unwrap());
            drop(pair);
        } else {
            drop(runtime.alloc(phase, 8 * MIB, &stream).unwrap());
        }
        if !step.end().unwrap().warnings.is_empty() {
            fired.push(index);
        }
    }
    // Steps 3 and 4 are above (the window has forgotten step 0): fires at 4, not again while it
    // lasts; the long step 5 ends the episode; steps 8 and 9 start a new one.
    assert_eq!(fired, [4, 9]);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    match &seen[0].kind {
        WarningKind::Fragmentation { phase, ratio, steps, peak_used, peak_reserved, .. } => {
            assert_eq!(phase, "kept");
            assert_eq!(*steps, 2);
            assert_eq!(*peak_used, 8 * MIB);
            assert_eq!(*peak_reserved, 128 * MIB);
            // The 8 MiB live cost one 32 MiB pool unit, whose unused end is not fragmentation.
            assert!((ratio - 0.75).abs() < 1e-9, "{ratio}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(seen[0].rule(), steppool::WarningRule::Fragmentation);
    assert!(seen[0].to_string().contains("fragmentation of `kept` above 50% for 2 steps"), "{}", seen[0]);
    assert_eq!(
        runtime.telemetry().metrics().unwrap().warnings,
        [steppool::telemetry::WarningCount { rule: steppool::WarningRule::Fragmentation, fired: 2 }]
    );
}

#[test]
fn fragmentation_stays_silent_on_steady_steps_and_small_waste() {
    let runtime = only(fragmentation_rules(0.25, 2));
    let phase = runtime.declare_phase(PhaseSpec::new("kept", Scope::Persistent).release_threshold(u64::MAX)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    for _ in 0..6 {
        assert!(step_with(&runtime, phase, &stream, 32 * MIB).warnings.is_empty());
    }
    // Wasteful (a 32 MiB pool unit held for 2 MiB), but the 30 MiB of waste are under 5 % of
    // the device: silent.
    let runtime = only(WarningRules {
        fragmentation: Some(FragmentationRule { threshold: 0.25, steps: 1, window: 1, min_waste: 0.05 }),
        ..WarningRules::none()
    });
    let phase = runtime.declare_phase(PhaseSpec::new("kept", Scope::Persistent).release_threshold(u64::MAX)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    step_with(&runtime, phase, &stream, 16 * MIB);
    for _ in 0..4 {
        assert!(step_with(&runtime, phase, &stream, 2 * MIB).warnings.is_empty());
    }
}

/// A device filled so that a persistent pool's free memory is 4 MiB pieces while the device has
/// `spare` bytes free; the pool served an 8 MiB request in an earlier step.
fn scattered(spare: u64) -> (Runtime, Vec<Warning>) {
    let capacity = 128 * MIB;
    // Pool slabs: on a range the arena's pieces would be one contiguous bump.
    let runtime = pool_slab_runtime(capacity);
    runtime.telemetry().set_warning_rules(WarningRules {
        scattered_free: Some(ScatteredFreeRule { window: 4 }),
        ..WarningRules::none()
    });
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    // An arena of 1 MiB slabs: each 4 MiB piece is a slab of its own, whose layout the arena knows.
    let cache = PhaseSpec::new("cache", Scope::Persistent).strategy(Strategy::Arena { slab_bytes: MIB });
    let phase = runtime.declare_phase(cache.release_threshold(u64::MAX)).unwrap();
    let step = runtime.begin_step().unwrap();
    drop(runtime.alloc(phase, 8 * MIB, &stream).unwrap());
    let mut warnings = step.end().unwrap().warnings;
    // The 8 MiB segment stays reserved; give it back so the pieces below are all the pool has.
    runtime.device(0).unwrap().release_idle().unwrap();
    let step = runtime.begin_step().unwrap();
    let pieces: Vec<_> = (0..8).map(|_| runtime.alloc(phase, 4 * MIB, &stream).unwrap()).collect();
    let used: u64 = 32 * MIB;
    let filler = runtime.alloc(Phase::WEIGHTS, capacity - used - spare, &stream).unwrap();
    let kept: Vec<_> = pieces.into_iter().enumerate().filter_map(|(i, b)| (i % 2 == 0).then_some(b)).collect();
    warnings.extend(step.end().unwrap().warnings);
    std::mem::forget((kept, filler)); // the runtime outlives nothing here; keep the layout
    (runtime, warnings)
}

#[test]
fn scattered_free_space_fires_when_no_piece_and_no_device_memory_fits() {
    let (_runtime, warnings) = scattered(2 * MIB);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    match &warnings[0].kind {
        WarningKind::ScatteredFree { phase, largest_request, largest_free, total_free, device_free, .. } => {
            assert_eq!(phase, "cache");
            assert_eq!(*largest_request, 8 * MIB);
            assert_eq!(*largest_free, 4 * MIB);
            assert_eq!(*total_free, 16 * MIB);
            assert_eq!(*device_free, 2 * MIB);
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn scattered_free_space_is_silent_while_the_device_has_room() {
    let (_runtime, warnings) = scattered(16 * MIB);
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn reserved_creep_fires_when_reserved_grows_under_flat_use() {
    let runtime = only(WarningRules {
        reserved_creep: Some(ReservedCreepRule {
            steps: 4,
            min_growth: 0.05,
            min_growth_bytes: MIB,
            flat_tolerance: 0.01,
        }),
        ..WarningRules::none()
    });
    let phase = runtime.declare_phase(PhaseSpec::new("cache", Scope::Persistent).release_threshold(u64::MAX)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let mut pinned = Vec::new();
    let mut fired = Vec::new();
    for index in 0..6 {
        let step = runtime.begin_step().unwrap();
        drop(runtime.alloc(phase, 64 * MIB, &stream).unwrap());
        // A small buffer kept for good lands in the freed segment and pins it: the next step's
        // 64 MiB no longer fits there, and the pool grows.
        pinned.push(runtime.alloc(phase, 4096, &stream).unwrap());
        if !step.end().unwrap().warnings.is_empty() {
            fired.push(index);
        }
    }
    assert_eq!(fired, [3]);
    drop(pinned);
}

#[test]
fn reserved_creep_is_silent_when_use_grows_with_it() {
    let runtime = only(WarningRules {
        reserved_creep: Some(ReservedCreepRule {
            steps: 3,
            min_growth: 0.05,
            min_growth_bytes: MIB,
            flat_tolerance: 0.01,
        }),
        ..WarningRules::none()
    });
    // An arena of 1 MiB slabs: each 4 MiB piece is a slab of its own, whose layout the arena knows.
    let cache = PhaseSpec::new("cache", Scope::Persistent).strategy(Strategy::Arena { slab_bytes: MIB });
    let phase = runtime.declare_phase(cache.release_threshold(u64::MAX)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let mut kept = Vec::new();
    for _ in 0..6 {
        let step = runtime.begin_step().unwrap();
        kept.push(runtime.alloc(phase, 16 * MIB, &stream).unwrap()); // a real leak: used grows too
        assert!(step.end().unwrap().warnings.is_empty());
    }
}

fn headroom_run(demand: u64) -> Vec<Warning> {
    let runtime = simulated_runtime(1 << 30);
    runtime.telemetry().set_warning_rules(WarningRules {
        low_headroom: Some(LowHeadroomRule { window: 4, margin: 0.1 }),
        ..WarningRules::none()
    });
    runtime
        .set_phase_spec(Phase::ACTIVATIONS, PhaseSpec::new("activations", Scope::Step).trim(TrimPolicy::KeepBytes(0)))
        .unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let _weights = runtime.alloc(Phase::WEIGHTS, 500 * MIB, &stream).unwrap();
    let mut warnings = Vec::new();
    for _ in 0..3 {
        let step = runtime.begin_step().unwrap();
        let activations = step.alloc(Phase::ACTIVATIONS, demand, &stream).unwrap();
        drop(activations);
        stream.synchronize().unwrap();
        warnings.extend(step.end().unwrap().warnings);
    }
    warnings
}

#[test]
fn low_headroom_fires_when_the_next_step_may_not_fit() {
    // 524 MiB of headroom; 480 MiB × 1.1 = 528 MiB needed.
    let warnings = headroom_run(480 * MIB);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    match warnings[0].kind {
        WarningKind::LowHeadroom { headroom, demand, .. } => {
            assert_eq!(demand, 480 * MIB);
            assert_eq!(headroom, 524 * MIB);
        }
        ref other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn low_headroom_is_silent_with_room_to_spare() {
    assert!(headroom_run(450 * MIB).is_empty());
}

#[test]
fn low_headroom_counts_what_a_loop_keeps_every_step() {
    // Each step keeps 96 MiB for good in a persistent pool and frees nothing: no step's live bytes
    // rise above its end, yet each wants 96 MiB more from a 1 GiB device. The first step builds
    // what the loop keeps and is not a demand; from the second on it is, and the rule fires when
    // the device's free memory falls under 96 MiB × 1.1.
    let runtime = simulated_runtime(1 << 30);
    runtime.telemetry().set_warning_rules(WarningRules {
        low_headroom: Some(LowHeadroomRule { window: 4, margin: 0.1 }),
        ..WarningRules::none()
    });
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let (mut kept, mut fired) = (Vec::new(), Vec::new());
    for index in 0..10u64 {
        let step = runtime.begin_step().unwrap();
        kept.push(runtime.alloc(Phase::OPTIMIZER_STATE, 96 * MIB, &stream).unwrap());
        let report = step.end().unwrap();
        if let Some(warning) = report.warnings.first() {
            fired.push((index, warning.kind.clone()));
        }
    }
    // After step 9, 960 MiB are kept (30 units of 32 MiB) and 64 MiB are free: short of 105.6.
    assert_eq!(fired.len(), 1, "{fired:?}");
    match &fired[0] {
        (9, WarningKind::LowHeadroom { demand, device_free, .. }) => {
            assert_eq!((*demand, *device_free), (96 * MIB, 64 * MIB));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn default_rules_stay_silent_on_a_loop_that_fills_the_device() {
    // 2 GiB of weights and 5.5 GiB of activations per step on an 8 GiB device: full, and fine.
    let runtime = simulated_runtime(8 << 30);
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let _weights = runtime.alloc(Phase::WEIGHTS, 2 << 30, &stream).unwrap();
    for index in 0..12u64 {
        let step = runtime.begin_step().unwrap();
        // A long step now and then; the pool keeps what the recent long one needed.
        let count = if index % 4 == 0 { 11 } else { 7 };
        let a: Vec<_> = (0..count).map(|_| step.alloc(Phase::ACTIVATIONS, 512 * MIB, &stream).unwrap()).collect();
        drop(a);
        stream.synchronize().unwrap();
        let report = step.end().unwrap();
        assert!(report.warnings.is_empty(), "step {index}: {:?}", report.warnings);
    }
}

#[test]
fn default_rules_stay_silent_on_a_healthy_loop() {
    let runtime = simulated_runtime(8 << 30);
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let _weights = runtime.alloc(Phase::WEIGHTS, 1 << 30, &stream).unwrap();
    for _ in 0..12 {
        let step = runtime.begin_step().unwrap();
        let a: Vec<_> = (0..8).map(|i| step.alloc(Phase::ACTIVATIONS, (64 + i) * MIB, &stream).unwrap()).collect();
        let g = step.alloc(Phase::GRADIENTS, 256 * MIB, &stream).unwrap();
        drop((a, g));
        assert!(step.end().unwrap().warnings.is_empty());
    }
}

// ----- OOM report -------------------------------------------------------------------------------

#[test]
fn oom_reports_say_fragmentation_or_demand_with_the_numbers() {
    // Demand: the live data needs more than the device (of two 32 MiB units and the granule
    // the driver keeps free beside them).
    let runtime = simulated_runtime(66 * MIB);
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    let _a = step.alloc(Phase::ACTIVATIONS, 48 * MIB, &stream).unwrap();
    let Err(Error::OutOfMemory(report)) = step.alloc(Phase::ACTIVATIONS, 32 * MIB, &stream) else { panic!() };
    assert_eq!(report.verdict, Verdict::Demand);
    assert_eq!(report.step, Some(0));
    assert_eq!(report.requested, 32 * MIB);
    let json = oom_json(&report);
    assert_eq!(json["verdict"], "demand");
    assert_eq!(json["requested_bytes"], 32 * MIB);
    assert_eq!(json["step"], 0);
    assert_eq!(json["pools"][0]["used_bytes"], 48 * MIB);

    // Fragmentation: 4 MiB holes between live buffers, in one segment, add up to more than the
    // request.
    let runtime = simulated_runtime(66 * MIB);
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    drop(runtime.alloc(Phase::WEIGHTS, 64 * MIB, &stream).unwrap());
    let buffers: Vec<_> = (0..16).map(|_| runtime.alloc(Phase::WEIGHTS, 4 * MIB, &stream).unwrap()).collect();
    let kept: Vec<_> = buffers.into_iter().enumerate().filter_map(|(i, b)| (i % 2 == 0).then_some(b)).collect();
    stream.synchronize().unwrap();
    let Err(Error::OutOfMemory(report)) = runtime.alloc(Phase::WEIGHTS, 8 * MIB, &stream) else { panic!() };
    assert_eq!(report.verdict, Verdict::Fragmentation, "{report}");
    assert_eq!(report.step, None);
    assert_eq!(report.pools[0].largest_free, None, "a Direct pool does not know its CUDA pool's layout");
    let text = report.to_string();
    assert!(text.contains("verdict: fragmentation"), "{text}");
    assert_eq!(oom_json(&report)["verdict"], "fragmentation");
    drop(kept);
}

// ----- exporters --------------------------------------------------------------------------------

/// A runtime that ran three steps on two streams, with the history recorded; the streams are
/// returned so their pools stay. The device has virtual memory management, as the simulated
/// device has by default.
fn busy_runtime() -> (Runtime, Vec<steppool::StepReport>, [steppool::Stream; 2]) {
    busy_runtime_on(true)
}

/// [`busy_runtime`] on a device with virtual memory management (`vmm`: slabs and arenas are
/// address ranges whose pages are mapped on demand) or without (they are pool allocations).
fn busy_runtime_on(vmm: bool) -> (Runtime, Vec<steppool::StepReport>, [steppool::Stream; 2]) {
    let config =
        steppool_sys::sim::SimConfig { vmm_supported: vmm, ..steppool_sys::sim::SimConfig::with_capacity(2 << 30) };
    let runtime = Runtime::builder()
        .simulated(config)
        .record_history(1 << 16)
        .warning_rules(fragmentation_rules(0.5, 1))
        .build()
        .unwrap();
    let odd = runtime
        .declare_phase(PhaseSpec::new("odd phase", Scope::Step).strategy(Strategy::Arena { slab_bytes: 8 * MIB }))
        .unwrap();
    let device = runtime.device(0).unwrap();
    let (a, b) = (device.create_stream().unwrap(), device.create_stream().unwrap());
    let weights = runtime.alloc(Phase::WEIGHTS, 64 * MIB, &a).unwrap();
    let mut reports = Vec::new();
    for (index, mib) in [96, 8, 40].into_iter().enumerate() {
        let step = runtime.begin_step().unwrap();
        let x = step.alloc(Phase::ACTIVATIONS, mib * MIB, &a).unwrap();
        let y = step.alloc(odd, 3 * MIB, &b).unwrap();
        let z = step.alloc(odd, 2 * MIB, &b).unwrap();
        if index == 1 {
            std::mem::forget(z); // released by the boundary
        } else {
            drop(z);
        }
        drop((x, y));
        reports.push(step.end().unwrap());
    }
    drop(weights);
    (runtime, reports, [a, b])
}

#[test]
fn prometheus_text_parses_with_conventional_names_and_labels() {
    let (runtime, _, _streams) = busy_runtime();
    let metrics = runtime.telemetry().metrics().unwrap();
    let text = metrics.to_prometheus();
    let lines = text.lines().map(|line| Ok(line.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid exposition text");
    let sample = |name: &str, labels: &[(&str, &str)]| -> f64 {
        let found: Vec<_> = scrape
            .samples
            .iter()
            .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .collect();
        assert_eq!(found.len(), 1, "{name} {labels:?} in\n{text}");
        match found[0].value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            ref other => panic!("{other:?}"),
        }
    };
    let activations = metrics.pools.iter().find(|p| p.pool.phase == Phase::ACTIVATIONS).unwrap();
    let stream = activations.pool.stream.to_string();
    let labels = [("device", "0"), ("stream", stream.as_str()), ("phase", "activations")];
    assert_eq!(sample("steppool_allocations_total", &labels), 3.0);
    assert_eq!(sample("steppool_requested_bytes_total", &labels), (144 * MIB) as f64);
    assert_eq!(sample("steppool_reserved_bytes", &labels), activations.usage.reserved as f64);
    assert_eq!(sample("steppool_used_high_bytes", &labels), (96 * MIB) as f64);
    // A `Direct` pool maps no pages; the arena's slabs are pages of a range.
    assert_eq!(activations.usage.pages, PageTraffic::default());
    assert_eq!(sample("steppool_pages_mapped_bytes_total", &labels), 0.0);
    let odd = metrics.pools.iter().find(|p| p.phase_name.starts_with("odd")).unwrap();
    let odd_stream = odd.pool.stream.to_string();
    let odd_labels = [("phase", "odd phase"), ("stream", odd_stream.as_str())];
    assert_eq!(sample("steppool_released_bytes_total", &odd_labels), (2 * MIB) as f64);
    assert_eq!(sample("steppool_frees_total", &odd_labels), 5.0);
    let pages = odd.usage.pages;
    assert!(pages.mapped > 0, "{pages:?}");
    assert_eq!(sample("steppool_pages_mapped_bytes_total", &odd_labels), pages.mapped as f64);
    assert_eq!(sample("steppool_pages_unmapped_bytes_total", &odd_labels), pages.unmapped as f64);
    assert_eq!(sample("steppool_steps_total", &[]), 3.0);
    assert_eq!(sample("steppool_device_total_bytes", &[("device", "0")]), (2u64 << 30) as f64);
    let mapped_high = runtime.device(0).unwrap().mapped_high_bytes();
    assert!(mapped_high > 0, "the arena's slabs are pages in a range");
    assert_eq!(sample("steppool_device_mapped_high_bytes", &[("device", "0")]), mapped_high as f64);
    assert_eq!(sample("steppool_warnings_total", &[("rule", "fragmentation")]), metrics.warnings[0].fired as f64);
    assert!(sample("steppool_fragmentation_ratio", &[("phase", "activations")]) >= 0.0);
    // The overhead split per (device, phase) and kind, in the last step and at the run's peak.
    for overhead in &metrics.overhead {
        let GroupKey::Phase { phase, .. } = &overhead.group else { panic!("{overhead:?}") };
        for (family, breakdown) in
            [("steppool_overhead_bytes", overhead.last_step), ("steppool_peak_overhead_bytes", overhead.run_peak)]
        {
            for (kind, bytes) in &breakdown.parts()[..4] {
                let labels = [("device", "0"), ("phase", phase.as_str()), ("kind", kind)];
                assert_eq!(sample(family, &labels), *bytes as f64, "{family} {labels:?}");
            }
        }
    }
    let odd_overhead =
        metrics.overhead.iter().find(|o| o.group == GroupKey::Phase { device: 0, phase: "odd phase".into() });
    assert_ne!(odd_overhead.unwrap().run_peak, Breakdown::default(), "the arena's slab is not all live");
    // Every family says its type; counters end in _total.
    for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
        let parts: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(parts[3] == "counter", parts[2].ends_with("_total"), "{line}");
    }
    let types: HashMap<&str, &str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' ')).collect();
    assert_eq!(types["steppool_reserved_bytes"], "gauge");
}

#[test]
fn the_http_endpoint_serves_metrics_and_stops_when_dropped() {
    let (runtime, _, _streams) = busy_runtime();
    let server = runtime.telemetry().serve_metrics("127.0.0.1:0").unwrap();
    let get = |path: &str| -> String {
        let mut stream = TcpStream::connect(server.addr()).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    };
    let response = get("/metrics");
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains("Content-Type: text/plain; version=0.0.4"));
    let body = response.split_once("\r\n\r\n").unwrap().1;
    let scrape = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).unwrap();
    assert!(scrape.samples.iter().any(|s| s.metric == "steppool_steps_total"));
    assert!(get("/other").starts_with("HTTP/1.1 404"));
    let addr = server.addr();
    drop(server);
    assert!(TcpStream::connect(addr).is_err(), "the listener is closed");
}

/// Sends `GET /metrics` on a fresh connection and reads the whole answer; a read that waits
/// 30 s fails the test (the server answers each connection on its own thread, so it never has
/// to wait for other clients).
fn scrape(addr: std::net::SocketAddr) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("an answer while the other clients wait");
    response
}

/// Whether the server still holds `stream` open: no data and no end of stream yet.
fn still_open(stream: &TcpStream) -> bool {
    stream.set_nonblocking(true).unwrap();
    let mut byte = [0u8; 1];
    let open = matches!(stream.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    stream.set_nonblocking(false).unwrap();
    open
}

/// Connects and sends the start of a request line, then nothing more.
fn slow_client(addr: std::net::SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(b"GET /metr").unwrap();
    stream
}

#[test]
fn a_scrape_is_answered_while_64_slow_clients_hold_their_connections() {
    let (runtime, _, _streams) = busy_runtime();
    // A deadline far longer than the test: had the scrape waited for the slow clients, its
    // read would give up first.
    let options = ServeOptions { max_connections: 80, request_deadline: std::time::Duration::from_secs(120) };
    let server = runtime.telemetry().serve_metrics_with("127.0.0.1:0", options).unwrap();
    let slow: Vec<TcpStream> = (0..64).map(|_| slow_client(server.addr())).collect();
    let response = scrape(server.addr());
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(response.contains("steppool_steps_total"));
    // The slow clients were not timed out or turned away to make room: all still connected.
    assert_eq!(slow.iter().filter(|s| still_open(s)).count(), 64);
}

#[test]
fn a_request_gets_one_deadline_however_slowly_it_trickles_in() {
    let (runtime, _, _streams) = busy_runtime();
    let options = ServeOptions { max_connections: 4, request_deadline: std::time::Duration::from_millis(300) };
    let server = runtime.telemetry().serve_metrics_with("127.0.0.1:0", options).unwrap();
    let mut stream = TcpStream::connect(server.addr()).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_millis(20))).unwrap();
    // One byte every 20 ms: each read the server makes succeeds well inside any per-read
    // timeout, so only a deadline for the whole request ends it. 500 bytes would take 10 s.
    let request = format!("GET /metrics HTTP/1.1\r\nX-Slow: {}\r\n\r\n", "a".repeat(460));
    let mut response = Vec::new();
    let mut sent = 0;
    for byte in request.bytes() {
        if stream.write_all(&[byte]).is_err() {
            break;
        }
        sent += 1;
        let mut buffer = [0u8; 256];
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&buffer[..n]),
            Err(_) => {}
        }
        if !response.is_empty() {
            break;
        }
    }
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 408 Request Timeout\r\n"), "{response}");
    assert!(sent < request.len(), "the server cut the request short ({sent} of {} bytes)", request.len());
}

/// Sends `request` on a fresh connection and reads the whole answer (the server may answer and
/// close before it has read everything); a read that waits 30 s fails the test.
fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let _ = stream.write_all(request);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    String::from_utf8_lossy(&response).into_owned()
}

#[test]
fn a_client_that_read_its_answer_finds_its_place_free_when_it_asks_again() {
    let (runtime, _, _streams) = busy_runtime();
    let options = ServeOptions { max_connections: 1, request_deadline: std::time::Duration::from_secs(120) };
    let server = runtime.telemetry().serve_metrics_with("127.0.0.1:0", options).unwrap();
    // One place, held while a request is read and answered: not while the client, its answer
    // read, keeps the connection open, nor while the server drains the connection to close it.
    for round in 0..20 {
        let mut kept = TcpStream::connect(server.addr()).unwrap();
        kept.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        kept.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        kept.read_to_end(&mut answer).unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 405 "), "round {round}");
        let response = exchange(server.addr(), b"POST /metrics HTTP/1.1\r\n\r\n");
        assert!(response.starts_with("HTTP/1.1 405 "), "round {round}, the first connection still open: {response}");
    }
}

#[test]
fn oversized_heads_garbage_and_one_connection_too_many_get_their_statuses() {
    let (runtime, _, _streams) = busy_runtime();
    let options = ServeOptions { max_connections: 2, request_deadline: std::time::Duration::from_secs(120) };
    let server = runtime.telemetry().serve_metrics_with("127.0.0.1:0", options).unwrap();
    let ask = |request: &[u8]| exchange(server.addr(), request);
    let oversized = format!("GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n", "b".repeat(MAX_REQUEST_BYTES));
    assert!(ask(oversized.as_bytes()).starts_with("HTTP/1.1 431 "));
    assert!(ask(b"\x00\x01\xffgarbage\r\n\r\n").starts_with("HTTP/1.1 400 Bad Request\r\n"));
    assert!(ask(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));

    drop(server);

    // On a fresh server, two slow clients take both places; a third connection is turned away
    // at once, without its request being read (so this one sends none).
    let server = runtime.telemetry().serve_metrics_with("127.0.0.1:0", options).unwrap();
    let ask = |request: &[u8]| exchange(server.addr(), request);
    let mut slow: Vec<TcpStream> = (0..2).map(|_| slow_client(server.addr())).collect();
    let turned_away = ask(b"");
    assert!(turned_away.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{turned_away}");
    assert!(slow.iter().all(still_open));
    // One leaves; its place comes free once its thread has seen it go.
    drop(slow.pop());
    let answered = (0..3000).find_map(|_| {
        // Turned away (unread, so the answer may be lost to a reset), or answered.
        let response = ask(b"GET /metrics HTTP/1.1\r\n\r\n");
        if response.starts_with("HTTP/1.1 200 OK") {
            Some(response)
        } else {
            std::thread::sleep(std::time::Duration::from_millis(10));
            None
        }
    });
    assert!(answered.is_some(), "a place came free when a slow client left");

    let zero = ServeOptions { max_connections: 0, ..ServeOptions::default() };
    let error = runtime.telemetry().serve_metrics_with("127.0.0.1:0", zero).unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
    assert!(error.to_string().contains("max_connections 0"), "{error}");
}

#[test]
fn json_lines_write_one_object_per_report_and_warning() {
    let (_, reports, _streams) = busy_runtime();
    let mut out = JsonLines::new(Vec::new());
    for report in &reports {
        out.step(report).unwrap();
    }
    let text = String::from_utf8(out.into_inner()).unwrap();
    let objects: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<_> = objects.iter().filter(|o| o["type"] == "step").collect();
    assert_eq!(steps.len(), 3);
    let warnings: Vec<_> = objects.iter().filter(|o| o["type"] == "warning").collect();
    assert_eq!(warnings.len(), reports.iter().map(|r| r.warnings.len()).sum::<usize>());
    assert!(!warnings.is_empty());
    assert_eq!(warnings[0]["rule"], "fragmentation");
    assert!(warnings[0]["fragmentation_ratio"].as_f64().unwrap() > 0.5);
    let first = &steps[0];
    assert_eq!(first["step"], 0);
    let activations = first["phases"].as_array().unwrap().iter().find(|p| p["phase"] == "activations").unwrap();
    assert_eq!(activations["peak_used_bytes"], 96 * MIB);
    assert_eq!(activations["scope"], "step");
    assert_eq!(activations["strategy"], "direct");
    assert_eq!(steps[1]["released_bytes"], 2 * MIB);
    // The overhead split, with replay's field names, summing to peak reserved − peak used.
    for step in &steps {
        let parts = |value: &serde_json::Value| -> i64 {
            let names = [
                "rounding_bytes",
                "granule_tail_bytes",
                "segregation_bytes",
                "hole_bytes",
                "unattributed_bytes",
                "peak_shift_bytes",
            ];
            names.iter().map(|name| value[name].as_i64().unwrap()).sum()
        };
        let overhead = |value: &serde_json::Value| {
            value["peak_reserved_bytes"].as_i64().unwrap() - value["peak_used_bytes"].as_i64().unwrap()
        };
        assert_eq!(parts(&step["breakdown"]), overhead(step));
        for group in step["phases"].as_array().unwrap().iter().chain(step["pools"].as_array().unwrap()) {
            assert_eq!(parts(&group["breakdown"]), overhead(group), "{group}");
        }
    }
    assert_eq!(steps[0]["breakdown"]["segregation_bytes"], reports[0].breakdown.segregation_bytes);
    assert_eq!(step_json(&reports[2])["step"], 2);
}

// ----- history: snapshot, trace, timeline ------------------------------------------------------

fn dict(value: &Value) -> BTreeMap<String, &Value> {
    match value {
        Value::Dict(map) => map
            .iter()
            .map(|(k, v)| match k {
                HashableValue::String(k) => (k.clone(), v),
                other => panic!("key {other:?}"),
            })
            .collect(),
        other => panic!("not a dict: {other:?}"),
    }
}

fn list(value: &Value) -> &[Value] {
    match value {
        Value::List(items) => items,
        other => panic!("not a list: {other:?}"),
    }
}

fn int(value: &Value) -> i64 {
    match value {
        Value::I64(n) => *n,
        other => panic!("not an int: {other:?}"),
    }
}

fn text(value: &Value) -> &str {
    match value {
        Value::String(s) => s,
        other => panic!("not a string: {other:?}"),
    }
}

#[test]
fn the_memory_snapshot_has_pytorchs_layout() {
    let (runtime, _, _streams) = busy_runtime();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let live = runtime.alloc(Phase::OPTIMIZER_STATE, 5 * MIB + 100, &stream).unwrap();
    let mut bytes = Vec::new();
    runtime.telemetry().history().write_memory_snapshot(&mut bytes).unwrap();
    let snapshot = serde_pickle::value_from_slice(&bytes, DeOptions::new()).expect("a valid pickle");
    let top = dict(&snapshot);
    assert!(top.contains_key("allocator_settings"));

    let traces = list(top["device_traces"]);
    assert_eq!(traces.len(), 1);
    let events: Vec<BTreeMap<String, &Value>> = list(&traces[0]).iter().map(dict).collect();
    let count = |action: &str| events.iter().filter(|e| text(e["action"]) == action).count();
    assert_eq!(count("alloc"), 11);
    // Every free is requested then completed; the forgotten buffer was released by the boundary.
    assert_eq!(count("free_requested"), 10);
    assert_eq!(count("free_completed"), 10);
    assert!(count("segment_alloc") >= 3 && count("segment_free") >= 1);
    let mut last_time = 0;
    let mut live_blocks: HashMap<i64, i64> = HashMap::new();
    for event in &events {
        for key in ["action", "addr", "size", "stream", "time_us", "frames", "category"] {
            assert!(event.contains_key(key), "{key} missing in {event:?}");
        }
        assert!(int(event["time_us"]) >= last_time);
        last_time = int(event["time_us"]);
        match text(event["action"]) {
            "alloc" => {
                assert!(live_blocks.insert(int(event["addr"]), int(event["size"])).is_none());
                let frame = dict(&list(event["frames"])[0]);
                assert!(text(frame["filename"]).starts_with("steppool phase `"));
                assert!(text(frame["name"]).contains("step") || text(frame["name"]).contains("outside"));
                assert_eq!(text(event["category"]), text(frame["filename"]).split('`').nth(1).unwrap());
            }
            "free_completed" => assert_eq!(live_blocks.remove(&int(event["addr"])), Some(int(event["size"]))),
            _ => {}
        }
    }
    assert!(events.iter().any(|e| text(e["category"]) == "unknown"), "the viewer needs `unknown`");

    // Segments are tiled exactly by their blocks, and the live blocks are those the trace left live.
    let mut active = HashMap::new();
    for segment in list(top["segments"]).iter().map(dict) {
        let (base, size) = (int(segment["address"]), int(segment["total_size"]));
        let mut cursor = base;
        for block in list(segment["blocks"]).iter().map(dict) {
            assert_eq!(int(block["address"]), cursor);
            cursor += int(block["size"]);
            assert!(int(block["requested_size"]) <= int(block["size"]));
            if text(block["state"]) == "active_allocated" {
                active.insert(int(block["address"]), int(block["requested_size"]));
            } else {
                assert_eq!(text(block["state"]), "inactive");
            }
        }
        assert_eq!(cursor, base + size);
        assert!(matches!(segment["segment_pool_id"], Value::Tuple(_)));
    }
    assert_eq!(active, live_blocks);
    assert_eq!(active.get(&(live.ptr() as i64)), Some(&((5 * MIB + 100) as i64)));
}

#[test]
fn the_trace_file_lists_every_allocation_free_and_boundary() {
    let (runtime, _, _streams) = busy_runtime();
    let mut bytes = Vec::new();
    runtime.telemetry().history().write_trace(&mut bytes).unwrap();
    let lines: Vec<serde_json::Value> =
        String::from_utf8(bytes).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let header = &lines[0];
    assert_eq!(header["format"], "steppool-trace");
    assert_eq!(header["version"], 1);
    assert_eq!(header["devices"][0]["total_bytes"], 2u64 << 30);
    let phases = header["phases"].as_array().unwrap();
    assert!(phases.iter().any(|p| p["name"] == "activations" && p["scope"] == "step"));
    assert!(phases.iter().any(|p| p["name"] == "weights" && p["scope"] == "persistent"));
    let events = &lines[1..];
    let count = |kind: &str| events.iter().filter(|e| e["event"] == kind).count();
    assert_eq!(count("alloc"), 10);
    assert_eq!(count("free"), 10);
    assert_eq!(count("step_begin"), 3);
    assert_eq!(count("step_end"), 3);
    assert_eq!(events.iter().filter(|e| e["release"] == true).count(), 1);
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut step = None;
    let mut last = 0;
    for event in events {
        let t = event["t_ns"].as_u64().unwrap();
        assert!(t >= last);
        last = t;
        match event["event"].as_str().unwrap() {
            "step_begin" => step = event["step"].as_u64(),
            "step_end" => step = None,
            "alloc" => {
                assert_eq!(event["step"].as_u64(), step);
                live.insert(event["ptr"].as_u64().unwrap(), event["bytes"].as_u64().unwrap());
            }
            "free" => assert_eq!(live.remove(&event["ptr"].as_u64().unwrap()), event["bytes"].as_u64()),
            _ => {}
        }
    }
    assert!(live.is_empty());
}

#[test]
fn the_timeline_is_an_svg_with_every_phase_step_and_warning() {
    let (runtime, reports, _streams) = busy_runtime();
    let svg = runtime.telemetry().history().timeline_svg("a <test> run");
    let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let root = document.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    let texts: Vec<&str> = document.descendants().filter(|n| n.is_element()).filter_map(|n| n.text()).collect();
    assert!(texts.contains(&"a <test> run"));
    for phase in ["weights", "activations", "odd phase"] {
        assert!(texts.iter().any(|t| t.starts_with(phase)), "{phase} missing");
    }
    for step in 0..3 {
        assert!(texts.contains(&format!("step {step}").as_str()));
    }
    let warnings: usize = reports.iter().map(|r| r.warnings.len()).sum();
    let marks = document.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text());
    assert_eq!(marks.filter(|t| t.starts_with("⚠ fragmentation")).count(), warnings);
}

#[test]
fn recording_is_bounded_and_says_what_it_dropped() {
    let runtime = Runtime::builder()
        .simulated(steppool_sys::sim::SimConfig::with_capacity(1 << 30))
        .record_history(10)
        .build()
        .unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    for _ in 0..20 {
        drop(runtime.alloc(Phase::WEIGHTS, MIB, &stream).unwrap());
    }
    let history = runtime.telemetry().history();
    assert_eq!(history.events.len(), 10);
    assert!(history.dropped > 0);
    runtime.telemetry().stop_recording();
    assert!(!runtime.telemetry().is_recording());
    drop(runtime.alloc(Phase::WEIGHTS, MIB, &stream).unwrap());
    assert_eq!(runtime.telemetry().history().events, history.events);
}

/// Walks a snapshot's events backwards from its final state, as memory_viz's "Allocator State
/// History" view does, and checks that every live block lies in a live segment at every point,
/// and that the category `unknown` is present whenever categories are (the viewer needs both).
/// As in the viewer, undoing a `segment_unmap` merges the pages into the segment of their stream
/// they touch, and undoing a `segment_map` cuts them out of the segment holding them.
fn check_viewer_consistency(bytes: &[u8]) {
    let snapshot = serde_pickle::value_from_slice(bytes, DeOptions::new()).expect("a valid pickle");
    let top = dict(&snapshot);
    // Live segments: address, size, stream.
    let mut segments: Vec<(i64, i64, i64)> = Vec::new();
    let mut blocks: HashMap<i64, i64> = HashMap::new();
    for segment in list(top["segments"]).iter().map(dict) {
        segments.push((int(segment["address"]), int(segment["total_size"]), int(segment["stream"])));
        for block in list(segment["blocks"]).iter().map(dict) {
            if text(block["state"]) == "active_allocated" {
                blocks.insert(int(block["address"]), int(block["size"]));
            }
        }
    }
    let check = |segments: &[(i64, i64, i64)], blocks: &HashMap<i64, i64>, at: &str| {
        for (&addr, &size) in blocks {
            assert!(
                segments.iter().any(|&(base, len, _)| base <= addr && addr + size <= base + len),
                "block {addr:#x}+{size} outside every segment {at}"
            );
        }
    };
    check(&segments, &blocks, "at the end");
    let events: Vec<BTreeMap<String, &Value>> = list(&list(top["device_traces"])[0]).iter().map(dict).collect();
    let categories: Vec<&str> = events.iter().map(|e| text(e["category"])).collect();
    assert!(categories.contains(&"unknown"));
    for (index, event) in events.iter().enumerate().rev() {
        let (addr, size, stream) = (int(event["addr"]), int(event["size"]), int(event["stream"]));
        match text(event["action"]) {
            "free_completed" => {
                blocks.insert(addr, size);
            }
            "alloc" => {
                blocks.remove(&addr);
            }
            "segment_free" => segments.push((addr, size, stream)),
            "segment_alloc" => {
                let at =
                    segments.iter().position(|&(base, ..)| base == addr).expect("a segment allocated is live after");
                segments.swap_remove(at);
            }
            "segment_unmap" => {
                let (mut base, mut len) = (addr, size);
                if let Some(at) = segments.iter().position(|&(b, l, s)| b + l == base && s == stream) {
                    let (b, l, _) = segments.swap_remove(at);
                    (base, len) = (b, l + len);
                }
                if let Some(at) = segments.iter().position(|&(b, _, s)| b == base + len && s == stream) {
                    len += segments.swap_remove(at).1;
                }
                segments.push((base, len, stream));
            }
            "segment_map" => {
                let at = segments
                    .iter()
                    .position(|&(base, len, _)| base <= addr && addr + size <= base + len)
                    .expect("pages mapped are in a live segment after");
                let (base, len, stream) = segments.swap_remove(at);
                if base < addr {
                    segments.push((base, addr - base, stream));
                }
                if addr + size < base + len {
                    segments.push((addr + size, base + len - addr - size, stream));
                }
            }
            _ => {}
        }
        check(&segments, &blocks, &format!("before event {index}"));
    }
}

#[test]
fn the_snapshot_replays_backwards_in_the_viewer_without_a_block_outside_its_segment() {
    // Both layouts: pool slabs, and ranges whose pages are mapped on demand (expandable segments).
    for vmm in [false, true] {
        let (runtime, _, _streams) = busy_runtime_on(vmm);
        let mut bytes = Vec::new();
        runtime.telemetry().history().write_memory_snapshot(&mut bytes).unwrap();
        check_viewer_consistency(&bytes);
        let snapshot = serde_pickle::value_from_slice(&bytes, DeOptions::new()).unwrap();
        let events = list(&list(dict(&snapshot)["device_traces"])[0]).iter().map(dict).collect::<Vec<_>>();
        let maps = events.iter().filter(|e| text(e["action"]) == "segment_map").count();
        assert_eq!(maps > 0, vmm, "segment_map entries exactly where pages are mapped");
    }
}

#[test]
fn a_snapshot_started_after_warm_up_or_cut_short_still_loads_consistently() {
    for bound in [1 << 16, 12] {
        let runtime = simulated_runtime(1 << 30);
        let arena = runtime
            .declare_phase(PhaseSpec::new("scratch", Scope::Step).strategy(Strategy::Arena { slab_bytes: 8 * MIB }))
            .unwrap();
        let stream = runtime.device(0).unwrap().create_stream().unwrap();
        let weights = runtime.alloc(Phase::WEIGHTS, 3 * MIB, &stream).unwrap();
        // A warm-up step takes the arena's slab before recording begins.
        let step = runtime.begin_step().unwrap();
        drop(step.alloc(arena, MIB, &stream).unwrap());
        step.end().unwrap();
        runtime.telemetry().start_recording(bound);
        for _ in 0..4 {
            let step = runtime.begin_step().unwrap();
            let a = step.alloc(arena, 2 * MIB, &stream).unwrap();
            let b = step.alloc(arena, MIB, &stream).unwrap();
            let c = step.alloc(Phase::ACTIVATIONS, 5 * MIB, &stream).unwrap();
            drop((b, c));
            drop(a);
            step.end().unwrap();
        }
        let mut bytes = Vec::new();
        runtime.telemetry().history().write_memory_snapshot(&mut bytes).unwrap();
        check_viewer_consistency(&bytes);
        drop(weights);
    }
}

#[test]
fn captured_steps_and_graph_memory_show_in_the_timeline_and_the_snapshot() {
    let runtime = simulated_runtime(1 << 30);
    runtime.telemetry().start_recording(10_000);
    let phase = runtime.declare_phase(PhaseSpec::new("captured", Scope::Step).strategy(Strategy::Direct)).unwrap();
    let stream = runtime.device(0).unwrap().create_stream().unwrap();
    let step = runtime.begin_step().unwrap();
    drop(step.alloc(phase, MIB, &stream).unwrap());
    let eager = step.end().unwrap();
    let step = runtime.begin_step().unwrap();
    let capture = step.capture(&stream, &[phase], CaptureMemory::GraphNodes, CaptureMode::Global).unwrap();
    let a = capture.alloc(phase, 3 * MIB).unwrap();
    let b = capture.alloc(phase, MIB).unwrap();
    capture.free(a).unwrap();
    let _left = b; // never freed in the graph: graph memory stays in use after a launch
    let captured = capture.end().unwrap();
    for _ in 0..3 {
        captured.launch().unwrap();
    }
    let report = step.end().unwrap();
    assert_eq!(report.graph_launches, 3);
    assert!(report.graph_memory.reserved >= 4 * MIB, "{:?}", report.graph_memory);
    let history = runtime.telemetry().history();

    // The timeline shades the captured step, names it with its launches, and draws graph memory.
    let svg = history.timeline_svg("captured");
    let document = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let shaded = document.descendants().filter(|n| n.attribute("class") == Some("captured")).count();
    assert_eq!(shaded, 1, "one captured step shaded");
    assert!(svg.contains(&format!("step {} captured: 3 graph launches", report.index)), "{svg}");
    assert!(!svg.contains(&format!("step {} captured", eager.index)), "the eager step is not marked");
    assert!(svg.contains("graph memory reserved, all devices"), "{svg}");
    let highest =
        format!("graph memory reserved (highest {})", steppool_sys::bytes::Bytes(report.graph_memory.reserved));
    assert!(svg.contains(&highest), "{highest} in {svg}");

    // The snapshot holds the reading in the device's trace and the settings.
    let mut bytes = Vec::new();
    history.write_memory_snapshot(&mut bytes).unwrap();
    let snapshot = serde_pickle::value_from_slice(&bytes, DeOptions::new()).expect("a valid pickle");
    let top = dict(&snapshot);
    let settings = dict(top["allocator_settings"]);
    let reserved = report.graph_memory.reserved.to_string();
    assert_eq!(text(settings["graph_memory_reserved_bytes:0"]), reserved);
    assert_eq!(text(settings["graph_memory_used_bytes:0"]), report.graph_memory.used.to_string());
    assert_eq!(text(settings["graph_launches"]), "3");
    let traces = list(top["device_traces"]);
    let readings: Vec<BTreeMap<String, &Value>> = list(&traces[0])
        .iter()
        .map(dict)
        .filter(|e| text(e["action"]) == "snapshot" && !list(e["frames"]).is_empty())
        .collect();
    assert_eq!(readings.len(), 1, "one reading, at the captured step's end");
    let frame = dict(&list(readings[0]["frames"])[0]);
    assert_eq!(text(frame["filename"]), "steppool graph memory, device 0");
    assert_eq!(int(frame["line"]), report.index as i64);
    let name = text(frame["name"]);
    assert!(name.contains("captured: 3 graph launches"), "{name}");
    assert!(name.starts_with("graph memory reserved "), "{name}");
    drop(captured);
    assert!(runtime.take_errors().is_empty());
}
