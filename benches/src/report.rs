//! The results of a run: one JSON document, a Markdown table per benchmark and SVG plots, all
//! from the records of the benchmarks, criterion and the peer harness.
//!
//! Every table gives ratios to `driver_pool` (the bare `cuMemAllocFromPoolAsync` pool, threshold
//! raised) measured in the same run, because absolute times drift between machines; rows
//! measured from Python are divided by the Python-side `driver_pool` when the harness measured
//! one (marked `py`), so that the interpreter's overhead cancels out.

use std::collections::BTreeSet;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use steppool::sys::bytes::Bytes;

use crate::record::{DeviceInfo, Line, Record, Skip};
use crate::{BenchError, Result};
use steppool_trace::svg::{BarChart, LineChart, Series};

/// The version of the results document's layout.
pub const SCHEMA: u32 = 1;

/// The Rust allocators, in table order.
const RUST_ORDER: [&str; 8] = [
    "cuda_malloc",
    "default_pool_t0",
    "default_pool",
    "driver_pool",
    "steppool_pool",
    "steppool_arena",
    "steppool_planned",
    "preallocated",
];

/// A run's results.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// [`SCHEMA`].
    pub schema: u32,
    /// The day of the run, `YYYY-MM-DD` (UTC).
    pub date: String,
    /// `smoke` or `full`.
    pub mode: String,
    /// What the Rust benchmarks ran on.
    pub device: DeviceInfo,
    /// What the peer harness saw, when it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_device: Option<DeviceInfo>,
    /// Every measured number.
    pub records: Vec<Record>,
    /// Allocators left out, and why.
    pub skipped: Vec<Skip>,
}

impl Results {
    /// Gathers `lines` (the benchmarks' and the peers' records files) and criterion's records.
    pub fn collect(lines: Vec<Line>, criterion: Vec<Record>, mode: &str, date: String) -> Result<Self> {
        let mut device = None;
        let mut peer_device = None;
        let mut records = criterion;
        let mut skipped = Vec::new();
        for line in lines {
            match line {
                Line::Device(info) if is_python(&info) => peer_device = peer_device.or(Some(info)),
                Line::Device(info) => device = device.or(Some(info)),
                Line::Record(record) => records.push(record),
                Line::Skipped(skip) => skipped.push(skip),
            }
        }
        let device = device.ok_or_else(|| BenchError::Sequence {
            sequence: "records".to_owned(),
            index: 0,
            reason: "no device line: did any Rust benchmark run with STEPPOOL_BENCH_RECORDS set?".to_owned(),
        })?;
        Ok(Self { schema: SCHEMA, date, mode: mode.to_owned(), device, peer_device, records, skipped })
    }

    /// `<date>-<device>`: the stem of every file of the run.
    pub fn stem(&self) -> String {
        format!("{}-{}", self.date, self.device.slug())
    }

    fn find(&self, bench: &str, allocator: &str, source: &str) -> impl Iterator<Item = &Record> {
        self.records.iter().filter(move |r| r.bench == bench && r.allocator == allocator && r.source == source)
    }

    fn value(&self, bench: &str, row: &Row, workload: Option<&str>, param: Option<u64>, metric: &str) -> Option<f64> {
        self.find(bench, &row.allocator, &row.source)
            .find(|r| r.metric == metric && r.workload.as_deref() == workload && r.param == param)
            .map(|r| r.value)
    }

    /// The rows of a benchmark: Rust allocators in table order, then Python ones by name.
    fn rows(&self, bench: &str) -> Vec<Row> {
        let mut present: BTreeSet<(u8, usize, String, String)> = BTreeSet::new();
        for r in self.records.iter().filter(|r| r.bench == bench && r.allocator != "sequence") {
            let rank = RUST_ORDER.iter().position(|&a| a == r.allocator).unwrap_or(RUST_ORDER.len());
            let python = u8::from(r.source != "rust");
            present.insert((python, rank, r.allocator.clone(), r.source.clone()));
        }
        present.into_iter().map(|(_, _, allocator, source)| Row { allocator, source }).collect()
    }

