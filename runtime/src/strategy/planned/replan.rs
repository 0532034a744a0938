//! Making a plan at a scope's end: packing its recording, or laying it out in allocation order.
//!
//! # Sequences that vary: plans laid out in allocation order
//!
//! A scope may also differ from its plan in its *sequence*: allocations inserted or missing, not
//! only other sizes (a mixture of experts: an expert that routed no tokens skips its allocations,
//! and which ones do changes every step). Such a scope leaves its plan early and goes on best-fit
//! in the slab's free ranges, around what the plan placed before it left. Where the plan was
//! packed (greedy by size over the whole recording), that is the worst of both: a long-lived
//! early activation sits wherever the packing found room for it in another sequence (high in the
//! slab, a small router output at its very top), and best fit must work around it, growing the
//! slab past it when a large buffer comes; measured on the generated MoE trace, this held 30 %
//! more than the step's live peak, where best fit from an empty slab held under 1 % more.
//!
//! So a plan the next scope is expected to leave is laid out as best fit in allocation order would
//! lay it out ([`best_fit_in_order`](plan::best_fit_in_order)): every prefix of that layout is what
//! best fit makes of the prefix alone, so wherever the scope leaves the plan, what is live is where
//! best fit from an empty slab would have put it, and the scope is never worse for having been
//! planned up to there; while it follows the plan it is served by index, as any plan. A plan is
//! laid out so when the scope that recorded it left the plan of its key part way (another
//! sequence), or when it is new (no plan of its key yet), and that layout needs at most 1/128 more
//! than the packing: the second step, the first one served from a plan, may already differ from the
//! first. Where the whole layout costs more, the plan lays out its first sixteenth of allocations
//! so and packs the rest around them ([`plan::pack_after_prefix`]) when that needs at most 1/128
//! more, and is packed where that costs more too. Laid out in order whatever that cost, the plan of
//! a scope that left another sequence's plan part way held 951 MiB where its packing needs 781, on
//! a recorded loop of two training steps and an evaluation pass read (without its recording's step
//! marks) as one step of all three: the next scope followed it whole, at the run's peak, 1,032 MiB
//! (872 within the margin); a recorded generate-then-train loop went 320 → 298 MiB, and none of 219
//! replays reserved more (`benches/results/2026-11-30-in-order-within-a-margin-simulated.md`). A
//! mixture of experts' second step leaves its plan at its first routed expert, a few dozen
//! allocations in, and went on best fit around a packed prefix, a granule above the steps after it
//! and so tied with one pool (91.6 MiB live, 96 MiB); with the prefix in order 94 MiB, and on the
//! 192 replays of the evaluation set the misses go from 10 to 6, none worse (the recorded MoE
//! 1.033× → 1.006×). A scope that left its plan only at the plan's end is planned as a new sequence
//! is: one that followed the whole plan and went on (the step after a first step recorded before
//! the optimizer's steady sequence existed: SGD makes its momentum where later steps allocate), or
//! one that followed it and ended early (that first step, served from saved plans of the steady
//! sequence). On a recorded Llama trace with 4× gradient accumulation and SGD, laying such a scope
//! out in order held 147 MiB of slab for one step where the packing needs 133 MiB, 1.081× peak live
//! over the run against 1.006×, and 1.082× against 1.007× with saved plans. Once a scope it serves
//! keeps its sequence (no deviation), it is packed (greedy), so repeating steps pay the in-order
//! layout for one scope at most. Aligning a scope to its plan by more than position
//! (re-synchronising the cursor on matching sizes after an inserted or missing allocation) was not
//! kept: the allocations the plan lacks must be placed in ranges the plan's later entries need, and
//! those entries then deviate in turn.
//!
//! Where slabs are pool allocations, a scope of a new shape (no plan has its first sizes) borrows
//! the smallest plan whose first sizes are each at least its own (a shorter sequence after a longer
//! one: every slot fits), and records its own plan at its end (in a slab that grows in place it is
//! served best-fit from the range's start instead: see `slab.rs`). When no plan covers it from its
//! first allocation, the empty slab goes back (after a stream wait, so the trim returns it) and
//! the scope is recorded in fallback chunks like a first scope: the holes of a slab packed for
//! another shape fit the new one's buffers badly (an evaluation pass after training steps). When
//! it leaves the plans later, it is served best-fit from the slab's free space, then from the
//! fallback chunks, and recorded.
//!
//! A pool slab follows the plan of the scope that just ended (the borrowing scope's own plan, not the
//! one it borrowed; a growable slab, the largest plan of the last eight scopes, see `slab.rs`): it
//! shrinks at the scope's end when larger than that plan needs by an eighth,
//! and grows, after a stream wait that lets the trim give the old one back, when a larger plan
//! serves again. So a first step run before the optimizer state existed, or a long sequence, does
//! not keep the slab at its size while smaller scopes follow.
//!
//! # What outlives the scope's allocations, gathered by page
//!
//! A plan packs bytes, but a slab that grows in place is held by pages: once the scope's
//! activations are freed, what is still live after its last allocation — gradients freed at its
//! end, which the scope may instead hand to the next (the training step before an evaluation
//! step of a loop that calls `zero_grad()` at its top) — is all that holds the range's pages, and
//! best fit puts the small ones into the gaps the large ones leave, each on a page of its own. So
//! every plan made without carried memory moves those blocks onto fewer pages
//! ([`plan::survivors_by_page`]): page by page, those holding the fewest of their bytes first,
//! each block on it moves into a gap, free for its whole life and below the plan's size, on a
//! page such blocks hold already, or none of them moves. Nothing else moves and the plan's size
//! stays; a plan laid out in allocation order is then best fit's layout but for those blocks. On
//! a recorded train/eval loop of that kind (879 MiB live, the evaluation step the largest) the
//! gradients held 22 MiB of pages for 13 MiB at the evaluation step's peak, and the run reserved
//! 892 MiB, above PyTorch's expandable segments (890, modelled); gathered, 888. Of 239 replays,
//! four reserve less and none more (`benches/results/2026-11-29-survivors-by-page-simulated.md`).
//!
//! # Sizes that vary in shares of a fixed total
//!
//! Sizing every entry to the largest size seen in its place holds every scope seen, but where the
//! sizes are shares of a fixed total — the tokens routed to each expert of a mixture of experts,
//! whose sum is the batch's tokens times the experts per token — the largest sizes of different
//! entries never come together, and a plan of them holds memory no scope needs. On a recorded
//! MoE trace of 24 steps at 1.1 GiB live, the packing of the largest sizes needed 874 MiB where
//! every step needed 850 MiB packed at its own sizes, and steps kept leaving it (in 17 of 22, an
//! expert routed more tokens than ever before), each going on best fit around the packed
//! placements at 864 to 884 MiB.
//!
//! So a plan whose sizes vary is re-made ([`Planned::replan`]) as one of two layouts: the packing
//! of the largest sizes, or best fit in allocation order at the sizes of the scope that just
//! ended ([`in_shares`]). The second is taken when that scope needed as much as any scope of its
//! sequence (packed at its own sizes, within 1/128: the sizes vary in shares, not together as a
//! ragged batch's do, where a smaller scope comes after a larger one), when the largest sizes
//! together need more than that by over 1/128, and when the in-order layout needs less than
//! their packing. A scope served from it leaves it at its first entry larger than the latest size,
//! early in its forward pass, and goes on best fit around a prefix placed as best fit would place
//! it (see above): on that trace the whole run then reserves 1.017× its live peak (1.031×
//! before; PyTorch's expandable segments, modelled, 1.024×), on the simulated device. The price is
//! that most of such a scope's allocations are served online, not by an index lookup. Sizes that
//! vary together (a batch or sequence length drawn per step) keep the packing of the largest.
//!
//! Two other ways were measured on that trace and not kept. Serving an allocation larger than
//! its entry apart — best fit in the ranges that no live allocation and no pending entry of an
//! overlapping lifetime holds, else past the plan's end — while the rest of the scope follows its
//! plan held 876 to 896 MiB a step: such an allocation (a saved activation, live until the
//! backward pass) holds its whole size beside its idle planned range, and an entry whose range a
//! grown one took goes apart in turn. Laying the largest sizes out in allocation order made plans
//! of 892 to 897 MiB.
//!
//! Sizes that vary by less, where their largest together need more than a scope's own by under
//! 1/128, keep the packing of the largest; but a scope that still meets a size larger than ever
//! before, whose grown range another entry holds, leaves it part way, and goes on best fit
//! around what the packing scattered. After such a scope the plan of the largest sizes is laid
//! out in allocation order instead ([`left_in_order`]), when that needs at most 1/32 more than
//! the packing: a 2 GiB MoE recording (1743 allocations a step, the peak at the 388th, expert
//! sizes within about 10 % of their mean) left its packed plan between the 46th and the 215th
//! allocation, step after step, and held 2,032 to 2,040 MiB a step; so, 2,024 to 2,030 (1,999.5
//! MiB live; one pool 2,048, PyTorch's expandable segments modelled 2,058). Both conditions are
//! needed on Llama traces recorded on an H200, whose steps leave a plan once and then follow the
//! next: without the margin, one with 4× accumulation paid an in-order layout 11 % above the
//! packing for a step (908 → 976 MiB whole-run); without the condition on the scope's own sizes
//! (there the largest sizes cost nothing more than its own: what varied is not at the peak), a
//! checkpointed one paid 1.5 % (758 → 764). Laying the plan out at the scope's own sizes rather
//! than the largest held 2,016 to 2,024 on that MoE, and a granule more on another.

