//! The runtime under driver faults: random programs of steps, micro-steps and raw allocations on
//! two streams, over every strategy, with the simulated device failing calls at random (and, in
//! some programs, a sticky error part-way). After every operation: every error is typed and a
//! driver error names its entry point; live allocations never overlap; each phase's `used` is
//! exactly what the program holds; once the runtime has returned a sticky error, every later
//! operation returns it. At the end, with faults off, dropping the runtime gives every byte back
//! to the simulated device (unless a sticky error lost the context, as it would on a GPU).

use std::collections::BTreeMap;

use proptest::prelude::*;
use steppool::sys::sim::{FaultCode, FaultPlan, SimConfig};
use steppool::sys::{CUdeviceptr, Driver, DriverError};
use steppool::{Error, Phase, PhaseSpec, Runtime, Scope, Strategy as Allocation};

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 2 << 30;

/// One operation of a program.
#[derive(Clone, Debug)]
enum Op {
    /// Allocate `bytes` in phase `phase` (an index into the harness's phases) on stream `stream`.
    Alloc {
        phase: usize,
        stream: usize,
        bytes: u64,
    },
    /// Free a live allocation, picked by this number modulo how many are live.
    Free(usize),
    BeginStep,
    EndStep,
    BeginMicro,
    EndMicro,
    /// From here on, the next driver call fails with a sticky error.
    Sticky,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..5, 0usize..2, 1u64..48 * MIB).prop_map(|(phase, stream, bytes)| Op::Alloc { phase, stream, bytes }),
        4 => any::<usize>().prop_map(Op::Free),
        2 => Just(Op::BeginStep),
        2 => Just(Op::EndStep),
        1 => Just(Op::BeginMicro),
        1 => Just(Op::EndMicro),
    ]
}

/// A live raw allocation as the program knows it.
#[derive(Clone, Copy, Debug)]
struct Live {
    ptr: CUdeviceptr,
    bytes: u64,
    phase: usize,
}

/// The phases, by index: their ids and scopes.
struct Phases {
    ids: Vec<Phase>,
    scopes: Vec<Scope>,
}

fn declare(rt: &Runtime) -> Phases {
    let specs = [
        PhaseSpec::new("persistent_direct", Scope::Persistent),
        PhaseSpec::new("persistent_chunked", Scope::Persistent).strategy(Allocation::Chunked { chunk_bytes: 32 * MIB }),
        PhaseSpec::new("step_direct", Scope::Step),
        PhaseSpec::new("step_planned", Scope::Step).strategy(Allocation::PLANNED),
        PhaseSpec::new("micro_arena", Scope::MicroStep).strategy(Allocation::Arena { slab_bytes: 64 * MIB }),
    ];
    let scopes = specs.iter().map(|spec| spec.scope).collect();
    let ids = specs.into_iter().map(|spec| rt.declare_phase(spec).unwrap()).collect();
    Phases { ids, scopes }
}

/// Whether `error` is one the runtime may return here, typed, and (for a driver error) naming
/// the entry point that failed.
fn check_typed(error: &Error) -> Result<(), TestCaseError> {
    match error {
        Error::Driver(DriverError::Call { call, .. }) => {
            prop_assert!(call.starts_with("cu"), "a driver error names its call: {error}");
        }
        Error::OutOfMemory(_)
        | Error::NoActiveStep
        | Error::NoActiveMicroStep
        | Error::StepActive { .. }
        | Error::MicroStepActive { .. } => {}
        other => prop_assert!(false, "an error a faulty driver should not cause: {other:?} ({other})"),
    }
    Ok(())
}

/// The code of a sticky driver error.
fn sticky_code(error: &Error) -> Option<steppool::sys::CUresult> {
    match error {
        Error::Driver(driver) if driver.is_sticky() => driver.code(),
        _ => None,
    }
}

/// Bytes device 0 holds in all (total − free), read through its primary context once every
/// runtime on it is gone.
fn reserved(driver: &Driver) -> u64 {
    let ordinal = driver.device(0).unwrap();
    let ctx = driver.primary_context_retain(ordinal).unwrap();
    // SAFETY: the context was just retained.
    unsafe { driver.context_set_current(ctx) }.unwrap();
    let (free, total) = driver.mem_get_info().unwrap();
    // SAFETY: balances the retain above.
    unsafe { driver.primary_context_release(ordinal) }.unwrap();
    total - free
}

