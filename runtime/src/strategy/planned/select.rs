//! Choosing a scope's plan: by its first sizes or the user's key, and predicting one for a new
//! shape.
//!
//! # A new shape predicted from two others
//!
//! A scope of a new shape is served from a plan after all when two plans of its sequence at other
//! shapes say how each size follows the first ([`Planned::predicted_plan`]): the same (a weight's
//! gradient), in proportion (an activation over a batch or a length) or as the square (attention
//! scores over a length). Then the new scope's sizes are predicted from the plan of the nearest
//! first size and packed, for that scope alone; it records its own plan as any new shape does.
//! On a ResNet whose batch varies (`resnet_varbatch_s41`, fp16), the first batch larger than any
//! before made the whole run's peak, 36 MiB served best-fit, 30 MiB from the prediction (1.078×
//! its live peak instead of 1.293×); over the 192 replays of the evaluation set, seven reserve
//! less and none more.
//! Scaling one plan by the ratio of the first sizes alone, with no second plan to tell which
//! sizes follow it, was measured first and not kept: the sizes that do not follow the batch grew
//! with the rest (13 % above the scope's own packing on a ResNet), and variable lengths, whose
//! attention grows as the square, left such plans early around a packed prefix (54 replays worse).
//!
//! # A larger shape predicted from one plan, once it follows it
//!
//! With one plan only, a larger shape (at most [`MAX_TEMPLATE_SCALE`] times the plan's first
//! size) is still served best-fit from the range's start, as any new shape, while the scope is
//! read against that plan ([`Planned::template`]): through the plan's first
//! 1/[`IN_ORDER_PREFIX`] of allocations, each allocation and free must come at the plan's place
//! among the scope's events, and each size must be the plan's, or the plan's times the ratio of
//! the first sizes. A scope that does so is then predicted from there on
//! ([`Planned::predict_from_template`]): each later size the plan's times the ratio to the power
//! the prefix showed for that size of the plan (a weight's gradient has its weight's size), else
//! in proportion, packed around the prefix laid out in allocation order, which is where best fit
//! from an empty range put it (checked; the scope stays online otherwise). Best fit is what the
//! scope would have had in its prefix anyway, so a scope that is another sequence (an evaluation
//! pass after training steps, attention over a longer length) loses nothing: it leaves at its
//! first event out of the plan's order or size no power explains, still online. On an fp16
//! ResNet whose second step, the first of its steady sequence, is a larger batch
//! (`resnet_varbatch_s16fp16`), that step held 30 MiB served best-fit, 26 MiB so (1.272× → 1.103×
//! its live peak); over the 192 replays of the evaluation set, two reserve less and none more.
//! Predicting from one plan at a scope's first allocation instead, with the same sizes, was
//! measured and not kept: packed from the first allocation, a scope that then left it (an
//! evaluation pass, a new length) held up to 56 % more (43 of the 192 replays worse; 30 with a
//! scope leaving at its first event out of order and the first sixteenth in allocation order).

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::PoisonError;

use steppool_trace::packing::{self as plan, Block};

use super::live::FOREIGN;
use super::replan::IN_ORDER_PREFIX;
use super::{Entry, Event, Plan, Planned};
use crate::phase::ALIGNMENT;
use crate::report::PlanKey;

/// The one plan a scope of a new, larger shape may be predicted from, while the scope, served
/// online, is checked against its sequence ([`Planned::follow_template`]).
#[derive(Debug)]
pub(super) struct Template {
    /// The plan's index.
    pub(super) plan: usize,
    /// The scope's first size over the plan's.
    pub(super) ratio: f64,
    /// Per allocation so far, the power of `ratio` that took the plan's size to the scope's: 0
    /// or 1, `None` where both agree (a size of a few hundred bytes).
    pub(super) exponents: Vec<Option<i32>>,
    /// The allocations so far served from the bin, not the slab.
    pub(super) in_bin: Vec<u32>,
}

/// The largest ratio of first sizes a plan is predicted across ([`Planned::predicted_plan`]).
pub(super) const MAX_SCALE: f64 = 8.0;

/// The largest ratio of first sizes a scope is predicted across from one plan
/// ([`Planned::template`]): its sizes that do not follow the ratio are predicted to, and a
/// predicted entry more than twice the size asked leaves the plan.
pub(super) const MAX_TEMPLATE_SCALE: f64 = 2.0;

