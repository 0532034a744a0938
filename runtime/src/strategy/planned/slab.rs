//! The slab: taken or grown in place for a plan, its pages given back, the bin lent beside it.
//!
//! # A slab that grows in place
//!
//! Where the source has ranges that grow in place (a device with virtual memory management), the
//! slab is one reserved range whose pages are mapped as plans need them, and everything `replan.rs`
//! says of taking a larger slab after a stream wait becomes mapping more pages at the same
//! addresses, live allocations untouched: a plan maps pages as its cursor reaches them (each entry
//! whose range runs past the mapped end maps up to that entry's end; an entry larger than planned
//! is still checked against every live allocation before it is handed out); a scope served online
//! (a new shape, a deviation) grows the slab at its end by what its free range there lacks, instead
//! of taking fallback chunks, and gives back its freed pages when it must map more or another pool
//! needs memory (below). At the scope's end the pages past what the largest plan of the last eight
//! scopes needs are given back in stream order (no wait for the stream), and the pages the scope
//! punched below that are mapped again, up to what the scope held mapped at once (a scope served
//! online around plans it left early held less than they need; mapping them all at its end made
//! the boundary the run's peak: 1,672 MiB against 1,610 on a mixture of experts): physical
//! pages are the device's, and another phase takes the idle ones whenever it needs memory. A new shape is served best-fit in the empty range rather
//! than recorded in chunks beside it, and so is the first scope: it is recorded best-fit in the
//! range from its start, pages mapped at the end as it needs them.
//!
//! Nothing is mapped *ahead* of a scope: the boundary keeps at most the pages the recent plans
//! need (those the scopes left mapped; a plan that serves scope after scope keeps its pages and
//! maps nothing more; a scope served from its plan first gives back what an earlier, larger scope
//! left mapped past its own plan), and does not grow the range for the next scope, whose
//! shape it does not know; a selected plan maps by its cursor, not whole. And a scope of a new
//! shape does not borrow a larger shape's plan here: it is served best-fit from the range's start,
//! as a new shape is, and records its own. Both matter when the first step is the largest (a
//! longer first batch, or the step before the optimizer state exists, whose state another phase
//! then takes at its end): mapping the largest recent plan at the boundary, or placing the next,
//! smaller step at the larger plan's offsets (its large early buffers sit wherever the packing of
//! the larger step put them, high in the range), kept the first step's extent mapped beside the
//! optimizer state. Measured on the generated variable-length GPT-2 trace whose first step is the
//! largest (scale 0.5, seed 5): 1.147× peak live before, 1.000× after, against torch-expandable's
//! 1.030×. Placement by index into the larger plan saved the waits of a scope served online; in a
//! growable range those waits are bounded as for any new shape, and a plan of the scope's own
//! serves the next scope of its shape.
//!
//! What makes that right is that a scope served online gives back its free pages *wherever they
//! are* ([`Planned::punch_freed`]), not only those at the range's end, as it maps more: when it
//! grows the range, as many whole pages of its other free ranges go back first as it is about to
//! map ([`Source::punch_range`]); when a hand-out lands over such a hole, as many free pages go
//! back, the range's free end first, as the hole's pages mapped again ([`Source::fill_range`]).
//! So the range never maps more while freed pages could stand in for what it maps, however best
//! fit has scattered them; and it does not give back more than it maps, which would map it again
//! at the next hand-out (on torch_gpt's trace, giving back every free page at each growth made
//! 7 GiB of page traffic a step for 5.7 GiB live; as many as mapped, 0.6 GiB, at the same peak). A
//! buffer reallocated larger (a KV cache grown by concatenation) leaves no stranded copy below it,
//! and a range freed below a live allocation goes back as well as one at the end. Recording the
//! first scope in the range without this was measured and not kept (the generated KV-cache trace
//! 1.024× to 1.062× peak live, static BERT at scale 0.05 1.008× to 1.036×, the shared ViT 1.015×
//! to 1.027×); recording it in fallback chunks, as before, leaves the last chunk mostly unused at
//! the scope's peak (up to 256 MiB: the generated ResNet trace at scale 1, 1.043× against
//! torch-expandable's 1.012×). With both, that ResNet trace reaches 1.003×, the generated
//! curriculum at scale 1 1.002× (1.043× before), and no trace measured reserves more at 80 GiB;
//! the recorded KV-cache trace needs one 2 MiB page more on its smallest device (a 15 KiB
//! allocation of its recording keeps an otherwise free page mapped, where the chunks packed small
//! requests together).
//!
//! Freed pages stay mapped until then. A free gives nothing back: the pages wait for the scope's
//! next growth, for another pool on the device that is about to take memory (the source asks the
//! pools holding freed pages to give back as much first, the free end before pages inside:
//! [`FreedPages`](crate::device_core::FreedPages)), for the scope's end, or for memory pressure.
//! Between scopes an idle slab's pages are held the same way, given back from the top. Giving
//! pages back at every free, as this strategy first did (the free end once it was an eighth of
//! the range, the rest at every 256th of the range freed), gave the same peaks on the 192 replays
//! of the evaluation, and on a GPU cost what the simulated device does not: on
//! an H200 a page took some 50 µs to map and unmap again, an allocation and free of 4 KiB in a
//! scope served online took 56 µs (1.7 ms for 64 MiB, against 3 µs for the other strategies),
//! and PyTorch's training step under steppool ran three times slower
//! (`benches/results/2026-11-27-h200-calibration.md`). No give-back waits for the stream: the
//! source unmaps the pages once an event recorded after their last use has completed
//! ([`crate::source`]).
//!
//! A scope served online from an empty slab (a first scope, a new shape) takes the free range at
//! the slab's end last: best fit over the other free ranges, the end only when none holds the
//! request ([`FreeRanges::take`](super::free_ranges::FreeRanges::take)), as an allocator keeps its
//! top chunk for last. The end is where the range grows and gives pages back; best fit alone found
//! it the smallest range that holds a small request whenever a growth's page rounding left a sliver
//! there, so temporaries settled above every free range, kept the top pages mapped, and the next
//! large request grew the range past them, as allocators that keep the end of their heap for last
//! (the *wilderness*) avoid. On the recorded KV-cache generation traces, where every request is a
//! new shape, that had held 2 to 7 % of peak live more: bf16 seed 1 1.106× → 1.032× (its smallest
//! device 90 → 84 MiB, `default-pool`'s), fp32 seed 4 1.053× → 1.029×, 1.4 GiB live 1.006× →
//! 1.003×; evaluation passes gain too (train/eval in bf16 1.014× → 1.009×). Of 192 replays, 32
//! reserve less and 8 one 2 MiB page more (four sequence-length curricula, e.g. 1.012× → 1.019× at
//! 308 MiB; a variable-length GPT-2 at 948 MiB, 1.002× → 1.004×; a variable-batch ResNet at 37 MiB,
//! 1.077× → 1.131×; each with and without its sidecar where it has one), none of them missing a
//! target for it (`benches/results/2026-11-27-end-last-simulated.md`). A scope that leaves a plan
//! goes on with plain best fit: its plan was laid out as best fit would place it
//! ([`best_fit_in_order`](plan::best_fit_in_order)), and the MoE under Adafactor, whose scopes
//! leave their plans, held 1.070× instead of 1.049× with the end taken last there too. Two other
//! placements were measured for these scopes and not kept: first fit (the lowest free range that
//! holds the request) for the whole of such a scope gains as much on generation but loses on the
//! variable-batch ResNet (1.060× → 1.106×) and the shared T5 (1.024× → 1.029×); taking the end last
//! only while it is under a page, or only for requests under a page, keeps part of the gain and all
//! of the losses.
//!
//! # A bin lent by the long-lived allocations' pool
//!
//! Persistent allocations and the step's plan live in two ranges, and each pays for the unused
//! end of its last page: on a run of tens of MiB, where the two ends are a granule together more
//! often than not, that granule decides whether a plan reserves less than one pool. So between
//! steps the runtime lends the planned pool the unused end of the last page a persistent pool of
//! the same stream touches ([`Allocator::lend_tail`](crate::strategy::Allocator::lend_tail),
//! brokered in `inner.rs`): a *bin*, from a few KiB to a page, already mapped and paid for. A plan
//! then serves the entries that reach past its last granule boundaries from the bin
//! ([`plan::into_bin`]: those entries move there whole, or, where one across the boundary is
//! larger than the bin, small entries alive at the moments that need more go there and the rest is
//! packed again under the boundary), and its slab maps a page less; a plan laid out in allocation
//! order keeps its offsets and only moves its top entries, and one laid out so only because its
//! sequence was new is packed instead where the packing with the bin needs fewer pages. A scope
//! served online takes a request in the bin when the bin's smallest free range that holds it is no
//! larger than the slab's (the free range at the slab's end, which costs pages, taken last as
//! before). Only slabs that grow in place take bins: their pages are what a bin saves.
//!
//! The loan is a hand-out of the lender's, so nothing of its own goes there while it lasts; at
//! each step's start it comes back and the end as it is then is lent again — the same one while
//! nothing was allocated or freed around it, another once the persistent pool grew past it or
//! freed what lay below it (a loan left at the top of freed memory kept a 5.6 GiB run's
//! persistent range from shrinking under memory pressure: its smallest device grew by 66 MiB
//! until the loan moved). The planned pool holds its lender alive and gives the loan back when
//! it goes. Plans saved or lent to a captured step keep their own offsets: a bin is never part of
//! a plan file or a graph, and a pool whose slab is lent gives its bin back.
//!
//! On 192 replays of recorded and generated traces (`benches/results/2026-11-27-bin-simulated.md`)
//! 52 reserve less with bins (a page, at times two) and 8 a page more (the online placement of
//! four generation and variable-length runs, each with and without its sidecar); misses of the
//! replay targets 15 → 12. On 27 generated runs of 3 to 80 MiB live, misses 16 → 9, each of the
//! nine a tie with a baseline already at the page floor but one.
//!
//! # When the device refuses memory
//!
//! A refusal (pages for a plan, the growth of a scope served online, a fallback chunk) fails the
//! allocation with out-of-memory, and the runtime's recovery asks every pool of the device, this
//! one included, to give back what its live allocations do not need
//! ([`Allocator::release_unused`](crate::strategy::Allocator::release_unused)), waits for the
//! device, trims, and retries, as PyTorch's allocator releases its cached blocks and retries. Here
//! that is: the empty fallback chunks; the whole slab when nothing lives in it; and otherwise the
//! slab's pages no live allocation touches (a scope served online has given back most of its free
//! pages already, as it ran). A scope served from its plan unmaps the pages past its highest live
//! allocation, which its cursor maps again as it reaches them (each entry past the mapped end grows
//! the slab to that entry's end). A scope served online unmaps the free range at the slab's end and
//! punches out the pages of every free range inside ([`Source::punch_range`]): its best-fit
//! placement goes on over the same addresses, and a range handed out over such a hole maps its
//! pages again first ([`Source::fill_range`]), or, refused, goes back to the free ranges while the
//! scope goes on from the fallback chunks. The retry then finds the device's memory where idle
//! caches held it, and grows the slab at its end by what the request lacks. An allocation fails
//! only when the live allocations, their placement and the granule tails leave no room. Holes never
//! outlive their scope: at its end, the pages from the lowest hole up go back (nothing lives in the
//! slab then), and the next scope maps again what its plan's cursor, or best fit, reaches.
//!
//! # Giving back what a scope outside the plan took
//!
//! The fallback chunks go back to the pool at the scope's end, and the stream is synchronized so
//! that the trim returns them to the device before the slab for the new plan is taken: a
//! recording step's memory never sits idle beside the slab that replaces it. Within the scope, a
//! chunk goes back as soon as nothing in it is handed out, and after every eighth of what the
//! scope holds has gone back so, the stream is waited for and the pool trimmed: in a first step
//! the gradients and optimizer state (another phase) are taken as the activations are freed, and
//! take the memory the activations' chunks held instead of adding to it. Only a scope the slab
//! did not serve in full (a recording, a new shape, a deviation) pays these waits.

