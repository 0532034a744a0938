//! Plans that outlive a run and the strategy a phase chooses itself: the plans a planned phase
//! recorded are saved, written, read back and loaded into the next run, whose first step is then
//! served from them with no recording step; bad plans are refused with a typed error before use;
//! an `Auto` phase records its first step and goes on with the strategy that reserves least.

use steppool::{Error, Phase, PhaseSpec, PlanFile, PlanFileError, Runtime, Scope, Step, Strategy, Stream};
use steppool_sys::sim::SimConfig;
use steppool_trace::plans::{PhasePlans, PlanKey, PlannedBlock, SavedPlan};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A simulated device with virtual memory management, as a GPU has it (planned slabs are ranges).
fn runtime() -> Runtime {
    runtime_with(true)
}

/// A simulated device with or without (`vmm`) virtual memory management: without it, planned
/// slabs are pool allocations.
fn runtime_with(vmm: bool) -> Runtime {
    Runtime::builder().simulated(SimConfig { vmm_supported: vmm, ..SimConfig::with_capacity(8 * GIB) }).build().unwrap()
}

/// One transformer-like step: activations kept for the backward pass, scratch freed at once,
/// then the activations freed in reverse.
fn step(step: &Step, phase: Phase, stream: &Stream) {
    let mut kept = Vec::new();
    for layer in 0..6u64 {
        kept.push(step.alloc(phase, (3 + layer % 2) * MIB, stream).unwrap());
        drop(step.alloc(phase, 5 * MIB + 512, stream).unwrap());
    }
    while kept.pop().is_some() {}
}

fn planned_runtime(plans: Option<PhasePlans>, vmm: bool) -> (Runtime, Phase, Stream) {
    let rt = runtime_with(vmm);
    let mut spec = PhaseSpec::new("act", Scope::Step).strategy(Strategy::PLANNED);
    if let Some(plans) = plans {
        spec = spec.plans(plans);
    }
    let phase = rt.declare_phase(spec).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    (rt, phase, stream)
}

fn plan_counts(rt: &Runtime, phase: Phase) -> (u64, u64, u64) {
    let stats = rt.stats().unwrap().into_iter().find(|s| s.pool.phase == phase).unwrap();
    let plan = stats.plan.unwrap();
    (plan.planned, plan.unplanned, plan.replans)
}

#[test]
fn a_run_loaded_from_saved_plans_has_no_recording_step() {
    for vmm in [true, false] {
        loaded_on(vmm);
    }
}

fn loaded_on(vmm: bool) {
    // The first run records its first step and serves the second from the plan.
    let (rt, phase, stream) = planned_runtime(None, vmm);
    let first = rt.begin_step().unwrap();
    step(&first, phase, &stream);
    let report = first.end().unwrap();
    let recorded = report.pools.iter().find(|p| p.pool.phase == phase).unwrap().plan.clone().unwrap();
    assert_eq!((recorded.planned, recorded.unplanned), (0, 12), "the first step is the recording");
    let second = rt.begin_step().unwrap();
    step(&second, phase, &stream);
    let steady = second.end().unwrap().phase(phase).unwrap().peak_reserved;
    let file = rt.saved_plans();
    assert_eq!(file.phases.len(), 1);
    assert_eq!(file.phases[0].phase, "act");
    assert_eq!(file.phases[0].plans[0].blocks.len(), 12);

    // Written, read back, loaded: the next run's first step is served from the plan.
    let text = file.to_json();
    let read = PlanFile::from_json(&text).unwrap();
    assert_eq!(read, file);
    let rt2 = runtime_with(vmm);
    let phase2 = rt2.declare_phase(PhaseSpec::new("act", Scope::Step).strategy(Strategy::PLANNED)).unwrap();
    rt2.load_plans(&read).unwrap();
    assert_eq!(rt2.phase_spec(phase2).unwrap().plans.as_deref(), Some(&read.phases[0]));
    let stream2 = rt2.device(0).unwrap().create_stream().unwrap();
    let first = rt2.begin_step().unwrap();
    step(&first, phase2, &stream2);
    assert_eq!(plan_counts(&rt2, phase2), (12, 0, 0), "every allocation of the first step at its planned offset");
    let report = first.end().unwrap();
    let plan = report.pools.iter().find(|p| p.pool.phase == phase2).unwrap().plan.clone().unwrap();
    assert_eq!((plan.planned, plan.unplanned, plan.deviations, plan.replans), (12, 0, 0, 0));
    // The slab is a pool allocation of the plan's size, or the range's whole pages.
    let bytes = file.phases[0].plans[0].bytes;
    assert_eq!(plan.slab_bytes, if vmm { bytes.next_multiple_of(2 * MIB) } else { bytes });
    assert_eq!(
        report.phase(phase2).unwrap().peak_reserved,
        steady,
        "the first step reserves what the recorded run's second step did"
    );
}

#[test]
fn plans_are_loaded_through_the_spec_as_well() {
    let (rt, phase, stream) = planned_runtime(None, true);
    for _ in 0..2 {
        let s = rt.begin_step().unwrap();
        step(&s, phase, &stream);
        s.end().unwrap();
    }
    let saved = rt.saved_plans().phases.remove(0);
    let (rt, phase, stream) = planned_runtime(Some(saved), true);
    let s = rt.begin_step().unwrap();
    step(&s, phase, &stream);
    assert_eq!(plan_counts(&rt, phase), (12, 0, 0));
    s.end().unwrap();
}

fn one_plan(blocks: Vec<PlannedBlock>, bytes: u64) -> PhasePlans {
    let key = PlanKey::Sizes(blocks.iter().take(4).map(|b| b.size).collect());
    PhasePlans {
        phase: "act".to_owned(),
        plans: vec![SavedPlan { key, bytes, varies: false, received: false, carries: false, blocks }],
    }
}

