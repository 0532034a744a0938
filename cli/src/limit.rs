//! The offline limit of a trace: the least memory a placement that knows every lifetime in
//! advance reaches, by the packer of [`steppool_trace::packing`], and its per-step variant.
//!
//! - **Limit**: per device, the trace's allocations (sizes rounded up to the 512-byte alignment
//!   every strategy and the simulated device use; lifetimes from the allocating event to the
//!   freeing one, or to the end) packed into one range by the best of the packer's greedy
//!   orders, and checked free of overlaps by [`is_valid`]; the sum over devices of the ranges'
//!   sizes. No strategy that reserves one device's memory as a whole can do with less and keep
//!   the recorded addresses apart, up to the heuristic's distance from the optimum, which is at
//!   most the distance to the lower bound (the peak of rounded live bytes, also reported).
//! - **Per-step limit**, what the planned strategy aims at: per device, the persistent
//!   allocations packed with their lifetimes into one range, and beside it one range reused by
//!   every step, as large as the largest packing of one step's step- and micro-step-scoped
//!   allocations; the sum of the two, summed over devices. `None` for a trace without steps.
//!   Memory a step hands to the next (the `carried` phase) is in both steps' packings: to the
//!   end of the step that makes it, and from the start of the next to its free there, which is
//!   where a plan reused by every step holds it.

use steppool::Scope;
use steppool_trace::analysis::{Analysis, Op};
use steppool_trace::packing::{Block, is_valid, lower_bound, pack};

use crate::error::{ReplayError, Result};

/// The alignment of every allocation: sizes are rounded up to it.
pub const ALIGNMENT: u64 = 512;

/// A trace's offline limits, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The whole trace packed, per device, summed.
    pub bytes: u64,
    /// The peak of rounded live bytes, per device, summed: no packing is below it.
    pub lower_bound_bytes: u64,
    /// Persistent allocations packed apart plus one range reused by every step; `None` without
    /// steps.
    pub per_step_bytes: Option<u64>,
}

/// The limits of `analysis`'s allocations.
pub fn limit(analysis: &Analysis) -> Result<Limit> {
    // The step each allocation is made in, from the operations.
    let mut step_of = vec![None; analysis.allocations.len()];
    let mut step: Option<usize> = None;
    let mut steps = 0usize;
    // Where each step begins, as a packing position.
    let mut begins: Vec<u32> = Vec::new();
    for &(event, op) in &analysis.ops {
        match op {
            Op::BeginStep => {
                step = Some(steps);
                steps += 1;
                begins.push(position(event));
            }
            Op::EndStep => step = None,
            Op::Alloc(id) => step_of[id as usize] = step,
            _ => {}
        }
    }
    let block = |id: usize| {
        let a = &analysis.allocations[id];
        Block {
            size: a.bytes.max(1).next_multiple_of(ALIGNMENT),
            start: position(a.event),
            end: a.free.map_or(Block::NEVER_FREED, position),
        }
    };
    let mut devices: Vec<u32> = analysis.allocations.iter().map(|a| a.device).collect();
    devices.sort_unstable();
    devices.dedup();
    let (mut bytes, mut bound, mut per_step) = (0u64, 0u64, 0u64);
    for device in devices {
        let ids: Vec<usize> =
            (0..analysis.allocations.len()).filter(|&i| analysis.allocations[i].device == device).collect();
        let blocks: Vec<Block> = ids.iter().map(|&i| block(i)).collect();
        bytes += checked_pack(&blocks, device, "the whole trace")?;
        bound += lower_bound(&blocks);
        let (mut persistent, mut by_step) = (Vec::new(), vec![Vec::new(); steps]);
        for &i in &ids {
            match (analysis.allocations[i].scope, step_of[i]) {
                (Scope::Step | Scope::MicroStep, Some(s)) => {
                    let carried = analysis.phases[usize::from(analysis.allocations[i].phase)].carried;
                    let mut made = block(i);
                    if carried && s + 1 < steps {
                        // To the end of its step there, from the next one's start to its free.
                        let freed = made.end;
                        made.end = Block::NEVER_FREED;
                        by_step[s + 1].push(Block { start: begins[s + 1], end: freed, ..made });
                    }
                    by_step[s].push(made);
                }
                _ => persistent.push(block(i)),
            }
        }
        let mut region = 0u64;
        for (s, blocks) in by_step.iter().enumerate() {
            region = region.max(checked_pack(blocks, device, &format!("step {s}"))?);
        }
        per_step += checked_pack(&persistent, device, "the persistent allocations")? + region;
    }
    Ok(Limit { bytes, lower_bound_bytes: bound, per_step_bytes: (steps > 0).then_some(per_step) })
}

/// An event index as a packing position.
fn position(event: usize) -> u32 {
    u32::try_from(event).unwrap_or(Block::NEVER_FREED - 1).min(Block::NEVER_FREED - 1)
}

