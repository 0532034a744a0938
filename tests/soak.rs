//! `soak`: a long run of the runtime under driver faults on the simulated device. Worker threads,
//! each on its own stream, allocate and free in persistent, step-, micro-step- and plan-scoped
//! phases through the raw API and through buffers, while the main thread ends and begins steps
//! (a micro-step in every other step); a fault plan fails driver calls at random. At the end the
//! runtime is dropped with the faults off, and the simulated device must hold nothing.
//!
//! ```text
//! soak [--threads 8] [--steps 1000000] [--faults seed=1,rate=0.0005]
//! ```
//!
//! Prints the operations per second, the process's peak resident memory, the errors by kind,
//! and the bytes still reserved on the device after the runtime was dropped (the leak, 0). Exits
//! with status 1 on a leak or an error that is not a typed driver, out-of-memory or scope
//! error; a panic anywhere fails it too. `cargo xtask soak` runs it in release; the tests run a
//! short form.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::Instant;

use steppool::sys::sim::{FaultPlan, SimConfig};
use steppool::sys::{Driver, DriverError};
use steppool::{Error, Phase, PhaseSpec, Runtime, Scope, Strategy};

const MIB: u64 = 1 << 20;

struct Options {
    threads: usize,
    steps: u64,
    faults: FaultPlan,
}

fn options() -> Result<Options, String> {
    let mut options = Options { threads: 8, steps: 1_000_000, faults: FaultPlan::random(1, 0.0005) };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--threads" => options.threads = value.parse().map_err(|_| format!("--threads {value}"))?,
            "--steps" => options.steps = value.parse().map_err(|_| format!("--steps {value}"))?,
            "--faults" => options.faults = FaultPlan::parse(&value).map_err(|e| e.to_string())?,
            _ => return Err(format!("unknown option {flag}; usage: soak [--threads N] [--steps N] [--faults PLAN]")),
        }
    }
    if options.threads == 0 {
        return Err("--threads must be at least 1".to_owned());
    }
    Ok(options)
}

/// The kind of an error, for the tally; `None` for one a faulty driver should not cause.
fn kind(error: &Error) -> Option<String> {
    match error {
        Error::Driver(DriverError::Call { call, code, .. }) => Some(format!("{call}: {code}")),
        Error::OutOfMemory(_) => Some("out of memory".to_owned()),
        Error::NoActiveStep | Error::NoActiveMicroStep => Some("no active scope".to_owned()),
        _ => None,
    }
}

/// Peak resident memory of this process, from `/proc/self/status` (Linux).
fn peak_rss() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|line| line.strip_prefix("VmHWM:")).map(|v| v.trim().to_owned())
}

