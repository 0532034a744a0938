//! The `Planned` strategy: a scope's allocation sequence is recorded, packed offline into one
//! slab, and later scopes with the same signature are served at the planned offsets.
//!
//! Training steps repeat. The first scope (step or micro-step) of a phase pool is served from
//! fallback chunks (best fit, `chunks.rs`) taken from the phase's CUDA pool while its allocations
//! and frees are recorded; at its end the recording is packed ([`plan`]), the chunks
//! go back to the device, and the slab is taken from the pool. A later scope whose first sizes
//! (or the user's key, [`Runtime::set_plan_key`](crate::Runtime::set_plan_key)) match a plan gets
//! allocation *i* at planned offset *i* — an index lookup — when it is no larger than entry *i*,
//! or when it is larger but the grown range at that offset misses every live allocation (a size
//! that varies from scope to scope: routed tokens, a ragged batch). Anything else while a plan
//! serves (a larger size whose range is taken, an extra allocation, a planned range still held by
//! an allocation freed late) is a deviation: from then on the scope is served best-fit from the
//! slab's free ranges, then from the fallback chunks, so a scope that leaves its plan holds the
//! slab and little beside it. The plan is refreshed at the scope's end; when the scope had the
//! plan's allocations and frees in the same order, each entry is sized to the largest size seen in
//! its place, so sizes that vary converge to one plan that holds them all — unless they vary in
//! shares of a fixed total (`replan.rs`).
//!
//! # The parts
//!
//! This file holds the plan, the strategy's state and its [`Allocator`] implementation; each
//! part of the design is in the file that implements it, with its reasons:
//!
//! - `select.rs`: which plan a scope follows — its first sizes or the user's key — and a plan
//!   predicted for a new shape from plans of other shapes.
//! - `serve.rs`: an allocation handed out by index from the plan, online best fit in the slab,
//!   or from the fallback chunks; why a hand-out never overlaps a live allocation.
//! - `replan.rs`: the plan made at a scope's end — packed, or laid out in allocation order for
//!   sequences and sizes that vary.
//! - `carried.rs`: memory a scope carries into the next (a batch copied in the step, gradients
//!   freed by the next `zero_grad()`), the plans packed around it, and a plan's move to a new
//!   range.
//! - `slab.rs`: the slab taken, grown in place and shrunk, its pages given back, the bin lent
//!   beside it, and what happens when the device refuses memory.
//! - `live.rs` and `free_ranges.rs`: the records of the live allocations in the slab, and its
//!   free ranges while a scope is served online.
//! - `tests.rs`: unit tests against the fake source.

mod carried;
mod free_ranges;
mod live;
mod replan;
mod select;
mod serve;
mod slab;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use steppool_sys::CUdeviceptr;
use steppool_trace::packing::{self as plan, Block};
use steppool_trace::plans::{PlannedBlock, SavedPlan};

use super::chunks::{Chunks, GRANULE, PointerMap};
use super::{Allocator, Bin, Served};
use crate::error::Result;
use crate::phase::ALIGNMENT;
use crate::phase::PhaseEntry;
use crate::report::{FreeSpace, PlanKey, PlanStats, PlanSummary};
use crate::source::Source;
use carried::{CARRIED_SLOT, CarriedAllocation, CarriedIn};
use free_ranges::FreeRanges;
use live::{FOREIGN, SlabAllocation, SlabLive};
use replan::freed_by_end;
use select::Template;
use slab::Slab;

/// Scopes with more allocations than this are not planned: packing is quadratic in the worst
/// case (about 50 ms for 4096 allocations with four orderings on one core).
pub(crate) const MAX_PLANNED_ALLOCATIONS: usize = 1 << 15;