use steppool_trace::packing::{self as plan, Block};

use super::{Event, MAX_PLANNED_ALLOCATIONS, Plan, Planned};
use crate::report::PlanKey;
use crate::strategy::chunks::GRANULE;

/// The blocks freed in their scope, by the position of their free: a plan's `by_end`.
pub(super) fn freed_by_end(blocks: &[Block]) -> Vec<u32> {
    let mut by_end: Vec<u32> =
        (0..blocks.len() as u32).filter(|&b| blocks[b as usize].end != Block::NEVER_FREED).collect();
    by_end.sort_unstable_by_key(|&b| blocks[b as usize].end);
    by_end
}

/// A plan's entries as the packer's blocks.
pub(super) fn plan_blocks(plan: &Plan) -> Vec<Block> {
    (0..plan.sizes.len()).map(|i| Block { size: plan.sizes[i], start: plan.starts[i], end: plan.ends[i] }).collect()
}

/// A new plan is laid out as best fit in allocation order when that needs at most
/// `1 / IN_ORDER_MARGIN` more than its packing: the next scope may leave it early.
pub(super) const IN_ORDER_MARGIN: u64 = 128;

/// A new plan whose layout in allocation order costs more than 1/[`IN_ORDER_MARGIN`] over its
/// packing lays out its first 1/`IN_ORDER_PREFIX` of allocations so, the rest packed around them.
pub(super) const IN_ORDER_PREFIX: usize = 16;

