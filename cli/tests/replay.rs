//! Replay numbers on traces small enough to work out by hand: reservations in whole granules,
//! the smallest device, and an allocation larger than the device.

use std::path::Path;

use steppool_cli::breakdown::Breakdown;
use steppool_cli::limit::limit;
use steppool_cli::replay::{ReplayOptions, Silent, recommended, replay, select};
use steppool_cli::report::{inspect, replay_json};
use steppool_trace::analysis::analyse;
use steppool_trace::read::read_bytes;

const MIB: u64 = 1 << 20;

fn log(rows: &[(&str, u64, u64)]) -> steppool_trace::Trace {
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for (t, &(action, ptr, bytes)) in rows.iter().enumerate() {
        text += &format!("1,{t},{action},{ptr:#x},{bytes},0x0\n");
    }
    read_bytes(Path::new("small.csv"), text.as_bytes()).unwrap()
}

#[test]
fn reservations_are_whole_granules_and_the_smallest_device_is_exact() {
    // In the segment model: 3 MiB, then 1 MiB placed in the 4 MiB segment's free tail, then
    // 2 MiB, which does not fit the tail and takes a 2 MiB segment of its own: 6 MiB reserved
    // at the peak ...
    let trace = log(&[
        ("allocate", 0x1000_0000, 3 * MIB),
        ("allocate", 0x2000_0000, MIB),
        ("free", 0x2000_0000, MIB),
        ("allocate", 0x3000_0000, 2 * MIB),
        ("free", 0x1000_0000, 3 * MIB),
        ("free", 0x3000_0000, 2 * MIB),
    ]);
    let analysis = analyse(&trace).unwrap();
    assert_eq!(analysis.peak_live_bytes, 5 * MIB);
    let segments = ReplayOptions { pool_unit: None, ..ReplayOptions::new(1 << 30) };
    let results = replay(&trace, &analysis, &select("default-pool").unwrap(), &segments, &Silent).unwrap();
    let result = &results[0];
    assert!(result.run.completed());
    // ... of which 5 MiB are live.
    assert_eq!(result.run.peak_reserved_bytes, 6 * MIB);
    assert!((result.overhead() - 1.2).abs() < 1e-12);
    assert!((result.fragmentation_ratio() - 1.0 / 6.0).abs() < 1e-12);
    // 6 MiB is needed: 4 MiB is below the live bytes, and no device reserves half a granule.
    assert_eq!(result.min_capacity_bytes, Some(6 * MIB));
    // The overhead is the free end of the first segment's second granule, beside the 3 MiB.
    let breakdown = result.breakdown.unwrap();
    assert_eq!(breakdown, Breakdown { granule_tail_bytes: MIB, ..Breakdown::default() });
    assert_eq!(result.run.steady_peak_reserved_bytes, None, "no steps, no steady peak");
    // As the driver reserves (the default model): one 32 MiB unit, on a device that keeps a
    // 2 MiB granule free beside it. The
    // freed 1 MiB, still pending in stream order, stays a piece of its own, so the 2 MiB goes
    // after it: a 1 MiB hole, and the unit's last 26 MiB unused.
    let results =
        replay(&trace, &analysis, &select("default-pool").unwrap(), &ReplayOptions::new(1 << 30), &Silent).unwrap();
    assert_eq!(results[0].run.peak_reserved_bytes, 32 * MIB);
    assert_eq!(results[0].min_capacity_bytes, Some(34 * MIB));
    assert_eq!(
        results[0].breakdown.unwrap(),
        Breakdown { granule_tail_bytes: 26 * MIB, hole_bytes: MIB, ..Breakdown::default() }
    );
}

#[test]
fn an_allocation_larger_than_the_device_is_an_oom_result() {
    let trace = log(&[("allocate", 0x1000, 3 * MIB), ("free", 0x1000, 3 * MIB), ("allocate", 0x2000, 64 * MIB)]);
    let analysis = analyse(&trace).unwrap();
    let options = ReplayOptions::new(48 * MIB);
    let results = replay(&trace, &analysis, &select("all").unwrap(), &options, &Silent).unwrap();
    for result in &results {
        let failure = result.run.failure.as_ref().expect("64 MiB does not fit 48 MiB");
        assert_eq!((failure.event, failure.requested), (2, 64 * MIB));
        assert_eq!(failure.location.to_string(), "line 4");
        // PyTorch's expandable segments map 20 MiB pages: 64 MiB takes 80 MiB. A CUDA pool maps
        // its 32 MiB units only while a 2 MiB granule stays free beside them, as the driver does.
        let need = match result.run.strategy {
            "torch-expandable" => 80 * MIB,
            "default-pool" | "phase-pools" | "arena" => 66 * MIB,
            _ => 64 * MIB,
        };
        assert_eq!(result.min_capacity_bytes, Some(need), "{}", result.run.strategy);
    }
    let limit = limit(&analysis).unwrap();
    let json =
        serde_json::to_value(replay_json(&inspect(&trace, &analysis), options.capacity, &results, &limit)).unwrap();
    assert_eq!(json["results"][0]["completed"], false);
    assert_eq!(json["results"][0]["failure"]["location"], "line 4");
    assert_eq!(json["results"][0]["min_capacity_bytes"], 66 * MIB);
    // Nothing completed: nothing is recommended, and no breakdown is given.
    assert_eq!(json["recommended"], serde_json::Value::Null);
    assert_eq!(json["results"][0]["breakdown"], serde_json::Value::Null);
    assert_eq!(json["limit_bytes"], 64 * MIB);
}

