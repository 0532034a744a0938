//! A training loop, run twice on the same allocation events: once on one default pool as plain
//! `cudaMallocAsync` users do, once with steppool's phases. It prints a line per step, with the
//! step report's split of its overhead (rounding, granule tails, segregation, holes) beneath, and
//! a side-by-side table: peak used, peak reserved, fragmentation ratio, and whether the run fits the
//! device capacity; beside the two runs, the same events through the models of PyTorch's caching
//! allocator (default and `expandable_segments:True`, as `steppool replay` runs them) and the
//! offline limit (every allocation's lifetime known, packed by `steppool_trace::packing`).
//!
//! ```text
//! cargo run --release --example training_loop -- [--steps 8] [--capacity 24GiB] [--micro-batches 4]
//!     [--layers 16] [--hidden 1536] [--seed 7]
//!     [--reports] [--jsonl FILE] [--prometheus FILE] [--snapshot FILE] [--svg FILE] [--trace FILE]
//!     [--metrics-addr ADDR] [--capture]
//! ```
//!
//! `--reports` prints each step's report. The telemetry flags write each run's step reports and warnings as JSON lines, its counters as
//! Prometheus text, its history as a PyTorch memory snapshot (pytorch.org/memory_viz), an SVG
//! timeline and a steppool trace (for `steppool replay`); each file gets the run's name before
//! its extension (`--svg t.svg` writes `t-plain.svg` and `t-steppool.svg`). Both runs go through
//! steppool's runtime: the plain one as a single pool, so the same telemetry watches it.
//! `--metrics-addr ADDR` serves each run's counters as Prometheus text at `http://ADDR/metrics`
//! while it runs.
//!
//! `--capture` adds captured steps: the same transformer at one fixed sequence length (a graph
//! replays fixed shapes), its step-scoped memory in one phase, run twice more: with captured
//! steps served at the offsets of a planned phase's plan (`CaptureMemory::PlanSlab`), then with
//! the driver's graph memory nodes (`CaptureMemory::GraphNodes`). Step 0 runs eagerly and records
//! the plan; step 1 is captured and launched; later steps of the same shapes relaunch the graph.
//! Each mode also runs the same steps all eagerly, as the baseline. Each step prints whether it
//! ran captured, the time spent in allocator calls and its peak reserved (every pool's peak plus
//! graph memory) beside the eager run's, and a summary compares eager and captured steps and the
//! two runs' peak reserved from step 1 on. In plan-slab mode the captured step holds the planned
//! strategy's own slab, lent for its life, so the captured run reserves what the eager one does.
//!
//! Without a GPU (or with `STEPPOOL_DEVICE=sim`) each run gets a fresh simulated device of
//! `--capacity`, so an out-of-memory is a real one. On a GPU both runs use it in turn, every
//! buffer is written by a kernel, and `--capacity` is the budget the peaks are judged against.

use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::process::ExitCode;

use steppool::sys::bytes::{Bytes, parse_bytes};
use steppool::sys::kernels::{FILL_BYTES, FILL_BYTES_PTX};
use steppool::sys::sim::SimConfig;
use steppool::sys::{CUdeviceptr, CUfunction, CUstream, Driver, DriverError, DriverKind, Selection};
use steppool::telemetry::json::JsonLines;
use steppool::{
    Breakdown, Buffer, CaptureMemory, CaptureMode, CapturedStep, Error, Phase, PhaseSpec, Runtime, Scope, Strategy,
};
use steppool_examples::{Lifetime, StepPlan, TransformerConfig, Workload, path_for, peak_live};
use steppool_trace::packing::{Block, is_valid, pack};
use steppool_trace::{Event, EventKind};

// The models of PyTorch's allocator are the ones `steppool replay` runs.
use steppool_cli::torch::{TorchAllocator, TorchMode};

const USAGE: &str = "usage: training_loop [--steps N] [--capacity SIZE] [--micro-batches N] [--layers N] [--hidden N] \
     [--seed N] [--reports] [--jsonl FILE] [--prometheus FILE] [--snapshot FILE] [--svg FILE] [--trace FILE] \
     [--metrics-addr ADDR] [--capture]";

struct Options {
    capture: bool,
    steps: u32,
    capacity: u64,
    model: TransformerConfig,
    outputs: Outputs,
}

