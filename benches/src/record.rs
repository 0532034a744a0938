//! The records of a run, one JSON object per line, in one schema for the Rust benchmarks and the
//! Python peer harness (`benches/peers/peers.py`):
//!
//! ```json
//! {"line":"device","name":"NVIDIA H100 80GB HBM3","kind":"gpu","driver":"CUDA driver 12.9 (libcuda.so.1)",...}
//! {"line":"record","bench":"fragmentation","allocator":"steppool_pool","workload":"t5_varlen_train","metric":"peak_reserved_bytes","value":123.0,"source":"rust"}
//! {"line":"skipped","allocator":"rmm_pool","reason":"package rmm is not installed","source":"python"}
//! ```
//!
//! Benchmarks append their lines to the file `STEPPOOL_BENCH_RECORDS` names (none when unset);
//! times measured by criterion are read back from its `estimates.json` files
//! ([`criterion_records`]) and become records of the same shape, with metric `ns`.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{BenchError, Result};

/// The variable naming the file benchmarks append their records to.
pub const RECORDS_VARIABLE: &str = "STEPPOOL_BENCH_RECORDS";

/// The device (and host) a run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The device's name (`cuDeviceGetName`).
    pub name: String,
    /// `gpu` or `simulated`.
    pub kind: String,
    /// The driver, in words.
    pub driver: String,
    /// The driver's version, `12.9`.
    #[serde(default)]
    pub driver_version: String,
    /// The device's memory in bytes.
    pub total_memory: u64,
    /// The machine the benchmarks ran on.
    pub host: HostInfo,
}

impl DeviceInfo {
    /// A short name for file names: `sim`, or the device's name in lower case with dashes
    /// (`nvidia-h100-80gb-hbm3`).
    pub fn slug(&self) -> String {
        if self.kind != "gpu" {
            return "sim".to_owned();
        }
        let mut slug = String::new();
        for c in self.name.chars() {
            if c.is_ascii_alphanumeric() {
                slug.push(c.to_ascii_lowercase());
            } else if !slug.ends_with('-') && !slug.is_empty() {
                slug.push('-');
            }
        }
        let slug = slug.trim_end_matches('-').to_owned();
        if slug.is_empty() { "gpu".to_owned() } else { slug }
    }
}

/// The host's processor, thread count and system.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    /// The processor's model name.
    pub cpu: String,
    /// Hardware threads available to the process.
    pub threads: usize,
    /// Operating system and architecture.
    pub os: String,
}

impl HostInfo {
    /// This machine.
    pub fn current() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|line| line.starts_with("model name"))
                    .and_then(|line| line.split_once(':'))
                    .map(|(_, name)| name.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let os = format!("{} {}", std::env::consts::OS, std::env::consts::ARCH);
        Self { cpu, threads, os }
    }
}

/// One measured number.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The benchmark: `latency`, `concurrency`, `step_release`, `kernel_step`, `fragmentation`.
    pub bench: String,
    /// The allocator (or strategy) measured: `driver_pool`, `steppool_arena`, `torch_native`...
    pub allocator: String,
    /// The workload or sequence, where the benchmark has several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// The swept parameter: bytes, threads, live allocations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<u64>,
    /// What `value` is: `ns` (per iteration, criterion's typical time), `peak_reserved_bytes`,
    /// `peak_live_bytes`, `release_share`...
    pub metric: String,
    /// The number.
    pub value: f64,
    /// Who measured it: `rust` or `python`.
    pub source: String,
}

impl Record {
    /// A record measured by the Rust benchmarks.
    pub fn rust(bench: &str, allocator: &str, metric: &str, value: f64) -> Self {
        Self {
            bench: bench.to_owned(),
            allocator: allocator.to_owned(),
            workload: None,
            param: None,
            metric: metric.to_owned(),
            value,
            source: "rust".to_owned(),
        }
    }

    /// With a workload.
    pub fn workload(mut self, workload: &str) -> Self {
        self.workload = Some(workload.to_owned());
        self
    }

    /// With a parameter.
    pub fn param(mut self, param: u64) -> Self {
        self.param = Some(param);
        self
    }
}

/// An allocator that could not be measured, and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skip {
    /// The allocator or peer.
    pub allocator: String,
    /// Why it was skipped.
    pub reason: String,
    /// Who skipped it: `rust` or `python`.
    pub source: String,
}

/// One line of a records file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "line", rename_all = "snake_case")]
pub enum Line {
    /// The device the lines after it were measured on.
    Device(DeviceInfo),
    /// A measured number.
    Record(Record),
    /// An allocator left out.
    Skipped(Skip),
}

/// Appends `line` to the file `STEPPOOL_BENCH_RECORDS` names, if it names one, and says it on
/// stderr.
///
/// # Panics
///
/// When the file cannot be written: a run whose records are lost should not look successful.
pub fn emit(line: &Line) {
    match line {
        Line::Record(r) => eprintln!(
            "record: {}/{}{}{} {} = {}",
            r.bench,
            r.allocator,
            r.workload.as_deref().map(|w| format!("/{w}")).unwrap_or_default(),
            r.param.map(|p| format!("/{p}")).unwrap_or_default(),
            r.metric,
            r.value
        ),
        Line::Skipped(s) => eprintln!("skipped: {} ({})", s.allocator, s.reason),
        Line::Device(_) => {}
    }
    let Some(path) = std::env::var_os(RECORDS_VARIABLE) else { return };
    let text = serde_json::to_string(line).expect("records serialize");
    let written = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| file.write_all(format!("{text}\n").as_bytes()));
    if let Err(error) = written {
        panic!("{}: {error}", PathBuf::from(path).display());
    }
}

