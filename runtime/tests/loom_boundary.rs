//! The boundary protocol, model-checked with loom: every interleaving of the runtime's own code at its boundary lock, its pools' locks and its activity flags, on
//! the simulated device.
//!
//! Built only with `--cfg loom`, which swaps those primitives for loom's (`runtime/src/sync.rs`):
//!
//! ```text
//! cargo xtask loom
//! # which runs
//! RUSTFLAGS="--cfg loom" cargo test -p steppool --test loom_boundary --release --target-dir target/loom
//! ```
//!
//! The models are small (a runtime, one or two streams, two or three threads), so loom explores
//! every interleaving: the preemption bound is loom's largest, which none of them reaches
//! (`LOOM_MAX_PREEMPTIONS` sets a smaller one). Each model records the outcomes its interleavings
//! produced and fails unless every outcome it is about was reached.
#![cfg(loom)]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use loom::thread;
use steppool::sys::sim::SimConfig;
use steppool::{Error, Phase, PhaseSpec, Runtime, Scope, Stream, Verdict};

const MIB: u64 = 1 << 20;

/// The preemption bound unless `LOOM_MAX_PREEMPTIONS` sets one: loom's largest. No execution of
/// these models comes near it, so it does not cut the search; it is set because loom's search
/// without a bound is known to skip executions (loom issues #166 and #392; here it skipped the
/// free that runs before the step end), and a bound turns on the conservative backtracking of
/// bounded partial-order reduction, which finds them.
const PREEMPTIONS: usize = u8::MAX as usize;

/// Runs `model` in every interleaving loom explores, and says on stderr how many there were.
fn check(model: impl Fn() + Sync + Send + 'static) {
    let interleavings = Arc::new(AtomicUsize::new(0));
    let counted = interleavings.clone();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(PREEMPTIONS));
    builder.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        model();
    });
    let test = std::thread::current().name().unwrap_or("a model").to_owned();
    eprintln!("{test}: {} interleavings", interleavings.load(Ordering::Relaxed));
}

/// Outcomes seen over all the interleavings of a model.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<BTreeSet<&'static str>>>);

impl Seen {
    fn note(&self, outcome: &'static str) {
        self.0.lock().unwrap().insert(outcome);
    }