use steppool_sys::CUdeviceptr;
use steppool_trace::packing::{self as plan};

use super::replan::plan_blocks;
use super::{Plan, Planned};
use crate::error::{Error, Result};
use crate::source::Source;
use crate::strategy::chunks::GRANULE;

/// How many scopes a plan keeps a pool slab at its size after it last served: the slab follows
/// the plan of the scope that just ended, and grows again (after a stream wait) when a larger
/// plan serves.
pub(super) const RECENT_SCOPES: u64 = 1;

/// The same for a slab that grows in place: its pages stay mapped for the largest plan of the last
/// eight scopes, so shapes that vary from step to step (sequence lengths, batches) map pages only
/// when a scope is larger than those before, not at every step. They cost nothing meanwhile: idle
/// pages go back first whenever another pool on the device takes memory
/// ([`FreedPages`](crate::device_core::FreedPages)). With one scope, a variable-length step
/// mapped and unmapped most of its pages at every boundary on the simulated device, which on an
/// H200 cost some 50 µs a page; with eight, the 192 replays of the evaluation reserve the same.
pub(super) const RECENT_SCOPES_IN_RANGE: u64 = 8;

/// The largest fallback chunk: a scope far larger than its slab takes several.
pub(super) const MAX_FALLBACK_CHUNK: u64 = 256 << 20;

