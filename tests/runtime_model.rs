//! The runtime against a reference model of phases and steps, over random programs of step and
//! micro-step boundaries, raw and safe allocations, frees, double frees, frees of released
//! pointers and recorded uses, in checked mode.
//!
//! The model knows which scopes are active, which allocations are live in which (stream, phase),
//! and which pointers each boundary released. It predicts every call's outcome (success or the
//! exact error) and, after every call, the live bytes of every pool and what a boundary releases.

use std::collections::BTreeMap;

use proptest::prelude::*;
use steppool::{Buffer, Error, Phase, PhaseSpec, Runtime, Scope, Strategy as Allocation};
use steppool_sys::CUdeviceptr;
use steppool_sys::sim::SimConfig;

const MIB: u64 = 1 << 20;
const STREAMS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    BeginStep,
    EndStep,
    BeginMicro,
    EndMicro,
    Alloc { phase: usize, stream: usize, size: u64 },
    Free { pick: usize },
    FreeReleased { pick: usize },
    Hold { stream: usize, size: u64 },
    Drop { pick: usize },
    RecordUse { pick: usize, stream: usize },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 6 => 1..4 * MIB, 2 => prop::sample::select(vec![512, 4096, MIB, 2 * MIB])]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::BeginStep),
        2 => Just(Op::EndStep),
        2 => Just(Op::BeginMicro),
        2 => Just(Op::EndMicro),
        8 => (0..5usize, 0..STREAMS, size()).prop_map(|(phase, stream, size)| Op::Alloc { phase, stream, size }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::FreeReleased { pick }),
        2 => (0..STREAMS, 1..4 * MIB).prop_map(|(stream, size)| Op::Hold { stream, size }),
        1 => any::<usize>().prop_map(|pick| Op::Drop { pick }),
        1 => (any::<usize>(), 0..STREAMS).prop_map(|(pick, stream)| Op::RecordUse { pick, stream }),
    ]
}

#[derive(Clone, Copy, Debug)]
struct Live {
    phase: usize,
    stream: usize,
    size: u64,
}

#[derive(Default)]
struct Model {
    step: Option<u64>,
    micro: bool,
    next_step: u64,
    /// Bytes released at the active step's micro-step boundaries so far.
    released_in_step: u64,
    /// Raw allocations by pointer.
    live: BTreeMap<CUdeviceptr, Live>,
    /// Pointers released by a boundary, with its step, as checked mode remembers them.
    released: BTreeMap<CUdeviceptr, (u64, u64)>,
}

impl Model {
    fn forget_overlaps(&mut self, ptr: CUdeviceptr, size: u64) {
        self.released.retain(|&base, &mut (len, _)| base + len <= ptr || ptr + size <= base);
    }

    /// Releases the raw allocations of the given scopes; returns the bytes.
    fn release(&mut self, scopes: &[Scope], phases: &[(Phase, Scope)], step: u64) -> u64 {
        let doomed: Vec<CUdeviceptr> =
            self.live.iter().filter(|(_, l)| scopes.contains(&phases[l.phase].1)).map(|(&p, _)| p).collect();
        let mut bytes = 0;
        for ptr in doomed {
            let live = self.live.remove(&ptr).unwrap();
            bytes += live.size;
            self.released.insert(ptr, (live.size, step));
        }
        bytes
    }
}

