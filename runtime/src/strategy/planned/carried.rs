//! Memory a scope carries into the next: plans packed around it, a plan's move to a new range,
//! a guessed free corrected.
//!
//! # Memory carried into the next scope
//!
//! A phase that carries ([`PhaseSpec::carry`](crate::PhaseSpec::carry)) keeps what a scope leaves
//! live for the next scope, which frees it: the gradients of a loop that calls `zero_grad()`
//! between its forward and backward passes are made in one step's backward pass and set to `None`
//! in the next step's. The pool hands such an allocation over at the boundary
//! ([`Allocator::carry`](crate::strategy::Allocator::carry)): it leaves the scope's records for a
//! list of its own, under a slot with [`CARRIED_SLOT`] set, stays where it is (in the slab, or in a
//! fallback chunk kept for it), and no reset, shrink, hole, loan or bin goes under it. While the
//! next scope runs, its range in the slab is on the late list, so no entry is handed out over it,
//! and its free is recorded in the scope's sequence ([`Event::Carried`]). A scope that carries is
//! planned with what it carries ([`Planned::replan_carried`]): each such allocation at one offset
//! in both its lives, its allocation to the scope's end and, in the next scope, the start to its
//! free ([`plan::pack_around`]), pinned where it lies, so a plan served scope after scope hands the
//! memory out at the place where the next scope finds it, and the memory is the next scope's
//! between its free and its next allocation.
//!
//! Where the recording scope puts the carried memory decides the plan if it is pinned there:
//! best fit puts gradients into the holes the backward pass leaves among the activations, where
//! the next forward pass needs its room (the static BERT of the repository's traces: its step
//! packed with the gradients free needs 193.4 MiB, its peak of live bytes; pinned where its
//! recording left them, 222.4 MiB). So a plan whose carried memory sits in a growable slab may
//! *move* ([`Planned::carried_layout`]): it is packed with every carried pair above what the next
//! scope makes before freeing it ([`plan::pack_around_above`]), and at the reset the slab retires
//! ([`Planned::retire_slab`]) at the next scope's first allocation, if that scope follows the
//! plan (the move is decided at the reset and made there; [`Planned::move_or_stay`]), keeping
//! only the carried memory's pages, while the scope maps a new range as its plan's cursor
//! reaches it. That scope holds the carried memory in the old
//! range until it frees it, beside what it has mapped in the new one, which stays below the
//! plan's size where the pairs sit above ([`plan::handover_peak`]); its frees give the old
//! range's pages back, and from its end on the memory lies where the plan hands it out. A plan
//! moves where it is smaller than the pinned plan by more than a [`MOVE_MARGIN`]th and that
//! scope holds no more pages than the pinned plan would, and only a plan whose scope's best fit
//! put what it carries out: the phase's first plan, made at the end of its recording scope, the
//! plan of a scope that followed its plan to the end and ran on past it (below), or the plan of
//! a new shape served best fit from its start where the phase had one shape before it (a loop
//! whose first steps begin with other sizes than the later ones). Other scopes put the carried
//! memory where a plan did, or serve shapes that vary from step to step,
//! whose next scope, another shape, would be served best fit in the new range beside the
//! carried memory, for nothing. A range retired before keeps its addresses reserved, nothing
//! mapped, until the pool goes. On eighteen recordings of loops that call
//! `zero_grad()` between their forward and backward passes
//! (`benches/results/2026-11-28-carried-moves-simulated.md`) the static BERT's whole run went
//! from 308 to 288 MiB (steady 280, its peak of live bytes).
//!
//! The step after the first follows the first step's plan to its end and runs on past it where
//! its optimizer makes what the first step's did not (an update that reads the state the first
//! step made, such as momentum buffers): best fit puts what it makes there, the batch it copies
//! for the next step at its end among them, in gaps the next forward pass needs, and that step
//! is planned afresh. Its batch comes at another index than the first step's, so where the next
//! scope frees it is read from the free of the allocation carried in that was made in the same
//! order ([`Planned::in_place_of`]), not of the same index, which finds none and guesses it
//! freed at the step's peak: it lives to the step's end, and the next step left its plan where
//! the plan counted on its room. And its plan may move to a new range, as the first did: on a
//! recorded static BERT of 1 GiB live, the plan pinned where best fit put that batch needed 956
//! MiB of range, the moved one 905; the whole run went from 1,062 to 1,012 MiB (1.004× its
//! limit), and a checkpointed Llama's from 656 to 650 MiB
//! (`benches/results/2026-11-29-second-move-simulated.md`).
//!
//! A first plan that guesses the carried memory freed right after the next scope's copies (see
//! below) weighs the move as if it were freed at the plan's peak instead: a plan moved for that
//! later free is as valid for the earlier one, and where the guess is right its pinned plan
//! would have been cheap, where it is wrong (`zero_grad()` between the passes) dear. Weighed
//! under the guess alone, the loops that copy their batch in the step never moved, and their
//! second step paid for the gradients best fit had scattered through the forward pass's room.
//! The move waits for the next scope's first allocation: a scope of another shape (a length
//! that varies from step to step) does not follow the moved plan, would be served best fit in
//! the new range for nothing, and there the pinned plan takes the moved one's place. And the
//! plan made again after a scope served from a plan keeps that plan's layout where still clear
//! of the pinned memory: packed afresh around the carried memory the moved plan had put above
//! the forward pass, the rest of a static BERT's step found 234.4 MiB where the moved plan held
//! 193.4. On recorded BERTs of that loop 390 → 378 MiB and 310 → 288 MiB over the run
//! (`benches/results/2026-11-28-late-move-simulated.md`).
//!
//! An allocation the next scope makes again *before* it frees the one carried in cannot share
//! its place: a batch copied to the device at each step's start and bound to the name the step
//! before's had (Python makes the new value before it drops the old), or copied at the step's
//! end for the next one, as `for batch in loader` does when the step is marked inside the loop.
//! Such an entry has two places, each held the whole scope, and scope after scope it is handed
//! out at whichever the one carried in does not hold (the plan's `alternates`). A first plan
//! takes an allocation made before the scope freed anything for one (the batch at the step's
//! start; a scope that frees nothing guesses none), and is made again after the first scope it
//! serves, from the frees that scope saw. With one place, each step of a Llama with
//! 4× accumulation whose micro-batches are copied so deviated at its first batch (218 MiB,
//! steady 1.069× the limit; with two, 214 and 1.003×,
//! `benches/results/2026-11-28-batches-carried-simulated.md`).
//!
//! Where such memory lies decides the scopes after it, since each plan pins it where it lies:
//! a batch in a gap between the gradients carried in splits, once they are freed, the room the
//! next forward pass needs, and a plan pinned around it holds that split for good. So the two
//! places lie together. A scope served online (a new shape) takes an allocation made again
//! while the one of its index carried in still lives at the lowest free range that holds it,
//! not the smallest ([`Planned::made_again_while_carried`]); and a carrying plan puts an
//! entry's own place right below or above its second place where that is clear of the pinned
//! memory ([`plan::pack_around`]), where the packing placed it, small and alive the whole
//! scope, into the smallest gap between the pinned memory. On a recorded token-budget GPT-2
//! whose steps are each a new shape and copy their batch at the step's start, the second
//! step's batch went into a gap at 807 MiB of a 1.3 GiB range, the forward pass's 189 MiB
//! logits found no room below it, and the run held 1.058× its live peak; with both, 1.006×
//! (`benches/results/2026-11-28-batches-low-simulated.md`). Either alone was measured and not
//! kept: the online placement alone held 1.117× (the plans after it put the batch's own place
//! in a gap again), the plans alone changed only 5 of 146 replays.
//!
//! # Memory carried out of a scope of a new shape
//!
//! The same holds for the gradients themselves where every step is another shape (a sequence
//! length that varies, a generation of a new length before the training pass): each step is
//! served online from its start, and best fit puts the gradients made in its backward pass
//! into the smallest holes the activations left, scattered through the room the next step's
//! forward pass needs, where they stay pinned until that step frees them. Their shapes are the
//! parameters', whatever the batch: a scope that went online within its first
//! [`NEW_SHAPE_PREFIX`](super::serve::NEW_SHAPE_PREFIX) allocations, or the first sixteenth of
//! its plan's (a mixture of experts leaves its plan in the forward pass, where the routing
//! varies), takes an allocation of a size the scope before carried into it at the lowest free
//! range that holds it ([`Planned::likely_carried`]), so the gradients lie together at the
//! range's start, where the ones before them did. Not in a scope that left its plan later:
//! there the lowest free ranges are gaps among the plan's live entries (a static BERT whose
//! second step left its plan at its 299th allocation, the first step's plan's last, and its
//! third at its 88th of 421: 1,062 → 1,138 MiB with the rule in the third, 1,164 in both, when
//! that third step still left its plan). On a recorded generate-then-train loop under SGD with
//! `zero_grad()` between the passes, whose longest generation is served online around the
//! gradients of the step before, 662 → 656 MiB (PyTorch's expandable segments, modelled, 658)
//! (`benches/results/2026-11-29-gradients-of-new-shapes-simulated.md`).
//!
//! What a first plan cannot see is when the next scope frees the rest of what it carries in:
//! its recording scope received nothing. Where that scope began by copying what it carries out
//! (a batch copied at the step's start), the plan guesses the rest freed right after the next
//! scope's own copies, as `zero_grad()` at the top of a loop frees the gradients
//! (`freed_by`); a loop that calls `zero_grad()` between the passes holds them through its
//! forward pass, where that plan put the forward pass. The scope that gets to the guessed
//! position with some of it still live corrects its plan there ([`Planned::correct_guess`]):
//! the rest is packed again around what lies where it lies, under the next guess (freed where
//! the plan's own live bytes peak, then before the first of it is made again), each gradient
//! made again pinned where the one of its index lies, and the rest kept at its offsets where
//! they are still clear ([`plan::pack_around_placed`]); where the memory is freed before that
//! guess, the rest is packed again from there, if that is smaller. Left on the wrong guess, the
//! scope deviated at its first activation, went on best fit, and every later plan was pinned
//! where best fit had left the gradients: on recorded BERTs and checkpointed Llamas of that
//! loop, 404 → 390 MiB and 312 → 294 MiB over the run
//! (`benches/results/2026-11-28-corrected-guess-simulated.md`).
//!
//! Nor can a first plan see *which* scope receives the memory. In a loop that calls
//! `zero_grad()` at its top with an evaluation step after some training steps, a training step
//! frees its gradients at its own end (the next step's top, before that step's first
//! allocation), but the one before an evaluation step carries them into it, which frees them at
//! its end. A first carrying plan made there guesses them live in the next scope of its key up
//! to its peak and keeps their range clear of that scope's activations, yet the training steps
//! after it receive nothing, and each held that range for nothing: 5,824 MiB a step on a 5.6 GiB
//! recording whose plan before held 5,712. So the plan a first carrying plan replaces, where it
//! carried nothing, is kept aside until the next scope's end; where that scope, of another key,
//! was carried memory, freed it, and carries nothing out itself, the plan kept aside takes the
//! carrying plan's place again ([`Planned::restore_uncarried`]), unless that scope held as much
//! of the range as the carrying plan needs: then the training steps' extra costs the run's peak
//! nothing, and the gradients kept apart stay out of the evaluation step's way (an evaluation
//! step of two batches of twice the training batch reserved 2–10 MiB more where they lay among
//! its room). A scope of the same key that receives the memory (the loop of every other step
//! here) keeps the carrying plan.
//!
//! Under `zero_grad()` between the passes it is the other way round: the gradients of the
//! training step before an evaluation step live through it into the next training step
//! (persistent: two boundaries), so that step receives nothing and carries its own gradients
//! out, and the step after it receives them and carries nothing, its own living through the
//! evaluation step. Both have the same first sizes, so under one key each left the other's plan,
//! scope after scope: on a 1.7 GiB recording under SGD, 1,936 MiB where one pool holds 1,824.
//! So a plan records whether its scope received memory (`received`), a scope prefers the plan of
//! its key that agrees, and a plan is kept beside the plan of its key, not in its place, where
//! the two differ both in what their scopes received and in what they carried out
//! ([`Planned::keep_plan`]): 1,788 MiB. A loop that carries at every boundary differs from its
//! first step's plan only in what it received, and replaces it as before; and a first carrying
//! plan takes the place of a plan that carries nothing only where both scopes received alike
//! (`benches/results/2026-11-29-four-new-loops-simulated.md`).
//!
//! # Sizes and sequences that vary in a phase that carries
//!
//! A loop that copies its next batch at each step's end (`for batch in loader`, the step marked
//! inside the loop) carries the batch at every boundary, so every plan of its step phase is a
//! carrying plan, and the logic a plan without carried memory has for sizes and sequences that
//! vary (`replan.rs`) applies to it as well, around the pinned memory: the same sequence as the
//! carrying plan of its key whose scope received alike has each entry sized to the largest seen
//! in its place (what it carries out keeps its size, pinned where it lies); sizes that vary in
//! shares of a fixed total are laid out as best fit in allocation order at the scope's own sizes,
//! and after a scope that left the plan part way, at the largest sizes where that costs at most
//! 1/[`LEFT_IN_ORDER_MARGIN`](super::replan::LEFT_IN_ORDER_MARGIN) more
//! ([`plan::best_fit_in_order_around`]); and a scope that left a plan of its key that is another
//! sequence part way (the step after the first, whose optimizer made its state) is laid out as
//! a new plan is, in order where that costs at most 1/[`IN_ORDER_MARGIN`] more than the packing,
//! else its first 1/[`IN_ORDER_PREFIX`] so and the rest packed around it
//! ([`plan::pack_after_prefix_around`]), unless it is the phase's first plan, which may move. On
//! a MoE recorded with such a loader (410 MiB live), every step left its plan among its first
//! hundred allocations, around a prefix packed for another sequence, and the run reserved 422 MiB
//! (steps 420–422), as much as PyTorch's expandable segments (modelled); so, 420 (steps from
//! the third 418). Laid out in order whatever it costs, as a plan that carries nothing is after
//! such a scope, a static BERT of that loop paid 0.85 % more for two steps (740 → 744 MiB).

