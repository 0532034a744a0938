//! A training loop, run twice on the same allocation events: once on one default pool as plain
//! `cudaMallocAsync` users do, once with steppool's phases. It prints a line per step and a
//! side-by-side table: peak used, peak reserved, fragmentation ratio, and whether the run fits the
//! device capacity.
//!
//! ```text
//! cargo run --release --example training_loop -- [--steps 8] [--capacity 24GiB] [--micro-batches 4]
//!     [--layers 16] [--hidden 1536] [--seed 7]
//! ```
//!
//! Without a GPU (or with `STEPPOOL_DEVICE=sim`) each run gets a fresh simulated device of
//! `--capacity`, so an out-of-memory is a real one. On a GPU both runs use it in turn, every
//! buffer is written by a kernel, and `--capacity` is the budget the peaks are judged against.

use std::collections::HashMap;
use std::ffi::c_void;
use std::process::ExitCode;

use steppool::sys::bytes::{Bytes, parse_bytes};
use steppool::sys::kernels::{FILL_BYTES, FILL_BYTES_PTX};
use steppool::sys::sim::SimConfig;
use steppool::sys::{
    CUdeviceptr, CUfunction, CUmemPool_attribute, CUstream, CUstream_flags, Driver, DriverKind, Selection,
};
use steppool::{Buffer, Error, OomReport, Phase, PhaseSpec, PoolUsage, Runtime, Scope, Strategy};
use steppool_examples::{Event, Lifetime, StepPlan, TransformerConfig, Workload, peak_live};

const USAGE: &str =
    "usage: training_loop [--steps N] [--capacity SIZE] [--micro-batches N] [--layers N] [--hidden N] [--seed N]";

struct Options {
    steps: u32,
    capacity: u64,
    model: TransformerConfig,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { steps: 8, capacity: 24 << 30, model: TransformerConfig::default() };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_owned());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = |value: &str| value.parse::<u64>().map_err(|_| format!("{flag}: `{value}` is not a number"));
        match flag.as_str() {
            "--steps" => options.steps = number(&value)? as u32,
            "--capacity" => options.capacity = parse_bytes(&value).map_err(|e| format!("--capacity: {e}"))?,
            "--micro-batches" => options.model.micro_batches = number(&value)?.max(1) as u32,
            "--layers" => options.model.layers = number(&value)?.max(1) as u32,
            "--hidden" => options.model.hidden = number(&value)?.max(128).next_multiple_of(128),
            "--seed" => options.model.seed = number(&value)?,
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    Ok(options)
}

/// What one run measured.
struct Run {
    name: &'static str,
    about: &'static str,
    /// Per step: sequence lengths, peak live bytes, peak reserved bytes.
    steps: Vec<(Vec<u64>, u64, u64)>,
    /// The step that ran out of memory, and why.
    oom: Option<(usize, String)>,
}

impl Run {
    fn peak_used(&self) -> u64 {
        self.steps.iter().map(|s| s.1).max().unwrap_or(0)
    }

    fn peak_reserved(&self) -> u64 {
        self.steps.iter().map(|s| s.2).max().unwrap_or(0)
    }
}

/// Tracks device memory held since the run began: total minus free, as `cuMemGetInfo` says.
struct Reservation {
    baseline: u64,
    peak: u64,
}

impl Reservation {
    fn start(driver: &Driver) -> Self {
        let (free, total) = driver.mem_get_info().expect("cuMemGetInfo");
        Self { baseline: total - free, peak: 0 }
    }

    fn sample(&mut self, driver: &Driver) {
        let (free, total) = driver.mem_get_info().expect("cuMemGetInfo");
        self.peak = self.peak.max((total - free).saturating_sub(self.baseline));
    }

    fn take_peak(&mut self) -> u64 {
        std::mem::take(&mut self.peak)
    }
}

/// Writes every byte of each buffer with a kernel, on a GPU.
struct Touch {
    function: Option<CUfunction>,
}