#[derive(Clone, Copy, Debug)]
pub(super) struct Slab {
    pub(super) base: CUdeviceptr,
    /// Bytes usable from `base`: the pool allocation, or what is mapped of a growable range.
    pub(super) size: u64,
    /// A range that grows in place ([`Source::reserve_range`]): pages are mapped at its end as
    /// plans and scopes outgrow it, and unmapped when they no longer need them.
    pub(super) growable: bool,
}

impl Planned {
    /// The slab a plan needs: less than its packing where the bin holds its top entries.
    pub(super) fn slab_bytes(&self, plan: &Plan) -> u64 {
        match (&plan.binned, self.bin) {
            (Some(binned), Some(_)) => binned.slab_bytes,
            _ => plan.bytes,
        }
    }

    /// `plan` with its layout in the bin held ([`Planned::bin_layout`]); a plan laid out in
    /// allocation order only because its sequence is new is packed instead, with its layout in
    /// the bin, where that needs fewer granules: the rule that chose the order (a layout within
    /// 1/128 of the packing) counts the slab's granules once a bin is held.
    pub(super) fn fit_bin(&self, mut plan: Plan) -> Plan {
        plan.binned = self.bin_layout(&plan);
        let Some(bin) = self.bin.filter(|_| plan.binned.is_none() && plan.in_order && plan.new_sequence) else {
            return plan;
        };
        if self.slab.is_none_or(|slab| !slab.growable) {
            return plan;
        }
        let blocks = plan_blocks(&plan);
        let packed = plan::pack(&blocks);
        if let Some(layout) = plan::into_bin(&blocks, &packed, GRANULE, bin.len, false)
            && layout.slab_bytes.div_ceil(GRANULE) < plan.bytes.div_ceil(GRANULE)
        {
            plan.offsets = packed.offsets;
            plan.bytes = packed.size;
            plan.in_order = false;
            plan.new_sequence = false;
            plan.binned = Some(layout);
        }
        plan
    }

