//! What the command prints and writes: the inspection of a trace and the replay table, as text
//! and as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use steppool::PageTraffic;
use steppool_sys::bytes::Bytes;
use steppool_sys::sim::DEFAULT_GRANULE;

use steppool_trace::analysis::Analysis;
use steppool_trace::{EventKind, StepSource, Trace};

use crate::breakdown::Breakdown;
use crate::limit::Limit;
use crate::replay::{StrategyResult, is_torch, recommended};

/// One bucket of the size histogram: allocations of more than `above_bytes` and at most
/// `up_to_bytes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SizeBucket {
    /// Exclusive lower bound (0 for the first bucket).
    pub above_bytes: u64,
    /// Inclusive upper bound, a power of two.
    pub up_to_bytes: u64,
    /// Allocations in the bucket.
    pub allocations: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// One stream of the trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StreamSummary {
    /// The device.
    pub device: u32,
    /// The stream handle, in hex.
    pub stream: String,
    /// Allocations on it.
    pub allocations: u64,
}

/// Lifetimes of one phase (tagged, or inferred from lifetimes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseSummary {
    /// The phase.
    pub name: String,
    /// Its scope: `persistent`, `step` or `micro_step`.
    pub scope: String,
    /// `tagged` by the trace or `inferred` from lifetimes.
    pub origin: &'static str,
    /// Allocations.
    pub allocations: u64,
    /// Bytes allocated in total.
    pub bytes: u64,
    /// The largest allocation.
    pub largest_bytes: u64,
    /// The most bytes live at once.
    pub peak_live_bytes: u64,
    /// Allocations never freed.
    pub never_freed: u64,
    /// Median lifetime of the freed ones.
    pub median_lifetime_ns: u64,
    /// Longest lifetime of the freed ones.
    pub max_lifetime_ns: u64,
}

/// `steppool inspect`'s report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Inspection {
    /// The trace file.
    pub trace: String,
    /// Its format.
    pub format: &'static str,
    /// What recorded it, if it says.
    pub driver: Option<String>,
    /// Events in the file (allocations, frees, failures, boundaries; step boundaries added from a
    /// sidecar or by inference are counted in `steps`, not here).
    pub events: u64,
    /// Allocations.
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Failed allocations recorded.
    pub allocation_failures: u64,
    /// Steps.
    pub steps: u64,
    /// Micro-steps.
    pub micro_steps: u64,
    /// Where the steps came from.
    pub step_source: String,
    /// Thread names.
    pub threads: Vec<String>,
    /// Streams, with their allocations.
    pub streams: Vec<StreamSummary>,
    /// From the first event to the last, on the trace's clock.
    pub duration_ns: u64,
    /// The highest sum of live bytes.
    pub peak_live_bytes: u64,
    /// Where it was reached.
    pub peak_live_at: String,
    /// Bytes live at the end.
    pub live_at_end_bytes: u64,
    /// Sizes, in power-of-two buckets.
    pub size_histogram: Vec<SizeBucket>,
    /// Lifetimes by phase.
    pub phases: Vec<PhaseSummary>,
    /// Counted warnings, one line per kind.
    pub warnings: Vec<String>,
}

