//! The `Planned` strategy: random step programs with random deviations (extra allocations,
//! missing ones, changed sizes, frees in another order, frees that come late or never, other
//! shapes and user keys), and random loops whose steps hand memory to the next, never get
//! memory that overlaps a live allocation, every allocation succeeds or fails with a typed
//! error, and the accounting stays exact; real PyTorch training traces replayed through it are
//! served from their plans.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use steppool::{Error, Phase, PhaseSpec, PlanKey, PlanStats, PoolStats, Runtime, Scope, Strategy as Allocation};
use steppool_sys::CUdeviceptr;
use steppool_sys::sim::SimConfig;
use steppool_trace::{EventKind, StepSource, Trace};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A simulated device of `capacity` bytes with virtual memory management, as a GPU has it: the
/// slab is a reserved range whose pages are mapped as plans need them.
fn runtime(capacity: u64) -> Runtime {
    runtime_with(capacity, true)
}

/// A simulated device with (`vmm`) or without virtual memory management: without it the slab is
/// a pool allocation, the fallback of devices and drivers that lack it.
/// A simulated device of `capacity` bytes, with virtual memory management or without it. Without
/// it, plans take pool slabs, and the pool is the simulated device's segment model, so that their
/// figures stay in 2 MiB granules: in pools of the driver's 32 MiB units (measured on an H200,
/// which has virtual memory management) a plan's slab rounds to whole units as one pool's memory
/// does, and the plan ties one pool or holds a unit more.
fn runtime_with(capacity: u64, vmm: bool) -> Runtime {
    let pool_unit = if vmm { SimConfig::default().pool_unit } else { None };
    Runtime::builder()
        .simulated(SimConfig { vmm_supported: vmm, pool_unit, ..SimConfig::with_capacity(capacity) })
        .build()
        .unwrap()
}

/// The simulated device's page and pool granule.
const GRANULE: u64 = 2 * MIB;

/// The slab a plan of `bytes` takes: a pool allocation of its size, or whole pages of a range.
fn slab_for(bytes: u64, vmm: bool) -> u64 {
    if vmm { bytes.next_multiple_of(GRANULE) } else { bytes }
}

/// Bytes mapped in reserved ranges on the runtime's simulated device.
fn mapped(rt: &Runtime) -> u64 {
    rt.driver().sim().unwrap().mapped_ranges().iter().map(|r| r.size).sum()
}

fn planned_phase(rt: &Runtime, name: &str, scope: Scope, strategy: Allocation) -> Phase {
    rt.declare_phase(PhaseSpec::new(name, scope).strategy(strategy)).unwrap()
}

fn pool_stats(rt: &Runtime, phase: Phase, stream: &steppool::Stream) -> PoolStats {
    rt.stats().unwrap().into_iter().find(|s| s.pool.phase == phase && s.pool.stream == stream.id()).expect("the pool")
}

fn plan_of(stats: &PoolStats) -> &PlanStats {
    stats.plan.as_ref().expect("a planned pool reports its plans")
}

/// Live device ranges handed out, across every pool: a new one must overlap none.
#[derive(Default)]
struct Ranges(BTreeMap<CUdeviceptr, u64>);

impl Ranges {
    fn insert(&mut self, ptr: CUdeviceptr, size: u64) -> Result<(), String> {
        if let Some((&below, &len)) = self.0.range(..=ptr).next_back()
            && below + len > ptr
        {
            return Err(format!("{ptr:#x}+{size} overlaps the live {below:#x}+{len}"));
        }
        if let Some((&above, &len)) = self.0.range(ptr..).next()
            && above < ptr + size
        {
            return Err(format!("{ptr:#x}+{size} overlaps the live {above:#x}+{len}"));
        }
        self.0.insert(ptr, size);
        Ok(())
    }

    fn remove(&mut self, ptr: CUdeviceptr) {
        self.0.remove(&ptr);
    }
}

// ----- the spec and the key ---------------------------------------------------------------------

/// Why `rt` refuses `spec`; panics if it does not.
fn refused(rt: &Runtime, spec: PhaseSpec) -> String {
    match rt.declare_phase(spec) {
        Err(Error::InvalidPhaseSpec { reason, .. }) => reason,
        other => panic!("expected an invalid spec, got {other:?}"),
    }
}

#[test]
fn planned_specs_are_checked_with_the_numbers() {
    let rt = runtime(GIB);
    let refused = |spec: PhaseSpec| refused(&rt, spec);
    let planned = |max_plans, signature_len| Allocation::Planned { max_plans, signature_len };
    assert!(refused(PhaseSpec::new("w", Scope::Persistent).strategy(Allocation::PLANNED)).contains("repeat"));
    assert!(refused(PhaseSpec::new("a", Scope::Step).strategy(planned(0, 4))).contains("0 plans"));
    assert!(refused(PhaseSpec::new("b", Scope::Step).strategy(planned(1025, 4))).contains("1025 plans"));
    assert!(refused(PhaseSpec::new("c", Scope::Step).strategy(planned(8, 0))).contains("0 sizes"));
    assert!(refused(PhaseSpec::new("d", Scope::MicroStep).strategy(planned(8, 65))).contains("65 sizes"));
    assert!(rt.declare_phase(PhaseSpec::new("e", Scope::MicroStep).strategy(planned(1, 64))).is_ok());
    assert_eq!(Allocation::PLANNED.name(), "planned");
}

#[test]
fn plan_keys_are_for_planned_phases() {
    let rt = runtime(GIB);
    match rt.set_plan_key(Phase::ACTIVATIONS, Some(3)) {
        Err(error @ Error::NotPlanned { .. }) => assert!(error.to_string().contains("direct strategy"), "{error}"),
        other => panic!("expected NotPlanned, got {other:?}"),
    }
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    rt.set_plan_key(phase, Some(7)).unwrap();
}

// ----- serving from a plan ----------------------------------------------------------------------

/// One step of a small "model": forward activations kept, scratch freed at once, backward frees
/// in reverse.
fn model_step(step: &steppool::Step, phase: Phase, stream: &steppool::Stream, batch: u64) -> Vec<CUdeviceptr> {
    let mut ptrs = Vec::new();
    let input = step.alloc(phase, batch * 3 * KIB, stream).unwrap();
    ptrs.push(input.ptr());
    let mut kept = Vec::new();
    for layer in 0..6 {
        let activation = step.alloc(phase, batch * (64 + 16 * layer) * KIB, stream).unwrap();
        let scratch = step.alloc(phase, batch * 40 * KIB, stream).unwrap();
        ptrs.extend([activation.ptr(), scratch.ptr()]);
        drop(scratch);
        kept.push(activation);
    }
    while let Some(activation) = kept.pop() {
        let grad = step.alloc(phase, activation.len(), stream).unwrap();
        ptrs.push(grad.ptr());
        drop(activation);
        drop(grad);
    }
    drop(input);
    ptrs
}

#[test]
fn a_repeating_step_is_served_from_its_plan_at_the_same_addresses() {
    for vmm in [true, false] {
        a_repeating_step_on(vmm);
    }
}

fn a_repeating_step_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let mut addresses = Vec::new();
    for index in 0..4 {
        let step = rt.begin_step().unwrap();
        addresses.push(model_step(&step, phase, &stream, 4));
        stream.synchronize().unwrap();
        let report = step.end().unwrap();
        let stats = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
        let plan = plan_of(stats);
        if index == 0 {
            assert_eq!((plan.planned, plan.replans), (0, 1), "the first step is recorded and planned");
            assert_eq!(plan.plans.len(), 1);
            if vmm {
                // The recording gave its pages back as it freed them; nothing is mapped ahead of
                // the next step, whose plan maps pages as its cursor reaches them.
                assert!(plan.slab_bytes <= slab_for(plan.plans[0].bytes, vmm), "{plan:?}");
            } else {
                assert_eq!(plan.slab_bytes, plan.plans[0].bytes, "the slab is taken at the end of the recording");
            }
        } else {
            assert_eq!((plan.planned, plan.unplanned, plan.deviations, plan.missing), (19, 0, 0, 0));
            assert_eq!(plan.hit_rate(), 1.0);
            // The new plan was laid out in allocation order (it cost little more than packing
            // it): the second step keeps its sequence, so it is packed at that step's end.
            assert_eq!(plan.replans, u64::from(index == 1));
            // The simulated pool reserves in 2 MiB granules, as a range maps pages.
            // (The second step's slab was the in-order plan's, at least the packed one's.)
            let slab = plan.slab_bytes.next_multiple_of(GRANULE);
            assert!(
                stats.peak_reserved == slab || (index == 1 && stats.peak_reserved >= slab),
                "the slab and nothing else"
            );
            let pool = rt.pool_handle(phase, &stream).unwrap().unwrap();
            let in_pool = rt.driver().sim().unwrap().pool_layout(pool).unwrap().reserved;
            if index != 1 {
                assert_eq!((in_pool, mapped(&rt)), if vmm { (0, plan.slab_bytes) } else { (stats.peak_reserved, 0) });
            } else if vmm {
                assert_eq!(in_pool, 0, "nothing in the pool beside the range");
            } else {
                assert_eq!(mapped(&rt), 0, "nothing mapped beside the pool's slab");
            }
            // (The second step's plan was replaced by its packing at the step's end: the scope
            // it served stays counted.)
            assert_eq!(plan.plans[0].scopes, 1);
        }
        let summary = &plan.plans[0];
        assert!(summary.bytes >= summary.lower_bound);
        assert_eq!(summary.allocations, 19);
    }
    // From the third step on, the packed plan: the same offsets in the same slab.
    assert_eq!(addresses[2], addresses[3], "planned offsets in the same slab");
}

#[test]
fn each_shape_gets_its_plan_and_smaller_shapes_borrow_a_larger_one_where_slabs_are_pool_allocations() {
    for vmm in [true, false] {
        shapes_on(vmm);
    }
}