    fn params(&self, bench: &str) -> Vec<u64> {
        self.records
            .iter()
            .filter(|r| r.bench == bench)
            .filter_map(|r| r.param)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    fn workloads(&self, bench: &str) -> Vec<String> {
        let mut seen = Vec::new();
        for r in self.records.iter().filter(|r| r.bench == bench) {
            if let Some(w) = &r.workload
                && !seen.contains(w)
            {
                seen.push(w.clone());
            }
        }
        seen
    }

    /// The baseline row for `row`: Python's own `driver_pool` for Python rows when measured.
    fn baseline(&self, bench: &str, row: &Row) -> Row {
        let python = Row { allocator: "driver_pool".to_owned(), source: row.source.clone() };
        if row.source != "rust" && self.find(bench, "driver_pool", &row.source).next().is_some() {
            python
        } else {
            Row { allocator: "driver_pool".to_owned(), source: "rust".to_owned() }
        }
    }

    /// The Markdown report: device, tables and the goals, as measured.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let d = &self.device;
        let simulated = d.kind != "gpu";
        let _ = writeln!(out, "# steppool benchmarks: {} ({}, {} mode)\n", d.name, self.date, self.mode);
        let _ = writeln!(
            out,
            "- Device: {} ({}), {}; driver: {}\n- Host: {}, {} threads, {}",
            d.name,
            d.kind,
            Bytes(d.total_memory),
            d.driver,
            d.host.cpu,
            d.host.threads,
            d.host.os
        );
        if let Some(p) = &self.peer_device {
            let _ = writeln!(out, "- Peers ran on: {} ({})", p.name, p.driver);
        }
        if simulated {
            let _ = writeln!(
                out,
                "\n**Simulated device.** No GPU: the driver is steppool's CPU model of it, kernels do not run, \
                 and the placement inside pools is a documented model, not NVIDIA's. These numbers measure \
                 steppool's own overhead, not a GPU."
            );
        }
        let _ = writeln!(
            out,
            "\nRatios (×) are to `driver_pool` measured in this run (Python rows: to Python's `driver_pool` \
             where measured, marked py). Times are criterion's typical time per iteration."
        );
        for (bench, title) in [
            ("latency", "Allocation latency: alloc + free pair"),
            ("latency_sync", "Allocation latency with a stream synchronization after each pair"),
        ] {
            self.latency_table(&mut out, bench, title);
        }
        self.concurrency_table(&mut out);
        self.release_table(&mut out);
        self.kernel_table(&mut out);
        self.fragmentation_table(&mut out);
        self.goals(&mut out);
        if !self.skipped.is_empty() {
            let _ = writeln!(out, "\n## Left out\n\n| allocator | source | reason |\n| --- | --- | --- |");
            for s in &self.skipped {
                let _ = writeln!(out, "| `{}` | {} | {} |", s.allocator, s.source, s.reason.replace('|', "/"));
            }
        }
        out
    }

