//! The reserved-versus-live picture of a replay: one panel per strategy, the trace's live bytes as
//! a grey area and the strategy's reserved bytes as a line, over the trace's events, with the
//! step boundaries marked.

use std::fmt::Write as _;

use steppool_sys::bytes::Bytes;
use steppool_trace::svg::{Px, Svg};
use steppool_trace::{EventKind, Trace};

use crate::replay::StrategyResult;

const WIDTH: f64 = 960.0;
const PANEL: f64 = 220.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 56.0;
const GAP: f64 = 46.0;
const COLORS: [&str; 6] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

/// The SVG document for `results` of `trace`.
pub fn timeline_svg(trace: &Trace, results: &[StrategyResult]) -> String {
    let height = TOP + results.len().max(1) as f64 * (PANEL + GAP) + 10.0;
    let events = trace.events.len().max(1) as f64;
    let plot_width = WIDTH - LEFT - RIGHT;
    let top = results
        .iter()
        .flat_map(|r| r.run.timeline.points.iter().flatten().map(|&(live, reserved)| live.max(reserved)))
        .max()
        .unwrap_or(0)
        .max(1);
    let scale = nice_ceiling(top);
    let mut svg = Svg::new(WIDTH, height, &[("font-family", &"sans-serif"), ("font-size", &12)]);
    let name =
        trace.path.file_name().map_or_else(|| trace.path.display().to_string(), |n| n.to_string_lossy().into_owned());
    svg.text(
        "text",
        &[("x", &LEFT), ("y", &22), ("font-size", &15), ("font-weight", &"bold")],
        &format!("{name}: reserved vs live bytes"),
    );
    svg.text(
        "text",
        &[("x", &LEFT), ("y", &40), ("fill", &"#555")],
        "grey: live bytes of the trace; line: bytes the strategy's pools reserve on the simulated device; ticks: step boundaries",
    );
    let steps: Vec<usize> = trace
        .events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e.kind, EventKind::StepBegin(_)))
        .map(|(i, _)| i)
        .collect();
    for (panel, result) in results.iter().enumerate() {
        let y0 = TOP + panel as f64 * (PANEL + GAP) + 16.0;
        let x = |event: f64| LEFT + event / events * plot_width;
        let y = |bytes: u64| y0 + PANEL - bytes as f64 / scale as f64 * PANEL;
        let color = COLORS[panel % COLORS.len()];
        let run = &result.run;
        let outcome = match &run.failure {
            None => format!("completed at {}", Bytes(run.capacity)),
            Some(f) => format!("OOM at {} on a {} device ({})", f.location, Bytes(run.capacity), f.verdict),
        };
        svg.text(
            "text",
            &[("x", &LEFT), ("y", &Px(y0 - 6.0)), ("font-weight", &"bold"), ("fill", &color)],
            &format!(
                "{} — peak reserved {}, overhead {:.3}×, {outcome}",
                run.strategy,
                Bytes(run.peak_reserved_bytes),
                result.overhead()
            ),
        );
        svg.element(
            "rect",
            &[
                ("x", &LEFT),
                ("y", &Px(y0)),
                ("width", &Px(plot_width)),
                ("height", &PANEL),
                ("fill", &"none"),
                ("stroke", &"#999"),
            ],
        );
        for tick in 0..=4u64 {
            let bytes = scale / 4 * tick;
            let ty = Px(y(bytes));
            svg.element(
                "line",
                &[("x1", &LEFT), ("x2", &Px(LEFT + plot_width)), ("y1", &ty), ("y2", &ty), ("stroke", &"#eee")],
            );
            svg.text(
                "text",
                &[("x", &Px(LEFT - 6.0)), ("y", &Px(y(bytes) + 4.0)), ("text-anchor", &"end"), ("fill", &"#555")],
                &Bytes(bytes).to_string(),
            );
        }
        for &step in &steps {
            let sx = Px(x(step as f64));
            svg.element(
                "line",
                &[
                    ("x1", &sx),
                    ("x2", &sx),
                    ("y1", &Px(y0 + PANEL)),
                    ("y2", &Px(y0 + PANEL + 6.0)),
                    ("stroke", &"#bbb"),
                ],
            );
        }
        let buckets = run.timeline.points.len().max(1) as f64;
        let at = |bucket: usize| x((bucket as f64 + 0.5) / buckets * events);
        let points: Vec<(usize, (u64, u64))> =
            run.timeline.points.iter().enumerate().filter_map(|(i, p)| p.map(|p| (i, p))).collect();
        if let (Some(first), Some(last)) = (points.first(), points.last()) {
            let mut area = format!("M{:.1},{:.1}", at(first.0), y(0));
            for &(bucket, (live, _)) in &points {
                let _ = write!(area, " L{:.1},{:.1}", at(bucket), y(live));
            }
            let _ = write!(area, " L{:.1},{:.1} Z", at(last.0), y(0));
            svg.element("path", &[("d", &area), ("fill", &"#cfcfcf"), ("stroke", &"#9a9a9a"), ("stroke-width", &0.6)]);
            let line: Vec<String> =
                points.iter().map(|&(bucket, (_, reserved))| format!("{:.1},{:.1}", at(bucket), y(reserved))).collect();
            svg.element(
                "polyline",
                &[("points", &line.join(" ")), ("fill", &"none"), ("stroke", &color), ("stroke-width", &1.6)],
            );
            if run.failure.is_some() {
                svg.text(
                    "text",
                    &[
                        ("x", &Px(at(last.0) + 4.0)),
                        ("y", &Px(y(last.1.1) + 4.0)),
                        ("fill", &color),
                        ("font-weight", &"bold"),
                    ],
                    "✕ OOM",
                );
            }
        }
        let label_y = Px(y0 + PANEL + 18.0);
        svg.text(
            "text",
            &[("x", &Px(LEFT + plot_width)), ("y", &label_y), ("text-anchor", &"end"), ("fill", &"#555")],
            &format!("event {}", trace.events.len()),
        );
        svg.text("text", &[("x", &LEFT), ("y", &label_y), ("fill", &"#555")], "event 0");
    }
    svg.finish()
}

/// The smallest of 1, 2 or 5 × a power of two-ish byte unit above `bytes`, for axis ticks.
fn nice_ceiling(bytes: u64) -> u64 {
    let mut unit = 1u64;
    while unit.saturating_mul(1024) <= bytes && unit < (1 << 60) {
        unit *= 1024;
    }
    let mut step = unit;
    loop {
        for factor in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024] {
            let candidate = step.saturating_mul(factor);
            if candidate >= bytes {
                return candidate;
            }
        }
        step = step.saturating_mul(1024);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_ceilings_are_round() {
        assert_eq!(nice_ceiling(1), 1);
        assert_eq!(nice_ceiling(1000), 1024);
        assert_eq!(nice_ceiling(3 << 20), 4 << 20);
        assert_eq!(nice_ceiling(184 << 20), 256 << 20);
    }
}