/// A packed scope.
#[derive(Debug)]
struct Plan {
    key: PlanKey,
    /// Per entry (allocation order): aligned size, planned offset, positions of its allocation
    /// and free in the recorded sequence.
    sizes: Vec<u64>,
    offsets: Vec<u64>,
    starts: Vec<u32>,
    ends: Vec<u32>,
    /// The entries freed in the recording, by the position of their free.
    by_end: Vec<u32>,
    bytes: u64,
    lower_bound: u64,
    last_used: u64,
    scopes: u64,
    /// Its sequence was seen again with the same allocations and frees but other sizes: its
    /// entries are sized to the largest seen, and an allocation larger than its entry is that
    /// entry grown, never a later entry of its size (the scope skipped nothing).
    varies: bool,
    /// Laid out as best fit in allocation order ([`plan::best_fit_in_order`]) rather than packed:
    /// its sequence changed from the scope before, or it is new and that layout costs little
    /// more, or its sizes vary in shares of a fixed total (see [`Planned::replan`]). Packed again
    /// once a scope it serves keeps its sequence, unless its sizes still vary so.
    in_order: bool,
    /// Per entry, the largest size seen in its place: `sizes`, unless the plan is laid out at
    /// the latest scope's sizes because its sizes vary in shares of a fixed total.
    largest: Vec<u64>,
    /// The most a scope of this sequence needed packed at its own sizes.
    own_peak: u64,
    /// Laid out in allocation order only because its sequence is new (the layout costs little
    /// more than the packing): packed instead where a bin makes the packing a granule smaller.
    new_sequence: bool,
    /// Where the bin lent by another pool holds the entries that reach past the slab's last
    /// granule boundaries ([`plan::into_bin`]): a packed plan, while a bin is held.
    binned: Option<plan::BinLayout>,
    /// Predicted for one scope of a new shape from plans of its sequence at other shapes
    /// ([`Planned::predicted_plan`]); never kept past that scope, saved or reported.
    predicted: bool,
    /// Packed with the allocations its scope carried into the next ([`plan::pack_around`]):
    /// its layout holds for the boundary too, so nothing lays it out again another way (no
    /// bin, no prediction from it).
    carries: bool,
    /// Entries carried into the next scope that the next scope makes again before it frees the
    /// one carried in (a batch bound to the same name each step), each with a second offset:
    /// the entry is handed out there where its own offset is taken (by the allocation carried
    /// in, as a rule), so that scope after scope the two places alternate; both are the entry's
    /// for the whole scope ([`Planned::replan_carried`]). By entry.
    alternates: Vec<(u32, u64)>,
    /// Some of `alternates` are guessed (a first plan of a scope that carries, which has seen
    /// no frees of what it carries): made again after the first scope it serves.
    guessed: bool,
    /// Where a first plan guessed the rest of what its scope carries freed in the next right
    /// after that scope's own copies (a batch copied, then `zero_grad()`), the position in the
    /// plan's sequence by which it is: a scope that gets there with that memory still live
    /// corrects the plan ([`Planned::correct_guess`]), which then holds the corrected guess.
    freed_by: Option<u32>,
    /// Its scope received memory the scope before carried into it: scopes of one key that do
    /// and that do not (the training steps after and before an evaluation step whose gradients
    /// live through it) keep a plan each ([`Planned::keep_plan`]).
    received: bool,
}

impl Plan {
    /// Whether a plan of another shape may be predicted from this one: a recorded plan (not a
    /// prediction) of one scope's sizes, which do not vary from scope to scope, selected by them.
    fn predicts(&self) -> bool {
        !self.predicted
            && !self.carries
            && !self.varies
            && matches!(self.key, PlanKey::Sizes(_))
            && !self.sizes.is_empty()
    }

    /// A plan predicted from `from` for one scope: `from`'s sequence at `sizes`, laid out at
    /// `offsets` in `bytes`.
    fn predicted(from: &Plan, sizes: Vec<u64>, offsets: Vec<u64>, bytes: u64, lower_bound: u64, clock: u64) -> Self {
        Plan {
            key: PlanKey::Sizes(Vec::new()),
            largest: sizes.clone(),
            sizes,
            offsets,
            starts: from.starts.clone(),
            ends: from.ends.clone(),
            by_end: from.by_end.clone(),
            bytes,
            lower_bound,
            last_used: clock,
            scopes: 0,
            varies: true,
            in_order: false,
            own_peak: 0,
            new_sequence: false,
            binned: None,
            predicted: true,
            carries: false,
            alternates: Vec::new(),
            guessed: false,
            freed_by: None,
            received: false,
        }
    }
}

/// One recorded event of a scope.
#[derive(Clone, Copy, Debug)]
enum Event {
    /// An allocation of this (aligned) size.
    Alloc(u64),
    /// The free of the scope's allocation with this index.
    Free(u32),
    /// The free of an allocation the scope before carried into this one
    /// ([`Allocator::carry`]), by its index in that scope.
    Carried(u32),
}

/// A planned entry's state in the current scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    Pending,
    Live,
    /// Live past its planned free: its range is on the late list.
    Late,
    /// Freed, skipped, or served elsewhere.
    Done,
}

/// Counters of the current step, summed over its scopes.
#[derive(Clone, Copy, Debug, Default)]
struct Counters {
    planned: u64,
    unplanned: u64,
    deviations: u64,
    missing: u64,
    deviated_scopes: u64,
    replans: u64,
    moves: u64,
}

