//! Plain SVG line and bar charts, written by hand: no fonts, no system libraries, any machine.

use std::fmt::Write;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 10] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

/// One named series of `(x, y)` points.
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
}

/// A line chart, each axis linear or logarithmic (base 10 ticks, or powers of two for x).
pub(crate) struct LineChart {
    pub(crate) title: String,
    pub(crate) x_label: String,
    pub(crate) y_label: String,
    pub(crate) log_x: bool,
    pub(crate) log_y: bool,
    pub(crate) x_ticks: Vec<(f64, String)>,
    pub(crate) series: Vec<Series>,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn header(out: &mut String, title: &str) {
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>
"#,
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        escape(title)
    );
}

fn legend(out: &mut String, names: &[&str]) {
    for (i, name) in names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 18.0;
        let x = WIDTH - RIGHT + 15.0;
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(out, r#"<rect x="{x}" y="{}" width="12" height="12" fill="{color}"/>"#, y - 10.0);
        let _ = writeln!(out, r#"<text x="{}" y="{y}">{}</text>"#, x + 18.0, escape(name));
    }
}

/// A short label for a value on a value axis.
fn number(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 1e9 {
        format!("{:.3}G", value / 1e9)
    } else if magnitude >= 1e6 {
        format!("{:.3}M", value / 1e6)
    } else if magnitude >= 1e3 {
        format!("{:.3}k", value / 1e3)
    } else {
        format!("{value:.3}")
    }
    .replace(".000", "")
}

struct Axis {
    log: bool,
    low: f64,
    high: f64,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Self {
        let values: Vec<f64> = values.filter(|v| v.is_finite() && (!log || *v > 0.0)).collect();
        let mut low = values.iter().copied().fold(f64::INFINITY, f64::min);
        let mut high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if !low.is_finite() {
            (low, high) = (1.0, 10.0);
        }
        if log {
            low = 10f64.powf(low.log10().floor());
            high = 10f64.powf(high.log10().ceil());
            if high <= low {
                high = low * 10.0;
            }
        } else {
            low = low.min(0.0);
            if high <= low {
                high = low + 1.0;
            }
            high *= 1.05;
        }
        Self { log, low, high }
    }

    /// Where `value` falls, from 0 to 1.
    fn position(&self, value: f64) -> f64 {
        if self.log {
            (value.log10() - self.low.log10()) / (self.high.log10() - self.low.log10())
        } else {
            (value - self.low) / (self.high - self.low)
        }
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (self.low.log10().round() as i32, self.high.log10().round() as i32);
            (a..=b).map(|e| 10f64.powi(e)).collect()
        } else {
            (0..=5).map(|i| self.low + (self.high - self.low) * f64::from(i) / 5.0).collect()
        }
    }
}

/// The horizontal grid lines of `axis` across a plot `plot_w` wide, with their labels.
fn y_grid(out: &mut String, axis: &Axis, plot_w: f64, y: &dyn Fn(f64) -> f64) {
    for tick in axis.ticks() {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{py}" y2="{py}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y(tick) + 4.0,
            number(tick),
            py = y(tick)
        );
    }
}

