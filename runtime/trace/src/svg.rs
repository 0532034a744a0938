//! SVG pictures, written by hand (no fonts, no system libraries, any machine): a document writer
//! through which every attribute value and every text goes through one escaping function,
//! [`escape`], and the line and bar charts of the benchmark reports. The runtime's timeline and
//! the CLI's replay panels are drawn with the same writer.
//!
//! ```
//! use steppool_trace::svg::Svg;
//! let mut svg = Svg::new(200.0, 100.0, &[("font-family", &"sans-serif")]);
//! svg.text("text", &[("x", &10), ("y", &20)], "peak <reserved> & \"live\"");
//! let document = svg.finish();
//! assert!(document.contains("peak &lt;reserved&gt; &amp; &quot;live&quot;"));
//! ```

use std::borrow::Cow;
use std::fmt::{self, Write as _};

/// `text` with the five characters XML gives meaning to replaced by entities (`&` `<` `>` `"`
/// `'`), fit for an attribute value or element text. Everything [`Svg`] writes goes through it.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.contains(['&', '<', '>', '"', '\'']) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            other => out.push(other),
        }
    }
    Cow::Owned(out)
}

/// An element's attributes: names (written as given: they are the writer's own words) and values
/// (escaped).
pub type Attrs<'a> = [(&'a str, &'a dyn fmt::Display)];

/// An SVG document being written.
#[derive(Debug)]
pub struct Svg {
    out: String,
}

fn is_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b':'))
}

impl Svg {
    /// A document `width` × `height` pixels (its `viewBox` the same), with `attrs` on the root
    /// element, on a white background.
    pub fn new(width: f64, height: f64, attrs: &Attrs<'_>) -> Self {
        let mut svg = Self { out: String::new() };
        let root: [(&str, &dyn fmt::Display); 4] = [
            ("xmlns", &"http://www.w3.org/2000/svg"),
            ("width", &width),
            ("height", &height),
            ("viewBox", &format_args!("0 0 {width} {height}")),
        ];
        svg.start("svg", &root);
        svg.attributes(attrs);
        svg.out.push_str(">\n");
        svg.element("rect", &[("width", &"100%"), ("height", &"100%"), ("fill", &"white")]);
        svg
    }

    fn start(&mut self, tag: &str, attrs: &Attrs<'_>) {
        debug_assert!(is_name(tag), "element name `{tag}`");
        self.out.push('<');
        self.out.push_str(tag);
        self.attributes(attrs);
    }

    fn attributes(&mut self, attrs: &Attrs<'_>) {
        for (name, value) in attrs {
            debug_assert!(is_name(name), "attribute name `{name}`");
            let value = value.to_string();
            let _ = write!(self.out, " {name}=\"{}\"", escape(&value));
        }
    }

    /// An empty element: `<tag a="v" .../>`.
    pub fn element(&mut self, tag: &str, attrs: &Attrs<'_>) {
        self.start(tag, attrs);
        self.out.push_str("/>\n");
    }

    /// An element holding `text`: `<tag a="v" ...>text</tag>`.
    pub fn text(&mut self, tag: &str, attrs: &Attrs<'_>, text: &str) {
        self.start(tag, attrs);
        self.out.push('>');
        self.out.push_str(&escape(text));
        self.close(tag);
    }

    /// Opens an element whose children follow; [`Svg::close`] ends it.
    pub fn open(&mut self, tag: &str, attrs: &Attrs<'_>) {
        self.start(tag, attrs);
        self.out.push('>');
    }

    /// Ends the element `tag` that [`Svg::open`] began.
    pub fn close(&mut self, tag: &str) {
        debug_assert!(is_name(tag), "element name `{tag}`");
        let _ = writeln!(self.out, "</{tag}>");
    }

    /// The document, closed.
    pub fn finish(mut self) -> String {
        self.out.push_str("</svg>\n");
        self.out
    }
}

/// A number with one decimal, the precision coordinates are written with.
#[derive(Clone, Copy, Debug)]
pub struct Px(pub f64);

impl fmt::Display for Px {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1}", self.0)
    }
}

const CHART_WIDTH: f64 = 760.0;
const CHART_HEIGHT: f64 = 440.0;
const CHART_LEFT: f64 = 80.0;
const CHART_RIGHT: f64 = 200.0;
const CHART_TOP: f64 = 40.0;
const CHART_BOTTOM: f64 = 60.0;
const CHART_COLORS: [&str; 10] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

/// One named series of `(x, y)` points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Its name in the legend.
    pub name: String,
    /// Its points, in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart, each axis linear or logarithmic (base 10 ticks, or the given ones for x).
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Its title.
    pub title: String,
    /// The x axis's label.
    pub x_label: String,
    /// The y axis's label.
    pub y_label: String,
    /// Whether x is logarithmic.
    pub log_x: bool,
    /// Whether y is logarithmic.
    pub log_y: bool,
    /// Labelled ticks on the x axis.
    pub x_ticks: Vec<(f64, String)>,
    /// The lines.
    pub series: Vec<Series>,
}