/// The `Planned` strategy's state in one phase pool.
#[derive(Debug)]
pub(crate) struct Planned {
    entry: Arc<PhaseEntry>,
    max_plans: usize,
    signature_len: usize,
    plans: Vec<Plan>,
    slab: Option<Slab>,
    /// Scopes begun so far, the clock of least-recently-used eviction.
    clock: u64,
    // ----- the current scope -----
    events: Vec<Event>,
    allocations: u32,
    /// The first `signature_len` aligned sizes.
    first_sizes: Vec<u64>,
    user_key: Option<u64>,
    plan: Option<usize>,
    cursor: usize,
    /// How far through the plan's `by_end` the planned frees have been passed.
    passed_ends: usize,
    entries: Vec<Entry>,
    /// Live slab ranges no plan guarantee covers: `(offset, size)`.
    late: Vec<(u64, u64)>,
    /// A scope without a plan is served from the slab's free ranges (and the pool past them).
    online: Option<FreeRanges>,
    /// The plan a scope served online may be predicted from once it has followed its sequence
    /// for a while ([`Planned::follow_template`]).
    template: Option<Template>,
    slab_live: SlabLive,
    /// Live allocations from the fallback chunks: their index in the scope.
    pooled: PointerMap<u32>,
    /// What the slab does not serve (a scope without a plan past the slab's free space, a
    /// deviation): best fit in chunks taken from the pool, given back at the scope's end.
    fallback: Chunks,
    deviated: bool,
    /// The scope left its plan only at the plan's end: its first deviation was an allocation past
    /// the last entry (a step after a first one recorded before the steady sequence's extra
    /// allocations existed), or it ended before the last entries, having followed the plan so far
    /// (that first step, served from a plan of the steady sequence), rather than leaving it part
    /// way.
    left_at_end: bool,
    /// The most of the slab mapped at once in the scope.
    peak_mapped: u64,
    /// The slab could not be had in this scope: do not ask again until its end, or until memory
    /// was given back for a retry ([`Allocator::release_unused`]).
    slab_refused: bool,
    /// Stretches of the slab (offset, length) whose pages were given back in the scope while
    /// free ([`Source::punch_range`]): a range handed out there maps them again first.
    holes: Vec<(u64, u64)>,
    /// Bytes of those pages not mapped again.
    unmapped: u64,
    counters: Counters,
    /// Bytes of emptied fallback chunks given back in the scope since the last wait.
    given_back: u64,
    /// Bytes freed in a scope served online since its free pages last went back: they go back
    /// before the scope maps more ([`Planned::punch_freed`], [`Planned::fill_holes`]).
    freed_unpunched: u64,
    /// Whether the source was told that this pool keeps pages of freed memory mapped
    /// ([`Source::hold_freed`]), which it gives back when the device needs more.
    holding_freed: bool,
    /// The source has no ranges that grow in place: slabs are pool allocations.
    no_ranges: bool,
    /// The slab while a captured step holds it ([`Planned::lend_slab`]): out of `slab`, so that
    /// nothing here resizes, frees or serves from it until it comes back.
    lent: Option<Slab>,
    /// The unused end of another pool's last page, lent between steps
    /// ([`Allocator::lend_tail`]): plans serve the entries at their top from it.
    bin: Option<Bin>,
    /// The live allocations in the bin, filed as those in the slab are.
    bin_live: SlabLive,
    /// The bin's free ranges while the scope is served online.
    bin_free: Option<FreeRanges>,
    /// Allocations carried into the current scope, and at its end out of it
    /// ([`Allocator::carry`]). Those in the slab are on the late list while the scope runs.
    carried: Vec<CarriedAllocation>,
    /// Carried allocations so far: the next one's slot.
    carried_count: u32,
    /// The growable slab a plan moved away from ([`Planned::retire_slab`]): it holds the memory
    /// carried into the current scope, and nothing else is mapped there; nothing once that
    /// memory is freed. A move retires the range before it, if any, to `spent`.
    retired: Option<Slab>,
    /// Ranges retired before the last, nothing mapped: their addresses stay reserved until the
    /// pool goes ([`Planned::empty_retired`]).
    spent: Vec<Slab>,
    /// Bytes mapped in the retired range.
    retired_mapped: u64,
    /// The plan just made moves to a new range if the next scope follows it
    /// ([`Planned::replan_carried`]): the plan pinned where the carried memory lies, kept in its
    /// place if the next scope does not ([`Planned::move_or_stay`]).
    unmoved: Option<Plan>,
    /// The plan a first carrying plan replaced, until the next scope's end
    /// ([`Planned::restore_uncarried`]).
    uncarried: Option<Plan>,
    /// The scope received memory the scope before carried into it.
    receiving: bool,
    /// The sizes of what the scope before carried into this one, sorted: a scope of a new shape
    /// served online takes an allocation of one of them at the lowest free range
    /// ([`Planned::likely_carried`]).
    received_sizes: Vec<u64>,
    /// What the scope before carried into this one, (index there, size), in the order it was
    /// made: matched in order to what this scope carries out ([`Planned::replan_carried`]).
    received: Vec<(u32, u64)>,
    /// The scope went online within its first [`NEW_SHAPE_PREFIX`](serve::NEW_SHAPE_PREFIX)
    /// allocations or sixteenth of its plan: without a plan, or leaving one it matched by its
    /// first sizes only (a new shape).
    online_early: bool,
    /// The scope's plan guessed when the memory carried into the scope is freed, and not all of
    /// it is yet: each allocation checks the guess ([`Planned::check_guess`]).
    guess_check: bool,
    /// The entries a corrected plan pins where the memory of their index carried into the scope
    /// lies, by entry, with that offset ([`Planned::correct_guess`]).
    pins: Vec<(u32, u64)>,
}