/// How much larger than twice the size asked a predicted entry may be before the scope is taken
/// for another sequence ([`Planned::predicted_plan`]).
pub(super) const PREDICTION_SLACK: u64 = 64 << 10;

/// Per entry of two plans of one sequence, the power of the ratio of their first sizes that
/// takes the entry's size in `a` to its size in `b`: 0, 1 or 2, the largest that agrees within
/// the alignment both sizes were rounded to (a size of a few bytes agrees with all three). `None`
/// when an entry agrees with none, or the first sizes are equal.
pub(super) fn size_exponents(a: &[u64], b: &[u64]) -> Option<Vec<i32>> {
    if a.len() != b.len() || a.first()? == b.first()? {
        return None;
    }
    let ratio = b[0] as f64 / a[0] as f64;
    a.iter().zip(b).map(|(&a, &b)| size_exponent(a, b, ratio)).collect()
}

/// The power of `ratio` that takes size `a` to size `b`: 0, 1 or 2, the largest that agrees
/// within the alignment both were rounded to; `None` when none does.
pub(super) fn size_exponent(a: u64, b: u64, ratio: f64) -> Option<i32> {
    (0..=2).rev().find(|&power| follows_power(a, b, ratio, power))
}

/// Size `size` times `ratio` to the power `power`, rounded up to the alignment: a predicted size.
pub(super) fn predicted_size(size: u64, ratio: f64, power: i32) -> u64 {
    ((size as f64 * ratio.powi(power)).ceil() as u64).next_multiple_of(ALIGNMENT)
}

/// Whether size `b` is size `a` times `ratio` to the power `power`, within the alignment both
/// were rounded to.
pub(super) fn follows_power(a: u64, b: u64, ratio: f64, power: i32) -> bool {
    let scaled = a as f64 * ratio.powi(power);
    (b as f64 - scaled).abs() <= ALIGNMENT as f64 * ratio.powi(power).max(1.0)
}

impl Planned {
    /// Begins a scope's bookkeeping at its first allocation: reads the user's key.
    pub(super) fn open_scope(&mut self) {
        self.clock += 1;
        self.fallback.start_scope();
        self.peak_mapped = 0;
        self.note_mapped();
        // What the scope before carried into the slab is live where it lies, which only a plan
        // packed with it keeps clear of (hand-outs are checked against the late list). A first
        // allocation retried after out-of-memory recovery opens the scope again: nothing twice,
        // and nothing once the scope is online, whose free ranges leave carried memory out.
        if let Some(slab) = self.slab.filter(|_| self.online.is_none()) {
            let carried: Vec<(u64, u64)> =
                self.carried_in_slab(slab).filter(|range| !self.late.contains(range)).collect();
            self.late.extend(carried);
        }
        self.receiving = self.carried.iter().any(|c| !c.out);
        self.received_sizes.clear();
        self.received_sizes.extend(self.carried.iter().filter(|c| !c.out).map(|c| c.size));
        self.received_sizes.sort_unstable();
        self.received.clear();
        self.received.extend(self.carried.iter().filter(|c| !c.out).map(|c| (c.index, c.size)));
        self.received.sort_unstable();
        self.user_key = *self.entry.plan_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(key) = self.user_key {
            let found = self.preferred(|plan| plan.key == PlanKey::User(key));
            self.select(found, 0);
        }
    }

    /// Serves the scope from plan `index` (or none) from allocation `at` on: the allocations so
    /// far are the plan's first `at` entries (their sizes matched), served elsewhere.
    pub(super) fn select(&mut self, index: Option<usize>, at: usize) {
        // The live entries of the plan left behind lose their guarantee.
        self.slab_live.for_each_mut(|allocation| {
            if allocation.entry != FOREIGN {
                if self.entries[allocation.entry as usize] == Entry::Live {
                    // Where it lies: its planned offset, or its second place.
                    let offset = allocation.ptr - self.slab.expect("a slab allocation has a slab").base;
                    self.late.push((offset, allocation.size));
                }
                allocation.entry = FOREIGN;
            }
        });
        self.bin_live.for_each_mut(|allocation| allocation.entry = FOREIGN);
        self.plan = index;
        self.cursor = at;
        self.passed_ends = 0;
        self.entries.clear();
        self.guess_check = index.is_some_and(|index| self.plans[index].freed_by.is_some());
        if let Some(index) = index {
            let plan = &mut self.plans[index];
            plan.last_used = self.clock;
            self.entries.resize(plan.sizes.len(), Entry::Pending);
            self.entries[..at.min(plan.sizes.len())].fill(Entry::Done);
        }
    }