#[test]
fn bad_plans_are_refused_before_use() {
    let rt = runtime();
    let refused = |spec: PhaseSpec| match rt.declare_phase(spec) {
        Err(Error::InvalidPhaseSpec { reason, .. }) => reason,
        other => panic!("expected an invalid spec, got {other:?}"),
    };
    let block = |size, start, end, offset| PlannedBlock { size, start, end, offset };
    // Two blocks alive together at one offset.
    let overlapping = one_plan(vec![block(4096, 0, Some(3), 0), block(4096, 1, Some(2), 2048)], 8192);
    let reason = refused(PhaseSpec::new("a", Scope::Step).strategy(Strategy::PLANNED).plans(overlapping.clone()));
    assert!(
        reason.contains("block 0 (4096 bytes at offset 0, alive 0 to 3) and block 1 (4096 bytes at offset 2048, alive 1 to 2) overlap"),
        "{reason}"
    );
    // Plans on a phase that is not planned, or keyed by another signature length.
    let fine = one_plan(vec![block(4096, 0, Some(1), 0)], 4096);
    let reason = refused(PhaseSpec::new("b", Scope::Step).plans(fine.clone()));
    assert!(reason.contains("the direct strategy"), "{reason}");
    let two = one_plan(vec![block(4096, 0, Some(2), 0), block(2048, 1, Some(3), 4096)], 8192);
    let reason = refused(
        PhaseSpec::new("c", Scope::Step).strategy(Strategy::Planned { max_plans: 8, signature_len: 1 }).plans(two),
    );
    assert!(reason.contains("keyed by 2 sizes; this phase's signature reads 1 of its 2 allocations"), "{reason}");

    // Through the runtime: an unknown phase, a phase in use, a bad file: nothing is loaded.
    let phase = rt.declare_phase(PhaseSpec::new("act", Scope::Step).strategy(Strategy::PLANNED)).unwrap();
    let mut file = PlanFile::new(vec![fine.clone(), PhasePlans { phase: "nope".to_owned(), ..fine.clone() }]);
    assert!(matches!(rt.load_plans(&file), Err(Error::NoPhaseNamed { name }) if name == "nope"));
    assert_eq!(rt.phase_spec(phase).unwrap().plans, None, "nothing loaded");
    file.phases[1] = overlapping;
    file.phases[1].phase = "other".to_owned();
    assert!(matches!(rt.load_plans(&file), Err(Error::InvalidPlans(PlanFileError::Invalid { plan: 0, .. }))));
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let s = rt.begin_step().unwrap();
    drop(s.alloc(phase, MIB, &stream).unwrap());
    s.end().unwrap();
    assert!(matches!(rt.load_plans(&PlanFile::new(vec![fine])), Err(Error::PhaseInUse { .. })));
}

// ----- the automatic strategy -------------------------------------------------------------------

/// The strategy an `Auto` phase chose after running `program` for three steps.
fn chosen(program: impl Fn(&Step, Phase, &Stream)) -> (Strategy, Vec<u64>) {
    let rt = runtime();
    let phase = rt.declare_phase(PhaseSpec::new("auto", Scope::Step).strategy(Strategy::Auto)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let mut peaks = Vec::new();
    let mut choice = None;
    for index in 0..3 {
        let s = rt.begin_step().unwrap();
        program(&s, phase, &stream);
        let report = s.end().unwrap();
        let pool = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
        assert_eq!(pool.strategy, Strategy::Auto);
        peaks.push(report.phase(phase).unwrap().peak_reserved);
        if index == 0 {
            choice = pool.chosen;
        } else {
            assert_eq!(pool.chosen, choice, "chosen once, at the end of the first step");
        }
    }
    (choice.expect("chosen at the end of the first step"), peaks)
}

#[test]
fn auto_plans_a_step_that_fragments_one_pool() {
    // Large activations kept while scratch of growing sizes comes and goes, each scratch freed
    // once the next is made: the pool's best fit strands the scratch's holes, the arena's bump
    // never moves back over them, the plan packs them.
    let (strategy, peaks) = chosen(|s, phase, stream| {
        let mut kept = Vec::new();
        let mut scratch = None;
        for layer in 0..8u64 {
            kept.push(s.alloc(phase, 3 * MIB, stream).unwrap());
            drop(scratch.replace(s.alloc(phase, (1 + layer) * MIB, stream).unwrap()));
        }
    });
    assert_eq!(strategy.name(), "planned", "{peaks:?}");
    assert!(peaks[2] < peaks[0], "the planned steps reserve less than the recorded one: {peaks:?}");
}

#[test]
fn auto_takes_the_arena_for_a_step_freed_in_stack_order() {
    // The same, each scratch freed before the next allocation: the arena's bump moves back over
    // it, so the arena needs what the plan does, and the tie goes to the simpler arena.
    let (strategy, peaks) = chosen(|s, phase, stream| {
        let mut kept = Vec::new();
        for layer in 0..8u64 {
            kept.push(s.alloc(phase, 3 * MIB, stream).unwrap());
            drop(s.alloc(phase, (1 + layer) * MIB, stream).unwrap());
        }
    });
    assert_eq!(strategy.name(), "arena", "{peaks:?}");
    assert!(peaks[2] < peaks[0], "the arena's steps reserve less than the recorded one: {peaks:?}");
}

#[test]
fn auto_keeps_one_pool_where_nothing_is_gained() {
    // One allocation a step of one 32 MiB pool unit: every strategy holds 32 MiB; the tie goes to
    // the simplest.
    let (strategy, _) = chosen(|s, phase, stream| drop(s.alloc(phase, 32 * MIB, stream).unwrap()));
    assert_eq!(strategy, Strategy::Direct);
}