impl Planned {
    /// A planned allocator for `entry`'s phase, keeping at most `max_plans` plans keyed by the
    /// first `signature_len` sizes (both at least 1, as [`PhaseSpec::validate`] checks).
    ///
    /// [`PhaseSpec::validate`]: crate::PhaseSpec::validate
    pub(crate) fn new(entry: Arc<PhaseEntry>, max_plans: u32, signature_len: u32) -> Self {
        Self {
            entry,
            max_plans: max_plans.max(1) as usize,
            signature_len: signature_len.max(1) as usize,
            plans: Vec::new(),
            slab: None,
            clock: 0,
            events: Vec::new(),
            allocations: 0,
            first_sizes: Vec::new(),
            user_key: None,
            plan: None,
            cursor: 0,
            passed_ends: 0,
            entries: Vec::new(),
            late: Vec::new(),
            online: None,
            template: None,
            slab_live: SlabLive::default(),
            pooled: PointerMap::default(),
            fallback: Chunks::default(),
            deviated: false,
            left_at_end: false,
            peak_mapped: 0,
            slab_refused: false,
            holes: Vec::new(),
            unmapped: 0,
            counters: Counters::default(),
            given_back: 0,
            freed_unpunched: 0,
            holding_freed: false,
            no_ranges: false,
            lent: None,
            bin: None,
            bin_live: SlabLive::default(),
            bin_free: None,
            carried: Vec::new(),
            carried_count: 0,
            retired: None,
            spent: Vec::new(),
            retired_mapped: 0,
            unmoved: None,
            uncarried: None,
            receiving: false,
            received_sizes: Vec::new(),
            received: Vec::new(),
            online_early: false,
            guess_check: false,
            pins: Vec::new(),
        }
    }

    /// As [`Planned::new`], starting with `saved` plans (checked by [`PhaseSpec::validate`]:
    /// overlap-free, keys of the phase's signature length), the first `max_plans` of them: a
    /// scope whose first sizes (or user key) select one is served from it from its first
    /// allocation, with no recording scope before it.
    ///
    /// [`PhaseSpec::validate`]: crate::PhaseSpec::validate
    pub(crate) fn with_plans(entry: Arc<PhaseEntry>, max_plans: u32, signature_len: u32, saved: &[SavedPlan]) -> Self {
        let mut planned = Self::new(entry, max_plans, signature_len);
        for saved in saved.iter().take(planned.max_plans) {
            let blocks = saved.packer_blocks();
            let by_end = freed_by_end(&blocks);
            planned.plans.push(Plan {
                key: saved.key.clone(),
                sizes: blocks.iter().map(|b| b.size).collect(),
                offsets: saved.blocks.iter().map(|b| b.offset).collect(),
                starts: blocks.iter().map(|b| b.start).collect(),
                ends: blocks.iter().map(|b| b.end).collect(),
                by_end,
                bytes: saved.bytes,
                lower_bound: plan::lower_bound(&blocks),
                last_used: 0,
                scopes: 0,
                varies: saved.varies,
                in_order: false,
                largest: blocks.iter().map(|b| b.size).collect(),
                own_peak: 0,
                new_sequence: false,
                binned: None,
                predicted: false,
                carries: saved.carries,
                alternates: Vec::new(),
                guessed: false,
                freed_by: None,
                received: saved.received,
            });
        }
        planned
    }

    /// The plans kept, most recently used first, as a plan file saves them: one per key and
    /// kind of scope (whether it received carried memory: two kinds of scope under one key keep
    /// a plan each), the most recently used. The kind is saved only where a key has plans of
    /// both: a key's only plan serves every scope of the key in the run that loads it, as the
    /// plan that the scopes before it replaced did (the last step's plan, which receives a
    /// batch and copies none, is the first step's too).
    pub(crate) fn saved_plans(&self) -> Vec<SavedPlan> {
        let mut plans: Vec<&Plan> = self.plans.iter().filter(|plan| !plan.predicted).collect();
        plans.sort_by_key(|plan| std::cmp::Reverse(plan.last_used));
        let mut kinds: Vec<(&PlanKey, bool)> = Vec::new();
        plans.retain(|plan| {
            let first = !kinds.contains(&(&plan.key, plan.received));
            kinds.push((&plan.key, plan.received));
            first
        });
        let shared = |plan: &Plan| plans.iter().filter(|p| p.key == plan.key).count() > 1;
        plans
            .iter()
            .map(|plan| SavedPlan {
                key: plan.key.clone(),
                bytes: plan.bytes,
                varies: plan.varies,
                received: plan.received && shared(plan),
                carries: plan.carries && shared(plan),
                blocks: (0..plan.sizes.len())
                    .map(|i| PlannedBlock {
                        size: plan.sizes[i],
                        start: plan.starts[i],
                        end: (plan.ends[i] != Block::NEVER_FREED).then_some(plan.ends[i]),
                        offset: plan.offsets[i],
                    })
                    .collect(),
            })
            .collect()
    }
}