fn shapes_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let batches = [2, 8, 2, 8, 4, 2, 8, 4];
    let mut last = None;
    for (index, &batch) in batches.iter().enumerate() {
        let step = rt.begin_step().unwrap();
        model_step(&step, phase, &stream, batch);
        let report = step.end().unwrap();
        let plan = plan_of(report.pools.iter().find(|p| p.pool.phase == phase).unwrap()).clone();
        // Served from a plan when this shape, or (where slabs are pool allocations) a larger one
        // whose sizes cover it, was seen. In a growable range a new shape is served best-fit
        // from the range's start and records its own plan, unless two other shapes of its
        // sequence were seen: then from the plan they predict for it (every size here follows the
        // batch).
        let seen = &batches[..index];
        let predicted = vmm && seen.iter().any(|&other| other != seen[0]);
        let covered = predicted || seen.iter().any(|&seen| if vmm { seen == batch } else { seen >= batch });
        assert_eq!(plan.planned == 19, covered, "step {index} (batch {batch}): {plan:?}");
        assert_eq!(plan.deviations, 0, "a new first size is a new signature, not a deviation");
        if vmm {
            // The range keeps the pages the largest recent plan needs, no more: at least the
            // pages of the plan of the shape just served once it served.
            let own = plan.plans.iter().find(|p| matches!(&p.key, PlanKey::Sizes(s) if s[0] == batch * 3 * KIB));
            let own = slab_for(own.unwrap().bytes, vmm);
            let largest = slab_for(plan.plans.iter().map(|p| p.bytes).max().unwrap(), vmm);
            assert!(plan.slab_bytes <= largest, "step {index} (batch {batch}): {plan:?}");
            if covered {
                assert!(plan.slab_bytes >= own, "step {index} (batch {batch}): {plan:?}");
            }
        } else {
            // The slab is sized for the plan of the shape just served: the largest only after it.
            let largest = plan.plans.iter().map(|p| p.bytes).max().unwrap();
            let largest_batch = batches[..=index].iter().copied().max().unwrap();
            assert_eq!(plan.slab_bytes == largest, batch == largest_batch, "step {index} (batch {batch}): {plan:?}");
            assert!(plan.plans.iter().any(|p| p.bytes == plan.slab_bytes));
        }
        last = Some(plan);
    }
    let plan = last.unwrap();
    assert_eq!(plan.plans.len(), 3);
    assert!(plan.plans.iter().all(|p| matches!(&p.key, PlanKey::Sizes(sizes) if sizes.len() == 4)));
}

#[test]
fn user_keys_select_plans_and_the_bound_evicts_the_least_recently_used() {
    let rt = runtime(8 * GIB);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::Planned { max_plans: 2, signature_len: 4 });
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let run = |key: u64, batch: u64| {
        rt.set_plan_key(phase, Some(key)).unwrap();
        let step = rt.begin_step().unwrap();
        model_step(&step, phase, &stream, batch);
        let report = step.end().unwrap();
        plan_of(report.pools.iter().find(|p| p.pool.phase == phase).unwrap()).clone()
    };
    assert_eq!(run(1, 2).planned, 0);
    assert_eq!(run(1, 2).planned, 19);
    assert_eq!(run(2, 4).planned, 0);
    assert_eq!(run(2, 4).planned, 19);
    assert_eq!(run(1, 2).planned, 19, "key 1 was used more recently than nothing: still kept");
    let third = run(3, 8);
    assert_eq!(third.planned, 0);
    let keys: Vec<_> = third.plans.iter().map(|p| p.key.clone()).collect();
    assert_eq!(keys, vec![PlanKey::User(3), PlanKey::User(1)], "key 2, least recently used, went");
    // Same sizes under another key: recorded again, not served from key 1's plan.
    assert_eq!(run(4, 2).planned, 0);
}

#[test]
fn a_deviation_is_served_from_the_pool_and_refreshes_the_plan() {
    for vmm in [true, false] {
        a_deviation_is_served_from_the_pool_and_refreshes_the_plan_on(vmm);
    }
}

fn a_deviation_is_served_from_the_pool_and_refreshes_the_plan_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    for _ in 0..2 {
        let step = rt.begin_step().unwrap();
        model_step(&step, phase, &stream, 4);
        step.end().unwrap();
    }
    // The same step with one extra allocation after the signature (the first 4 sizes).
    let deviating = |rt: &Runtime| {
        let step = rt.begin_step().unwrap();
        let input = step.alloc(phase, 12 * KIB, &stream).unwrap();
        let first = step.alloc(phase, 4 * 64 * KIB, &stream).unwrap();
        drop(step.alloc(phase, 4 * 40 * KIB, &stream).unwrap());
        let second = step.alloc(phase, 4 * 80 * KIB, &stream).unwrap();
        let extra = step.alloc(phase, 3 * MIB, &stream).unwrap();
        let stats = pool_stats(rt, phase, &stream);
        assert_eq!(stats.used, 12 * KIB + 4 * 144 * KIB + 3 * MIB);
        drop((input, first, second, extra));
        let report = step.end().unwrap();
        (plan_of(&stats).clone(), plan_of(report.pools.iter().find(|p| p.pool.phase == phase).unwrap()).clone())
    };
    let (during, after) = deviating(&rt);
    assert_eq!((during.planned, during.deviations), (4, 1), "the extra allocation came from the pool");
    assert_eq!((after.deviated_scopes, after.replans), (1, 1));
    // The extra allocation is larger than the fifth entry and its grown range is taken: that
    // entry deviates, and the 14 after it were never asked for.
    assert_eq!(after.missing, 14, "the rest of the plan was never asked for");
    assert_eq!(after.plans.len(), 1, "the same signature: the plan was refreshed, not added");
    // The refreshed plan is the deviating step's: served from the next time it repeats.
    let (during, after) = deviating(&rt);
    assert_eq!((during.planned, during.deviations), (5, 0));
    // Its plan, of another sequence than the one before, was laid out in allocation order; the
    // sequence repeats, so it is packed now.
    assert_eq!((after.missing, after.deviated_scopes, after.replans), (0, 0, 1));
}

#[test]
fn a_new_shape_is_served_from_a_larger_plan_or_else_from_the_slab_free_space() {
    for vmm in [true, false] {
        a_new_shape_is_served_from_a_larger_plan_or_else_from_the_slab_free_space_on(vmm);
    }
}

fn a_new_shape_is_served_from_a_larger_plan_or_else_from_the_slab_free_space_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let step = rt.begin_step().unwrap();
    model_step(&step, phase, &stream, 8);
    stream.synchronize().unwrap(); // the recording's frees are seen complete: trimmed at the end
    step.end().unwrap();
    let before = plan_of(&pool_stats(&rt, phase, &stream)).clone();
    let (slab_before, larger) = (before.slab_bytes, before.plans[0].bytes);
    // A smaller shape: no plan of its own, but every size fits the larger plan's entries.
    let step = rt.begin_step().unwrap();
    model_step(&step, phase, &stream, 2);
    let report = step.end().unwrap();
    let stats = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
    let plan = plan_of(stats);
    if vmm {
        // In a growable range it does not borrow the larger plan (whose offsets would spread it
        // over its extent): it is served best-fit from the range's start, in the pages the
        // larger scope left mapped, which the range keeps while that plan is recent.
        assert_eq!((plan.planned, plan.unplanned, plan.deviations), (0, 19, 0));
        assert_eq!(stats.peak_reserved, slab_before, "within the pages mapped");
        assert_eq!(stats.reserved, slab_before);
        let pool = rt.pool_handle(phase, &stream).unwrap().unwrap();
        assert_eq!(rt.driver().sim().unwrap().pool_layout(pool).unwrap().reserved, 0, "nothing came from the pool");
    } else {
        assert_eq!((plan.planned, plan.unplanned, plan.deviations), (19, 0, 0));
        assert_eq!(stats.peak_reserved, slab_before.next_multiple_of(2 * MIB), "nothing came from the pool");
    }
    assert_eq!(plan.plans.len(), 2, "it records its own plan");
    if vmm {
        assert_eq!(plan.slab_bytes, slab_for(larger, vmm), "the range keeps the recent, larger plan's pages");
    } else {
        assert!(plan.slab_bytes < slab_for(larger, vmm), "and a pool slab follows it");
    }
    let slab_small = plan.slab_bytes;
    // Another order of sizes, larger first but smaller in all: no plan covers its first size,
    // so it is served best-fit from the slab's free space. (In a growable range the two plans of
    // the model's sequence predict one from its first size; the scope leaves it at its second
    // allocation, far smaller than predicted.)
    let step = rt.begin_step().unwrap();
    let big = step.alloc(phase, 40 * KIB, &stream).unwrap();
    let small = step.alloc(phase, 4 * KIB, &stream).unwrap();
    drop((big, small));
    let report = step.end().unwrap();
    let stats = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
    let plan = plan_of(stats);
    let expected = if vmm { (1, 1, 1) } else { (0, 2, 0) };
    assert_eq!((plan.planned, plan.unplanned, plan.deviations), expected);
    if vmm {
        // Its first allocation went where the prediction (the batch-8 plan's sizes, 5/3 as large)
        // puts it, and the range mapped the pages up to there: the price of a prediction the
        // scope leaves at once, at most the prediction's pages.
        let predicted = (larger * 5 / 3 + 2 * MIB).next_multiple_of(2 * MIB);
        assert!(stats.peak_reserved > slab_small && stats.peak_reserved <= predicted, "{stats:?}");
    } else {
        assert_eq!(stats.peak_reserved, slab_small.next_multiple_of(2 * MIB), "nothing came from the pool");
    }
}

#[test]
fn a_late_free_keeps_its_range_from_the_allocation_planned_over_it() {
    for vmm in [true, false] {
        a_late_free_keeps_its_range_from_the_allocation_planned_over_it_on(vmm);
    }
}

