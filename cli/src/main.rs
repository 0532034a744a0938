//! `steppool`: inspect an allocation trace, or replay it through steppool's runtime on the
//! simulated device under each strategy.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use steppool_cli::replay::{self, Observer, ReplayOptions, STRATEGIES};
use steppool_cli::{analysis, read, report, svg};
use steppool_sys::bytes::{Bytes, parse_bytes};

/// Replays below this many operations get no progress bar.
const PROGRESS_FROM_OPS: u64 = 200_000;

#[derive(Parser)]
#[command(
    name = "steppool",
    version,
    about = "Inspect GPU allocation traces and replay them through steppool on the simulated device",
    long_about = "Inspect GPU allocation traces (RMM logs, PyTorch memory snapshots, PyTorch profiler traces, \
                  steppool traces) and replay \
                  them through steppool's runtime on the simulated device under each strategy: peak reserved \
                  memory, overhead over the live bytes, and the smallest device that runs them."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Events, steps, threads and streams, peak live bytes, sizes, and lifetimes by phase.
    Inspect {
        /// The trace: an RMM CSV log, a PyTorch snapshot pickle, a PyTorch profiler trace
        /// (`.pt.trace.json`, gzipped or not), or a steppool .jsonl trace. Its steps are its own,
        /// else a sidecar `<stem>.json`'s `steps_start_ns`, else inferred.
        trace: PathBuf,
        /// Also write the inspection as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Replay the trace under each strategy and each model of PyTorch's allocator and print peak
    /// reserved, overhead (whole run and steady), the distance to the offline limit, the outcome
    /// at the capacity, the smallest capacity that completes, and where the overhead goes.
    Replay {
        /// The trace: an RMM CSV log, a PyTorch snapshot pickle, a PyTorch profiler trace
        /// (`.pt.trace.json`, gzipped or not), or a steppool .jsonl trace. Its steps are its own,
        /// else a sidecar `<stem>.json`'s `steps_start_ns`, else inferred.
        trace: PathBuf,
        /// Memory of each simulated device (`80GiB`, `1.5 GiB`); default: the trace's device, or
        /// 80 GiB.
        #[arg(long, value_name = "SIZE", value_parser = size)]
        capacity: Option<u64>,
        /// A strategy (default-pool, phase-pools, arena, planned), a model of PyTorch's allocator
        /// (torch-caching, torch-expandable), or `all`.
        #[arg(long, value_name = "NAME", default_value = "all")]
        strategy: String,
        /// Arena slab size; default: an eighth of each phase's peak live bytes, 2 MiB to 256 MiB.
        #[arg(long, value_name = "SIZE", value_parser = size)]
        arena_slab: Option<u64>,
        /// The unit in which the simulated device's stream-ordered pools grow, allocations placed
        /// across unit boundaries (default: 32MiB, as an H200's driver does); `segments` for the
        /// uncalibrated model, a segment per growth of each request rounded to the 2 MiB granule.
        #[arg(long, value_name = "SIZE|segments", value_parser = pool_unit)]
        pool_unit: Option<PoolUnit>,
        /// Skip the bisection for the smallest capacity.
        #[arg(long)]
        no_bisect: bool,
        /// Also write the results as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Draw the reserved-vs-live timeline of each strategy into this SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// Saved plans (from `steppool plan` or `Runtime::saved_plans`): also replay
        /// `planned-loaded`, the planned strategy starting with them, planned from its first step.
        #[arg(long, value_name = "PLAN")]
        plan: Option<PathBuf>,
    },
    /// Replay the trace under the planned strategy and save the plans its step phase kept, for a
    /// later run to load (`Runtime::load_plans`, `steppool replay --plan`).
    Plan {
        /// The trace: an RMM CSV log, a PyTorch snapshot pickle, a PyTorch profiler trace
        /// (`.pt.trace.json`, gzipped or not), or a steppool .jsonl trace. Its steps are its own,
        /// else a sidecar `<stem>.json`'s `steps_start_ns`, else inferred.
        trace: PathBuf,
        /// The plan file to write (JSON, format `steppool-plans`).
        #[arg(short, long, value_name = "PLAN")]
        output: PathBuf,
        /// Memory of each simulated device; default: the trace's device, or 80 GiB.
        #[arg(long, value_name = "SIZE", value_parser = size)]
        capacity: Option<u64>,
    },
    /// Generate a trace of a workload pattern (steppool format) at the real models' sizes times
    /// --scale: bert_static, gpt2_varlen, llama_accum, resnet_varbatch, moe_routing,
    /// llama_ckpt_bf16, gpt2_kv_generate, train_eval, curriculum_accum, gpt2_token_budget,
    /// rl_generate_train.
    Synth {
        /// The pattern.
        pattern: String,
        /// The .jsonl file to write.
        output: PathBuf,
        /// Multiplies every size (1: a few GiB live).
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Steps (requests, for generation).
        #[arg(long, default_value_t = 8)]
        steps: u32,
        /// Seed of the draws (lengths, batches, routing).
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Leave out micro-step boundaries (steps only, as an RMM log with a step sidecar).
        #[arg(long)]
        no_micro_steps: bool,
    },
    /// Replay each trace under steppool's strategies on the GPU (the driver `STEPPOOL_DEVICE`
    /// selects, default the GPU) and on a simulated device of the same memory, and print both
    /// peaks: how far the simulated device's placement is from the driver's. Nothing else may run
    /// on the GPU meanwhile.
    Calibrate {
        /// The traces, as `replay` reads them.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// Also write the table as Markdown to this file.
        #[arg(long, value_name = "FILE")]
        markdown: Option<PathBuf>,
        /// Also write the figures as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// The unit in which the simulated device's pools grow, as for `replay` (default: 32MiB;
        /// `segments` for the uncalibrated model).
        #[arg(long, value_name = "SIZE|segments", value_parser = pool_unit)]
        pool_unit: Option<PoolUnit>,
    },
    /// Write the trace in steppool's own format (JSON lines), with its step boundaries.
    Convert {
        /// The trace to read.
        trace: PathBuf,
        /// The .jsonl file to write.
        output: PathBuf,
    },
}