use std::collections::HashMap;

use steppool_sys::CUdeviceptr;
use steppool_trace::packing::{self as plan, Block};

use super::live::FOREIGN;
use super::replan::{
    IN_ORDER_MARGIN, IN_ORDER_PREFIX, freed_by_end, in_shares, left_in_order, plan_blocks, same_sequence,
};
use super::slab::Slab;
use super::{Entry, Event, Plan, Planned};
use crate::error::Result;
use crate::report::PlanKey;
use crate::source::Source;
use crate::strategy::Served;
use crate::strategy::chunks::GRANULE;

/// A carrying plan moves to a new range ([`Planned::carried_layout`]) when it is smaller than the
/// plan pinned where the carried memory lies by more than this fraction of its own size: a move
/// costs driver calls and a scope's pages in two ranges.
pub(super) const MOVE_MARGIN: u64 = 64;

/// The slots of carried allocations ([`Allocator::carry`](crate::strategy::Allocator::carry)) have
/// this bit set: a scope's own slots are its allocations' indices, far below it.
pub(super) const CARRIED_SLOT: u32 = 1 << 31;

/// An allocation a scope carried into the next
/// ([`Allocator::carry`](crate::strategy::Allocator::carry)), live until freed there.
#[derive(Clone, Copy, Debug)]
pub(super) struct CarriedAllocation {
    pub(super) ptr: CUdeviceptr,
    pub(super) size: u64,
    /// The slot its free passes.
    pub(super) slot: u32,
    /// Its index among the allocations of the scope that made it.
    pub(super) index: u32,
    /// Where it lies.
    pub(super) place: CarriedIn,
    /// Carried out of the scope now ending (else into the current one).
    pub(super) out: bool,
}

