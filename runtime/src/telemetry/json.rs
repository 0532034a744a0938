//! JSON lines: one object per step report, warning and OOM report, for log pipelines.
//!
//! Every object has a `"type"` (`"step"`, `"warning"`, `"oom"`); sizes are bytes, times are
//! seconds, ratios are between 0 and 1. The field names are the brief's vocabulary.

use std::io::{self, Write};

use serde_json::{Value, json};

use super::{Warning, WarningKind};
use crate::error::{OomReport, Verdict};
use crate::report::StepReport;
use crate::report::{Breakdown, FreeSpace};

fn free_space(space: Option<FreeSpace>) -> Value {
    match space {
        Some(space) => json!({
            "largest_free_bytes": space.largest_free,
            "total_free_bytes": space.total_free,
            "free_space_fragmentation": space.fragmentation(),
        }),
        None => Value::Null,
    }
}

/// An overhead breakdown as a JSON object, with the field names of `steppool replay --json`.
fn breakdown(breakdown: &Breakdown) -> Value {
    json!({
        "rounding_bytes": breakdown.rounding_bytes,
        "granule_tail_bytes": breakdown.granule_tail_bytes,
        "segregation_bytes": breakdown.segregation_bytes,
        "hole_bytes": breakdown.hole_bytes,
        "unattributed_bytes": breakdown.unattributed_bytes,
        "peak_shift_bytes": breakdown.peak_shift_bytes,
    })
}

/// A step report as a JSON object.
pub fn step_json(report: &StepReport) -> Value {
    let phases: Vec<Value> = report
        .phases
        .iter()
        .map(|p| {
            json!({
                "phase": p.name,
                "scope": p.scope.name(),
                "strategy": p.strategy.name(),
                "peak_used_bytes": p.peak_used,
                "peak_reserved_bytes": p.peak_reserved,
                "reserved_bytes": p.reserved,
                "fragmentation_ratio": p.fragmentation_ratio(),
                "released_bytes": p.released,
                "allocations": p.allocations,
                "frees": p.frees,
                "free_space": free_space(p.free_space),
                "breakdown": breakdown(&p.breakdown),
                "pages_mapped_bytes": p.pages.mapped,
                "pages_unmapped_bytes": p.pages.unmapped,
            })
        })
        .collect();
    let pools: Vec<Value> = report
        .pools
        .iter()
        .map(|p| {
            json!({
                "device": p.pool.device,
                "stream": p.pool.stream,
                "phase": p.phase_name,
                "used_bytes": p.used,
                "peak_used_bytes": p.peak_used,
                "reserved_bytes": p.reserved,
                "peak_reserved_bytes": p.peak_reserved,
                "peak_served_bytes": p.peak_served,
                "granule_bytes": p.granule,
                "breakdown": breakdown(&p.breakdown),
                "allocations": p.allocations,
                "frees": p.frees,
                "released_bytes": p.released,
                "largest_request_bytes": p.largest_request,
                "free_space": free_space(p.free_space),
                "plan": p.plan.as_ref().map(|plan| json!({
                    "hit_rate": plan.hit_rate(),
                    "planned": plan.planned,
                    "unplanned": plan.unplanned,
                    "deviations": plan.deviations,
                    "missing": plan.missing,
                    "replans": plan.replans,
                    "moves": plan.moves,
                    "slab_bytes": plan.slab_bytes,
                    "bin_bytes": plan.bin_bytes,
                    "plans": plan.plans.len(),
                    "overhead": plan.overhead(),
                })),
                "chosen_strategy": p.chosen.map(|strategy| strategy.name()),
                "pages_mapped_bytes": p.pages.mapped,
                "pages_unmapped_bytes": p.pages.unmapped,
            })
        })
        .collect();
    json!({
        "type": "step",
        "step": report.index,
        "duration_s": report.duration.as_secs_f64(),
        "release_s": report.release_time.as_secs_f64(),
        "micro_steps": report.micro_steps,
        "peak_used_bytes": report.peak_used(),
        "peak_reserved_bytes": report.peak_reserved(),
        "fragmentation_ratio": crate::fragmentation_ratio(report.peak_used(), report.peak_reserved()),
        "released_bytes": report.released(),
        "breakdown": breakdown(&report.breakdown),
        "phases": phases,
        "pools": pools,
        "warnings": report.warnings.iter().map(|w| w.rule().name()).collect::<Vec<_>>(),
        "deferred_errors": report.deferred_errors,
        "graph_launches": report.graph_launches,
        "graph_reserved_bytes": report.graph_memory.reserved,
        "graph_used_bytes": report.graph_memory.used,
    })
}