/// The layout of a plan the next scope may leave early (a new sequence, or another sequence than
/// the plan of its key, which the scope left part way), whose packing is `packed`: best fit in
/// allocation order where that needs at most 1/[`IN_ORDER_MARGIN`] more; else its first
/// 1/[`IN_ORDER_PREFIX`] of allocations so and the rest packed around them, where that does
/// (where the next scope leaves it early, at the first routed expert, best fit goes on around
/// what best fit would have placed); else the packing. With whether it is laid out in order.
fn in_order_within_margin(blocks: &[Block], packed: plan::Packing) -> (plan::Packing, bool) {
    let margin = packed.size + packed.size / IN_ORDER_MARGIN;
    let in_order = plan::best_fit_in_order(blocks);
    if in_order.size <= margin {
        return (in_order, true);
    }
    let first = blocks.len() / IN_ORDER_PREFIX;
    match (first > 0).then(|| plan::pack_after_prefix(blocks, first)) {
        Some(prefix) if prefix.size <= margin => (prefix, true),
        _ => (packed, false),
    }
}

/// A plan of an allocation sequence whose sizes vary, and which a scope left part way, is laid
/// out in allocation order when that needs at most `1 / LEFT_IN_ORDER_MARGIN` more than the
/// packing of its largest sizes ([`left_in_order`]).
pub(super) const LEFT_IN_ORDER_MARGIN: u64 = 32;

/// The layout of a plan of the largest sizes (packed in `packed_bytes`) after a scope of its
/// sequence left it part way, when the largest sizes need more than that scope's own (the sizes
/// vary where the scope peaks) but not in shares of a fixed total ([`in_shares`]): `in_order`,
/// best fit in allocation order, when that needs at most 1/[`LEFT_IN_ORDER_MARGIN`] more than
/// the packing. The next scope, whose sizes may reach a new largest again, leaves it around a
/// prefix placed as best fit from an empty slab would place it; one that follows it pays the
/// margin at most, once, as it is then packed. `None`: the packing.
pub(super) fn left_in_order(in_order: plan::Packing, packed_bytes: u64) -> Option<plan::Packing> {
    (in_order.size <= packed_bytes + packed_bytes / LEFT_IN_ORDER_MARGIN).then_some(in_order)
}