/// Reads a records file; blank lines are skipped.
pub fn read_lines(path: &Path) -> Result<Vec<Line>> {
    let text =
        std::fs::read_to_string(path).map_err(|source| BenchError::Io { path: path.display().to_string(), source })?;
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            serde_json::from_str(line).map_err(|source| BenchError::Json { path: path.display().to_string(), source })
        })
        .collect()
}

#[derive(Deserialize)]
struct CriterionId {
    group_id: String,
    function_id: Option<String>,
    value_str: Option<String>,
}

#[derive(Deserialize)]
struct CriterionEstimate {
    point_estimate: f64,
}

#[derive(Deserialize)]
struct CriterionEstimates {
    mean: CriterionEstimate,
    slope: Option<CriterionEstimate>,
}

/// The times criterion measured, from `<dir>/**/new/{benchmark,estimates}.json`: one record per
/// benchmark, with the group as `bench`, the function as `allocator`, a numeric value as
/// `param` and any other value as `workload`; `value` is criterion's typical time per iteration
/// in ns (the slope of its linear sampling, else the mean).
pub fn criterion_records(dir: &Path) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let entries = match std::fs::read_dir(&folder) {
            Ok(entries) => entries,
            Err(source) if folder == dir => {
                return Err(BenchError::Io { path: folder.display().to_string(), source });
            }
            Err(_) => continue,
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            if path.file_name().is_some_and(|name| name == "new") && path.join("estimates.json").is_file() {
                records.push(criterion_record(&path)?);
            } else {
                pending.push(path);
            }
        }
    }
    records.sort_by(|a, b| {
        (&a.bench, &a.allocator, &a.workload, a.param).cmp(&(&b.bench, &b.allocator, &b.workload, b.param))
    });
    Ok(records)
}

fn criterion_record(new: &Path) -> Result<Record> {
    let read = |name: &str| -> Result<String> {
        let path = new.join(name);
        std::fs::read_to_string(&path).map_err(|source| BenchError::Io { path: path.display().to_string(), source })
    };
    let json_error = |name: &str, source| BenchError::Json { path: new.join(name).display().to_string(), source };
    let id: CriterionId =
        serde_json::from_str(&read("benchmark.json")?).map_err(|e| json_error("benchmark.json", e))?;
    let estimates: CriterionEstimates =
        serde_json::from_str(&read("estimates.json")?).map_err(|e| json_error("estimates.json", e))?;
    let mut record = Record::rust(
        &id.group_id,
        id.function_id.as_deref().unwrap_or("default"),
        "ns",
        estimates.slope.unwrap_or(estimates.mean).point_estimate,
    );
    if let Some(value) = id.value_str {
        match value.parse::<u64>() {
            Ok(param) => record.param = Some(param),
            Err(_) => record.workload = Some(value),
        }
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_through_json() {
        let lines = vec![
            Line::Record(Record::rust("latency", "driver_pool", "ns", 1234.5).param(256)),
            Line::Record(Record::rust("fragmentation", "steppool_pool", "peak_reserved_bytes", 2e9).workload("t5")),
            Line::Skipped(Skip { allocator: "rmm_pool".into(), reason: "no rmm".into(), source: "python".into() }),
        ];
        for line in &lines {
            let text = serde_json::to_string(line).unwrap();
            assert_eq!(&serde_json::from_str::<Line>(&text).unwrap(), line);
        }
        let text = serde_json::to_string(&lines[0]).unwrap();
        assert!(text.starts_with(r#"{"line":"record","bench":"latency""#), "{text}");
        assert!(!text.contains("workload"), "absent fields are left out: {text}");
    }

    #[test]
    fn a_python_line_parses() {
        let text = r#"{"line":"record","bench":"latency","allocator":"torch_native","param":4096,"metric":"ns","value":2150.0,"source":"python"}"#;
        let Line::Record(record) = serde_json::from_str(text).unwrap() else { panic!("a record") };
        assert_eq!((record.param, record.source.as_str()), (Some(4096), "python"));
    }

    #[test]
    fn device_slugs_fit_file_names() {
        let host = HostInfo { cpu: "x".into(), threads: 1, os: "linux".into() };
        let mut device = DeviceInfo {
            name: "NVIDIA H100 80GB HBM3".into(),
            kind: "gpu".into(),
            driver: String::new(),
            driver_version: String::new(),
            total_memory: 0,
            host,
        };
        assert_eq!(device.slug(), "nvidia-h100-80gb-hbm3");
        device.kind = "simulated".into();
        assert_eq!(device.slug(), "sim");
    }

    #[test]
    fn criterion_estimates_become_records() {
        let dir = std::env::temp_dir().join(format!("steppool-criterion-{}", std::process::id()));
        let new = dir.join("latency/driver_pool/256/new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(
            new.join("benchmark.json"),
            r#"{"group_id":"latency","function_id":"driver_pool","value_str":"256","throughput":null,"full_id":"latency/driver_pool/256","directory_name":"latency/driver_pool/256","title":"latency/driver_pool/256"}"#,
        )
        .unwrap();
        std::fs::write(
            new.join("estimates.json"),
            r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1},"median_abs_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1},"slope":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":1.5,"standard_error":0.1},"std_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.0,"standard_error":0.1}}"#,
        )
        .unwrap();
        let records = criterion_records(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(records, vec![Record::rust("latency", "driver_pool", "ns", 1.5).param(256)]);
    }
}