/// Builds the inspection of `trace`.
pub fn inspect(trace: &Trace, analysis: &Analysis) -> Inspection {
    let added_boundaries = !matches!(trace.steps, StepSource::Trace);
    let events = trace.events.iter().filter(|e| !(added_boundaries && e.kind.is_boundary())).count() as u64;
    let count = |f: fn(&EventKind) -> bool| trace.events.iter().filter(|e| f(&e.kind)).count() as u64;
    let mut histogram: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let mut per_stream = vec![0u64; analysis.streams.len()];
    for allocation in &analysis.allocations {
        let bucket = 64 - (allocation.bytes - 1).leading_zeros();
        let entry = histogram.entry(bucket).or_default();
        entry.0 += 1;
        entry.1 += allocation.bytes;
        per_stream[usize::from(allocation.stream)] += 1;
    }
    let size_histogram = histogram
        .into_iter()
        .map(|(bucket, (allocations, bytes))| SizeBucket {
            above_bytes: if bucket == 0 { 0 } else { 1u64 << (bucket - 1) },
            up_to_bytes: 1u64.checked_shl(bucket).unwrap_or(u64::MAX),
            allocations,
            bytes,
        })
        .collect();
    let streams = analysis
        .streams
        .iter()
        .zip(per_stream)
        .map(|(&(device, stream), allocations)| StreamSummary { device, stream: format!("{stream:#x}"), allocations })
        .collect();
    let phases = analysis
        .phases
        .iter()
        .zip(&analysis.facts)
        .map(|(phase, f)| PhaseSummary {
            name: phase.name.clone(),
            scope: phase.scope.name().to_owned(),
            origin: if phase.tagged { "tagged" } else { "inferred" },
            allocations: f.allocations,
            bytes: f.bytes,
            largest_bytes: f.largest,
            peak_live_bytes: f.peak_live,
            never_freed: f.never_freed,
            median_lifetime_ns: f.median_lifetime_ns,
            max_lifetime_ns: f.max_lifetime_ns,
        })
        .collect();
    let first = trace.events.iter().map(|e| e.t_ns).min().unwrap_or(0);
    let last = trace.events.iter().map(|e| e.t_ns).max().unwrap_or(0);
    let mut warnings = trace.warnings.clone();
    warnings.merge(&analysis.warnings);
    Inspection {
        trace: trace.path.display().to_string(),
        format: trace.format.name(),
        driver: trace.driver.clone(),
        events,
        allocations: count(|k| matches!(k, EventKind::Alloc)),
        frees: count(|k| matches!(k, EventKind::Free { .. })),
        allocation_failures: analysis.failures,
        steps: analysis.steps,
        micro_steps: analysis.micro_steps,
        step_source: trace.steps.to_string(),
        threads: trace.threads.clone(),
        streams,
        duration_ns: last - first,
        peak_live_bytes: analysis.peak_live_bytes,
        peak_live_at: trace
            .events
            .get(analysis.peak_live_event)
            .map_or_else(|| "no allocation".to_owned(), |e| e.location.to_string()),
        live_at_end_bytes: analysis.live_at_end,
        size_histogram,
        phases,
        warnings: warnings.lines(),
    }
}

/// A duration in the largest unit that keeps it readable.
pub fn duration(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} µs", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

impl Inspection {
    /// The inspection as text.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let w = &mut out;
        let _ = writeln!(w, "trace       {} ({})", self.trace, self.format);
        if let Some(driver) = &self.driver {
            let _ = writeln!(w, "recorded by {driver}");
        }
        let _ = writeln!(
            w,
            "events      {} ({} allocations, {} frees, {} failed allocations) over {}",
            self.events,
            self.allocations,
            self.frees,
            self.allocation_failures,
            duration(self.duration_ns)
        );
        let micro = if self.micro_steps > 0 { format!(", {} micro-steps", self.micro_steps) } else { String::new() };
        let _ = writeln!(w, "steps       {}{micro} ({})", self.steps, self.step_source);
        let _ = writeln!(w, "threads     {}: {}", self.threads.len(), abbreviate(&self.threads));
        let streams: Vec<String> = self
            .streams
            .iter()
            .map(|s| format!("device {} stream {} ({} allocations)", s.device, s.stream, s.allocations))
            .collect();
        let _ = writeln!(w, "streams     {}: {}", self.streams.len(), abbreviate(&streams));
        let _ = writeln!(
            w,
            "peak live   {} ({} bytes, at {})",
            Bytes(self.peak_live_bytes),
            self.peak_live_bytes,
            self.peak_live_at
        );
        let _ = writeln!(w, "live at end {}", Bytes(self.live_at_end_bytes));
        let _ = writeln!(w, "\nsizes");
        let largest = self.size_histogram.iter().map(|b| b.allocations).max().unwrap_or(1).max(1);
        for bucket in &self.size_histogram {
            let bar = "#".repeat(((bucket.allocations * 40).div_ceil(largest)) as usize);
            let _ = writeln!(
                w,
                "  {:>10} – {:<10} {:>9} {:>11}  {bar}",
                Bytes(bucket.above_bytes + 1).to_string(),
                Bytes(bucket.up_to_bytes).to_string(),
                bucket.allocations,
                Bytes(bucket.bytes).to_string()
            );
        }
        let _ = writeln!(w, "\nlifetimes by phase");
        let _ = writeln!(
            w,
            "  {:<20} {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>6}",
            "phase", "scope", "origin", "allocs", "bytes", "peak live", "median life", "max life", "kept"
        );
        for p in &self.phases {
            let _ = writeln!(
                w,
                "  {:<20} {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>6}",
                p.name,
                p.scope,
                p.origin,
                p.allocations,
                Bytes(p.bytes).to_string(),
                Bytes(p.peak_live_bytes).to_string(),
                life(p.allocations - p.never_freed, p.median_lifetime_ns),
                life(p.allocations - p.never_freed, p.max_lifetime_ns),
                p.never_freed
            );
        }
        if !self.warnings.is_empty() {
            let _ = writeln!(w, "\nwarnings");
            for line in &self.warnings {
                let _ = writeln!(w, "  {line}");
            }
        }
        out
    }
}