/// Where a carried allocation lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CarriedIn {
    /// The slab.
    Slab,
    /// The range the slab was before a plan moved to a new one ([`Planned::retire_slab`]).
    Retired,
    /// A fallback chunk.
    Chunk,
}

/// A carrying scope's packing and its pairs as placed ([`Planned::carried_layout`]).
pub(super) type PairedPacking = (plan::Packing, Vec<plan::Carried>);

/// What [`Planned::carried_plan`] makes a carrying scope's plan from, besides its packing.
#[derive(Clone, Copy)]
pub(super) struct CarriedLayout<'a> {
    /// The scope's own blocks, then the carried memory's lives in the next scope.
    pub(super) blocks: &'a [Block],
    /// How many of `blocks` are the scope's own.
    pub(super) entries: usize,
    /// Entries with two places: (entry, its second place's block, its recorded start).
    pub(super) alternating: &'a [(usize, usize, u32)],
    /// The plan's key.
    pub(super) key: &'a PlanKey,
    /// Whether the plan guesses a free of carried memory its scope did not see.
    pub(super) guessed: bool,
    /// Where the plan guesses the carried memory freed, if after the next scope's copies.
    pub(super) copies_end: u32,
}

/// What [`Planned::varying_layout`] weighs.
#[derive(Clone, Copy)]
struct Varying<'a> {
    /// The carrying plan of the scope's sequence and kind.
    same: Option<&'a Plan>,
    /// The scope's sizes, or that plan's, vary from the largest seen.
    varies: bool,
    /// A plan of the scope's key is another sequence.
    other_sequence: bool,
    /// The scope's own blocks, at the largest sizes seen, then the carried memory's lives in the
    /// next scope.
    blocks: &'a [Block],
    /// The scope's own sizes.
    own_sizes: &'a [u64],
    /// The carried memory, as [`plan::pack_around`] takes it.
    pairs: &'a [plan::Carried],
    /// The entries with a second place, placed beside it by [`plan::pack_around`].
    beside: &'a [plan::Alternate],
    /// How many of `blocks` are the scope's own.
    entries: usize,
}

/// A carrying plan's layout where its sizes or sequence vary ([`Planned::varying_layout`]).
struct VaryingLayout {
    /// Best fit in allocation order (of a prefix at least), where taken; else the plan is packed.
    in_order: Option<plan::Packing>,
    /// The blocks at the scope's own sizes, where the layout is of them (shares of a fixed
    /// total), not of the largest.
    own: Option<Vec<Block>>,
    /// The most a scope of its sequence needed packed at its own sizes; 0 where not weighed.
    own_peak: u64,
}