fn size(text: &str) -> Result<u64, String> {
    parse_bytes(text).map_err(|e| e.to_string())
}

/// `--pool-unit`: a size, or `None` for the segment model.
#[derive(Clone, Copy, Debug)]
struct PoolUnit(Option<u64>);

impl PoolUnit {
    /// The unit `--pool-unit` asked for, else the simulated device's default.
    fn or_default(arg: Option<Self>) -> Option<u64> {
        arg.map_or(steppool_sys::sim::SimConfig::default().pool_unit, |Self(unit)| unit)
    }
}

fn pool_unit(text: &str) -> Result<PoolUnit, String> {
    steppool_sys::sim::parse_pool_unit(text).map(PoolUnit).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error)
            if error.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            // The reader of stdout went away (`steppool inspect x | head`): nothing left to say.
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("steppool: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Refuses to write `--json` over the trace's step sidecar (`<stem>.json` beside it), which the
/// next read of the trace would take for its steps.
fn refuse_sidecar(trace: &std::path::Path, json: Option<&std::path::Path>) -> anyhow::Result<()> {
    if let Some(json) = json
        && json == trace.with_extension("json")
    {
        anyhow::bail!(
            "--json {}: that is the trace's step sidecar, which the next read would take for its steps; write elsewhere (for example {})",
            json.display(),
            trace.with_extension("replay.json").display()
        );
    }
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Inspect { trace, json } => {
            refuse_sidecar(&trace, json.as_deref())?;
            let trace = read::read_trace(&trace)?;
            let analysis = analysis::analyse(&trace)?;
            let inspection = report::inspect(&trace, &analysis);
            out(&inspection.to_text())?;
            if let Some(path) = json {
                write(&path, serde_json::to_string_pretty(&inspection)? + "\n")?;
            }
        }
        Command::Replay { trace, capacity, strategy, arena_slab, pool_unit, no_bisect, json, svg, plan } => {
            refuse_sidecar(&trace, json.as_deref())?;
            let plans = plan.as_deref().map(read_plans).transpose()?;
            if let Some(slab) = arena_slab
                && let Err(error) = steppool::PhaseSpec::new("arena", steppool::Scope::Step)
                    .strategy(steppool::Strategy::Arena { slab_bytes: slab })
                    .validate()
            {
                anyhow::bail!("--arena-slab: {error}");
            }
            let mut strategies = replay::select(&strategy)?;
            if plans.is_some() {
                // Right after `planned`, or last when it was not selected.
                let at = strategies
                    .iter()
                    .position(|s| s.name() == replay::PLANNED.name)
                    .map_or(strategies.len(), |i| i + 1);
                strategies.insert(at, replay::Allocator::Steppool(&replay::PLANNED_LOADED));
            }
            let trace = read::read_trace(&trace)?;
            let analysis = analysis::analyse(&trace)?;
            let inspection = report::inspect(&trace, &analysis);
            let capacity = capacity.unwrap_or_else(|| {
                trace.devices.iter().filter_map(|d| d.total_bytes).max().unwrap_or(steppool_sys::sim::DEFAULT_CAPACITY)
            });
            let mut options = ReplayOptions::new(capacity);
            options.arena_slab = arena_slab;
            options.pool_unit = PoolUnit::or_default(pool_unit);
            options.bisect = !no_bisect;
            options.plans = plans.map(std::sync::Arc::new);
            let progress = Progress::new(analysis.ops.len() as u64);
            let results = replay::replay(&trace, &analysis, &strategies, &options, &progress)?;
            progress.bar.finish_and_clear();
            let limit = steppool_cli::limit::limit(&analysis)?;
            let mut text = report::replay_table(&inspection, capacity, options.pool_unit, &results, &limit);
            text.push('\n');
            for def in &strategies {
                text += &format!("{:<17} {}\n", def.name(), def.summary());
            }
            if strategies.iter().any(|s| s.name() == "arena") {
                let slabs: Vec<String> = analysis
                    .phases
                    .iter()
                    .zip(&analysis.facts)
                    .filter(|(p, _)| p.scope != steppool::Scope::Persistent && !p.carried)
                    .map(|(p, f)| {
                        format!("{} {}", p.name, Bytes(arena_slab.unwrap_or_else(|| replay::default_slab(f))))
                    })
                    .collect();
                if !slabs.is_empty() {
                    text += &format!("{:<17} arena slabs: {}\n", "", slabs.join(", "));
                }
            }
            out(&text)?;
            if let Some(path) = json {
                let document = report::replay_json(&inspection, capacity, &results, &limit);
                write(&path, serde_json::to_string_pretty(&document)? + "\n")?;
            }
            if let Some(path) = svg {
                write(&path, svg::timeline_svg(&trace, &results))?;
            }
        }
        Command::Plan { trace: path, output, capacity } => {
            let trace = read::read_trace(&path)?;
            let analysis = analysis::analyse(&trace)?;
            let capacity = capacity.unwrap_or_else(|| {
                trace.devices.iter().filter_map(|d| d.total_bytes).max().unwrap_or(steppool_sys::sim::DEFAULT_CAPACITY)
            });
            let progress = Progress::new(analysis.ops.len() as u64);
            let (run, plans) = replay::record_plans(&trace, &analysis, &ReplayOptions::new(capacity), &progress)?;
            progress.bar.finish_and_clear();
            if let Some(failure) = &run.failure {
                anyhow::bail!(
                    "{}: the planned replay stopped at {} on a device of {}: {}; give a larger --capacity",
                    path.display(),
                    failure.location,
                    Bytes(capacity),
                    failure.message
                );
            }
            write(&output, plans.to_json())?;
            let mut text = format!("wrote {}: plans of the planned replay of {}\n", output.display(), path.display());
            for phase in &plans.phases {
                for plan in &phase.plans {
                    let bound = plan.lower_bound();
                    text += &format!(
                        "  phase {}: {} allocations in a slab of {} ({:.3}x its peak of live bytes, {})\n",
                        phase.phase,
                        plan.blocks.len(),
                        Bytes(plan.bytes),
                        if bound == 0 { 1.0 } else { plan.bytes as f64 / bound as f64 },
                        Bytes(bound)
                    );
                }
            }
            if plans.phases.is_empty() {
                text += "  no plans: the trace has no step-scoped allocations\n";
            }
            out(&text)?;
        }
        Command::Synth { pattern, output, scale, steps, seed, no_micro_steps } => {
            let pattern = steppool_cli::patterns::Pattern::from_name(&pattern)?;
            let options = steppool_cli::patterns::PatternOptions { steps, seed, scale, micro_steps: !no_micro_steps };
            let trace = steppool_cli::patterns::generate(pattern, &options)?;
            let mut text = Vec::new();
            steppool_trace::jsonl::write(&trace, &mut text)?;
            write(&output, text)?;
            eprintln!("wrote {} ({} events)", output.display(), trace.events.len());
        }
        Command::Calibrate { traces, markdown, json, pool_unit } => {
            let pool_unit = PoolUnit::or_default(pool_unit);
            let driver = steppool_sys::Driver::from_env_or(steppool_sys::Selection::Cuda)?;
            let mut read_traces = Vec::with_capacity(traces.len());
            for path in &traces {
                let trace = read::read_trace(path)?;
                let analysis = analysis::analyse(&trace)?;
                let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into());
                read_traces.push((name, trace, analysis));
            }
            let ops = read_traces.iter().map(|(_, _, a)| a.ops.len() as u64).sum::<u64>();
            let progress = Progress::new(ops * 2 * STRATEGIES.len() as u64);
            let borrowed: Vec<_> = read_traces.iter().map(|(n, t, a)| (n.clone(), t, a)).collect();
            let calibration = steppool_cli::calibrate::calibrate(&borrowed, &driver, pool_unit, &progress)?;
            progress.bar.finish_and_clear();
            let text = calibration.markdown();
            out(&text)?;
            if let Some(path) = markdown {
                write(&path, text)?;
            }
            if let Some(path) = json {
                write(&path, serde_json::to_string_pretty(&calibration.json())? + "\n")?;
            }
        }
        Command::Convert { trace, output } => {
            let trace = read::read_trace(&trace)?;
            let mut text = Vec::new();
            steppool_trace::jsonl::write(&trace, &mut text)?;
            write(&output, text)?;
            let names: Vec<&str> = STRATEGIES.iter().map(|s| s.name).collect();
            eprintln!(
                "wrote {} ({} events); replay it with `steppool replay {}` ({})",
                output.display(),
                trace.events.len(),
                output.display(),
                names.join(", ")
            );
        }
    }
    Ok(())
}

