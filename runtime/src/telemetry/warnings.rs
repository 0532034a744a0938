//! Early warnings: rules evaluated at every step end that say an OOM is coming before it does.
//!
//! Each rule fires once per episode: when its condition becomes true, and not again until the
//! condition has been false at a step end. A firing goes to the callbacks registered with
//! [`Telemetry::on_warning`](crate::Telemetry::on_warning), to the log (`tracing`, target
//! `steppool::warnings`), into the [`StepReport`](crate::StepReport) and into the history.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::report::PoolStats;
use crate::telemetry::metrics::WarningCount;
pub use crate::warning::{Warning, WarningKind, WarningRule};

/// Fragmentation of a phase on a device above `threshold` for `steps` consecutive steps.
///
/// The ratio judged is the step's peak reservation against the largest peak of live bytes of the
/// last `window` steps, rounded up to the phase's reservation granule (a pool's 32 MiB unit on
/// the driver, or the 2 MiB pages of a range), `1 - max(peak_used) / peak_reserved`: memory a
/// pool keeps for the next long step of a variable-length workload is not waste while such steps
/// keep coming, but a reservation that outgrows every recent need is; and the unused end of the
/// last unit is the unit's price, not fragmentation. With steps of one shape this is the step's
/// own fragmentation ratio, less that tail.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FragmentationRule {
    /// The ratio above which a step counts (default 0.25: a quarter of the peak reservation
    /// never held live data; PyTorch's caching allocator runs at about 0.36 on large models).
    pub threshold: f64,
    /// Consecutive steps above it before the rule fires (default 3).
    pub steps: u32,
    /// Steps whose peak of live bytes the reservation is judged against (default 10).
    pub window: u32,
    /// A step counts only when the memory it wasted (`peak_reserved - peak_used`) is at least
    /// this share of the device (default 0.02): a few megabytes of rounding in a small phase are
    /// not an OOM risk.
    pub min_waste: f64,
}

/// Reserved memory of a phase on a device growing over `steps` steps while its peak of live
/// bytes stays flat: memory creep in the pool, or a leak of reservations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReservedCreepRule {
    /// Steps in the window (default 5): reserved at step end must never shrink across it.
    pub steps: u32,
    /// Growth over the window, as a share of the first reservation, that fires (default 0.05).
    pub min_growth: f64,
    /// ... and in bytes (default 64 MiB).
    pub min_growth_bytes: u64,
    /// How far the peak of live bytes may move and still count as flat (default 0.01).
    pub flat_tolerance: f64,
}

/// A device's headroom below the largest recent step demand: the next step like it will not fit.
///
/// A step's demand is how far live bytes rose above what outlives the step (the sum over pools of
/// `peak_used - used` at the step end), plus what outlived it that the step before did not hold
/// (a pool's growth of live bytes over the step, from its second step on: a loop that keeps a
/// tensor every step will want as much again). What the pools already reserve without live
/// data serves it first; the shortfall must come from the device's free memory, with a margin for the
/// fragmentation that new segments bring. The rule fires when free memory is below the shortfall
/// times `1 + margin`: a loop whose pools keep what it needs stays silent however full the
/// device is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LowHeadroomRule {
    /// Steps whose demand is remembered (default 10).
    pub window: u32,
    /// Fires when free memory < (demand - reserved unused) × (1 + margin) (default 0.1).
    pub margin: f64,
}

/// A pool's free space, where its layout is known, large enough in total for the largest request
/// it served in recent steps but in pieces smaller than it, with no room on the device for a new
/// segment of that size: the next such request can only fail or wait for a trim. This is the
/// failure the fragmentation ratio foretells, seen one step ahead. Pools whose layout steppool
/// does not know (a real device's `Pool` strategy) are not judged, rather than guessed at.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScatteredFreeRule {
    /// Steps whose largest request is remembered (default 10).
    pub window: u32,
}

/// Which rules run, with what thresholds. `None` turns a rule off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarningRules {
    /// See [`FragmentationRule`].
    pub fragmentation: Option<FragmentationRule>,
    /// See [`ScatteredFreeRule`].
    pub scattered_free: Option<ScatteredFreeRule>,
    /// See [`ReservedCreepRule`].
    pub reserved_creep: Option<ReservedCreepRule>,
    /// See [`LowHeadroomRule`].
    pub low_headroom: Option<LowHeadroomRule>,
}

impl Default for FragmentationRule {
    fn default() -> Self {
        Self { threshold: 0.25, steps: 3, window: 10, min_waste: 0.02 }
    }
}

impl Default for ScatteredFreeRule {
    fn default() -> Self {
        Self { window: 10 }
    }
}

impl Default for ReservedCreepRule {
    fn default() -> Self {
        Self { steps: 5, min_growth: 0.05, min_growth_bytes: 64 << 20, flat_tolerance: 0.01 }
    }
}

