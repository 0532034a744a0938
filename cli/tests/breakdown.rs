//! The overhead breakdown on traces built so that each part is known by construction: rounding,
//! granule tails, holes, segregation and the peak shift, through the real runtime on the
//! simulated device and through the PyTorch models; and the steady peak.

use steppool_cli::breakdown::Breakdown;
use steppool_cli::replay::{ReplayOptions, Silent, StrategyResult, replay, select};
use steppool_trace::analysis::analyse;
use steppool_trace::{Event, EventKind, Location, StepSource, Trace, TraceFormat};

const MIB: u64 = 1 << 20;

/// A trace from a script: `[` and `]` begin and end a step, `+p:n` allocates `n` bytes at
/// pointer `p` (`n` may end in `M` for MiB), `-p` frees it.
fn trace(script: &str) -> Trace {
    let mut trace = Trace::new("hand-made", TraceFormat::Steppool);
    let (mut step, mut sizes) = (0, std::collections::HashMap::new());
    for (t, word) in script.split_whitespace().enumerate() {
        let at = Event::new(t as u64, EventKind::Alloc, Location::Line(t as u64 + 1));
        let event = match word.as_bytes()[0] {
            b'[' => Event { kind: EventKind::StepBegin(step), ..at },
            b']' => {
                step += 1;
                Event { kind: EventKind::StepEnd(step - 1), ..at }
            }
            b'+' => {
                let (ptr, size) = word[1..].split_once(':').unwrap();
                let bytes = match size.strip_suffix('M') {
                    Some(mib) => mib.parse::<u64>().unwrap() * MIB,
                    None => size.parse().unwrap(),
                };
                sizes.insert(ptr.parse::<u64>().unwrap(), bytes);
                Event { ptr: ptr.parse().unwrap(), bytes, ..at }
            }
            _ => {
                let ptr: u64 = word[1..].parse().unwrap();
                Event { ptr, bytes: sizes[&ptr], kind: EventKind::Free { released: false }, ..at }
            }
        };
        trace.events.push(event);
    }
    trace.steps = StepSource::Trace;
    trace
}

/// `strategy` replayed on `script` in the simulated device's segment model, whose 2 MiB
/// granules keep the worked examples small.
fn run(script: &str, strategy: &str) -> StrategyResult {
    run_with(script, strategy, None)
}

/// `strategy` replayed on `script`, pools growing in `pool_unit` ([`ReplayOptions::pool_unit`]).
fn run_with(script: &str, strategy: &str, pool_unit: Option<u64>) -> StrategyResult {
    let trace = trace(script);
    let analysis = analyse(&trace).unwrap();
    let mut options = ReplayOptions::new(1 << 30);
    options.bisect = false;
    options.pool_unit = pool_unit;
    let mut results = replay(&trace, &analysis, &select(strategy).unwrap(), &options, &Silent).unwrap();
    let result = results.remove(0);
    assert!(result.run.completed(), "{strategy}: {:?}", result.run.failure);
    let breakdown = result.breakdown.unwrap();
    assert_eq!(breakdown.total(), result.run.peak_reserved_bytes as i64 - analysis.peak_live_bytes as i64);
    result
}

#[test]
fn rounding_and_tails() {
    // Three allocations of 1 MiB + 100 B: each rounded up by 412 bytes, and each too large for the
    // free end of the previous segment, so each takes a 2 MiB segment whose end is a tail.
    let result = run("+1:1048676 +2:1048676 +3:1048676", "default-pool");
    assert_eq!(result.run.peak_reserved_bytes, 6 * MIB);
    let tail = 2 * MIB - (MIB + 512);
    assert_eq!(
        result.breakdown.unwrap(),
        Breakdown { rounding_bytes: 3 * 412, granule_tail_bytes: 3 * tail, ..Breakdown::default() }
    );
}

#[test]
fn holes_in_the_growing_pool() {
    // Three 2 MiB segments; the middle one is freed and kept; 4 MiB then needs a new segment
    // (pieces never span segments): the freed 2 MiB is a hole of the pool that grew.
    let result = run("+1:2M +2:2M +3:2M -2 +4:4M", "default-pool");
    assert_eq!(result.run.peak_reserved_bytes, 10 * MIB);
    assert_eq!(result.breakdown.unwrap(), Breakdown { hole_bytes: 2 * MIB, ..Breakdown::default() });
}

#[test]
fn a_reserved_peak_after_the_live_peak_is_a_peak_shift() {
    // 6 MiB live at first; then the first and last 2 MiB are freed and 3 MiB takes a 4 MiB
    // segment: 10 MiB reserved while 5 MiB are live.
    let result = run("+1:2M +2:2M +3:2M -1 -3 +4:3M", "default-pool");
    assert_eq!(result.run.peak_reserved_bytes, 10 * MIB);
    assert_eq!(
        result.breakdown.unwrap(),
        Breakdown {
            granule_tail_bytes: MIB,
            hole_bytes: 4 * MIB,
            peak_shift_bytes: -(MIB as i64),
            ..Breakdown::default()
        }
    );
}

#[test]
fn memory_idle_in_another_pool_is_segregation() {
    // 4 MiB made and freed before the step is persistent; the step's 4 MiB is step-scoped. With
    // a pool per phase the persistent pool keeps its 4 MiB idle while the step's pool grows; one
    // pool reuses it.
    let script = "+1:4M -1 [ +2:4M -2 ]";
    let phases = run(script, "phase-pools");
    assert_eq!(phases.run.peak_reserved_bytes, 8 * MIB);
    assert_eq!(phases.breakdown.unwrap(), Breakdown { segregation_bytes: 4 * MIB, ..Breakdown::default() });
    let one = run(script, "default-pool");
    assert_eq!(one.run.peak_reserved_bytes, 4 * MIB);
    assert_eq!(one.breakdown.unwrap(), Breakdown::default());
}