impl Touch {
    fn new(driver: &Driver) -> Self {
        if driver.kind() != DriverKind::Cuda {
            return Self { function: None };
        }
        let module = driver.module_load_ptx(FILL_BYTES_PTX).expect("loading the fill_bytes kernel");
        // SAFETY: the module was just loaded and is never unloaded while the example runs.
        let function = unsafe { driver.module_function(module, FILL_BYTES) }.expect("fill_bytes");
        Self { function: Some(function) }
    }

    fn touch(&self, driver: &Driver, ptr: CUdeviceptr, bytes: u64, stream: CUstream) {
        let Some(function) = self.function else { return };
        let (mut ptr, mut len, mut value) = (ptr, bytes, 0x5Au32);
        let mut params =
            [(&raw mut ptr).cast::<c_void>(), (&raw mut len).cast::<c_void>(), (&raw mut value).cast::<c_void>()];
        let blocks = bytes.div_ceil(256 * 16).clamp(1, 4096) as u32;
        // SAFETY: the kernel writes `bytes` bytes at `ptr`, a live allocation used in `stream`
        // order; the parameters match `fill_bytes(u8*, u64, u32)`.
        unsafe { driver.launch_kernel(function, [blocks, 1, 1], [256, 1, 1], 0, stream, &mut params) }
            .expect("launching fill_bytes");
    }
}

/// The events of a step, split into its micro-batches and what follows them.
fn micro_batches(plan: &StepPlan) -> (Vec<&[Event]>, &[Event]) {
    let mut batches = Vec::new();
    let mut rest = &plan.events[..];
    while let Some(start) = rest.iter().position(|e| *e == Event::BeginMicroBatch) {
        let end = rest.iter().position(|e| *e == Event::EndMicroBatch).expect("balanced micro-batches");
        batches.push(&rest[start + 1..end]);
        rest = &rest[end + 1..];
    }
    (batches, rest)
}

/// The plain run's state: one stream, the device's default pool, the live pointers by id.
struct Plain<'d> {
    driver: &'d Driver,
    stream: CUstream,
    touch: Touch,
    reservation: Reservation,
    live: HashMap<u32, (CUdeviceptr, u64)>,
}

impl Plain<'_> {
    /// The same report steppool gives, from the default pool's counters and the live bytes.
    fn oom_report(&self, requested: u64) -> String {
        let driver = self.driver;
        let (device_free, device_total) = driver.mem_get_info().unwrap_or((0, 0));
        let pool = driver.device_default_mem_pool(0).expect("default pool");
        // SAFETY: the device's default pool is always live.
        let reserved = unsafe { driver.mem_pool_counters(pool) }.map(|c| c.reserved).unwrap_or(0);
        let used = self.live.values().map(|&(_, bytes)| bytes).sum();
        let pools = vec![PoolUsage { phase: "(default pool)".into(), stream: 0, reserved, used }];
        let verdict = OomReport::judge(requested, device_free, &pools);
        let report = OomReport {
            requested,
            phase: "(default pool)".into(),
            stream: 0,
            device: 0,
            device_free,
            device_total,
            pools,
            verdict,
        };
        report.to_string()
    }

    fn execute(&mut self, events: &[Event]) -> Result<(), String> {
        let (driver, stream) = (self.driver, self.stream);
        for event in events {
            match *event {
                Event::Alloc { id, bytes, .. } => {
                    // SAFETY: `stream` is live; the pointer is freed once, below.
                    let mut result = unsafe { driver.mem_alloc_async(bytes as usize, stream) };
                    if result.as_ref().is_err_and(|e| e.is_out_of_memory()) {
                        // SAFETY: as above.
                        unsafe { driver.stream_synchronize(stream) }.map_err(|e| e.to_string())?;
                        // SAFETY: as above.
                        result = unsafe { driver.mem_alloc_async(bytes as usize, stream) };
                    }
                    let ptr = match result {
                        Ok(ptr) => ptr,
                        Err(error) if error.is_out_of_memory() => return Err(self.oom_report(bytes)),
                        Err(error) => return Err(error.to_string()),
                    };
                    self.touch.touch(driver, ptr, bytes, stream);
                    self.live.insert(id, (ptr, bytes));
                    self.reservation.sample(driver);
                }
                Event::Free { id } => {
                    let (ptr, _) = self.live.remove(&id).expect("allocated before");
                    // SAFETY: freed once; later work on `stream` does not use it.
                    unsafe { driver.mem_free_async(ptr, stream) }.map_err(|e| e.to_string())?;
                }
                Event::BeginMicroBatch | Event::EndMicroBatch => {}
            }
        }
        Ok(())
    }
}