    /// The layout of a plan's top entries in the bin held, if that ends its slab a granule
    /// lower (see [`plan::into_bin`]). A plan laid out in allocation order keeps the offsets of
    /// the entries that stay: a scope that leaves it part way finds what lives in the slab where
    /// best fit would have put it.
    pub(super) fn bin_layout(&self, plan: &Plan) -> Option<plan::BinLayout> {
        let bin = self.bin?;
        if self.slab.is_none_or(|slab| !slab.growable) {
            return None;
        }
        let blocks = plan_blocks(plan);
        let packing = plan::Packing { offsets: plan.offsets.clone(), size: plan.bytes };
        plan::into_bin(&blocks, &packing, GRANULE, bin.len, plan.in_order)
    }

    /// What the slab should hold at a scope's end: the largest plan that served or was recorded
    /// in the last [`RECENT_SCOPES`] scopes ([`RECENT_SCOPES_IN_RANGE`] for a growable slab). A
    /// plan that has not served for longer (the first step's, before the optimizer state existed;
    /// a shape that stopped coming) no longer keeps the slab at its size.
    pub(super) fn desired_slab(&self) -> u64 {
        let recent = if self.slab.is_some_and(|slab| slab.growable) { RECENT_SCOPES_IN_RANGE } else { RECENT_SCOPES };
        self.plans
            .iter()
            .filter(|plan| self.clock - plan.last_used < recent)
            .map(|plan| self.slab_bytes(plan))
            .max()
            .unwrap_or(0)
    }