/// A lifetime, or `-` when no allocation of the phase was freed.
fn life(freed: u64, ns: u64) -> String {
    if freed == 0 { "-".to_owned() } else { duration(ns) }
}

fn abbreviate(items: &[String]) -> String {
    if items.len() <= 4 {
        items.join(", ")
    } else {
        format!("{}, … and {} more", items[..3].join(", "), items.len() - 3)
    }
}

/// One strategy (or PyTorch model) in `steppool replay --json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ResultJson {
    /// The strategy.
    pub strategy: &'static str,
    /// `steppool` for the runtime's strategies, `torch-model` for the models of PyTorch's
    /// allocator.
    pub kind: &'static str,
    /// Peak reserved bytes at the chosen capacity (up to the failure, if one happened).
    pub peak_reserved_bytes: u64,
    /// Peak reserved / peak live.
    pub overhead: f64,
    /// `1 - peak live / peak reserved`.
    pub fragmentation_ratio: f64,
    /// Peak reserved from the second step's beginning on; null with fewer than two steps.
    pub steady_peak_reserved_bytes: Option<u64>,
    /// Steady peak reserved / peak live over the same steps; null with fewer than two steps.
    pub steady_overhead: Option<f64>,
    /// Peak reserved − the offline limit (`limit_bytes`).
    pub limit_distance_bytes: i64,
    /// Per step, its peaks of reserved and live bytes (up to the failure, if one happened): which
    /// step sets the run's peak.
    pub steps: Vec<StepPeakJson>,
    /// The step, from 0, in which the reservation first reached `peak_reserved_bytes`; null when
    /// it did before the first step (or `steps` is empty).
    pub peak_step: Option<u32>,
    /// Where peak reserved − peak live goes (see the breakdown's definitions); null for a run
    /// that did not complete.
    pub breakdown: Option<Breakdown>,
    /// Whether the replay completed at the chosen capacity.
    pub completed: bool,
    /// The smallest capacity per device that completes (to the 2 MiB granule); null when none
    /// does or bisection was skipped.
    pub min_capacity_bytes: Option<u64>,
    /// Where it failed at the chosen capacity.
    pub failure: Option<FailureJson>,
    /// What the planned strategy's plans served over the run (up to the failure, if one
    /// happened); null for strategies without plans.
    pub plans: Option<PlansJson>,
    /// Pages mapped into and unmapped from the runtime's ranges; null for the models of
    /// PyTorch's allocator.
    pub page_traffic: Option<PageTrafficJson>,
}

/// A run's page traffic in `steppool replay --json`: each page costs time to map and unmap on a
/// GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PageTrafficJson {
    /// Bytes of pages mapped over the run.
    pub mapped_bytes: u64,
    /// Bytes of pages unmapped over the run.
    pub unmapped_bytes: u64,
    /// Bytes mapped and unmapped per step from the second step on; null with fewer than two
    /// steps.
    pub steady_bytes_per_step: Option<u64>,
}

/// One step's peaks in `steppool replay --json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StepPeakJson {
    /// The highest reserved bytes during the step.
    pub peak_reserved_bytes: u64,
    /// The highest live bytes during the step.
    pub peak_live_bytes: u64,
}