struct Harness {
    rt: Runtime,
    streams: Vec<steppool::Stream>,
    /// The phases and their scopes, by the index ops use.
    phases: Vec<(Phase, Scope)>,
    held: Vec<(Buffer<'static>, usize)>,
    model: Model,
}

impl Harness {
    fn new() -> Self {
        let rt = Runtime::builder().simulated(SimConfig::with_capacity(64 << 30)).checked(true).build().unwrap();
        let micro = rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep)).unwrap();
        let micro_arena = rt
            .declare_phase(
                PhaseSpec::new("micro_arena", Scope::MicroStep).strategy(Allocation::Arena { slab_bytes: 8 * MIB }),
            )
            .unwrap();
        let phases = vec![
            (Phase::WEIGHTS, Scope::Persistent),
            (Phase::ACTIVATIONS, Scope::Step),
            (Phase::WORKSPACE, Scope::Step),
            (micro, Scope::MicroStep),
            (micro_arena, Scope::MicroStep),
        ];
        let device = rt.device(0).unwrap();
        let streams = (0..STREAMS).map(|_| device.create_stream().unwrap()).collect();
        Self { rt, streams, phases, held: Vec::new(), model: Model::default() }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let m = &mut self.model;
        match *op {
            Op::BeginStep => match (self.rt.raw().begin_step(), m.step) {
                (Ok(index), None) => {
                    prop_assert_eq!(index, m.next_step);
                    m.step = Some(index);
                    m.next_step += 1;
                }
                (Err(Error::StepActive { index }), Some(active)) => prop_assert_eq!(index, active),
                (other, _) => prop_assert!(false, "begin step: {:?} with step {:?}", other, m.step),
            },
            Op::EndStep => {
                // SAFETY: nothing uses the released pointers on the device.
                match (unsafe { self.rt.raw().end_step() }, m.step) {
                    (Ok(report), Some(index)) => {
                        let expected = m.release(&[Scope::Step, Scope::MicroStep], &self.phases, index);
                        prop_assert_eq!(report.index, index);
                        prop_assert_eq!(
                            report.released(),
                            m.released_in_step + expected,
                            "bytes released at the step's boundaries"
                        );
                        m.released_in_step = 0;
                        m.step = None;
                        m.micro = false;
                    }
                    (Err(Error::NoActiveStep), None) => {}
                    (other, _) => prop_assert!(false, "end step: {:?} with step {:?}", other.map(|r| r.index), m.step),
                }
            }
            Op::BeginMicro => match (self.rt.raw().begin_micro_step(), m.step, m.micro) {
                (Ok(_), Some(_), false) => m.micro = true,
                (Err(Error::NoActiveStep), None, _) => {}
                (Err(Error::MicroStepActive { .. }), Some(_), true) => {}
                (other, step, micro) => prop_assert!(false, "begin micro: {:?} with {:?}/{}", other, step, micro),
            },
            Op::EndMicro => {
                // SAFETY: nothing uses the released pointers on the device.
                match (unsafe { self.rt.raw().end_micro_step() }, m.step, m.micro) {
                    (Ok(report), Some(index), true) => {
                        let expected = m.release(&[Scope::MicroStep], &self.phases, index);
                        prop_assert_eq!(report.released, expected);
                        m.released_in_step += expected;
                        m.micro = false;
                    }
                    (Err(Error::NoActiveStep), None, _) => {}
                    (Err(Error::NoActiveMicroStep), Some(_), false) => {}
                    (other, step, micro) => prop_assert!(false, "end micro: {:?} with {:?}/{}", other, step, micro),
                }
            }
            Op::Alloc { phase, stream, size } => {
                let (handle, scope) = self.phases[phase];
                // SAFETY: the pointer is only freed or checked through the runtime.
                let result = unsafe { self.rt.raw().alloc(handle, size, &self.streams[stream]) };
                let expected_ok = size > 0
                    && match scope {
                        Scope::Persistent => true,
                        Scope::Step => m.step.is_some(),
                        Scope::MicroStep => m.micro,
                    };
                match result {
                    Ok(ptr) if expected_ok => {
                        prop_assert!(!m.live.contains_key(&ptr), "a live pointer handed out again");
                        m.forget_overlaps(ptr, size);
                        m.live.insert(ptr, Live { phase, stream, size });
                    }
                    Err(Error::ZeroSize { .. }) if size == 0 => {}
                    Err(Error::NoActiveStep) if scope == Scope::Step && m.step.is_none() => {}
                    Err(Error::NoActiveMicroStep) if scope == Scope::MicroStep && !m.micro => {}
                    other => prop_assert!(false, "alloc {:?} of {} bytes: {:?}", scope, size, other),
                }
            }
            Op::Free { pick } => {
                if m.live.is_empty() {
                    return Ok(());
                }
                let ptr = *m.live.keys().nth(pick % m.live.len()).unwrap();
                // SAFETY: a live raw allocation; nothing uses it on the device.
                unsafe { self.rt.raw().free(ptr) }.map_err(|e| TestCaseError::fail(e.to_string()))?;
                m.live.remove(&ptr);
                // SAFETY: as above; the runtime refuses the second free.
                let again = unsafe { self.rt.raw().free(ptr) };
                let expected_step = m.released.get(&ptr).map(|&(_, step)| step);
                match (again, expected_step) {
                    (Err(Error::UnknownPointer { .. }), None) => {}
                    (Err(Error::UseAfterRelease { step, .. }), Some(expected)) => prop_assert_eq!(step, expected),
                    (other, _) => prop_assert!(false, "double free: {:?}", other),
                }
            }
            Op::FreeReleased { pick } => {
                let candidates: Vec<(CUdeviceptr, u64)> = m
                    .released
                    .iter()
                    .filter(|(p, _)| !m.live.contains_key(p))
                    .map(|(&p, &(_, step))| (p, step))
                    .collect();
                if candidates.is_empty() {
                    return Ok(());
                }
                let (ptr, step) = candidates[pick % candidates.len()];
                // SAFETY: the runtime refuses the pointer.
                match unsafe { self.rt.raw().free(ptr) } {
                    Err(Error::UseAfterRelease { ptr: p, step: s, .. }) => prop_assert_eq!((p, s), (ptr, step)),
                    other => prop_assert!(false, "free of a released pointer: {:?}", other),
                }
                match self.rt.raw().check_range(ptr, 1) {
                    Err(Error::UseAfterRelease { step: s, .. }) => prop_assert_eq!(s, step),
                    other => prop_assert!(false, "check of a released pointer: {:?}", other),
                }
            }
            Op::Hold { stream, size } => {
                let buffer = self.rt.alloc(Phase::WEIGHTS, size, &self.streams[stream]).unwrap();
                self.held.push((buffer, stream));
            }
            Op::Drop { pick } => {
                if !self.held.is_empty() {
                    let index = pick % self.held.len();
                    self.held.swap_remove(index);
                }
            }
            Op::RecordUse { pick, stream } => {
                if m.live.is_empty() {
                    return Ok(());
                }
                let ptr = *m.live.keys().nth(pick % m.live.len()).unwrap();
                // SAFETY: a live raw allocation; the stream outlives its release.
                unsafe { self.rt.raw().record_use(ptr, &self.streams[stream]) }.unwrap();
            }
        }
        self.check()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let mut expected: BTreeMap<(u32, Phase), u64> = BTreeMap::new();
        for live in self.model.live.values() {
            *expected.entry((self.streams[live.stream].id(), self.phases[live.phase].0)).or_default() += live.size;
        }
        for (buffer, stream) in &self.held {
            *expected.entry((self.streams[*stream].id(), Phase::WEIGHTS)).or_default() += buffer.len();
        }
        for stats in self.rt.stats().unwrap() {
            let want = expected.get(&(stats.pool.stream, stats.pool.phase)).copied().unwrap_or(0);
            prop_assert_eq!(stats.used, want, "live bytes of {} on stream {}", stats.phase_name, stats.pool.stream);
        }
        for (&ptr, live) in &self.model.live {
            prop_assert!(self.rt.raw().check_range(ptr, live.size).is_ok(), "{:#x} should be live", ptr);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn the_runtime_follows_the_model(ops in prop::collection::vec(op(), 1..120)) {
        let mut harness = Harness::new();
        for op in &ops {
            harness.apply(op)?;
        }
        // Wind down: end what is active and drop what is held; the device must be empty but for
        // persistent raw allocations, which are freed explicitly.
        harness.apply(&Op::EndMicro)?;
        harness.apply(&Op::EndStep)?;
        let persistent: Vec<CUdeviceptr> = harness.model.live.keys().copied().collect();
        for ptr in persistent {
            // SAFETY: a live raw allocation; nothing uses it.
            unsafe { harness.rt.raw().free(ptr) }.unwrap();
            harness.model.live.remove(&ptr);
        }
        harness.held.clear();
        harness.check()?;
        prop_assert!(harness.rt.stats().unwrap().iter().all(|s| s.used == 0));
        prop_assert!(harness.rt.take_errors().is_empty());
    }
}
