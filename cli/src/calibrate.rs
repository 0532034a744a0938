//! Calibrating the simulated device against a GPU: each trace replayed under each of steppool's
//! strategies on the GPU and on simulated devices of the GPU's memory, side by side.
//!
//! `steppool replay` runs on the simulated device, whose placement (pools that reserve whole
//! granules, ranges that grow in place by whole pages) is steppool's documented model of the
//! driver, not the driver. `steppool calibrate TRACE...` runs the same replay ([`replay::run`])
//! twice per strategy: on the driver it is given, the reservation read with `cuMemGetInfo` less
//! what the device held before the run ([`ReplayOptions::driver`]), and on a simulated device of
//! the same memory. The ratio of the two peaks is how far the model is from that driver, per
//! trace and strategy. A replay launches no work, so no device memory is ever written: the GPU
//! needs only each trace's peak reservation free, and nothing else running on it while it runs
//! (other processes' memory would count as the run's).

use std::fmt::Write;

use serde_json::{Value, json};
use steppool::sys::Driver;
use steppool_sys::bytes::Bytes;
use steppool_trace::Trace;
use steppool_trace::analysis::Analysis;

use crate::error::{ReplayError, Result};
use crate::replay::{self, Allocator, Observer, ReplayOptions, Run, STRATEGIES};

/// One trace under one strategy, on both devices.
#[derive(Clone, Debug)]
pub struct Row {
    /// The trace's name.
    pub trace: String,
    /// The strategy.
    pub strategy: &'static str,
    /// The run on the simulated device.
    pub simulated: Run,
    /// The run on the driver.
    pub real: Run,
}

impl Row {
    /// Peak reserved on the driver over peak reserved on the simulated device, when both runs
    /// completed and the simulated one reserved anything.
    pub fn ratio(&self) -> Option<f64> {
        let (simulated, real) = (&self.simulated, &self.real);
        (simulated.completed() && real.completed() && simulated.peak_reserved_bytes > 0)
            .then(|| real.peak_reserved_bytes as f64 / simulated.peak_reserved_bytes as f64)
    }
}

/// The driver the traces ran on, and every trace's rows.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// Device 0's name, as the driver gives it.
    pub device: String,
    /// The driver's CUDA version.
    pub driver_version: String,
    /// Device 0's memory, the capacity of the simulated devices.
    pub capacity: u64,
    /// The unit in which the simulated devices' pools grow
    /// ([`ReplayOptions::pool_unit`]); `None` for the segment model.
    pub pool_unit: Option<u64>,
    /// One row per trace and strategy, in trace order, then strategy order.
    pub rows: Vec<Row>,
}

/// Replays each `(name, trace, analysis)` under every steppool strategy on `driver` and on
/// simulated devices of its device 0's memory whose pools grow in `pool_unit`
/// ([`ReplayOptions::pool_unit`]: the default model's 32 MiB, or `None` for the segment model).
pub fn calibrate(
    traces: &[(String, &Trace, &Analysis)],
    driver: &Driver,
    pool_unit: Option<u64>,
    observer: &dyn Observer,
) -> Result<Calibration> {
    let driver_error = |what: &str, error: steppool_sys::DriverError| ReplayError::Invalid(format!("{what}: {error}"));
    let device = driver.device(0).map_err(|e| driver_error("device 0", e))?;
    let capacity = driver.device_total_memory(device).map_err(|e| driver_error("device 0's memory", e))?;
    let name = driver.device_name(device).map_err(|e| driver_error("device 0's name", e))?;
    let version = driver.driver_version().map_err(|e| driver_error("the driver's version", e))?;
    let simulated = ReplayOptions { pool_unit, ..ReplayOptions::new(capacity) };
    let mut real = ReplayOptions::new(capacity);
    real.driver = Some(driver.clone());
    let mut rows = Vec::new();
    for &(ref trace_name, trace, analysis) in traces {
        for def in STRATEGIES {
            let allocator = Allocator::Steppool(def);
            rows.push(Row {
                trace: trace_name.clone(),
                strategy: def.name,
                simulated: replay::run(trace, analysis, allocator, capacity, &simulated, observer)?,
                real: replay::run(trace, analysis, allocator, capacity, &real, observer)?,
            });
        }
    }
    Ok(Calibration { device: name, driver_version: version.to_string(), capacity, pool_unit, rows })
}

impl Calibration {
    /// The rows as a Markdown table, with the device and driver above it.
    pub fn markdown(&self) -> String {
        let pools = crate::report::pool_model(self.pool_unit);
        let mut text = format!(
            "Device 0: {}, {} ({} driver). Peak reserved of each replay, whole run; the simulated device \
             has the same memory, {pools}.\n\n",
            self.device,
            Bytes(self.capacity),
            self.driver_version
        );
        text += "| trace | strategy | simulated | driver | driver ÷ simulated | steady, driver ÷ simulated |\n";
        text += "| --- | --- | --- | --- | --- | --- |\n";
        for row in &self.rows {
            let peak = |run: &Run| match &run.failure {
                None => Bytes(run.peak_reserved_bytes).to_string(),
                Some(failure) => format!("failed at {}", failure.location),
            };
            let steady = match (row.simulated.steady_peak_reserved_bytes, row.real.steady_peak_reserved_bytes) {
                (Some(simulated), Some(real)) if simulated > 0 => format!("{:.3}", real as f64 / simulated as f64),
                _ => "–".to_owned(),
            };
            let ratio = row.ratio().map_or_else(|| "–".to_owned(), |ratio| format!("{ratio:.3}"));
            let _ = writeln!(
                text,
                "| {} | {} | {} | {} | {} | {} |",
                row.trace,
                row.strategy,
                peak(&row.simulated),
                peak(&row.real),
                ratio,
                steady
            );
        }
        text
    }

    /// The rows as JSON: bytes per run, `null` where a run did not complete.
    pub fn json(&self) -> Value {
        let run = |run: &Run| {
            json!({
                "completed": run.completed(),
                "peak_reserved_bytes": run.peak_reserved_bytes,
                "steady_peak_reserved_bytes": run.steady_peak_reserved_bytes,
                "failure": run.failure.as_ref().map(|f| f.message.clone()),
            })
        };
        json!({
            "device": self.device,
            "driver_version": self.driver_version,
            "capacity_bytes": self.capacity,
            "simulated_pool_unit_bytes": self.pool_unit,
            "rows": self.rows.iter().map(|row| json!({
                "trace": row.trace,
                "strategy": row.strategy,
                "simulated": run(&row.simulated),
                "driver": run(&row.real),
                "ratio": row.ratio(),
            })).collect::<Vec<_>>(),
        })
    }
}