/// Plain `cudaMallocAsync`: everything from the device's default pool on one stream, with the
/// release threshold raised (as PyTorch's `cudaMallocAsync` backend does). On out-of-memory it
/// synchronizes and retries once, as RMM and PyTorch do.
fn run_plain(driver: &Driver, setup: &[Event], plans: &[StepPlan]) -> Run {
    let ctx = driver.primary_context_retain(0).expect("primary context");
    // SAFETY: `ctx` was just retained.
    unsafe { driver.context_set_current(ctx) }.expect("current context");
    let stream = driver.stream_create(CUstream_flags::CU_STREAM_NON_BLOCKING).expect("stream");
    let pool = driver.device_default_mem_pool(0).expect("default pool");
    // SAFETY: the device's default pool is always live.
    unsafe { driver.mem_pool_set_attribute(pool, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX) }
        .expect("release threshold");
    let mut plain = Plain {
        driver,
        stream,
        touch: Touch::new(driver),
        reservation: Reservation::start(driver),
        live: HashMap::new(),
    };
    let mut run = Run {
        name: "plain cudaMallocAsync",
        about: "one default pool, one stream, release threshold raised",
        steps: Vec::new(),
        oom: None,
    };
    let (_, mut held) = peak_live(setup, 0);
    if let Err(why) = plain.execute(setup) {
        run.oom = Some((0, why));
    }
    for (index, plan) in plans.iter().enumerate() {
        if run.oom.is_some() {
            break;
        }
        let (peak_used, after) = peak_live(&plan.events, held);
        held = after;
        match plain.execute(&plan.events) {
            Ok(()) => {
                // Reading the loss: the host waits for the step.
                // SAFETY: the stream is live.
                unsafe { driver.stream_synchronize(stream) }.expect("synchronize");
                run.steps.push((plan.sequences.clone(), peak_used, plain.reservation.take_peak()));
            }
            Err(why) => run.oom = Some((index, why)),
        }
    }
    let live: Vec<CUdeviceptr> = plain.live.drain().map(|(_, (ptr, _))| ptr).collect();
    for ptr in live {
        // SAFETY: every remaining allocation is freed once at the end.
        unsafe { driver.mem_free_async(ptr, stream) }.expect("cuMemFreeAsync");
    }
    // SAFETY: the stream and the pool are live; the pool is given back for the next run.
    unsafe {
        driver.stream_synchronize(stream).expect("synchronize");
        driver.mem_pool_trim_to(pool, 0).expect("trim");
        driver.stream_destroy(stream).expect("destroy stream");
        driver.primary_context_release(0).expect("release context");
    }
    run
}