impl Default for LowHeadroomRule {
    fn default() -> Self {
        Self { window: 10, margin: 0.1 }
    }
}

impl Default for WarningRules {
    /// Every rule, with its defaults.
    fn default() -> Self {
        Self {
            fragmentation: Some(FragmentationRule::default()),
            scattered_free: Some(ScatteredFreeRule::default()),
            reserved_creep: Some(ReservedCreepRule::default()),
            low_headroom: Some(LowHeadroomRule::default()),
        }
    }
}

impl WarningRules {
    /// No rule at all.
    pub fn none() -> Self {
        Self { fragmentation: None, scattered_free: None, reserved_creep: None, low_headroom: None }
    }
}

/// Per (device, phase) numbers of one step.
#[derive(Clone, Copy, Debug, Default)]
struct PhaseStep {
    peak_used: u64,
    peak_reserved: u64,
    reserved: u64,
    /// The largest reservation granule of its pools.
    granule: u64,
}

/// The rules' memory between steps.
#[derive(Debug, Default)]
pub(crate) struct WarningState {
    /// Consecutive steps above the fragmentation threshold, per (device, phase).
    above: HashMap<(usize, String), u32>,
    /// Recent peaks of live bytes per (device, phase), for the fragmentation window.
    peaks: HashMap<(usize, String), VecDeque<u64>>,
    /// Recent steps per (device, phase), for creep.
    recent: HashMap<(usize, String), VecDeque<PhaseStep>>,
    /// Recent step demands per device.
    demands: HashMap<usize, VecDeque<u64>>,
    /// Live bytes per pool (device, stream, phase) at the last step's end.
    used_before: HashMap<(usize, u32, String), u64>,
    /// Recent largest requests per pool (device, stream, phase).
    requests: HashMap<(usize, u32, String), VecDeque<u64>>,
    /// Episodes in progress: (rule, device, phase).
    active: HashSet<(WarningRule, usize, String)>,
    /// Firings per rule.
    fired: HashMap<WarningRule, u64>,
}

impl WarningState {
    /// How often each rule has fired, in rule order.
    pub(crate) fn counts(&self) -> Vec<WarningCount> {
        let mut counts: Vec<WarningCount> =
            self.fired.iter().map(|(&rule, &fired)| WarningCount { rule, fired }).collect();
        counts.sort_unstable_by_key(|count| count.rule);
        counts
    }

