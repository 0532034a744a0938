//! The history as an SVG timeline: used and reserved bytes per phase over time, with step
//! boundaries, warnings and out-of-memory failures marked.
//!
//! The top panel stacks every phase's used bytes and draws the total reservation over them, so
//! the gap between the two is the memory held without live data. One row per phase follows,
//! each on its own scale: used filled, reserved as a line. Time is split into as many buckets as
//! the picture has pixels, and each bucket shows its highest values, so no peak is lost.
//!
//! Captured steps: a step in which a captured step's graph was launched
//! ([`CapturedStep::launch`](crate::CapturedStep::launch)) is shaded across the top panel and
//! labelled `step N captured` with its launch count. The devices' graph memory pools, read at each
//! step's end once a capture has begun, are drawn in the top panel as a dashed line (`graph
//! memory reserved`, all devices): memory the driver's graph allocation nodes hold beside the
//! pools' reservations.

use std::collections::BTreeMap;
use std::fmt::Write;

use steppool_sys::bytes::Bytes;
use steppool_trace::svg::{Px, Svg};

use super::history::{EventKind, History};
use crate::phase::Phase;
use crate::report::PoolId;

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 96.0;
const RIGHT: f64 = 24.0;
const TOP_HEIGHT: f64 = 220.0;
const ROW_HEIGHT: f64 = 84.0;
const GAP: f64 = 26.0;
/// Captured steps and graph memory.
const GRAPH_COLOR: &str = "#7b3294";
const BUCKETS: usize = (WIDTH - LEFT - RIGHT) as usize;
const COLORS: [&str; 10] =
    ["#4e79a7", "#f28e2c", "#59a14f", "#e15759", "#76b7b2", "#edc949", "#af7aa1", "#ff9da7", "#9c755f", "#bab0ab"];

/// The highest used and reserved bytes of each phase in each time bucket.
struct Series {
    phases: Vec<Phase>,
    /// `[bucket][phase] = (used, reserved)`.
    buckets: Vec<Vec<(u64, u64)>>,
    /// Highest total used and total reserved per bucket.
    totals: Vec<(u64, u64)>,
    /// Graph memory reserved, all devices, per bucket; `None` before the first reading.
    graph: Vec<Option<u64>>,
    t0: u64,
    t1: u64,
}

fn series(history: &History) -> Series {
    let mut phases: Vec<Phase> = history.events.iter().filter_map(|e| e.kind.pool().map(|p| p.phase)).collect();
    phases.sort_unstable();
    phases.dedup();
    let t0 = history.events.first().map_or(0, |e| e.t_ns);
    let t1 = history.events.last().map_or(0, |e| e.t_ns).max(t0 + 1);
    // Histories built by hand may be out of order: clamp rather than trust the order.
    let bucket_of = |t: u64| {
        let bucket = (t.saturating_sub(t0) as u128 * BUCKETS as u128) / ((t1 - t0) as u128 + 1);
        (bucket as usize).min(BUCKETS - 1)
    };
    let mut used = vec![0u64; phases.len()];
    let mut reserved: BTreeMap<PoolId, u64> = BTreeMap::new();
    let mut buckets = vec![vec![(0u64, 0u64); phases.len()]; BUCKETS];
    let mut totals = vec![(0u64, 0u64); BUCKETS];
    let mut touched = vec![false; BUCKETS];
    let mut graph_reserved: BTreeMap<usize, u64> = BTreeMap::new();
    let mut graph = vec![None; BUCKETS];
    let index = |phase: Phase| phases.binary_search(&phase).unwrap_or(0);
    for event in &history.events {
        match &event.kind {
            EventKind::Alloc { pool, bytes, .. } => used[index(pool.phase)] += bytes,
            EventKind::Free { pool, bytes, .. } => {
                let slot = &mut used[index(pool.phase)];
                *slot = slot.saturating_sub(*bytes);
            }
            EventKind::SegmentAlloc { pool, pool_reserved, .. }
            | EventKind::SegmentFree { pool, pool_reserved, .. }
            | EventKind::SegmentMap { pool, pool_reserved, .. }
            | EventKind::SegmentUnmap { pool, pool_reserved, .. }
            | EventKind::Reserved { pool, pool_reserved } => {
                reserved.insert(*pool, *pool_reserved);
            }
            EventKind::GraphMemory { device, reserved, .. } => {
                graph_reserved.insert(*device, *reserved);
            }
            _ => continue,
        }
        let b = bucket_of(event.t_ns);
        touched[b] = true;
        if !graph_reserved.is_empty() {
            let total: u64 = graph_reserved.values().sum();
            graph[b] = Some(graph[b].map_or(total, |v: u64| v.max(total)));
        }
        let mut total = (0, 0);
        for (i, &phase) in phases.iter().enumerate() {
            let phase_reserved: u64 = reserved.iter().filter(|(k, _)| k.phase == phase).map(|(_, v)| v).sum();
            // Before a pool's first reservation read, its used bytes bound its reservation.
            let phase_reserved = phase_reserved.max(used[i]);
            let slot = &mut buckets[b][i];
            *slot = (slot.0.max(used[i]), slot.1.max(phase_reserved));
            total = (total.0 + used[i], total.1 + phase_reserved);
        }
        totals[b] = (totals[b].0.max(total.0), totals[b].1.max(total.1));
    }
    // Buckets without events hold the values of the last one before them.
    for b in 1..BUCKETS {
        if !touched[b] {
            buckets[b] = buckets[b - 1].clone();
            totals[b] = totals[b - 1];
            graph[b] = graph[b - 1];
        } else if graph[b].is_none() {
            graph[b] = graph[b - 1];
        }
    }
    Series { phases, buckets, totals, graph, t0, t1 }
}