/// Grouped bars: one group per category, one bar per series.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// Its title.
    pub title: String,
    /// The y axis's label.
    pub y_label: String,
    /// The groups, left to right.
    pub categories: Vec<String>,
    /// Per series, its name and one value per category (`None`: not measured).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

/// A short label for a value on a value axis: `1.5k`, `2M`, `0.125`.
pub fn number(value: f64) -> String {
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

fn chart(title: &str) -> Svg {
    let mut svg = Svg::new(CHART_WIDTH, CHART_HEIGHT, &[("font-family", &"sans-serif"), ("font-size", &12)]);
    let x = CHART_LEFT + (CHART_WIDTH - CHART_LEFT - CHART_RIGHT) / 2.0;
    svg.text("text", &[("x", &x), ("y", &22), ("text-anchor", &"middle"), ("font-size", &15)], title);
    svg
}

fn legend(svg: &mut Svg, names: &[&str]) {
    for (i, name) in names.iter().enumerate() {
        let y = CHART_TOP + 10.0 + i as f64 * 18.0;
        let x = CHART_WIDTH - CHART_RIGHT + 15.0;
        let color = CHART_COLORS[i % CHART_COLORS.len()];
        svg.element("rect", &[("x", &x), ("y", &(y - 10.0)), ("width", &12), ("height", &12), ("fill", &color)]);
        svg.text("text", &[("x", &(x + 18.0)), ("y", &y)], name);
    }
}

/// The horizontal grid lines of `axis` across a plot `plot_w` wide, with their labels.
fn y_grid(svg: &mut Svg, axis: &Axis, plot_w: f64, y: &dyn Fn(f64) -> f64) {
    for tick in axis.ticks() {
        let py = y(tick);
        svg.element(
            "line",
            &[("x1", &CHART_LEFT), ("x2", &(CHART_LEFT + plot_w)), ("y1", &py), ("y2", &py), ("stroke", &"#ddd")],
        );
        svg.text("text", &[("x", &(CHART_LEFT - 6.0)), ("y", &(py + 4.0)), ("text-anchor", &"end")], &number(tick));
    }
}

fn frame(svg: &mut Svg, plot_w: f64, plot_h: f64) {
    svg.element(
        "rect",
        &[
            ("x", &CHART_LEFT),
            ("y", &CHART_TOP),
            ("width", &plot_w),
            ("height", &plot_h),
            ("fill", &"none"),
            ("stroke", &"#333"),
        ],
    );
}

fn y_label(svg: &mut Svg, label: &str, plot_h: f64) {
    let transform = format!("translate(18 {}) rotate(-90)", CHART_TOP + plot_h / 2.0);
    svg.text("text", &[("transform", &transform), ("text-anchor", &"middle")], label);
}

impl LineChart {
    /// The chart as an SVG document.
    pub fn render(&self) -> String {
        let (plot_w, plot_h) = (CHART_WIDTH - CHART_LEFT - CHART_RIGHT, CHART_HEIGHT - CHART_TOP - CHART_BOTTOM);
        let all = || self.series.iter().flat_map(|s| s.points.iter());
        let x_axis = Axis::new(all().map(|p| p.0).chain(self.x_ticks.iter().map(|t| t.0)), self.log_x);
        let y_axis = Axis::new(all().map(|p| p.1), self.log_y);
        let x = |v: f64| CHART_LEFT + x_axis.position(v) * plot_w;
        let y = |v: f64| CHART_TOP + plot_h - y_axis.position(v) * plot_h;
        let mut svg = chart(&self.title);
        y_grid(&mut svg, &y_axis, plot_w, &y);
        for (value, label) in &self.x_ticks {
            let px = x(*value);
            svg.element(
                "line",
                &[("x1", &px), ("x2", &px), ("y1", &CHART_TOP), ("y2", &(CHART_TOP + plot_h)), ("stroke", &"#eee")],
            );
            svg.text("text", &[("x", &px), ("y", &(CHART_TOP + plot_h + 16.0)), ("text-anchor", &"middle")], label);
        }
        frame(&mut svg, plot_w, plot_h);
        svg.text(
            "text",
            &[("x", &(CHART_LEFT + plot_w / 2.0)), ("y", &(CHART_HEIGHT - 18.0)), ("text-anchor", &"middle")],
            &self.x_label,
        );
        y_label(&mut svg, &self.y_label, plot_h);
        for (i, series) in self.series.iter().enumerate() {
            let color = CHART_COLORS[i % CHART_COLORS.len()];
            let points: Vec<(f64, f64)> =
                series.points.iter().filter(|p| !self.log_y || p.1 > 0.0).map(|&(px, py)| (x(px), y(py))).collect();
            let line: Vec<String> = points.iter().map(|&(px, py)| format!("{px:.1},{py:.1}")).collect();
            svg.element(
                "polyline",
                &[("points", &line.join(" ")), ("fill", &"none"), ("stroke", &color), ("stroke-width", &2)],
            );
            for &(px, py) in &points {
                svg.element("circle", &[("cx", &Px(px)), ("cy", &Px(py)), ("r", &3), ("fill", &color)]);
            }
        }
        legend(&mut svg, &self.series.iter().map(|s| s.name.as_str()).collect::<Vec<_>>());
        svg.finish()
    }
}

impl BarChart {
    /// The chart as an SVG document.
    pub fn render(&self) -> String {
        let (plot_w, plot_h) = (CHART_WIDTH - CHART_LEFT - CHART_RIGHT, CHART_HEIGHT - CHART_TOP - CHART_BOTTOM);
        let y_axis = Axis::new(self.series.iter().flat_map(|s| s.1.iter().flatten().copied()), false);
        let y = |v: f64| CHART_TOP + plot_h - y_axis.position(v) * plot_h;
        let mut svg = chart(&self.title);
        y_grid(&mut svg, &y_axis, plot_w, &y);
        let groups = self.categories.len().max(1) as f64;
        let group_w = plot_w / groups;
        let bar_w = group_w * 0.8 / self.series.len().max(1) as f64;
        for (g, category) in self.categories.iter().enumerate() {
            let gx = CHART_LEFT + g as f64 * group_w;
            svg.text(
                "text",
                &[("x", &(gx + group_w / 2.0)), ("y", &(CHART_TOP + plot_h + 16.0)), ("text-anchor", &"middle")],
                category,
            );
            for (s, (_, values)) in self.series.iter().enumerate() {
                let Some(value) = values.get(g).copied().flatten() else { continue };
                let color = CHART_COLORS[s % CHART_COLORS.len()];
                let bx = gx + group_w * 0.1 + s as f64 * bar_w;
                svg.open(
                    "rect",
                    &[
                        ("x", &Px(bx)),
                        ("y", &Px(y(value))),
                        ("width", &Px(bar_w * 0.9)),
                        ("height", &Px((y(y_axis.low.max(0.0)) - y(value)).max(0.0))),
                        ("fill", &color),
                    ],
                );
                svg.text("title", &[], &number(value));
                svg.close("rect");
            }
        }
        frame(&mut svg, plot_w, plot_h);
        y_label(&mut svg, &self.y_label, plot_h);
        legend(&mut svg, &self.series.iter().map(|s| s.0.as_str()).collect::<Vec<_>>());
        svg.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_five_xml_characters_are_escaped_in_attributes_and_text() {
        let hostile = r#"a"b<c>d&e'f"#;
        let escaped = "a&quot;b&lt;c&gt;d&amp;e&#39;f";
        assert_eq!(escape(hostile), escaped);
        assert!(matches!(escape("plain text"), Cow::Borrowed("plain text")));

        let mut svg = Svg::new(10.0, 10.0, &[("data-root", &hostile)]);
        svg.text("text", &[("x", &1), ("data-label", &hostile)], hostile);
        svg.open("g", &[("id", &hostile)]);
        svg.text("title", &[], hostile);
        svg.close("g");
        let document = svg.finish();
        assert_eq!(document.matches(escaped).count(), 5, "{document}");
        assert!(!document.contains(hostile));
        let parsed = roxmltree::Document::parse(&document).expect("well-formed");
        let root = parsed.root_element();
        assert_eq!(root.attribute("data-root"), Some(hostile));
        let text = root.descendants().find(|n| n.has_tag_name("text")).unwrap();
        assert_eq!((text.attribute("data-label"), text.text()), (Some(hostile), Some(hostile)));
        let title = root.descendants().find(|n| n.has_tag_name("title")).unwrap();
        assert_eq!(title.text(), Some(hostile));
    }

    #[test]
    fn charts_are_well_formed_svg() {
        let line = LineChart {
            title: "a <title>".into(),
            x_label: "x \"axis\"".into(),
            y_label: "y".into(),
            log_x: true,
            log_y: true,
            x_ticks: vec![(256.0, "256 B".into()), (1024.0, "1 KiB".into())],
            series: vec![Series { name: "it's".into(), points: vec![(256.0, 10.0), (1024.0, 1000.0)] }],
        }
        .render();
        assert!(line.starts_with("<svg") && line.trim_end().ends_with("</svg>"));
        assert!(line.contains("a &lt;title&gt;") && line.contains("<polyline"));
        let parsed = roxmltree::Document::parse(&line).expect("well-formed");
        let texts: Vec<&str> = parsed.descendants().filter_map(|n| n.text()).collect();
        assert!(texts.contains(&"x \"axis\"") && texts.contains(&"it's"));
        let bars = BarChart {
            title: "t".into(),
            y_label: "y".into(),
            categories: vec!["a".into(), "b".into()],
            series: vec![("s".into(), vec![Some(1.0), None])],
        }
        .render();
        roxmltree::Document::parse(&bars).expect("well-formed");
        assert_eq!(bars.matches("<rect ").count(), 1 + 1 + 1 + 1, "background, one bar, the frame, one legend box");
    }
}