    /// Of the plans `matches` takes, the one whose scope received memory carried in as this one
    /// did (two kinds of scope under one key keep a plan each), the most recently used first.
    fn preferred(&self, matches: impl Fn(&Plan) -> bool) -> Option<usize> {
        (self.plans.iter().enumerate())
            .filter(|(_, plan)| matches(plan))
            .max_by_key(|(_, plan)| (plan.received == self.receiving, plan.last_used))
            .map(|(index, _)| index)
    }

    /// While the signature is still being read (no user key): if the current plan does not
    /// have this size next, switch to the most recently used plan whose first sizes are the
    /// scope's so far ([`Planned::preferred`]); if none has them, the scope is a new shape and
    /// has no plan.
    pub(super) fn follow_signature(&mut self, n: usize) {
        // A predicted plan is the scope's whatever its next sizes: it was made for this scope.
        let current_fits = self
            .plan
            .is_some_and(|p| self.plans[p].predicted || self.plans[p].sizes.get(n) == Some(&self.first_sizes[n]));
        if current_fits || self.online.is_some() {
            return;
        }
        let sizes = &self.first_sizes;
        let exact = self
            .preferred(|plan| matches!(&plan.key, PlanKey::Sizes(key) if key.len() > n && key[..=n] == sizes[..=n]));
        // No plan of this shape: the smallest plan whose first sizes are each at least the
        // scope's, sized to the slots' largest seen sizes, serves it (a shorter sequence after
        // the longest one was seen), so the scope is not served online.
        let dominates =
            |plan: &Plan| plan.sizes.len() > n && plan.sizes[..=n].iter().zip(&sizes[..=n]).all(|(p, s)| p >= s);
        // In a growable slab it does not: it is served best-fit from the empty range's start
        // (module docs, "A slab that grows in place").
        let growable = self.slab.is_some_and(|slab| slab.growable);
        let predict = growable && exact.is_none() && n == 0;
        let candidate = exact.or_else(|| {
            if growable {
                return None;
            }
            if self.plan.is_some_and(|p| dominates(&self.plans[p])) {
                return self.plan;
            }
            (0..self.plans.len()).filter(|&p| dominates(&self.plans[p])).min_by_key(|&p| self.plans[p].bytes)
        });
        let candidate = if predict { self.predicted_plan() } else { candidate };
        if predict && candidate.is_none() {
            self.template = self.template();
        }
        if candidate != self.plan {
            self.select(candidate, n);
        }
    }

    /// A plan for a scope whose first size no plan has (a batch or a length not seen before),
    /// predicted from two plans of one sequence at other shapes: the index of the new plan, kept
    /// for this scope only, or `None`.
    ///
    /// Where two plans have the same allocations and frees and their first sizes differ, each
    /// entry's size is read as a power of the first size: the same in both (a weight's gradient),
    /// in proportion (an activation: batch or length), or as its square (attention scores over a
    /// length). When every entry is one of these, the new scope's sizes are predicted from the
    /// plan whose first size is nearest its own, packed as any plan is, and the scope is served
    /// from that packing from its first allocation, rather than best-fit from the range's start,
    /// which holds a fifth to a third more on a ResNet whose batch varies. A scope whose sizes
    /// are not the predicted ones leaves the plan (one larger than its entry, where the range is
    /// not clear; one much smaller) and goes on best-fit around what it placed.
    pub(super) fn predicted_plan(&mut self) -> Option<usize> {
        let first = *self.first_sizes.first()?;
        let usable = Plan::predicts;
        // Each plan's sequence fingerprinted once, so that finding another plan of a sequence is
        // one pass over the plans, however many are kept.
        let fingerprints: Vec<u64> = self
            .plans
            .iter()
            .map(|plan| {
                let mut hasher = DefaultHasher::new();
                (&plan.starts, &plan.ends).hash(&mut hasher);
                hasher.finish()
            })
            .collect();
        let same_sequence = |a: &Plan, b: &Plan| a.starts == b.starts && a.ends == b.ends;
        // The plan nearest in first size, and another of its sequence at another first size.
        let (from, other) = (0..self.plans.len())
            .filter(|&p| usable(&self.plans[p]) && self.plans[p].sizes[0] != first)
            .filter_map(|p| {
                let plan = &self.plans[p];
                let other = (0..self.plans.len())
                    .filter(|&o| fingerprints[o] == fingerprints[p])
                    .map(|o| &self.plans[o])
                    .filter(|other| usable(other) && other.sizes[0] != plan.sizes[0] && same_sequence(plan, other))
                    .max_by_key(|other| other.last_used)?;
                Some((plan, other))
            })
            .min_by_key(|(plan, _)| {
                let (small, large) = (plan.sizes[0].min(first), plan.sizes[0].max(first));
                (u128::from(large) << 32) / u128::from(small)
            })?;
        let mut exponents = size_exponents(&from.sizes, &other.sizes)?;
        // The ratio is the first sizes': the first entry follows it in proportion, whatever else
        // a first size of a few hundred bytes also agrees with.
        exponents[0] = 1;
        let ratio = first as f64 / from.sizes[0] as f64;
        if !(1.0 / MAX_SCALE..=MAX_SCALE).contains(&ratio) {
            return None;
        }
        let blocks: Vec<Block> = (0..from.sizes.len())
            .map(|i| Block {
                size: predicted_size(from.sizes[i], ratio, exponents[i]),
                start: from.starts[i],
                end: from.ends[i],
            })
            .collect();
        let packing = plan::pack(&blocks);
        if !plan::is_valid(&blocks, &packing) {
            debug_assert!(false, "the planner made an invalid packing");
            return None;
        }
        let sizes = blocks.iter().map(|block| block.size).collect();
        let plan = Plan::predicted(from, sizes, packing.offsets, packing.size, plan::lower_bound(&blocks), self.clock);
        let plan = self.fit_bin(plan);
        self.plans.push(plan);
        Some(self.plans.len() - 1)
    }

