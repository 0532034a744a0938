//! Prometheus text exposition (format 0.0.4) of a runtime's [`Metrics`].
//!
//! Names follow Prometheus conventions: base units (`_bytes`, `_seconds`), `_total` for
//! counters, and the labels `device`, `stream` and `phase` on every per-pool series, so sums per
//! phase, stream or device are one `sum by (...)` away.

use std::fmt::Write;

use super::{Metrics, PoolMetrics};
use crate::warning::WarningRule;

/// The `Content-Type` of the text this module writes.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

struct Family<'a> {
    name: &'a str,
    kind: &'a str,
    help: &'a str,
}

fn header(out: &mut String, family: &Family<'_>) {
    let _ = writeln!(out, "# HELP {} {}", family.name, family.help);
    let _ = writeln!(out, "# TYPE {} {}", family.name, family.kind);
}

fn pool_labels(pool: &PoolMetrics) -> String {
    let stream = if pool.retired { "retired".to_owned() } else { pool.pool.stream.to_string() };
    format!("device=\"{}\",stream=\"{stream}\",phase=\"{}\"", pool.pool.device, escape(&pool.phase_name))
}

impl Metrics {
    /// The metrics as Prometheus text.
    pub fn to_prometheus(&self) -> String {
        let mut out = String::new();
        type Read = fn(&PoolMetrics) -> Option<f64>;
        let per_pool: [(Family<'_>, Read); 16] = [
            (
                Family { name: "steppool_used_bytes", kind: "gauge", help: "Bytes of live allocations, as requested." },
                |p| Some(p.usage.used as f64),
            ),
            (Family { name: "steppool_used_high_bytes", kind: "gauge", help: "High-water mark of used bytes." }, |p| {
                Some(p.usage.used_high as f64)
            }),
            (
                Family {
                    name: "steppool_reserved_bytes",
                    kind: "gauge",
                    help: "Bytes the pool holds from the device.",
                },
                |p| Some(p.usage.reserved as f64),
            ),
            (
                Family {
                    name: "steppool_reserved_high_bytes",
                    kind: "gauge",
                    help: "High-water mark of reserved bytes.",
                },
                |p| Some(p.usage.reserved_high as f64),
            ),
            (
                Family {
                    name: "steppool_reserved_unused_bytes",
                    kind: "gauge",
                    help: "Reserved bytes holding no live data (reserved - used).",
                },
                |p| Some(p.usage.reserved_unused() as f64),
            ),
            (Family { name: "steppool_allocations_total", kind: "counter", help: "Allocations handed out." }, |p| {
                Some(p.usage.allocations as f64)
            }),
            (
                Family { name: "steppool_frees_total", kind: "counter", help: "Allocations freed by their owner." },
                |p| Some(p.usage.frees as f64),
            ),
            (
                Family {
                    name: "steppool_requested_bytes_total",
                    kind: "counter",
                    help: "Bytes requested by the allocations handed out.",
                },
                |p| Some(p.usage.requested_bytes as f64),
            ),
            (
                Family { name: "steppool_alloc_failures_total", kind: "counter", help: "Allocations that failed." },
                |p| Some(p.usage.failures as f64),
            ),
            (
                Family {
                    name: "steppool_oom_recoveries_total",
                    kind: "counter",
                    help: "Allocations that succeeded only after out-of-memory recovery.",
                },
                |p| Some(p.usage.oom_recoveries as f64),
            ),
            (
                Family {
                    name: "steppool_ooms_total",
                    kind: "counter",
                    help: "Allocations that failed for lack of memory after recovery.",
                },
                |p| Some(p.usage.ooms as f64),
            ),
            (
                Family {
                    name: "steppool_released_bytes_total",
                    kind: "counter",
                    help: "Bytes still live at a boundary, which the boundary released.",
                },
                |p| Some(p.usage.released_bytes as f64),
            ),
            (
                Family {
                    name: "steppool_alloc_seconds_total",
                    kind: "counter",
                    help: "Time spent allocating, in the strategy and the driver.",
                },
                |p| Some(p.usage.alloc_nanos as f64 / 1e9),
            ),
            (
                Family {
                    name: "steppool_pages_mapped_bytes_total",
                    kind: "counter",
                    help: "Bytes of pages mapped into the pool's address ranges (each costs time to map and unmap).",
                },
                |p| Some(p.usage.pages.mapped as f64),
            ),
            (
                Family {
                    name: "steppool_pages_unmapped_bytes_total",
                    kind: "counter",
                    help: "Bytes of pages unmapped from the pool's address ranges.",
                },
                |p| Some(p.usage.pages.unmapped as f64),
            ),
            (
                Family {
                    name: "steppool_largest_free_bytes",
                    kind: "gauge",
                    help: "Largest free piece inside the pool, where the layout is known.",
                },
                |p| p.free_space.map(|space| space.largest_free as f64),
            ),
        ];
        for (family, read) in &per_pool {
            let samples: Vec<(String, f64)> =
                self.pools.iter().filter_map(|pool| read(pool).map(|value| (pool_labels(pool), value))).collect();
            if samples.is_empty() {
                continue;
            }
            header(&mut out, family);
            for (labels, value) in samples {
                let _ = writeln!(out, "{}{{{labels}}} {value}", family.name);
            }
        }
        let spaces: Vec<(String, f64)> = self
            .pools
            .iter()
            .filter_map(|pool| pool.free_space.map(|space| (pool_labels(pool), space.fragmentation())))
            .collect();
        if !spaces.is_empty() {
            header(
                &mut out,
                &Family {
                    name: "steppool_free_space_fragmentation_ratio",
                    kind: "gauge",
                    help: "1 - largest_free / total_free inside the pool, where the layout is known.",
                },
            );
            for (labels, value) in spaces {
                let _ = writeln!(out, "steppool_free_space_fragmentation_ratio{{{labels}}} {value}");
            }
        }
        if !self.fragmentation.is_empty() {
            header(
                &mut out,
                &Family {
                    name: "steppool_fragmentation_ratio",
                    kind: "gauge",
                    help: "1 - peak_used / peak_reserved of the phase in the last step.",
                },
            );
            for fragmentation in &self.fragmentation {
                let super::GroupKey::Phase { device, phase } = &fragmentation.group else { continue };
                let ratio = fragmentation.ratio;
                let _ = writeln!(
                    out,
                    "steppool_fragmentation_ratio{{device=\"{device}\",phase=\"{}\"}} {ratio}",
                    escape(phase)
                );
            }
        }
        // The runtime's unattributed bytes and peak shift are always 0 (see `StepReport`): the
        // four parts it measures.
        type OverheadRead = fn(&super::PhaseOverhead) -> crate::report::Breakdown;
        let overheads: [(Family<'_>, OverheadRead); 2] = [
            (
                Family {
                    name: "steppool_overhead_bytes",
                    kind: "gauge",
                    help: "Peak reserved - peak used of the phase in the last step, by kind: rounding, granule_tail, segregation, holes.",
                },
                |o| o.last_step,
            ),
            (
                Family {
                    name: "steppool_peak_overhead_bytes",
                    kind: "gauge",
                    help: "The same split in the step of the device's highest peak reserved so far.",
                },
                |o| o.run_peak,
            ),
        ];
        for (family, read) in &overheads {
            if self.overhead.is_empty() {
                break;
            }
            header(&mut out, family);
            for overhead in &self.overhead {
                let super::GroupKey::Phase { device, phase } = &overhead.group else { continue };
                for (kind, bytes) in &read(overhead).parts()[..4] {
                    let _ = writeln!(
                        out,
                        "{}{{device=\"{device}\",phase=\"{}\",kind=\"{kind}\"}} {bytes}",
                        family.name,
                        escape(phase)
                    );
                }
            }
        }
        type DeviceRead = fn(&super::DeviceMemory) -> u64;
        let devices: [(Family<'_>, DeviceRead); 5] = [
            (
                Family {
                    name: "steppool_device_free_bytes",
                    kind: "gauge",
                    help: "Free device memory (cuMemGetInfo).",
                },
                |d| d.free,
            ),
            (Family { name: "steppool_device_total_bytes", kind: "gauge", help: "Device memory." }, |d| d.total),
            (
                Family {
                    name: "steppool_device_graph_reserved_bytes",
                    kind: "gauge",
                    help: "Bytes the device's graph memory pool holds (cuDeviceGetGraphMemAttribute).",
                },
                |d| d.graph_reserved,
            ),
            (
                Family {
                    name: "steppool_device_graph_used_bytes",
                    kind: "gauge",
                    help: "Bytes of graph memory associated with graphs.",
                },
                |d| d.graph_used,
            ),
            (
                Family {
                    name: "steppool_device_mapped_high_bytes",
                    kind: "gauge",
                    help: "The most bytes of pages mapped at once into the address ranges of steppool's pools.",
                },
                |d| d.mapped_high,
            ),
        ];
        for (family, read) in &devices {
            if self.devices.is_empty() {
                break;
            }
            header(&mut out, family);
            for device in &self.devices {
                let _ = writeln!(out, "{}{{device=\"{}\"}} {}", family.name, device.device, read(device));
            }
        }
        header(&mut out, &Family { name: "steppool_steps_total", kind: "counter", help: "Steps ended." });
        let _ = writeln!(out, "steppool_steps_total {}", self.steps);
        header(
            &mut out,
            &Family { name: "steppool_warnings_total", kind: "counter", help: "Early warnings fired, per rule." },
        );
        for rule in [
            WarningRule::Fragmentation,
            WarningRule::ScatteredFree,
            WarningRule::ReservedCreep,
            WarningRule::LowHeadroom,
        ] {
            let count = self.warnings.iter().find(|count| count.rule == rule).map_or(0, |count| count.fired);
            let _ = writeln!(out, "steppool_warnings_total{{rule=\"{rule}\"}} {count}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn label_values_escape_backslashes_quotes_and_newlines() {
        assert_eq!(escape("a\\b \"c\"\nd"), "a\\\\b \\\"c\\\"\\nd");
    }
}