impl Planned {
    /// [`Allocator::allocate`] of `size` (aligned) in every case but the plain one that
    /// [`Planned::serve_following`] serves. Kept out of line, so that the plain case saves and
    /// restores few registers.
    #[inline(never)]
    fn allocate_otherwise(&mut self, source: &mut dyn Source, size: u64) -> Result<Served> {
        let n = self.allocations as usize;
        if n == 0 {
            self.open_scope();
        }
        if n < self.signature_len {
            self.first_sizes.push(size);
            if self.user_key.is_none() {
                self.follow_signature(n);
            }
        }
        if self.template.is_some() {
            self.follow_template(n, size);
        }
        match self.serve(source, size) {
            Ok(ptr) => Ok(self.recorded(ptr, size)),
            Err(error) => {
                // Not an allocation of the scope: the caller may retry it after recovery (and a
                // scope that ran out of memory is not predicted).
                self.first_sizes.truncate(n);
                self.template = None;
                Err(error)
            }
        }
    }

    /// Records the scope's allocation of `size` (aligned) served at `ptr`, and its slot.
    #[inline(always)]
    fn recorded(&mut self, ptr: CUdeviceptr, size: u64) -> Served {
        self.events.push(Event::Alloc(size));
        let slot = self.allocations;
        self.allocations += 1;
        Served { ptr, slot }
    }

    /// [`Allocator::free`] in every case but the plain one it serves itself. Kept out of line,
    /// so that the plain case saves and restores few registers.
    #[inline(never)]
    fn free_otherwise(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        if served.slot & CARRIED_SLOT != 0 && served.slot != Served::NO_SLOT {
            return self.free_carried(source, served, bytes);
        }
        let ptr = served.ptr;
        if self.template.is_some() {
            self.follow_template_free(served.slot);
        }
        if let Some(allocation) = self.slab_live.remove(served.slot, ptr) {
            self.events.push(Event::Free(allocation.index));
            if let Some(online) = &mut self.online {
                // The pages stay mapped: they go back when the scope must map new ones
                // ([`Planned::punch_freed`]), at its end, or under memory pressure.
                online.give(ptr - self.slab.expect("a slab allocation has a slab").base, allocation.size);
                self.freed_unpunched += allocation.size;
                self.hold_freed(source, true);
                return Ok(());
            }
            self.end_in_slab(allocation);
            return Ok(());
        }
        if let Some(allocation) = self.bin_live.remove(served.slot, ptr) {
            self.events.push(Event::Free(allocation.index));
            if let (Some(bin), Some(free)) = (self.bin, &mut self.bin_free) {
                free.give(ptr - bin.ptr, allocation.size);
            }
            if allocation.entry != FOREIGN {
                self.entries[allocation.entry as usize] = Entry::Done;
            }
            return Ok(());
        }
        match self.pooled.remove(&ptr) {
            Some(index) => {
                self.fallback.free(ptr);
                self.events.push(Event::Free(index));
                // A chunk emptied in the scope goes back at once, and once an eighth of what the
                // scope holds (a chunk's worth) has gone back the stream is waited for and the
                // pool trimmed: the memory returns to the device while the scope goes on, so
                // another phase (gradients, optimizer state taken in the first step as its
                // activations are freed) takes it rather than adding to the reservation.
                self.given_back += self.fallback.release_if_empty(source, ptr)?;
                let held = self.slab.map_or(0, |slab| slab.size) + self.fallback.held() + self.given_back;
                if self.given_back > 0 && self.given_back >= (held / 8).max(GRANULE) {
                    self.given_back = 0;
                    source.synchronize()?;
                    source.trim_to(0)?;
                }
                Ok(())
            }
            None => {
                debug_assert!(false, "free of {ptr:#x}, which this strategy did not hand out");
                source.free(ptr, bytes)
            }
        }
    }

    /// Marks the entry of a slab allocation just freed, outside a scope served online, done, and
    /// takes a range kept past its planned free off the late list.
    #[inline(always)]
    fn end_in_slab(&mut self, allocation: SlabAllocation) {
        let late = allocation.entry == FOREIGN || self.entries[allocation.entry as usize] == Entry::Late;
        if allocation.entry != FOREIGN {
            self.entries[allocation.entry as usize] = Entry::Done;
        }
        if late {
            let offset = allocation.ptr - self.slab.expect("a slab allocation has a slab").base;
            if let Some(at) = self.late.iter().position(|&(late, _)| late == offset) {
                self.late.swap_remove(at);
            }
        }
    }
}