fn parse_options() -> Result<Options, String> {
    let outputs = Outputs {
        jsonl: None,
        prometheus: None,
        snapshot: None,
        svg: None,
        trace: None,
        metrics_addr: None,
        reports: false,
    };
    let mut options =
        Options { capture: false, steps: 8, capacity: 24 << 30, model: TransformerConfig::default(), outputs };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_owned());
        }
        if flag == "--reports" {
            options.outputs.reports = true;
            continue;
        }
        if flag == "--capture" {
            options.capture = true;
            continue;
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
            "--jsonl" => options.outputs.jsonl = Some(value),
            "--prometheus" => options.outputs.prometheus = Some(value),
            "--snapshot" => options.outputs.snapshot = Some(value),
            "--svg" => options.outputs.svg = Some(value),
            "--trace" => options.outputs.trace = Some(value),
            "--metrics-addr" => options.outputs.metrics_addr = Some(value),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    Ok(options)
}

/// A step report's peak used and peak reserved (each pool at its own peak, summed) and where
/// their difference went.
type PoolsPeak = (u64, u64, Breakdown);

/// What one run measured.
struct Run {
    name: &'static str,
    about: &'static str,
    /// Per step: sequence lengths, peak live bytes, peak reserved bytes, and the step report's
    /// peak used, peak reserved and where their difference went (runs through steppool's
    /// runtime only).
    steps: Vec<(Vec<u64>, u64, u64, Option<PoolsPeak>)>,
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
    fn start(driver: &Driver) -> Result<Self, DriverError> {
        let (free, total) = driver.mem_get_info()?;
        Ok(Self { baseline: total - free, peak: 0 })
    }

    fn sample(&mut self, driver: &Driver) -> Result<(), DriverError> {
        let (free, total) = driver.mem_get_info()?;
        self.peak = self.peak.max((total - free).saturating_sub(self.baseline));
        Ok(())
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
    while let Some(start) = rest.iter().position(|e| matches!(e.kind, EventKind::MicroBegin(..))) {
        let end = rest.iter().position(|e| matches!(e.kind, EventKind::MicroEnd(..))).expect("balanced micro-batches");
        batches.push(&rest[start + 1..end]);
        rest = &rest[end + 1..];
    }
    (batches, rest)
}

/// How a run lays out its memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Everything in one pool on one stream, as plain `cudaMallocAsync` users have it (release
    /// threshold raised, as PyTorch's `cudaMallocAsync` backend sets it), watched by steppool's
    /// telemetry.
    Plain,
    /// Each lifetime in its phase: weights and optimizer state persistent, gradients per step,
    /// activations and workspace in arenas per micro-batch.
    Phases,
}

/// What the telemetry flags ask for, and the JSON lines writer while a run lasts.
struct Outputs {
    jsonl: Option<String>,
    prometheus: Option<String>,
    snapshot: Option<String>,
    svg: Option<String>,
    trace: Option<String>,
    /// Where to serve each run's metrics while it runs (`GET /metrics`).
    metrics_addr: Option<String>,
    /// Print each step's report.
    reports: bool,
}

impl Outputs {
    fn recording(&self) -> bool {
        self.snapshot.is_some() || self.svg.is_some() || self.trace.is_some()
    }

    fn create(path: &Option<String>, run: &str) -> std::io::Result<Option<(String, std::fs::File)>> {
        let Some(path) = path else { return Ok(None) };
        let path = path_for(path, run);
        let file = std::fs::File::create(&path)?;
        Ok(Some((path, file)))
    }
}

/// The text of an out-of-memory report, also written to the JSON lines; other errors go up.
fn oom(
    error: Error,
    jsonl: &mut Option<(String, JsonLines<std::fs::File>)>,
) -> Result<String, Box<dyn std::error::Error>> {
    match error {
        Error::OutOfMemory(report) => {
            if let Some((_, jsonl)) = jsonl {
                jsonl.oom(&report)?;
            }
            Ok(report.to_string())
        }
        other => Err(other.into()),
    }
}