    /// Fails unless each of `expected` was seen in some interleaving.
    fn assert_all(&self, expected: &[&'static str]) {
        let seen = self.0.lock().unwrap();
        for outcome in expected {
            assert!(seen.contains(outcome), "no interleaving reached '{outcome}'; seen: {seen:?}");
        }
    }
}

/// A runtime on a simulated device of `capacity` bytes in the segment model: the models fill
/// devices of a few 2 MiB granules, smaller than one of the driver's 32 MiB pool units.
fn runtime(capacity: u64) -> Arc<Runtime> {
    let config = SimConfig { pool_unit: None, ..SimConfig::with_capacity(capacity) };
    Arc::new(Runtime::builder().simulated(config).build().unwrap())
}

/// The live allocations of `phase`'s CUDA pool on `stream`, as the simulated device holds them.
fn on_device(rt: &Runtime, phase: Phase, stream: &Stream) -> Vec<(u64, u64)> {
    let pool = rt.pool_handle(phase, stream).unwrap().expect("a device with pools");
    rt.driver().sim().expect("a simulated device").pool_layout(pool).expect("a pool of this driver").allocations
}

/// Bytes live in `phase` over every stream, as `Runtime::stats` reads them.
fn used_in_stats(rt: &Runtime, phase: Phase) -> u64 {
    rt.stats().unwrap().iter().filter(|stats| stats.pool.phase == phase).map(|stats| stats.used).sum()
}

/// A step end on one thread, a raw allocation of a step-scoped phase on a second and the raw free
/// of an earlier one on a third: each allocation is released by the step end, freed by its
/// owner, or refused with `NoActiveStep` — never two of these, never none.
#[test]
fn a_step_end_releases_or_refuses_raw_allocations_and_frees_on_other_threads() {
    let seen = Seen::default();
    let outcomes = seen.clone();
    check(move || {
        let rt = runtime(64 * MIB);
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        rt.raw().begin_step().unwrap();
        // SAFETY: nothing uses the memory.
        let first = unsafe { rt.raw().alloc(Phase::ACTIVATIONS, MIB, &stream) }.unwrap();

        let allocating = {
            let (rt, stream) = (rt.clone(), stream.clone());
            // SAFETY: nothing uses the memory.
            thread::spawn(move || unsafe { rt.raw().alloc(Phase::ACTIVATIONS, 2 * MIB, &stream) })
        };
        let freeing = {
            let rt = rt.clone();
            // SAFETY: nothing uses the memory.
            thread::spawn(move || unsafe { rt.raw().free(first) })
        };
        // SAFETY: nothing uses the released memory.
        let report = unsafe { rt.raw().end_step() }.unwrap();
        let allocated = allocating.join().unwrap();
        let freed = freeing.join().unwrap();

        let mut released = 0;
        match freed {
            Ok(()) => outcomes.note("freed by its owner"),
            Err(Error::UnknownPointer { ptr }) if ptr == first => {
                outcomes.note("released before its free");
                released += MIB;
            }
            other => panic!("the free of a step's allocation: {other:?}"),
        }
        match allocated {
            Ok(ptr) => {
                outcomes.note("granted, then released");
                released += 2 * MIB;
                // SAFETY: the runtime checks the pointer.
                let again = unsafe { rt.raw().free(ptr) };
                assert!(matches!(again, Err(Error::UnknownPointer { .. })), "not released by the step end: {again:?}");
            }
            Err(Error::NoActiveStep) => outcomes.note("refused"),
            Err(other) => panic!("a raw allocation racing a step end: {other}"),
        }
        // The step end released exactly what was granted and not freed: nothing twice (the
        // simulated device refuses a second free, and the step end would have failed), nothing
        // left on the device.
        assert_eq!(report.phase(Phase::ACTIVATIONS).unwrap().released, released);
        assert_eq!(on_device(&rt, Phase::ACTIVATIONS, &stream), vec![], "leaked past the step end");
        assert_eq!(used_in_stats(&rt, Phase::ACTIVATIONS), 0);
        assert!(rt.take_errors().is_empty());
    });
    seen.assert_all(&["freed by its owner", "released before its free", "granted, then released", "refused"]);
}

/// Out-of-memory recovery on one thread (its pool cannot grow until the device's other pools
/// give back their idle memory) while a second thread allocates from the pool being trimmed:
/// the recovery either wins the memory back and succeeds, or finds it taken and reports
/// fragmentation; the other thread's allocation is never given back under it, and the counters
/// agree with the device.
#[test]
fn out_of_memory_recovery_against_another_threads_allocation() {
    let seen = Seen::default();
    let outcomes = seen.clone();
    check(move || {
        // 8 MiB: the first pool keeps 6 MiB whose free the host has not yet seen complete (so
        // the driver cannot give it to another pool by itself), 2 MiB are free.
        let rt = runtime(8 * MIB);
        let device = rt.device(0).unwrap();
        let (kept, short) = (device.create_stream().unwrap(), device.create_stream().unwrap());
        drop(rt.alloc(Phase::WEIGHTS, 6 * MIB, &kept).unwrap());
        rt.pool_handle(Phase::WEIGHTS, &short).unwrap();

        let recovering = {
            let (rt, short) = (rt.clone(), short.clone());
            thread::spawn(move || rt.alloc(Phase::WEIGHTS, 4 * MIB, &short))
        };
        let competing = {
            let (rt, kept) = (rt.clone(), kept.clone());
            thread::spawn(move || rt.alloc(Phase::WEIGHTS, 4 * MIB, &kept))
        };
        let recovered = recovering.join().unwrap();
        let other = competing.join().unwrap().expect("the pool that is trimmed can still serve its owner");

        let on_kept = on_device(&rt, Phase::WEIGHTS, &kept);
        assert_eq!(on_kept.len(), 1, "the competing allocation is live: {on_kept:?}");
        assert_eq!(on_kept[0].0, other.ptr());
        let on_short = on_device(&rt, Phase::WEIGHTS, &short);
        match &recovered {
            Ok(buffer) => {
                outcomes.note("recovered");
                assert_eq!(rt.telemetry().oom_recoveries(), 1);
                assert_eq!(on_short, vec![(buffer.ptr(), 4 * MIB)]);
            }
            Err(Error::OutOfMemory(report)) => {
                outcomes.note("out of memory");
                assert_eq!(rt.telemetry().oom_recoveries(), 0);
                assert_eq!(report.requested, 4 * MIB);
                // The competing allocation holds 4 MiB of the idle 6: 2 MiB free on the device
                // and 2 MiB reserved but unused would have held the request.
                assert_eq!(report.verdict, Verdict::Fragmentation, "{report}");
                assert_eq!(on_short, vec![]);
            }
            Err(error) => panic!("out-of-memory recovery: {error}"),
        }
        let metrics = rt.telemetry().metrics().unwrap();
        let live: u64 = metrics.pools.iter().map(|pool| pool.usage.used).sum();
        assert_eq!(live, 4 * MIB + if recovered.is_ok() { 4 * MIB } else { 0 });
        assert!(rt.take_errors().is_empty());
    });
    seen.assert_all(&["recovered", "out of memory"]);
}

/// Two threads recover from out-of-memory at once, each in its own pool and each needing the
/// memory the other's pool keeps: neither waits for the other (each recovery takes one pool's
/// lock at a time), exactly one of them gets the memory, and the other is told it is demand.
/// Which one wins, and whether by its own recovery or by the memory the other's recovery gave
/// back, depends on the interleaving: all four happen.
#[test]
fn two_out_of_memory_recoveries_at_once_neither_waits_for_the_other() {
    let seen = Seen::default();
    let outcomes = seen.clone();
    check(move || {
        // 8 MiB, all of it kept by two pools (4 MiB each) in frees not yet seen complete.
        let rt = runtime(8 * MIB);
        let device = rt.device(0).unwrap();
        let streams = [device.create_stream().unwrap(), device.create_stream().unwrap()];
        let kept: Vec<_> = streams.iter().map(|stream| rt.alloc(Phase::WEIGHTS, 4 * MIB, stream).unwrap()).collect();
        drop(kept);

        let recovering: Vec<_> = streams
            .iter()
            .map(|stream| {
                let (rt, stream) = (rt.clone(), stream.clone());
                thread::spawn(move || rt.alloc(Phase::WEIGHTS, 6 * MIB, &stream))
            })
            .collect();
        let results: Vec<_> = recovering.into_iter().map(|thread| thread.join().unwrap()).collect();

        let granted: Vec<usize> = (0..2).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(granted.len(), 1, "6 MiB twice on an 8 MiB device: {results:?}");
        let winner = granted[0];
        outcomes.note(["the first won", "the second won"][winner]);
        // The winner recovered itself, or found the memory the other's recovery gave back.
        match rt.telemetry().oom_recoveries() {
            0 => outcomes.note("won with the memory the other's recovery gave back"),
            1 => outcomes.note("won by its own recovery"),
            more => panic!("{more} recoveries for one allocation"),
        }
        match &results[1 - winner] {
            Err(Error::OutOfMemory(report)) => {
                assert_eq!(report.requested, 6 * MIB);
                assert_eq!(report.verdict, Verdict::Demand, "{report}");
            }
            other => panic!("the second 6 MiB: {other:?}"),
        }
        for (i, stream) in streams.iter().enumerate() {
            let live = on_device(&rt, Phase::WEIGHTS, stream);
            let expected = match &results[i] {
                Ok(buffer) => vec![(buffer.ptr(), 6 * MIB)],
                Err(_) => vec![],
            };
            assert_eq!(live, expected);
        }
        assert!(rt.take_errors().is_empty());
    });
    seen.assert_all(&[
        "the first won",
        "the second won",
        "won by its own recovery",
        "won with the memory the other's recovery gave back",
    ]);
}

/// A micro-step end on one thread, raw allocations of a micro-step-scoped and a step-scoped
/// phase on two others: the micro-step's allocation is released by its end or refused with
/// `NoActiveMicroStep`; the step's is granted and outlives the micro-step, to be released by the
/// step end.
#[test]
fn a_micro_step_end_releases_or_refuses_only_its_own_scope() {
    let seen = Seen::default();
    let outcomes = seen.clone();
    check(move || {
        let rt = runtime(64 * MIB);
        let micro = rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
        let stream = rt.device(0).unwrap().create_stream().unwrap();
        rt.raw().begin_step().unwrap();
        rt.raw().begin_micro_step().unwrap();
        rt.pool_handle(micro, &stream).unwrap();
        rt.pool_handle(Phase::ACTIVATIONS, &stream).unwrap();

        let in_micro = {
            let (rt, stream) = (rt.clone(), stream.clone());
            // SAFETY: nothing uses the memory.
            thread::spawn(move || unsafe { rt.raw().alloc(micro, MIB, &stream) })
        };
        let in_step = {
            let (rt, stream) = (rt.clone(), stream.clone());
            // SAFETY: nothing uses the memory.
            thread::spawn(move || unsafe { rt.raw().alloc(Phase::ACTIVATIONS, 2 * MIB, &stream) })
        };
        // SAFETY: nothing uses the released memory.
        let report = unsafe { rt.raw().end_micro_step() }.unwrap();
        let in_micro = in_micro.join().unwrap();
        let in_step = in_step.join().unwrap().expect("the step is still active");

        match in_micro {
            Ok(ptr) => {
                outcomes.note("granted, then released");
                assert_eq!(report.released, MIB);
                // SAFETY: the runtime checks the pointer.
                let again = unsafe { rt.raw().free(ptr) };
                assert!(matches!(again, Err(Error::UnknownPointer { .. })), "not released: {again:?}");
            }
            Err(Error::NoActiveMicroStep) => {
                outcomes.note("refused");
                assert_eq!(report.released, 0);
            }
            Err(other) => panic!("a raw allocation racing a micro-step end: {other}"),
        }
        assert_eq!(on_device(&rt, micro, &stream), vec![], "leaked past the micro-step end");
        assert_eq!(on_device(&rt, Phase::ACTIVATIONS, &stream), vec![(in_step, 2 * MIB)], "the step's memory");
        // SAFETY: nothing uses the released memory.
        let step = unsafe { rt.raw().end_step() }.unwrap();
        assert_eq!(step.phase(Phase::ACTIVATIONS).unwrap().released, 2 * MIB);
        assert_eq!(on_device(&rt, Phase::ACTIVATIONS, &stream), vec![]);
        assert!(rt.take_errors().is_empty());
    });
    seen.assert_all(&["granted, then released", "refused"]);
}

/// Statistics and metrics read on two threads while a third ends the step: the step's memory
/// is in two pools, and each read sees both or neither.
#[test]
fn statistics_read_during_a_release_see_all_or_nothing() {
    let seen = Seen::default();
    let outcomes = seen.clone();
    check(move || {
        let rt = runtime(64 * MIB);
        let device = rt.device(0).unwrap();
        let streams = [device.create_stream().unwrap(), device.create_stream().unwrap()];
        rt.raw().begin_step().unwrap();
        for (stream, bytes) in streams.iter().zip([MIB, 2 * MIB]) {
            // SAFETY: released at the step end; nothing uses it.
            unsafe { rt.raw().alloc(Phase::ACTIVATIONS, bytes, stream) }.unwrap();
        }
        let step = 3 * MIB;

        let stats = {
            let rt = rt.clone();
            thread::spawn(move || used_in_stats(&rt, Phase::ACTIVATIONS))
        };
        let metrics = {
            let rt = rt.clone();
            thread::spawn(move || {
                let metrics = rt.telemetry().metrics().unwrap();
                let activations = metrics.pools.iter().filter(|pool| pool.pool.phase == Phase::ACTIVATIONS);
                activations.map(|pool| pool.usage.used).sum::<u64>()
            })
        };
        // SAFETY: nothing uses the released memory.
        unsafe { rt.raw().end_step() }.unwrap();

        for (reader, value) in [("stats", stats.join().unwrap()), ("metrics", metrics.join().unwrap())] {
            match (reader, value) {
                ("stats", 0) => outcomes.note("stats after the release"),
                ("stats", v) if v == step => outcomes.note("stats before the release"),
                ("metrics", 0) => outcomes.note("metrics after the release"),
                ("metrics", v) if v == step => outcomes.note("metrics before the release"),
                _ => panic!("{reader} saw a half-released step: {value} of {step} bytes"),
            }
        }
    });
    seen.assert_all(&[
        "stats before the release",
        "stats after the release",
        "metrics before the release",
        "metrics after the release",
    ]);
}