/// steppool: each lifetime in its phase, on one stream. Weights and optimizer state are
/// persistent; gradients last the step; activations and workspace last the micro-batch.
fn run_steppool(driver: &Driver, setup: &[Event], plans: &[StepPlan]) -> Result<Run, Error> {
    let runtime = Runtime::with_driver(driver.clone())?;
    // Activations and workspace are freed in the reverse order of their allocation within a
    // micro-batch: arenas pack them without fragmentation, whatever the sequence length. Slabs of
    // 1 GiB, several times the largest activation, keep the tails lost at slab ends small.
    let slab_bytes = 1 << 30;
    let activations = PhaseSpec::new("micro_activations", Scope::MicroStep).strategy(Strategy::Arena { slab_bytes });
    let micro_activations = runtime.declare_phase(activations)?;
    let micro_workspace =
        runtime.declare_phase(PhaseSpec::new("micro_workspace", Scope::MicroStep).strategy(Strategy::ARENA))?;
    let device = runtime.device(0)?;
    let stream = device.create_stream()?;
    let touch = Touch::new(driver);
    let mut reservation = Reservation::start(driver);
    let mut run = Run {
        name: "steppool phases",
        about: "weights and optimizer state persistent, gradients per step, activations and workspace in arenas per micro-batch",
        steps: Vec::new(),
        oom: None,
    };
    let mut persistent: HashMap<u32, Buffer<'static>> = HashMap::new();
    let oom = |error: Error| match error {
        Error::OutOfMemory(report) => Ok(report.to_string()),
        other => Err(other),
    };

    for event in setup {
        if let Event::Alloc { id, bytes, .. } = *event {
            match runtime.alloc(Phase::WEIGHTS, bytes, &stream) {
                Ok(buffer) => {
                    touch.touch(driver, buffer.ptr(), bytes, stream.raw());
                    persistent.insert(id, buffer);
                }
                Err(error) => {
                    run.oom = Some((0, oom(error)?));
                    return Ok(run);
                }
            }
        }
    }
    let mut held: u64 = persistent.values().map(Buffer::len).sum();
    'steps: for (index, plan) in plans.iter().enumerate() {
        let (peak_used, after) = peak_live(&plan.events, held);
        held = after;
        let (batches, tail) = micro_batches(plan);
        let step = runtime.begin_step()?;
        let mut step_buffers: HashMap<u32, Buffer<'_>> = HashMap::new();
        for events in batches.into_iter().chain(std::iter::once(tail)) {
            let micro = if events.as_ptr() == tail.as_ptr() { None } else { Some(step.begin_micro_step()?) };
            let mut micro_buffers: HashMap<u32, Buffer<'_>> = HashMap::new();
            for event in events {
                match *event {
                    Event::Alloc { id, lifetime, bytes } => {
                        let allocated = match (lifetime, &micro) {
                            (Lifetime::OptimizerState, _) => {
                                runtime.alloc(Phase::OPTIMIZER_STATE, bytes, &stream).map(|b| persistent.insert(id, b))
                            }
                            (Lifetime::Gradient, _) => {
                                step.alloc(Phase::GRADIENTS, bytes, &stream).map(|b| step_buffers.insert(id, b))
                            }
                            (Lifetime::Workspace, None) => {
                                step.alloc(Phase::WORKSPACE, bytes, &stream).map(|b| step_buffers.insert(id, b))
                            }
                            (Lifetime::Activation, Some(micro)) => {
                                micro.alloc(micro_activations, bytes, &stream).map(|b| micro_buffers.insert(id, b))
                            }
                            (Lifetime::Workspace, Some(micro)) => {
                                micro.alloc(micro_workspace, bytes, &stream).map(|b| micro_buffers.insert(id, b))
                            }
                            (Lifetime::Weight | Lifetime::Activation, _) => unreachable!("not in a step's plan"),
                        };
                        if let Err(error) = allocated {
                            run.oom = Some((index, oom(error)?));
                            break 'steps;
                        }
                        let ptr = [&micro_buffers, &step_buffers]
                            .into_iter()
                            .find_map(|map| map.get(&id).map(Buffer::ptr))
                            .or_else(|| persistent.get(&id).map(Buffer::ptr))
                            .expect("just allocated");
                        touch.touch(driver, ptr, bytes, stream.raw());
                        reservation.sample(driver);
                    }
                    Event::Free { id } => {
                        let freed = micro_buffers.remove(&id).is_some()
                            || step_buffers.remove(&id).is_some()
                            || persistent.remove(&id).is_some();
                        assert!(freed, "allocation {id} freed before it was made");
                    }
                    Event::BeginMicroBatch | Event::EndMicroBatch => {}
                }
            }
            drop(micro_buffers);
            if let Some(micro) = micro {
                micro.end()?;
            }
        }
        drop(step_buffers);
        // Reading the loss: the host waits for the step.
        stream.synchronize()?;
        step.end()?;
        run.steps.push((plan.sequences.clone(), peak_used, reservation.take_peak()));
    }
    drop(persistent);
    stream.synchronize()?;
    Ok(run)
}