/// The planned strategy's plans over a run in `steppool replay --json`: the runtime's
/// [`PlanStats`](steppool::PlanStats) counters summed over the steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PlansJson {
    /// Allocations served at their planned offset.
    pub planned_allocations: u64,
    /// Allocations served otherwise (recording scopes, and allocations after a deviation).
    pub unplanned_allocations: u64,
    /// Allocations a plan was in use for but could not serve.
    pub deviations: u64,
    /// Scopes that deviated from their plan.
    pub deviated_scopes: u64,
    /// Scopes served from a plan, deviated or not.
    pub planned_scopes: u64,
}

/// A failed allocation in `steppool replay --json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailureJson {
    /// The event's index in the trace.
    pub event: usize,
    /// Its line or record.
    pub location: String,
    /// Bytes requested.
    pub requested_bytes: u64,
    /// The runtime phase (empty for the PyTorch models).
    pub phase: String,
    /// `fragmentation` or `demand`.
    pub verdict: String,
}

/// `steppool replay --json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayJson {
    /// The trace file.
    pub trace: String,
    /// Its events (as in `inspect`).
    pub events: u64,
    /// The trace's peak of live bytes.
    pub peak_live_bytes: u64,
    /// Capacity of each simulated device.
    pub capacity_bytes: u64,
    /// Steps replayed.
    pub steps: u64,
    /// Where the steps came from.
    pub step_source: String,
    /// The recommended strategy: of steppool's strategies that completed, the one with the least
    /// peak reserved (the earlier on ties); never a PyTorch model; null when none completed.
    pub recommended: Option<&'static str>,
    /// The offline limit: the whole trace packed per device (512-byte aligned sizes) by the best
    /// of several greedy orders, checked free of overlaps.
    pub limit_bytes: u64,
    /// The peak of 512-byte aligned live bytes per device, summed: no packing is below it.
    pub limit_lower_bound_bytes: u64,
    /// Persistent allocations packed apart plus one region reused by every step; null without
    /// steps.
    pub per_step_limit_bytes: Option<u64>,
    /// One entry per strategy, then per PyTorch model.
    pub results: Vec<ResultJson>,
}

/// The JSON of a replay.
pub fn replay_json(inspection: &Inspection, capacity: u64, results: &[StrategyResult], limit: &Limit) -> ReplayJson {
    ReplayJson {
        trace: inspection.trace.clone(),
        events: inspection.events,
        peak_live_bytes: inspection.peak_live_bytes,
        capacity_bytes: capacity,
        steps: inspection.steps,
        step_source: inspection.step_source.clone(),
        recommended: recommended(results),
        limit_bytes: limit.bytes,
        limit_lower_bound_bytes: limit.lower_bound_bytes,
        per_step_limit_bytes: limit.per_step_bytes,
        results: results
            .iter()
            .map(|r| ResultJson {
                strategy: r.run.strategy,
                kind: if is_torch(r.run.strategy) { "torch-model" } else { "steppool" },
                peak_reserved_bytes: r.run.peak_reserved_bytes,
                overhead: r.overhead(),
                fragmentation_ratio: r.fragmentation_ratio(),
                steady_peak_reserved_bytes: r.run.steady_peak_reserved_bytes,
                steady_overhead: r.steady_overhead(),
                limit_distance_bytes: r.run.peak_reserved_bytes as i64 - limit.bytes as i64,
                steps: r
                    .run
                    .step_peaks
                    .iter()
                    .map(|s| StepPeakJson {
                        peak_reserved_bytes: s.peak_reserved_bytes,
                        peak_live_bytes: s.peak_live_bytes,
                    })
                    .collect(),
                peak_step: r.run.peak_step,
                breakdown: r.breakdown,
                completed: r.run.completed(),
                min_capacity_bytes: r.min_capacity_bytes,
                failure: r.run.failure.as_ref().map(|f| FailureJson {
                    event: f.event,
                    location: f.location.to_string(),
                    requested_bytes: f.requested,
                    phase: f.phase.clone(),
                    verdict: f.verdict.to_string(),
                }),
                plans: r.run.plans.map(|p| PlansJson {
                    planned_allocations: p.planned,
                    unplanned_allocations: p.unplanned,
                    deviations: p.deviations,
                    deviated_scopes: p.deviated_scopes,
                    planned_scopes: p.planned_scopes,
                }),
                page_traffic: r.run.pages.map(|pages| PageTrafficJson {
                    mapped_bytes: pages.whole.mapped,
                    unmapped_bytes: pages.whole.unmapped,
                    steady_bytes_per_step: r.run.steady_page_traffic_per_step(),
                }),
            })
            .collect(),
    }
}

