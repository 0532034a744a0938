//! Fragmentation seen coming: a loop whose free memory scatters step after step until an
//! allocation fails with memory free, watched by steppool's telemetry. The early warnings fire
//! steps before the out-of-memory, and its report gives the verdict. Then the same steps with
//! the lifetimes in their phases, which do not fragment: that run ends when the live data itself
//! outgrows the device, and its report says `demand`.
//!
//! ```text
//! cargo run --example fragmentation -- [--capacity 1GiB] [--steps 40]
//!     [--jsonl FILE] [--prometheus FILE] [--snapshot FILE] [--svg FILE] [--trace FILE]
//! ```
//!
//! Each step allocates activations, 32 MiB and 2 MiB more every step (a curriculum that lengthens
//! the sequences), and while they are live keeps a 48 MiB tensor for good (statistics computed
//! from them, say); then it frees the activations. In one pool the kept tensor lands above the
//! activations, the next step's activations, larger, no longer fit the hole they left, and the
//! pool grows past them: every step strands its activations' hole, whether the pool grows in
//! segments or, as the driver's does, in 32 MiB units of one range. With phases the kept tensors
//! have a pool of their own and the activations reuse theirs. The files get the run's name before their
//! extension (`--svg t.svg` writes `t-plain.svg` and `t-phases.svg`). It runs on a simulated
//! device of `--capacity`, whose placement is steppool's documented model.

use std::process::ExitCode;

use steppool::sys::bytes::{Bytes, parse_bytes};
use steppool::sys::sim::SimConfig;
use steppool::telemetry::json::JsonLines;
use steppool::{Buffer, Error, Phase, PhaseSpec, Runtime, Scope};
use steppool_examples::path_for;

const USAGE: &str = "usage: fragmentation [--capacity SIZE] [--steps N] [--jsonl FILE] [--prometheus FILE] \
     [--snapshot FILE] [--svg FILE] [--trace FILE]";

const MIB: u64 = 1 << 20;
const ACTIVATIONS: u64 = 32 * MIB;
const GROWTH: u64 = 2 * MIB;
const KEPT: u64 = 48 * MIB;

#[derive(Default)]
struct Options {
    capacity: u64,
    steps: u32,
    jsonl: Option<String>,
    prometheus: Option<String>,
    snapshot: Option<String>,
    svg: Option<String>,
    trace: Option<String>,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options { capacity: 1 << 30, steps: 40, ..Options::default() };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.to_owned());
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--capacity" => options.capacity = parse_bytes(&value).map_err(|e| format!("--capacity: {e}"))?,
            "--steps" => options.steps = value.parse().map_err(|_| format!("--steps: `{value}` is not a number"))?,
            "--jsonl" => options.jsonl = Some(value),
            "--prometheus" => options.prometheus = Some(value),
            "--snapshot" => options.snapshot = Some(value),
            "--svg" => options.svg = Some(value),
            "--trace" => options.trace = Some(value),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    Ok(options)
}

fn run(options: &Options, phases: bool) -> Result<(), Box<dyn std::error::Error>> {
    let name = if phases { "phases" } else { "plain" };
    let mut builder = Runtime::builder().simulated(SimConfig::with_capacity(options.capacity));
    if options.snapshot.is_some() || options.svg.is_some() || options.trace.is_some() {
        builder = builder.record_history(1 << 22);
    }
    let runtime = builder.build()?;
    runtime.telemetry().on_warning(|warning| println!("  ⚠ [{}] {warning}", warning.rule()));
    let mut jsonl = match &options.jsonl {
        Some(path) => Some(JsonLines::new(std::fs::File::create(path_for(path, name))?)),
        None => None,
    };
    let one_pool = runtime.declare_phase(PhaseSpec::new("default_pool", Scope::Persistent))?;
    let stream = runtime.device(0)?.create_stream()?;
    if phases {
        println!("phases: activations step-scoped, the kept tensors persistent, each in its own pool");
    } else {
        println!(
            "plain: one pool on one stream, release threshold raised (plain cudaMallocAsync), watched by steppool"
        );
    }

    let mut kept: Vec<Buffer<'static>> = Vec::new();
    let mut failure = None;
    for _ in 0..options.steps {
        let step = runtime.begin_step()?;
        let bytes = ACTIVATIONS + step.index() * GROWTH;
        let (activations, kept_phase) = if phases {
            (step.alloc(Phase::ACTIVATIONS, bytes, &stream), Phase::OPTIMIZER_STATE)
        } else {
            (runtime.alloc(one_pool, bytes, &stream), one_pool)
        };
        // The kept tensor is made while the activations are live; they go after it.
        let result = activations.and_then(|_activations| runtime.alloc(kept_phase, KEPT, &stream));
        let index = step.index();
        match result {
            Ok(buffer) => kept.push(buffer),
            Err(error) => {
                failure = Some((index, error));
                break;
            }
        }
        // Reading the loss: the host waits for the step.
        stream.synchronize()?;
        let report = step.end()?;
        let live: u64 = kept.iter().map(Buffer::len).sum();
        let reserved: u64 = report.phases.iter().map(|p| p.reserved).sum();
        println!(
            "  step {:>2}  live {:>9}  reserved {:>9}  fragmentation {:>5.1} %",
            report.index,
            Bytes(live).to_string(),
            Bytes(reserved).to_string(),
            steppool::fragmentation_ratio(report.peak_used(), report.peak_reserved()) * 100.0
        );
        if let Some(jsonl) = &mut jsonl {
            jsonl.step(&report)?;
        }
    }
    match failure {
        None => println!("  completed {} steps", options.steps),
        Some((index, Error::OutOfMemory(report))) => {
            println!("  step {index:>2}  out of memory:");
            for line in report.to_string().lines() {
                println!("    {line}");
            }
            if let Some(jsonl) = &mut jsonl {
                jsonl.oom(&report)?;
            }
        }
        Some((_, other)) => return Err(other.into()),
    }
    if let Some(path) = &options.jsonl {
        println!("  wrote {}", path_for(path, name));
    }
    if let Some(path) = &options.prometheus {
        let path = path_for(path, name);
        std::fs::write(&path, runtime.telemetry().metrics()?.to_prometheus())?;
        println!("  wrote {path}");
    }
    let history = runtime.telemetry().history();
    if let Some(path) = &options.snapshot {
        let path = path_for(path, name);
        history.write_memory_snapshot(&mut std::io::BufWriter::new(std::fs::File::create(&path)?))?;
        println!("  wrote {path} (open it at https://pytorch.org/memory_viz)");
    }
    if let Some(path) = &options.trace {
        let path = path_for(path, name);
        history.write_trace(&mut std::io::BufWriter::new(std::fs::File::create(&path)?))?;
        println!("  wrote {path}");
    }
    if let Some(path) = &options.svg {
        let path = path_for(path, name);
        std::fs::write(
            &path,
            history.timeline_svg(&format!("fragmentation example, {name}: used and reserved per phase")),
        )?;
        println!("  wrote {path}");
    }
    println!();
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    println!(
        "a simulated device of {}; each step: activations of {} and {} more every step, and {} kept for good\n",
        Bytes(options.capacity),
        Bytes(ACTIVATIONS),
        Bytes(GROWTH),
        Bytes(KEPT)
    );
    for phases in [false, true] {
        if let Err(error) = run(&options, phases) {
            eprintln!("fragmentation: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