    fn latency_table(&self, out: &mut String, bench: &str, title: &str) {
        let rows = self.rows(bench);
        if rows.is_empty() {
            return;
        }
        let sizes = self.params(bench);
        let _ = writeln!(out, "\n## {title}\n");
        let _ = write!(out, "| allocator |");
        sizes.iter().for_each(|&s| {
            let _ = write!(out, " {} |", Bytes(s));
        });
        let _ = write!(out, "\n| --- |");
        sizes.iter().for_each(|_| out.push_str(" ---: |"));
        out.push('\n');
        for row in &rows {
            let base = self.baseline(bench, row);
            let _ = write!(out, "| {} |", row.label());
            for &size in &sizes {
                let cell = match self.value(bench, row, None, Some(size), "ns") {
                    Some(ns) => {
                        let ratio = self.value(bench, &base, None, Some(size), "ns").map(|b| ns / b);
                        format!("{} ({})", time(ns), ratio_text(ratio, &base))
                    }
                    None => "–".to_owned(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    fn concurrency_table(&self, out: &mut String) {
        let bench = "concurrency";
        let rows = self.rows(bench);
        if rows.is_empty() {
            return;
        }
        let threads = self.params(bench);
        let _ = writeln!(
            out,
            "\n## Concurrency: threads each on its own stream, 64 KiB pairs\n\n\
             Each cell: million pairs per second, its scaling against one thread, and the ratio of \
             throughput to `driver_pool` at the same thread count.\n"
        );
        let _ = write!(out, "| allocator |");
        threads.iter().for_each(|t| {
            let _ = write!(out, " {t} thread{} |", if *t == 1 { "" } else { "s" });
        });
        let _ = write!(out, "\n| --- |");
        threads.iter().for_each(|_| out.push_str(" ---: |"));
        out.push('\n');
        for row in &rows {
            let base = self.baseline(bench, row);
            let _ = write!(out, "| {} |", row.label());
            for &t in &threads {
                let cell = match self.throughput(row, t) {
                    Some(rate) => {
                        let scaling = self.throughput(row, 1).map(|one| rate / one);
                        let ratio = self.throughput(&base, t).map(|b| rate / b);
                        format!(
                            "{:.2} M/s, {} scaling, {}",
                            rate / 1e6,
                            scaling.map(|s| format!("{s:.2}×")).unwrap_or_else(|| "–".into()),
                            ratio_text(ratio, &base)
                        )
                    }
                    None => "–".to_owned(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    /// Pairs per second of `row` at `threads` threads.
    fn throughput(&self, row: &Row, threads: u64) -> Option<f64> {
        self.value("concurrency", row, None, Some(threads), "ns").map(|ns| threads as f64 * 1e9 / ns)
    }

    fn release_table(&self, out: &mut String) {
        let bench = "step_release";
        let rows = self.rows(bench);
        if rows.is_empty() {
            return;
        }
        let live = self.params(bench);
        let rust = |a: &str| Row { allocator: a.to_owned(), source: "rust".to_owned() };
        let pair = self.value("latency", &rust("driver_pool"), None, Some(64 << 10), "ns");
        let _ = writeln!(
            out,
            "\n## Step release: ending a step with N live 64 KiB allocations\n\n\
             Each cell: the release, its cost per allocation, and that cost against one `driver_pool` \
             alloc + free pair of 64 KiB.\n"
        );
        let _ = write!(out, "| strategy |");
        live.iter().for_each(|n| {
            let _ = write!(out, " {n} live |");
        });
        let _ = write!(out, "\n| --- |");
        live.iter().for_each(|_| out.push_str(" ---: |"));
        out.push('\n');
        for row in &rows {
            let _ = write!(out, "| {} |", row.label());
            for &n in &live {
                let cell = match self.value(bench, row, None, Some(n), "ns") {
                    Some(ns) => {
                        let each = ns / n as f64;
                        let ratio = pair.map(|p| format!("{:.2}×", each / p)).unwrap_or_else(|| "–".into());
                        format!("{}, {} each, {ratio}", time(ns), time(each))
                    }
                    None => "–".to_owned(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    fn kernel_table(&self, out: &mut String) {
        let bench = "kernel_step";
        let rows: Vec<Row> = self.rows(bench);
        if rows.is_empty() {
            return;
        }
        let rust = |a: &str| Row { allocator: a.to_owned(), source: "rust".to_owned() };
        for workload in self.workloads(bench) {
            let w = Some(workload.as_str());
            let floor = self.value(bench, &rust("preallocated"), w, None, "ns");
            let base = self.value(bench, &rust("driver_pool"), w, None, "ns");
            let _ = writeln!(
                out,
                "\n## Kernel-level step (`{workload}`): every buffer written by `fill_v4`\n\n\
                 | allocator | step time | × preallocated | × driver_pool | release share of the step |\n\
                 | --- | ---: | ---: | ---: | ---: |"
            );
            for row in &rows {
                let Some(ns) = self.value(bench, row, w, None, "ns") else { continue };
                let share = self
                    .value(bench, row, w, None, "release_share")
                    .map(|s| format!("{:.4} %", s * 100.0))
                    .unwrap_or_else(|| "–".into());
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {share} |",
                    row.label(),
                    time(ns),
                    floor.map(|f| format!("{:.3}×", ns / f)).unwrap_or_else(|| "–".into()),
                    base.map(|b| format!("{:.3}×", ns / b)).unwrap_or_else(|| "–".into()),
                );
            }
        }
    }

    fn fragmentation_table(&self, out: &mut String) {
        let bench = "fragmentation";
        let workloads = self.workloads(bench);
        if workloads.is_empty() {
            return;
        }
        let _ = writeln!(
            out,
            "\n## Fragmentation: peak reserved (device footprint) per sequence\n\n\
             Each cell: peak reserved, its ratio to the sequence's peak live bytes (1.00 is perfect \
             packing), and its ratio to `driver_pool`.\n"
        );
        let _ = write!(out, "| allocator |");
        workloads.iter().for_each(|w| {
            let _ = write!(out, " `{w}` |");
        });
        let _ = write!(out, "\n| --- |");
        workloads.iter().for_each(|_| out.push_str(" ---: |"));
        let _ = write!(out, "\n| peak live |");
        for w in &workloads {
            let live = self.peak_live(w).map(|v| Bytes(v as u64).to_string()).unwrap_or_else(|| "–".into());
            let _ = write!(out, " {live} |");
        }
        out.push('\n');
        for row in self.rows(bench) {
            let base = Row { allocator: "driver_pool".to_owned(), source: "rust".to_owned() };
            let _ = write!(out, "| {} |", row.label());
            for w in &workloads {
                let cell = match self.value(bench, &row, Some(w), None, "peak_reserved_bytes") {
                    Some(peak) => {
                        let over = self.peak_live(w).map(|l| format!("{:.2}× live", peak / l)).unwrap_or_default();
                        let ratio = self.value(bench, &base, Some(w), None, "peak_reserved_bytes").map(|b| peak / b);
                        format!("{}, {over}, {}", Bytes(peak as u64), ratio_text(ratio, &base))
                    }
                    None => "–".to_owned(),
                };
                let _ = write!(out, " {cell} |");
            }
            out.push('\n');
        }
    }

    fn peak_live(&self, workload: &str) -> Option<f64> {
        self.records
            .iter()
            .find(|r| {
                r.bench == "fragmentation" && r.metric == "peak_live_bytes" && r.workload.as_deref() == Some(workload)
            })
            .map(|r| r.value)
    }

    /// The goals of the issue, each with what this run measured. Readings, never assertions.
    fn goals(&self, out: &mut String) {
        let rust = |a: &str| Row { allocator: a.to_owned(), source: "rust".to_owned() };
        let mut rows: Vec<(String, String, Option<bool>)> = Vec::new();
        let worst =
            |values: Vec<f64>| values.into_iter().fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));

        let ratios: Vec<f64> = self
            .params("latency")
            .into_iter()
            .filter_map(|s| {
                Some(
                    self.value("latency", &rust("steppool_pool"), None, Some(s), "ns")?
                        / self.value("latency", &rust("driver_pool"), None, Some(s), "ns")?,
                )
            })
            .collect();
        let pool = worst(ratios);
        rows.push((
            "`Pool` within 1.1× of the bare driver pool call".into(),
            pool.map(|r| format!("worst size {r:.2}×")).unwrap_or_else(|| "not measured".into()),
            pool.map(|r| r <= 1.1),
        ));
        let arena = worst(
            self.params("latency")
                .into_iter()
                .filter_map(|s| self.value("latency", &rust("steppool_arena"), None, Some(s), "ns"))
                .collect(),
        );
        rows.push((
            "`Arena` under 50 ns per pair".into(),
            arena.map(|ns| format!("worst size {}", time(ns))).unwrap_or_else(|| "not measured".into()),
            arena.map(|ns| ns < 50.0),
        ));
        let planned = worst(
            self.params("latency")
                .into_iter()
                .filter_map(|s| self.value("latency", &rust("steppool_planned"), None, Some(s), "ns"))
                .collect(),
        );
        rows.push((
            "`Planned` pair served from a plan under 50 ns".into(),
            planned.map(|ns| format!("worst size {}", time(ns))).unwrap_or_else(|| "not measured".into()),
            planned.map(|ns| ns < 50.0),
        ));
        for allocator in ["steppool_pool", "steppool_arena"] {
            let scaling = self.throughput(&rust(allocator), 8).zip(self.throughput(&rust(allocator), 1));
            rows.push((
                format!("8 threads at 6× or more of one thread (`{allocator}`)"),
                scaling.map(|(e, o)| format!("{:.2}×", e / o)).unwrap_or_else(|| "not measured".into()),
                scaling.map(|(e, o)| e / o >= 6.0),
            ));
        }
        for workload in self.workloads("kernel_step") {
            let w = Some(workload.as_str());
            for allocator in ["steppool_pool", "steppool_arena"] {
                let share = self.value("kernel_step", &rust(allocator), w, None, "release_share");
                rows.push((
                    format!("step release under 0.1 % of step time (`{allocator}`)"),
                    share.map(|s| format!("{:.4} %", s * 100.0)).unwrap_or_else(|| "not measured".into()),
                    share.map(|s| s < 0.001),
                ));
                let ratio = self
                    .value("kernel_step", &rust(allocator), w, None, "ns")
                    .zip(self.value("kernel_step", &rust("preallocated"), w, None, "ns"))
                    .map(|(a, f)| a / f);
                rows.push((
                    format!("kernel-level step within 1 % of preallocated (`{allocator}`)"),
                    ratio.map(|r| format!("{r:.3}×")).unwrap_or_else(|| "not measured".into()),
                    ratio.map(|r| r <= 1.01),
                ));
            }
        }
        for workload in self.workloads("fragmentation") {
            let peak = |row: &Row| self.value("fragmentation", row, Some(&workload), None, "peak_reserved_bytes");
            let all = self.rows("fragmentation");
            let ours =
                all.iter().filter(|r| r.allocator.starts_with("steppool")).filter_map(peak).fold(f64::NAN, f64::min);
            let others = |python: bool| -> Option<(String, f64)> {
                all.iter()
                    .filter(|r| !r.allocator.starts_with("steppool") && (r.source != "rust") == python)
                    .filter_map(|r| peak(r).map(|p| (r.label(), p)))
                    .min_by(|a, b| a.1.total_cmp(&b.1))
            };
            let (peer, driver) = (others(true), others(false));
            let met = peer.as_ref().filter(|_| !ours.is_nan()).map(|(_, b)| ours <= *b);
            let driver_text = driver
                .map(|(name, b)| format!("; best driver allocator {} ({name})", Bytes(b as u64)))
                .unwrap_or_default();
            rows.push((
                format!("peak reserved at or below every peer (`{workload}`)"),
                match (&peer, ours.is_nan()) {
                    (_, true) => "not measured".into(),
                    (Some((name, b)), false) => {
                        format!(
                            "steppool (best strategy) {} vs best peer {} ({name}){driver_text}",
                            Bytes(ours as u64),
                            Bytes(*b as u64)
                        )
                    }
                    (None, false) => {
                        format!("steppool (best strategy) {}; no peer measured{driver_text}", Bytes(ours as u64))
                    }
                },
                met,
            ));
        }
        let _ = writeln!(
            out,
            "\n## Goals, as measured in this run{}\n\n| goal | measured | met |\n| --- | --- | --- |",
            if self.device.kind != "gpu" { " (simulated device: not a GPU reading)" } else { "" }
        );
        for (goal, measured, met) in rows {
            let met = match met {
                Some(true) => "yes",
                Some(false) => "no",
                None => "–",
            };
            let _ = writeln!(out, "| {goal} | {measured} | {met} |");
        }
    }

    /// The plots: latency by size, scaling by threads, peak reserved by allocator.
    pub fn plots(&self) -> Vec<(String, String)> {
        let mut plots = Vec::new();
        let sim = if self.device.kind == "gpu" { String::new() } else { " (simulated device)".to_owned() };
        let sizes = self.params("latency");
        if !sizes.is_empty() {
            let series = self
                .rows("latency")
                .iter()
                .map(|row| Series {
                    name: row.label().replace('`', ""),
                    points: sizes
                        .iter()
                        .filter_map(|&s| self.value("latency", row, None, Some(s), "ns").map(|ns| (s as f64, ns)))
                        .collect(),
                })
                .collect();
            let chart = LineChart {
                title: format!("Alloc + free latency by size{sim}"),
                x_label: "allocation size".into(),
                y_label: "ns per pair".into(),
                log_x: true,
                log_y: true,
                x_ticks: sizes.iter().map(|&s| (s as f64, Bytes(s).to_string())).collect(),
                series,
            };
            plots.push(("latency".to_owned(), chart.render()));
        }
        let threads = self.params("concurrency");
        if !threads.is_empty() {
            let series = self
                .rows("concurrency")
                .iter()
                .map(|row| Series {
                    name: row.label().replace('`', ""),
                    points: threads
                        .iter()
                        .filter_map(|&t| self.throughput(row, t).map(|rate| (t as f64, rate)))
                        .collect(),
                })
                .collect();
            let chart = LineChart {
                title: format!("Throughput by threads, 64 KiB pairs{sim}"),
                x_label: "threads (one stream each)".into(),
                y_label: "pairs per second".into(),
                log_x: true,
                log_y: true,
                x_ticks: threads.iter().map(|&t| (t as f64, t.to_string())).collect(),
                series,
            };
            plots.push(("scaling".to_owned(), chart.render()));
        }
        let workloads = self.workloads("fragmentation");
        if !workloads.is_empty() {
            let series = self
                .rows("fragmentation")
                .iter()
                .map(|row| {
                    let values = workloads
                        .iter()
                        .map(|w| {
                            let peak = self.value("fragmentation", row, Some(w), None, "peak_reserved_bytes")?;
                            Some(peak / self.peak_live(w)?)
                        })
                        .collect();
                    (row.label().replace('`', ""), values)
                })
                .collect();
            let chart = BarChart {
                title: format!("Peak reserved / peak live by allocator{sim}"),
                y_label: "peak reserved ÷ peak live".into(),
                categories: workloads.clone(),
                series,
            };
            plots.push(("peak_reserved".to_owned(), chart.render()));
        }
        plots
    }

    /// Writes `<stem>.json`, `<stem>.md` and `<stem>-<plot>.svg` into `dir`; returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| BenchError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let stem = self.stem();
        let mut written = Vec::new();
        let json = dir.join(format!("{stem}.json"));
        let text = serde_json::to_string_pretty(self).expect("results serialize");
        std::fs::write(&json, text + "\n").map_err(io(&json))?;
        written.push(json);
        let md = dir.join(format!("{stem}.md"));
        std::fs::write(&md, self.markdown()).map_err(io(&md))?;
        written.push(md);
        for (name, svg) in self.plots() {
            let path = dir.join(format!("{stem}-{name}.svg"));
            std::fs::write(&path, svg).map_err(io(&path))?;
            written.push(path);
        }
        Ok(written)
    }
}

fn is_python(info: &DeviceInfo) -> bool {
    info.driver.starts_with("python")
}

/// A row of a table: an allocator as measured from one language.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    allocator: String,
    source: String,
}

impl Row {
    fn label(&self) -> String {
        if self.source == "rust" {
            format!("`{}`", self.allocator)
        } else {
            format!("`{}` ({})", self.allocator, self.source)
        }
    }
}

fn ratio_text(ratio: Option<f64>, base: &Row) -> String {
    match ratio {
        Some(r) if base.source == "rust" => format!("{r:.2}×"),
        Some(r) => format!("{r:.2}× py"),
        None => "–".to_owned(),
    }
}

/// `12.3 ns`, `4.56 µs`, `7.89 ms`, `1.23 s`.
fn time(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.1} ns")
    } else if ns < 1e6 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

/// Today's date in UTC, `YYYY-MM-DD`.
pub fn today() -> String {
    let days =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0)
            as i64;
    civil_date(days)
}

/// The calendar date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_date(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::HostInfo;

    fn device(kind: &str, driver: &str) -> DeviceInfo {
        DeviceInfo {
            name: "Test GPU".into(),
            kind: kind.into(),
            driver: driver.into(),
            driver_version: String::new(),
            total_memory: 80 << 30,
            host: HostInfo { cpu: "cpu".into(), threads: 2, os: "linux x86_64".into() },
        }
    }

    fn python(bench: &str, allocator: &str, metric: &str, value: f64) -> Record {
        Record { source: "python".into(), ..Record::rust(bench, allocator, metric, value) }
    }

    fn results() -> Results {
        let lines = vec![
            Line::Device(device("gpu", "CUDA driver 12.9")),
            Line::Device(device("gpu", "python: torch 2.11")),
            Line::Record(Record::rust("fragmentation", "sequence", "peak_live_bytes", 100.0).workload("t5")),
            Line::Record(Record::rust("fragmentation", "driver_pool", "peak_reserved_bytes", 200.0).workload("t5")),
            Line::Record(Record::rust("fragmentation", "steppool_pool", "peak_reserved_bytes", 110.0).workload("t5")),
            Line::Record(python("fragmentation", "torch_native", "peak_reserved_bytes", 150.0).workload("t5")),
            Line::Record(python("latency", "driver_pool", "ns", 2000.0).param(256)),
            Line::Record(python("latency", "torch_native", "ns", 3000.0).param(256)),
            Line::Skipped(Skip {
                allocator: "rmm_pool".into(),
                reason: "rmm is not installed".into(),
                source: "python".into(),
            }),
        ];
        let criterion = vec![
            Record::rust("latency", "driver_pool", "ns", 1000.0).param(256),
            Record::rust("latency", "steppool_pool", "ns", 1050.0).param(256),
            Record::rust("latency", "steppool_arena", "ns", 30.0).param(256),
            Record::rust("concurrency", "steppool_pool", "ns", 1000.0).param(1),
            Record::rust("concurrency", "steppool_pool", "ns", 1250.0).param(8),
        ];
        Results::collect(lines, criterion, "full", "2026-11-21".into()).unwrap()
    }

    #[test]
    fn tables_give_ratios_to_the_driver_pool_of_the_same_language() {
        let results = results();
        assert_eq!(results.stem(), "2026-11-21-test-gpu");
        assert!(results.peer_device.is_some());
        let md = results.markdown();
        assert!(md.contains("| `steppool_pool` | 1.05 µs (1.05×) |"), "{md}");
        assert!(md.contains("| `torch_native` (python) | 3.00 µs (1.50× py) |"), "{md}");
        assert!(md.contains("1.10× live, 0.55×"), "{md}");
        assert!(md.contains("| `rmm_pool` | python | rmm is not installed |"), "{md}");
        // 8 threads: 8 pairs per 1.25 µs = 6.4 M/s against 1 M/s.
        assert!(md.contains("| 8 threads at 6× or more of one thread (`steppool_pool`) | 6.40× | yes |"), "{md}");
        assert!(md.contains("| `Pool` within 1.1× of the bare driver pool call | worst size 1.05× | yes |"), "{md}");
        assert!(md.contains("steppool (best strategy) 110 B vs best peer 150 B (`torch_native` (python)); best driver allocator 200 B (`driver_pool`) | yes |"), "{md}");
    }

    #[test]
    fn results_write_json_markdown_and_plots() {
        let dir = std::env::temp_dir().join(format!("steppool-report-{}", std::process::id()));
        let written = results().write(&dir).unwrap();
        let names: Vec<String> =
            written.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(
            names,
            [
                "2026-11-21-test-gpu.json",
                "2026-11-21-test-gpu.md",
                "2026-11-21-test-gpu-latency.svg",
                "2026-11-21-test-gpu-scaling.svg",
                "2026-11-21-test-gpu-peak_reserved.svg"
            ]
        );
        let back: Results = serde_json::from_str(&std::fs::read_to_string(&written[0]).unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back, results());
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(20_413), "2025-11-21");
        assert_eq!(civil_date(11_016), "2000-02-29");
    }

    #[test]
    fn no_device_line_is_an_error() {
        let error = Results::collect(Vec::new(), Vec::new(), "smoke", "d".into()).unwrap_err();
        assert!(error.to_string().contains("no device line"), "{error}");
    }
}