/// The size of the best packing of `blocks`, once [`is_valid`] accepts it.
fn checked_pack(blocks: &[Block], device: u32, what: &str) -> Result<u64> {
    if blocks.is_empty() {
        return Ok(0);
    }
    let packing = pack(blocks);
    if !is_valid(blocks, &packing) {
        return Err(ReplayError::Invalid(format!(
            "the packing of {what} on device {device} ({} allocations, {} bytes) overlaps; this is a bug in the packer",
            blocks.len(),
            packing.size
        )));
    }
    Ok(packing.size)
}

#[cfg(test)]
mod tests {
    use steppool_trace::analysis::analyse;
    use steppool_trace::{Event, EventKind, Location, Trace, TraceFormat};

    use super::*;

    const MIB: u64 = 1 << 20;

    /// A trace from a script: `[` and `]` begin and end a step, `+p:n` allocates `n` MiB at
    /// `p`, `-p` frees it.
    fn trace(script: &str) -> Trace {
        let mut trace = Trace::new("hand-made", TraceFormat::Steppool);
        let (mut step, mut sizes) = (0, std::collections::HashMap::new());
        for (t, word) in script.split_whitespace().enumerate() {
            let location = Location::Line(t as u64 + 1);
            let event = match word.as_bytes()[0] {
                b'[' => Event::new(t as u64, EventKind::StepBegin(step), location),
                b']' => {
                    step += 1;
                    Event::new(t as u64, EventKind::StepEnd(step - 1), location)
                }
                b'+' => {
                    let (ptr, mib) = word[1..].split_once(':').unwrap();
                    let ptr: u64 = ptr.parse().unwrap();
                    sizes.insert(ptr, mib.parse::<u64>().unwrap() * MIB);
                    Event { ptr, bytes: sizes[&ptr], ..Event::new(t as u64, EventKind::Alloc, location) }
                }
                _ => {
                    let ptr: u64 = word[1..].parse().unwrap();
                    Event {
                        ptr,
                        bytes: sizes[&ptr],
                        ..Event::new(t as u64, EventKind::Free { released: false }, location)
                    }
                }
            };
            trace.events.push(event);
        }
        trace.steps = steppool_trace::StepSource::Trace;
        trace
    }

    #[test]
    fn the_limit_packs_whole_lifetimes() {
        // 4 MiB throughout; 1 and 2 MiB together, then 3 MiB: 7 MiB at most live.
        let analysis = analyse(&trace("+1:4 +2:1 +3:2 -2 -3 +4:3 -4")).unwrap();
        let limit = limit(&analysis).unwrap();
        assert_eq!((limit.bytes, limit.lower_bound_bytes, limit.per_step_bytes), (7 * MIB, 7 * MIB, None));
    }

    #[test]
    fn the_per_step_limit_keeps_persistent_memory_apart_and_reuses_one_step_region() {
        // Step 0 has 2 + 1 MiB of scratch and makes a 4 MiB weight that is kept; between the
        // steps a persistent 2 MiB lives until step 1 begins freeing; step 1 has 5 MiB of
        // scratch. At most 9 MiB are live (the weight and step 1's scratch), and the whole
        // trace packs into that: the 2 MiB between the steps reuses step 0's scratch memory.
        let analysis = analyse(&trace("[ +1:2 +2:1 -1 +3:4 -2 ] +5:2 [ -5 +6:5 -6 ]")).unwrap();
        let limit = limit(&analysis).unwrap();
        assert_eq!(limit.lower_bound_bytes, 9 * MIB);
        assert_eq!(limit.bytes, 9 * MIB);
        // Per step, the persistent weight and the 2 MiB, alive together, take 6 MiB apart, and
        // the region every step reuses is step 1's 5 MiB.
        assert_eq!(limit.per_step_bytes, Some(11 * MIB));
    }

    #[test]
    fn memory_a_step_hands_to_the_next_is_in_both_steps_region() {
        // Each step makes two 4 MiB activations, frees the 2 MiB gradient the step before made,
        // frees an activation, makes its own gradient and frees the other: 10 MiB live at most,
        // the activations with the gradient handed over. Counted only in the step that makes
        // it, a gradient would be missing from the next step's region (8 MiB, below what is
        // live).
        let analysis =
            analyse(&trace("[ +1:4 +2:4 -1 +3:2 -2 ] [ +4:4 +5:4 -3 -4 +6:2 -5 ] [ +7:4 +8:4 -6 -7 -8 ]")).unwrap();
        let limit = limit(&analysis).unwrap();
        assert_eq!(limit.lower_bound_bytes, 10 * MIB);
        assert_eq!(analysis.phases[usize::from(analysis.allocations[2].phase)].name, "carried");
        assert_eq!(limit.per_step_bytes, Some(10 * MIB));
    }
}