/// Runs the workload on a fresh runtime with `layout`, and writes what `outputs` asks for.
fn run(
    driver: &Driver,
    layout: Layout,
    setup: &[Event],
    plans: &[StepPlan],
    outputs: &Outputs,
) -> Result<Run, Box<dyn std::error::Error>> {
    let short = if layout == Layout::Plain { "plain" } else { "steppool" };
    let mut builder = Runtime::builder().driver(driver.clone());
    if outputs.recording() {
        builder = builder.record_history(4 << 20);
    }
    let runtime = builder.build()?;
    let _metrics = match &outputs.metrics_addr {
        Some(addr) => {
            let server = runtime.telemetry().serve_metrics(addr.as_str())?;
            println!("  serving this run's metrics at http://{}/metrics", server.addr());
            Some(server)
        }
        None => None,
    };
    runtime.telemetry().on_warning(move |warning| println!("  warning [{}] ({short}) {warning}", warning.rule()));
    let mut jsonl = Outputs::create(&outputs.jsonl, short)?.map(|(path, file)| (path, JsonLines::new(file)));

    // Activations and workspace are freed in the reverse order of their allocation within a
    // micro-batch: arenas pack them without fragmentation, whatever the sequence length. Slabs of
    // 1 GiB, several times the largest activation, keep the tails lost at slab ends small.
    let everything = runtime.declare_phase(
        PhaseSpec::new("default_pool", Scope::Persistent).strategy(Strategy::Direct).release_threshold(u64::MAX),
    )?;
    let activations =
        PhaseSpec::new("micro_activations", Scope::MicroStep).strategy(Strategy::Arena { slab_bytes: 1 << 30 });
    let micro_activations = runtime.declare_phase(activations)?;
    let micro_workspace =
        runtime.declare_phase(PhaseSpec::new("micro_workspace", Scope::MicroStep).strategy(Strategy::ARENA))?;
    let device = runtime.device(0)?;
    let stream = device.create_stream()?;
    let touch = Touch::new(driver);
    let mut reservation = Reservation::start(driver)?;
    let mut run = match layout {
        Layout::Plain => Run {
            name: "plain cudaMallocAsync",
            about: "one pool, one stream, release threshold raised",
            steps: Vec::new(),
            oom: None,
        },
        Layout::Phases => Run {
            name: "steppool phases",
            about: "weights and optimizer state persistent, gradients per step, activations and workspace in arenas per micro-batch",
            steps: Vec::new(),
            oom: None,
        },
    };
    // Buffers by allocation id (the workload's events carry it as their pointer).
    let mut persistent: HashMap<u64, Buffer<'static>> = HashMap::new();

    for event in setup {
        if event.kind == EventKind::Alloc {
            let (id, bytes) = (event.ptr, event.bytes);
            let phase = if layout == Layout::Plain { everything } else { Phase::WEIGHTS };
            match runtime.alloc(phase, bytes, &stream) {
                Ok(buffer) => {
                    touch.touch(driver, buffer.ptr(), bytes, stream.raw());
                    persistent.insert(id, buffer);
                }
                Err(error) => {
                    run.oom = Some((0, oom(error, &mut jsonl)?));
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
        let mut step_buffers: HashMap<u64, Buffer<'_>> = HashMap::new();
        for events in batches.into_iter().chain(std::iter::once(tail)) {
            let micro = if events.as_ptr() == tail.as_ptr() { None } else { Some(step.begin_micro_step()?) };
            let mut micro_buffers: HashMap<u64, Buffer<'_>> = HashMap::new();
            for event in events {
                match event.kind {
                    EventKind::Alloc => {
                        let (id, bytes) = (event.ptr, event.bytes);
                        let lifetime = Lifetime::of(event).expect("the workload tags every allocation");
                        let allocated = match (layout, lifetime, &micro) {
                            (Layout::Plain, _, _) => {
                                runtime.alloc(everything, bytes, &stream).map(|b| persistent.insert(id, b))
                            }
                            (_, Lifetime::OptimizerState, _) => {
                                runtime.alloc(Phase::OPTIMIZER_STATE, bytes, &stream).map(|b| persistent.insert(id, b))
                            }
                            (_, Lifetime::Gradient, _) => {
                                step.alloc(Phase::GRADIENTS, bytes, &stream).map(|b| step_buffers.insert(id, b))
                            }
                            (_, Lifetime::Workspace, None) => {
                                step.alloc(Phase::WORKSPACE, bytes, &stream).map(|b| step_buffers.insert(id, b))
                            }
                            (_, Lifetime::Activation, Some(micro)) => {
                                micro.alloc(micro_activations, bytes, &stream).map(|b| micro_buffers.insert(id, b))
                            }
                            (_, Lifetime::Workspace, Some(micro)) => {
                                micro.alloc(micro_workspace, bytes, &stream).map(|b| micro_buffers.insert(id, b))
                            }
                            (_, Lifetime::Weight | Lifetime::Activation, _) => unreachable!("not in a step's plan"),
                        };
                        if let Err(error) = allocated {
                            run.oom = Some((index, oom(error, &mut jsonl)?));
                            break 'steps;
                        }
                        let ptr = [&micro_buffers, &step_buffers]
                            .into_iter()
                            .find_map(|map| map.get(&id).map(Buffer::ptr))
                            .or_else(|| persistent.get(&id).map(Buffer::ptr))
                            .expect("just allocated");
                        touch.touch(driver, ptr, bytes, stream.raw());
                        reservation.sample(driver)?;
                    }
                    EventKind::Free { .. } => {
                        let id = event.ptr;
                        let freed = micro_buffers.remove(&id).is_some()
                            || step_buffers.remove(&id).is_some()
                            || persistent.remove(&id).is_some();
                        assert!(freed, "allocation {id} freed before it was made");
                    }
                    _ => {}
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
        let report = step.end()?;
        dropped_cleanly(&runtime)?;
        if outputs.reports {
            print!("{report}");
        }
        if let Some((_, jsonl)) = &mut jsonl {
            jsonl.step(&report)?;
        }
        run.steps.push((
            plan.sequences.clone(),
            peak_used,
            reservation.take_peak(),
            Some((report.peak_used(), report.peak_reserved(), report.breakdown)),
        ));
    }
    if let Some((path, file)) = Outputs::create(&outputs.prometheus, short)? {
        let mut file = file;
        file.write_all(runtime.telemetry().metrics()?.to_prometheus().as_bytes())?;
        println!("  wrote {path}");
    }
    if let Some((path, _)) = &jsonl {
        println!("  wrote {path}");
    }
    let history = runtime.telemetry().history();
    if let Some((path, mut file)) = Outputs::create(&outputs.snapshot, short)? {
        history.write_memory_snapshot(&mut file)?;
        println!("  wrote {path} (open it at https://pytorch.org/memory_viz)");
    }
    if let Some((path, file)) = Outputs::create(&outputs.trace, short)? {
        history.write_trace(&mut std::io::BufWriter::new(file))?;
        println!("  wrote {path} (replay it with `cargo run -p steppool-cli -- replay {path}`)");
    }
    if let Some((path, mut file)) = Outputs::create(&outputs.svg, short)? {
        file.write_all(history.timeline_svg(&format!("{} — {}", run.name, driver.describe())).as_bytes())?;
        println!("  wrote {path}");
    }
    drop(persistent);
    stream.synchronize()?;
    dropped_cleanly(&runtime)?;
    Ok(run)
}

/// Fails with the first error the runtime met in a `Drop` (a buffer's free, a step's end), which
/// it keeps because `Drop` cannot return it.
fn dropped_cleanly(runtime: &Runtime) -> Result<(), Box<dyn std::error::Error>> {
    let errors = runtime.take_errors();
    match errors.first() {
        None => Ok(()),
        Some(first) => Err(format!("{first} (and {} more error(s) while dropping)", errors.len() - 1).into()),
    }
}

fn print_run(run: &Run) {
    println!("{} ({})", run.name, run.about);
    for (index, (sequences, used, reserved, split)) in run.steps.iter().enumerate() {
        let sequences: Vec<String> = sequences.iter().map(|s| format!("{s:>4}")).collect();
        println!(
            "  step {index:>2}  tokens {}  peak used {:>10}  peak reserved {:>10}  fragmentation {:>5.1} %",
            sequences.join(" "),
            Bytes(*used).to_string(),
            Bytes(*reserved).to_string(),
            steppool::fragmentation_ratio(*used, *reserved) * 100.0
        );
        // The step report's split of the pools' peak reserved − peak used (see `StepReport`):
        // each pool read at its own peak, so pools that peak at different moments of the step
        // count more live bytes than the step's peak above.
        let Some((pools_used, pools_reserved, split)) = split else { continue };
        println!(
            "           at the pools' own peaks (used {}, reserved {}): rounding {}, granule tails {}, segregation {}, holes {}",
            Bytes(*pools_used),
            Bytes(*pools_reserved),
            Bytes(split.rounding_bytes),
            Bytes(split.granule_tail_bytes),
            Bytes(split.segregation_bytes),
            Bytes(split.hole_bytes)
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
    let selection = match Selection::from_env_or(Selection::Auto) {
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
    // The environment's simulated device (faults included, `STEPPOOL_SIM_FAULTS`; virtual memory
    // management as a GPU has it unless `STEPPOOL_SIM_VMM=0`), at the capacity asked for.
    let sim_config = match SimConfig::from_env() {
        Ok(config) => SimConfig { capacities: vec![options.capacity], ..config },
        Err(error) => {
            eprintln!("training_loop: {error}");
            return ExitCode::FAILURE;
        }
    };
    let simulated = || Driver::simulated(sim_config.clone());
    let describe = gpu.as_ref().map_or_else(|| sim_config.describe(), Driver::describe);

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

    let mut runs = Vec::new();
    for layout in [Layout::Plain, Layout::Phases] {
        let driver = match gpu.clone().map_or_else(simulated, Ok) {
            Ok(driver) => driver,
            Err(error) => {
                eprintln!("training_loop: {error}");
                return ExitCode::FAILURE;
            }
        };
        match run(&driver, layout, &setup, &plans, &options.outputs) {
            Ok(run) => {
                print_run(&run);
                runs.push(run);
            }
            Err(error) => {
                eprintln!("training_loop: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    let caching = modelled(TorchMode::Caching, &setup, &plans, options.capacity);
    let expandable = modelled(TorchMode::Expandable, &setup, &plans, options.capacity);
    let limit = match offline_limit(&setup, &plans) {
        Ok(limit) => limit,
        Err(error) => {
            eprintln!("training_loop: {error}");
            return ExitCode::FAILURE;
        }
    };
    let (plain, phased) = (&runs[0], &runs[1]);
    let columns = [plain, phased, &caching, &expandable, &limit];

    println!();
    let line = |label: &str, cells: Vec<String>| {
        println!("{label:<22} {:>24} {:>20} {:>20} {:>20} {:>20}", cells[0], cells[1], cells[2], cells[3], cells[4])
    };
    line("", columns.iter().map(|r| r.name.to_owned()).collect());
    let row = |label: &str, f: &dyn Fn(&Run) -> String| line(label, columns.iter().map(|r| f(r)).collect());
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
    println!();
    for run in [&caching, &expandable, &limit] {
        println!("{:<22} {}", run.name, run.about);
    }
    if options.capture {
        let fixed = TransformerConfig {
            sequence: (options.model.sequence.1, options.model.sequence.1),
            ..options.model.clone()
        };
        println!();
        println!(
            "captured steps: the same model at a fixed {} tokens per sequence, step-scoped memory in one phase",
            fixed.sequence.1
        );
        for memory in [CaptureMemory::PlanSlab, CaptureMemory::GraphNodes] {
            // The same steps eagerly, then captured, each on a device of its own.
            let mut runs = Vec::new();
            for capture in [false, true] {
                let run = gpu
                    .clone()
                    .map_or_else(simulated, Ok)
                    .map_err(Into::into)
                    .and_then(|driver| captured_run(&driver, &fixed, options.steps, memory, capture));
                match run {
                    Ok(rows) => runs.push(rows),
                    Err(error) => {
                        eprintln!("training_loop: {error}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            print_captured_run(memory, &runs[0], &runs[1]);
        }
    }
    ExitCode::SUCCESS
}

/// How a step of [`captured_run`] ran.
#[derive(Clone, Debug, PartialEq)]
enum Ran {
    Eager,
    /// Captured in this step, then launched; `lent`: its slab is the planned strategy's.
    Recorded {
        lent: bool,
    },
    /// The graph captured earlier, relaunched.
    Relaunched,
    /// A capture that failed (deviation, error): the step ran eagerly.
    Fallback(String),
}

/// One step of [`captured_run`]: how it ran, the time spent in allocator calls, and its peak
/// reserved (every pool's peak in the step plus the graph memory the driver reserves).
type StepRow = (Ran, std::time::Duration, u64);

/// `--capture`: `steps` steps of a fixed-shape workload, with allocations served as `memory`
/// says: all eagerly (`capture` false, the baseline), or the first eagerly, then captured and
/// relaunched. Returns a row per step.
fn captured_run(
    driver: &Driver,
    config: &TransformerConfig,
    steps: u32,
    memory: CaptureMemory,
    capture: bool,
) -> Result<Vec<StepRow>, Box<dyn std::error::Error>> {
    let mut workload = Workload::new(config.clone());
    let setup = workload.setup();
    let plans: Vec<StepPlan> = (0..steps).map(|_| workload.step()).collect();
    let runtime = Runtime::builder().driver(driver.clone()).build()?;
    let strategy = match memory {
        CaptureMemory::PlanSlab => Strategy::PLANNED,
        _ => Strategy::Direct,
    };
    let phase = runtime.declare_phase(PhaseSpec::new("step", Scope::Step).strategy(strategy))?;
    let stream = runtime.device(0)?.create_stream()?;
    let touch = Touch::new(driver);
    let mut persistent: HashMap<u64, Buffer<'static>> = HashMap::new();
    for event in setup.iter().filter(|e| e.kind == EventKind::Alloc) {
        let buffer = runtime.alloc(Phase::WEIGHTS, event.bytes, &stream)?;
        touch.touch(driver, buffer.ptr(), event.bytes, stream.raw());
        persistent.insert(event.ptr, buffer);
    }
    let is_persistent = |event: &Event| Lifetime::of(event).is_some_and(|l| l.scope() == Scope::Persistent);
    // The step-scoped allocations and frees of a step, in order: what a captured graph replays.
    let shape = |plan: &StepPlan| -> Vec<(bool, u64)> {
        plan.events
            .iter()
            .filter(|e| !is_persistent(e) && matches!(e.kind, EventKind::Alloc | EventKind::Free { .. }))
            .map(|e| (e.kind == EventKind::Alloc, e.bytes))
            .collect()
    };
    let mut captured: Option<(CapturedStep, Vec<(bool, u64)>)> = None;
    let mut rows: Vec<StepRow> = Vec::new();
    for (index, plan) in plans.iter().enumerate() {
        let step = runtime.begin_step()?;
        let mut allocator = std::time::Duration::ZERO;
        // Persistent allocations (the optimizer state, in the first step) are made eagerly.
        for event in plan.events.iter().filter(|e| is_persistent(e) && e.kind == EventKind::Alloc) {
            let started = std::time::Instant::now();
            let buffer = runtime.alloc(Phase::OPTIMIZER_STATE, event.bytes, &stream)?;
            allocator += started.elapsed();
            persistent.insert(event.ptr, buffer);
        }
        let step_events: Vec<&Event> = plan.events.iter().filter(|e| !is_persistent(e)).collect();
        let same_shape = captured.as_ref().is_some_and(|(_, captured_shape)| *captured_shape == shape(plan));
        let ran = if same_shape {
            captured.as_ref().expect("checked").0.launch()?;
            Ran::Relaunched
        } else if !capture || index == 0 || plan.events.iter().any(is_persistent) {
            allocator += eager(&step, phase, &stream, &step_events, driver, &touch)?;
            Ran::Eager
        } else {
            drop(captured.take());
            if memory == CaptureMemory::GraphNodes {
                // The graph's memory comes from the device's graph memory pool, not the phase's:
                // what the phase's pool kept from the eager steps goes back to the device first.
                runtime.device(0)?.release_idle()?;
            }
            let attempt = capture_events(&step, phase, &stream, memory, &step_events, driver, &touch);
            match attempt {
                Ok((graph, time)) => {
                    allocator += time;
                    graph.launch()?;
                    let lent = graph.slab_lent();
                    captured = Some((graph, shape(plan)));
                    Ran::Recorded { lent }
                }
                Err(error) => {
                    allocator += eager(&step, phase, &stream, &step_events, driver, &touch)?;
                    Ran::Fallback(error.to_string())
                }
            }
        };
        let report = step.end()?;
        let peak_reserved = report.pools.iter().map(|p| p.peak_reserved).sum::<u64>() + report.graph_memory.reserved;
        rows.push((ran, allocator, peak_reserved));
    }
    drop(captured);
    drop(persistent);
    Ok(rows)
}

/// Prints the captured run a line per step beside the eager run of the same steps, and a summary
/// of each: allocator time and peak reserved, the latter from step 1 on (step 0 records the plan
/// and takes the optimizer state in both).
fn print_captured_run(memory: CaptureMemory, eager: &[StepRow], captured: &[StepRow]) {
    let mode = match memory {
        CaptureMemory::PlanSlab => "plan slab",
        _ => "graph memory nodes",
    };
    println!();
    println!("captured steps ({mode}); peak reserved is every pool's peak in the step plus graph memory:");
    for (index, (row, eager_row)) in captured.iter().zip(eager).enumerate() {
        let how = match &row.0 {
            Ran::Eager => "eager".to_owned(),
            Ran::Recorded { lent: true } => "captured (recorded, launched; slab lent)".to_owned(),
            Ran::Recorded { lent: false } => "captured (recorded, launched)".to_owned(),
            Ran::Relaunched => "captured (relaunched)".to_owned(),
            Ran::Fallback(why) => format!("eager (capture failed: {why})"),
        };
        println!(
            "  step {index}: {how:<41} allocator {:>10.1} µs   peak reserved {:>10} (eager run {:>10}, {:>10.1} µs)",
            row.1.as_secs_f64() * 1e6,
            Bytes(row.2).to_string(),
            Bytes(eager_row.2).to_string(),
            eager_row.1.as_secs_f64() * 1e6,
        );
    }
    let summary = |label: &str, rows: &[StepRow], pick: &dyn Fn(&Ran) -> bool| {
        let chosen: Vec<_> = rows.iter().filter(|(ran, ..)| pick(ran)).collect();
        if chosen.is_empty() {
            println!("  {label:<24} no steps");
            return;
        }
        let mean = chosen.iter().map(|r| r.1.as_secs_f64()).sum::<f64>() / chosen.len() as f64;
        println!("  {label:<24} {} steps, allocator {:.1} µs a step on average", chosen.len(), mean * 1e6);
    };
    let is_captured = |ran: &Ran| matches!(ran, Ran::Recorded { .. } | Ran::Relaunched);
    summary("eager run", eager, &|_| true);
    summary("captured run, eager", captured, &|ran| !is_captured(ran));
    summary("captured run, captured", captured, &is_captured);
    let peak_from_one = |rows: &[StepRow]| rows.iter().skip(1).map(|r| r.2).max().unwrap_or(0);
    let (eager_peak, captured_peak) = (peak_from_one(eager), peak_from_one(captured));
    let change = captured_peak as f64 / eager_peak.max(1) as f64 - 1.0;
    println!(
        "  peak reserved from step 1: eager run {}, captured run {} ({:+.1} %)",
        Bytes(eager_peak),
        Bytes(captured_peak),
        change * 100.0
    );
}

/// Runs a step's step-scoped events eagerly; returns the time spent in allocator calls.
fn eager(
    step: &steppool::Step,
    phase: Phase,
    stream: &steppool::Stream,
    events: &[&Event],
    driver: &Driver,
    touch: &Touch,
) -> Result<std::time::Duration, Error> {
    let (time, live) = serve(
        events,
        |bytes| step.alloc(phase, bytes, stream),
        |buffer, bytes| touch.touch(driver, buffer.ptr(), bytes, stream.raw()),
        Buffer::free,
    )?;
    // What the step still holds goes at its end.
    drop(live);
    Ok(time)
}

/// Captures a step's step-scoped events; returns the captured step and the time spent in
/// allocator calls during the capture.
fn capture_events(
    step: &steppool::Step,
    phase: Phase,
    stream: &steppool::Stream,
    memory: CaptureMemory,
    events: &[&Event],
    driver: &Driver,
    touch: &Touch,
) -> Result<(CapturedStep, std::time::Duration), Error> {
    let capture = step.capture(stream, &[phase], memory, CaptureMode::Global)?;
    let (time, live) = serve(
        events,
        |bytes| capture.alloc(phase, bytes),
        |buffer, bytes| touch.touch(driver, buffer.ptr(), bytes, stream.raw()),
        |buffer| capture.free(buffer),
    )?;
    for buffer in live {
        capture.free(buffer)?;
    }
    Ok((capture.end()?, time))
}

/// Serves `events` through `alloc` and `free`, each new buffer written by `touch`; returns the
/// time spent in `alloc` and `free` alone, and the buffers still live.
fn serve<B>(
    events: &[&Event],
    mut alloc: impl FnMut(u64) -> Result<B, Error>,
    mut touch: impl FnMut(&B, u64),
    mut free: impl FnMut(B) -> Result<(), Error>,
) -> Result<(std::time::Duration, Vec<B>), Error> {
    let mut time = std::time::Duration::ZERO;
    let mut live = HashMap::new();
    for event in events {
        match event.kind {
            EventKind::Alloc => {
                let started = std::time::Instant::now();
                let buffer = alloc(event.bytes)?;
                time += started.elapsed();
                touch(&buffer, event.bytes);
                live.insert(event.ptr, buffer);
            }
            EventKind::Free { .. } => {
                if let Some(buffer) = live.remove(&event.ptr) {
                    let started = std::time::Instant::now();
                    free(buffer)?;
                    time += started.elapsed();
                }
            }
            _ => {}
        }
    }
    Ok((time, live.into_values().collect()))
}

/// Every allocation and free of the run, in order, with the step each belongs to (0 for the
/// setup, which the first step's numbers include).
fn all_events<'a>(setup: &'a [Event], plans: &'a [StepPlan]) -> impl Iterator<Item = (usize, &'a Event)> {
    let steps = plans.iter().enumerate().flat_map(|(index, plan)| plan.events.iter().map(move |e| (index, e)));
    setup.iter().map(|e| (0, e)).chain(steps)
}

/// The run's events through a model of PyTorch's caching allocator on a device of `capacity`.
fn modelled(mode: TorchMode, setup: &[Event], plans: &[StepPlan], capacity: u64) -> Run {
    let (name, about) = match mode {
        TorchMode::Caching => ("torch-caching", "model of PyTorch's native caching allocator, default settings"),
        TorchMode::Expandable => ("torch-expandable", "model of PyTorch's caching allocator, expandable_segments:True"),
    };
    let mut run = Run { name, about, steps: Vec::new(), oom: None };
    let mut model = TorchAllocator::new(mode, capacity);
    let mut addresses: HashMap<u64, u64> = HashMap::new();
    let (mut live, mut step) = (0u64, (0u64, 0u64));
    for (index, event) in all_events(setup, plans) {
        while run.steps.len() < index {
            run.steps.push((plans[run.steps.len()].sequences.clone(), step.0, step.1, None));
            step = (live, model.reserved());
        }
        match event.kind {
            EventKind::Alloc => match model.alloc(event.bytes, 0) {
                Ok(addr) => {
                    addresses.insert(event.ptr, addr);
                    live += event.bytes;
                    step = (step.0.max(live), step.1.max(model.reserved()));
                }
                Err(oom) => {
                    let verdict = if live + event.bytes <= capacity { "fragmentation" } else { "demand" };
                    let why = format!(
                        "{} bytes requested with {} reserved; verdict: {verdict}",
                        oom.requested,
                        Bytes(oom.reserved)
                    );
                    run.oom = Some((index, why));
                    return run;
                }
            },
            EventKind::Free { .. } => {
                model.free(addresses.remove(&event.ptr).expect("the workload frees only what it allocated"));
                live -= event.bytes;
            }
            _ => {}
        }
    }
    while run.steps.len() < plans.len() {
        run.steps.push((plans[run.steps.len()].sequences.clone(), step.0, step.1, None));
        step = (live, model.reserved());
    }
    run
}

/// The offline limit: every allocation of the run (512-byte aligned, with its lifetime) packed by
/// the best of the packer's greedy orders, checked free of overlaps, as `steppool replay` prints
/// it. Its "peak reserved" is the packing's size, the same for every step; the table says when it
/// exceeds the capacity.
fn offline_limit(setup: &[Event], plans: &[StepPlan]) -> Result<Run, String> {
    let mut blocks: Vec<Block> = Vec::new();
    let mut open: HashMap<u64, usize> = HashMap::new();
    let mut step_live = vec![0u64; plans.len().max(1)];
    let mut live = 0u64;
    for (position, (index, event)) in all_events(setup, plans).enumerate() {
        let position = u32::try_from(position).map_err(|_| "too many events to pack".to_owned())?;
        match event.kind {
            EventKind::Alloc => {
                open.insert(event.ptr, blocks.len());
                let size = event.bytes.max(1).next_multiple_of(512);
                blocks.push(Block { size, start: position, end: Block::NEVER_FREED });
                live += event.bytes;
                step_live[index] = step_live[index].max(live);
            }
            EventKind::Free { .. } => {
                let block = open.remove(&event.ptr).ok_or("a free of an allocation never made")?;
                blocks[block].end = position;
                live -= event.bytes;
            }
            _ => {}
        }
    }
    let packing = pack(&blocks);
    if !is_valid(&blocks, &packing) {
        return Err(format!("the offline packing of {} allocations overlaps", blocks.len()));
    }
    let steps =
        plans.iter().zip(step_live).map(|(plan, used)| (plan.sequences.clone(), used, packing.size, None)).collect();
    Ok(Run { name: "offline limit", about: "every lifetime known in advance, packed offline", steps, oom: None })
}