fn a_late_free_keeps_its_range_from_the_allocation_planned_over_it_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    // Recorded: A freed before B, so B is planned over A's range.
    for _ in 0..2 {
        let step = rt.begin_step().unwrap();
        let a = step.alloc(phase, MIB, &stream).unwrap();
        drop(a);
        let b = step.alloc(phase, MIB, &stream).unwrap();
        drop(b);
        step.end().unwrap();
    }
    let step = rt.begin_step().unwrap();
    let a = step.alloc(phase, MIB, &stream).unwrap();
    let b = step.alloc(phase, MIB, &stream).unwrap();
    assert!(a.ptr() + MIB <= b.ptr() || b.ptr() + MIB <= a.ptr(), "{:#x} and {:#x} overlap", a.ptr(), b.ptr());
    let plan = plan_of(&pool_stats(&rt, phase, &stream)).clone();
    assert_eq!((plan.planned, plan.deviations), (1, 1), "B went to the pool");
    drop((a, b));
    step.end().unwrap();
}

#[test]
fn carrying_is_for_step_scoped_pool_and_planned_phases() {
    let rt = runtime(GIB);
    let refused = |spec: PhaseSpec| refused(&rt, spec);
    assert!(refused(PhaseSpec::new("p", Scope::Persistent).carry(true)).contains("persistent phase"));
    assert!(refused(PhaseSpec::new("m", Scope::MicroStep).carry(true)).contains("step-scoped"));
    let arena = refused(PhaseSpec::new("a", Scope::Step).strategy(Allocation::ARENA).carry(true));
    assert!(arena.contains("arena strategy") && arena.contains("cannot carry"), "{arena}");
    for strategy in [Allocation::Direct, Allocation::PLANNED] {
        rt.declare_phase(PhaseSpec::new(strategy.name(), Scope::Step).strategy(strategy).carry(true)).unwrap();
    }
}

#[test]
fn memory_a_step_hands_to_the_next_lives_until_freed_there_and_is_planned_at_one_place() {
    for vmm in [true, false] {
        for strategy in [Allocation::PLANNED, Allocation::Direct] {
            carried_on(vmm, strategy);
        }
    }
}

/// Steps of a loop that sets its gradients to `None` between its forward and backward passes:
/// two 4 MiB activations, the step before's gradients freed, a 4 MiB temporary, then two 2 MiB
/// gradients made as the activations go, left live at the step's end.
fn carried_on(vmm: bool, strategy: Allocation) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = rt.declare_phase(PhaseSpec::new("step", Scope::Step).strategy(strategy).carry(true)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let raw = rt.raw();
    let mut live = Ranges::default();
    let alloc = |live: &mut Ranges, bytes: u64| {
        // SAFETY: the stream and phase are the runtime's; every pointer is freed once, below.
        let ptr = unsafe { raw.alloc(phase, bytes, &stream) }.unwrap();
        live.insert(ptr, bytes).unwrap_or_else(|overlap| panic!("{vmm} {strategy:?}: {overlap}"));
        ptr
    };
    let free = |live: &mut Ranges, ptr: CUdeviceptr| {
        live.remove(ptr);
        // SAFETY: handed out by `alloc` and not freed before.
        unsafe { raw.free(ptr) }.unwrap();
    };
    let mut carried: Vec<CUdeviceptr> = Vec::new();
    let mut places = Vec::new();
    for step in 0..6 {
        raw.begin_step().unwrap();
        let a1 = alloc(&mut live, 4 * MIB);
        let a2 = alloc(&mut live, 4 * MIB);
        for g in carried.drain(..) {
            assert_eq!(raw.allocation(g).unwrap().bytes, 2 * MIB, "the step before's gradient is still the runtime's");
            free(&mut live, g);
        }
        let t = alloc(&mut live, 4 * MIB);
        free(&mut live, t);
        free(&mut live, a2);
        let g1 = alloc(&mut live, 2 * MIB);
        free(&mut live, a1);
        let g2 = alloc(&mut live, 2 * MIB);
        carried = vec![g1, g2];
        places.push(carried.clone());
        // SAFETY: nothing of the step is used after its end but what it carries.
        let report = unsafe { raw.end_step() }.unwrap();
        let pool = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
        assert_eq!((pool.used, pool.released), (4 * MIB, 0), "step {step}: the gradients carried, nothing released");
        if strategy == Allocation::PLANNED {
            assert_eq!(plan_of(pool).moves, u64::from(vmm && step == 1), "{vmm}: step {step}");
        }
        if strategy == Allocation::PLANNED && step == 5 {
            let plan = plan_of(pool);
            assert_eq!((plan.planned, plan.deviations), (5, 0), "{vmm}: the step served from its plan");
            // The temporary takes the gradients' place once they are freed: 12 MiB, the peak of
            // live bytes, where apart from the rest they would need 16. Without virtual memory
            // management the first step is recorded in chunks, apart from the slab, so the
            // gradients are placed with the plan. In a range that grows in place it is recorded
            // best-fit in the range, which leaves the gradients below the activations (pinned
            // there, 14 MiB), so the plan moved to a new range (`PlanStats::moves`, in the
            // report of the second step, at whose start it moved) with the gradients above them.
            assert_eq!(plan.slab_bytes, slab_for(12 * MIB, vmm), "{vmm}");
        }
    }
    if strategy == Allocation::PLANNED {
        assert!(places.windows(2).skip(2).all(|w| w[0] == w[1]), "{vmm}: the gradients at one place: {places:x?}");
    }
    // Not freed in the step after their own: that step's end releases them.
    raw.begin_step().unwrap();
    // SAFETY: nothing is used after the step's end.
    let report = unsafe { raw.end_step() }.unwrap();
    let pool = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
    assert_eq!((pool.used, pool.released), (0, 4 * MIB), "{vmm} {strategy:?}");
    assert!(raw.allocation(carried[0]).is_err(), "released, no longer the runtime's");
}

#[test]
fn leaked_buffers_are_reclaimed_and_leaked_deviations_given_back() {
    for vmm in [true, false] {
        leaks_on(vmm);
    }
}

fn leaks_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "planned", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    for leak in [false, true, true, false] {
        let step = rt.begin_step().unwrap();
        let kept = step.alloc(phase, 2 * MIB, &stream).unwrap();
        let extra = step.alloc(phase, if leak { 5 * MIB } else { MIB }, &stream).unwrap();
        if leak {
            std::mem::forget(kept);
            std::mem::forget(extra);
        } else {
            drop((kept, extra));
        }
        let report = step.end().unwrap();
        let stats = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
        assert_eq!(stats.used, 0);
        assert_eq!(stats.released, if leak { 7 * MIB } else { 0 });
        let pool = rt.pool_handle(phase, &stream).unwrap().unwrap();
        let layout = rt.driver().sim().unwrap().pool_layout(pool).unwrap();
        let held: Vec<u64> = layout.allocations.iter().map(|&(_, size)| size).collect();
        let slab = plan_of(stats).slab_bytes;
        if vmm {
            assert!(held.is_empty(), "the pool holds nothing beside the range: {held:?}");
            assert_eq!(mapped(&rt), slab, "only the slab's pages stay mapped");
        } else {
            assert_eq!(held, vec![slab], "only the slab stays allocated in the pool");
        }
    }
}

#[test]
fn micro_steps_are_planned_like_steps() {
    for vmm in [true, false] {
        micro_steps_are_planned_like_steps_on(vmm);
    }
}