#[test]
fn a_pytorch_model_is_compared_but_never_recommended() {
    // 4 KiB allocations: the caching model packs them into one 2 MiB small-pool segment, as the
    // plain pool does; only the model ran, so nothing is recommended.
    let trace = log(&[("allocate", 0x1000, 4096), ("allocate", 0x2000, 4096), ("free", 0x1000, 4096)]);
    let analysis = analyse(&trace).unwrap();
    let options = ReplayOptions::new(1 << 30);
    let results = replay(&trace, &analysis, &select("torch-caching").unwrap(), &options, &Silent).unwrap();
    assert_eq!(results[0].run.peak_reserved_bytes, 2 * MIB);
    assert_eq!(recommended(&results), None);
    let limit = limit(&analysis).unwrap();
    let json =
        serde_json::to_value(replay_json(&inspect(&trace, &analysis), options.capacity, &results, &limit)).unwrap();
    assert_eq!(json["results"][0]["kind"], "torch-model");
    assert_eq!(json["recommended"], serde_json::Value::Null);
    assert_eq!(json["limit_bytes"], 8192);
    // With the strategies beside it, the least steppool peak is recommended: the plan's 2 MiB
    // page, not the plain pool's 32 MiB unit.
    let results = replay(&trace, &analysis, &select("all").unwrap(), &options, &Silent).unwrap();
    assert_eq!(results[0].run.peak_reserved_bytes, 32 * MIB);
    assert_eq!(recommended(&results), Some("planned"));
}

/// Under memory pressure the recommended strategy gives back what its live allocations do not
/// need and retries, as PyTorch's allocator releases its cache and retries: on generated traces
/// whose plans reach their peak at other moments than the live bytes do (a curriculum with
/// accumulation, routed experts), it completes on a device no larger than the one plain pool
/// and the PyTorch models need.
#[test]
fn the_planned_smallest_device_is_no_larger_than_the_pool_and_the_torch_models() {
    use steppool_cli::patterns::{Pattern, PatternOptions, generate};
    for pattern in [Pattern::CurriculumAccum, Pattern::MoeRouting] {
        let options = PatternOptions { steps: 6, seed: 1, scale: 0.1, ..PatternOptions::default() };
        let trace = generate(pattern, &options).unwrap();
        let analysis = analyse(&trace).unwrap();
        let mut allocators = select("planned").unwrap();
        for name in ["default-pool", "torch-caching", "torch-expandable"] {
            allocators.extend(select(name).unwrap());
        }
        let results = replay(&trace, &analysis, &allocators, &ReplayOptions::new(80 << 30), &Silent).unwrap();
        let smallest = |result: &steppool_cli::replay::StrategyResult| result.min_capacity_bytes.unwrap();
        let planned = smallest(&results[0]);
        for other in &results[1..] {
            assert!(
                planned <= smallest(other),
                "{pattern:?}: planned needs {} MiB, {} {} MiB",
                planned >> 20,
                other.run.strategy,
                smallest(other) >> 20
            );
        }
    }
}

/// The planned strategy's plan counters, summed over the run's steps, say how often its plans
/// served and how often a scope left its plan; the other strategies have none.
#[test]
fn the_planned_strategy_counts_what_its_plans_served_and_its_deviations() {
    use steppool_cli::patterns::{Pattern, PatternOptions, generate};
    let run = |pattern: Pattern| {
        let options = PatternOptions { steps: 6, seed: 1, scale: 0.01, micro_steps: false };
        let trace = generate(pattern, &options).unwrap();
        let analysis = analyse(&trace).unwrap();
        let mut allocators = select("planned").unwrap();
        allocators.extend(select("torch-expandable").unwrap());
        let options = ReplayOptions { bisect: false, ..ReplayOptions::new(80 << 30) };
        let results = replay(&trace, &analysis, &allocators, &options, &Silent).unwrap();
        let limit = limit(&analysis).unwrap();
        let json = serde_json::to_value(replay_json(&inspect(&trace, &analysis), 80 << 30, &results, &limit)).unwrap();
        assert_eq!(json["results"][1]["plans"], serde_json::Value::Null, "a PyTorch model has no plans");
        assert_eq!(results[1].run.plans, None);
        let plans = results[0].run.plans.expect("the planned strategy's counters");
        let shown = &json["results"][0]["plans"];
        assert_eq!(shown["deviations"], plans.deviations);
        assert_eq!(shown["planned_allocations"], plans.planned);
        assert_eq!(shown["deviated_scopes"], plans.deviated_scopes);
        plans
    };
    // Static shapes: the first step is recorded, the five after it are served from its plan.
    let plans = run(Pattern::BertStatic);
    assert_eq!((plans.deviations, plans.deviated_scopes, plans.planned_scopes), (0, 0, 5));
    assert_eq!(plans.planned, 5 * plans.unplanned, "each step has the recorded step's allocations");
    // Routed experts: the token counts change every step, and steps leave their plan.
    let plans = run(Pattern::MoeRouting);
    assert_eq!(plans.planned_scopes, 5);
    assert!(plans.deviated_scopes > 0 && plans.deviations >= plans.deviated_scopes, "{plans:?}");
}