/// A signed byte count: `+1.5 MiB`, `-512 B`.
fn signed(bytes: i64) -> String {
    let sign = match bytes.signum() {
        -1 => "-",
        0 => "",
        _ => "+",
    };
    format!("{sign}{}", Bytes(bytes.unsigned_abs()))
}

/// How the simulated device's pools grow, for a header: `32 MiB pool units` or `pools in
/// segments` ([`ReplayOptions::pool_unit`](crate::replay::ReplayOptions::pool_unit)).
pub fn pool_model(pool_unit: Option<u64>) -> String {
    pool_unit.map_or_else(|| "pools in segments".to_owned(), |unit| format!("{} pool units", Bytes(unit)))
}

/// The step in which a run first reached its peak reservation, from 0: `setup` before the first
/// step, `-` for a trace without steps.
fn peak_step(run: &crate::replay::Run) -> String {
    match (run.step_peaks.is_empty(), run.peak_step) {
        (true, _) => "-".to_owned(),
        (false, None) => "setup".to_owned(),
        (false, Some(step)) => step.to_string(),
    }
}

/// The replay tables: the results, then the breakdown of each completed run; `pool_unit` is the
/// simulated device's ([`ReplayOptions::pool_unit`](crate::replay::ReplayOptions::pool_unit)).
pub fn replay_table(
    inspection: &Inspection,
    capacity: u64,
    pool_unit: Option<u64>,
    results: &[StrategyResult],
    limit: &Limit,
) -> String {
    let mut out = String::new();
    let w = &mut out;
    let micro =
        if inspection.micro_steps > 0 { format!(", {} micro-steps", inspection.micro_steps) } else { String::new() };
    let _ = writeln!(
        w,
        "trace: {} ({}, {} events, {} steps{micro} {})",
        inspection.trace, inspection.format, inspection.events, inspection.steps, inspection.step_source
    );
    let _ = writeln!(
        w,
        "peak live: {} ({} bytes); simulated device of {} per trace device, {} granules, {}",
        Bytes(inspection.peak_live_bytes),
        inspection.peak_live_bytes,
        Bytes(capacity),
        Bytes(DEFAULT_GRANULE),
        pool_model(pool_unit)
    );
    let per_step = limit.per_step_bytes.map_or_else(String::new, |b| format!("; per-step limit {}", Bytes(b)));
    let _ = writeln!(
        w,
        "offline limit: {} ({} bytes; lower bound {}){per_step}",
        Bytes(limit.bytes),
        limit.bytes,
        Bytes(limit.lower_bound_bytes)
    );
    let best = recommended(results);
    let at = format!("at {}", Bytes(capacity));
    let _ = writeln!(
        w,
        "\n  {:<17} {:>13} {:>9} {:>9} {:>9} {:>22} {:>24} {:>15}",
        "strategy", "peak reserved", "overhead", "steady", "peak step", "vs limit", at, "smallest device"
    );
    for r in results {
        let outcome = match &r.run.failure {
            None => "completed".to_owned(),
            Some(f) => format!("OOM at {} ({})", f.location, f.verdict),
        };
        let smallest = match (r.min_capacity_bytes, r.bisection_runs) {
            (Some(bytes), _) => Bytes(bytes).to_string(),
            (None, 0) => "-".to_owned(),
            (None, _) => "none".to_owned(),
        };
        // A run that stopped short did not reach the trace's peak: its ratios would mislead.
        let (overhead, steady, peak_step, distance) = match r.run.failure {
            None => {
                let over = r.run.peak_reserved_bytes as i64 - limit.bytes as i64;
                let percent = if limit.bytes == 0 { 0.0 } else { over as f64 * 100.0 / limit.bytes as f64 };
                (
                    format!("{:.3}×", r.overhead()),
                    r.steady_overhead().map_or_else(|| "-".to_owned(), |s| format!("{s:.3}×")),
                    peak_step(&r.run),
                    format!("{} ({percent:+.1} %)", signed(over)),
                )
            }
            Some(_) => ("-".to_owned(), "-".to_owned(), "-".to_owned(), "-".to_owned()),
        };
        let mark = if best == Some(r.run.strategy) { "*" } else { " " };
        let _ = writeln!(
            w,
            "{mark} {:<17} {:>13} {:>9} {:>9} {:>9} {:>22} {:>24} {:>15}",
            r.run.strategy,
            Bytes(r.run.peak_reserved_bytes).to_string(),
            overhead,
            steady,
            peak_step,
            distance,
            outcome,
            smallest
        );
    }
    match best {
        Some(name) => {
            let _ = writeln!(w, "* recommended: {name} (least peak reserved of steppool's strategies that completed)");
        }
        None if results.iter().any(|r| !is_torch(r.run.strategy)) => {
            let _ = writeln!(w, "no steppool strategy completed at this capacity: none recommended");
        }
        // Only PyTorch models were replayed: they are compared, never recommended.
        None => {}
    }
    if results.iter().any(|r| r.breakdown.is_some()) {
        let unattributed = results.iter().filter_map(|r| r.breakdown).any(|b| b.unattributed_bytes != 0);
        let _ = writeln!(w, "\npeak reserved − peak live, at the reserved peak");
        let _ = write!(
            w,
            "  {:<17} {:>12} {:>12} {:>14} {:>12} {:>12} {:>12}",
            "strategy", "= total", "rounding", "granule tails", "segregation", "holes", "peak shift"
        );
        let _ = writeln!(w, "{}", if unattributed { format!(" {:>13}", "unattributed") } else { String::new() });
        for r in results {
            let Some(b) = r.breakdown else { continue };
            let _ = write!(
                w,
                "  {:<17} {:>12} {:>12} {:>14} {:>12} {:>12} {:>12}",
                r.run.strategy,
                signed(b.total()),
                Bytes(b.rounding_bytes).to_string(),
                Bytes(b.granule_tail_bytes).to_string(),
                Bytes(b.segregation_bytes).to_string(),
                Bytes(b.hole_bytes).to_string(),
                signed(b.peak_shift_bytes)
            );
            let _ = writeln!(
                w,
                "{}",
                if unattributed { format!(" {:>13}", signed(b.unattributed_bytes)) } else { String::new() }
            );
        }
    }
    if results.iter().any(|r| r.run.plans.is_some()) {
        let _ = writeln!(w, "\nplans over the run (the runtime's plan counters, summed over the steps)");
        let _ = writeln!(
            w,
            "  {:<17} {:>12} {:>12} {:>11} {:>24}",
            "strategy", "planned", "unplanned", "deviations", "deviated/planned scopes"
        );
        for r in results {
            let Some(p) = r.run.plans else { continue };
            let total = p.planned + p.unplanned;
            let share = if total == 0 { 0.0 } else { p.planned as f64 * 100.0 / total as f64 };
            let _ = writeln!(
                w,
                "  {:<17} {:>12} {:>12} {:>11} {:>24}",
                r.run.strategy,
                format!("{} ({share:.1} %)", p.planned),
                p.unplanned,
                p.deviations,
                format!("{} / {}", p.deviated_scopes, p.planned_scopes)
            );
        }
    }
    if results.iter().any(|r| r.run.pages.is_some_and(|pages| pages.whole != PageTraffic::default())) {
        let _ = writeln!(
            w,
            "\npage traffic (pages mapped and unmapped in ranges that grow in place: some 70 µs a 2 MiB page on an H200)"
        );
        let _ = writeln!(w, "  {:<17} {:>14} {:>14} {:>22}", "strategy", "mapped", "unmapped", "per step, from 2nd");
        for r in results {
            let Some(pages) = r.run.pages else { continue };
            let per_step =
                r.run.steady_page_traffic_per_step().map_or_else(|| "-".to_owned(), |bytes| Bytes(bytes).to_string());
            let _ = writeln!(
                w,
                "  {:<17} {:>14} {:>14} {:>22}",
                r.run.strategy,
                Bytes(pages.whole.mapped).to_string(),
                Bytes(pages.whole.unmapped).to_string(),
                per_step
            );
        }
    }
    if !inspection.warnings.is_empty() {
        let _ = writeln!(w, "\nwarnings");
        for line in &inspection.warnings {
            let _ = writeln!(w, "  {line}");
        }
    }
    out
}