#[test]
fn pools_of_32_mib_units_leave_a_tail_and_span_their_boundaries() {
    // The simulated device's default, as an H200's driver answered: 20 and 20 MiB fill the
    // first unit and part of the second; the first is freed, too small a hole for 30 MiB, which
    // lands after the second, across the boundary into a third unit: at the peak, 50 MiB live,
    // the 20 MiB hole, and 26 MiB of the third unit unused.
    let unit = ReplayOptions::new(1 << 30).pool_unit;
    assert_eq!(unit, Some(32 * MIB));
    let result = run_with("+1:20M +2:20M -1 +3:30M", "default-pool", unit);
    assert_eq!(result.run.peak_reserved_bytes, 96 * MIB);
    assert_eq!(
        result.breakdown.unwrap(),
        Breakdown { granule_tail_bytes: 26 * MIB, hole_bytes: 20 * MIB, ..Breakdown::default() }
    );
    // In the segment model the same trace reserves a segment per growth: 20 + 20 + 30 MiB.
    assert_eq!(run("+1:20M +2:20M -1 +3:30M", "default-pool").run.peak_reserved_bytes, 70 * MIB);
}

#[test]
fn the_torch_models_split_their_overhead_the_same_way() {
    // A small allocation takes a 2 MiB small-pool segment and is freed; 3 MiB takes a 20 MiB
    // large-pool segment: 1 MiB of its second granule is a tail, the 16 MiB after it a hole of
    // the growing pool, and the small pool's idle 2 MiB is segregation.
    let result = run("+1:4096 -1 +2:3M", "torch-caching");
    assert_eq!(result.run.peak_reserved_bytes, 22 * MIB);
    assert_eq!(
        result.breakdown.unwrap(),
        Breakdown { granule_tail_bytes: MIB, hole_bytes: 16 * MIB, segregation_bytes: 2 * MIB, ..Breakdown::default() }
    );
    // Expandable segments map 20 MiB pages: the tail is the rest of the page.
    let result = run("+1:4096 -1 +2:3M", "torch-expandable");
    assert_eq!(result.run.peak_reserved_bytes, 22 * MIB);
    assert_eq!(
        result.breakdown.unwrap(),
        Breakdown { granule_tail_bytes: 17 * MIB, segregation_bytes: 2 * MIB, ..Breakdown::default() }
    );
}

#[test]
fn the_steady_peak_starts_with_the_second_step() {
    // The first step needs 8 MiB, later ones 2 and 3 MiB. The plain pool keeps the 8 MiB it
    // reserved, which the second step starts with: steady overhead 8 / 3.
    let result = run("+1:1M [ +2:8M -2 ] [ +3:2M -3 ] [ +4:3M -4 ] -1", "default-pool");
    assert_eq!(result.run.peak_reserved_bytes, 10 * MIB);
    assert_eq!(result.run.steady_peak_reserved_bytes, Some(10 * MIB));
    assert_eq!(result.run.steady_peak_live_bytes, Some(4 * MIB));
    assert_eq!(result.steady_overhead(), Some(2.5));
    // Step by step: the first step sets the peak of live bytes, and its reservation stays.
    let steps: Vec<(u64, u64)> =
        result.run.step_peaks.iter().map(|s| (s.peak_reserved_bytes / MIB, s.peak_live_bytes / MIB)).collect();
    assert_eq!(steps, [(10, 9), (10, 3), (10, 4)]);
    // The table names the step that first reached the peak: the first.
    let hand_made = trace("+1:1M [ +2:8M -2 ] [ +3:2M -3 ] [ +4:3M -4 ] -1");
    let analysis = analyse(&hand_made).unwrap();
    let limit = steppool_cli::limit::limit(&analysis).unwrap();
    let inspection = steppool_cli::report::inspect(&hand_made, &analysis);
    let table = steppool_cli::report::replay_table(&inspection, 1 << 30, None, std::slice::from_ref(&result), &limit);
    let header = table.lines().find(|l| l.contains("peak step")).unwrap();
    let row = table.lines().find(|l| l.contains("default-pool") && l.contains("completed")).unwrap();
    // Columns are aligned in characters (`×` is two bytes).
    let at = header[..header.find("peak step").unwrap()].chars().count() + "peak step".len();
    let cell: String = row.chars().take(at).collect();
    assert_eq!(cell.split_whitespace().last(), Some("0"), "{table}");
    // A peak reached before the first step is the setup's.
    let script = "+1:8M -1 [ +2:1M -2 ]";
    let (hand_made, result) = (trace(script), run(script, "default-pool"));
    let analysis = analyse(&hand_made).unwrap();
    let limit = steppool_cli::limit::limit(&analysis).unwrap();
    let inspection = steppool_cli::report::inspect(&hand_made, &analysis);
    let table = steppool_cli::report::replay_table(&inspection, 1 << 30, None, &[result], &limit);
    let row = table.lines().find(|l| l.contains("default-pool") && l.contains("completed")).unwrap();
    let cell: String = row.chars().take(at).collect();
    assert_eq!(cell.split_whitespace().last(), Some("setup"), "{table}");
    // One step is not a steady state.
    let single = run("[ +1:2M -1 ]", "default-pool");
    assert_eq!((single.run.steady_peak_reserved_bytes, single.steady_overhead()), (None, None));
}