fn x_of(series: &Series, t: u64) -> f64 {
    LEFT + (t.saturating_sub(series.t0)) as f64 / (series.t1 - series.t0) as f64 * (WIDTH - LEFT - RIGHT)
}

fn bx(b: usize) -> f64 {
    LEFT + b as f64 + 0.5
}

/// A polyline (or a closed area down to `base`) through `values`, scaled to `max` over `height`.
fn path(values: impl Iterator<Item = u64>, top: f64, height: f64, max: u64, area: Option<f64>) -> String {
    let mut d = String::new();
    let scale = |v: u64| top + height - v as f64 / max.max(1) as f64 * height;
    let values: Vec<u64> = values.collect();
    for (b, &v) in values.iter().enumerate() {
        let _ = write!(d, "{}{:.1},{:.1} ", if b == 0 { "M" } else { "L" }, bx(b), scale(v));
    }
    if let Some(base) = area {
        let _ = write!(d, "L{:.1},{base:.1} L{:.1},{base:.1} Z", bx(values.len() - 1), bx(0));
    }
    d
}

/// A stacked area between `lower` and `upper`.
fn band(lower: &[u64], upper: &[u64], top: f64, height: f64, max: u64) -> String {
    let scale = |v: u64| top + height - v as f64 / max.max(1) as f64 * height;
    let mut d = String::new();
    for (b, &v) in upper.iter().enumerate() {
        let _ = write!(d, "{}{:.1},{:.1} ", if b == 0 { "M" } else { "L" }, bx(b), scale(v));
    }
    for (b, &v) in lower.iter().enumerate().rev() {
        let _ = write!(d, "L{:.1},{:.1} ", bx(b), scale(v));
    }
    d.push('Z');
    d
}

fn axis_label(svg: &mut Svg, top: f64, height: f64, max: u64) {
    let x = Px(LEFT - 6.0);
    for (y, text) in [(top + 10.0, Bytes(max).to_string()), (top + height, "0".to_owned())] {
        svg.text("text", &[("x", &x), ("y", &Px(y)), ("text-anchor", &"end"), ("class", &"axis")], &text);
    }
    svg.element(
        "rect",
        &[
            ("x", &LEFT),
            ("y", &Px(top)),
            ("width", &(WIDTH - LEFT - RIGHT)),
            ("height", &Px(height)),
            ("fill", &"none"),
            ("stroke", &"#ccc"),
        ],
    );
}

impl History {
    /// Shades every step in which a captured step's graph was launched, across the top panel,
    /// labelled `step N captured` with its launch count.
    fn captured_steps(&self, svg: &mut Svg, series: &Series, top: f64) {
        let mut launches: BTreeMap<u64, u64> = BTreeMap::new();
        for event in &self.events {
            if let EventKind::GraphLaunch { step: Some(step), .. } = event.kind {
                *launches.entry(step).or_default() += 1;
            }
        }
        for (row, (&step, &count)) in launches.iter().enumerate() {
            let begin = self.events.iter().find_map(|e| match e.kind {
                EventKind::StepBegin { step: s } if s == step => Some(e.t_ns),
                _ => None,
            });
            let end = self.events.iter().find_map(|e| match e.kind {
                EventKind::StepEnd { step: s } if s == step => Some(e.t_ns),
                _ => None,
            });
            let x0 = x_of(series, begin.unwrap_or(series.t0));
            let x1 = x_of(series, end.unwrap_or(series.t1)).max(x0 + 2.0);
            let label = format!("step {step} captured");
            let launches = if count == 1 { "1 graph launch".to_owned() } else { format!("{count} graph launches") };
            svg.open("g", &[("class", &"captured")]);
            svg.text("title", &[], &format!("{label}: {launches}"));
            svg.element(
                "rect",
                &[
                    ("x", &Px(x0)),
                    ("y", &Px(top)),
                    ("width", &Px(x1 - x0)),
                    ("height", &Px(TOP_HEIGHT)),
                    ("fill", &GRAPH_COLOR),
                    ("fill-opacity", &0.12),
                    ("stroke", &"none"),
                ],
            );
            let y = top + TOP_HEIGHT - 6.0 - 12.0 * (row % 3) as f64;
            svg.text(
                "text",
                &[("x", &Px(x0 + 2.0)), ("y", &Px(y)), ("class", &"mark"), ("fill", &GRAPH_COLOR)],
                &label,
            );
            svg.close("g");
        }
    }