impl Planned {
    /// The ranges (offset, length) of the carried allocations in the slab at `slab`.
    pub(super) fn carried_in_slab(&self, slab: Slab) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.carried.iter().filter(|c| c.place == CarriedIn::Slab).map(move |c| (c.ptr - slab.base, c.size))
    }

    /// Whether the scope's next allocation is made again while the one of its index carried in
    /// from the scope before still lies in the slab (a batch copied to the device before the
    /// step before's is freed): it is likely carried out in turn.
    pub(super) fn made_again_while_carried(&self) -> bool {
        let index = self.allocations;
        self.carried.iter().any(|c| !c.out && c.index == index && c.place == CarriedIn::Slab)
    }

    /// Whether an allocation of `size` in a scope of a new shape served online is likely carried
    /// into the next scope: the scope went online early
    /// ([`NEW_SHAPE_PREFIX`](super::serve::NEW_SHAPE_PREFIX)) and `size` is the size of something
    /// the scope before carried into it (the gradients of a loop that calls `zero_grad()`
    /// between its passes are shaped as the parameters, whatever the batch). Such an allocation
    /// takes the lowest free range that holds it (module docs, "Memory carried out of a scope of
    /// a new shape").
    pub(super) fn likely_carried(&self, size: u64) -> bool {
        self.online_early && self.received_sizes.binary_search(&size).is_ok()
    }

    /// The end of the highest carried allocation in the slab: what no resize may cut.
    pub(super) fn carried_top(&self) -> u64 {
        self.slab.map_or(0, |slab| self.carried_in_slab(slab).map(|(offset, len)| offset + len).max().unwrap_or(0))
    }

    /// Frees an allocation carried in from the scope before: its range goes back to the scope
    /// served online, or off the late list; the free's place in the scope is recorded, which is
    /// where the next plan keeps its memory clear until.
    #[cold]
    pub(super) fn free_carried(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
        let Some(at) = self.carried.iter().position(|c| c.slot == served.slot && c.ptr == served.ptr) else {
            debug_assert!(false, "free of {:#x}, which this strategy did not carry", served.ptr);
            return source.free(served.ptr, bytes);
        };
        let carried = self.carried.swap_remove(at);
        self.events.push(Event::Carried(carried.index));
        match carried.place {
            CarriedIn::Slab => {}
            CarriedIn::Chunk => {
                self.fallback.free(carried.ptr);
                self.given_back += self.fallback.release_if_empty(source, carried.ptr)?;
                return Ok(());
            }
            CarriedIn::Retired => return self.free_retired(source, carried),
        }
        let offset = carried.ptr - self.slab.expect("a carried allocation in the slab has a slab").base;
        if let Some(online) = &mut self.online {
            online.give(offset, carried.size);
            self.freed_unpunched += carried.size;
            self.hold_freed(source, true);
        } else if let Some(late) = self.late.iter().position(|&(late, _)| late == offset) {
            self.late.swap_remove(late);
        }
        Ok(())
    }

    /// Frees a carried allocation in the retired range: the pages between its neighbours still
    /// live there go back (in stream order, without a wait), and the whole range's once it held
    /// the last ([`Planned::empty_retired`]).
    pub(super) fn free_retired(&mut self, source: &mut dyn Source, carried: CarriedAllocation) -> Result<()> {
        let Some(retired) = self.retired else {
            debug_assert!(false, "a carried allocation in a retired range with none");
            return Ok(());
        };
        let offset = carried.ptr - retired.base;
        let live =
            self.carried.iter().filter(|c| c.place == CarriedIn::Retired).map(|c| (c.ptr - retired.base, c.size));
        let (mut below, mut above, mut any) = (0u64, retired.size, false);
        for (at, len) in live {
            any = true;
            if at + len <= offset {
                below = below.max(at + len);
            } else if at >= offset + carried.size {
                above = above.min(at);
            }
        }
        if !any {
            return self.empty_retired(source);
        }
        let given = source.punch_range(retired.base, below, above - below)?;
        self.retired_mapped = self.retired_mapped.saturating_sub(given);
        Ok(())
    }

    /// Gives back the retired range's pages (in stream order, without a wait) once nothing
    /// carried lives there. Its addresses stay reserved until the pool goes
    /// ([`Allocator::release_all`](crate::strategy::Allocator::release_all)): giving them back
    /// would wait for the stream.
    pub(super) fn empty_retired(&mut self, source: &mut dyn Source) -> Result<()> {
        let Some(retired) = self.retired.filter(|retired| retired.size > 0) else { return Ok(()) };
        let size = source.resize_range(retired.base, 0)?;
        self.retired = Some(Slab { size, ..retired });
        if size == 0 {
            self.retired_mapped = 0;
        }
        Ok(())
    }

    /// Moves the plans to a new range at a reset ([`Planned::replan_carried`]): the growable
    /// slab keeps only what the scope carries out, as the retired range, whose other pages go
    /// back now (in stream order, without a wait); the next scope maps a new range as its
    /// plan's cursor reaches it, while what it frees of the carried memory leaves the retired
    /// range ([`Planned::free_retired`]).
    pub(super) fn retire_slab(&mut self, source: &mut dyn Source) -> Result<()> {
        let Some(slab) = self.slab.filter(|slab| slab.growable && self.retired_is_empty()) else { return Ok(()) };
        // A range retired before, nothing living there, gives its pages back and keeps its
        // addresses until the pool goes.
        self.empty_retired(source)?;
        if let Some(spent) = self.retired.take() {
            debug_assert!(spent.size == 0, "a retired range set aside with {} bytes mapped", spent.size);
            self.spent.push(spent);
            self.retired_mapped = 0;
        }
        let mut live: Vec<(u64, u64)> = self.carried_in_slab(slab).collect();
        live.sort_unstable();
        for carried in &mut self.carried {
            if carried.place == CarriedIn::Slab {
                carried.place = CarriedIn::Retired;
            }
        }
        self.slab = None;
        self.online = None;
        let top = live.iter().map(|&(at, len)| at + len).max().unwrap_or(0);
        // Pages punched in the scope stay holes.
        self.clip_holes(top);
        let holes = self.unmapped;
        self.holes.clear();
        self.unmapped = 0;
        self.freed_unpunched = 0;
        self.retired = Some(slab);
        self.retired_mapped = slab.size.saturating_sub(holes);
        let size = source.resize_range(slab.base, top)?;
        self.retired = Some(Slab { size, ..slab });
        self.retired_mapped = size.saturating_sub(holes);
        let mut at = 0;
        for (offset, len) in live {
            if offset > at {
                let given = source.punch_range(slab.base, at, offset - at)?;
                self.retired_mapped = self.retired_mapped.saturating_sub(given);
            }
            at = at.max(offset + len);
        }
        Ok(())
    }

    /// Moves to a new range at the first allocation of the scope after a plan that moves was
    /// made ([`Planned::carried_layout`]), where the scope follows that plan: what the scope
    /// before carried out stays in the old range until freed ([`Planned::retire_slab`]). A scope
    /// of another shape would be served best fit in the new range for nothing (a length that
    /// varies from step to step); there the plan pinned where the carried memory lies takes the
    /// moved plan's place, and nothing moves.
    #[cold]
    pub(super) fn move_or_stay(&mut self, source: &mut dyn Source) -> Result<()> {
        let Some(unmoved) = self.unmoved.take() else { return Ok(()) };
        let follows = self.plan.is_some_and(|index| self.plans[index].key == unmoved.key);
        let movable = self.slab.is_some_and(|slab| slab.growable) && self.retired_is_empty();
        if follows && movable {
            // Only carried memory is late at the scope's start, and it is in the old range now.
            self.late.clear();
            self.counters.moves += 1;
            return self.retire_slab(source);
        }
        self.keep_plan(unmoved);
        Ok(())
    }

    /// Bytes of the pages the carried allocations in the slab touch beyond their own: what a
    /// retired range holds more than they.
    pub(super) fn carried_page_slack(&self) -> u64 {
        let Some(slab) = self.slab else { return 0 };
        let mut pages: Vec<u64> = Vec::new();
        let mut bytes = 0;
        for (offset, len) in self.carried_in_slab(slab) {
            bytes += len;
            pages.extend(offset / GRANULE..(offset + len).div_ceil(GRANULE));
        }
        pages.sort_unstable();
        pages.dedup();
        (pages.len() as u64 * GRANULE).saturating_sub(bytes)
    }

    /// Maps the index of an allocation carried into this scope, in the scope before, to the index
    /// of the allocation this scope carries out in its place (`out`): the one of the same rank in
    /// the order each scope made them, where both carry the same sizes in that order. A step
    /// after the first makes allocations the first did not (the optimizer's, once its state
    /// exists), so what it copies at its end for the next (a batch) comes at another index than
    /// the first step's; its gradients, made before, keep theirs. Where the sizes differ, by
    /// index, as the scopes of one sequence make them.
    fn in_place_of(&self, out: &[CarriedAllocation]) -> impl Fn(u32) -> u32 + use<> {
        let mut out: Vec<(u32, u64)> = out.iter().map(|c| (c.index, c.size)).collect();
        out.sort_unstable();
        let alike = out.len() == self.received.len()
            && out.iter().zip(&self.received).all(|(&(_, mine), &(_, theirs))| mine == theirs);
        let map: HashMap<u32, u32> = if alike {
            self.received.iter().zip(&out).map(|(&(before, _), &(now, _))| (before, now)).collect()
        } else {
            HashMap::new()
        };
        move |index| map.get(&index).copied().unwrap_or(index)
    }

    /// [`Planned::replan`] for a scope that carries allocations into the next: each is packed
    /// with its life in the next scope, at one offset ([`plan::pack_around`]), pinned where it
    /// lies in the slab now, since the next scope finds it there. Its life there ends where the
    /// allocation carried into this scope in its place ([`Planned::in_place_of`]) was freed,
    /// or, where none was (the first scope that carries), at a guess: where this scope's own
    /// live bytes first peak (a loop frees the gradients the step before handed it before its
    /// backward pass, where its peak is), or where the allocation is made again if that is
    /// sooner; but right after the scope's own copies where it began by copying what it carries
    /// out (a batch copied before `zero_grad()` at the top of the loop). A carried allocation
    /// freed later than planned finds the plan's entries laid over it refused (the late list),
    /// and that scope deviates and is planned again from what it saw.
    ///
    /// An allocation the next scope makes again before it frees the one carried in (a batch
    /// copied to the device at a step's start and bound to the name the step before's was: the
    /// new one is made first), or, in a first plan, one made before the scope freed anything,
    /// has two places, each held the whole scope, and its scopes alternate between them (the
    /// plan's `alternates`); the second is pinned where the allocation lies now, which the next
    /// scope finds carried in. A guessed one makes the plan `guessed`.
    pub(super) fn replan_carried(&mut self, mut blocks: Vec<Block>, key: PlanKey) {
        let entries = blocks.len();
        let base = self.slab.map_or(0, |slab| slab.base);
        let out: Vec<CarriedAllocation> = self.carried.iter().filter(|c| c.out).copied().collect();
        let peak_at = plan::peak_position(&blocks);
        // Where each allocation the scope before carried in was freed, by the index of the one
        // this scope carries out in its place.
        let in_place_of = self.in_place_of(&out);
        let freed_at: HashMap<u32, u32> = self
            .events
            .iter()
            .enumerate()
            .filter_map(|(position, event)| match *event {
                Event::Carried(index) => Some((in_place_of(index), position as u32)),
                _ => None,
            })
            .collect();
        // A scope that frees nothing of its own (a phase of gradients alone) guesses none.
        let first_free = self.events.iter().position(|event| matches!(event, Event::Free(_))).map_or(0, |at| at as u32);
        let mut guessed = false;
        // A first plan whose scope copied what it carries out before freeing anything (a batch at
        // the step's start) guesses that the next scope frees the rest of what it receives right
        // after its own copies, as a loop that copies its batch and then calls `zero_grad()`
        // does; else at its own peak, as one that calls it between the passes does.
        let copies_end = if freed_at.is_empty() {
            out.iter()
                .map(|carried| blocks[carried.index as usize].start)
                .filter(|&start| start < first_free)
                .max()
                .map_or(0, |start| start + 1)
        } else {
            0
        };
        // The same sequence as the carrying plan of its key whose scope received alike, sizes
        // aside (routed tokens, a ragged batch): each entry it does not carry out is sized to the
        // largest size seen in its place, as a plan that carries nothing is (`replan.rs`, "Sizes
        // that vary"); what it carries out stays at its size, pinned where it lies.
        let same = self
            .plans
            .iter()
            .find(|p| p.key == key && p.carries && p.received == self.receiving && same_sequence(p, &blocks));
        // A plan of its key that is another sequence (the step before, recorded before the
        // optimizer's state existed, or with experts that routed no tokens).
        let other_sequence = self.plans.iter().any(|p| p.key == key && !same_sequence(p, &blocks));
        let own_sizes: Vec<u64> = blocks.iter().map(|b| b.size).collect();
        let mut varies = false;
        if let Some(same) = same {
            varies = same.varies || blocks.iter().zip(&same.largest).any(|(block, &size)| block.size != size);
            let mut is_out = vec![false; entries];
            out.iter().for_each(|carried| is_out[carried.index as usize] = true);
            for ((block, &size), out) in blocks.iter_mut().zip(&same.largest).zip(is_out) {
                if !out {
                    block.size = block.size.max(size);
                }
            }
        }
        let largest: Vec<u64> = blocks.iter().map(|b| b.size).collect();
        let mut pairs = Vec::with_capacity(out.len());
        // Entries with two places: (entry, its second place's block, its recorded start).
        let mut alternating: Vec<(usize, usize, u32)> = Vec::new();
        let mut beside = Vec::new();
        for carried in &out {
            let index = carried.index as usize;
            let block = blocks[index];
            let at = (carried.place == CarriedIn::Slab).then(|| carried.ptr - base);
            let freed = freed_at.get(&carried.index).copied();
            if freed.map_or(block.start < first_free, |until| until > block.start) {
                guessed |= freed.is_none();
                let until = freed.unwrap_or(peak_at).clamp(1, Block::NEVER_FREED - 1);
                // Both places held the whole scope (for the packing only): the entry's own, and
                // the second as a pair of blocks, the one carried in up to its free and then
                // what the scope makes there, pinned where the one carried in lies now.
                blocks[index].start = 0;
                blocks.push(Block { size: block.size, start: until, end: Block::NEVER_FREED });
                blocks.push(Block { size: block.size, start: 0, end: until });
                alternating.push((index, blocks.len() - 2, block.start));
                beside.push(plan::Alternate { own: index, second: pairs.len() });
                pairs.push(plan::Carried { block: blocks.len() - 2, next: blocks.len() - 1, at });
                continue;
            }
            let guess = if copies_end > 0 { copies_end } else { peak_at };
            let until = freed.unwrap_or(guess.min(block.start));
            if until == 0 {
                // Freed before anything else in the next scope: no life there to pack.
                continue;
            }
            blocks.push(Block { size: block.size, start: 0, end: until });
            pairs.push(plan::Carried { block: index, next: blocks.len() - 1, at });
        }
        // Under the copy guess, the move is weighed as if the memory lived to the plan's peak
        // (each up to where it is made again): a plan moved for that later free is as valid for
        // the earlier one (module docs, "Memory carried into the next scope").
        let late = (copies_end > 0 && peak_at > copies_end).then(|| {
            let mut late = blocks.clone();
            for pair in pairs.iter().filter(|pair| blocks[pair.next].end == copies_end) {
                late[pair.next].end = copies_end.max(peak_at.min(blocks[pair.block].start));
            }
            late
        });
        let varying = self.varying_layout(&Varying {
            same,
            varies,
            other_sequence,
            blocks: &blocks,
            own_sizes: &own_sizes,
            pairs: &pairs,
            beside: &beside,
            entries,
        });
        let laid_in_order = varying.in_order.is_some();
        if let Some(own) = varying.own {
            blocks = own;
        }
        let ((packing, pairs), unmoved) = match varying.in_order {
            Some(layout) => ((layout, pairs), None),
            None => self.carried_layout(&blocks, pairs, &beside, late.as_deref()),
        };
        let layout =
            CarriedLayout { blocks: &blocks, entries, alternating: &alternating, key: &key, guessed, copies_end };
        let Some(mut plan) = self.carried_plan(&layout, &packing, &pairs) else { return };
        plan.varies = varies;
        plan.largest = largest;
        plan.in_order = laid_in_order;
        if varying.own_peak > 0 {
            plan.own_peak = varying.own_peak;
        }
        if let Some((pinned, pairs)) = unmoved
            && let Some(unmoved) = self.carried_plan(&layout, &pinned, &pairs)
        {
            self.unmoved = Some(unmoved);
        }
        self.counters.replans += 1;
        // A first carrying plan (its scope received nothing) in place of a plan of its key that
        // carries nothing: that plan is kept aside until the next scope's end shows where the
        // memory went ([`Planned::restore_uncarried`]).
        let same = self.plans.iter().position(|p| p.key == plan.key && !p.carries && p.received == plan.received);
        match same.filter(|_| freed_at.is_empty()) {
            Some(same) => {
                let scopes = self.plans[same].scopes;
                self.uncarried = Some(std::mem::replace(&mut self.plans[same], Plan { scopes, ..plan }));
            }
            None => self.keep_plan(plan),
        }
    }

    /// At the end of the scope after one that made a first carrying plan in place of a plan that
    /// carried nothing ([`Planned::replan_carried`]): where this scope, of another key, freed
    /// what that one carried out and carries nothing on itself, the memory went to a scope
    /// unlike it (a training step's gradients, made before an evaluation step that frees them
    /// at its end: a loop that calls `zero_grad()` at its top), and the next scope of that key
    /// is likely to hand nothing on either. The carrying plan holds the memory's range clear of
    /// that scope's own allocations up to a guessed free, for nothing, scope after scope: the
    /// plan it replaced, `uncarried`, takes its place again, where the carrying plan needs more of the range
    /// than this scope held at once. Where it needs no more (an evaluation step larger than the
    /// training steps), the training steps' extra costs the run's peak nothing, and the memory
    /// it keeps apart from their activations keeps out of this scope's way too. `key` is this
    /// scope's key, `received` whether it was carried anything, `carries` whether it carries
    /// anything out.
    pub(super) fn restore_uncarried(&mut self, uncarried: Plan, key: &PlanKey, received: bool, carries: bool) {
        if !received || carries || *key == uncarried.key {
            return;
        }
        // Only where the carrying plan needs more than this scope held: elsewhere the memory lies
        // apart from this scope's room at no cost to the run's peak.
        let costs = |p: &Plan| p.key == uncarried.key && p.carries && p.bytes > self.peak_mapped;
        if let Some(same) = self.plans.iter().position(costs) {
            let scopes = self.plans[same].scopes;
            self.plans[same] = Plan { scopes, ..uncarried };
        }
    }

    /// The plan of a carrying scope laid out by `packing` (of `layout.blocks`: the scope's own,
    /// then the carried memory's lives in the next scope), `pairs` as placed; `None` where the
    /// packing is not valid.
    pub(super) fn carried_plan(
        &self,
        layout: &CarriedLayout,
        packing: &plan::Packing,
        pairs: &[plan::Carried],
    ) -> Option<Plan> {
        let CarriedLayout { blocks, entries, alternating, key, guessed, copies_end } = *layout;
        let paired = pairs.iter().all(|pair| packing.offsets[pair.block] == packing.offsets[pair.next]);
        if !paired || !plan::is_valid(blocks, packing) {
            debug_assert!(false, "the planner made an invalid packing of a carrying scope");
            return None;
        }
        let lower_bound = plan::lower_bound(blocks);
        let alternates =
            alternating.iter().map(|&(entry, second, _)| (entry as u32, packing.offsets[second])).collect();
        let mut blocks = blocks[..entries].to_vec();
        for &(entry, _, start) in alternating {
            blocks[entry].start = start;
        }
        let by_end = freed_by_end(&blocks);
        let sizes: Vec<u64> = blocks.iter().map(|b| b.size).collect();
        Some(Plan {
            key: key.clone(),
            largest: sizes.clone(),
            sizes,
            starts: blocks.iter().map(|b| b.start).collect(),
            ends: blocks.iter().map(|b| b.end).collect(),
            offsets: packing.offsets[..entries].to_vec(),
            by_end,
            bytes: packing.size,
            lower_bound,
            last_used: self.clock,
            scopes: 0,
            varies: false,
            in_order: false,
            own_peak: packing.size,
            new_sequence: false,
            binned: None,
            predicted: false,
            carries: true,
            alternates,
            guessed,
            freed_by: (copies_end > 0).then_some(copies_end),
            received: self.receiving,
        })
    }

    /// Follows a scope served from a plan that guessed the memory carried into it freed by its
    /// `freed_by` ([`Planned::replan_carried`]). Where the scope gets there with some of it still
    /// live, the plan is corrected to a later guess ([`Planned::correct_guess`]); where the scope
    /// frees it before a corrected guess, the rest is packed again from there, where that is
    /// smaller ([`Planned::pack_rest_around`]). Once all of it is freed, nothing is checked.
    pub(super) fn check_guess(&mut self) {
        let Some(index) = self.plan.filter(|_| self.online.is_none()) else {
            self.guess_check = false;
            return;
        };
        let plan = &self.plans[index];
        let (Some(by), Some(&now)) = (plan.freed_by, plan.starts.get(self.cursor)) else {
            self.guess_check = false;
            return;
        };
        let alternate = |entry: u32| plan.alternates.iter().any(|&(e, _)| e == entry);
        let live = self.carried.iter().any(|c| !c.out && c.place == CarriedIn::Slab && !alternate(c.index));
        self.guess_check = match (live, self.pins.is_empty()) {
            (true, _) if now >= by => self.correct_guess(index, now),
            (true, _) => true,
            (false, false) if now < by => {
                self.pack_rest_around(index, now);
                false
            }
            (false, _) => false,
        };
    }

    /// Corrects plan `index`, which guessed the memory carried into its scopes freed by a
    /// position the scope has reached, `past`, with some of it still live. The first plan of a
    /// scope that began by copying what it carries out guesses it freed right after the next
    /// scope's own copies ([`Planned::replan_carried`]), as `zero_grad()` at the top of a loop
    /// frees the gradients; a loop that calls `zero_grad()` between the passes frees them later,
    /// and served on, the plan would put the forward pass over them, the scope would leave it
    /// and be served best fit, and every later plan would be pinned where best fit left the
    /// gradients. Instead the rest of the scope is packed again under the next guess past
    /// `past`: the memory freed where the plan's own live bytes peak (the forward pass's end),
    /// else before the first of it is made again (the backward pass's first gradient, the last
    /// guess that keeps the scope on its plan). What the scope makes again of it (the entry of
    /// each index, carried out in turn, of its size) is pinned where the memory of its index
    /// lies, with that life in the next scope, as the steady plan will have it; the rest keeps
    /// its offsets where they are clear ([`Planned::pack_rest_around`]). Nothing changes where
    /// the rest of the scope has two places, or nothing carried in is made again.
    #[cold]
    pub(super) fn correct_guess(&mut self, index: usize, past: u32) -> bool {
        let Some(slab) = self.slab else { return false };
        let plan = &self.plans[index];
        let count = plan.sizes.len();
        if self.cursor >= count
            || (self.cursor..count).any(|entry| plan.alternates.iter().any(|&(e, _)| e as usize == entry))
        {
            return false;
        }
        if self.pins.is_empty() {
            self.pins = self
                .carried
                .iter()
                .filter(|c| !c.out && c.place == CarriedIn::Slab)
                .filter(|c| {
                    let entry = c.index as usize;
                    entry >= self.cursor
                        && entry < count
                        && self.entries[entry] == Entry::Pending
                        && plan.ends[entry] == Block::NEVER_FREED
                        && plan.sizes[entry] == c.size
                })
                .map(|c| (c.index, c.ptr - slab.base))
                .collect();
        }
        let Some(first_again) = self.pins.iter().map(|&(entry, _)| plan.starts[entry as usize]).min() else {
            return false;
        };
        match [plan::peak_position(&plan_blocks(plan)).min(first_again), first_again].into_iter().find(|&at| at > past)
        {
            Some(until) => self.pack_rest_around(index, until),
            None => false,
        }
    }

    /// Packs the rest of plan `index` again, from the scope's cursor, around what lies where it
    /// lies: the scope's live allocations, each at its entry's offset until its planned free;
    /// the memory carried in and still live, until `until`; and the entries of `pins`
    /// still to come, each pinned with its life in the next scope up to `until`
    /// ([`plan::pack_around_placed`]). The plan stays guessed, and is made again from what the
    /// scope saw at its end. Where the scope is not on its plan's entries alone (something late,
    /// a chunk, a bin), or the packing would reach past a slab that cannot grow, nothing changes.
    #[cold]
    pub(super) fn pack_rest_around(&mut self, index: usize, until: u32) -> bool {
        let Some(slab) = self.slab else { return false };
        if self.bin.is_some() || !self.pooled.is_empty() || self.template.is_some() {
            return false;
        }
        let plan = &self.plans[index];
        let count = plan.sizes.len();
        let carried_in: Vec<(u64, u64)> = self.carried_in_slab(slab).collect();
        let on_plan =
            self.slab_live.iter().all(|live| live.entry != FOREIGN && self.entries[live.entry as usize] == Entry::Live);
        if !on_plan || self.late.len() != carried_in.len() || self.cursor >= count {
            return false;
        }
        let mut blocks = Vec::with_capacity(count + carried_in.len());
        let mut block_of = vec![usize::MAX; count];
        for (entry, slot) in block_of.iter_mut().enumerate() {
            if self.entries[entry] != Entry::Done {
                *slot = blocks.len();
                blocks.push(Block { size: plan.sizes[entry], start: plan.starts[entry], end: plan.ends[entry] });
            }
        }
        let mut placed: Vec<(usize, u64)> =
            self.slab_live.iter().map(|live| (block_of[live.entry as usize], live.ptr - slab.base)).collect();
        let mut pairs = Vec::new();
        for &(entry, at) in &self.pins {
            if self.entries[entry as usize] == Entry::Pending && plan.starts[entry as usize] >= until {
                blocks.push(Block { size: plan.sizes[entry as usize], start: 0, end: until });
                pairs.push(plan::Carried { block: block_of[entry as usize], next: blocks.len() - 1, at: Some(at) });
            }
        }
        for (offset, size) in carried_in {
            if !pairs.iter().any(|pair| pair.at == Some(offset)) {
                blocks.push(Block { size, start: 0, end: until });
                placed.push((blocks.len() - 1, offset));
            }
        }
        // Where the plan puts what is to come: kept where still clear.
        let mut previous = vec![None; blocks.len()];
        for entry in (self.cursor..count).filter(|&entry| self.entries[entry] == Entry::Pending) {
            previous[block_of[entry]] = Some(plan.offsets[entry]);
        }
        let packing = plan::pack_around_placed(&blocks, &pairs, &placed, &previous);
        if !plan::is_valid(&blocks, &packing) {
            debug_assert!(false, "the planner made an invalid packing of a scope's rest");
            return false;
        }
        if !slab.growable && packing.size > slab.size {
            return false;
        }
        let plan = &mut self.plans[index];
        for (offset, &block) in plan.offsets.iter_mut().zip(&block_of).skip(self.cursor) {
            if block != usize::MAX {
                *offset = packing.offsets[block];
            }
        }
        plan.bytes = packing.size;
        plan.freed_by = Some(until);
        plan.guessed = true;
        self.counters.replans += 1;
        true
    }

    /// The layout in allocation order of a carrying plan whose sizes or sequence vary, around
    /// the pinned memory, as a plan that carries nothing would be laid out (`replan.rs`; module
    /// docs, "Sizes and sequences that vary in a phase that carries"): where the sizes vary
    /// (`same`, the plan of its sequence), at the scope's own sizes if they vary in shares of a
    /// fixed total, or at the largest after a scope that left the plan part way; and where the
    /// scope left a plan of its key that is another sequence part way, as a new plan is.
    fn varying_layout(&self, varying: &Varying) -> VaryingLayout {
        let Varying { same, varies, other_sequence, blocks, own_sizes, pairs, beside, entries } = *varying;
        let left_part_way = self.online.is_some() && !self.left_at_end;
        let mut layout = VaryingLayout { in_order: None, own: None, own_peak: 0 };
        match same {
            Some(same) if varies => {
                let packed = plan::pack_around(blocks, pairs, beside);
                let mut own = blocks.to_vec();
                for (block, &size) in own.iter_mut().zip(own_sizes) {
                    block.size = size;
                }
                let own_packing = plan::pack_around(&own, pairs, beside);
                layout.own_peak = same.own_peak.max(own_packing.size);
                let shares = in_shares(own_packing.size, layout.own_peak, packed.size)
                    .then(|| plan::best_fit_in_order_around(&own, pairs))
                    .filter(|in_order| in_order.size < packed.size);
                if shares.is_some() {
                    layout.in_order = shares;
                    layout.own = Some(own);
                } else if left_part_way && own_packing.size < packed.size {
                    layout.in_order = left_in_order(plan::best_fit_in_order_around(blocks, pairs), packed.size);
                }
            }
            Some(_) => {}
            None => {
                let pinned = !pairs.is_empty() && pairs.iter().all(|pair| pair.at.is_some());
                if left_part_way && other_sequence && pinned && !self.may_move() {
                    // As a new plan that carries nothing is: in order where that costs at most
                    // 1/IN_ORDER_MARGIN more than the packing, else its first sixteenth so.
                    let packed = plan::pack_around(blocks, pairs, beside);
                    let margin = packed.size + packed.size / IN_ORDER_MARGIN;
                    let prefixes = [usize::MAX, (entries / IN_ORDER_PREFIX).max(1)];
                    layout.in_order = prefixes
                        .into_iter()
                        .map(|prefix| plan::pack_after_prefix_around(blocks, pairs, prefix))
                        .find(|in_order| in_order.size <= margin);
                }
            }
        }
        layout
    }

    /// Whether the plan made now may move to a new range ([`Planned::carried_layout`]): the
    /// phase's first plan, made at the end of its recording scope; the plan of a scope that
    /// followed its plan to the end and ran on past it, served online (the step after the
    /// first, whose optimizer makes what the first step's did not: what it carries out after
    /// its plan's end, best fit put); or the plan of a new shape served online from its start
    /// where the phase had one shape before it (steps whose first ones begin with other sizes
    /// than the later ones: a static BERT of 1 GiB live, its steps inferred from the period of
    /// its sizes, went 1,136 → 1,014 MiB), not where shapes vary from step to step (each new
    /// length's plan moving, a variable-length GPT-2 went 1,968 → 2,132 MiB); in a growable slab,
    /// with nothing left in a range retired before.
    pub(super) fn may_move(&self) -> bool {
        let first = self.plans.iter().all(|plan| plan.predicted);
        let ran_past_end = self.left_at_end && self.online.is_some();
        let settled = self.plan.is_none() && self.online.is_some() && self.online_early && self.plans.len() == 1;
        (first || ran_past_end || settled) && self.retired_is_empty() && self.slab.is_some_and(|slab| slab.growable)
    }

    /// Whether no range is retired, or nothing carried lives in the one that is.
    fn retired_is_empty(&self) -> bool {
        self.retired.is_none() || !self.carried.iter().any(|c| c.place == CarriedIn::Retired)
    }

    /// The layout of a carrying scope's plan (`blocks`: the scope's own, then the carried
    /// memory's lives in the next scope) with its pairs as placed, and the pinned layout where
    /// the plan moves. Pinned where the carried memory lies ([`plan::pack_around`]), keeping the
    /// layout of the plan that served the scope where still clear, unless moving pays: where
    /// that memory sits in the way of what the next scope makes before freeing it (best fit put
    /// the gradients of the recording scope into the holes its backward pass left among the
    /// activations, where the next forward pass needs its room), the plan is packed with every
    /// pair above what is made before its free ([`plan::pack_around_above`]) and moves to a new
    /// range at the next scope's first allocation if that scope follows it, else the pinned
    /// layout takes its place ([`Planned::move_or_stay`]). The next scope then holds the carried
    /// memory in the old range until it frees it, beside what its plan has reached in the new
    /// one ([`plan::handover_peak`], plus the pages the carried memory shares), once; the scopes
    /// after it find the memory where the plan puts it. It moves when that scope holds no more
    /// pages than the pinned plan and the moved plan is smaller than it by more than a
    /// [`MOVE_MARGIN`]th, both weighed on `late` where given (the blocks with the carried
    /// memory's lives under a later guess of its free, for which the moved plan is valid too),
    /// and only a plan whose scope's best fit put the carried memory, in a growable slab, moves
    /// ([`Planned::may_move`]). Where no carried memory is in the slab (a recording served from
    /// chunks), every scope that first follows the plan finds it elsewhere: the pairs go above.
    pub(super) fn carried_layout(
        &self,
        blocks: &[Block],
        pairs: Vec<plan::Carried>,
        alternates: &[plan::Alternate],
        late: Option<&[Block]>,
    ) -> (PairedPacking, Option<PairedPacking>) {
        let free: Vec<plan::Carried> = pairs.iter().map(|pair| plan::Carried { at: None, ..*pair }).collect();
        if pairs.iter().all(|pair| pair.at.is_none()) {
            return ((plan::pack_around_above(blocks, &free), free), None);
        }
        let mut pinned = plan::pack_around(blocks, &pairs, alternates);
        // The plan that served the scope, where its entries are the scope's: its layout kept
        // where still clear of the pinned memory. A plan that moved put the pairs above what the
        // next scope makes before freeing them; packed afresh around them where they now lie,
        // the rest need not find that layout again.
        if let Some(served) = self.plan.map(|index| &self.plans[index])
            && served.sizes.len() <= blocks.len()
            && served.sizes.iter().zip(blocks).all(|(&size, block)| size == block.size)
        {
            let mut previous = vec![None; blocks.len()];
            for (previous, &offset) in previous.iter_mut().zip(&served.offsets) {
                *previous = Some(offset);
            }
            let kept = plan::pack_around_placed(blocks, &pairs, &[], &previous);
            if kept.size < pinned.size {
                pinned = kept;
            }
        }
        // Only a plan whose scope's best fit put the carried memory (the phase's first, or one
        // after a scope that ran past its plan's end): others put it where a plan did, or serve a
        // shape that varies from step to step (a batch, a length), whose next scope, another
        // shape, would be served best fit in the new range beside the carried memory, for
        // nothing (a ResNet whose batches vary went from 66 to 78 MiB when a plan of a repeated
        // batch could move too).
        if !self.may_move() {
            return ((pinned, pairs), None);
        }
        let weighed = late.unwrap_or(blocks);
        let pinned_weighed = late.map_or(pinned.size, |late| plan::pack_around(late, &pairs, alternates).size);
        let above = plan::pack_around_above(weighed, &free);
        let handover = plan::handover_peak(weighed, &free, &above) + self.carried_page_slack();
        if handover.next_multiple_of(GRANULE) <= pinned_weighed.next_multiple_of(GRANULE)
            && above.size + above.size / MOVE_MARGIN < pinned_weighed
        {
            ((above, free), Some((pinned, pairs)))
        } else {
            ((pinned, pairs), None)
        }
    }
}