/// Whether a plan's sizes vary in shares of a fixed total: the scope that just ended (packed at
/// its own sizes in `own_bytes`) needed as much as any scope of its sequence (`own_peak`, within
/// 1/[`IN_ORDER_MARGIN`]), yet the largest sizes of all its entries together need more
/// (`largest_bytes`, packed), by more than 1/[`IN_ORDER_MARGIN`]. Then the largest sizes do not
/// come together (routed tokens: each expert's share changes every step, their sum does not), a
/// plan that holds them all holds memory no scope needs, and the plan is laid out as best fit in
/// allocation order at the latest sizes instead, when that needs less than `largest_bytes`: a
/// scope leaves it at its first entry larger than the latest, where little is live, and goes on
/// best fit around a prefix that best fit would have placed the same, ending near what best fit
/// in order of its own sizes needs. `false` where the sizes vary together (a ragged batch: the
/// largest scope needs the largest sizes).
pub(super) fn in_shares(own_bytes: u64, own_peak: u64, largest_bytes: u64) -> bool {
    let slack = |bytes: u64| bytes + bytes / IN_ORDER_MARGIN;
    slack(own_bytes) >= own_peak && largest_bytes > slack(own_bytes)
}

/// Whether `plan` is the sequence of `blocks` (the same allocations and frees, in the same
/// places), sizes aside: its entries may be sized to the largest seen in their place.
pub(super) fn same_sequence(plan: &Plan, blocks: &[Block]) -> bool {
    plan.sizes.len() == blocks.len()
        && blocks.iter().zip(plan.starts.iter().zip(&plan.ends)).all(|(b, (&s, &e))| b.start == s && b.end == e)
}

impl Planned {
    /// The recorded scope as blocks (aligned sizes and lifetimes), if it may be planned.
    pub(super) fn recorded_blocks(&self) -> Option<Vec<Block>> {
        if self.allocations == 0 || self.allocations as usize > MAX_PLANNED_ALLOCATIONS {
            return None;
        }
        let mut blocks = Vec::with_capacity(self.allocations as usize);
        for (position, event) in self.events.iter().enumerate() {
            let position = position as u32;
            match *event {
                Event::Alloc(size) => blocks.push(Block { size, start: position, end: Block::NEVER_FREED }),
                Event::Free(index) => blocks[index as usize].end = position,
                Event::Carried(_) => {}
            }
        }
        Some(blocks)
    }

    /// The key of the current scope's plan: the user's, else its first sizes.
    pub(super) fn scope_key(&self) -> PlanKey {
        match self.user_key {
            Some(key) => PlanKey::User(key),
            None => PlanKey::Sizes(self.first_sizes.clone()),
        }
    }