    /// The one plan a scope whose first size no plan has may yet be predicted from, where no two
    /// plans of one sequence predict it ([`Planned::predicted_plan`]): the plan whose first size
    /// is the largest below the scope's, at most [`MAX_TEMPLATE_SCALE`] times smaller. One plan
    /// does not say which sizes follow the ratio of the first sizes (an activation) and which do
    /// not (a weight's gradient), so the scope is served online from its start like any new
    /// shape, and [`Planned::follow_template`] reads that from the scope itself.
    pub(super) fn template(&self) -> Option<Template> {
        let first = *self.first_sizes.first()?;
        let (plan, from) = self
            .plans
            .iter()
            .enumerate()
            .filter(|(_, plan)| plan.predicts() && plan.sizes[0] < first && plan.sizes.len() >= IN_ORDER_PREFIX)
            .max_by_key(|(_, plan)| plan.sizes[0])?;
        let ratio = first as f64 / from.sizes[0] as f64;
        (ratio <= MAX_TEMPLATE_SCALE).then(|| Template { plan, ratio, exponents: Vec::new(), in_bin: Vec::new() })
    }

    /// Follows a scope served online with a template ([`Planned::template`]) at its allocation
    /// `n`, of `size`: through the template's first 1/[`IN_ORDER_PREFIX`] of allocations the
    /// scope must have its sequence (each allocation at the template's position among the
    /// scope's events; each free, [`Planned::follow_template_free`], too) and sizes that are the
    /// template's times the ratio of the first sizes to the power 0 or 1 (a size squared, as
    /// attention scores over a length are, is not predicted: the scope stays online). At the end
    /// of that prefix the rest of the scope is predicted ([`Planned::predict_from_template`]).
    pub(super) fn follow_template(&mut self, n: usize, size: u64) {
        let Some(template) = &mut self.template else { return };
        let from = &self.plans[template.plan];
        let prefix = from.sizes.len() / IN_ORDER_PREFIX;
        // Online from the first allocation's serving on.
        let follows = (n == 0 || self.online.is_some())
            && template.exponents.len() == n.min(prefix)
            && from.starts.get(n) == Some(&(self.events.len() as u32));
        if n < prefix {
            // The first size follows the ratio by definition.
            let agrees = |power| n == 0 || follows_power(from.sizes[n], size, template.ratio, power);
            let power = match (agrees(0) && n > 0, agrees(1)) {
                (true, true) => Some(None),
                (true, false) => Some(Some(0)),
                (false, true) => Some(Some(1)),
                (false, false) => None,
            };
            match power {
                Some(power) if follows => template.exponents.push(power),
                _ => self.template = None,
            }
            return;
        }
        let template = self.template.take().expect("a template");
        if follows {
            self.predict_from_template(template);
        }
    }