/// A warning as a JSON object, with the numbers that triggered it.
pub fn warning_json(warning: &Warning) -> Value {
    let mut value = json!({
        "type": "warning",
        "rule": warning.rule().name(),
        "step": warning.step,
        "device": warning.device,
        "message": warning.to_string(),
    });
    let numbers = match &warning.kind {
        WarningKind::Fragmentation { phase, ratio, threshold, steps, peak_used, peak_reserved } => json!({
            "phase": phase, "fragmentation_ratio": ratio, "threshold": threshold, "steps": steps,
            "peak_used_bytes": peak_used, "peak_reserved_bytes": peak_reserved,
        }),
        WarningKind::ScatteredFree { phase, stream, largest_request, largest_free, total_free, device_free } => json!({
            "phase": phase, "stream": stream, "largest_request_bytes": largest_request,
            "largest_free_bytes": largest_free, "total_free_bytes": total_free, "device_free_bytes": device_free,
        }),
        WarningKind::ReservedCreep { phase, steps, reserved_from, reserved_to, peak_used_from, peak_used_to } => {
            json!({
                "phase": phase, "steps": steps, "reserved_from_bytes": reserved_from,
                "reserved_to_bytes": reserved_to, "peak_used_from_bytes": peak_used_from,
                "peak_used_to_bytes": peak_used_to,
            })
        }
        WarningKind::LowHeadroom { headroom, demand, device_free, margin } => json!({
            "headroom_bytes": headroom, "demand_bytes": demand, "device_free_bytes": device_free,
            "margin": margin,
        }),
    };
    if let (Value::Object(target), Value::Object(numbers)) = (&mut value, numbers) {
        target.extend(numbers);
    }
    value
}

/// An OOM report as a JSON object: what was asked, what was free, every pool, the verdict.
pub fn oom_json(report: &OomReport) -> Value {
    let pools: Vec<Value> = report
        .pools
        .iter()
        .map(|p| {
            json!({
                "phase": p.phase,
                "stream": p.pool.stream,
                "reserved_bytes": p.reserved,
                "used_bytes": p.used,
                "reserved_unused_bytes": p.reserved.saturating_sub(p.used),
                "largest_free_bytes": p.largest_free,
            })
        })
        .collect();
    json!({
        "type": "oom",
        "requested_bytes": report.requested,
        "phase": report.phase,
        "stream": report.pool.stream,
        "device": report.pool.device,
        "step": report.step,
        "device_free_bytes": report.device_free,
        "device_total_bytes": report.device_total,
        "reserved_bytes": report.pools.iter().map(|p| p.reserved).sum::<u64>(),
        "reserved_unused_bytes": report.reserved_unused(),
        "pools": pools,
        "verdict": match report.verdict {
            Verdict::Fragmentation => "fragmentation",
            Verdict::Demand => "demand",
        },
    })
}

/// Writes JSON lines: one object per line, flushed per object so a crash loses nothing written.
#[derive(Debug)]
pub struct JsonLines<W: Write> {
    out: W,
}

impl<W: Write> JsonLines<W> {
    /// Writes to `out`.
    pub fn new(out: W) -> Self {
        Self { out }
    }

    /// Writes one object.
    pub fn write(&mut self, value: &Value) -> io::Result<()> {
        serde_json::to_writer(&mut self.out, value)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }

    /// Writes a step report, then each of its warnings.
    pub fn step(&mut self, report: &StepReport) -> io::Result<()> {
        self.write(&step_json(report))?;
        report.warnings.iter().try_for_each(|warning| self.write(&warning_json(warning)))
    }

    /// Writes a warning.
    pub fn warning(&mut self, warning: &Warning) -> io::Result<()> {
        self.write(&warning_json(warning))
    }

    /// Writes an OOM report.
    pub fn oom(&mut self, report: &OomReport) -> io::Result<()> {
        self.write(&oom_json(report))
    }

    /// The writer back.
    pub fn into_inner(self) -> W {
        self.out
    }
}