    /// The history as an SVG timeline (see [`crate::telemetry`]); `title` heads the picture.
    pub fn timeline_svg(&self, title: &str) -> String {
        let series = series(self);
        let rows = series.phases.len();
        let height = 40.0 + TOP_HEIGHT + GAP + rows as f64 * (ROW_HEIGHT + GAP) + 30.0;
        let height = height.round();
        let mut svg = Svg::new(WIDTH, height, &[("font-family", &"Helvetica, Arial, sans-serif")]);
        svg.text(
            "style",
            &[],
            ".axis{font-size:10px;fill:#555} .label{font-size:12px;fill:#222} .mark{font-size:10px}",
        );
        svg.text("text", &[("x", &LEFT), ("y", &22), ("font-size", &15), ("font-weight", &"bold")], title);

        // Top panel: used stacked by phase, total reserved over it.
        let top = 40.0;
        let graph_max = series.graph.iter().flatten().copied().max();
        let max = series.totals.iter().map(|t| t.1.max(t.0)).max().unwrap_or(0).max(graph_max.unwrap_or(0)).max(1);
        axis_label(&mut svg, top, TOP_HEIGHT, max);
        self.captured_steps(&mut svg, &series, top);
        let mut lower = vec![0u64; BUCKETS];
        for (i, &phase) in series.phases.iter().enumerate() {
            let upper: Vec<u64> = lower.iter().zip(&series.buckets).map(|(l, b)| l + b[i].0).collect();
            let color = COLORS[i % COLORS.len()];
            let d = band(&lower, &upper, top, TOP_HEIGHT, max);
            svg.open("path", &[("d", &d), ("fill", &color), ("fill-opacity", &0.75), ("stroke", &"none")]);
            svg.text("title", &[], &format!("{} used", self.phase_name(phase)));
            svg.close("path");
            lower = upper;
        }
        let d = path(series.totals.iter().map(|t| t.1), top, TOP_HEIGHT, max, None);
        svg.open("path", &[("d", &d), ("fill", &"none"), ("stroke", &"#222"), ("stroke-width", &1.5)]);
        svg.text("title", &[], "reserved, all phases");
        svg.close("path");
        if let Some(graph_max) = graph_max {
            // From the first reading on; before it the graph memory pools were not read.
            let scale = |v: u64| top + TOP_HEIGHT - v as f64 / max as f64 * TOP_HEIGHT;
            let mut d = String::new();
            for (b, v) in series.graph.iter().enumerate().filter_map(|(b, v)| v.map(|v| (b, v))) {
                let _ = write!(d, "{}{:.1},{:.1} ", if d.is_empty() { "M" } else { "L" }, bx(b), scale(v));
            }
            svg.open(
                "path",
                &[
                    ("d", &d),
                    ("fill", &"none"),
                    ("stroke", &GRAPH_COLOR),
                    ("stroke-width", &1.5),
                    ("stroke-dasharray", &"6,3"),
                ],
            );
            svg.text("title", &[], &format!("graph memory reserved, all devices (highest {})", Bytes(graph_max)));
            svg.close("path");
        }
        // Legend.
        let mut lx = LEFT + 8.0;
        for (i, &phase) in series.phases.iter().enumerate() {
            let name = self.phase_name(phase);
            let color = COLORS[i % COLORS.len()];
            svg.element(
                "rect",
                &[("x", &Px(lx)), ("y", &Px(top + 8.0)), ("width", &10), ("height", &10), ("fill", &color)],
            );
            svg.text("text", &[("x", &Px(lx + 14.0)), ("y", &Px(top + 17.0)), ("class", &"label")], name);
            lx += 24.0 + 7.0 * name.chars().count() as f64;
        }
        let line_y = Px(top + 13.0);
        svg.element(
            "line",
            &[
                ("x1", &Px(lx)),
                ("y1", &line_y),
                ("x2", &Px(lx + 18.0)),
                ("y2", &line_y),
                ("stroke", &"#222"),
                ("stroke-width", &1.5),
            ],
        );
        svg.text("text", &[("x", &Px(lx + 22.0)), ("y", &Px(top + 17.0)), ("class", &"label")], "reserved");
        if let Some(graph_max) = graph_max {
            let lx = lx + 90.0;
            svg.element(
                "line",
                &[
                    ("x1", &Px(lx)),
                    ("y1", &line_y),
                    ("x2", &Px(lx + 18.0)),
                    ("y2", &line_y),
                    ("stroke", &GRAPH_COLOR),
                    ("stroke-width", &1.5),
                    ("stroke-dasharray", &"6,3"),
                ],
            );
            // Read only at step ends, the line may be short: the legend says its highest value.
            let label = format!("graph memory reserved (highest {})", Bytes(graph_max));
            svg.text("text", &[("x", &Px(lx + 22.0)), ("y", &Px(top + 17.0)), ("class", &"label")], &label);
        }

        // One row per phase.
        for (i, &phase) in series.phases.iter().enumerate() {
            let row_top = top + TOP_HEIGHT + GAP + i as f64 * (ROW_HEIGHT + GAP);
            let max = series.buckets.iter().map(|b| b[i].0.max(b[i].1)).max().unwrap_or(0).max(1);
            let color = COLORS[i % COLORS.len()];
            svg.text(
                "text",
                &[("x", &LEFT), ("y", &Px(row_top - 5.0)), ("class", &"label")],
                &format!("{} — used (filled) and reserved (line)", self.phase_name(phase)),
            );
            axis_label(&mut svg, row_top, ROW_HEIGHT, max);
            let base = row_top + ROW_HEIGHT;
            let used = path(series.buckets.iter().map(|b| b[i].0), row_top, ROW_HEIGHT, max, Some(base));
            svg.element("path", &[("d", &used), ("fill", &color), ("fill-opacity", &0.6), ("stroke", &"none")]);
            let reserved = path(series.buckets.iter().map(|b| b[i].1), row_top, ROW_HEIGHT, max, None);
            svg.element("path", &[("d", &reserved), ("fill", &"none"), ("stroke", &color), ("stroke-width", &1.5)]);
        }

        // Step boundaries, warnings and OOMs across every panel.
        let bottom = height - 30.0;
        let steps: Vec<(u64, u64)> = self
            .events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::StepBegin { step } => Some((e.t_ns, step)),
                _ => None,
            })
            .collect();
        let every = steps.len().div_ceil(40).max(1);
        for (n, &(t, step)) in steps.iter().enumerate() {
            let x = Px(x_of(&series, t));
            svg.element(
                "line",
                &[
                    ("x1", &x),
                    ("y1", &top),
                    ("x2", &x),
                    ("y2", &bottom),
                    ("stroke", &"#999"),
                    ("stroke-dasharray", &"2,3"),
                    ("stroke-width", &0.8),
                ],
            );
            if n % every == 0 {
                svg.text(
                    "text",
                    &[("x", &Px(x.0 + 2.0)), ("y", &(bottom + 12.0)), ("class", &"axis")],
                    &format!("step {step}"),
                );
            }
        }
        let mut warning_row = 0;
        for event in &self.events {
            let (color, label) = match &event.kind {
                EventKind::Warning { rule, message } => ("#e8710a", format!("⚠ {rule}: {message}")),
                EventKind::Oom { pool, bytes, .. } => {
                    ("#d62728", format!("✖ OOM: {} in `{}`", Bytes(*bytes), self.phase_name(pool.phase)))
                }
                _ => continue,
            };
            let x = x_of(&series, event.t_ns);
            let short: String = label.chars().take(48).collect();
            let y = top + 32.0 + 14.0 * (warning_row % 8) as f64;
            warning_row += 1;
            let (text_x, anchor) = if x > WIDTH / 2.0 { (x - 4.0, "end") } else { (x + 4.0, "start") };
            svg.open("g", &[]);
            svg.text("title", &[], &label);
            svg.element(
                "line",
                &[
                    ("x1", &Px(x)),
                    ("y1", &top),
                    ("x2", &Px(x)),
                    ("y2", &bottom),
                    ("stroke", &color),
                    ("stroke-width", &1.6),
                ],
            );
            svg.text(
                "text",
                &[("x", &Px(text_x)), ("y", &y), ("class", &"mark"), ("fill", &color), ("text-anchor", &anchor)],
                &short,
            );
            svg.close("g");
        }
        let seconds = (series.t1 - series.t0) as f64 / 1e9;
        svg.text(
            "text",
            &[("x", &(WIDTH - RIGHT)), ("y", &(height - 6.0)), ("text-anchor", &"end"), ("class", &"axis")],
            &format!("time → ({seconds:.3} s)"),
        );
        svg.finish()
    }
}