/// What a run saw.
#[derive(Debug, Default)]
struct Seen {
    /// Whether a sticky error lost the context.
    lost: bool,
    /// Faults the simulated device injected.
    faults: u64,
    /// Driver errors the runtime returned.
    driver_errors: u64,
}

/// Runs `ops` with faults at `rate` from `seed`, on a device with or without (`vmm`) virtual
/// memory management (slabs, chunks and arenas as ranges of mapped pages, or pool allocations).
fn run(ops: &[Op], seed: u64, rate: f64, vmm: bool) -> Result<Seen, TestCaseError> {
    let driver = Driver::simulated(SimConfig { vmm_supported: vmm, ..SimConfig::with_capacity(CAPACITY) }).unwrap();
    let sim = driver.sim().expect("a simulated driver");
    let rt = Runtime::with_driver(driver.clone()).unwrap();
    let phases = declare(&rt);
    let device = rt.device(0).unwrap();
    let streams = [device.create_stream().unwrap(), device.create_stream().unwrap()];
    sim.set_faults(Some(FaultPlan::random(seed, rate)));

    let mut live: Vec<Live> = Vec::new();
    let mut driver_errors = 0;
    let (mut in_step, mut in_micro) = (false, false);
    // The sticky error the runtime returned, once it did.
    let mut lost: Option<steppool::sys::CUresult> = None;
    for op in ops {
        let outcome: Result<(), Error> = match *op {
            Op::Alloc { phase, stream, bytes } => {
                // SAFETY: nothing runs on the device; the runtime releases what a boundary ends.
                match unsafe { rt.raw().alloc(phases.ids[phase], bytes, &streams[stream]) } {
                    Ok(ptr) => {
                        live.push(Live { ptr, bytes, phase });
                        Ok(())
                    }
                    Err(error) => Err(error),
                }
            }
            Op::Free(pick) => {
                if live.is_empty() {
                    continue;
                }
                let freed = live.swap_remove(pick % live.len());
                // A failed free is still a free: the runtime owes it to the driver.
                // SAFETY: nothing uses the memory.
                unsafe { rt.raw().free(freed.ptr) }
            }
            Op::BeginStep => rt.raw().begin_step().map(|_| in_step = true),
            Op::BeginMicro => rt.raw().begin_micro_step().map(|_| in_micro = true),
            // SAFETY: nothing uses the released pointers.
            Op::EndMicro => unsafe { rt.raw().end_micro_step() }.map(drop),
            // SAFETY: as above.
            Op::EndStep => unsafe { rt.raw().end_step() }.map(drop),
            Op::Sticky => {
                sim.set_faults(Some(FaultPlan::nth(1, FaultCode::IllegalAddress)));
                continue;
            }
        };
        // A boundary ends its scope even when its release fails (but not once refused for a
        // lost context): what it released is gone either way.
        let refused_as_lost = outcome.as_ref().err().and_then(sticky_code).is_some() && lost.is_some();
        match op {
            Op::EndMicro if in_micro && !refused_as_lost => {
                in_micro = false;
                live.retain(|l| phases.scopes[l.phase] != Scope::MicroStep);
            }
            Op::EndStep if in_step && !refused_as_lost => {
                in_step = false;
                in_micro = false;
                live.retain(|l| phases.scopes[l.phase] == Scope::Persistent);
            }
            _ => {}
        }
        if let Err(error) = &outcome {
            check_typed(error)?;
            driver_errors += u64::from(matches!(error, Error::Driver(_)));
        }
        if let Some(code) = lost {
            prop_assert!(
                matches!(&outcome, Err(error) if sticky_code(error) == Some(code)),
                "after a sticky error, {op:?} gave {outcome:?}"
            );
            continue;
        }
        if let Some(code) = outcome.as_ref().err().and_then(sticky_code) {
            lost = Some(code);
            continue;
        }
        // No two live allocations overlap.
        let mut ranges: Vec<(u64, u64)> = live.iter().map(|l| (l.ptr, l.ptr + l.bytes)).collect();
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            prop_assert!(pair[0].1 <= pair[1].0, "overlap: {:?} after {op:?}", pair);
        }
        // Each phase's `used` is what the program holds in it (reading the stats may fail
        // under faults: then only the error is checked).
        match rt.stats() {
            Ok(stats) => {
                let mut used: BTreeMap<Phase, u64> = BTreeMap::new();
                for pool in &stats {
                    *used.entry(pool.pool.phase).or_default() += pool.used;
                }
                for (index, &phase) in phases.ids.iter().enumerate() {
                    let held: u64 = live.iter().filter(|l| l.phase == index).map(|l| l.bytes).sum();
                    let counted = used.get(&phase).copied().unwrap_or(0);
                    prop_assert_eq!(counted, held, "phase {} after {:?}", index, op);
                }
            }
            Err(error) => check_typed(&error)?,
        }
    }

    // Teardown with a healthy driver: every owed free is made and every pool destroyed.
    let faults = sim.faults_fired();
    sim.set_faults(None);
    let lost = lost.is_some() || sim.poisoned().is_some();
    drop(streams);
    drop(device);
    drop(rt);
    if !lost {
        prop_assert_eq!(reserved(&driver), 0, "bytes still reserved on the device after the runtime was dropped");
    }
    Ok(Seen { lost, faults, driver_errors })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_faults_lose_nothing_and_every_error_is_typed(
        ops in prop::collection::vec(op(), 1..80),
        seed in any::<u64>(),
        rate in 0.0f64..0.08,
        vmm in any::<bool>(),
    ) {
        run(&ops, seed, rate, vmm)?;
    }

    #[test]
    fn after_a_sticky_error_every_operation_returns_it(
        mut ops in prop::collection::vec(op(), 1..60),
        at in any::<prop::sample::Index>(),
        seed in any::<u64>(),
        vmm in any::<bool>(),
    ) {
        let at = at.index(ops.len());
        ops.insert(at, Op::Sticky);
        // Operations after the poison that reach the driver see it; the runtime then refuses
        // every operation with it.
        ops.extend([Op::BeginStep, Op::Alloc { phase: 3, stream: 0, bytes: MIB }, Op::EndStep]);
        let seen = run(&ops, seed, 0.0, vmm)?;
        prop_assert!(seen.lost, "the sticky error was never reached");
    }
}