fn main() -> ExitCode {
    // A panic anywhere ends the run at once: a worker that died would otherwise leave the others
    // waiting at the step barrier for ever.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::exit(101);
    }));
    let options = match options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("soak: {message}");
            return ExitCode::from(2);
        }
    };
    let driver = Driver::simulated(SimConfig::with_capacity(64 << 30)).expect("a simulated device");
    let sim = driver.sim().expect("a simulated driver");
    let rt = Runtime::with_driver(driver.clone()).expect("a runtime");
    let phases = [
        Phase::WEIGHTS,
        rt.declare_phase(
            PhaseSpec::new("state", Scope::Persistent).strategy(Strategy::Chunked { chunk_bytes: 32 * MIB }),
        )
        .unwrap(),
        Phase::ACTIVATIONS,
        rt.declare_phase(PhaseSpec::new("planned", Scope::Step).strategy(Strategy::PLANNED)).unwrap(),
        rt.declare_phase(PhaseSpec::new("micro", Scope::MicroStep).strategy(Strategy::ARENA)).unwrap(),
    ];
    let device = rt.device(0).unwrap();
    let streams: Vec<_> = (0..options.threads).map(|_| device.create_stream().unwrap()).collect();
    sim.set_faults(Some(options.faults.clone()));

    let operations = AtomicU64::new(0);
    let errors: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());
    let untyped: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let note = |error: Error| match kind(&error) {
        Some(kind) => *errors.lock().unwrap().entry(kind).or_default() += 1,
        None => untyped.lock().unwrap().push(format!("{error:?}")),
    };
    // Each step: the main thread opens it (and every other step a micro-step), the workers
    // allocate and free, the main thread closes it. Two barriers a step.
    let start = Barrier::new(options.threads + 1);
    let end = Barrier::new(options.threads + 1);
    let done = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|scope| {
        for (thread, stream) in streams.iter().enumerate() {
            let (rt, phases, operations, note, start, end, done) =
                (&rt, &phases, &operations, &note, &start, &end, &done);
            scope.spawn(move || {
                let mut rng = (thread as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                // Persistent raw memory a thread keeps across steps, and frees now and then.
                let mut kept: Vec<u64> = Vec::new();
                loop {
                    start.wait();
                    if done.load(Ordering::Acquire) {
                        break;
                    }
                    for _ in 0..4 {
                        let phase = phases[(next() % 5) as usize];
                        let bytes = 1 + next() % (4 * MIB);
                        // SAFETY: nothing runs on the device; scoped memory is released by its
                        // boundary, which this thread never touches after.
                        match unsafe { rt.raw().alloc(phase, bytes, stream) } {
                            Ok(ptr) if phase == phases[0] || phase == phases[1] => kept.push(ptr),
                            Ok(_) => {}
                            Err(error) => note(error),
                        }
                        operations.fetch_add(1, Ordering::Relaxed);
                    }
                    // At most 16 kept: the persistent memory a thread holds stays bounded.
                    while kept.len() > 16 {
                        let ptr = kept.swap_remove((next() % kept.len() as u64) as usize);
                        // SAFETY: nothing uses the memory.
                        if let Err(error) = unsafe { rt.raw().free(ptr) } {
                            note(error);
                        }
                        operations.fetch_add(1, Ordering::Relaxed);
                    }
                    end.wait();
                }
                for ptr in kept {
                    // SAFETY: as above.
                    if let Err(error) = unsafe { rt.raw().free(ptr) } {
                        note(error);
                    }
                }
            });
        }
        for step in 0..options.steps {
            if let Err(error) = rt.raw().begin_step() {
                note(error);
            }
            if step % 2 == 1
                && let Err(error) = rt.raw().begin_micro_step()
            {
                note(error);
            }
            start.wait();
            end.wait();
            // SAFETY: the workers wait at the barrier; nothing uses the released memory.
            if let Err(error) = unsafe { rt.raw().end_step() } {
                note(error);
            }
            operations.fetch_add(2, Ordering::Relaxed);
        }
        done.store(true, Ordering::Release);
        start.wait();
    });
    let elapsed = started.elapsed();

    let faults = sim.faults_fired();
    sim.set_faults(None);
    drop(streams);
    drop(device);
    drop(rt);
    let leaked = (|| -> Result<u64, DriverError> {
        let ordinal = driver.device(0)?;
        let ctx = driver.primary_context_retain(ordinal)?;
        // SAFETY: the context was just retained.
        unsafe { driver.context_set_current(ctx) }?;
        let (free, total) = driver.mem_get_info()?;
        // SAFETY: balances the retain above.
        unsafe { driver.primary_context_release(ordinal) }?;
        Ok(total - free)
    })();

    let operations = operations.into_inner();
    println!(
        "soak: {} threads, {} steps, faults {} ({faults} injected)",
        options.threads, options.steps, options.faults
    );
    println!(
        "  {operations} operations in {:.1} s: {:.0} operations/s",
        elapsed.as_secs_f64(),
        operations as f64 / elapsed.as_secs_f64()
    );
    println!("  peak resident memory: {}", peak_rss().unwrap_or_else(|| "unknown".to_owned()));
    for (kind, count) in errors.into_inner().unwrap() {
        println!("  error {kind}: {count}");
    }
    let untyped = untyped.into_inner().unwrap();
    for error in &untyped {
        println!("  unexpected error: {error}");
    }
    match &leaked {
        Ok(bytes) => println!("  leaked: {bytes} bytes still reserved on the device"),
        Err(error) => println!("  leaked: unknown ({error})"),
    }
    if leaked.as_ref().is_ok_and(|&bytes| bytes == 0) && untyped.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