    /// Evaluates `rules` on the pools' numbers at the end of `step`; `memory` gives each
    /// device's free and total memory. Returns the warnings that start an episode.
    pub(crate) fn evaluate(
        &mut self,
        rules: &WarningRules,
        step: u64,
        pools: &[PoolStats],
        memory: &dyn Fn(usize) -> Option<(u64, u64)>,
    ) -> Vec<Warning> {
        let mut phases: Vec<((usize, String), PhaseStep)> = Vec::new();
        let mut devices: Vec<(usize, u64, u64)> = Vec::new(); // (device, reserved unused, demand)
        for pool in pools {
            let key = (pool.pool.device, pool.phase_name.clone());
            let index = match phases.iter().position(|(k, _)| *k == key) {
                Some(index) => index,
                None => {
                    phases.push((key, PhaseStep::default()));
                    phases.len() - 1
                }
            };
            let entry = &mut phases[index].1;
            entry.peak_used += pool.peak_used;
            entry.peak_reserved += pool.peak_reserved;
            entry.reserved += pool.reserved;
            entry.granule = entry.granule.max(pool.granule);
            let index = match devices.iter().position(|d| d.0 == pool.pool.device) {
                Some(index) => index,
                None => {
                    devices.push((pool.pool.device, 0, 0));
                    devices.len() - 1
                }
            };
            devices[index].1 += pool.reserved.saturating_sub(pool.used);
            // What the step's live bytes rose above its end, and what the pool's live bytes grew
            // by over the step (nothing the first time the pool is seen: its first step builds
            // what the loop keeps).
            let before =
                self.used_before.insert((pool.pool.device, pool.pool.stream, pool.phase_name.clone()), pool.used);
            let grew = before.map_or(0, |before| pool.used.saturating_sub(before));
            devices[index].2 += pool.peak_used.saturating_sub(pool.used) + grew;
        }

        let mut fired = Vec::new();
        if let Some(rule) = &rules.scattered_free {
            for pool in pools {
                let recent =
                    self.requests.entry((pool.pool.device, pool.pool.stream, pool.phase_name.clone())).or_default();
                recent.push_back(pool.largest_request);
                while recent.len() > rule.window.max(1) as usize {
                    recent.pop_front();
                }
                let largest_request = recent.iter().copied().max().unwrap_or(0);
                let (Some(space), Some((device_free, _))) = (pool.free_space, memory(pool.pool.device)) else {
                    continue;
                };
                // Scattered, not merely full: enough bytes are free, in pieces too small.
                let condition = largest_request > 0
                    && space.total_free >= largest_request
                    && space.largest_free < largest_request
                    && device_free < largest_request;
                let kind = WarningKind::ScatteredFree {
                    phase: pool.phase_name.clone(),
                    stream: pool.pool.stream,
                    largest_request,
                    largest_free: space.largest_free,
                    total_free: space.total_free,
                    device_free,
                };
                let key = format!("{}@{}", pool.phase_name, pool.pool.stream);
                self.episode(condition, step, pool.pool.device, Some(&key), kind, &mut fired);
            }
        }
        for ((device, phase), now) in &phases {
            if let Some(rule) = &rules.fragmentation {
                let peaks = self.peaks.entry((*device, phase.clone())).or_default();
                peaks.push_back(now.peak_used);
                while peaks.len() > rule.window.max(1) as usize {
                    peaks.pop_front();
                }
                let needed = peaks.iter().copied().max().unwrap_or(0);
                // The last unit's unused end is what a unit costs, not fragmentation.
                let in_units = needed.next_multiple_of(now.granule.max(1)).min(now.peak_reserved.max(needed));
                let ratio = crate::report::fragmentation_ratio(in_units, now.peak_reserved);
                let total = memory(*device).map_or(0, |(_, total)| total);
                let waste = now.peak_reserved.saturating_sub(in_units);
                let count = self.above.entry((*device, phase.clone())).or_default();
                *count = if ratio > rule.threshold && waste as f64 >= rule.min_waste * total as f64 {
                    *count + 1
                } else {
                    0
                };
                let condition = *count >= rule.steps.max(1);
                let steps = *count;
                let kind = WarningKind::Fragmentation {
                    phase: phase.clone(),
                    ratio,
                    threshold: rule.threshold,
                    steps,
                    peak_used: needed,
                    peak_reserved: now.peak_reserved,
                };
                self.episode(condition, step, *device, Some(phase), kind, &mut fired);
            }
            if let Some(rule) = &rules.reserved_creep {
                let window = rule.steps.max(2) as usize;
                let recent = self.recent.entry((*device, phase.clone())).or_default();
                recent.push_back(*now);
                while recent.len() > window {
                    recent.pop_front();
                }
                let (first, last) = (recent[0], *now);
                let never_shrank = recent.iter().zip(recent.iter().skip(1)).all(|(a, b)| b.reserved >= a.reserved);
                let growth = last.reserved.saturating_sub(first.reserved);
                let grew = growth >= rule.min_growth_bytes && growth as f64 >= rule.min_growth * first.reserved as f64;
                let flat = (last.peak_used as f64 - first.peak_used as f64).abs()
                    <= rule.flat_tolerance * first.peak_used.max(1) as f64;
                let condition = recent.len() == window && never_shrank && grew && flat;
                let kind = WarningKind::ReservedCreep {
                    phase: phase.clone(),
                    steps: window as u32,
                    reserved_from: first.reserved,
                    reserved_to: last.reserved,
                    peak_used_from: first.peak_used,
                    peak_used_to: last.peak_used,
                };
                self.episode(condition, step, *device, Some(phase), kind, &mut fired);
            }
        }
        if let Some(rule) = &rules.low_headroom {
            for &(device, unused, demand) in &devices {
                let Some((free, _)) = memory(device) else { continue };
                let demands = self.demands.entry(device).or_default();
                demands.push_back(demand);
                while demands.len() > rule.window.max(1) as usize {
                    demands.pop_front();
                }
                let demand = demands.iter().copied().max().unwrap_or(0);
                let headroom = free.saturating_add(unused);
                let shortfall = demand.saturating_sub(unused);
                let condition = shortfall > 0 && (free as f64) < shortfall as f64 * (1.0 + rule.margin);
                let kind = WarningKind::LowHeadroom { headroom, demand, device_free: free, margin: rule.margin };
                self.episode(condition, step, device, None, kind, &mut fired);
            }
        }
        fired
    }

    /// Starts an episode when `condition` turns true, ends it when it turns false.
    fn episode(
        &mut self,
        condition: bool,
        step: u64,
        device: usize,
        phase: Option<&String>,
        kind: WarningKind,
        fired: &mut Vec<Warning>,
    ) {
        let warning = Warning { step, device, kind };
        let key = (warning.rule(), device, phase.cloned().unwrap_or_default());
        if !condition {
            self.active.remove(&key);
        } else if self.active.insert(key) {
            *self.fired.entry(warning.rule()).or_default() += 1;
            fired.push(warning);
        }
    }
}