#[test]
fn the_fault_test_meets_faults_and_survives_them() {
    // One long program, to show that the properties above are checked with faults happening:
    // allocations and frees across steps and micro-steps on both streams.
    let mut ops = Vec::new();
    for step in 0..40u64 {
        ops.push(Op::BeginStep);
        for i in 0..12u64 {
            let bytes = (1 + (step * 7 + i * 13) % 40) * MIB;
            ops.push(Op::Alloc { phase: (i % 4) as usize, stream: (i % 2) as usize, bytes });
            if i % 3 == 2 {
                ops.push(Op::Free(usize::try_from(step + i).unwrap()));
            }
            if i == 5 {
                ops.push(Op::BeginMicro);
                ops.push(Op::Alloc { phase: 4, stream: 1, bytes: 3 * MIB });
                ops.push(Op::EndMicro);
            }
        }
        ops.push(Op::EndStep);
    }
    for vmm in [true, false] {
        let seen = run(&ops, 7, 0.03, vmm).unwrap();
        assert!(!seen.lost);
        assert!(seen.faults >= 20, "faults were injected (vmm {vmm}): {seen:?}");
        assert!(seen.driver_errors >= 5, "the runtime returned driver errors and went on (vmm {vmm}): {seen:?}");
    }
}

/// Live ranges by start: (end, phase index, allocation id).
type Ranges = BTreeMap<u64, (u64, usize, u64)>;

