//! Replays on a driver, as `steppool calibrate` makes them on a GPU, measured from the driver
//! alone: on a simulated driver they must find what the simulated replay finds, whatever the
//! device held before the run.

use std::path::Path;

use steppool::sys::Driver;
use steppool::sys::sim::SimConfig;
use steppool::{PhaseSpec, Runtime, Scope};
use steppool_cli::calibrate::calibrate;
use steppool_cli::replay::{ReplayOptions, Silent, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::read::read_trace;

const GIB: u64 = 1 << 30;

fn vit() -> steppool_trace::Trace {
    read_trace(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/vit_static_train.csv"))).unwrap()
}

#[test]
fn a_replay_on_a_driver_measures_what_the_simulated_replay_does_despite_memory_held_before() {
    let trace = vit();
    let analysis = analyse(&trace).unwrap();
    let simulated = replay(&trace, &analysis, &select("all").unwrap(), &ReplayOptions::new(4 * GIB), &Silent).unwrap();

    // Another user of the device holds 96 MiB through the whole run: not the run's reservation.
    let driver = Driver::simulated(SimConfig::with_capacity(4 * GIB)).unwrap();
    let other = Runtime::builder().driver(driver.clone()).build().unwrap();
    let stream = other.device(0).unwrap().create_stream().unwrap();
    let held = other.declare_phase(PhaseSpec::new("held", Scope::Persistent)).unwrap();
    let _held = other.alloc(held, 96 << 20, &stream).unwrap();
    let (free, total) = other.device(0).unwrap().memory_info().unwrap();
    assert!(total - free >= 96 << 20, "the other user's memory is on the device");

    let mut options = ReplayOptions::new(4 * GIB);
    options.driver = Some(driver);
    let on_driver = replay(&trace, &analysis, &select("all").unwrap(), &options, &Silent).unwrap();
    assert_eq!(on_driver.len(), simulated.len());
    for (real, model) in on_driver.iter().zip(&simulated) {
        assert_eq!(real.run.strategy, model.run.strategy);
        assert!(real.run.completed(), "{} completed on the driver", real.run.strategy);
        assert_eq!(
            (real.run.peak_reserved_bytes, real.run.steady_peak_reserved_bytes),
            (model.run.peak_reserved_bytes, model.run.steady_peak_reserved_bytes),
            "{}: the same peaks",
            real.run.strategy
        );
        let torch = steppool_cli::replay::is_torch(real.run.strategy);
        // Only the simulated device can be read for a layout or resized for a bisection.
        assert_eq!(real.breakdown.is_some(), torch, "{}: breakdown", real.run.strategy);
        assert_eq!(real.min_capacity_bytes.is_some(), torch, "{}: smallest device", real.run.strategy);
    }
}

#[test]
fn calibration_on_a_simulated_driver_finds_the_model_exact() {
    let trace = vit();
    let analysis = analyse(&trace).unwrap();
    let driver = Driver::simulated(SimConfig::with_capacity(2 * GIB)).unwrap();
    let unit = SimConfig::default().pool_unit;
    let calibration = calibrate(&[("vit".to_owned(), &trace, &analysis)], &driver, unit, &Silent).unwrap();
    assert_eq!(calibration.capacity, 2 * GIB);
    let strategies: Vec<_> = calibration.rows.iter().map(|row| row.strategy).collect();
    assert_eq!(strategies, ["default-pool", "phase-pools", "arena", "planned"]);
    for row in &calibration.rows {
        assert_eq!(row.ratio(), Some(1.0), "{}: the driver is the model", row.strategy);
        assert!(row.real.peak_reserved_bytes >= analysis.peak_live_bytes);
    }
    let table = calibration.markdown();
    assert!(table.contains("| vit | planned |"), "{table}");
    assert!(table.contains("32 MiB pool units"), "{table}");
    let json = calibration.json();
    assert_eq!(json["rows"].as_array().unwrap().len(), 4);
    assert_eq!(json["rows"][3]["driver"]["peak_reserved_bytes"], json["rows"][3]["simulated"]["peak_reserved_bytes"]);
    assert_eq!(json["simulated_pool_unit_bytes"], 32 << 20);
    // The segment model against a driver of 32 MiB units: one pool is off, the planned strategy,
    // which maps its own pages, is not.
    let segments = calibrate(&[("vit".to_owned(), &trace, &analysis)], &driver, None, &Silent).unwrap();
    let ratio = |strategy: &str| segments.rows.iter().find(|row| row.strategy == strategy).unwrap().ratio().unwrap();
    assert!(ratio("default-pool") < 0.95, "{}", ratio("default-pool"));
    assert_eq!(ratio("planned"), 1.0);
    assert!(segments.markdown().contains("pools in segments"));
    assert_eq!(segments.json()["simulated_pool_unit_bytes"], serde_json::Value::Null);
}