fn print_run(run: &Run) {
    println!("{} ({})", run.name, run.about);
    for (index, (sequences, used, reserved)) in run.steps.iter().enumerate() {
        let sequences: Vec<String> = sequences.iter().map(|s| format!("{s:>4}")).collect();
        println!(
            "  step {index:>2}  tokens {}  peak used {:>10}  peak reserved {:>10}  fragmentation {:>5.1} %",
            sequences.join(" "),
            Bytes(*used).to_string(),
            Bytes(*reserved).to_string(),
            steppool::fragmentation_ratio(*used, *reserved) * 100.0
        );
    }
    if let Some((index, why)) = &run.oom {
        println!("  step {index:>2}  out of memory:");
        for line in why.lines() {
            println!("    {line}");
        }
    }
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let selection = match Selection::from_env() {
        Ok(selection) => selection,
        Err(error) => {
            eprintln!("training_loop: {error}");
            return ExitCode::FAILURE;
        }
    };
    let gpu = match selection {
        Selection::Sim => None,
        Selection::Cuda => match Driver::cuda() {
            Ok(driver) => Some(driver),
            Err(error) => {
                eprintln!("training_loop: {error}");
                return ExitCode::FAILURE;
            }
        },
        Selection::Auto => Driver::cuda()
            .inspect_err(|why| eprintln!("no CUDA device answered ({why}); using the simulated device"))
            .ok(),
    };
    let simulated = || Driver::simulated(SimConfig::with_capacity(options.capacity)).expect("a valid simulated device");
    let describe = gpu.as_ref().map_or_else(|| simulated().describe(), Driver::describe);

    let mut workload = Workload::new(TransformerConfig { ..options.model.clone() });
    let setup = workload.setup();
    let plans: Vec<StepPlan> = (0..options.steps).map(|_| workload.step()).collect();
    let c = workload.config();
    println!(
        "training loop: {} layers, hidden {}, {} micro-batches of {} sequences of {}-{} tokens, {} steps, {} of weights",
        c.layers,
        c.hidden,
        c.micro_batches,
        c.batch,
        c.sequence.0,
        c.sequence.1,
        options.steps,
        Bytes(workload.weight_bytes())
    );
    println!("device: {describe}");
    if gpu.is_none() {
        println!("(the simulated device's placement is steppool's documented model, not NVIDIA's)");
    }
    println!();

    let plain = run_plain(&gpu.clone().unwrap_or_else(simulated), &setup, &plans);
    print_run(&plain);
    let phased = match run_steppool(&gpu.clone().unwrap_or_else(simulated), &setup, &plans) {
        Ok(run) => run,
        Err(error) => {
            eprintln!("training_loop: {error}");
            return ExitCode::FAILURE;
        }
    };
    print_run(&phased);

    println!();
    println!("{:<22} {:>30} {:>20}", "", plain.name, phased.name);
    let row = |label: &str, f: &dyn Fn(&Run) -> String| println!("{label:<22} {:>30} {:>20}", f(&plain), f(&phased));
    row("peak used", &|r| Bytes(r.peak_used()).to_string());
    row("peak reserved", &|r| Bytes(r.peak_reserved()).to_string());
    row("fragmentation ratio", &|r| {
        format!("{:.1} %", steppool::fragmentation_ratio(r.peak_used(), r.peak_reserved()) * 100.0)
    });
    let capacity = Bytes(options.capacity);
    row(&format!("at {capacity}"), &|r| match &r.oom {
        Some((index, why)) if why.contains("verdict: fragmentation") => format!("OOM at step {index} (fragmentation)"),
        Some((index, why)) if why.contains("verdict: demand") => format!("OOM at step {index} (demand)"),
        Some((index, _)) => format!("OOM at step {index}"),
        None if r.peak_reserved() > options.capacity => "exceeds capacity".to_owned(),
        None => format!("completed {} steps", r.steps.len()),
    });
    ExitCode::SUCCESS
}