#[test]
fn threads_allocating_across_step_ends_under_faults_lose_nothing() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Mutex, RwLock};

    // Four threads, each on its own stream, allocate and free raw memory in persistent and
    // step-scoped phases, concurrently with each other, while the main thread ends and begins
    // steps between them, with 2 % of driver calls failing. Every range handed out is checked
    // against every live one. A thread's call and its bookkeeping run under a shared lock that a
    // step end takes exclusively: a thread never frees a pointer a step end released (the
    // raw API's contract), and the released ranges leave the set with the release.
    for seed in [1u64, 2, 3] {
        // Seeds 1 and 3 on ranges of mapped pages, seed 2 on pool slabs.
        let config = SimConfig { vmm_supported: seed != 2, ..SimConfig::with_capacity(CAPACITY) };
        let driver = Driver::simulated(config).unwrap();
        let sim = driver.sim().expect("a simulated driver");
        let rt = Runtime::with_driver(driver.clone()).unwrap();
        let phases = declare(&rt);
        let device = rt.device(0).unwrap();
        let streams: Vec<_> = (0..4).map(|_| device.create_stream().unwrap()).collect();
        let live: RwLock<Mutex<Ranges>> = RwLock::default();
        let ids = AtomicU64::new(0);
        // Calls the threads made, so that every step sees some.
        let calls = AtomicU64::new(0);
        let done = AtomicBool::new(false);
        let errors = Mutex::new(Vec::<Error>::new());
        rt.raw().begin_step().unwrap();
        sim.set_faults(Some(FaultPlan::random(seed, 0.02)));
        let mut boundaries = 0;
        std::thread::scope(|scope| {
            for (thread, stream) in streams.iter().enumerate() {
                let (rt, live, ids, calls, done, errors, phases) = (&rt, &live, &ids, &calls, &done, &errors, &phases);
                scope.spawn(move || {
                    let mut rng = seed ^ (thread as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    let mut mine: Vec<(u64, u64)> = Vec::new();
                    while !done.load(Ordering::Acquire) {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let shared = live.read().unwrap();
                        calls.fetch_add(1, Ordering::Release);
                        if rng % 5 < 3 || mine.is_empty() {
                            let phase = [0, 2, 3][(rng % 3) as usize];
                            let bytes = 1 + rng % (8 * MIB);
                            // SAFETY: nothing runs on the device.
                            match unsafe { rt.raw().alloc(phases.ids[phase], bytes, stream) } {
                                Ok(ptr) => {
                                    let mut set = shared.lock().unwrap();
                                    if let Some((&start, &(end, other, _))) = set.range(..=ptr).next_back() {
                                        assert!(
                                            end <= ptr,
                                            "{ptr:#x} (phase {phase}) inside live {start:#x}..{end:#x} (phase {other})"
                                        );
                                    }
                                    if let Some((&start, _)) = set.range(ptr..).next() {
                                        assert!(ptr + bytes <= start, "{ptr:#x}+{bytes} over live {start:#x}");
                                    }
                                    let id = ids.fetch_add(1, Ordering::Relaxed);
                                    set.insert(ptr, (ptr + bytes, phase, id));
                                    mine.push((ptr, id));
                                }
                                Err(error) => errors.lock().unwrap().push(error),
                            }
                        } else {
                            let (ptr, id) = mine.swap_remove((rng as usize / 7) % mine.len());
                            // Still this allocation, or a step end released it.
                            let ours = shared.lock().unwrap().get(&ptr).is_some_and(|&(.., owner)| owner == id);
                            if !ours {
                                continue;
                            }
                            // Out of the set before the free: once freed, the range may be
                            // handed out again.
                            shared.lock().unwrap().remove(&ptr);
                            // SAFETY: nothing uses the memory.
                            if let Err(error) = unsafe { rt.raw().free(ptr) } {
                                errors.lock().unwrap().push(error);
                            }
                        }
                    }
                });
            }
            for _ in 0..200 {
                // The threads make 16 calls or more in every step.
                let from = calls.load(Ordering::Acquire);
                while calls.load(Ordering::Acquire) < from + 16 {
                    std::thread::yield_now();
                }
                let exclusive = live.write().unwrap();
                // SAFETY: nothing uses the released pointers.
                let ended = unsafe { rt.raw().end_step() };
                exclusive.lock().unwrap().retain(|_, &mut (_, phase, _)| phases.scopes[phase] == Scope::Persistent);
                if let Err(error) = ended {
                    errors.lock().unwrap().push(error);
                }
                boundaries += 1;
                while let Err(error) = rt.raw().begin_step() {
                    check_typed(&error).unwrap();
                }
                drop(exclusive);
            }
            done.store(true, Ordering::Release);
        });
        let errors = errors.into_inner().unwrap();
        for error in &errors {
            check_typed(error).unwrap();
        }
        assert!(errors.iter().any(|e| matches!(e, Error::Driver(_))), "seed {seed}: faults reached the threads");
        assert_eq!(boundaries, 200);
        sim.set_faults(None);
        // SAFETY: nothing uses the released pointers.
        let _ = unsafe { rt.raw().end_step() };
        drop(streams);
        drop(device);
        drop(rt);
        assert_eq!(reserved(&driver), 0, "seed {seed}: bytes still reserved after the runtime was dropped");
    }
}