    /// Follows the free of the scope's allocation `index` under a template: at the template's
    /// position, or the scope is not the template's sequence.
    pub(super) fn follow_template_free(&mut self, index: u32) {
        if let Some(template) = &self.template
            && self.plans[template.plan].ends.get(index as usize) != Some(&(self.events.len() as u32))
        {
            self.template = None;
        }
    }

    /// Predicts the rest of a scope that followed its template through the template's prefix:
    /// each later entry's size is the template's times the ratio to the power the scope showed
    /// for that size of the template in the prefix (a weight's gradient has the weight's size),
    /// else to the power 1; the prefix keeps the scope's own sizes. The prefix is laid out in
    /// allocation order and the rest packed around it ([`plan::pack_after_prefix`]): best fit
    /// from the empty range's start, which served the prefix, placed it so, and the scope goes
    /// on from the packing where what it holds already lies (checked; if not, it stays online).
    /// The plan is predicted, like [`Planned::predicted_plan`]'s: the scope's alone.
    pub(super) fn predict_from_template(&mut self, template: Template) {
        let Some(slab) = self.slab.filter(|slab| slab.growable) else { return };
        // Allocations carried into the slab lie where no prediction placed them.
        if self.online.is_none() || !self.pooled.is_empty() || !self.late.is_empty() || self.carried_top() > 0 {
            return;
        }
        let from = &self.plans[template.plan];
        let prefix = template.exponents.len();
        let own: Vec<u64> = self
            .events
            .iter()
            .filter_map(|event| match *event {
                Event::Alloc(size) => Some(size),
                Event::Free(_) | Event::Carried(_) => None,
            })
            .collect();
        let mut powers: BTreeMap<u64, i32> = BTreeMap::new();
        for (&size, &power) in from.sizes.iter().zip(&template.exponents) {
            if let Some(power) = power {
                let seen = powers.entry(size).or_insert(power);
                *seen = (*seen).max(power);
            }
        }
        let blocks: Vec<Block> = (0..from.sizes.len())
            .map(|i| {
                let size = own.get(i).copied().unwrap_or_else(|| {
                    let power = powers.get(&from.sizes[i]).copied().unwrap_or(1);
                    predicted_size(from.sizes[i], template.ratio, power)
                });
                Block { size, start: from.starts[i], end: from.ends[i] }
            })
            .collect();
        // The slab's blocks: not those of the prefix served from the bin, whose entries the
        // cursor has passed (their offsets in the plan are never used).
        let in_slab: Vec<usize> = (0..blocks.len()).filter(|i| !template.in_bin.contains(&(*i as u32))).collect();
        let slab_blocks: Vec<Block> = in_slab.iter().map(|&i| blocks[i]).collect();
        let packing = plan::pack_after_prefix(&slab_blocks, prefix - template.in_bin.len());
        if !plan::is_valid(&slab_blocks, &packing) {
            debug_assert!(false, "the planner made an invalid packing");
            return;
        }
        let mut offsets = vec![0; blocks.len()];
        for (&i, &offset) in in_slab.iter().zip(&packing.offsets) {
            offsets[i] = offset;
        }
        // Best fit from the empty range's start placed what is live where the packing does,
        // unless the scope's frees or the bin made it otherwise: then it stays online.
        if !self.slab_live.iter().all(|live| offsets[live.index as usize] == live.ptr - slab.base) {
            return;
        }
        let sizes = blocks.iter().map(|block| block.size).collect();
        let lower_bound = plan::lower_bound(&slab_blocks);
        let plan = Plan::predicted(from, sizes, offsets, packing.size, lower_bound, self.clock);
        let count = plan.sizes.len();
        self.plans.push(plan);
        self.plan = Some(self.plans.len() - 1);
        self.cursor = prefix;
        self.passed_ends = 0;
        self.entries.clear();
        self.entries.resize(count, Entry::Done);
        let entries = &mut self.entries;
        self.slab_live.for_each_mut(|live| {
            live.entry = live.index;
            entries[live.index as usize] = Entry::Live;
        });
        self.online = None;
        self.bin_free = None;
    }

    /// Takes out the plan predicted for the scope, the last one if any
    /// ([`Planned::predicted_plan`]).
    pub(super) fn drop_predicted_plan(&mut self) {
        if self.plans.last().is_some_and(|plan| plan.predicted) {
            self.plans.pop();
            if self.plan == Some(self.plans.len()) {
                self.plan = None;
            }
        }
    }
}