/// Reads and checks a plan file.
fn read_plans(path: &Path) -> anyhow::Result<steppool_trace::plans::PlanFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let plans = steppool_trace::plans::PlanFile::from_json(&text).with_context(|| format!("{}", path.display()))?;
    if plans.phase(replay::STEP_PHASE).is_none() {
        anyhow::bail!(
            "{}: no plans for phase `{}`, the step phase of the planned replay (the file has {:?})",
            path.display(),
            replay::STEP_PHASE,
            plans.phases.iter().map(|p| p.phase.as_str()).collect::<Vec<_>>()
        );
    }
    Ok(plans)
}

/// Prints to stdout, returning a broken pipe as an error rather than panicking.
fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

fn write(path: &Path, contents: impl AsRef<[u8]>) -> anyhow::Result<()> {
    std::fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))
}

/// A progress bar on stderr, only on a terminal and only for long replays.
struct Progress {
    bar: ProgressBar,
}

impl Progress {
    fn new(ops: u64) -> Self {
        let visible = std::io::stderr().is_terminal() && ops >= PROGRESS_FROM_OPS;
        let target = if visible { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
        let bar = ProgressBar::with_draw_target(Some(ops), target);
        bar.set_style(
            ProgressStyle::with_template("{msg:32} [{bar:40}] {human_pos}/{human_len} ops, {elapsed} (eta {eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        Self { bar }
    }
}

impl Observer for Progress {
    fn start(&self, strategy: &str, capacity: u64, ops: u64) {
        self.bar.set_length(ops);
        self.bar.set_position(0);
        self.bar.set_message(format!("{strategy} at {}", Bytes(capacity)));
    }

    fn advance(&self, ops: u64) {
        self.bar.inc(ops);
    }
}