impl Allocator for Planned {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        let size = bytes.next_multiple_of(ALIGNMENT);
        if let Some(ptr) = self.serve_following(size) {
            return Ok(self.recorded(ptr, size));
        }
        self.allocate_otherwise(source, size)
    }

    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        // The plain case of a step that follows its plan, kept small: an allocation of the scope
        // in the slab, with no template to follow and no free ranges to give it to.
        if served.slot & CARRIED_SLOT == 0
            && self.template.is_none()
            && self.online.is_none()
            && let Some(allocation) = self.slab_live.remove(served.slot, served.ptr)
        {
            self.events.push(Event::Free(allocation.index));
            self.end_in_slab(allocation);
            return Ok(());
        }
        self.free_otherwise(source, served, bytes)
    }

    /// Keeps a slab or fallback allocation where it lies; one in the bin is not kept (a phase
    /// that carries takes no bin: [`Allocator::bin`]).
    fn carry(&mut self, served: Served, bytes: u64) -> Option<u32> {
        if served.slot & CARRIED_SLOT != 0 {
            return None;
        }
        let (index, size, place) = if let Some(allocation) = self.slab_live.remove(served.slot, served.ptr) {
            (allocation.index, allocation.size, CarriedIn::Slab)
        } else {
            (self.pooled.remove(&served.ptr)?, bytes.next_multiple_of(ALIGNMENT), CarriedIn::Chunk)
        };
        // Below `Served::NO_SLOT`, which has the bit set too.
        let slot = CARRIED_SLOT | (self.carried_count % (CARRIED_SLOT - 1));
        self.carried_count = self.carried_count.wrapping_add(1);
        self.carried.push(CarriedAllocation { ptr: served.ptr, size, slot, index, place, out: true });
        Some(slot)
    }

    /// Plans the scope if it had no plan or deviated from it, reclaims the slab (leaked buffers
    /// too), gives back leaked pool allocations, and sizes the slab for the largest plan. The
    /// slab is taken now, so the next scope finds it; it is given back when no plan is left, or
    /// when `keep` is smaller than it (the trim policy asks for the memory back; the next scope
    /// that has a plan takes it again).
    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()> {
        // A plan kept aside at the scope before's end: what this scope did with the memory that
        // scope carried out decides whether it comes back (`restore_uncarried`).
        let uncarried = self.uncarried.take().map(|plan| {
            let received = self.events.iter().any(|event| matches!(event, Event::Carried(_)))
                || self.carried.iter().any(|c| !c.out);
            let carries = self.carried.iter().any(|c| c.out);
            (plan, self.scope_key(), received, carries)
        });
        // What the scope before carried in and is still live the pool has released; what this
        // scope carries out stays where it is. A retired range none of it lives in any more
        // (a free the pool could not pass on) gives its pages back.
        self.carried.retain(|c| c.out);
        let retired_outcome = if self.carried.iter().any(|c| c.place == CarriedIn::Retired) {
            Ok(())
        } else {
            self.empty_retired(source)
        };
        self.pooled.clear();
        let kept: Vec<(CUdeviceptr, u64)> =
            self.carried.iter().filter(|c| c.place == CarriedIn::Chunk).map(|c| (c.ptr, c.size)).collect();
        self.fallback.reclaim_keeping(&kept);
        // The fallback chunks go back whole: the scope that needed them is over, and the pool
        // must not hold them idle while the slab (or another phase) takes its own peak.
        let outcome = self.fallback.release_empty(source, 0);
        let chunks_released = *outcome.as_ref().unwrap_or(&0) > 0;
        let mut outcome = outcome.map(drop).and(retired_outcome);
        if self.allocations > 0 {
            if let Some(index) = self.plan {
                let unserved = self.plans[index].sizes.len().saturating_sub(self.cursor) as u64;
                self.counters.missing += unserved;
                self.left_at_end |= !self.deviated && unserved > 0;
                self.deviated |= unserved > 0;
                self.plans[index].scopes += 1;
            }
            if self.deviated {
                self.counters.deviated_scopes += 1;
            }
            // A scope another shape's plan served (one whose first sizes dominate its own)
            // records its own plan too, so the slab can shrink to it once the larger shape stops
            // coming.
            let borrowed = self.user_key.is_none()
                && self
                    .plan
                    .is_some_and(|p| !matches!(&self.plans[p].key, PlanKey::Sizes(key) if *key == self.first_sizes));
            if borrowed && let Some(index) = self.plan {
                // Its own plan, not the borrowed one, sizes the slab from now on.
                self.plans[index].last_used = self.plans[index].last_used.min(self.clock - 1);
            }
            // A plan laid out in allocation order that served its scope without a deviation: the
            // sequence repeats, so it is packed now (greedy, as tight as the packer finds).
            let confirmed = !borrowed && !self.deviated && self.plan.is_some_and(|p| self.plans[p].in_order);
            // A plan that guessed which of what its scope carries out is made again before it is
            // freed: the scope it served saw the frees, and the plan is made again from them.
            let guessed = self.plan.is_some_and(|p| self.plans[p].guessed);
            self.drop_predicted_plan();
            if self.plan.is_none() || self.deviated || borrowed || confirmed || guessed {
                self.replan();
            }
        } else {
            self.drop_predicted_plan();
        }
        if let Some((plan, key, received, carries)) = uncarried {
            self.restore_uncarried(plan, &key, received, carries);
        }
        self.close_scope();
        for carried in &mut self.carried {
            carried.out = false;
        }
        self.slab_refused = false;
        let desired = self.desired_slab();
        // Holes given back in the scope: those under what the plans need are mapped again, so
        // that the next scope finds its pages where it left them (a scope that grew punched them
        // when it mapped more; unmapping everything above the lowest hole instead made every
        // scope of a new shape map its whole extent again). Past that, or when the device
        // refuses the pages, the pages from the lowest hole on go back (nothing lives in the slab
        // now), and the slab grows again below as the plans need.
        if let (Some(slab), Some(lowest)) = (self.slab, self.holes.iter().map(|&(at, _)| at).min()) {
            // Nothing of the scope lives in the slab now but what it carries: the pages under
            // that are mapped again whatever the plans need.
            let carried = self.carried_top();
            let keep = desired.next_multiple_of(GRANULE).min(slab.size).max(carried);
            // No more than the scope itself had mapped at once, though: the plans may need more
            // than a scope that left them ever held (a mixture of experts served online), and the
            // next scope's plan maps the rest as its cursor reaches it.
            let refill = keep.min(self.peak_mapped.next_multiple_of(GRANULE).max(carried));
            let refilled = lowest < refill && source.fill_range(slab.base, 0, refill).is_ok();
            let end = if refilled { refill } else { lowest.max(carried) };
            if refilled {
                self.holes.clear();
                self.unmapped = 0;
            } else {
                // Refused with carried memory above the lowest hole: the holes under it stay,
                // and the next scope is served online, which maps a hole again before it hands
                // it out (`serve`).
                self.clip_holes(end);
            }
            if end < slab.size {
                match source.resize_range(slab.base, end) {
                    Ok(size) => self.slab = Some(Slab { size, ..slab }),
                    Err(error) => outcome = outcome.and(Err(error)),
                }
            }
        }
        let mut slab_released = false;
        let mut kept = true;
        if let Some(slab) = self.slab.filter(|slab| slab.growable) {
            // Pages past what the plan of the scope that just ended needs go back to the device
            // (in stream order, without a wait), where another phase can take them; all of them when
            // the trim policy keeps less than the slab. The next scope maps what its plan needs.
            kept = slab.size <= keep;
            let target = if kept { desired } else { 0 };
            if slab.size > target.next_multiple_of(GRANULE) {
                outcome = outcome.and(self.shrink_slab(source, target));
            }
        } else if let Some(slab) = self.slab {
            let unfit = slab.size < desired || slab.size > desired + desired / 8;
            kept = slab.size <= keep;
            if (unfit || !kept) && self.carried_top() == 0 {
                // Smaller or larger than the recent plans need, or larger than the trim policy
                // keeps.
                self.slab = None;
                self.online = None;
                slab_released = true;
                outcome = outcome.and(source.free(slab.base, slab.size));
            }
        }
        if chunks_released || slab_released {
            // Wait for the frees, so that the trim gives the memory back rather than keeping it
            // idle while the slab (or another phase) takes its own peak: only after a scope the
            // slab did not serve in full (a recording, a new shape, a deviation) or a resize.
            outcome = outcome.and(source.synchronize());
        }
        if kept && !self.slab.is_some_and(|slab| slab.growable) {
            // A slab of the pool is taken now, so the next scope finds it (and a new shape has its
            // free space). A growable slab is not grown here: the next scope's plan maps what its
            // cursor reaches, and a scope of a new shape maps what best fit needs (module docs).
            outcome = outcome.and(self.ensure_slab(source, desired));
        }
        // Between scopes nothing lives in a growable slab: its mapped pages wait for the next
        // scope, and go back first if another pool on the device needs memory meanwhile.
        let idle_pages = self.slab.is_some_and(|slab| slab.growable && slab.size > 0) && self.carried_top() == 0;
        self.hold_freed(source, idle_pages);
        outcome
    }

    /// The slab (lent or not), what the fallback chunks hold (given back at the reset, so the
    /// pool keeps nothing for them) and what is mapped in a retired range.
    fn touched(&self) -> Option<u64> {
        Some(self.slab.or(self.lent).map_or(0, |slab| slab.size) + self.fallback.held() + self.retired_mapped)
    }

    fn free_space(&self) -> Option<FreeSpace> {
        let Some(slab) = self.slab else {
            // A lent slab is the captured step's: only the fallback chunks' free space is the pool's.
            return self.lent.map(|_| self.fallback.free_space());
        };
        let mut live: Vec<(u64, u64)> = self
            .slab_live
            .iter()
            .map(|allocation| (allocation.ptr - slab.base, allocation.size))
            .chain(self.carried_in_slab(slab))
            .collect();
        live.sort_unstable();
        let mut space = FreeSpace::default();
        let mut top = 0;
        for (offset, size) in live.into_iter().chain(std::iter::once((slab.size, 0))) {
            let gap = offset.saturating_sub(top);
            space.total_free += gap;
            space.largest_free = space.largest_free.max(gap);
            top = top.max(offset + size);
        }
        // Pages given back inside the slab are not held.
        space.total_free = space.total_free.saturating_sub(self.unmapped);
        let chunks = self.fallback.free_space();
        space.total_free += chunks.total_free;
        space.largest_free = space.largest_free.max(chunks.largest_free);
        Some(space)
    }

    /// Gives the slab back when nothing lives in it: the scope takes it again (at its planned
    /// size) when it next serves from a plan. Fallback chunks with nothing handed out go back
    /// too, and, while allocations live in a growable slab, the pages none of them needs
    /// ([`Planned::give_back_free_pages`]).
    fn release_unused(&mut self, source: &mut dyn Source) -> Result<u64> {
        // Memory is being freed for a retry: a slab refused before may be had now.
        self.slab_refused = false;
        self.freed_unpunched = 0;
        self.hold_freed(source, false);
        let chunks = self.fallback.release_empty(source, 0)?;
        if !self.slab_live.is_empty() || !self.late.is_empty() || self.online.is_some() || self.carried_top() > 0 {
            return Ok(chunks + self.give_back_free_pages(source, u64::MAX)?);
        }
        let Some(slab) = self.slab.take() else { return Ok(chunks) };
        self.online = None;
        self.slab_refused = false;
        if slab.growable {
            // The pages go back; the range stays reserved for the next scope to map again.
            self.slab = Some(Slab { size: 0, ..slab });
            self.holes.clear();
            let unmapped = std::mem::take(&mut self.unmapped);
            source.resize_range(slab.base, 0)?;
            return Ok(chunks + slab.size.saturating_sub(unmapped));
        }
        source.free(slab.base, slab.size)?;
        Ok(chunks + slab.size)
    }

    fn give_back_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<u64> {
        if !self.holding_freed {
            return Ok(0);
        }
        let given = self.give_back_free_pages(source, bytes)?;
        if given < bytes {
            // Everything it kept went back.
            self.freed_unpunched = 0;
            self.hold_freed(source, false);
        }
        Ok(given)
    }

    fn release_all(&mut self, source: &mut dyn Source) -> Result<()> {
        self.drop_predicted_plan();
        self.hold_freed(source, false);
        self.pooled.clear();
        let mut outcome = self.fallback.release_all(source);
        self.online = None;
        self.holes.clear();
        self.unmapped = 0;
        // A lent slab's lease holds the pool, so the pool goes only after it came back; were it
        // still out, nothing could launch on it any more.
        self.retired_mapped = 0;
        let spent = std::mem::take(&mut self.spent);
        for slab in [self.slab.take(), self.lent.take(), self.retired.take()].into_iter().flatten().chain(spent) {
            outcome = outcome.and(if slab.growable {
                source.free_range(slab.base)
            } else {
                source.free(slab.base, slab.size)
            });
        }
        self.close_scope();
        outcome
    }

    fn begin_step(&mut self) {
        self.counters = Counters::default();
        for plan in &mut self.plans {
            plan.scopes = 0;
        }
    }

    fn lend_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Option<CUdeviceptr>> {
        Planned::lend_slab(self, source, bytes)
    }

    fn take_back_slab(&mut self, source: &mut dyn Source, base: CUdeviceptr) -> Result<bool> {
        Planned::take_back_slab(self, source, base)
    }

    fn plan_view(&self) -> Option<super::PlanView> {
        let plan = self.plans.iter().filter(|plan| !plan.predicted).max_by_key(|plan| plan.last_used)?;
        Some(super::PlanView { sizes: plan.sizes.clone(), offsets: plan.offsets.clone(), bytes: plan.bytes })
    }

    /// A bin is wanted once there are plans to serve from a slab that grows in place, and none
    /// while the slab is lent to a captured step (whose graph is laid out at the plan's own
    /// offsets, and outlives any loan).
    fn bin(&self) -> Option<(Option<Bin>, bool)> {
        // A phase that carries takes none: the bin goes back at each step's start, and what it
        // held could not outlive the step.
        let wants = self.lent.is_none()
            && !self.entry.spec.carry
            && self.slab.is_some_and(|slab| slab.growable)
            && !self.plans.is_empty();
        Some((self.bin, wants))
    }

    fn set_bin(&mut self, bin: Option<Bin>) {
        debug_assert!(self.bin_live.is_empty(), "the bin changes while an allocation lives in it");
        if self.bin == bin {
            return;
        }
        self.bin = bin;
        let plans = std::mem::take(&mut self.plans);
        self.plans = plans.into_iter().map(|plan| self.fit_bin(plan)).collect();
    }

    fn saved_plans(&self) -> Vec<SavedPlan> {
        Planned::saved_plans(self)
    }

    fn plan_stats(&self) -> Option<PlanStats> {
        let c = self.counters;
        let mut plans: Vec<&Plan> = self.plans.iter().filter(|plan| !plan.predicted).collect();
        plans.sort_by_key(|plan| std::cmp::Reverse(plan.last_used));
        Some(PlanStats {
            planned: c.planned,
            unplanned: c.unplanned,
            deviations: c.deviations,
            missing: c.missing,
            deviated_scopes: c.deviated_scopes,
            replans: c.replans,
            moves: c.moves,
            slab_bytes: self.slab.or(self.lent).map_or(0, |slab| slab.size),
            bin_bytes: self.bin.map_or(0, |bin| bin.len),
            plans: plans
                .into_iter()
                .map(|plan| PlanSummary {
                    key: plan.key.clone(),
                    allocations: plan.sizes.len(),
                    bytes: plan.bytes,
                    lower_bound: plan.lower_bound,
                    scopes: plan.scopes,
                })
                .collect(),
        })
    }
}