impl LineChart {
    /// The chart as an SVG document.
    pub(crate) fn render(&self) -> String {
        let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
        let all = || self.series.iter().flat_map(|s| s.points.iter());
        let x_axis = Axis::new(all().map(|p| p.0).chain(self.x_ticks.iter().map(|t| t.0)), self.log_x);
        let y_axis = Axis::new(all().map(|p| p.1), self.log_y);
        let x = |v: f64| LEFT + x_axis.position(v) * plot_w;
        let y = |v: f64| TOP + plot_h - y_axis.position(v) * plot_h;
        let mut out = String::new();
        header(&mut out, &self.title);
        y_grid(&mut out, &y_axis, plot_w, &y);
        for (value, label) in &self.x_ticks {
            let _ = writeln!(
                out,
                r##"<line x1="{px}" x2="{px}" y1="{TOP}" y2="{}" stroke="#eee"/><text x="{px}" y="{}" text-anchor="middle">{}</text>"##,
                TOP + plot_h,
                TOP + plot_h + 16.0,
                escape(label),
                px = x(*value)
            );
        }
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"##,
            LEFT + plot_w / 2.0,
            HEIGHT - 18.0,
            escape(&self.x_label),
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let points: Vec<String> = series
                .points
                .iter()
                .filter(|p| !self.log_y || p.1 > 0.0)
                .map(|&(px, py)| format!("{:.1},{:.1}", x(px), y(py)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                points.join(" ")
            );
            for point in &points {
                let (px, py) = point.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(out, r#"<circle cx="{px}" cy="{py}" r="3" fill="{color}"/>"#);
            }
        }
        legend(&mut out, &self.series.iter().map(|s| s.name.as_str()).collect::<Vec<_>>());
        out.push_str("</svg>\n");
        out
    }
}

/// Grouped bars: one group per category, one bar per series.
pub(crate) struct BarChart {
    pub(crate) title: String,
    pub(crate) y_label: String,
    pub(crate) categories: Vec<String>,
    /// Per series, one value per category (`None`: not measured).
    pub(crate) series: Vec<(String, Vec<Option<f64>>)>,
}

impl BarChart {
    /// The chart as an SVG document.
    pub(crate) fn render(&self) -> String {
        let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
        let y_axis = Axis::new(self.series.iter().flat_map(|s| s.1.iter().flatten().copied()), false);
        let y = |v: f64| TOP + plot_h - y_axis.position(v) * plot_h;
        let mut out = String::new();
        header(&mut out, &self.title);
        y_grid(&mut out, &y_axis, plot_w, &y);
        let groups = self.categories.len().max(1) as f64;
        let group_w = plot_w / groups;
        let bar_w = group_w * 0.8 / self.series.len().max(1) as f64;
        for (g, category) in self.categories.iter().enumerate() {
            let gx = LEFT + g as f64 * group_w;
            let _ = writeln!(
                out,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                gx + group_w / 2.0,
                TOP + plot_h + 16.0,
                escape(category)
            );
            for (s, (_, values)) in self.series.iter().enumerate() {
                let Some(value) = values.get(g).copied().flatten() else { continue };
                let color = COLORS[s % COLORS.len()];
                let bx = gx + group_w * 0.1 + s as f64 * bar_w;
                let _ = writeln!(
                    out,
                    r#"<rect x="{bx:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}</title></rect>"#,
                    y(value),
                    bar_w * 0.9,
                    (y(y_axis.low.max(0.0)) - y(value)).max(0.0),
                    number(value)
                );
            }
        }
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>
<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"##,
            TOP + plot_h / 2.0,
            escape(&self.y_label)
        );
        legend(&mut out, &self.series.iter().map(|s| s.0.as_str()).collect::<Vec<_>>());
        out.push_str("</svg>\n");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_well_formed_svg() {
        let line = LineChart {
            title: "a <title>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: true,
            log_y: true,
            x_ticks: vec![(256.0, "256 B".into()), (1024.0, "1 KiB".into())],
            series: vec![Series { name: "s".into(), points: vec![(256.0, 10.0), (1024.0, 1000.0)] }],
        }
        .render();
        assert!(line.starts_with("<svg") && line.trim_end().ends_with("</svg>"));
        assert!(line.contains("a &lt;title&gt;") && line.contains("<polyline"));
        let bars = BarChart {
            title: "t".into(),
            y_label: "y".into(),
            categories: vec!["a".into(), "b".into()],
            series: vec![("s".into(), vec![Some(1.0), None])],
        }
        .render();
        assert_eq!(bars.matches("<rect x=").count(), 1 + 1 + 1, "one bar, one legend box, the frame");
    }
}