    /// Packs the recorded scope and keeps the plan under the scope's signature, replacing the
    /// plan of that signature or, at the bound, the least recently used one.
    pub(super) fn replan(&mut self) {
        let Some(mut blocks) = self.recorded_blocks() else { return };
        let key = self.scope_key();
        if self.carried.iter().any(|c| c.out) {
            return self.replan_carried(blocks, key);
        }
        // The scope left its plan part way and went on online: where its sizes vary, the next
        // scope may leave the plan of its largest sizes too (`left_in_order`).
        let left_part_way = self.online.is_some() && !self.left_at_end;

        // The same sequence as the plan of its key, sizes aside (routed tokens, a ragged
        // batch): each entry is sized to the largest size seen in its place, so the sizes the
        // scopes vary between all fit the next plan instead of deviating scope after scope —
        // unless they vary in shares of a fixed total, where the plan keeps the scope's own sizes
        // (`in_shares`).
        let mut varies = false;
        let same = self.plans.iter().find(|p| p.key == key);
        let same_sequence = same.is_some_and(|same| same_sequence(same, &blocks));
        let own = blocks.clone();
        match same {
            Some(same) if same_sequence => {
                varies = same.varies || blocks.iter().zip(&same.largest).any(|(block, &size)| block.size != size);
                for (block, &size) in blocks.iter_mut().zip(&same.largest) {
                    block.size = block.size.max(size);
                }
            }
            _ => {}
        }
        let largest: Vec<u64> = blocks.iter().map(|b| b.size).collect();
        let mut own_peak = 0;
        // Where the next scope is expected to leave the plan (see the module docs), it is laid out
        // as best fit in allocation order: another sequence than the plan of its key (the
        // allocations of experts that routed no tokens are missing), or a new plan (the next
        // scope may differ from it), where that layout costs at most 1/128 more than the
        // packing; or sizes that vary in shares of a fixed total (`in_shares`).
        let mut new_sequence = false;
        let (packing, in_order) = match same {
            Some(same) if same_sequence && varies => {
                let packed = plan::pack(&blocks);
                let own_packing = plan::pack(&own);
                own_peak = same.own_peak.max(own_packing.size);
                let shares = in_shares(own_packing.size, own_peak, packed.size)
                    .then(|| plan::best_fit_in_order(&own))
                    .filter(|in_order| in_order.size < packed.size);
                match shares {
                    Some(in_order) => {
                        blocks = own;
                        (in_order, true)
                    }
                    None if left_part_way && own_packing.size < packed.size => {
                        match left_in_order(plan::best_fit_in_order(&blocks), packed.size) {
                            Some(in_order) => (in_order, true),
                            None => (packed, false),
                        }
                    }
                    None => (packed, false),
                }
            }
            Some(same) if same_sequence => {
                let packed = plan::pack(&blocks);
                own_peak = same.own_peak.max(packed.size);
                (packed, false)
            }
            // Another sequence than the plan of its key, which the scope left part way.
            Some(_) if !self.left_at_end => in_order_within_margin(&blocks, plan::pack(&blocks)),
            // A scope that followed the whole plan and went on, or followed it and ended early,
            // is no sign that the next one leaves its plan part way: it is planned as a new
            // sequence.
            _ => {
                new_sequence = true;
                let packed = plan::pack(&blocks);
                own_peak = packed.size;
                in_order_within_margin(&blocks, packed)
            }
        };
        let packing = plan::survivors_by_page(&blocks, packing, GRANULE);
        if !plan::is_valid(&blocks, &packing) {
            debug_assert!(false, "the planner made an invalid packing");
            return;
        }
        let by_end = freed_by_end(&blocks);
        let plan = Plan {
            key,
            sizes: blocks.iter().map(|b| b.size).collect(),
            starts: blocks.iter().map(|b| b.start).collect(),
            ends: blocks.iter().map(|b| b.end).collect(),
            offsets: packing.offsets,
            by_end,
            bytes: packing.size,
            lower_bound: plan::lower_bound(&blocks),
            last_used: self.clock,
            scopes: 0,
            varies,
            in_order,
            largest,
            own_peak,
            new_sequence,
            binned: None,
            predicted: false,
            carries: false,
            alternates: Vec::new(),
            guessed: false,
            freed_by: None,
            received: self.receiving,
        };
        let plan = self.fit_bin(plan);
        self.counters.replans += 1;
        self.keep_plan(plan);
    }

    /// Keeps `plan` in place of the plan of its key (beside it where their scopes differ both in
    /// what they received and in what they carried out: see "Memory carried into the next
    /// scope" in `carried.rs`) or, at the bound, of the least recently used one.
    pub(super) fn keep_plan(&mut self, plan: Plan) {
        // The plan of its key, unless that one's scope received where this one's did not and
        // carried out where this one did not, or the other way round: two kinds of scope under
        // one key, each kept.
        let apart = |p: &Plan| p.received != plan.received && p.carries != plan.carries;
        let same = self.plans.iter().position(|p| p.key == plan.key && !apart(p));
        if let Some(same) = same {
            // The scopes it served in this step stay counted.
            let plan = Plan { scopes: self.plans[same].scopes, ..plan };
            self.plans[same] = plan;
        } else if self.plans.len() < self.max_plans {
            self.plans.push(plan);
        } else if let Some(oldest) = (0..self.plans.len()).min_by_key(|&p| self.plans[p].last_used) {
            self.plans[oldest] = plan;
        }
    }

    /// Sets the scope's bookkeeping back to empty.
    pub(super) fn close_scope(&mut self) {
        self.events.clear();
        self.allocations = 0;
        self.first_sizes.clear();
        self.user_key = None;
        self.plan = None;
        self.cursor = 0;
        self.passed_ends = 0;
        self.entries.clear();
        self.late.clear();
        self.online = None;
        self.template = None;
        self.slab_live.clear();
        self.bin_live.clear();
        self.bin_free = None;
        self.deviated = false;
        self.left_at_end = false;
        self.slab_refused = false;
        self.given_back = 0;
        self.freed_unpunched = 0;
        self.guess_check = false;
        self.pins.clear();
    }
}
