//! Many threads, each on its own stream, over thousands of steps with random sizes and
//! micro-steps. After every step end, the live bytes are exactly the persistent ones, the device's
//! reservation stays bounded, nothing leaks, and no two live buffers ever overlap.
//!
//! `STEPPOOL_STRESS_STEPS` sets the number of steps (default 1500).

use std::collections::BTreeMap;
use std::sync::Mutex;

use steppool::{Buffer, Phase, PhaseSpec, Runtime, Scope, Stream};
use steppool_sys::CUdeviceptr;
use steppool_tests::runtime;

const THREADS: usize = 8;
const MIB: u64 = 1 << 20;
/// Most bytes one thread holds live at once in the pool phases of one scope.
const PER_THREAD_LIVE: u64 = 48 * MIB;
/// Most allocations one thread makes in one scope, and their largest size.
const PER_SCOPE_ALLOCATIONS: u64 = 16;
const LARGEST: u64 = 7 * MIB;

/// A small deterministic generator (xorshift), one per thread and step.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn size(&mut self) -> u64 {
        match self.below(4) {
            0 => 1 + self.below(4096),
            1 => 4096 + self.below(MIB),
            _ => MIB + self.below(LARGEST - MIB),
        }
    }
}

/// Every live range, checked for overlap on insert. Ranges leave before their memory is freed.
#[derive(Default)]
struct Live(Mutex<BTreeMap<CUdeviceptr, u64>>);

impl Live {
    fn insert(&self, ptr: CUdeviceptr, len: u64) {
        let mut live = self.0.lock().unwrap();
        if let Some((&before, &before_len)) = live.range(..=ptr).next_back() {
            assert!(before + before_len <= ptr, "{ptr:#x}+{len} overlaps live {before:#x}+{before_len}");
        }
        if let Some((&after, _)) = live.range(ptr..).next() {
            assert!(ptr + len <= after, "{ptr:#x}+{len} overlaps live {after:#x}");
        }
        live.insert(ptr, len);
    }

    fn remove(&self, ptr: CUdeviceptr) {
        assert!(self.0.lock().unwrap().remove(&ptr).is_some());
    }
}