    /// Whether the slab is a growable range, reserving one (nothing mapped yet) when there is no
    /// slab and the source has ranges; false where slabs are pool allocations.
    pub(super) fn growable_slab(&mut self, source: &mut dyn Source) -> Result<bool> {
        match self.slab {
            Some(slab) => Ok(slab.growable),
            None if self.no_ranges || self.lent.is_some() => Ok(false),
            None => match source.reserve_range()? {
                Some((base, _)) => {
                    self.slab = Some(Slab { base, size: 0, growable: true });
                    Ok(true)
                }
                None => {
                    self.no_ranges = true;
                    Ok(false)
                }
            },
        }
    }

    /// Maps pages at the end of the growable slab until it holds `bytes`; what is added joins
    /// the free ranges of a scope served online. False (and the scope goes on from the fallback
    /// chunks) when the device refuses the memory.
    pub(super) fn grow_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<bool> {
        let Some(slab) = self.slab.filter(|slab| slab.growable && slab.size < bytes) else { return Ok(true) };
        match source.resize_range(slab.base, bytes) {
            Ok(size) => {
                self.slab = Some(Slab { size, ..slab });
                self.note_mapped();
                if let Some(online) = &mut self.online
                    && size > slab.size
                {
                    online.give(slab.size, size - slab.size);
                }
                Ok(true)
            }
            Err(Error::Driver(error)) if error.is_out_of_memory() => {
                self.slab_refused = true;
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// Notes the slab's mapped bytes in the scope's peak of them.
    pub(super) fn note_mapped(&mut self) {
        if let Some(slab) = self.slab.filter(|slab| slab.growable) {
            self.peak_mapped = self.peak_mapped.max(slab.size.saturating_sub(self.unmapped));
        }
    }

    /// Tells the source whether this pool keeps pages of freed memory mapped.
    pub(super) fn hold_freed(&mut self, source: &mut dyn Source, holding: bool) {
        if self.holding_freed != holding {
            self.holding_freed = holding;
            source.hold_freed(holding);
        }
    }

    /// Unmaps the growable slab's pages past `bytes` (rounded up to a page), waiting for the
    /// stream first; nothing may live there.
    pub(super) fn shrink_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<()> {
        let bytes = bytes.max(self.carried_top());
        let Some(slab) = self.slab.filter(|slab| slab.growable && slab.size > bytes) else { return Ok(()) };
        let size = source.resize_range(slab.base, bytes)?;
        self.slab = Some(Slab { size, ..slab });
        // Holes left under memory carried across the boundary went with the pages past the end.
        self.clip_holes(size);
        Ok(())
    }

    /// Maps again the pages given back ([`Planned::give_back_free_pages`]) under `size` bytes at
    /// `offset`, just taken from the free ranges of a scope served online. When the device
    /// refuses them the range goes back to the free ranges and the scope goes on elsewhere.
    pub(super) fn fill_holes(&mut self, source: &mut dyn Source, offset: u64, size: u64) -> Result<Option<u64>> {
        let touches = |&(at, len): &(u64, u64)| at < offset + size && offset < at + len;
        if !self.holes.iter().any(touches) {
            return Ok(Some(offset));
        }
        // Pages are mapped here: as many of the other free ranges' go back first, the free
        // end's first.
        if self.freed_unpunched > 0 {
            let holes: u64 = self
                .holes
                .iter()
                .map(|&(hole, len)| (hole + len).min(offset + size).saturating_sub(hole.max(offset)))
                .sum();
            let given = self.give_back_free_pages(source, holes.next_multiple_of(GRANULE))?;
            self.forget_freed(source, given);
        }
        let slab = self.slab.expect("holes are in a slab");
        match source.fill_range(slab.base, offset, size) {
            Ok(bytes) => {
                self.unmapped = self.unmapped.saturating_sub(bytes);
                self.unhole(offset, size);
                self.note_mapped();
                Ok(Some(offset))
            }
            Err(Error::Driver(error)) if error.is_out_of_memory() => {
                self.online.as_mut().expect("an online scope").give(offset, size);
                self.slab_refused = true;
                Ok(None)
            }
            Err(error) => Err(error),
        }
    }

    /// Gives back the slab's pages that no live allocation of the scope needs, up to `limit`
    /// bytes (in whole pages; `u64::MAX` for all, as memory pressure asks). Served online, the
    /// free end first by unmapping it, then free stretches inside as holes that a later hand-out
    /// there maps again; served from its plan, or between scopes, the pages past the highest live
    /// allocation, from the top, which the plan maps again as its cursor reaches them. Returns
    /// the bytes given back.
    pub(super) fn give_back_free_pages(&mut self, source: &mut dyn Source, limit: u64) -> Result<u64> {
        let Some(slab) = self.slab.filter(|slab| slab.growable && slab.size > 0) else { return Ok(0) };
        // Whole pages: a request smaller than a page takes one.
        let limit = limit.saturating_add(GRANULE - 1) / GRANULE * GRANULE;
        let mut released = 0;
        if let Some(online) = &mut self.online {
            if let Some((&at, &len)) = online.by_offset.iter().next_back()
                && at + len == slab.size
            {
                // Holes in the free end are given back already: they do not count.
                let punched: u64 = self
                    .holes
                    .iter()
                    .map(|&(hole, hole_len)| (hole + hole_len).min(slab.size).saturating_sub(hole.max(at)))
                    .sum();
                let size =
                    source.resize_range(slab.base, at.max(slab.size.saturating_sub(limit.saturating_add(punched))))?;
                online.remove(at, len);
                if size > at {
                    online.give(at, size - at);
                }
                released += slab.size - size;
                self.slab = Some(Slab { size, ..slab });
            }
            // Holes of earlier calls past the end just given back went with it.
            self.clip_holes(self.slab.map_or(0, |slab| slab.size));
            released += self.punch_inside(source, limit.saturating_sub(released))?;
        } else {
            let top = self
                .slab_live
                .iter()
                .map(|allocation| allocation.ptr - slab.base + allocation.size)
                .chain(self.late.iter().map(|&(offset, len)| offset + len))
                .chain(self.carried_in_slab(slab).map(|(offset, len)| offset + len))
                .max()
                .unwrap_or(0);
            let keep = top.max(slab.size.saturating_sub(limit));
            if keep.next_multiple_of(GRANULE) < slab.size {
                let size = source.resize_range(slab.base, keep)?;
                released += slab.size - size;
                self.slab = Some(Slab { size, ..slab });
            }
        }
        Ok(released)
    }

    /// A scope served online from a growable slab is about to grow it by `bytes`: first it gives
    /// back as many whole pages of its other free ranges, wherever they lie, if it freed anything
    /// since they last went back (the free range at the end, where it grows, keeps its pages). A
    /// hand-out over a hole gives back as many free pages as it maps, the end's first
    /// ([`Planned::fill_holes`]). So the scope maps more only when its freed pages cannot stand
    /// in, while a scope that frees and allocates within what it holds makes no driver call.
    /// None of it waits for the stream: the pages go back in stream order.
    pub(super) fn punch_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<()> {
        if self.freed_unpunched == 0 || !self.slab.is_some_and(|slab| slab.growable) || self.online.is_none() {
            return Ok(());
        }
        let given = self.punch_inside(source, bytes)?;
        self.forget_freed(source, given);
        Ok(())
    }

    /// `given` bytes of the pages freed in the scope went back: once none is left, the pool no
    /// longer holds pages of freed memory.
    pub(super) fn forget_freed(&mut self, source: &mut dyn Source, given: u64) {
        self.freed_unpunched = self.freed_unpunched.saturating_sub(given);
        if self.freed_unpunched == 0 {
            self.hold_freed(source, false);
        }
    }

    /// Gives back up to `limit` bytes (in whole pages) of the free ranges of a scope served
    /// online other than the one at the slab's end: each range's first pages past those given
    /// back already, in address order, as many as are still wanted. Returns the bytes given back.
    pub(super) fn punch_inside(&mut self, source: &mut dyn Source, limit: u64) -> Result<u64> {
        let (Some(slab), Some(online)) = (self.slab.filter(|slab| slab.growable), &self.online) else {
            return Ok(0);
        };
        let free: Vec<(u64, u64)> = online
            .by_offset
            .iter()
            .filter(|&(&at, &len)| len >= GRANULE && at + len < slab.size)
            .map(|(&at, &len)| (at, len))
            .collect();
        let mut released = 0;
        for (at, len) in free {
            if released >= limit {
                break;
            }
            let punched: u64 = self
                .holes
                .iter()
                .map(|&(hole, hole_len)| (hole + hole_len).min(at + len).saturating_sub(hole.max(at)))
                .sum();
            let wanted = (limit - released).saturating_add(punched);
            let first = at.next_multiple_of(GRANULE).saturating_add(wanted).min(at + len) - at;
            let bytes = source.punch_range(slab.base, at, first)?;
            if bytes > 0 {
                self.add_hole(at, first);
                self.unmapped += bytes;
                released += bytes;
            }
        }
        Ok(released)
    }

    /// Files `[at, at + len)` as a hole, merged with the holes it overlaps, so that no byte is
    /// counted twice (holes that only touch stay apart: the page they share may be mapped). A
    /// range punched over several calls (a partial punch takes its first pages, the next call
    /// more) was once filed once per call, and the bytes already punched, summed over the
    /// overlapping entries, grew with each call until one call punched the whole range whatever
    /// it was asked for.
    pub(super) fn add_hole(&mut self, at: u64, len: u64) {
        let (mut low, mut high) = (at, at + len);
        self.holes.retain(|&(hole, hole_len)| {
            let apart = hole + hole_len <= low || high <= hole;
            if !apart {
                low = low.min(hole);
                high = high.max(hole + hole_len);
            }
            apart
        });
        self.holes.push((low, high - low));
    }

    /// The pages touching `[offset, offset + size)` were mapped again ([`Source::fill_range`]):
    /// they are no longer holes. A hole they cut in two leaves its two ends.
    pub(super) fn unhole(&mut self, offset: u64, size: u64) {
        let (low, high) = (offset / GRANULE * GRANULE, (offset + size).next_multiple_of(GRANULE));
        let mut left = Vec::with_capacity(self.holes.len() + 1);
        for &(at, len) in &self.holes {
            if at + len <= low || high <= at {
                left.push((at, len));
                continue;
            }
            if at < low {
                left.push((at, low - at));
            }
            if high < at + len {
                left.push((high, at + len - high));
            }
        }
        self.holes = left;
    }

    /// The slab now ends at `size`: holes past it went with the pages unmapped from its end.
    pub(super) fn clip_holes(&mut self, size: u64) {
        if self.holes.is_empty() {
            return;
        }
        self.holes.retain(|&(at, _)| at < size);
        let mut whole_pages = 0;
        for (at, len) in &mut self.holes {
            *len = (*len).min(size - *at);
            whole_pages += ((*at + *len) / GRANULE).saturating_sub(at.div_ceil(GRANULE)) * GRANULE;
        }
        self.unmapped = self.unmapped.min(whole_pages);
    }

    /// Makes sure a slab of at least `desired` bytes is held, when nothing lives in it.
    pub(super) fn ensure_slab(&mut self, source: &mut dyn Source, desired: u64) -> Result<()> {
        // While the slab is lent, no second one is taken beside it: the scope is served apart.
        if self.slab_refused || desired == 0 || self.lent.is_some() {
            return Ok(());
        }
        // A growable slab grows in place, whatever lives in it.
        if self.growable_slab(source)? {
            if self.slab.is_some_and(|slab| slab.size < desired) {
                self.grow_slab(source, desired)?;
            }
            return Ok(());
        }
        if !self.slab_live.is_empty() || !self.late.is_empty() || self.carried_top() > 0 {
            return Ok(());
        }
        if let Some(slab) = self.slab {
            if slab.size >= desired {
                return Ok(());
            }
            self.slab = None;
            self.online = None;
            source.free(slab.base, slab.size)?;
            // A larger plan replaces the slab: wait for the old one's free, so the trim below
            // gives it back and the new slab takes its place rather than adding to it. Rare:
            // only when a plan larger than the recent ones serves.
            source.synchronize()?;
        }
        // Idle memory goes back first (as far as its frees were seen complete), so the slab can
        // take its place instead of adding to it.
        source.trim_to(0)?;
        match source.alloc(desired) {
            Ok(base) => self.slab = Some(Slab { base, size: desired, growable: false }),
            // The scope goes on from the pool; out-of-memory recovery happens there if needed.
            Err(Error::Driver(error)) if error.is_out_of_memory() => self.slab_refused = true,
            Err(error) => return Err(error),
        }
        Ok(())
    }
}

/// Lending the slab to a captured step (`capture.rs`): the executable holds the strategy's own
/// slab for its life instead of a second one beside it, so a captured run reserves what an eager
/// planned run does.
///
/// While lent, the slab is out of [`Planned::slab`](Planned) and in `lent`: everything that
/// resizes, frees, unmaps or serves from the slab reads `slab`, so none of it can touch the lent
/// one, and [`Planned::ensure_slab`] and [`Planned::growable_slab`] take no other slab meanwhile.
/// A scope of the phase served while it is lent (an eager step between launches) is served
/// apart, from the fallback chunks, which go back at its end: the graph may run between any two
/// of its allocations, and the allocations the graph leaves live after a launch are the step's
/// until it ends, so no range of the lent slab is handed to anyone else. When the slab comes
/// back, scopes are served from it again, in the stream's order after the graph's last launch.
impl Planned {
    /// Lends the slab, holding at least `bytes` (taken or grown first, as a plan would), to a
    /// captured step; its base, or `None` when it cannot be lent: lent already, an allocation of
    /// the scope lives in it, or the device refused the memory.
    pub(super) fn lend_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Option<CUdeviceptr>> {
        if self.lent.is_some() || !self.slab_live.is_empty() || !self.late.is_empty() || self.carried_top() > 0 {
            return Ok(None);
        }
        self.ensure_slab(source, bytes)?;
        let Some(slab) = self.slab.filter(|slab| slab.size >= bytes) else { return Ok(None) };
        self.slab = None;
        self.online = None;
        self.lent = Some(slab);
        Ok(Some(slab.base))
    }

    /// Takes back the slab lent at `base`; false if it is not the one lent.
    pub(super) fn take_back_slab(&mut self, source: &mut dyn Source, base: CUdeviceptr) -> Result<bool> {
        let Some(slab) = self.lent.filter(|slab| slab.base == base) else { return Ok(false) };
        self.lent = None;
        if self.slab.is_none() {
            self.slab = Some(slab);
            return Ok(true);
        }
        // Another slab was taken meanwhile (never, as `ensure_slab` stands): this one goes back.
        if slab.growable { source.free_range(slab.base) } else { source.free(slab.base, slab.size) }.map(|()| true)
    }
}