fn micro_steps_are_planned_like_steps_on(vmm: bool) {
    let rt = runtime_with(8 * GIB, vmm);
    let phase = planned_phase(&rt, "micro", Scope::MicroStep, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    for index in 0..3 {
        let step = rt.begin_step().unwrap();
        for _ in 0..4 {
            let micro = step.begin_micro_step().unwrap();
            let a = micro.alloc(phase, 3 * MIB, &stream).unwrap();
            let b = micro.alloc(phase, MIB, &stream).unwrap();
            drop(a);
            let c = micro.alloc(phase, 2 * MIB, &stream).unwrap();
            drop((b, c));
            micro.end().unwrap();
        }
        let report = step.end().unwrap();
        let plan = plan_of(report.pools.iter().find(|p| p.pool.phase == phase).unwrap()).clone();
        let expected = if index == 0 { (9, 3) } else { (12, 0) };
        assert_eq!((plan.planned, plan.unplanned), expected, "step {index}");
        assert_eq!(plan.plans[0].bytes, plan.plans[0].lower_bound, "{plan:?}");
    }
}

// ----- random programs with random deviations --------------------------------------------------

/// One operation of a step's base program.
#[derive(Clone, Copy, Debug)]
enum Base {
    Alloc(u64),
    /// Frees the live allocation picked by this index (modulo the live count).
    Free(usize),
}

/// What a step does differently from its base program.
#[derive(Clone, Copy, Debug)]
enum Deviation {
    /// An allocation of this size before base op `at`.
    Extra { at: usize, size: u64 },
    /// Base allocation `at` is not made (its free is skipped too).
    Missing { at: usize },
    /// Base allocation `at` has this size instead.
    Resize { at: usize, size: u64 },
    /// Base free `at` frees another live allocation.
    Reorder { at: usize, pick: usize },
    /// Base free `at` comes at the step's end instead (released there), or is freed after every
    /// other op.
    Late { at: usize, never: bool },
}

#[derive(Clone, Debug)]
struct StepPlan {
    shape: usize,
    /// Every allocation of the base program this many times as large (a batch that varies: after
    /// two scales of one sequence, a third is served from the plan they predict).
    scale: u64,
    key: Option<u64>,
    deviations: Vec<Deviation>,
    micro: bool,
}

fn alloc_size() -> impl Strategy<Value = u64> {
    prop_oneof![4 => 1..256 * KIB, 2 => prop::sample::select(vec![512, 4 * KIB, MIB, 3 * MIB]), 1 => 1..8 * MIB]
}

fn base_program() -> impl Strategy<Value = Vec<Base>> {
    prop::collection::vec(
        prop_oneof![3 => alloc_size().prop_map(Base::Alloc), 2 => any::<usize>().prop_map(Base::Free)],
        1..40,
    )
}

fn deviation() -> impl Strategy<Value = Deviation> {
    prop_oneof![
        (0..40usize, alloc_size()).prop_map(|(at, size)| Deviation::Extra { at, size }),
        (0..40usize).prop_map(|at| Deviation::Missing { at }),
        (0..40usize, alloc_size()).prop_map(|(at, size)| Deviation::Resize { at, size }),
        (0..40usize, any::<usize>()).prop_map(|(at, pick)| Deviation::Reorder { at, pick }),
        (0..40usize, any::<bool>()).prop_map(|(at, never)| Deviation::Late { at, never }),
    ]
}

fn step_plan(shapes: usize) -> impl Strategy<Value = StepPlan> {
    (
        0..shapes,
        prop_oneof![2 => Just(1u64), 1 => 2..4u64],
        prop_oneof![3 => Just(None), 1 => (0..3u64).prop_map(Some)],
        prop_oneof![2 => Just(vec![]), 1 => prop::collection::vec(deviation(), 1..4)],
        prop_oneof![3 => Just(false), 1 => Just(true)],
    )
        .prop_map(|(shape, scale, key, deviations, micro)| StepPlan { shape, scale, key, deviations, micro })
}

/// The allocations the harness holds in the planned phases: `(phase index, size)` by pointer.
struct Harness {
    rt: Runtime,
    streams: Vec<steppool::Stream>,
    /// A step-scoped and a micro-step-scoped planned phase, and a plain pool for contrast.
    phases: [Phase; 3],
    ranges: Ranges,
    live: HashMap<CUdeviceptr, (usize, usize, u64)>,
    /// Whether the device has virtual memory management: slabs are ranges, not pool allocations.
    vmm: bool,
}

impl Harness {
    fn new(max_plans: u32, signature_len: u32, vmm: bool) -> Self {
        let config = SimConfig { vmm_supported: vmm, ..SimConfig::with_capacity(16 * GIB) };
        let rt = Runtime::builder().simulated(config).checked(true).build().unwrap();
        let strategy = Allocation::Planned { max_plans, signature_len };
        let step = planned_phase(&rt, "planned", Scope::Step, strategy);
        let micro = planned_phase(&rt, "planned_micro", Scope::MicroStep, strategy);
        let streams = (0..2).map(|_| rt.device(0).unwrap().create_stream().unwrap()).collect();
        let phases = [step, micro, Phase::ACTIVATIONS];
        Self { rt, streams, phases, ranges: Ranges::default(), live: HashMap::new(), vmm }
    }

    fn alloc(&mut self, phase: usize, stream: usize, size: u64) -> Result<CUdeviceptr, TestCaseError> {
        // SAFETY: nothing runs on the device; pointers are freed or released by the harness.
        let ptr = unsafe { self.rt.raw().alloc(self.phases[phase], size, &self.streams[stream]) };
        let ptr = ptr.map_err(|error| TestCaseError::fail(format!("allocation of {size} failed: {error}")))?;
        prop_assert_eq!(ptr % 512, 0);
        self.ranges.insert(ptr, size).map_err(TestCaseError::fail)?;
        self.check_backed(phase, stream, ptr, size)?;
        self.live.insert(ptr, (phase, stream, size));
        Ok(ptr)
    }

    fn free(&mut self, ptr: CUdeviceptr) -> Result<(), TestCaseError> {
        // SAFETY: as above.
        unsafe { self.rt.raw().free(ptr) }.map_err(|error| TestCaseError::fail(error.to_string()))?;
        self.ranges.remove(ptr);
        self.live.remove(&ptr);
        Ok(())
    }

    /// The range lies in memory the pool has allocated from the device (the slab or its own), or,
    /// with virtual memory management, in pages mapped without a gap (a slab's range).
    fn check_backed(&self, phase: usize, stream: usize, ptr: CUdeviceptr, size: u64) -> Result<(), TestCaseError> {
        let pool = self.rt.pool_handle(self.phases[phase], &self.streams[stream]).unwrap().unwrap();
        let sim = self.rt.driver().sim().unwrap();
        let layout = sim.pool_layout(pool).unwrap();
        let in_pool = layout.allocations.iter().any(|&(base, len)| base <= ptr && ptr + size <= base + len);
        let mut mapped_to = ptr;
        for range in sim.mapped_ranges() {
            if range.base <= mapped_to && mapped_to < range.base + range.size {
                mapped_to = range.base + range.size;
            }
        }
        let in_range = self.vmm && mapped_to >= ptr + size;
        prop_assert!(
            in_pool || in_range,
            "{:#x}+{} is not inside an allocation of its pool or a mapped range",
            ptr,
            size
        );
        Ok(())
    }

    /// Every pool's `used` is exactly what the harness holds in it.
    fn check_used(&self) -> Result<(), TestCaseError> {
        for stats in self.rt.stats().unwrap() {
            let Some(phase) = self.phases.iter().position(|&p| p == stats.pool.phase) else { continue };
            let stream = self.streams.iter().position(|s| s.id() == stats.pool.stream).unwrap();
            let held: u64 =
                self.live.values().filter(|&&(ph, st, _)| ph == phase && st == stream).map(|&(_, _, size)| size).sum();
            prop_assert_eq!(stats.used, held, "phase {} stream {}", phase, stream);
            prop_assert!(stats.peak_used >= stats.used);
        }
        Ok(())
    }

    /// Runs a base program with deviations in `phase` on `stream`.
    fn run(
        &mut self,
        phase: usize,
        stream: usize,
        base: &[Base],
        deviations: &[Deviation],
    ) -> Result<(), TestCaseError> {
        let mut order: Vec<CUdeviceptr> = Vec::new();
        let mut base_allocations = 0;
        let mut deferred: Vec<CUdeviceptr> = Vec::new();
        for (at, op) in base.iter().enumerate() {
            for deviation in deviations {
                if let Deviation::Extra { at: when, size } = *deviation
                    && when == at
                {
                    order.push(self.alloc(phase, stream, size)?);
                }
            }
            match *op {
                Base::Alloc(size) => {
                    let index = base_allocations;
                    base_allocations += 1;
                    if deviations.iter().any(|d| matches!(*d, Deviation::Missing { at } if at == index)) {
                        continue;
                    }
                    let size = deviations
                        .iter()
                        .find_map(|d| match *d {
                            Deviation::Resize { at, size } if at == index => Some(size),
                            _ => None,
                        })
                        .unwrap_or(size);
                    let ptr = self.alloc(phase, stream, size)?;
                    order.push(ptr);
                }
                Base::Free(pick) => {
                    if order.is_empty() {
                        continue;
                    }
                    let mut victim = pick % order.len();
                    let mut late = None;
                    for deviation in deviations {
                        match *deviation {
                            Deviation::Reorder { at: when, pick } if when == at => victim = pick % order.len(),
                            Deviation::Late { at: when, never } if when == at => late = Some(never),
                            _ => {}
                        }
                    }
                    let ptr = order.remove(victim);
                    match late {
                        Some(true) => {}
                        Some(false) => deferred.push(ptr),
                        None => self.free(ptr)?,
                    }
                }
            }
            self.check_used()?;
        }
        for ptr in deferred {
            self.free(ptr)?;
        }
        Ok(())
    }

    /// Ends the step and checks what the boundary released and what the pools keep.
    fn end_step(&mut self) -> Result<(), TestCaseError> {
        // Micro-step phases released theirs at the micro-step ends (checked there).
        let expected: u64 = self.live.values().filter(|&&(phase, _, _)| phase != 1).map(|&(_, _, size)| size).sum();
        // SAFETY: nothing uses the released pointers.
        let report = unsafe { self.rt.raw().end_step() }.map_err(|error| TestCaseError::fail(error.to_string()))?;
        let released: u64 = report.pools.iter().filter(|p| p.pool.phase != self.phases[1]).map(|p| p.released).sum();
        prop_assert_eq!(released, expected);
        for ptr in std::mem::take(&mut self.live).into_keys() {
            self.ranges.remove(ptr);
        }
        for stats in &report.pools {
            prop_assert_eq!(stats.used, 0);
            if let Some(plan) = &stats.plan {
                // What the strategy holds in the pool after the boundary: the slab, nothing else.
                let stream = self.streams.iter().find(|s| s.id() == stats.pool.stream).unwrap();
                let pool = self.rt.pool_handle(stats.pool.phase, stream).unwrap().unwrap();
                let layout = self.rt.driver().sim().unwrap().pool_layout(pool).unwrap();
                let held: Vec<u64> = layout.allocations.iter().map(|&(_, size)| size).collect();
                // Without virtual memory management the slab is a pool allocation; with it, a
                // range whose mapped pages the pool does not hold.
                let slab: Vec<u64> = Some(plan.slab_bytes).filter(|&b| b > 0 && !self.vmm).into_iter().collect();
                prop_assert_eq!(held, slab);
                if self.vmm {
                    prop_assert_eq!(plan.slab_bytes % GRANULE, 0, "whole pages");
                }
                prop_assert!(plan.plans.len() <= 3);
                for summary in &plan.plans {
                    prop_assert!(summary.bytes >= summary.lower_bound);
                }
                let allocations = plan.planned + plan.unplanned;
                prop_assert_eq!(allocations, stats.allocations);
                prop_assert!(plan.deviations <= plan.unplanned);
                if let Some(free) = stats.free_space {
                    prop_assert_eq!(free.total_free, plan.slab_bytes, "an empty slab after the boundary");
                }
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_steps_with_random_deviations_never_overlap(
        shapes in prop::collection::vec(base_program(), 1..4),
        steps in prop::collection::vec(step_plan(3), 1..12),
        signature_len in 1u32..5,
        vmm in any::<bool>(),
    ) {
        let mut h = Harness::new(3, signature_len, vmm);
        let shapes: Vec<Vec<Base>> = shapes;
        for step in &steps {
            let shape: Vec<Base> = shapes[step.shape % shapes.len()]
                .iter()
                .map(|op| match *op {
                    Base::Alloc(size) => Base::Alloc(size * step.scale),
                    free => free,
                })
                .collect();
            let shape = &shape;
            h.rt.set_plan_key(h.phases[0], step.key).unwrap();
            h.rt.set_plan_key(h.phases[1], step.key).unwrap();
            h.rt.raw().begin_step().unwrap();
            // A pool-strategy allocation that lives through the step, between planned ones.
            h.alloc(2, 0, 3 * KIB)?;
            if step.micro {
                for micro in 0..2 {
                    h.rt.raw().begin_micro_step().unwrap();
                    h.run(1, micro % 2, shape, &step.deviations)?;
                    let expected: u64 = h.live.values().filter(|&&(p, _, _)| p == 1).map(|&(_, _, s)| s).sum();
                    // SAFETY: nothing uses the released pointers.
                    let report = unsafe { h.rt.raw().end_micro_step() }.unwrap();
                    prop_assert_eq!(report.released, expected);
                    let released: Vec<_> = h.live.iter().filter(|(_, v)| v.0 == 1).map(|(&p, _)| p).collect();
                    for ptr in released {
                        h.live.remove(&ptr);
                        h.ranges.remove(ptr);
                    }
                }
            }
            h.run(0, 0, shape, &step.deviations)?;
            h.run(0, 1, shape, &[])?;
            h.end_step()?;
        }
    }
}

/// A training loop whose steps hand memory to the next (a carrying planned phase): each step
/// copies its batch first (made before the step before's is freed), runs a random program of its
/// own allocations and frees, makes gradients at random places in it, left live at its end, and
/// frees the gradients the step before made at a random place, the same in every step (as
/// `zero_grad()` at one line of the loop) unless the step says otherwise.
#[derive(Clone, Debug)]
struct CarryingLoop {
    batch: u64,
    body: Vec<Base>,
    /// (position in the body, size) of each gradient.
    grads: Vec<(usize, u64)>,
    /// Where in the body the gradients carried in are freed (past its end: at the step's end).
    freed_at: usize,
    /// Per step, another place for that free.
    moved: Vec<Option<usize>>,
}

fn carrying_loop() -> impl Strategy<Value = CarryingLoop> {
    (
        prop_oneof![Just(0u64), 1..2 * MIB],
        base_program(),
        prop::collection::vec((0..40usize, alloc_size()), 1..6),
        0..44usize,
        prop::collection::vec(prop_oneof![6 => Just(None), 1 => (0..44usize).prop_map(Some)], 2..8),
    )
        .prop_map(|(batch, body, grads, freed_at, moved)| CarryingLoop { batch, body, grads, freed_at, moved })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn carrying_loops_never_overlap_and_carry_exactly_what_they_leave(
        program in carrying_loop(),
        vmm in any::<bool>(),
    ) {
        let rt = runtime_with(8 * GIB, vmm);
        let spec = PhaseSpec::new("step", Scope::Step).strategy(Allocation::PLANNED).carry(true);
        let phase = rt.declare_phase(spec).unwrap();
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        let raw = rt.raw();
        let mut ranges = Ranges::default();
        let alloc = |ranges: &mut Ranges, size: u64| -> Result<CUdeviceptr, TestCaseError> {
            // SAFETY: the phase and stream are the runtime's; every pointer is freed once below.
            let ptr = unsafe { raw.alloc(phase, size, &stream) }.map_err(|e| TestCaseError::fail(e.to_string()))?;
            ranges.insert(ptr, size).map_err(TestCaseError::fail)?;
            Ok(ptr)
        };
        let free = |ranges: &mut Ranges, ptr: CUdeviceptr| -> Result<(), TestCaseError> {
            ranges.remove(ptr);
            // SAFETY: handed out by `alloc` and not freed before.
            unsafe { raw.free(ptr) }.map_err(|e| TestCaseError::fail(e.to_string()))
        };
        // Live carried memory: (pointer, size).
        let mut batch: Option<(CUdeviceptr, u64)> = None;
        let mut grads: Vec<(CUdeviceptr, u64)> = Vec::new();
        for moved in &program.moved {
            raw.begin_step().unwrap();
            let freed_at = moved.unwrap_or(program.freed_at);
            let copied = (program.batch > 0).then(|| alloc(&mut ranges, program.batch)).transpose()?;
            if let Some((old, _)) = batch.take() {
                free(&mut ranges, old)?;
            }
            let mut own: Vec<CUdeviceptr> = Vec::new();
            let mut made = Vec::new();
            for (at, op) in program.body.iter().enumerate() {
                if at == freed_at {
                    for (g, _) in grads.drain(..) {
                        free(&mut ranges, g)?;
                    }
                }
                for &(_, size) in program.grads.iter().filter(|&&(when, _)| when == at) {
                    made.push((alloc(&mut ranges, size)?, size));
                }
                match *op {
                    Base::Alloc(size) => own.push(alloc(&mut ranges, size)?),
                    Base::Free(pick) if !own.is_empty() => {
                        let ptr = own.remove(pick % own.len());
                        free(&mut ranges, ptr)?;
                    }
                    Base::Free(_) => {}
                }
            }
            for ptr in own.drain(..) {
                free(&mut ranges, ptr)?;
            }
            for (g, _) in grads.drain(..) {
                free(&mut ranges, g)?;
            }
            for &(_, size) in program.grads.iter().filter(|&&(when, _)| when >= program.body.len()) {
                made.push((alloc(&mut ranges, size)?, size));
            }
            batch = copied.map(|ptr| (ptr, program.batch));
            grads = made;
            let carried: u64 = grads.iter().chain(&batch).map(|&(_, size)| size).sum();
            // SAFETY: nothing of the step is used after its end but what it carries.
            let report = unsafe { raw.end_step() }.map_err(|e| TestCaseError::fail(e.to_string()))?;
            let pool = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
            prop_assert_eq!((pool.used, pool.released), (carried, 0));
        }
    }
}

// ----- real training traces ---------------------------------------------------------------------

/// Reads `cli/tests/data/<name>.csv` (an RMM log of a real training run, kept in the repository)
/// through the trace model, with the step boundaries of its JSON sidecar.
fn read_trace(name: &str) -> Trace {
    let path = format!("{}/../cli/tests/data/{name}.csv", env!("CARGO_MANIFEST_DIR"));
    let trace = steppool_trace::read::read_trace(&path).expect("the training traces in cli/tests/data");
    assert!(matches!(trace.steps, StepSource::Sidecar(_)), "{path}: steps from {:?}", trace.steps);
    trace
}

/// Per step: peak live bytes of the step phase, its pool's peak reservation, and its plan numbers.
struct StepNumbers {
    peak_used: u64,
    peak_reserved: u64,
    plan: Option<PlanStats>,
    allocations: u64,
}

/// Replays a trace: allocations freed within their step go to a step-scoped phase of `strategy`,
/// the others to a persistent one. Checks that no hand-out overlaps a live allocation.
fn replay(name: &str, strategy: Allocation) -> Vec<StepNumbers> {
    let trace = read_trace(name);
    // Each event's step: events before the first boundary belong to step 0.
    let mut begun = 0usize;
    let steps: Vec<usize> = trace
        .events
        .iter()
        .map(|event| {
            begun += usize::from(matches!(event.kind, EventKind::StepBegin(_)));
            begun.saturating_sub(1)
        })
        .collect();
    // Which allocation events are freed in their own step.
    let mut open: HashMap<u64, usize> = HashMap::new();
    let mut freed_in_step = vec![false; trace.events.len()];
    for (index, event) in trace.events.iter().enumerate() {
        match event.kind {
            EventKind::Alloc => {
                open.insert(event.ptr, index);
            }
            EventKind::Free { .. } => {
                if let Some(at) = open.remove(&event.ptr) {
                    freed_in_step[at] = steps[at] == steps[index];
                }
            }
            _ => {}
        }
    }
    let rt = runtime(64 * GIB);
    let phase = rt.declare_phase(PhaseSpec::new("step", Scope::Step).strategy(strategy)).unwrap();
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let mut ranges = Ranges::default();
    let mut ours: HashMap<u64, CUdeviceptr> = HashMap::new();
    let mut numbers = Vec::new();
    let mut step = None;
    for (index, event) in trace.events.iter().enumerate() {
        if !matches!(event.kind, EventKind::Alloc | EventKind::Free { .. }) {
            continue;
        }
        let at = steps[index];
        if step != Some(at) {
            if step.is_some() {
                numbers.push(end_step(&rt, phase, &stream));
            }
            rt.raw().begin_step().unwrap();
            step = Some(at);
        }
        if event.kind == EventKind::Alloc {
            let target = if freed_in_step[index] { phase } else { Phase::WEIGHTS };
            // SAFETY: nothing runs on the device.
            let ptr = unsafe { rt.raw().alloc(target, event.bytes.max(1), &stream) }.unwrap();
            ranges.insert(ptr, event.bytes.max(1)).unwrap();
            ours.insert(event.ptr, ptr);
        } else if let Some(ptr) = ours.remove(&event.ptr) {
            ranges.remove(ptr);
            // SAFETY: as above.
            unsafe { rt.raw().free(ptr) }.unwrap();
        }
    }
    numbers.push(end_step(&rt, phase, &stream));
    numbers
}

fn end_step(rt: &Runtime, phase: Phase, stream: &steppool::Stream) -> StepNumbers {
    // A training loop synchronizes at least once a step (reading the loss); trimming at the
    // boundary only gives back memory whose frees the host has seen complete.
    stream.synchronize().unwrap();
    // SAFETY: nothing runs on the device.
    let report = unsafe { rt.raw().end_step() }.unwrap();
    let stats = report.pools.iter().find(|p| p.pool.phase == phase).unwrap();
    StepNumbers {
        peak_used: stats.peak_used,
        peak_reserved: stats.peak_reserved,
        plan: stats.plan.clone(),
        allocations: stats.allocations,
    }
}

fn print_comparison(name: &str, pool: &[StepNumbers], planned: &[StepNumbers]) {
    println!("{name}: step-scoped allocations, pool strategy vs planned (simulated device)");
    println!("step  allocs   peak live   pool resv  planned resv  resv/live  plan/bound  hit rate  deviations");
    for (index, (p, q)) in pool.iter().zip(planned).enumerate() {
        let plan = q.plan.as_ref().unwrap();
        println!(
            "{index:>4} {:>7} {:>11} {:>11} {:>13} {:>10.4} {:>11.4} {:>8.1}% {:>11}",
            q.allocations,
            q.peak_used,
            p.peak_reserved,
            q.peak_reserved,
            q.peak_reserved as f64 / q.peak_used.max(1) as f64,
            plan.overhead().unwrap_or(f64::NAN),
            plan.hit_rate() * 100.0,
            plan.deviations,
        );
    }
}

#[test]
fn a_static_training_trace_is_served_from_its_plan_from_the_second_step_on() {
    let pool = replay("vit_static_train", Allocation::Direct);
    let planned = replay("vit_static_train", Allocation::PLANNED);
    print_comparison("vit_static_train", &pool, &planned);
    // Step 0 builds the optimizer state and differs; step 1 deviates from it and refreshes the
    // plan; from step 2 on every allocation is served from the plan.
    for numbers in &planned[2..] {
        let plan = numbers.plan.as_ref().unwrap();
        assert_eq!((plan.unplanned, plan.deviations, plan.missing), (0, 0, 0));
        assert_eq!(plan.planned, numbers.allocations);
        assert_eq!(numbers.peak_reserved, plan.slab_bytes.next_multiple_of(2 * MIB));
    }
}

#[test]
fn a_variable_length_training_trace_gets_a_plan_per_shape() {
    let pool = replay("t5_varlen_train", Allocation::Direct);
    let planned = replay("t5_varlen_train", Allocation::PLANNED);
    print_comparison("t5_varlen_train", &pool, &planned);
    let last = planned.last().unwrap().plan.as_ref().unwrap();
    assert!(last.plans.len() >= 2, "sequence lengths vary: {:?}", last.plans.len());
}

// ----- whole-run reservations on hand-written training patterns ----------------------------------

/// One operation of a hand-written training program.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// Allocation `id` of `bytes`, persistent (never freed) or freed within its step.
    Alloc {
        id: usize,
        bytes: u64,
        persistent: bool,
    },
    Free(usize),
    BeginStep,
    EndStep,
    BeginMicro,
    EndMicro,
}

/// A program's numbers under one layout: the device's peak reservation over the whole run, from
/// the second step on, and from a later step on (once every shape has been seen).
#[derive(Debug)]
struct Reserved {
    whole: u64,
    steady: u64,
    settled: u64,
}

/// How a program is laid out: one plain pool, or steppool's best strategy (persistent allocations
/// chunked, every step- and micro-step-scoped allocation in one planned step phase), as
/// `steppool replay` lays them out.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    DefaultPool,
    Planned,
}

fn run_program(program: &[Op], layout: Layout, settled_from: u32, vmm: bool) -> Reserved {
    let rt = runtime_with(64 * GIB, vmm);
    let (persistent, step_phase) = match layout {
        Layout::DefaultPool => {
            let pool = rt.declare_phase(PhaseSpec::new("default", Scope::Persistent)).unwrap();
            (pool, pool)
        }
        Layout::Planned => (
            rt.declare_phase(
                PhaseSpec::new("persistent", Scope::Persistent)
                    .strategy(Allocation::Chunked { chunk_bytes: persistent_chunk(program) }),
            )
            .unwrap(),
            planned_phase(&rt, "step", Scope::Step, Allocation::PLANNED),
        ),
    };
    let device = rt.device(0).unwrap();
    let stream = device.create_stream().unwrap();
    let mut ptrs: HashMap<usize, CUdeviceptr> = HashMap::new();
    let mut ranges = Ranges::default();
    let (mut whole, mut steady, mut settled, mut steps) = (0u64, 0u64, 0u64, 0u32);
    let mut sample = |steps: u32| {
        let (free, capacity) = device.memory_info().unwrap();
        whole = whole.max(capacity - free);
        if steps >= 1 {
            steady = steady.max(capacity - free);
        }
        if steps >= settled_from {
            settled = settled.max(capacity - free);
        }
    };
    for &op in program {
        match op {
            Op::Alloc { id, bytes, persistent: p } => {
                let phase = if p { persistent } else { step_phase };
                // SAFETY: nothing runs on the simulated device.
                let ptr = unsafe { rt.raw().alloc(phase, bytes, &stream) }.unwrap();
                ranges.insert(ptr, bytes).unwrap();
                ptrs.insert(id, ptr);
                sample(steps);
            }
            Op::Free(id) => {
                let ptr = ptrs.remove(&id).unwrap();
                ranges.remove(ptr);
                // SAFETY: as above.
                unsafe { rt.raw().free(ptr) }.unwrap();
            }
            Op::BeginStep => drop(rt.raw().begin_step().unwrap()),
            Op::BeginMicro => drop(rt.raw().begin_micro_step().unwrap()),
            Op::EndMicro => {
                // SAFETY: as above.
                unsafe { rt.raw().end_micro_step() }.unwrap();
                sample(steps);
            }
            Op::EndStep => {
                device.synchronize().unwrap();
                // SAFETY: as above.
                unsafe { rt.raw().end_step() }.unwrap();
                sample(steps);
                steps += 1;
            }
        }
    }
    Reserved { whole, steady, settled }
}

/// The chunk `steppool replay` gives a persistent phase: a sixteenth of its bytes, rounded up to
/// the 2 MiB granule, between 2 MiB and 64 MiB (`replay::default_chunk`).
fn persistent_chunk(program: &[Op]) -> u64 {
    let bytes: u64 =
        program.iter().map(|op| if let Op::Alloc { bytes, persistent: true, .. } = op { *bytes } else { 0 }).sum();
    (bytes / 16).next_multiple_of(2 * MIB).clamp(2 * MIB, 64 * MIB)
}

/// The limit: the offline packing of the whole program with perfect foresight.
fn program_limit(program: &[Op]) -> u64 {
    use steppool_trace::packing::{self, Block};
    let mut blocks = Vec::new();
    let mut index: HashMap<usize, usize> = HashMap::new();
    for (position, &op) in program.iter().enumerate() {
        match op {
            Op::Alloc { id, bytes, .. } => {
                index.insert(id, blocks.len());
                blocks.push(Block {
                    size: bytes.next_multiple_of(512),
                    start: position as u32,
                    end: Block::NEVER_FREED,
                });
            }
            Op::Free(id) => blocks[index[&id]].end = position as u32,
            _ => {}
        }
    }
    packing::pack(&blocks).size
}

/// Builds programs: ids are handed out in order.
#[derive(Default)]
struct Program {
    ops: Vec<Op>,
    next: usize,
}

impl Program {
    fn alloc(&mut self, bytes: u64, persistent: bool) -> usize {
        let id = self.next;
        self.next += 1;
        self.ops.push(Op::Alloc { id, bytes, persistent });
        id
    }

    fn free(&mut self, id: usize) {
        self.ops.push(Op::Free(id));
    }

    /// A forward and backward pass: per layer an activation kept for the backward pass (`act`
    /// bytes, a little more per layer) and a scratch buffer freed at once; the backward pass frees
    /// them in reverse with a scratch buffer each.
    fn pass(&mut self, layers: u64, act: u64, backward: bool) {
        let mut kept = Vec::new();
        for layer in 0..layers {
            let scratch = self.alloc(act * 2 + layer * 4 * KIB, false);
            kept.push(self.alloc(act + layer * 12 * KIB, false));
            self.free(scratch);
        }
        while let Some(activation) = kept.pop() {
            if backward {
                let scratch = self.alloc(act + 3 * KIB, false);
                self.free(scratch);
            }
            self.free(activation);
        }
    }

    /// Weights of `layers` layers: a 2.25 MiB matrix and three of 0.5625 MiB each, as a ViT's.
    fn weights(&mut self, layers: u64) -> Vec<(usize, u64)> {
        let mut weights = Vec::new();
        for _ in 0..layers {
            for bytes in [9 * MIB / 4, 9 * MIB / 16, 9 * MIB / 16, 9 * MIB / 16] {
                weights.push((self.alloc(bytes, true), bytes));
            }
        }
        weights
    }
}

/// Checks the planned layout against one plain pool and the limit: below the pool over the whole
/// run and from the second step on, and from step `settled_from` on (every shape seen once)
/// within `within` of the limit plus one 2 MiB granule. A shape's first step is served online
/// (best fit in the slab's free space and in chunks), which the bound does not cover.
/// Returns the limit and the planned layout's reservations.
/// Checks `program` laid out as `replay` lays out `planned` against one pool and the limit, on a
/// device with virtual memory management (slabs that grow in place) and on one without (pool
/// slabs); returns the limit and the planned numbers of each, in that order.
fn check_against_limit(name: &str, program: &Program, settled_from: u32, within: f64) -> (u64, [Reserved; 2]) {
    check_against(name, program, settled_from, within, Against::WholeRun)
}

/// Over which steps the planned layout must reserve less than one pool.
#[derive(Clone, Copy, PartialEq)]
enum Against {
    /// The whole run and from the second step on.
    WholeRun,
    /// Only from the settled step on (with virtual memory management; pool slabs still over the
    /// whole run).
    Settled,
}

/// [`check_against_limit`], comparing with one pool over the steps `against` names.
fn check_against(
    name: &str,
    program: &Program,
    settled_from: u32,
    within: f64,
    against: Against,
) -> (u64, [Reserved; 2]) {
    let limit = program_limit(&program.ops);
    let check = |vmm: bool| {
        let pool = run_program(&program.ops, Layout::DefaultPool, settled_from, vmm);
        let planned = run_program(&program.ops, Layout::Planned, settled_from, vmm);
        let ratio = |bytes: u64| bytes as f64 / limit as f64;
        let device = if vmm { "ranges" } else { "pool slabs" };
        println!(
            "{name} ({device}): limit {:.1} MiB; over it: default pool whole {:.3} steady {:.3}; \
             planned whole {:.3} steady {:.3} from step {settled_from} {:.3}",
            limit as f64 / MIB as f64,
            ratio(pool.whole),
            ratio(pool.steady),
            ratio(planned.whole),
            ratio(planned.steady),
            ratio(planned.settled),
        );
        if vmm && against == Against::Settled {
            assert!(planned.settled < pool.settled, "{name} ({device}): planned {planned:?} vs one pool {pool:?}");
        } else {
            assert!(planned.whole < pool.whole, "{name} ({device}): planned {planned:?} vs one pool {pool:?}");
            assert!(planned.steady < pool.steady, "{name} ({device}): planned {planned:?} vs one pool {pool:?}");
        }
        assert!(
            planned.settled as f64 <= within * limit as f64 + (2 * MIB) as f64,
            "{name} ({device}): from step {settled_from}, {} is over {within} × the limit {limit} + 2 MiB",
            planned.settled
        );
        planned
    };
    (limit, [check(true), check(false)])
}

#[test]
fn gradient_accumulation_is_planned_as_one_step_with_its_micro_steps() {
    let mut program = Program::default();
    let weights = program.weights(12);
    let mut moments = Vec::new();
    for step in 0..6 {
        program.ops.push(Op::BeginStep);
        // Gradients live across the micro-steps, freed after the optimizer update.
        let grads: Vec<usize> = weights.iter().map(|&(_, bytes)| program.alloc(bytes, false)).collect();
        for _ in 0..4 {
            program.ops.push(Op::BeginMicro);
            program.pass(12, 3 * MIB, true);
            program.ops.push(Op::EndMicro);
        }
        if step == 0 {
            for &(_, bytes) in &weights {
                moments.push(program.alloc(bytes, true));
                moments.push(program.alloc(bytes, true));
            }
        }
        for grad in grads {
            program.free(grad);
        }
        program.ops.push(Op::EndStep);
    }
    check_against_limit("accumulation", &program, 1, 1.08);
}

#[test]
fn an_eval_pass_between_training_steps_gets_its_own_plan() {
    let mut program = Program::default();
    let weights = program.weights(12);
    for step in 0..9 {
        program.ops.push(Op::BeginStep);
        if step % 3 == 2 {
            // Evaluation: a forward pass at a larger batch, no gradients, no backward.
            let input = program.alloc(5 * MIB, false);
            program.pass(12, 5 * MIB, false);
            program.free(input);
        } else {
            let input = program.alloc(3 * MIB, false);
            program.pass(12, 3 * MIB, true);
            let grads: Vec<usize> = weights.iter().map(|&(_, bytes)| program.alloc(bytes, false)).collect();
            for grad in grads {
                program.free(grad);
            }
            program.free(input);
        }
        program.ops.push(Op::EndStep);
    }
    // The first evaluation (step 2) is a new shape; from step 3 on both have plans.
    check_against_limit("eval passes", &program, 3, 1.08);
}

#[test]
fn a_first_step_larger_than_the_rest_does_not_keep_its_memory() {
    let mut program = Program::default();
    let weights = program.weights(12);
    for step in 0..6 {
        program.ops.push(Op::BeginStep);
        // The first step runs at a larger batch (a warm-up, a routing imbalance) before the
        // optimizer state exists; the optimizer state then takes what it gave back.
        let act = if step == 0 { 6 * MIB } else { 3 * MIB };
        program.pass(12, act, true);
        if step == 0 {
            for &(_, bytes) in &weights {
                program.alloc(bytes, true);
                program.alloc(bytes, true);
            }
        }
        program.ops.push(Op::EndStep);
    }
    // Step 1, a new shape, is served online, best fit in 2 MiB pages; its plan serves the later
    // steps from step 2 on. One pool of the driver's 32 MiB units packs this program at 1.040×
    // the limit over the whole run; the plan holds 1.073× in step 1 (12 MiB of pages that its
    // scattered online placement leaves partly used) and 1.008× from step 2 on, so it is held
    // below one pool from there.
    check_against("first step larger", &program, 2, 1.08, Against::Settled);
}

#[test]
fn generated_variable_length_traces_stay_near_the_limit() {
    for seed in [3, 7, 11] {
        let mut program = Program::default();
        program.weights(16);
        let mut state: u64 = seed;
        let mut lengths = Vec::new();
        for _ in 0..12 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Sequence lengths of a quarter to all of the longest, in eight buckets (as a loader
            // that pads to a multiple of a block does).
            let bucket = 2 + (state >> 33) % 7;
            lengths.push(bucket);
            program.ops.push(Op::BeginStep);
            program.pass(16, MIB * bucket / 2, true);
            program.ops.push(Op::EndStep);
        }
        // Once the longest length has been seen, its plan sizes the slab for every shorter one.
        let longest = lengths.iter().copied().max().unwrap();
        let settled_from = lengths.iter().position(|&length| length == longest).unwrap() as u32 + 1;
        check_against_limit(&format!("variable lengths, seed {seed}"), &program, settled_from, 1.08);
    }
}

/// A trace's allocations as a program: scopes from the trace's lifetimes, as `steppool replay`
/// infers them (persistent when made outside a step or never freed in it).
fn trace_program(name: &str) -> Program {
    let trace = read_trace(name);
    let analysis = steppool_trace::analysis::analyse(&trace).unwrap();
    assert_eq!(analysis.streams.len(), 1, "{name}: one stream");
    let mut program = Program::default();
    for &(_, op) in &analysis.ops {
        use steppool_trace::analysis::Op as TraceOp;
        program.ops.push(match op {
            TraceOp::Alloc(id) => {
                let allocation = &analysis.allocations[id as usize];
                let persistent = allocation.scope == Scope::Persistent;
                Op::Alloc { id: id as usize, bytes: allocation.bytes, persistent }
            }
            TraceOp::Free(id) => Op::Free(id as usize),
            TraceOp::BeginStep => Op::BeginStep,
            TraceOp::EndStep => Op::EndStep,
            TraceOp::BeginMicro => Op::BeginMicro,
            TraceOp::EndMicro => Op::EndMicro,
        });
    }
    program
}

#[test]
fn the_shared_training_traces_stay_near_the_limit_from_the_second_step() {
    // ViT, static shapes: from the second step on, 1.013 × the limit on ranges that grow in place
    // (178 MiB for 175.8), 1.047 on pool slabs (184 MiB: the persistent chunks' tails and the
    // slab's rounding). The target is 1.03 plus a granule; guarded at 1.05 against regressions.
    let (limit, planned) = check_against_limit("vit_static_train", &trace_program("vit_static_train"), 1, 1.05);
    // The recording step gives back what it freed as the gradients and optimizer state arrive
    // (its free pages on ranges, its emptied chunks on pool slabs), so it reserves no more than
    // the steps after it (it was 1.183 × the limit when the chunks stayed until the step's end).
    for planned in &planned {
        assert!(
            planned.whole as f64 <= 1.05 * limit as f64 + (2 * MIB) as f64,
            "vit_static_train: the whole run's {} is over 1.05 × the limit {limit} + 2 MiB",
            planned.whole
        );
    }
    // T5, variable lengths: step 4 is a new, largest shape served online; within 8 %.
    check_against_limit("t5_varlen_train", &trace_program("t5_varlen_train"), 1, 1.08);
}

/// One step of the bin test: a 4 MiB buffer and a quarter MiB one, both live at the step's peak.
/// Returns the quarter MiB buffer's address and the bytes mapped at the peak.
fn bin_step(rt: &Runtime, phase: Phase, stream: &steppool::Stream) -> (CUdeviceptr, u64) {
    let step = rt.begin_step().unwrap();
    let large = step.alloc(phase, 4 * MIB, stream).unwrap();
    let small = step.alloc(phase, 256 * KIB, stream).unwrap();
    let (at, peak) = (small.ptr(), mapped(rt));
    drop((small, large));
    step.end().unwrap();
    (at, peak)
}

/// A persistent phase that packs its allocations in one range grown in place: the lender of the
/// bin tests.
fn params_phase(rt: &Runtime) -> Phase {
    rt.declare_phase(
        PhaseSpec::new("params", Scope::Persistent).strategy(Allocation::Chunked { chunk_bytes: 16 * MIB }),
    )
    .unwrap()
}

#[test]
fn a_persistent_pool_lends_the_end_of_its_last_page_to_the_plans_of_its_stream() {
    let rt = runtime(GIB);
    let weights = params_phase(&rt);
    let phase = planned_phase(&rt, "step", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    // 3.5 MiB of weights: two pages, the second half used.
    let first = rt.alloc(weights, 7 * MIB / 2, &stream).unwrap();
    let base = first.ptr();
    // The first step is recorded: 4.25 MiB, three pages of the step's own range beside the two.
    let (at, peak) = bin_step(&rt, phase, &stream);
    assert!(!(base..base + 4 * MIB).contains(&at));
    assert_eq!(peak, 4 * MIB + 6 * MIB);
    // From the second step on, the plan's quarter MiB past 4 MiB is served in the free half
    // page of the weights: two pages of the step's range, not three.
    for _ in 0..2 {
        let (at, peak) = bin_step(&rt, phase, &stream);
        assert_eq!(at, base + 7 * MIB / 2, "in the weights' last page");
        assert_eq!(peak, 4 * MIB + 4 * MIB);
        let plan = pool_stats(&rt, phase, &stream).plan.unwrap();
        assert_eq!((plan.planned, plan.deviations), (2, 0));
        assert_eq!((plan.slab_bytes, plan.bin_bytes), (4 * MIB, MIB / 2), "the step's two pages and the lent half");
    }
    // Weights that come while the loan lasts go past it; the next step borrows the new end of
    // their last page, and the first loan is free for the weights again.
    let step = rt.begin_step().unwrap();
    let second = rt.alloc(weights, 7 * MIB / 4, &stream).unwrap();
    assert_eq!(second.ptr(), base + 4 * MIB);
    step.end().unwrap();
    let (at, peak) = bin_step(&rt, phase, &stream);
    assert_eq!(at, base + 4 * MIB + 7 * MIB / 4, "the end of the third page: a quarter MiB");
    assert_eq!(peak, 6 * MIB + 4 * MIB);
    let third = rt.alloc(weights, MIB / 2, &stream).unwrap();
    assert_eq!(third.ptr(), base + 7 * MIB / 2, "the first loan came back");
    // The weights go before the step's pool: the loan goes back with it, and nothing is lost.
    drop((first, second, third));
    drop(stream);
    assert!(rt.take_errors().is_empty());
}

#[test]
fn an_automatic_phase_that_chose_the_plan_borrows_the_bin_too() {
    let rt = runtime(GIB);
    let params = params_phase(&rt);
    let phase = planned_phase(&rt, "step", Scope::Step, Allocation::Auto);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let weights = rt.alloc(params, 7 * MIB / 2, &stream).unwrap();
    let mut small_at = Vec::new();
    for _ in 0..4 {
        // Three 2.25 MiB buffers, the first freed and its memory reused by a fourth, then 1.25
        // and 0.25 MiB: 8.25 MiB live at the peak. A pool takes a 4 MiB segment per 2.25 MiB
        // buffer (12 MiB), an arena cannot reuse the first's memory, a plan packs five pages;
        // with the bin, four.
        let step = rt.begin_step().unwrap();
        let alloc = |quarters: u64| step.alloc(phase, quarters * MIB / 4, &stream).unwrap();
        let first = alloc(9);
        let kept = [alloc(9), alloc(9)];
        drop(first);
        let rest = [alloc(9), alloc(5), alloc(1)];
        small_at.push(rest[2].ptr());
        drop((kept, rest));
        step.end().unwrap();
    }
    let stats = pool_stats(&rt, phase, &stream);
    assert_eq!(stats.chosen, Some(Allocation::PLANNED));
    assert_eq!(stats.plan.unwrap().bin_bytes, MIB / 2);
    assert_eq!(*small_at.last().unwrap(), weights.ptr() + 7 * MIB / 2, "served in the weights' last page");
}

/// One op of a step in the bin property test.
#[derive(Clone, Debug)]
enum BinOp {
    /// A step allocation of this many 64 KiB units.
    Step(u64),
    /// Frees the step allocation picked by this index among the live ones.
    FreeStep(usize),
    /// A persistent allocation of this many 64 KiB units.
    Persistent(u64),
    /// Frees the persistent allocation picked by this index among the live ones.
    FreePersistent(usize),
}

fn bin_op() -> impl Strategy<Value = BinOp> {
    prop_oneof![
        6 => (1u64..48).prop_map(BinOp::Step),
        3 => any::<usize>().prop_map(BinOp::FreeStep),
        1 => (1u64..48).prop_map(BinOp::Persistent),
        1 => any::<usize>().prop_map(BinOp::FreePersistent),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// A persistent `Chunked` phase lends the end of its last page to a planned phase on the same
    /// stream while both allocate and free at random, steps repeating one of a few shapes: no
    /// hand-out of either ever overlaps a live one of the other, every one lies in mapped pages,
    /// and nothing is left mapped once the runtime is gone.
    #[test]
    fn a_page_lent_between_a_persistent_pool_and_a_plan_is_never_handed_out_twice(
        shapes in prop::collection::vec(prop::collection::vec(bin_op(), 1..30), 1..3),
        order in prop::collection::vec(0usize..8, 2..12),
    ) {
        let driver = steppool::sys::Driver::simulated(SimConfig::with_capacity(4 * GIB)).unwrap();
        let rt = Runtime::with_driver(driver.clone()).unwrap();
        let persistent = rt
            .declare_phase(PhaseSpec::new("params", Scope::Persistent).strategy(Allocation::Chunked { chunk_bytes: 8 * MIB }))
            .unwrap();
        let step_phase = planned_phase(&rt, "step", Scope::Step, Allocation::PLANNED);
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        let sim = driver.sim().expect("a simulated driver");
        let mut ranges = Ranges::default();
        let mut kept: Vec<(CUdeviceptr, u64)> = Vec::new();
        let unit = 64 * KIB;
        let mapped = |ptr: CUdeviceptr, size: u64| {
            let mut to = ptr;
            for range in sim.mapped_ranges() {
                if range.base <= to && to < range.base + range.size {
                    to = range.base + range.size;
                }
            }
            to >= ptr + size
        };
        // Weights first, so there is a last page to lend from the first step on.
        // SAFETY: nothing runs on the device; every pointer is freed or released below.
        let first = unsafe { rt.raw().alloc(persistent, 5 * unit, &stream) }.unwrap();
        ranges.insert(first, 5 * unit).map_err(TestCaseError::fail)?;
        kept.push((first, 5 * unit));
        for &pick in &order {
            let ops = &shapes[pick % shapes.len()];
            rt.raw().begin_step().unwrap();
            let mut live: Vec<(CUdeviceptr, u64)> = Vec::new();
            for op in ops {
                match *op {
                    BinOp::Step(units) | BinOp::Persistent(units) => {
                        let phase = if matches!(op, BinOp::Step(_)) { step_phase } else { persistent };
                        // SAFETY: as above.
                        let ptr = unsafe { rt.raw().alloc(phase, units * unit, &stream) }.unwrap();
                        ranges.insert(ptr, units * unit).map_err(TestCaseError::fail)?;
                        prop_assert!(mapped(ptr, units * unit), "{:#x}+{} is not mapped", ptr, units * unit);
                        if matches!(op, BinOp::Step(_)) {
                            live.push((ptr, units * unit));
                        } else {
                            kept.push((ptr, units * unit));
                        }
                    }
                    BinOp::FreeStep(pick) | BinOp::FreePersistent(pick) => {
                        let list = if matches!(op, BinOp::FreeStep(_)) { &mut live } else { &mut kept };
                        if list.is_empty() {
                            continue;
                        }
                        let (ptr, _) = list.swap_remove(pick % list.len());
                        // SAFETY: as above.
                        unsafe { rt.raw().free(ptr) }.unwrap();
                        ranges.remove(ptr);
                    }
                }
            }
            // SAFETY: the step's pointers are not used after its end releases them.
            unsafe { rt.raw().end_step() }.unwrap();
            for (ptr, _) in live {
                ranges.remove(ptr);
            }
        }
        for (ptr, _) in kept {
            // SAFETY: as above.
            unsafe { rt.raw().free(ptr) }.unwrap();
        }
        drop(stream);
        drop(rt);
        prop_assert!(sim.mapped_ranges().is_empty(), "pages left mapped: {:?}", sim.mapped_ranges());
    }
}

#[test]
fn steps_of_varying_length_map_pages_only_when_one_outgrows_the_recent_ones() {
    // A training loop whose sequence length changes every step, as a forward pass allocates and
    // frees its activations. Each step is a new shape, served online in the growable range. The
    // range keeps its pages for the largest of the recent steps, so a step no longer than one of
    // the last eight makes no call that maps or unmaps a page, in the step or at its end: on a GPU
    // each page costs some 50 µs to map and unmap again.
    let config = SimConfig { count_calls: true, ..SimConfig::with_capacity(80 * GIB) };
    let rt = Runtime::builder().simulated(config).build().unwrap();
    let acts = planned_phase(&rt, "forward", Scope::Step, Allocation::PLANNED);
    let stream = rt.device(0).unwrap().create_stream().unwrap();
    let sim = rt.driver().sim().unwrap();
    let calls = || ["cuMemMap", "cuMemUnmap"].map(|call| sim.calls(call));
    let lengths =
        [469u64, 202, 295, 533, 709, 252, 861, 914, 163, 175, 166, 434, 613, 133, 152, 992, 715, 806, 208, 456];
    let mut quiet = 0;
    for (index, &length) in lengths.iter().enumerate() {
        let before = calls();
        let step = rt.begin_step().unwrap();
        let mut live = Vec::new();
        for _layer in 0..8 {
            for k in 0..12u64 {
                live.push(step.alloc(acts, length * (k % 5 + 1) * 96 * KIB, &stream).unwrap());
                if k % 3 == 2 {
                    live.remove(live.len() - 2);
                }
            }
        }
        while live.pop().is_some() {}
        drop(live);
        let report = step.end().unwrap();
        // The report's page traffic says the same as the driver's calls.
        let pages = report.phases.iter().find(|p| p.phase == acts).unwrap().pages;
        let [maps, unmaps] = [0, 1].map(|i| calls()[i] - before[i]);
        assert_eq!((pages.mapped > 0, pages.unmapped > 0), (maps > 0, unmaps > 0), "step {index}: {pages:?}");
        if index == 0 {
            assert!(pages.mapped >= length * 96 * KIB, "the first step maps its pages: {pages:?}");
        }
        let recent = &lengths[index.saturating_sub(8)..index];
        if recent.iter().any(|&earlier| earlier >= length) {
            assert_eq!(calls(), before, "step {index} (length {length}) after {recent:?}");
            quiet += 1;
        }
    }
    assert!(quiet >= 12, "{quiet} steps no longer than a recent one");
}