/// One thread's share of a scope: allocate and free at random, keeping under the live limit.
fn churn<'a>(
    rt: &Runtime,
    mut alloc: impl FnMut(Phase, u64) -> Buffer<'a>,
    phases: &[Phase],
    stream: &Stream,
    rng: &mut Rng,
    live: &Live,
    raw: &Mutex<Vec<(CUdeviceptr, Phase)>>,
) {
    let mut held: Vec<(Buffer<'a>, u64)> = Vec::new();
    let mut held_bytes = 0;
    for _ in 0..(4 + rng.below(PER_SCOPE_ALLOCATIONS - 4)) {
        let phase = phases[rng.below(phases.len() as u64) as usize];
        let size = rng.size();
        if rng.below(5) == 0 && phase != Phase::WORKSPACE {
            // A raw allocation, released by the boundary of its scope.
            // SAFETY: nothing uses the pointer; the boundary releases it.
            let ptr = unsafe { rt.raw().alloc(phase, size, stream) }.unwrap();
            live.insert(ptr, size);
            raw.lock().unwrap().push((ptr, phase));
            continue;
        }
        while held_bytes + size > PER_THREAD_LIVE && !held.is_empty() {
            let (buffer, bytes) = held.swap_remove(rng.below(held.len() as u64) as usize);
            live.remove(buffer.ptr());
            held_bytes -= bytes;
            drop(buffer);
        }
        let buffer = alloc(phase, size);
        live.insert(buffer.ptr(), size);
        held_bytes += size;
        held.push((buffer, size));
    }
    for (buffer, _) in held {
        live.remove(buffer.ptr());
    }
}

#[test]
fn eight_threads_thousands_of_steps() {
    let rt = runtime();
    let steps: u64 = std::env::var("STEPPOOL_STRESS_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(1500);
    let micro_phase = rt.declare_phase(PhaseSpec::new("micro_activations", Scope::MicroStep)).unwrap();
    let device = rt.device(0).unwrap();
    let streams: Vec<Stream> = (0..THREADS).map(|_| device.create_stream().unwrap()).collect();
    let live = Live::default();

    // Persistent memory, held across all steps.
    let persistent: Vec<Buffer<'static>> = streams
        .iter()
        .enumerate()
        .map(|(i, stream)| rt.alloc(Phase::WEIGHTS, (i as u64 + 1) * 3 * MIB + 1000, stream).unwrap())
        .collect();
    for buffer in &persistent {
        live.insert(buffer.ptr(), buffer.len());
    }
    let persistent_bytes: u64 = persistent.iter().map(Buffer::len).sum();
    // What the generator can ask for in one step: per thread, at most three scopes of
    // PER_SCOPE_ALLOCATIONS requests of at most LARGEST bytes (arenas and raw allocations do not
    // reuse within a scope), each rounded up to a 2 MiB granule, plus a 64 MiB arena slab of slack.
    let demand_bound = THREADS as u64 * 3 * (PER_SCOPE_ALLOCATIONS * (LARGEST + 2 * MIB) + 64 * MIB);
    let mut most_reserved = 0;
    let mut most_reserved_first_half = 0;

    for step_index in 0..steps {
        let raw = Mutex::new(Vec::new());
        let step = rt.begin_step().unwrap();
        let micro_steps = step_index % 3;
        for micro_index in 0..micro_steps {
            let micro = step.begin_micro_step().unwrap();
            std::thread::scope(|scope| {
                for (thread, stream) in streams.iter().enumerate() {
                    let (rt, micro, live, raw) = (&rt, &micro, &live, &raw);
                    scope.spawn(move || {
                        let mut rng =
                            Rng(0x9E37_79B9_7F4A_7C15 ^ (step_index << 20) ^ (micro_index << 8) ^ thread as u64);
                        let phases = [micro_phase, Phase::ACTIVATIONS];
                        let alloc = |phase, size| micro.alloc(phase, size, stream).unwrap();
                        churn(rt, alloc, &phases, stream, &mut rng, live, raw);
                    });
                }
            });
            micro.end().unwrap();
            // The micro-step's end released its raw allocations: their memory may come back.
            raw.lock().unwrap().retain(|&(ptr, phase)| {
                let released = phase == micro_phase;
                if released {
                    live.remove(ptr);
                }
                !released
            });
        }
        std::thread::scope(|scope| {
            for (thread, stream) in streams.iter().enumerate() {
                let (rt, step, live, raw) = (&rt, &step, &live, &raw);
                scope.spawn(move || {
                    let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (step_index << 20) ^ thread as u64);
                    let phases = [Phase::ACTIVATIONS, Phase::GRADIENTS, Phase::WORKSPACE];
                    let alloc = |phase, size| step.alloc(phase, size, stream).unwrap();
                    churn(rt, alloc, &phases, stream, &mut rng, live, raw);
                });
            }
        });
        let report = step.end().unwrap();
        for (ptr, _) in raw.into_inner().unwrap() {
            live.remove(ptr);
        }

        assert_eq!(report.micro_steps as u64, micro_steps);
        let stats = rt.stats().unwrap();
        let used_by_scope = |scope: Scope| stats.iter().filter(|s| s.scope == scope).map(|s| s.used).sum::<u64>();
        assert_eq!(
            used_by_scope(Scope::Step) + used_by_scope(Scope::MicroStep),
            0,
            "step {step_index}: step memory left"
        );
        assert_eq!(used_by_scope(Scope::Persistent), persistent_bytes, "step {step_index}: persistent memory changed");
        let reserved: u64 = stats.iter().map(|s| s.reserved).sum();
        most_reserved = most_reserved.max(reserved);
        if step_index < steps / 2 {
            most_reserved_first_half = most_reserved;
        }
        assert!(
            reserved <= persistent_bytes + demand_bound,
            "step {step_index}: {reserved} reserved exceeds the bound {}",
            persistent_bytes + demand_bound
        );
        if let Some(sim) = rt.driver().sim() {
            // The device agrees: its live allocations are the persistent buffers only.
            let on_device: usize = streams
                .iter()
                .flat_map(|stream| {
                    [Phase::ACTIVATIONS, Phase::GRADIENTS, micro_phase]
                        .map(|phase| rt.pool_handle(phase, stream).unwrap().unwrap())
                })
                .map(|pool| sim.pool_layout(pool).unwrap().allocations.len())
                .sum();
            assert_eq!(on_device, 0, "step {step_index}: allocations left on the device");
        }
        assert_eq!(live.0.lock().unwrap().len(), persistent.len());
    }
    assert!(rt.take_errors().is_empty());
    println!("{steps} steps; most reserved {most_reserved} bytes ({most_reserved_first_half} in the first half)");
    // No creep: the second half of the run needs no more than the first half did, give or take
    // one step's worth of a thread's demand.
    assert!(
        most_reserved <= most_reserved_first_half + demand_bound / THREADS as u64,
        "reserved crept from {most_reserved_first_half} to {most_reserved}"
    );
    drop(persistent);
}
