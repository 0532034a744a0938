//! The `Planned` strategy: a scope's allocation sequence is recorded, packed offline into one
//! slab, and later scopes with the same signature are served at the planned offsets.
//!
//! Training steps repeat. The first scope (step or micro-step) of a phase pool is served from
//! fallback chunks (best fit, `chunks.rs`) taken from the phase's CUDA pool while its allocations
//! and frees are recorded; at its end the recording is packed ([`plan`](super::plan)), the chunks
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
//! shares of a fixed total (below).
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
//! So a plan the next scope is expected to leave is laid out as best fit in allocation order
//! would lay it out ([`best_fit_in_order`](plan::best_fit_in_order)): every prefix of that layout
//! is what best fit makes of the prefix alone, so wherever the scope leaves the plan, what is live
//! is where best fit from an empty slab would have put it, and the scope is never worse for having
//! been planned up to there; while it follows the plan it is served by index, as any plan. A plan
//! is laid out so when the scope that recorded it left the plan of its key part way (another
//! sequence), and when it is new (no plan of its key yet) and that layout needs at most 1/128 more
//! than the packing: the second step, the first one served from a plan, may already differ from
//! the first. Where the whole layout costs more, a new plan lays out its first sixteenth of
//! allocations so and packs the rest around them ([`plan::pack_after_prefix`]) when that needs at
//! most 1/128 more: a mixture of experts' second step leaves its plan at its first routed
//! expert, a few dozen allocations in, and went on best fit around a packed prefix, a granule
//! above the steps after it and so tied with one pool (91.6 MiB live, 96 MiB); with the prefix in
//! order 94 MiB, and on the 192 replays of the evaluation set the misses go from 10 to 6, none
//! worse (the recorded MoE 1.033× → 1.006×). A scope that left its plan only at the plan's end is planned as a new sequence is:
//! one that followed the whole plan and went on (the step after a first step recorded before the
//! optimizer's steady sequence existed: SGD makes its momentum where later steps allocate), or
//! one that followed it and ended early (that first step, served from saved plans of the steady
//! sequence). On a recorded Llama trace with 4× gradient accumulation and SGD, laying such a
//! scope out in order held 147 MiB of slab for one step where the packing needs 133 MiB, 1.081×
//! peak live over the run against 1.006×, and 1.082× against 1.007× with saved plans. Once a scope it
//! serves keeps its sequence (no deviation), it is packed (greedy), so repeating steps pay the
//! in-order layout for one scope at most. Aligning a scope to its plan by more than position
//! (re-synchronising the cursor on matching sizes after an inserted or missing allocation) was
//! not kept: the allocations the plan lacks must be placed in ranges the plan's later entries
//! need, and those entries then deviate in turn.
//!
//! Where slabs are pool allocations, a scope of a new shape (no plan has its first sizes) borrows
//! the smallest plan whose first sizes are each at least its own (a shorter sequence after a longer
//! one: every slot fits), and records its own plan at its end (in a slab that grows in place it is
//! served best-fit from the range's start instead: see below). When no plan covers it from its
//! first allocation, the empty slab goes back (after a stream wait, so the trim returns it) and the scope is recorded in
//! fallback chunks like a first scope: the holes of a slab packed for another shape fit the new
//! one's buffers badly (an evaluation pass after training steps). When it leaves the plans later,
//! it is served best-fit from the slab's free space, then from the fallback chunks, and recorded.
//!
//! A pool slab follows the plan of the scope that just ended (the borrowing scope's own plan, not the
//! one it borrowed; a growable slab, the largest plan of the last eight scopes, see below): it
//! shrinks at the scope's end when larger than that plan needs by an eighth,
//! and grows, after a stream wait that lets the trim give the old one back, when a larger plan
//! serves again. So a first step run before the optimizer state existed, or a long sequence, does
//! not keep the slab at its size while smaller scopes follow.
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
//! # A slab that grows in place
//!
//! Where the source has ranges that grow in place (a device with virtual memory management), the
//! slab is one reserved range whose pages are mapped as plans need them, and everything above about
//! taking a larger slab after a stream wait becomes mapping more pages at the same addresses, live
//! allocations untouched: a plan maps pages as its cursor reaches them (each entry whose range runs
//! past the mapped end maps up to that entry's end; an entry larger than planned is still checked
//! against every live allocation before it is handed out); a scope served online
//! (a new shape, a deviation) grows the slab at its end by what its free range there lacks, instead
//! of taking fallback chunks, and gives back its freed pages when it must map more or another pool
//! needs memory (below). At the scope's end the pages past what the largest plan of the last eight
//! scopes needs are given back in stream order (no wait for the stream), and the pages the scope
//! punched below that are mapped again: physical pages are the device's, and another phase takes
//! the idle ones whenever it needs memory. A new shape is served best-fit in the empty range rather than
//! recorded in chunks beside it, and so is the first scope: it is recorded best-fit in the range
//! from its start, pages mapped at the end as it needs them.
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
//! A scope served online from an empty slab (a first scope, a new shape) takes the free range
//! at the slab's end last: best fit over the other free ranges, the end only when none holds the
//! request ([`FreeRanges::take`]), as an allocator keeps its top chunk for last. The end is where
//! the range grows and gives pages back; best fit alone found it the smallest range that holds a
//! small request whenever a growth's page rounding left a sliver there, so temporaries settled
//! above every free range, kept the top pages mapped, and the next large request grew the range
//! past them, as allocators that keep the end of their heap for last (the *wilderness*) avoid.
//! On the recorded KV-cache generation traces, where every request is a new shape, that had
//! held 2 to 7 % of peak live more: bf16 seed 1 1.106× → 1.032× (its smallest device 90 → 84
//! MiB, `default-pool`'s), fp32 seed 4 1.053× → 1.029×, 1.4 GiB live 1.006× → 1.003×; evaluation
//! passes gain too (train/eval in bf16 1.014× → 1.009×). Of 192 replays, 32 reserve less and 8
//! one 2 MiB page more (four sequence-length curricula, e.g. 1.012× → 1.019× at 308 MiB; a
//! variable-length GPT-2 at 948 MiB, 1.002× → 1.004×; a variable-batch ResNet at 37 MiB, 1.077×
//! → 1.131×; each with and without its sidecar where it has one), none of them missing a target
//! for it (`benches/results/2026-11-27-end-last-simulated.md`). A scope that leaves a plan goes on with
//! plain best fit: its plan was laid out as best fit would place it
//! ([`best_fit_in_order`](plan::best_fit_in_order)), and the MoE under Adafactor, whose scopes
//! leave their plans, held 1.070× instead of 1.049× with the end taken last there too. Two other
//! placements were measured for these scopes and not kept: first fit (the lowest free range that
//! holds the request) for the whole of such a scope gains as much on generation but loses on the
//! variable-batch ResNet (1.060× → 1.106×) and the shared T5 (1.024× → 1.029×); taking the end
//! last only while it is under a page, or only for requests under a page, keeps part of the
//! gain and all of the losses.
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
//!
//! # A bin lent by the long-lived allocations' pool
//!
//! Persistent allocations and the step's plan live in two ranges, and each pays for the unused
//! end of its last page: on a run of tens of MiB, where the two ends are a granule together more
//! often than not, that granule decides whether a plan reserves less than one pool. So between
//! steps the runtime lends the planned pool the unused end of the last page a persistent pool of
//! the same stream touches ([`Allocator::lend_tail`], brokered in `inner.rs`): a *bin*, from a few
//! KiB to a page, already mapped and paid for. A plan then serves the entries that reach past its
//! last granule boundaries from the bin ([`plan::into_bin`]: those entries move there whole,
//! or, where one across the boundary is larger than the bin, small entries alive at the moments
//! that need more go there and the rest is packed again under the boundary), and its slab maps a
//! page less; a plan laid out in allocation order keeps its offsets and only moves its top
//! entries, and one laid out so only because its sequence was new is packed instead where the
//! packing with the bin needs fewer pages. A scope served online takes a request in the bin
//! when the bin's smallest free range that holds it is no larger than the slab's (the free range
//! at the slab's end, which costs pages, taken last as before). Only slabs that grow in place
//! take bins: their pages are what a bin saves.
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
//! ([`Allocator::release_unused`]), waits for the device, trims, and retries, as PyTorch's
//! allocator releases its cached blocks and retries. Here that is: the empty fallback chunks;
//! the whole slab when nothing lives in it; and otherwise the slab's pages no live allocation
//! touches (a scope served online has given back most of its free pages already, as it ran). A
//! scope served from its plan unmaps the pages past its highest live allocation, which its
//! cursor maps again as it reaches them (each entry past the mapped end grows the slab to that
//! entry's end). A scope served online unmaps
//! the free range at the slab's end and punches out the pages of every free range inside
//! ([`Source::punch_range`]): its best-fit placement goes on over the same addresses, and a range
//! handed out over such a hole maps its pages again first ([`Source::fill_range`]), or, refused,
//! goes back to the free ranges while the scope goes on from the fallback chunks. The retry then
//! finds the device's memory where idle caches held it, and grows the slab at its end by what the
//! request lacks. An allocation fails only when the live allocations, their placement and the
//! granule tails leave no room. Holes never outlive their scope: at its end, the pages from the
//! lowest hole up go back (nothing lives in the slab then), and the next scope maps again what its
//! plan's cursor, or best fit, reaches.
//!
//! # Memory carried into the next scope
//!
//! A phase that carries ([`PhaseSpec::carry`](crate::PhaseSpec::carry)) keeps what a scope
//! leaves live for the next scope, which frees it: the gradients of a loop that calls
//! `zero_grad()` between its forward and backward passes are made in one step's backward pass
//! and set to `None` in the next step's. The pool hands such an allocation over at the boundary
//! ([`Allocator::carry`]): it leaves the scope's records for a list of its own, under a slot with
//! [`CARRIED_SLOT`] set, stays where it is (in the slab, or in a fallback chunk kept for it),
//! and no reset, shrink, hole, loan or bin goes under it. While the next scope runs, its range in
//! the slab is on the late list, so no entry is handed out over it, and its free is recorded in
//! the scope's sequence ([`Event::Carried`]). A scope that carries is planned with what it
//! carries ([`Planned::replan_carried`]): each such allocation at one offset in both its lives,
//! its allocation to the scope's end and, in the next scope, the start to its free
//! ([`plan::pack_around`]), pinned where it lies, so a plan served scope after scope hands the
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
//! scope holds no more pages than the pinned plan would, and only the phase's first plan, made
//! at the end of its recording scope: later scopes put the carried memory where a plan did, or
//! serve shapes that vary from step to step, whose next scope, another shape, would be served
//! best fit in the new range beside the carried memory, for nothing. The old range's addresses
//! stay reserved, nothing mapped, until the pool goes. On eighteen recordings of loops that call
//! `zero_grad()` between their forward and backward passes
//! (`benches/results/2026-11-28-carried-moves-simulated.md`) the static BERT's whole run went
//! from 308 to 288 MiB (steady 280, its peak of live bytes).
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
//! # Why a hand-out never overlaps a live allocation
//!
//! Planned entries are handed out in increasing order, each at most once per scope (the cursor
//! only moves forward). When entry *i* is handed out, every live slab allocation is an entry
//! *j < i* of the same plan or a range on the *late list*. An entry *j* the recording had still
//! alive when *i* was allocated was packed apart from *i* (the packing is checked before it is
//! kept). An entry the recording had freed by then but which is still live — freed late, or never
//! — is moved to the late list as the cursor passes its planned free, and so are the live entries
//! of a plan the scope switched away from; *i* is handed out only if it overlaps nothing on the
//! late list. An entry handed out larger than planned was checked against every live slab
//! allocation and is put on the late list itself. An entry with a second place (memory carried
//! into the next scope, made again there before the one carried in is freed) is handed out at
//! it only where its own offset is taken and the second place overlaps nothing on the late
//! list; the plan packs both places apart from every other entry for the whole scope, and a
//! scope that leaves its plan puts each live entry on the late list where it lies. A plan
//! corrected partway through a scope ([`Planned::correct_guess`]) is packed around every live
//! allocation of the scope where it lies, until its planned free, and the memory carried in
//! stays on the late list until freed, so the same holds. A scope of a
//! new shape, and a scope after a deviation, serves from ranges of the slab that no live
//! allocation holds, and no planned entry is handed out after that. Deviations come from the
//! fallback chunks, allocations of the pool apart from the slab. At the scope's end every slab
//! range and every chunk is reclaimed (leaked buffers too); the boundary has ordered the pool's
//! stream after every stream that used them.
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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, PoisonError};

use steppool_sys::CUdeviceptr;
use steppool_trace::packing::{self as plan, Block};
use steppool_trace::plans::{PlannedBlock, SavedPlan};

use super::chunks::{Chunks, GRANULE, PointerMap};
use super::{Allocator, Bin, Served};
use crate::error::{Error, Result};
use crate::phase::ALIGNMENT;
use crate::phase::PhaseEntry;
use crate::report::{FreeSpace, PlanKey, PlanStats, PlanSummary};
use crate::source::Source;

/// How far ahead a size that does not match the next entry looks for its entry (allocations the
/// scope skipped); the entries jumped over are missing.
const LOOKAHEAD: usize = 16;

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

/// The one plan a scope of a new, larger shape may be predicted from, while the scope, served
/// online, is checked against its sequence ([`Planned::follow_template`]).
#[derive(Debug)]
struct Template {
    /// The plan's index.
    plan: usize,
    /// The scope's first size over the plan's.
    ratio: f64,
    /// Per allocation so far, the power of `ratio` that took the plan's size to the scope's: 0
    /// or 1, `None` where both agree (a size of a few hundred bytes).
    exponents: Vec<Option<i32>>,
    /// The allocations so far served from the bin, not the slab.
    in_bin: Vec<u32>,
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

/// A live allocation in the slab.
#[derive(Clone, Copy, Debug)]
struct SlabAllocation {
    ptr: CUdeviceptr,
    /// Its index among the scope's allocations: the slot handed out with it.
    index: u32,
    /// Its entry in the current plan, or [`FOREIGN`] for an entry of a plan the scope left.
    entry: u32,
    size: u64,
}

const FOREIGN: u32 = u32::MAX;

/// A carrying plan moves to a new range ([`Planned::carried_layout`]) when it is smaller than the
/// plan pinned where the carried memory lies by more than this fraction of its own size: a move
/// costs driver calls and a scope's pages in two ranges.
const MOVE_MARGIN: u64 = 64;

/// The slots of carried allocations ([`Allocator::carry`]) have this bit set: a scope's own
/// slots are its allocations' indices, far below it.
const CARRIED_SLOT: u32 = 1 << 31;

/// An allocation a scope carried into the next ([`Allocator::carry`]), live until freed there.
#[derive(Clone, Copy, Debug)]
struct CarriedAllocation {
    ptr: CUdeviceptr,
    size: u64,
    /// The slot its free passes.
    slot: u32,
    /// Its index among the allocations of the scope that made it.
    index: u32,
    /// Where it lies.
    place: CarriedIn,
    /// Carried out of the scope now ending (else into the current one).
    out: bool,
}

/// Where a carried allocation lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CarriedIn {
    /// The slab.
    Slab,
    /// The range the slab was before a plan moved to a new one ([`Planned::retire_slab`]).
    Retired,
    /// A fallback chunk.
    Chunk,
}

/// The offset in the slab of entry `entry` of plan `index`: the plan's own, or its layout's
/// around the bin held.
#[inline]
fn planned_offset(plans: &[Plan], bin: Option<Bin>, index: usize, entry: usize) -> u64 {
    match (&plans[index].binned, bin) {
        (Some(binned), Some(_)) => binned.offsets[entry],
        _ => plans[index].offsets[entry],
    }
}

/// The blocks freed in their scope, by the position of their free: a plan's `by_end`.
fn freed_by_end(blocks: &[Block]) -> Vec<u32> {
    let mut by_end: Vec<u32> =
        (0..blocks.len() as u32).filter(|&b| blocks[b as usize].end != Block::NEVER_FREED).collect();
    by_end.sort_unstable_by_key(|&b| blocks[b as usize].end);
    by_end
}

/// A carrying scope's packing and its pairs as placed ([`Planned::carried_layout`]).
type PairedPacking = (plan::Packing, Vec<plan::Carried>);

/// What [`Planned::carried_plan`] makes a carrying scope's plan from, besides its packing.
#[derive(Clone, Copy)]
struct CarriedLayout<'a> {
    /// The scope's own blocks, then the carried memory's lives in the next scope.
    blocks: &'a [Block],
    /// How many of `blocks` are the scope's own.
    entries: usize,
    /// Entries with two places: (entry, its second place's block, its recorded start).
    alternating: &'a [(usize, usize, u32)],
    /// The plan's key.
    key: &'a PlanKey,
    /// Whether the plan guesses a free of carried memory its scope did not see.
    guessed: bool,
    /// Where the plan guesses the carried memory freed, if after the next scope's copies.
    copies_end: u32,
}

/// A plan's entries as the packer's blocks.
fn plan_blocks(plan: &Plan) -> Vec<Block> {
    (0..plan.sizes.len()).map(|i| Block { size: plan.sizes[i], start: plan.starts[i], end: plan.ends[i] }).collect()
}

/// Where a plan puts an allocation: at an offset in the slab, or at an address in the bin.
#[derive(Clone, Copy, Debug)]
enum Placed {
    Slab(u64),
    Bin(CUdeviceptr),
}

/// The live allocations in the slab, filed by their index among the scope's allocations, which
/// is the slot handed out with each ([`Served::slot`]): a free finds its record by that index,
/// with no lookup by address, and a bit per index says which are live, for the scans that visit
/// them all (a range checked clear, a scope going online, the free space) at a word per 64
/// allocations. Filing and taking out one is a store and a bit flipped.
#[derive(Debug, Default)]
struct SlabLive {
    /// Per index: the record, meaningful while the index's bit in `live` is set.
    by_index: Vec<SlabAllocation>,
    /// A bit per index, set while the allocation lives in the slab.
    live: Vec<u64>,
    /// How many bits of `live` are set.
    count: usize,
}

impl SlabLive {
    #[inline]
    fn insert(&mut self, allocation: SlabAllocation) {
        let index = allocation.index as usize;
        if self.by_index.len() <= index {
            self.grow(index);
        }
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        debug_assert!(self.live[word] & bit == 0, "allocation {index} filed twice");
        self.by_index[index] = allocation;
        self.live[word] |= bit;
        self.count += 1;
    }

    /// Room for index `index`, with some to spare.
    #[cold]
    fn grow(&mut self, index: usize) {
        let len = (index + 1).next_power_of_two().max(64);
        self.by_index.resize(len, SlabAllocation { ptr: 0, index: 0, entry: FOREIGN, size: 0 });
        self.live.resize(len.div_ceil(64), 0);
    }

    /// Takes out the allocation at `ptr` filed under `slot`, if it is there.
    #[inline]
    fn remove(&mut self, slot: u32, ptr: CUdeviceptr) -> Option<SlabAllocation> {
        let index = slot as usize;
        let (word, bit) = (index / 64, 1u64 << (index % 64));
        let allocation = *self.by_index.get(index)?;
        if self.live[word] & bit == 0 || allocation.ptr != ptr {
            return None;
        }
        self.live[word] &= !bit;
        self.count -= 1;
        Some(allocation)
    }

    /// The indices of the live ones, in order.
    fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.live.iter().enumerate().flat_map(|(word, &bits)| {
            let mut bits = bits;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let bit = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    word * 64 + bit
                })
            })
        })
    }

    fn iter(&self) -> impl Iterator<Item = &SlabAllocation> {
        self.indices().map(|index| &self.by_index[index])
    }

    fn for_each_mut(&mut self, mut visit: impl FnMut(&mut SlabAllocation)) {
        for (word, &bits) in self.live.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                visit(&mut self.by_index[word * 64 + bits.trailing_zeros() as usize]);
                bits &= bits - 1;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn clear(&mut self) {
        self.live.fill(0);
        self.count = 0;
    }
}

/// A new plan is laid out as best fit in allocation order when that needs at most
/// `1 / IN_ORDER_MARGIN` more than its packing: the next scope may leave it early.
const IN_ORDER_MARGIN: u64 = 128;

/// A new plan whose layout in allocation order costs more than 1/[`IN_ORDER_MARGIN`] over its
/// packing lays out its first 1/`IN_ORDER_PREFIX` of allocations so, the rest packed around them.
const IN_ORDER_PREFIX: usize = 16;

/// The largest ratio of first sizes a plan is predicted across ([`Planned::predicted_plan`]).
const MAX_SCALE: f64 = 8.0;

/// The largest ratio of first sizes a scope is predicted across from one plan
/// ([`Planned::template`]): its sizes that do not follow the ratio are predicted to, and a
/// predicted entry more than twice the size asked leaves the plan.
const MAX_TEMPLATE_SCALE: f64 = 2.0;

/// How much larger than twice the size asked a predicted entry may be before the scope is taken
/// for another sequence ([`Planned::predicted_plan`]).
const PREDICTION_SLACK: u64 = 64 << 10;

/// Per entry of two plans of one sequence, the power of the ratio of their first sizes that
/// takes the entry's size in `a` to its size in `b`: 0, 1 or 2, the largest that agrees within
/// the alignment both sizes were rounded to (a size of a few bytes agrees with all three). `None`
/// when an entry agrees with none, or the first sizes are equal.
fn size_exponents(a: &[u64], b: &[u64]) -> Option<Vec<i32>> {
    if a.len() != b.len() || a.first()? == b.first()? {
        return None;
    }
    let ratio = b[0] as f64 / a[0] as f64;
    a.iter().zip(b).map(|(&a, &b)| size_exponent(a, b, ratio)).collect()
}

/// The power of `ratio` that takes size `a` to size `b`: 0, 1 or 2, the largest that agrees
/// within the alignment both were rounded to; `None` when none does.
fn size_exponent(a: u64, b: u64, ratio: f64) -> Option<i32> {
    (0..=2).rev().find(|&power| follows_power(a, b, ratio, power))
}

/// Size `size` times `ratio` to the power `power`, rounded up to the alignment: a predicted size.
fn predicted_size(size: u64, ratio: f64, power: i32) -> u64 {
    ((size as f64 * ratio.powi(power)).ceil() as u64).next_multiple_of(ALIGNMENT)
}

/// Whether size `b` is size `a` times `ratio` to the power `power`, within the alignment both
/// were rounded to.
fn follows_power(a: u64, b: u64, ratio: f64, power: i32) -> bool {
    let scaled = a as f64 * ratio.powi(power);
    (b as f64 - scaled).abs() <= ALIGNMENT as f64 * ratio.powi(power).max(1.0)
}

/// The layout of a plan whose sizes vary, at the sizes of the scope that just ended (`own`,
/// packed in `own_bytes`), when its sizes vary in shares of a fixed total: that scope needed as
/// much as any scope of its sequence (`own_peak`, within 1/[`IN_ORDER_MARGIN`]), yet the largest
/// sizes of all its entries together need more (`largest_bytes`, packed), by more than
/// 1/[`IN_ORDER_MARGIN`]. Then the largest sizes do not come together (routed tokens: each
/// expert's share changes every step, their sum does not), a plan that holds them all holds
/// memory no scope needs, and the plan is laid out as best fit in allocation order at the latest
/// sizes instead, when that needs less: a scope leaves it at its first entry larger than the
/// latest, where little is live, and goes on best fit around a prefix that best fit would have
/// placed the same, ending near what best fit in order of its own sizes needs. `None` where the
/// sizes vary together (a ragged batch: the largest scope needs the largest sizes) or the
/// packing of the largest sizes needs less.
fn in_shares(own: &[Block], own_bytes: u64, own_peak: u64, largest_bytes: u64) -> Option<plan::Packing> {
    let slack = |bytes: u64| bytes + bytes / IN_ORDER_MARGIN;
    if slack(own_bytes) < own_peak || largest_bytes <= slack(own_bytes) {
        return None;
    }
    let in_order = plan::best_fit_in_order(own);
    (in_order.size < largest_bytes).then_some(in_order)
}

/// How many scopes a plan keeps a pool slab at its size after it last served: the slab follows
/// the plan of the scope that just ended, and grows again (after a stream wait) when a larger
/// plan serves.
const RECENT_SCOPES: u64 = 1;

/// The same for a slab that grows in place: its pages stay mapped for the largest plan of the last
/// eight scopes, so shapes that vary from step to step (sequence lengths, batches) map pages only
/// when a scope is larger than those before, not at every step. They cost nothing meanwhile: idle
/// pages go back first whenever another pool on the device takes memory
/// ([`FreedPages`](crate::device_core::FreedPages)). With one scope, a variable-length step
/// mapped and unmapped most of its pages at every boundary on the simulated device, which on an
/// H200 cost some 50 µs a page; with eight, the 192 replays of the evaluation reserve the same.
const RECENT_SCOPES_IN_RANGE: u64 = 8;

/// The largest fallback chunk: a scope far larger than its slab takes several.
const MAX_FALLBACK_CHUNK: u64 = 256 << 20;

/// The free ranges of the slab while a scope without a plan is served from it: best fit, by
/// offset (to merge neighbours) and by size.
#[derive(Debug, Default)]
struct FreeRanges {
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    /// The free range at the end of a growable slab is taken last ([`FreeRanges::take`]): set
    /// for a scope served online from a slab where nothing of its own lives (memory carried into
    /// it aside).
    end_last: bool,
}

impl FreeRanges {
    /// The slab's free ranges around the live ones.
    fn around(slab: u64, mut live: Vec<(u64, u64)>) -> Self {
        live.sort_unstable();
        let mut ranges = Self::default();
        let mut top = 0;
        for (offset, size) in live.into_iter().chain(std::iter::once((slab, 0))) {
            if offset > top {
                ranges.insert(top, offset - top);
            }
            top = top.max(offset + size);
        }
        ranges
    }

    fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
    }

    fn remove(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
    }

    /// The start of the smallest free range that holds `size` (the lowest on ties). In a range
    /// that grows in place, ending at `growable_end`, the free range at its end is taken last,
    /// only when no other holds the request: it is where the range grows and gives pages back,
    /// so an allocation placed there (a small one in the page rounding of the last growth, which
    /// best fit finds smallest) keeps pages mapped above every free one and makes the next large
    /// request grow the range past it.
    fn take(&mut self, size: u64, growable_end: Option<u64>) -> Option<u64> {
        let growable_end = growable_end.filter(|_| self.end_last);
        let end = |&(len, offset): &(u64, u64)| Some(offset + len) == growable_end;
        let inside = self.by_size.range((size, 0)..).copied().find(|range| !end(range));
        let at_end = || {
            let (&offset, &len) = self.by_offset.iter().next_back()?;
            (len >= size && end(&(len, offset))).then_some((len, offset))
        };
        let (len, offset) = inside.or_else(at_end)?;
        self.remove(offset, len);
        if len > size {
            self.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// The start of the lowest free range that holds `size` (first fit).
    fn take_lowest(&mut self, size: u64) -> Option<u64> {
        let (offset, len) = self.by_offset.iter().map(|(&offset, &len)| (offset, len)).find(|&(_, len)| len >= size)?;
        self.remove(offset, len);
        if len > size {
            self.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// Returns a range, merged with its free neighbours.
    fn give(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&below, &below_len)) = self.by_offset.range(..offset).next_back()
            && below + below_len == offset
        {
            self.remove(below, below_len);
            offset = below;
            len += below_len;
        }
        if let Some(&above_len) = self.by_offset.get(&(offset + len)) {
            self.remove(offset + len, above_len);
            len += above_len;
        }
        self.insert(offset, len);
    }
}

#[derive(Clone, Copy, Debug)]
struct Slab {
    base: CUdeviceptr,
    /// Bytes usable from `base`: the pool allocation, or what is mapped of a growable range.
    size: u64,
    /// A range that grows in place ([`Source::reserve_range`]): pages are mapped at its end as
    /// plans and scopes outgrow it, and unmapped when they no longer need them.
    growable: bool,
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
    /// memory is freed. A phase moves once.
    retired: Option<Slab>,
    /// Bytes mapped in the retired range.
    retired_mapped: u64,
    /// The plan just made moves to a new range if the next scope follows it
    /// ([`Planned::replan_carried`]): the plan pinned where the carried memory lies, kept in its
    /// place if the next scope does not ([`Planned::move_or_stay`]).
    unmoved: Option<Plan>,
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
            retired_mapped: 0,
            unmoved: None,
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
                carries: false,
                alternates: Vec::new(),
                guessed: false,
                freed_by: None,
            });
        }
        planned
    }

    /// The plans kept, most recently used first, as a plan file saves them.
    pub(crate) fn saved_plans(&self) -> Vec<SavedPlan> {
        let mut plans: Vec<&Plan> = self.plans.iter().filter(|plan| !plan.predicted).collect();
        plans.sort_by_key(|plan| std::cmp::Reverse(plan.last_used));
        plans
            .into_iter()
            .map(|plan| SavedPlan {
                key: plan.key.clone(),
                bytes: plan.bytes,
                varies: plan.varies,
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

    /// Begins a scope's bookkeeping at its first allocation: reads the user's key.
    fn open_scope(&mut self) {
        self.clock += 1;
        self.fallback.start_scope();
        // What the scope before carried into the slab is live where it lies, which only a plan
        // packed with it keeps clear of (hand-outs are checked against the late list). A first
        // allocation retried after out-of-memory recovery opens the scope again: nothing twice,
        // and nothing once the scope is online, whose free ranges leave carried memory out.
        if let Some(slab) = self.slab.filter(|_| self.online.is_none()) {
            let carried: Vec<(u64, u64)> =
                self.carried_in_slab(slab).filter(|range| !self.late.contains(range)).collect();
            self.late.extend(carried);
        }
        self.user_key = *self.entry.plan_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(key) = self.user_key {
            let found = self.plans.iter().position(|plan| plan.key == PlanKey::User(key));
            self.select(found, 0);
        }
    }

    /// Serves the scope from plan `index` (or none) from allocation `at` on: the allocations so
    /// far are the plan's first `at` entries (their sizes matched), served elsewhere.
    fn select(&mut self, index: Option<usize>, at: usize) {
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

    /// While the signature is still being read (no user key): if the current plan does not
    /// have this size next, switch to the most recently used plan whose first sizes are the
    /// scope's so far; if none has them, the scope is a new shape and has no plan.
    fn follow_signature(&mut self, n: usize) {
        // A predicted plan is the scope's whatever its next sizes: it was made for this scope.
        let current_fits = self
            .plan
            .is_some_and(|p| self.plans[p].predicted || self.plans[p].sizes.get(n) == Some(&self.first_sizes[n]));
        if current_fits || self.online.is_some() {
            return;
        }
        let sizes = &self.first_sizes;
        let exact = self
            .plans
            .iter()
            .enumerate()
            .filter(|(_, plan)| matches!(&plan.key, PlanKey::Sizes(key) if key.len() > n && key[..=n] == sizes[..=n]))
            .max_by_key(|(_, plan)| plan.last_used)
            .map(|(index, _)| index);
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
    fn predicted_plan(&mut self) -> Option<usize> {
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
    fn template(&self) -> Option<Template> {
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
    fn follow_template(&mut self, n: usize, size: u64) {
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
    fn follow_template_free(&mut self, index: u32) {
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
    fn predict_from_template(&mut self, template: Template) {
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

    /// Serves the rest of a scope without a plan from the slab's free ranges.
    fn go_online(&mut self, slab: Slab) {
        // Nothing of the scope's own lives in the slab (what the scope before carried in aside):
        // its end is the range's wilderness, as in a first scope.
        let from_empty = self.slab_live.is_empty()
            && self.late.iter().all(|&late| self.carried_in_slab(slab).any(|carried| carried == late));
        let live = self
            .slab_live
            .iter()
            .map(|allocation| (allocation.ptr - slab.base, allocation.size))
            .chain(self.carried_in_slab(slab))
            .collect();
        self.slab_live.for_each_mut(|allocation| allocation.entry = FOREIGN);
        self.bin_live.for_each_mut(|allocation| allocation.entry = FOREIGN);
        self.late.clear();
        self.online = Some(FreeRanges { end_last: from_empty, ..FreeRanges::around(slab.size, live) });
        self.bin_free = self.bin.map(|bin| {
            FreeRanges::around(bin.len, self.bin_live.iter().map(|live| (live.ptr - bin.ptr, live.size)).collect())
        });
    }

    /// Where the plan puts the next allocation of `size` (aligned), if it may serve it.
    #[inline]
    fn next_planned(&mut self, size: u64) -> Option<Placed> {
        let index = self.plan?;
        let entry = self.cursor;
        let count = self.plans[index].sizes.len();
        // An allocation no larger than its entry is served at the entry's offset: the range is
        // the entry's, whatever part of it the allocation uses.
        if entry < count && self.plans[index].sizes[entry] >= size {
            // A predicted entry much larger than what is asked: the scope is not the sequence the
            // prediction read, and leaves the plan. (Small entries are predicted generously: a
            // size of a few hundred bytes agrees with every power.)
            let planned = self.plans[index].sizes[entry];
            if self.plans[index].predicted && planned > 2 * size + PREDICTION_SLACK {
                self.deviated = true;
                self.counters.deviations += 1;
                return None;
            }
            return self.hand_out(index, entry, size, false);
        }
        self.left_at_end |= !self.deviated && entry >= count;
        self.deviated = true;
        // Larger than its entry (a size that varies from scope to scope: routed tokens, a
        // ragged batch): at the entry's offset when the larger range is clear.
        if entry < count && self.in_bin(index, entry).is_none() {
            self.pass_ends(index, entry);
            if self.grown_range_clear(planned_offset(&self.plans, self.bin, index, entry), size) {
                return self.hand_out(index, entry, size, true);
            }
        }
        // Allocations the scope skipped: the entry further on with this size, if near (not in
        // a plan whose sizes vary: there a later entry of the same size is a coincidence).
        let end = if self.plans[index].varies { entry + 1 } else { count.min(entry + 1 + LOOKAHEAD) };
        let Some(found) = (entry + 1..end).find(|&e| self.plans[index].sizes[e] == size) else {
            if entry < count {
                // The entry, larger than planned, where its range is not clear.
                self.entries[entry] = Entry::Done;
                self.cursor = entry + 1;
            }
            // Otherwise an allocation the plan does not have: the cursor stays.
            self.counters.deviations += 1;
            return None;
        };
        self.entries[entry..found].fill(Entry::Done);
        self.counters.missing += (found - entry) as u64;
        self.hand_out(index, found, size, false)
    }

    /// Moves the entries the recording had freed before entry `entry` was allocated, and that
    /// are still live, to the late list.
    #[inline]
    fn pass_ends(&mut self, index: usize, entry: usize) {
        let plan = &self.plans[index];
        let start = plan.starts[entry];
        while let Some(&passed) = plan.by_end.get(self.passed_ends) {
            if plan.ends[passed as usize] >= start {
                break;
            }
            if self.entries[passed as usize] == Entry::Live {
                self.entries[passed as usize] = Entry::Late;
                // An entry in the bin keeps clear of the slab's; a later one in the bin is
                // checked against every live one there (`hand_out`).
                let in_bin =
                    self.bin.is_some() && plan.binned.as_ref().is_some_and(|b| b.at[passed as usize].is_some());
                if !in_bin {
                    let offset = planned_offset(&self.plans, self.bin, index, passed as usize);
                    self.late.push((offset, self.plans[index].sizes[passed as usize]));
                }
            }
            self.passed_ends += 1;
        }
    }

    /// Whether `size` bytes at `offset`, past the entry's planned range, are in the slab and
    /// miss every live slab allocation: past its planned range the packing promises nothing.
    fn grown_range_clear(&self, offset: u64, size: u64) -> bool {
        let Some(slab) = self.slab else { return false };
        let disjoint = |at: u64, len: u64| at + len <= offset || offset + size <= at;
        offset + size <= slab.size
            && self.late.iter().all(|&(late, len)| disjoint(late, len))
            && self.slab_live.iter().all(|allocation| disjoint(allocation.ptr - slab.base, allocation.size))
    }

    /// Entry `entry` of plan `index` for an allocation of `size`, if its range is clear: `grown`
    /// when the allocation is larger than the entry (the range was checked against every live
    /// allocation, and goes on the late list, so no later entry is handed out over it).
    #[inline]
    fn hand_out(&mut self, index: usize, entry: usize, size: u64, grown: bool) -> Option<Placed> {
        self.cursor = entry + 1;
        self.pass_ends(index, entry);
        if let Some(ptr) = self.in_bin(index, entry) {
            // In the bin: clear of every allocation live there (one kept past its planned free
            // included); a grown entry never comes here (`next_planned`).
            let clear = self.bin_live.iter().all(|live| live.ptr + live.size <= ptr || ptr + size <= live.ptr);
            if !clear {
                self.entries[entry] = Entry::Done;
                self.deviated = true;
                self.counters.deviations += 1;
                return None;
            }
            self.entries[entry] = Entry::Live;
            return Some(Placed::Bin(ptr));
        }
        let fits = |offset: u64| self.slab.is_some_and(|slab| offset + size <= slab.size);
        let mut offset = planned_offset(&self.plans, self.bin, index, entry);
        if !(fits(offset) && self.clear_of_late(offset, size)) {
            // Its second place, if it has one and that is clear (both are the entry's for the
            // whole scope in the plan, so either serves).
            match self.second_place(index, entry, offset, size).filter(|&at| fits(at) && self.clear_of_late(at, size)) {
                Some(at) => offset = at,
                None => {
                    self.entries[entry] = Entry::Done;
                    self.deviated = true;
                    self.counters.deviations += 1;
                    return None;
                }
            }
        }
        if grown {
            self.entries[entry] = Entry::Late;
            self.late.push((offset, size));
        } else {
            self.entries[entry] = Entry::Live;
        }
        Some(Placed::Slab(offset))
    }

    /// The address in the bin of entry `entry` of plan `index`, where the plan has a layout for
    /// the bin held ([`Planned::set_bin`]) and puts the entry there.
    #[inline]
    fn in_bin(&self, index: usize, entry: usize) -> Option<CUdeviceptr> {
        let bin = self.bin?;
        let at = self.plans[index].binned.as_ref()?.at[entry]?;
        Some(bin.ptr + at)
    }

    /// Whether `size` bytes at `offset` miss every range on the late list.
    #[inline]
    fn clear_of_late(&self, offset: u64, size: u64) -> bool {
        self.late.iter().all(|&(late, len)| late + len <= offset || offset + size <= late)
    }

    /// The second place of entry `entry` of plan `index` (`Plan::alternates`), where it has one
    /// and its own, at `offset`, is taken by a range on the late list (the allocation of the
    /// entry carried in from the scope before).
    #[inline]
    fn second_place(&self, index: usize, entry: usize, offset: u64, size: u64) -> Option<u64> {
        let alternates = &self.plans[index].alternates;
        if alternates.is_empty() || self.clear_of_late(offset, size) {
            return None;
        }
        alternates.iter().find(|&&(e, _)| e as usize == entry).map(|&(_, at)| at)
    }

    /// The ranges (offset, length) of the carried allocations in the slab at `slab`.
    fn carried_in_slab(&self, slab: Slab) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.carried.iter().filter(|c| c.place == CarriedIn::Slab).map(move |c| (c.ptr - slab.base, c.size))
    }

    /// Whether the scope's next allocation is made again while the one of its index carried in
    /// from the scope before still lies in the slab (a batch copied to the device before the
    /// step before's is freed): it is likely carried out in turn.
    fn made_again_while_carried(&self) -> bool {
        let index = self.allocations;
        self.carried.iter().any(|c| !c.out && c.index == index && c.place == CarriedIn::Slab)
    }

    /// The end of the highest carried allocation in the slab: what no resize may cut.
    fn carried_top(&self) -> u64 {
        self.slab.map_or(0, |slab| self.carried_in_slab(slab).map(|(offset, len)| offset + len).max().unwrap_or(0))
    }

    /// Frees an allocation carried in from the scope before: its range goes back to the scope
    /// served online, or off the late list; the free's place in the scope is recorded, which is
    /// where the next plan keeps its memory clear until.
    #[cold]
    fn free_carried(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
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
    fn free_retired(&mut self, source: &mut dyn Source, carried: CarriedAllocation) -> Result<()> {
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
    /// ([`Allocator::release_all`]): giving them back would wait for the stream.
    fn empty_retired(&mut self, source: &mut dyn Source) -> Result<()> {
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
    fn retire_slab(&mut self, source: &mut dyn Source) -> Result<()> {
        let Some(slab) = self.slab.filter(|slab| slab.growable && self.retired.is_none()) else { return Ok(()) };
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
    fn move_or_stay(&mut self, source: &mut dyn Source) -> Result<()> {
        let Some(unmoved) = self.unmoved.take() else { return Ok(()) };
        let follows = self.plan.is_some_and(|index| self.plans[index].key == unmoved.key);
        let movable = self.slab.is_some_and(|slab| slab.growable) && self.retired.is_none();
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
    fn carried_page_slack(&self) -> u64 {
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

    /// The slab a plan needs: less than its packing where the bin holds its top entries.
    fn slab_bytes(&self, plan: &Plan) -> u64 {
        match (&plan.binned, self.bin) {
            (Some(binned), Some(_)) => binned.slab_bytes,
            _ => plan.bytes,
        }
    }

    /// `plan` with its layout in the bin held ([`Planned::bin_layout`]); a plan laid out in
    /// allocation order only because its sequence is new is packed instead, with its layout in
    /// the bin, where that needs fewer granules: the rule that chose the order (a layout within
    /// 1/128 of the packing) counts the slab's granules once a bin is held.
    fn fit_bin(&self, mut plan: Plan) -> Plan {
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
    fn bin_layout(&self, plan: &Plan) -> Option<plan::BinLayout> {
        let bin = self.bin?;
        if self.slab.is_none_or(|slab| !slab.growable) {
            return None;
        }
        let blocks = plan_blocks(plan);
        let packing = plan::Packing { offsets: plan.offsets.clone(), size: plan.bytes };
        plan::into_bin(&blocks, &packing, GRANULE, bin.len, plan.in_order)
    }

    /// What the slab should hold at a scope's end: the largest plan that served or was recorded
    /// in the last [`RECENT_SCOPES`] scopes ([`RECENT_SCOPES_IN_RANGE`] for a growable slab). A plan that has not served for longer (the first
    /// step's, before the optimizer state existed; a shape that stopped coming) no longer keeps
    /// the slab at its size.
    fn desired_slab(&self) -> u64 {
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
    fn growable_slab(&mut self, source: &mut dyn Source) -> Result<bool> {
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
    fn grow_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<bool> {
        let Some(slab) = self.slab.filter(|slab| slab.growable && slab.size < bytes) else { return Ok(true) };
        match source.resize_range(slab.base, bytes) {
            Ok(size) => {
                self.slab = Some(Slab { size, ..slab });
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

    /// Tells the source whether this pool keeps pages of freed memory mapped.
    fn hold_freed(&mut self, source: &mut dyn Source, holding: bool) {
        if self.holding_freed != holding {
            self.holding_freed = holding;
            source.hold_freed(holding);
        }
    }

    /// Unmaps the growable slab's pages past `bytes` (rounded up to a page), waiting for the
    /// stream first; nothing may live there.
    fn shrink_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<()> {
        let bytes = bytes.max(self.carried_top());
        let Some(slab) = self.slab.filter(|slab| slab.growable && slab.size > bytes) else { return Ok(()) };
        let size = source.resize_range(slab.base, bytes)?;
        self.slab = Some(Slab { size, ..slab });
        // Holes left under memory carried across the boundary went with the pages past the end.
        self.clip_holes(size);
        Ok(())
    }

    /// Serves `size` online and files it: in the bin when its smallest free range that holds the
    /// request is no larger than the slab's (the free range at a growable slab's end aside: it
    /// costs new pages), else in the slab ([`Planned::take_online`]).
    fn serve_online(&mut self, source: &mut dyn Source, size: u64) -> Result<Option<CUdeviceptr>> {
        let index = self.allocations;
        if let (Some(bin), Some(bin_free), Some(online)) = (self.bin, &self.bin_free, &self.online)
            && let Some(&(len, _)) = bin_free.by_size.range((size, 0)..).next()
        {
            let growable_end = self.slab.filter(|slab| slab.growable).map(|slab| slab.size);
            let slab_best = online.by_size.range((size, 0)..).find(|&&(l, at)| Some(at + l) != growable_end);
            if slab_best.is_none_or(|&(slab_len, _)| len <= slab_len) {
                let at = self.bin_free.as_mut().and_then(|free| free.take(size, None)).expect("a range that holds it");
                let ptr = bin.ptr + at;
                self.bin_live.insert(SlabAllocation { ptr, index, entry: FOREIGN, size });
                if let Some(template) = &mut self.template {
                    template.in_bin.push(index);
                }
                return Ok(Some(ptr));
            }
        }
        let Some(offset) = self.take_online(source, size)? else { return Ok(None) };
        let ptr = self.slab.expect("an online scope has a slab").base + offset;
        self.slab_live.insert(SlabAllocation { ptr, index, entry: FOREIGN, size });
        Ok(Some(ptr))
    }

    /// Serves `size` online from the slab's free ranges, growing a growable slab at its end when
    /// none holds it (by what the free range at its end lacks, as an expandable segment grows).
    fn take_online(&mut self, source: &mut dyn Source, size: u64) -> Result<Option<u64>> {
        let growable_end = self.slab.filter(|slab| slab.growable).map(|slab| slab.size);
        let lowest = self.made_again_while_carried();
        let Some(online) = &mut self.online else { return Ok(None) };
        let taken = if lowest { online.take_lowest(size) } else { online.take(size, growable_end) };
        if let Some(offset) = taken {
            return self.fill_holes(source, offset, size);
        }
        let Some(slab) = self.slab.filter(|slab| slab.growable) else { return Ok(None) };
        if self.slab_refused {
            return Ok(None);
        }
        let online = self.online.as_mut().expect("an online scope");
        let tail =
            online.by_offset.iter().next_back().filter(|&(&at, &len)| at + len == slab.size).map_or(0, |(_, &len)| len);
        // As many freed pages go back as the slab is about to map.
        self.punch_freed(source, (size - tail).next_multiple_of(GRANULE))?;
        if !self.grow_slab(source, slab.size + (size - tail))? {
            return Ok(None);
        }
        let growable_end = self.slab.map(|slab| slab.size);
        match self.online.as_mut().and_then(|online| online.take(size, growable_end)) {
            Some(offset) => self.fill_holes(source, offset, size),
            None => Ok(None),
        }
    }

    /// Maps again the pages given back ([`Planned::give_back_free_pages`]) under `size` bytes at
    /// `offset`, just taken from the free ranges of a scope served online. When the device
    /// refuses them the range goes back to the free ranges and the scope goes on elsewhere.
    fn fill_holes(&mut self, source: &mut dyn Source, offset: u64, size: u64) -> Result<Option<u64>> {
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
    fn give_back_free_pages(&mut self, source: &mut dyn Source, limit: u64) -> Result<u64> {
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
    fn punch_freed(&mut self, source: &mut dyn Source, bytes: u64) -> Result<()> {
        if self.freed_unpunched == 0 || !self.slab.is_some_and(|slab| slab.growable) || self.online.is_none() {
            return Ok(());
        }
        let given = self.punch_inside(source, bytes)?;
        self.forget_freed(source, given);
        Ok(())
    }

    /// `given` bytes of the pages freed in the scope went back: once none is left, the pool no
    /// longer holds pages of freed memory.
    fn forget_freed(&mut self, source: &mut dyn Source, given: u64) {
        self.freed_unpunched = self.freed_unpunched.saturating_sub(given);
        if self.freed_unpunched == 0 {
            self.hold_freed(source, false);
        }
    }

    /// Gives back up to `limit` bytes (in whole pages) of the free ranges of a scope served
    /// online other than the one at the slab's end: each range's first pages past those given
    /// back already, in address order, as many as are still wanted. Returns the bytes given back.
    fn punch_inside(&mut self, source: &mut dyn Source, limit: u64) -> Result<u64> {
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
    fn add_hole(&mut self, at: u64, len: u64) {
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
    fn unhole(&mut self, offset: u64, size: u64) {
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
    fn clip_holes(&mut self, size: u64) {
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
    fn ensure_slab(&mut self, source: &mut dyn Source, desired: u64) -> Result<()> {
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

    /// Serves the scope's next allocation: at its planned offset, else from the pool.
    fn serve(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        if self.unmoved.is_some() && self.allocations == 0 {
            self.move_or_stay(source)?;
        }
        // A plan larger than the slab (one that has not served recently) takes a larger slab of
        // the pool. A growable slab is not mapped for the whole plan here: the entries map it as
        // the cursor reaches them (below), so a scope holds the pages its plan has reached.
        let need = self.plan.map_or(0, |p| self.plans[p].bytes);
        // A scope that starts from its plan on pages an earlier scope left mapped: those past
        // what the plan needs go back first (a bin lent at the boundary may end its slab lower).
        // Not from a predicted plan: a new shape keeps the pages the recent plans need, as one
        // served best-fit does, so that steps of lengths within the recent ones map nothing.
        if self.allocations == 0
            && let (Some(index), Some(slab)) = (self.plan, self.slab.filter(|slab| slab.growable))
            && !self.plans[index].predicted
            && self.slab_live.is_empty()
            && self.late.is_empty()
        {
            let needs = self.slab_bytes(&self.plans[index]);
            if slab.size > needs.next_multiple_of(GRANULE) {
                self.shrink_slab(source, needs)?;
            }
        }
        if need > 0 && self.slab.is_none_or(|slab| slab.size < need) && !self.growable_slab(source)? {
            let desired = need.max(self.desired_slab());
            self.ensure_slab(source, desired)?;
        }
        // Holes left between scopes (pages under memory carried into the scope could not be
        // mapped again at its start): no plan promises a hand-out there is mapped, so the scope
        // is served online, which maps a hole before handing it out.
        if self.online.is_none()
            && !self.holes.is_empty()
            && let Some(slab) = self.slab
        {
            self.deviated |= self.plan.is_some();
            self.go_online(slab);
        }
        // A scope with no plan from its first allocation, nothing mapped (a first scope, or one
        // after the slab went back): recorded best-fit in a growable slab, which maps pages at its
        // end as the scope needs them and gives back its free pages as the scope runs (see
        // `punch_freed`), rather than in fallback chunks.
        if self.plan.is_none()
            && self.online.is_none()
            && self.allocations == 0
            && !self.slab_refused
            && self.slab.is_none_or(|slab| slab.size == 0)
            && self.growable_slab(source)?
            && let Some(slab) = self.slab
        {
            self.go_online(slab);
        }
        if let (None, None, Some(slab)) = (self.plan, &self.online, self.slab.filter(|slab| slab.size > 0)) {
            if self.slab_live.is_empty() && self.late.is_empty() {
                // A new shape from its first allocation, the slab empty: the slab goes back and
                // the scope is recorded in chunks, like a first step, rather than best-fit in the
                // free ranges of a slab packed for another shape (an evaluation pass after
                // training steps: its large buffers fit none of the training plan's holes, and
                // the slab and the chunks would both be held). The stream is waited for so the
                // trim returns the slab to the device before the chunks are taken.
                //
                // A growable slab has no such cost: the new shape is served best-fit from its
                // start (nothing lives in it, so there are no holes), pages are mapped at its end
                // as the scope needs them, free ones inside go back when it maps more (see
                // `punch_freed`), and the slab ends the scope sized by the new plan.
                if slab.growable {
                    self.go_online(slab);
                } else {
                    self.slab = None;
                    self.online = None;
                    source.free(slab.base, slab.size)?;
                    source.synchronize()?;
                    source.trim_to(0)?;
                }
            } else {
                self.go_online(slab);
            }
        }
        if self.guess_check {
            self.check_guess();
        }
        if self.online.is_some()
            && let Some(ptr) = self.serve_online(source, size)?
        {
            self.counters.unplanned += 1;
            return Ok(ptr);
        }
        // Once online, the plan's offsets promise nothing: the slab is full, the chunks serve.
        // Without a slab (refused for lack of memory, or lost to a failed call) the plan cannot
        // serve: the scope deviates and the chunks serve.
        if let (false, Some(slab), Some(index)) = (self.online.is_some(), self.slab, self.plan)
            && slab.growable
            && self.cursor < self.plans[index].offsets.len()
            && self.in_bin(index, self.cursor).is_none()
        {
            // An entry past the end of what is mapped (the plan's cursor reaching pages not mapped
            // yet, or an entry larger than planned): the slab grows to hold it, at its second
            // place where its own is taken.
            let offset = planned_offset(&self.plans, self.bin, index, self.cursor);
            let at = self.second_place(index, self.cursor, offset, size).unwrap_or(offset);
            if at + size > slab.size {
                self.grow_slab(source, at + size)?;
            }
        }
        let planned = match (self.online.is_some(), self.slab) {
            (false, Some(slab)) => self.next_planned(size).map(|offset| (slab, offset)),
            (false, None) if self.plan.is_some() => {
                self.deviated = true;
                None
            }
            _ => None,
        };
        match planned {
            Some((slab, placed)) => {
                let entry = self.cursor as u32 - 1;
                let ptr = match placed {
                    Placed::Slab(offset) => {
                        let ptr = slab.base + offset;
                        self.slab_live.insert(SlabAllocation { ptr, index: self.allocations, entry, size });
                        ptr
                    }
                    Placed::Bin(ptr) => {
                        self.bin_live.insert(SlabAllocation { ptr, index: self.allocations, entry, size });
                        ptr
                    }
                };
                self.counters.planned += 1;
                Ok(ptr)
            }
            None => {
                self.counters.unplanned += 1;
                // The plan failed this scope (a size larger than its entry where the range is
                // not clear, an allocation it lacks): the rest of the scope is served best-fit
                // from the slab's free ranges, then the fallback chunks, so a scope that leaves
                // its plan holds the slab and little beside it, not the slab and a second copy
                // of itself in chunks.
                if let Some(slab) = self.slab.filter(|slab| slab.size > 0) {
                    self.go_online(slab);
                    if let Some(ptr) = self.serve_online(source, size)? {
                        return Ok(ptr);
                    }
                }
                match self.allocate_from_pool(source, size) {
                    // The pool cannot place a chunk (the device is full, or its free memory is in
                    // pieces): the scope goes on best-fit in a growable slab, whose pages need no
                    // contiguous memory.
                    Err(Error::Driver(error))
                        if error.is_out_of_memory() && !self.slab_refused && self.growable_slab(source)? =>
                    {
                        let slab = self.slab.expect("a growable slab");
                        if self.online.is_none() {
                            self.go_online(slab);
                        }
                        match self.serve_online(source, size)? {
                            Some(ptr) => Ok(ptr),
                            None => Err(Error::Driver(error)),
                        }
                    }
                    other => other,
                }
            }
        }
    }

    /// Serves an allocation the slab does not from the fallback chunks. A chunk is a sixteenth
    /// of what the pool holds for the scope (the slab and the chunks), at least a granule, so a
    /// scope that outgrows the slab takes few chunks and the last one, mostly unused at the
    /// scope's peak, is small beside it. A request smaller than the granule takes a chunk of as
    /// many requests (one to four times as many as the chunk holds) as leave the least of the
    /// granule unused: four 1.5 MiB requests fill 6 MiB, where one alone leaves a quarter of
    /// 2 MiB.
    fn allocate_from_pool(&mut self, source: &mut dyn Source, size: u64) -> Result<CUdeviceptr> {
        let held = self.slab.map_or(0, |slab| slab.size) + self.fallback.held();
        let mut chunk = (held / 16).clamp(GRANULE, MAX_FALLBACK_CHUNK);
        if size < GRANULE {
            let fewest = (chunk / size).max(1);
            let len = |count: u64| (count * size).next_multiple_of(GRANULE);
            let unused = |count: u64| len(count) - count * size;
            // The least unused per byte of chunk, the fewest requests on ties.
            let count = (fewest..=4 * fewest)
                .min_by(|&a, &b| (unused(a) * len(b)).cmp(&(unused(b) * len(a))).then(a.cmp(&b)))
                .unwrap_or(fewest);
            chunk = count * size;
        }
        let ptr = self.fallback.alloc(source, size, chunk)?;
        self.pooled.insert(ptr, self.allocations);
        Ok(ptr)
    }

    /// The recorded scope as blocks (aligned sizes and lifetimes), if it may be planned.
    fn recorded_blocks(&self) -> Option<Vec<Block>> {
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

    /// Packs the recorded scope and keeps the plan under the scope's signature, replacing the
    /// plan of that signature or, at the bound, the least recently used one.
    fn replan(&mut self) {
        let Some(mut blocks) = self.recorded_blocks() else { return };
        let key = match self.user_key {
            Some(key) => PlanKey::User(key),
            None => PlanKey::Sizes(self.first_sizes.clone()),
        };
        if self.carried.iter().any(|c| c.out) {
            return self.replan_carried(blocks, key);
        }
        // The same sequence as the plan of its key, sizes aside (routed tokens, a ragged
        // batch): each entry is sized to the largest size seen in its place, so the sizes the
        // scopes vary between all fit the next plan instead of deviating scope after scope —
        // unless they vary in shares of a fixed total, where the plan keeps the scope's own sizes
        // (`in_shares`).
        let mut varies = false;
        let same = self.plans.iter().find(|p| p.key == key);
        let same_sequence = same.is_some_and(|same| {
            same.sizes.len() == blocks.len()
                && blocks.iter().zip(same.starts.iter().zip(&same.ends)).all(|(b, (&s, &e))| b.start == s && b.end == e)
        });
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
        // allocations of experts that routed no tokens are missing), or a new plan whose packing
        // that layout costs at most 1/128 more (the next scope may differ from it), or sizes that
        // vary in shares of a fixed total (`in_shares`).
        let mut new_sequence = false;
        let (packing, in_order) = match same {
            Some(same) if same_sequence && varies => {
                let packed = plan::pack(&blocks);
                let own_packing = plan::pack(&own);
                own_peak = same.own_peak.max(own_packing.size);
                match in_shares(&own, own_packing.size, own_peak, packed.size) {
                    Some(in_order) => {
                        blocks = own;
                        (in_order, true)
                    }
                    None => (packed, false),
                }
            }
            Some(same) if same_sequence => {
                let packed = plan::pack(&blocks);
                own_peak = same.own_peak.max(packed.size);
                (packed, false)
            }
            // A scope that followed the whole plan and went on, or followed it and ended early,
            // is no sign that the next one leaves its plan part way: it is planned as a new
            // sequence.
            Some(_) if !self.left_at_end => (plan::best_fit_in_order(&blocks), true),
            _ => {
                new_sequence = true;
                let packed = plan::pack(&blocks);
                own_peak = packed.size;
                let in_order = plan::best_fit_in_order(&blocks);
                let margin = packed.size + packed.size / IN_ORDER_MARGIN;
                if in_order.size <= margin {
                    (in_order, true)
                } else {
                    // Else its first allocations in that layout and the rest packed around them:
                    // where the next scope leaves it early (the first routed expert), best fit
                    // goes on around what best fit would have placed.
                    let first = blocks.len() / IN_ORDER_PREFIX;
                    match (first > 0).then(|| plan::pack_after_prefix(&blocks, first)) {
                        Some(prefix) if prefix.size <= margin => (prefix, true),
                        _ => (packed, false),
                    }
                }
            }
        };
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
        };
        let plan = self.fit_bin(plan);
        self.counters.replans += 1;
        self.keep_plan(plan);
    }

    /// [`Planned::replan`] for a scope that carries allocations into the next: each is packed
    /// with its life in the next scope, at one offset ([`plan::pack_around`]), pinned where it
    /// lies in the slab now, since the next scope finds it there. Its life there ends where the
    /// allocation of the same index carried into this scope was freed, or, where none was (the
    /// first scope that carries), at a guess: where this scope's own live bytes first peak (a
    /// loop frees the gradients the step before handed it before its backward pass, where its
    /// peak is), or where the allocation is made again if that is sooner; but right after the
    /// scope's own copies where it began by copying what it carries out (a batch copied before
    /// `zero_grad()` at the top of the loop). A carried allocation
    /// freed later than planned finds the plan's entries laid over it refused (the late list),
    /// and that scope deviates and is planned again from what it saw.
    ///
    /// An allocation the next scope makes again before it frees the one carried in (a batch
    /// copied to the device at a step's start and bound to the name the step before's was: the
    /// new one is made first), or, in a first plan, one made before the scope freed anything,
    /// has two places, each held the whole scope, and its scopes alternate between them (the
    /// plan's `alternates`); the second is pinned where the allocation lies now, which the next
    /// scope finds carried in. A guessed one makes the plan `guessed`.
    fn replan_carried(&mut self, mut blocks: Vec<Block>, key: PlanKey) {
        let entries = blocks.len();
        let base = self.slab.map_or(0, |slab| slab.base);
        let out: Vec<CarriedAllocation> = self.carried.iter().filter(|c| c.out).copied().collect();
        let peak_at = plan::peak_position(&blocks);
        // Where each allocation the scope before carried in was freed, by its index there.
        let freed_at: HashMap<u32, u32> = self
            .events
            .iter()
            .enumerate()
            .filter_map(|(position, event)| match *event {
                Event::Carried(index) => Some((index, position as u32)),
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
        let ((packing, pairs), unmoved) = self.carried_layout(&blocks, pairs, &beside, late.as_deref());
        let layout =
            CarriedLayout { blocks: &blocks, entries, alternating: &alternating, key: &key, guessed, copies_end };
        let Some(plan) = self.carried_plan(&layout, &packing, &pairs) else { return };
        if let Some((pinned, pairs)) = unmoved
            && let Some(unmoved) = self.carried_plan(&layout, &pinned, &pairs)
        {
            self.unmoved = Some(unmoved);
        }
        self.counters.replans += 1;
        self.keep_plan(plan);
    }

    /// The plan of a carrying scope laid out by `packing` (of `layout.blocks`: the scope's own,
    /// then the carried memory's lives in the next scope), `pairs` as placed; `None` where the
    /// packing is not valid.
    fn carried_plan(&self, layout: &CarriedLayout, packing: &plan::Packing, pairs: &[plan::Carried]) -> Option<Plan> {
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
        })
    }

    /// Follows a scope served from a plan that guessed the memory carried into it freed by its
    /// `freed_by` ([`Planned::replan_carried`]). Where the scope gets there with some of it still
    /// live, the plan is corrected to a later guess ([`Planned::correct_guess`]); where the scope
    /// frees it before a corrected guess, the rest is packed again from there, where that is
    /// smaller ([`Planned::pack_rest_around`]). Once all of it is freed, nothing is checked.
    fn check_guess(&mut self) {
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
    fn correct_guess(&mut self, index: usize, past: u32) -> bool {
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
    fn pack_rest_around(&mut self, index: usize, until: u32) -> bool {
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
    /// and only the phase's first plan, in a growable slab, moves. Where no carried memory is
    /// in the slab (a recording served from chunks), every scope that first follows the plan
    /// finds it elsewhere: the pairs go above.
    fn carried_layout(
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
        // The phase's first plan only, made at the end of its recording scope, whose best fit put
        // the carried memory: later scopes put it where a plan did, or serve a shape that varies
        // from step to step (a batch, a length), whose next scope, another shape, would be served
        // best fit in the new range beside the carried memory, for nothing (a ResNet whose
        // batches vary went from 66 to 78 MiB when a plan of a repeated batch could move too).
        let first = self.plans.iter().all(|plan| plan.predicted);
        let movable = first && self.retired.is_none() && self.slab.is_some_and(|slab| slab.growable);
        if !movable {
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

    /// Keeps `plan` in place of the plan of its key or, at the bound, of the least recently
    /// used one.
    fn keep_plan(&mut self, plan: Plan) {
        if let Some(same) = self.plans.iter().position(|p| p.key == plan.key) {
            // The scopes it served in this step stay counted.
            let plan = Plan { scopes: self.plans[same].scopes, ..plan };
            self.plans[same] = plan;
        } else if self.plans.len() < self.max_plans {
            self.plans.push(plan);
        } else if let Some(oldest) = (0..self.plans.len()).min_by_key(|&p| self.plans[p].last_used) {
            self.plans[oldest] = plan;
        }
    }

    /// Takes out the plan predicted for the scope, the last one if any
    /// ([`Planned::predicted_plan`]).
    fn drop_predicted_plan(&mut self) {
        if self.plans.last().is_some_and(|plan| plan.predicted) {
            self.plans.pop();
            if self.plan == Some(self.plans.len()) {
                self.plan = None;
            }
        }
    }

    /// Sets the scope's bookkeeping back to empty.
    fn close_scope(&mut self) {
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
    fn lend_slab(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Option<CUdeviceptr>> {
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
    fn take_back_slab(&mut self, source: &mut dyn Source, base: CUdeviceptr) -> Result<bool> {
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

impl Allocator for Planned {
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served> {
        let size = bytes.next_multiple_of(ALIGNMENT);
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
            Ok(ptr) => {
                self.events.push(Event::Alloc(size));
                let slot = self.allocations;
                self.allocations += 1;
                Ok(Served { ptr, slot })
            }
            Err(error) => {
                // Not an allocation of the scope: the caller may retry it after recovery (and a
                // scope that ran out of memory is not predicted).
                self.first_sizes.truncate(n);
                self.template = None;
                Err(error)
            }
        }
    }

    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()> {
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
            let late = allocation.entry == FOREIGN || self.entries[allocation.entry as usize] == Entry::Late;
            if allocation.entry != FOREIGN {
                self.entries[allocation.entry as usize] = Entry::Done;
            }
            if late {
                let offset = ptr - self.slab.expect("a slab allocation has a slab").base;
                if let Some(at) = self.late.iter().position(|&(late, _)| late == offset) {
                    self.late.swap_remove(at);
                }
            }
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

    /// Plans the scope if it had no plan or deviated from it, reclaims the slab (leaked buffers
    /// too), gives back leaked pool allocations, and sizes the slab for the largest plan. The
    /// slab is taken now, so the next scope finds it; it is given back when no plan is left, or
    /// when `keep` is smaller than it (the trim policy asks for the memory back; the next scope
    /// that has a plan takes it again).
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

    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()> {
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
            let refilled = lowest < keep && source.fill_range(slab.base, 0, keep).is_ok();
            let end = if refilled { keep } else { lowest.max(carried) };
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
        for slab in [self.slab.take(), self.lent.take(), self.retired.take()].into_iter().flatten() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phase::{Phase, PhaseSpec, Scope, Strategy};
    use crate::source::fake::{FakeSource, RANGE_LIMIT};

    /// A planned allocator whose plans are selected by the first two sizes of a scope.
    fn planned() -> Planned {
        let entry = PhaseEntry::new(Phase(0), PhaseSpec::new("p", Scope::Step).strategy(Strategy::PLANNED));
        Planned::new(entry, 8, 2)
    }

    #[test]
    fn the_live_slab_allocations_are_found_by_their_slot_and_listed() {
        let record = |index: u32, ptr: CUdeviceptr| SlabAllocation { ptr, index, entry: FOREIGN, size: 512 };
        let mut live = SlabLive::default();
        for (index, ptr) in [(0, 0x1000), (1, 0x2000), (3, 0x4000)] {
            live.insert(record(index, ptr));
        }
        assert!(live.remove(1, 0x9000).is_none(), "a slot names an allocation only with its address");
        assert!(live.remove(2, 0x3000).is_none(), "nothing filed at slot 2");
        assert!(live.remove(700, 0x1000).is_none(), "a slot past the table");
        assert_eq!(live.remove(0, 0x1000).map(|a| a.index), Some(0));
        assert!(live.remove(0, 0x1000).is_none(), "freed once");
        let listed: Vec<_> = live.iter().map(|a| (a.index, a.ptr)).collect();
        assert_eq!(listed, [(1, 0x2000), (3, 0x4000)], "the live ones, by index");
        // Past the first word of live bits, and across words.
        for index in [63, 64, 130, 200] {
            live.insert(record(index, 0x10_0000 + u64::from(index)));
        }
        assert_eq!(live.iter().map(|a| a.index).collect::<Vec<_>>(), [1, 3, 63, 64, 130, 200]);
        live.for_each_mut(|allocation| allocation.entry = allocation.index);
        assert!(live.iter().all(|a| a.entry == a.index), "every live one visited, mutably");
        assert_eq!(live.remove(64, 0x10_0040).map(|a| a.index), Some(64));
        assert_eq!(live.iter().map(|a| a.index).collect::<Vec<_>>(), [1, 3, 63, 130, 200]);
        for (index, ptr) in [(3, 0x4000), (1, 0x2000), (63, 0x10_003f), (130, 0x10_0082), (200, 0x10_00c8)] {
            assert_eq!(live.remove(index, ptr).map(|a| a.index), Some(index));
        }
        assert!(live.is_empty() && live.iter().next().is_none());
        live.insert(record(0, 0x1000));
        live.clear();
        assert!(live.is_empty() && live.remove(0, 0x1000).is_none(), "a new scope files from nothing");
        assert!(live.iter().next().is_none());
    }

    /// One scope of a transformer-like shape: `a` and `b` overlap, `c` reuses `a`'s place.
    fn scope(planned: &mut Planned, source: &mut FakeSource) -> Vec<CUdeviceptr> {
        planned.begin_step();
        let a = planned.allocate(source, 4096).unwrap();
        let b = planned.allocate(source, 8192).unwrap();
        planned.free(source, a, 4096).unwrap();
        let c = planned.allocate(source, 2048).unwrap();
        planned.free(source, c, 2048).unwrap();
        planned.free(source, b, 8192).unwrap();
        planned.reset(source, u64::MAX).unwrap();
        vec![a.ptr, b.ptr, c.ptr]
    }

    #[test]
    fn the_first_scope_is_recorded_and_the_next_served_from_one_slab() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        scope(&mut planned, &mut source);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.plans.len()), (0, 3, 1));
        let plan = &stats.plans[0];
        assert_eq!((plan.bytes, plan.lower_bound), (12288, 12288), "packed at the peak of live bytes");
        assert_eq!(source.held(), 12288, "the recording's memory went back, the slab is taken");
        let allocs = source.allocs;
        let ptrs = scope(&mut planned, &mut source);
        assert_eq!(source.allocs, allocs, "a planned scope takes nothing from the source");
        let slab = *source.live.keys().next().unwrap();
        assert!(ptrs.iter().all(|&p| p >= slab && p < slab + 12288), "{ptrs:x?} inside the slab at {slab:#x}");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 0, 0));
        assert_eq!(planned.touched(), Some(12288));
    }

    #[test]
    fn a_deviation_is_served_from_the_source_and_refreshes_the_plan() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        scope(&mut planned, &mut source);
        planned.begin_step();
        let a = planned.allocate(&mut source, 4096).unwrap();
        let b = planned.allocate(&mut source, 8192).unwrap();
        let extra = planned.allocate(&mut source, 1 << 14).unwrap();
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (2, 1));
        let held_in_scope = source.held();
        assert_eq!(held_in_scope, 12288 + (1 << 14), "the extra allocation came from the source");
        for (ptr, bytes) in [(extra, 1 << 14), (b, 8192), (a, 4096)] {
            planned.free(&mut source, ptr, bytes).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.deviated_scopes, stats.replans), (1, 1), "one scope deviated, and its plan was made again");
    }

    /// One scope: each `(size, lives)` allocated in turn; those not `lives` freed before the next.
    fn sequence(planned: &mut Planned, source: &mut FakeSource, sizes: &[(u64, bool)]) -> Vec<CUdeviceptr> {
        planned.begin_step();
        let mut ptrs = Vec::new();
        let mut live = Vec::new();
        for &(size, lives) in sizes {
            let ptr = planned.allocate(source, size).unwrap();
            ptrs.push(ptr);
            if lives {
                live.push((ptr, size));
            } else {
                planned.free(source, ptr, size).unwrap();
            }
        }
        for (ptr, size) in live {
            planned.free(source, ptr, size).unwrap();
        }
        planned.reset(source, u64::MAX).unwrap();
        ptrs.iter().map(|served| served.ptr).collect()
    }

    #[test]
    fn a_larger_size_is_served_in_place_and_the_plan_keeps_the_largest_seen() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // The first two sizes are the key; the last two come one after the other, both planned
        // at offset 0 of an 8 KiB slab.
        let key = [(512, false), (512, false)];
        sequence(&mut planned, &mut source, &[key[0], key[1], (8192, false), (4096, false)]);
        let allocs = source.allocs;
        // The sizes swap (routed tokens): the last is larger than its entry, and its grown range
        // is clear (the one before was freed), so it is served in place.
        let ptrs = sequence(&mut planned, &mut source, &[key[0], key[1], (4096, false), (8192, false)]);
        assert_eq!(source.allocs, allocs, "all served from the slab");
        assert_eq!(ptrs[2], ptrs[3], "both at the planned offset");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.replans), (4, 0, 1), "a grown entry deviates the scope");
        let plan = &planned.plans[0];
        assert_eq!(plan.sizes, [512, 512, 8192, 8192], "each entry sized to the largest seen in its place");
        assert!(plan.varies);
        assert_eq!(plan.bytes, 8192);
        // Either order now fits its entries: no deviation, no replan.
        sequence(&mut planned, &mut source, &[key[0], key[1], (8192, false), (4096, false)]);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations, stats.replans), (4, 0, 0));
    }

    #[test]
    fn sizes_that_vary_in_shares_of_a_fixed_total_are_planned_at_the_latest_sizes_in_order() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        let key = [(512, false), (512, false)];
        // Three buffers live together whose sizes change from scope to scope while their sum
        // does not (tokens routed to experts): each scope needs 16 KiB.
        sequence(&mut planned, &mut source, &[key[0], key[1], (4096, true), (8192, true), (4096, true)]);
        let shares = [key[0], key[1], (8192, true), (4096, true), (4096, true)];
        sequence(&mut planned, &mut source, &shares);
        // The largest sizes of all three (8, 8 and 4 KiB) would need 20 KiB together, which no
        // scope needs: the plan keeps the latest sizes, laid out in allocation order.
        let plan = &planned.plans[0];
        assert_eq!(plan.largest, [512, 512, 8192, 8192, 4096]);
        assert_eq!(plan.sizes, [512, 512, 8192, 4096, 4096]);
        assert!(plan.varies && plan.in_order);
        assert_eq!(plan.bytes, 16384, "the scope's own need, not the packing of the largest sizes");
        // A scope within those sizes is served from the plan, in the 16 KiB slab.
        let allocs = source.allocs;
        sequence(&mut planned, &mut source, &shares);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (5, 0));
        assert_eq!((source.allocs, source.held()), (allocs, 16384));
        assert_eq!(planned.plans[0].bytes, 16384, "planned so again: its sizes still vary in shares");
    }

    #[test]
    fn sizes_that_vary_together_keep_the_plan_of_the_largest_sizes() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        let key = [(512, false), (512, false)];
        // A large batch, then a smaller one in which one buffer is larger: that scope needs less
        // than the first did, so the sizes vary together, and the next large batch must fit.
        sequence(&mut planned, &mut source, &[key[0], key[1], (8192, true), (8192, true), (8192, true)]);
        sequence(&mut planned, &mut source, &[key[0], key[1], (12288, true), (4096, true), (4096, true)]);
        let plan = &planned.plans[0];
        assert_eq!(plan.sizes, [512, 512, 12288, 8192, 8192], "each entry at the largest size seen");
        assert!(plan.varies && !plan.in_order);
        assert_eq!(plan.bytes, 28672);
    }

    #[test]
    fn a_grown_range_over_a_live_allocation_is_not_handed_out() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        let key = [(512, false), (512, false)];
        sequence(&mut planned, &mut source, &[key[0], key[1], (4096, true), (4096, true)]);
        let slab = planned.slab.unwrap();
        let ptrs = sequence(&mut planned, &mut source, &[key[0], key[1], (4096, true), (8192, true)]);
        let (first, second) = (ptrs[2], ptrs[3]);
        assert!(second + 8192 <= first || first + 4096 <= second, "{first:#x} and {second:#x} overlap");
        assert!(second < slab.base || second >= slab.base + slab.size, "the larger one came from a chunk");
    }

    #[test]
    fn a_scope_that_leaves_its_plan_goes_on_in_the_slab_free_space() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        let key = [(1024, true), (1024, true)];
        sequence(&mut planned, &mut source, &[key[0], key[1], (4096, false), (8192, false)]);
        let slab = planned.slab.unwrap();
        assert_eq!(slab.size, 10240);
        // The third is larger than the slab: a chunk serves it, and the scope goes on from the
        // slab's free ranges, where the fourth fits.
        let ptrs = sequence(&mut planned, &mut source, &[key[0], key[1], (16384, false), (8192, false)]);
        assert!(ptrs[2] < slab.base || ptrs[2] >= slab.base + slab.size);
        assert!(ptrs[3] >= slab.base && ptrs[3] + 8192 <= slab.base + slab.size, "served in the slab");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (2, 2, 1));
    }

    #[test]
    fn leaked_allocations_are_reclaimed_at_the_reset() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        scope(&mut planned, &mut source);
        planned.begin_step();
        planned.allocate(&mut source, 4096).unwrap();
        planned.allocate(&mut source, 8192).unwrap();
        planned.allocate(&mut source, 1 << 14).unwrap();
        planned.reset(&mut source, u64::MAX).unwrap();
        assert!(planned.reclaims_live());
        assert_eq!(source.held(), planned.slab.map_or(0, |slab| slab.size), "only the slab is held");
        planned.release_all(&mut source).unwrap();
        assert_eq!(source.held(), 0);
    }

    #[test]
    fn the_recording_is_served_from_chunks_given_back_before_the_slab_is_taken() {
        let (mut source, mut planned) = (FakeSource::new(64 << 20), planned());
        planned.begin_step();
        let ptrs: Vec<_> = (0..4).map(|_| planned.allocate(&mut source, 1 << 20).unwrap()).collect();
        assert_eq!(source.allocs, 2, "one 2 MiB chunk holds the first two, a second the next two");
        assert_eq!(ptrs[1].ptr - ptrs[0].ptr, 1 << 20, "end to end in a chunk");
        let syncs = source.syncs;
        for ptr in ptrs {
            planned.free(&mut source, ptr, 1 << 20).unwrap();
        }
        assert_eq!(source.held(), 0, "each chunk went back once empty");
        planned.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(source.held(), 4 << 20, "the chunks went back; the slab, the recording's peak, is held");
        assert!(source.syncs > syncs, "the stream is waited for so the trim returns the chunks");
        assert_eq!(source.trims.last(), Some(&0), "what is idle goes back before the slab is taken");
        assert_eq!(planned.touched(), Some(4 << 20), "the pool keeps nothing for the chunks");
    }

    #[test]
    fn chunks_emptied_in_a_recording_go_back_while_it_runs() {
        let (mut source, mut planned) = (FakeSource::new(64 << 20), planned());
        planned.begin_step();
        // Activations: eight 2 MiB chunks, one 2 MiB allocation each.
        let ptrs: Vec<_> = (0..8).map(|_| planned.allocate(&mut source, 2 << 20).unwrap()).collect();
        assert_eq!(source.held(), 16 << 20);
        let syncs = source.syncs;
        // Freed one by one: each emptied chunk goes back at once, and the stream is waited for
        // once an eighth of what the scope held has gone back.
        planned.free(&mut source, ptrs[0], 2 << 20).unwrap();
        assert_eq!(source.held(), 14 << 20, "the emptied chunk went back");
        assert_eq!((source.syncs, source.trims.last()), (syncs + 1, Some(&0)), "2 MiB of 16: waited for and trimmed");
        for &ptr in &ptrs[1..] {
            planned.free(&mut source, ptr, 2 << 20).unwrap();
        }
        assert_eq!(source.held(), 0, "nothing idle is held while the scope goes on");
        planned.reset(&mut source, u64::MAX).unwrap();
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.plans.len(), stats.slab_bytes), (1, 16 << 20), "the recording is planned as before");
    }

    #[test]
    fn a_new_shape_gives_the_empty_slab_back_and_is_recorded_in_chunks() {
        let (mut source, mut planned) = (FakeSource::new(64 << 20), planned());
        sequence(&mut planned, &mut source, &[(4096, true), (8192, true)]);
        assert!(planned.slab.is_some());
        assert_eq!(source.held(), 12288);
        // Another shape (an evaluation pass): no plan has its first size.
        planned.begin_step();
        let syncs = source.syncs;
        let ptr = planned.allocate(&mut source, 1 << 20).unwrap();
        assert_eq!(source.syncs, syncs + 1, "waited for, so the trim returns it before the chunk is taken");
        assert_eq!(source.held(), 2 << 20, "the slab went back; a chunk of two 1 MiB requests is held");
        assert!(planned.slab.is_none(), "no slab while the new shape is recorded");
        planned.free(&mut source, ptr, 1 << 20).unwrap();
        planned.reset(&mut source, u64::MAX).unwrap();
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.plans.len(), stats.slab_bytes), (2, 1 << 20), "recorded; the slab is its plan's");
    }

    #[test]
    fn a_request_below_the_granule_takes_a_chunk_it_fills() {
        let (mut source, mut planned) = (FakeSource::new(64 << 20), planned());
        planned.begin_step();
        let size = 3 << 19; // 1.5 MiB: one alone leaves a quarter of a 2 MiB chunk unused
        let ptrs: Vec<_> = (0..4).map(|_| planned.allocate(&mut source, size).unwrap()).collect();
        assert_eq!((source.allocs, source.held()), (1, 6 << 20), "four in one 6 MiB chunk, end to end");
        for ptr in ptrs {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
    }

    #[test]
    fn a_plan_that_stopped_serving_no_longer_sizes_the_slab() {
        let (mut source, mut planned) = (FakeSource::new(64 << 20), planned());
        // A large first scope (its own first sizes), then smaller ones of another shape.
        let mut run = |planned: &mut Planned, sizes: &[u64]| {
            planned.begin_step();
            let ptrs: Vec<_> = sizes.iter().map(|&size| planned.allocate(&mut source, size).unwrap()).collect();
            for (&ptr, &size) in ptrs.iter().zip(sizes) {
                planned.free(&mut source, ptr, size).unwrap();
            }
            planned.reset(&mut source, u64::MAX).unwrap();
            planned.slab.map_or(0, |slab| slab.size)
        };
        let (large, small) = ([8u64 << 20, 8 << 20], [1u64 << 20, 2 << 20]);
        assert_eq!(run(&mut planned, &large), 16 << 20, "recorded");
        assert_eq!(run(&mut planned, &small), 3 << 20, "served from the large plan, then sized by its own");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.plans.len()), (2, 0, 2), "borrowed, and recorded");
        assert_eq!(run(&mut planned, &small), 3 << 20);
        assert_eq!(run(&mut planned, &large), 16 << 20, "the large plan grows it again when it serves");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned), (2, 0), "served from its plan after the growth");
        assert_eq!(run(&mut planned, &small), 3 << 20);
    }

    /// An operation of a scope: an allocation of this many bytes, or the free of the scope's
    /// allocation with this index.
    #[derive(Clone, Copy)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    /// Runs one scope of `ops`, frees what is still live in allocation order, and returns the
    /// pointers.
    fn run_ops(planned: &mut Planned, source: &mut FakeSource, ops: &[Op]) -> Vec<CUdeviceptr> {
        planned.begin_step();
        let (mut ptrs, mut sizes, mut freed) = (Vec::new(), Vec::new(), Vec::new());
        for &op in ops {
            match op {
                Op::Alloc(size) => {
                    ptrs.push(planned.allocate(source, size).unwrap());
                    sizes.push(size);
                    freed.push(false);
                }
                Op::Free(index) => {
                    planned.free(source, ptrs[index], sizes[index]).unwrap();
                    freed[index] = true;
                }
            }
        }
        for index in 0..ptrs.len() {
            if !freed[index] {
                planned.free(source, ptrs[index], sizes[index]).unwrap();
            }
        }
        planned.reset(source, u64::MAX).unwrap();
        ptrs.iter().map(|served| served.ptr).collect()
    }

    /// The blocks `run_ops` records for `ops`.
    fn blocks_of(ops: &[Op]) -> Vec<Block> {
        let mut blocks: Vec<Block> = Vec::new();
        let mut position = 0;
        for &op in ops {
            match op {
                Op::Alloc(size) => blocks.push(Block { size, start: position, end: Block::NEVER_FREED }),
                Op::Free(index) => blocks[index].end = position,
            }
            position += 1;
        }
        for block in blocks.iter_mut().filter(|block| block.end == Block::NEVER_FREED) {
            block.end = position;
            position += 1;
        }
        blocks
    }

    #[test]
    fn a_plan_whose_sequence_changed_is_laid_out_in_allocation_order() {
        use Op::{Alloc, Free};
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // B is freed once C is allocated, D comes last: best fit in order leaves B's hole under
        // D (8 KiB), the packing places D first (6 KiB); a new plan is packed.
        let first = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1), Alloc(3072)];
        run_ops(&mut planned, &mut source, &first);
        assert!(!planned.plans[0].in_order, "in order costs a third more: packed");
        assert_eq!(planned.plans[0].bytes, 6144);
        // The same key, one allocation inserted (an expert that routed tokens this time): the
        // scope leaves the plan, and its plan is laid out as best fit in allocation order, so a
        // scope that leaves it finds what is live where best fit would have put it.
        let second = [Alloc(2048), Alloc(2048), Alloc(512), Alloc(1024), Free(1), Alloc(3072)];
        run_ops(&mut planned, &mut source, &second);
        let blocks = blocks_of(&second);
        let plan = &planned.plans[0];
        assert_eq!(plan.starts, blocks.iter().map(|b| b.start).collect::<Vec<_>>(), "the second scope's plan");
        assert!(plan.in_order);
        assert_eq!(plan.offsets, plan::best_fit_in_order(&blocks).offsets);
        assert_ne!(plan.offsets, plan::pack(&blocks).offsets, "not the packing");
        assert_eq!(plan.offsets[..2], [0, 2048], "the first allocations from the slab's start");
    }

    #[test]
    fn a_new_plan_lays_out_its_first_sixteenth_in_order_where_all_of_it_would_cost_more() {
        use Op::{Alloc, Free};
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // Two small buffers that live through the scope, the pattern above whose best fit in
        // order leaves a hole under D (a third more than the packing), then short-lived ones:
        // 32 allocations, the first two laid out in order, the rest packed around them.
        let mut ops = vec![Alloc(512), Alloc(512), Alloc(2048), Alloc(2048), Alloc(1024), Free(3), Alloc(3072)];
        for index in 6..32 {
            ops.extend([Alloc(512), Free(index)]);
        }
        run_ops(&mut planned, &mut source, &ops);
        let blocks = blocks_of(&ops);
        let (packed, in_order) = (plan::pack(&blocks), plan::best_fit_in_order(&blocks));
        assert!(
            in_order.size > packed.size + packed.size / IN_ORDER_MARGIN,
            "{} against {}",
            in_order.size,
            packed.size
        );
        let plan = &planned.plans[0];
        assert!(plan.in_order, "laid out for a scope expected to leave it, packed once one follows it");
        assert_eq!(plan.offsets[..2], in_order.offsets[..2], "the first sixteenth as best fit lays it out");
        assert_eq!(plan.offsets, plan::pack_after_prefix(&blocks, 2).offsets);
        assert!(plan.bytes <= packed.size + packed.size / IN_ORDER_MARGIN);
        // A scope that follows it whole: packed from then on.
        run_ops(&mut planned, &mut source, &ops);
        assert!(!planned.plans[0].in_order);
        assert_eq!(planned.plans[0].bytes, packed.size);
    }

    #[test]
    fn a_scope_that_follows_its_whole_plan_and_goes_on_is_packed_not_laid_out_in_order() {
        use Op::{Alloc, Free};
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // A first step recorded before the steady sequence's last allocation exists (the
        // optimizer's first step, which makes its state where later steps allocate temporaries).
        let first = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1)];
        run_ops(&mut planned, &mut source, &first);
        // The next scope follows the whole plan, then allocates 3 KiB more: its sequence changed,
        // but it left the plan only past its end, which says nothing of the next scope leaving
        // it part way. Best fit in order would need 8 KiB; it is packed (6 KiB), as a new plan.
        let second = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1), Alloc(3072)];
        run_ops(&mut planned, &mut source, &second);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (3, 1), "the allocation past the plan's end deviated");
        let blocks = blocks_of(&second);
        assert_eq!(plan::best_fit_in_order(&blocks).size, 8192);
        let plan = &planned.plans[0];
        assert_eq!(plan.starts, blocks.iter().map(|b| b.start).collect::<Vec<_>>(), "the second scope's plan");
        assert!(!plan.in_order, "packed");
        assert_eq!((plan.bytes, &plan.offsets), (6144, &plan::pack(&blocks).offsets));
    }

    #[test]
    fn a_scope_that_follows_its_plan_and_ends_early_is_packed_not_laid_out_in_order() {
        use Op::{Alloc, Free};
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // A plan of the steady sequence (saved, or recorded first), then a scope that is a prefix
        // of it: a first step, before the optimizer allocates what later steps do.
        let steady = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1), Alloc(3072), Alloc(512)];
        run_ops(&mut planned, &mut source, &steady);
        assert!(!planned.plans[0].in_order);
        let first = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1), Alloc(3072)];
        run_ops(&mut planned, &mut source, &first);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations, stats.missing), (4, 0, 1), "left only at the plan's end");
        // Its plan: best fit in order would need 8 KiB, the packing 6 KiB.
        let blocks = blocks_of(&first);
        assert_eq!(plan::best_fit_in_order(&blocks).size, 8192);
        let plan = &planned.plans[0];
        assert_eq!(plan.starts, blocks.iter().map(|b| b.start).collect::<Vec<_>>(), "the prefix's plan");
        assert!(!plan.in_order, "packed");
        assert_eq!(plan.bytes, 6144);
    }

    #[test]
    fn a_new_plan_in_allocation_order_is_packed_once_its_sequence_repeats() {
        let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
        // Best fit in order needs what the packing needs (12 KiB): a new plan is laid out so.
        scope(&mut planned, &mut source);
        assert!(planned.plans[0].in_order);
        assert_eq!(planned.plans[0].bytes, 12288);
        // The next scope has the same sequence: served from the plan, then packed.
        scope(&mut planned, &mut source);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations, stats.replans), (3, 0, 1), "packed again");
        assert!(!planned.plans[0].in_order);
        scope(&mut planned, &mut source);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.replans), (3, 0), "a packed plan that serves is kept");
    }

    const MIB: u64 = 1 << 20;

    /// Runs one scope of `sizes` (all live until the end, freed in reverse) and returns the
    /// pointers and the slab after the reset.
    fn live_scope(planned: &mut Planned, source: &mut FakeSource, sizes: &[u64]) -> (Vec<CUdeviceptr>, Slab) {
        planned.begin_step();
        let ptrs: Vec<_> = sizes.iter().map(|&size| planned.allocate(source, size).unwrap()).collect();
        for (&ptr, &size) in ptrs.iter().zip(sizes).rev() {
            planned.free(source, ptr, size).unwrap();
        }
        planned.reset(source, u64::MAX).unwrap();
        (ptrs.iter().map(|served| served.ptr).collect(), planned.slab.unwrap())
    }

    /// Another pool on the device takes `bytes`: first the device asks the pools that keep pages
    /// of freed memory mapped to give them back, as
    /// [`FreedPages::before_growth`](crate::device_core::FreedPages::before_growth) does.
    fn another_pool_takes(planned: &mut Planned, source: &mut FakeSource, bytes: u64) -> CUdeviceptr {
        if source.holding {
            planned.give_back_freed(source, bytes).unwrap();
        }
        source.alloc(bytes).unwrap()
    }

    #[test]
    fn with_ranges_the_first_scope_is_recorded_in_the_range_and_served_from_its_plan() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        let (first, slab) = live_scope(&mut planned, &mut source, &[MIB, MIB, 3 * MIB, 4 * MIB]);
        assert_eq!(source.allocs, 0, "the first scope is recorded best-fit in the range, not in chunks");
        assert_eq!(first[0], slab.base);
        assert!(slab.growable);
        assert_eq!(source.ranges.len(), 1);
        assert_eq!(
            (slab.size, source.held(), source.holding),
            (10 * MIB, 10 * MIB, true),
            "its pages stay mapped for the next scope, offered to whoever needs memory first"
        );
        let allocs = source.allocs;
        let (again, slab) = live_scope(&mut planned, &mut source, &[MIB, MIB, 3 * MIB, 4 * MIB]);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (4, 0, 0), "then served from its plan");
        assert_eq!(source.allocs, allocs);
        assert_eq!(slab.size, 10 * MIB, "the plan's 9 MiB, rounded up to a page");
        assert_eq!(source.held(), 10 * MIB, "and kept mapped for the next scope of the plan");
        assert!(again.iter().all(|&p| p >= slab.base && p < slab.base + slab.size));
    }

    /// A planned allocator of a phase that carries allocations into the next step.
    fn carrying() -> Planned {
        let spec = PhaseSpec::new("p", Scope::Step).strategy(Strategy::PLANNED).carry(true);
        Planned::new(PhaseEntry::new(Phase(0), spec), 8, 2)
    }

    /// One training step whose gradients (2 MiB each) are made in its backward pass and set to
    /// `None` in the next step between its forward and backward passes: activations `a1`, `a2`
    /// (4 MiB each), the gradients `carried_in` of the step before freed, a 4 MiB temporary, then
    /// the gradients made as the activations go. Every hand-out is checked clear of the
    /// carried-in gradients still live. Returns this step's gradients, carried out.
    fn carrying_step(planned: &mut Planned, source: &mut FakeSource, carried_in: &[Served]) -> Vec<Served> {
        carrying_step_seen(planned, source, carried_in, 4 * MIB, |_, _| {})
    }

    /// [`carrying_step`] with `a1` of `first` bytes, `seen` called after that first allocation.
    fn carrying_step_seen(
        planned: &mut Planned,
        source: &mut FakeSource,
        carried_in: &[Served],
        first: u64,
        seen: impl FnOnce(&Planned, &FakeSource),
    ) -> Vec<Served> {
        let clear_of = |ptr: CUdeviceptr, size: u64, live: &[Served]| {
            live.iter().all(|g| g.ptr + 2 * MIB <= ptr || ptr + size <= g.ptr)
        };
        planned.begin_step();
        let a1 = planned.allocate(source, first).unwrap();
        seen(planned, source);
        let a2 = planned.allocate(source, 4 * MIB).unwrap();
        assert!(clear_of(a1.ptr, first, carried_in) && clear_of(a2.ptr, 4 * MIB, carried_in));
        for &g in carried_in {
            planned.free(source, g, 2 * MIB).unwrap();
        }
        let t = planned.allocate(source, 4 * MIB).unwrap();
        planned.free(source, t, 4 * MIB).unwrap();
        planned.free(source, a2, 4 * MIB).unwrap();
        let g1 = planned.allocate(source, 2 * MIB).unwrap();
        planned.free(source, a1, first).unwrap();
        let g2 = planned.allocate(source, 2 * MIB).unwrap();
        let out = [g1, g2].map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).expect("carried") });
        planned.reset(source, u64::MAX).unwrap();
        out.to_vec()
    }

    #[test]
    fn memory_carried_into_the_next_step_is_planned_at_one_place_and_shared_once_freed() {
        // Without ranges the recording is served from chunks, so the carried gradients are in
        // none of the plan's way: it packs them freely. With ranges, the recording's best fit
        // puts them where the next forward pass needs room (the second at 0, in the first
        // activation's hole, the first at 4 MiB, in the second's): pinned there the plan needs
        // 14 MiB, so it moves to a new range (below) and packs them above the activations: at
        // the next step's first allocation, which follows it.
        for vmm in [false, true] {
            let mut source = if vmm { FakeSource::with_ranges(64 * MIB) } else { FakeSource::new(64 * MIB) };
            let mut planned = carrying();
            let mut carried = carrying_step(&mut planned, &mut source, &[]);
            assert!(carried.iter().all(|g| g.slot & CARRIED_SLOT != 0));
            assert_eq!((planned.plan_stats().unwrap().moves, planned.unmoved.is_some()), (0, vmm));
            let mut places = Vec::new();
            for step in 0..4 {
                carried = carrying_step(&mut planned, &mut source, &carried);
                places.push(carried.iter().map(|g| g.ptr).collect::<Vec<_>>());
                if step == 0 {
                    assert_eq!((planned.plan_stats().unwrap().moves, planned.retired.is_some()), (u64::from(vmm), vmm));
                }
            }
            let stats = planned.plan_stats().unwrap();
            assert_eq!((stats.planned, stats.unplanned, stats.deviations, stats.moves), (5, 0, 0, 0), "vmm {vmm}");
            assert!(places.windows(2).all(|w| w[0] == w[1]), "the gradients at one place: {places:x?}");
            // The temporary takes the gradients' place once they are freed: 12 MiB, the peak of
            // live bytes, where the gradients apart from the rest need 16.
            let plan = &planned.plans[0];
            let (temporary, gradient) = (plan.offsets[2], plan.offsets[4]);
            assert!(temporary < gradient + 2 * MIB && gradient < temporary + 4 * MIB, "{plan:?}");
            assert!(plan.offsets[3] >= 8 * MIB && plan.offsets[4] >= 8 * MIB, "above the activations: {plan:?}");
            assert_eq!(plan.bytes, 12 * MIB, "{plan:?}");
            assert_eq!(source.held(), 12 * MIB, "vmm {vmm}");
            // The next step's end would release them; freed here, nothing is left.
            for g in carried {
                planned.free(&mut source, g, 2 * MIB).unwrap();
            }
            planned.reset(&mut source, 0).unwrap();
            assert!(planned.carried.is_empty());
        }
    }

    /// One step of a loop that copies its batch (1 MiB) to the device and binds it to the name
    /// the step before's had, so the new batch is made before the old one is freed: at the
    /// step's start (`loader` false), or at its end for the next step, as `for batch in
    /// loader` does when the step is marked inside the loop (`loader` true). Between, two
    /// activations of 4 MiB. Every hand-out is checked clear of the batch carried in while it
    /// lives. Returns the batch carried out.
    fn batch_step(planned: &mut Planned, source: &mut FakeSource, carried_in: Option<Served>, loader: bool) -> Served {
        let clear_of =
            |ptr: CUdeviceptr, size: u64| carried_in.is_none_or(|b| b.ptr + MIB <= ptr || ptr + size <= b.ptr);
        planned.begin_step();
        let mut batch = None;
        if !loader {
            let b = planned.allocate(source, MIB).unwrap();
            assert!(clear_of(b.ptr, MIB));
            batch = Some(b);
        }
        let a1 = planned.allocate(source, 4 * MIB).unwrap();
        let a2 = planned.allocate(source, 4 * MIB).unwrap();
        assert!(clear_of(a1.ptr, 4 * MIB) && clear_of(a2.ptr, 4 * MIB));
        planned.free(source, a2, 4 * MIB).unwrap();
        planned.free(source, a1, 4 * MIB).unwrap();
        if loader {
            let b = planned.allocate(source, MIB).unwrap();
            assert!(clear_of(b.ptr, MIB));
            batch = Some(b);
        }
        if let Some(old) = carried_in {
            planned.free(source, old, MIB).unwrap();
        }
        let batch = batch.expect("a batch made");
        let out = Served { ptr: batch.ptr, slot: planned.carry(batch, MIB).expect("carried") };
        planned.reset(source, u64::MAX).unwrap();
        out
    }

    #[test]
    fn a_batch_made_before_the_one_carried_in_is_freed_alternates_between_two_places() {
        // Made at the step's start, before anything is freed, the batch is taken for one the
        // next step makes again before freeing the one it receives: the first plan gives it two
        // places. Made at the end, the first plan guesses it freed first, and the first step
        // that finds it in the plan's place deviates at the batch; the plan made from that step
        // has the two places. (Without ranges that plan, pinned where best fit put the batch in
        // the deviating step, needs 11 MiB, and a slab of the pool cannot be taken again while
        // carried memory lives in it: its steps deviate.)
        for (loader, vmm) in [(false, false), (false, true), (true, true)] {
            let mut source = if vmm { FakeSource::with_ranges(64 * MIB) } else { FakeSource::new(64 * MIB) };
            let mut planned = carrying();
            let mut batch = batch_step(&mut planned, &mut source, None, loader);
            if loader {
                let mut deviations = 0;
                for _ in 0..2 {
                    batch = batch_step(&mut planned, &mut source, Some(batch), loader);
                    deviations += planned.plan_stats().unwrap().deviations;
                }
                assert_eq!(deviations, 1, "vmm {vmm}: the guess is wrong once");
            }
            let mut places = Vec::new();
            for _ in 0..5 {
                batch = batch_step(&mut planned, &mut source, Some(batch), loader);
                places.push(batch.ptr);
                let stats = planned.plan_stats().unwrap();
                assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 0, 0), "loader {loader}, vmm {vmm}");
            }
            assert!(places.windows(2).all(|w| w[0] != w[1]), "two places in turn: {places:x?}");
            assert!(places.windows(3).all(|w| w[0] == w[2]), "two places in turn: {places:x?}");
            let plan = &planned.plans[0];
            assert_eq!(plan.alternates.len(), 1, "{plan:?}");
            // The activations' 8 MiB and the two batches.
            assert_eq!(plan.bytes, 10 * MIB, "loader {loader}, vmm {vmm}: {plan:?}");
            planned.free(&mut source, batch, MIB).unwrap();
            planned.reset(&mut source, 0).unwrap();
            assert!(planned.carried.is_empty());
        }
    }

    #[test]
    fn a_batch_of_a_new_shape_is_made_at_the_lowest_free_range_while_the_one_before_lives() {
        // Every step another shape, so every step is served best fit in the range: a batch made
        // before the step before's and its gradients are freed, then three activations, then
        // gradients made as the activations go, carried with the batch into the next step. The
        // batch goes to the lowest free range between what was carried in, not the smallest: in
        // a gap between the gradients it would split the room the activations need once those
        // are freed (the second step's batch: at 1 MiB, not in the 2 MiB gap at 7).
        let mut source = FakeSource::with_ranges(256 * MIB);
        let mut planned = carrying();
        let mut carried: Vec<(Served, u64)> = Vec::new();
        for step in 0..8u64 {
            planned.begin_step();
            let batch_size = MIB - step * 64 * 1024;
            let activation = 4 * MIB + step * 768 * 1024;
            let batch = planned.allocate(&mut source, batch_size).unwrap();
            let base = planned.slab.expect("a slab").base;
            let mut live: Vec<(u64, u64)> = carried.iter().map(|&(served, size)| (served.ptr - base, size)).collect();
            live.sort_unstable();
            let mut lowest = 0;
            for (offset, size) in live {
                if offset >= lowest + batch_size {
                    break;
                }
                lowest = lowest.max(offset + size);
            }
            assert_eq!(batch.ptr - base, lowest, "step {step}");
            for (served, size) in carried.drain(..) {
                planned.free(&mut source, served, size).unwrap();
            }
            let x: Vec<Served> = (0..3).map(|_| planned.allocate(&mut source, activation).unwrap()).collect();
            let mut gradients = Vec::new();
            for &served in x.iter().rev() {
                planned.free(&mut source, served, activation).unwrap();
                gradients.push(planned.allocate(&mut source, MIB).unwrap());
            }
            for (served, size) in std::iter::once((batch, batch_size)).chain(gradients.into_iter().map(|g| (g, MIB))) {
                carried.push((Served { ptr: served.ptr, slot: planned.carry(served, size).expect("carried") }, size));
            }
            planned.reset(&mut source, u64::MAX).unwrap();
            assert_eq!(planned.plan_stats().unwrap().planned, 0, "step {step} served online");
        }
    }

    /// Hands out `size` and checks it against every range in `live`, which it joins.
    /// Frees `served` (of `size`) and takes it off `live` ([`allocate_apart`]).
    fn free_apart(
        planned: &mut Planned,
        source: &mut FakeSource,
        live: &mut Vec<(Served, u64)>,
        served: Served,
        size: u64,
    ) {
        planned.free(source, served, size).unwrap();
        live.retain(|&(other, _)| other.ptr != served.ptr);
    }

    fn allocate_apart(
        planned: &mut Planned,
        source: &mut FakeSource,
        live: &mut Vec<(Served, u64)>,
        size: u64,
    ) -> Served {
        let served = planned.allocate(source, size).unwrap();
        for &(other, len) in live.iter() {
            assert!(
                other.ptr + len <= served.ptr || served.ptr + size <= other.ptr,
                "{size} bytes at {:#x} over {len} at {:#x}",
                served.ptr,
                other.ptr
            );
        }
        live.push((served, size));
        served
    }

    #[test]
    fn batches_carried_across_steps_of_several_shapes_never_overlap_live_memory() {
        // Steps of three shapes, the first two beginning alike (a scope that starts from one's
        // plan switches to the other's at its second allocation), each copying a batch first
        // and freeing the one carried in after: wherever a plan or best fit put the batch,
        // nothing is handed out over live memory.
        let shapes: [&[u64]; 3] = [&[MIB, 2 * MIB, MIB], &[MIB, MIB, 3 * MIB], &[2 * MIB, 4 * MIB]];
        for vmm in [false, true] {
            for seed in 0..64u64 {
                let mut source = if vmm { FakeSource::with_ranges(256 * MIB) } else { FakeSource::new(256 * MIB) };
                let mut planned = carrying();
                let mut carried: Option<(Served, u64)> = None;
                let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let (mut alternated, mut switched) = (0, 0);
                for _ in 0..24 {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let shape = shapes[(state >> 33) as usize % shapes.len()];
                    planned.begin_step();
                    let mut live: Vec<(Served, u64)> = carried.into_iter().collect();
                    let batch_size = MIB / 2 * (1 + (state >> 40) % 2);
                    let batch = allocate_apart(&mut planned, &mut source, &mut live, batch_size);
                    if let Some((old, len)) = carried.take() {
                        alternated += u64::from(batch.ptr != old.ptr && planned.plan.is_some());
                        planned.free(&mut source, old, len).unwrap();
                        live.retain(|&(served, _)| served.ptr != old.ptr);
                    }
                    let before = planned.plan;
                    let temporaries: Vec<(Served, u64)> = shape
                        .iter()
                        .map(|&size| (allocate_apart(&mut planned, &mut source, &mut live, size), size))
                        .collect();
                    switched += u64::from(before.is_some() && planned.plan != before);
                    for (served, size) in temporaries.into_iter().rev() {
                        planned.free(&mut source, served, size).unwrap();
                    }
                    let slot = planned.carry(batch, batch_size).expect("carried");
                    carried = Some((Served { ptr: batch.ptr, slot }, batch_size));
                    planned.reset(&mut source, u64::MAX).unwrap();
                }
                assert!(alternated > 0, "seed {seed}: no batch at a second place");
                let _ = switched;
            }
        }
    }

    #[test]
    fn a_plan_that_moves_keeps_a_batchs_two_places_apart_from_live_memory() {
        // `carrying_step`'s gradients, whose first plan moves, and a batch copied between the two
        // activations and freed by the next step after its own: from the step the move hands
        // over to on, the batch takes its two places in turn, every hand-out clear of what lives.
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let (mut grads, mut batch): (Vec<Served>, Option<Served>) = (Vec::new(), None);
        let mut stats = Vec::new();
        for _ in 0..6 {
            planned.begin_step();
            let mut live: Vec<(Served, u64)> =
                grads.iter().map(|&g| (g, 2 * MIB)).chain(batch.map(|b| (b, MIB))).collect();
            let a1 = allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB);
            let b = allocate_apart(&mut planned, &mut source, &mut live, MIB);
            let a2 = allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB);
            for g in grads.drain(..) {
                planned.free(&mut source, g, 2 * MIB).unwrap();
            }
            if let Some(old) = batch.take() {
                planned.free(&mut source, old, MIB).unwrap();
            }
            let t = planned.allocate(&mut source, 4 * MIB).unwrap();
            planned.free(&mut source, t, 4 * MIB).unwrap();
            planned.free(&mut source, a2, 4 * MIB).unwrap();
            let g1 = planned.allocate(&mut source, 2 * MIB).unwrap();
            planned.free(&mut source, a1, 4 * MIB).unwrap();
            let g2 = planned.allocate(&mut source, 2 * MIB).unwrap();
            grads = [g1, g2].map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).unwrap() }).to_vec();
            batch = Some(Served { ptr: b.ptr, slot: planned.carry(b, MIB).unwrap() });
            planned.reset(&mut source, u64::MAX).unwrap();
            let s = planned.plan_stats().unwrap();
            stats.push((s.moves, s.deviations, planned.plans[0].alternates.len()));
        }
        // The first plan moves at the second step's start.
        assert_eq!(
            (stats[0], stats[1].0),
            ((0, 0, 1), 1),
            "the first plan moves, the batch with two places: {stats:?}"
        );
        assert!(stats[1..].iter().all(|&(_, deviations, places)| deviations == 0 && places == 1), "{stats:?}");
    }

    /// `steps` steps of a loop that copies its batch (1 MiB) to the device at the step's start,
    /// bound to the name the step before's had (made before that one is freed), then makes
    /// `activations` activations of 4 MiB and frees them in turn, making a 2 MiB gradient after
    /// each free; the gradients the step before made are freed right after the copy
    /// (`zero_grad()` first) or after the forward pass (`zero_grad()` between the passes). Every
    /// hand-out is checked clear of everything live. Per step: the plan's bytes in MiB, and the
    /// scopes that deviated and the replans of its report; and whether the phase moved.
    fn batch_copy_loop(steps: usize, activations: usize, zero_grad_first: bool) -> (Vec<(u64, u64, u64)>, bool) {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let (mut grads, mut batch): (Vec<Served>, Option<Served>) = (Vec::new(), None);
        let mut per_step = Vec::new();
        for _ in 0..steps {
            planned.begin_step();
            let mut live: Vec<(Served, u64)> =
                grads.iter().map(|&g| (g, 2 * MIB)).chain(batch.map(|b| (b, MIB))).collect();
            let b = allocate_apart(&mut planned, &mut source, &mut live, MIB);
            if let Some(old) = batch.take() {
                free_apart(&mut planned, &mut source, &mut live, old, MIB);
            }
            if zero_grad_first {
                for g in grads.drain(..) {
                    free_apart(&mut planned, &mut source, &mut live, g, 2 * MIB);
                }
            }
            let mut forward: Vec<Served> =
                (0..activations).map(|_| allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB)).collect();
            for g in grads.drain(..) {
                free_apart(&mut planned, &mut source, &mut live, g, 2 * MIB);
            }
            let mut made = Vec::new();
            while let Some(a) = forward.pop() {
                free_apart(&mut planned, &mut source, &mut live, a, 4 * MIB);
                made.push(allocate_apart(&mut planned, &mut source, &mut live, 2 * MIB));
            }
            grads = made.into_iter().map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).unwrap() }).collect();
            batch = Some(Served { ptr: b.ptr, slot: planned.carry(b, MIB).unwrap() });
            planned.reset(&mut source, u64::MAX).unwrap();
            let stats = planned.plan_stats().unwrap();
            per_step.push((planned.plans[0].bytes / MIB, stats.deviated_scopes, stats.replans));
        }
        (per_step, planned.retired.is_some())
    }

    #[test]
    fn a_first_plan_after_a_batch_copy_guesses_the_gradients_freed_right_after_it() {
        // The most common loop, its batch copied to the device in the step: the copy first, then
        // `zero_grad()` frees the gradients the step before made, then the forward and backward
        // passes. The recording has seen no free of the gradients; guessed freed at the next
        // step's peak, as between the passes, the first plan kept their place from the forward
        // pass, and every later plan, pinned where that one put them, held 12 MiB where the step
        // needs 10 (its activations and the batch's two places).
        let per_step = batch_copy_loop(4, 2, true).0;
        assert!(per_step.iter().all(|&(bytes, deviated, _)| (bytes, deviated) == (10, 0)), "{per_step:?}");
    }

    #[test]
    fn a_guess_proved_early_by_gradients_freed_between_the_passes_is_corrected() {
        // The batch copied in the step, then the forward pass, then `zero_grad()` and the
        // backward pass. The recording cannot tell this loop from the one that calls
        // `zero_grad()` right after the copy, and the first plan guesses that one: freed right
        // after the copy, the gradients lie where it puts the forward pass. Four activations:
        // moving would not pay, even for the later free. The second step, still holding the
        // gradients there, corrects the plan twice (freed at its peak, then before the first
        // gradient is made again) instead of leaving it and going on best fit.
        let (per_step, moved) = batch_copy_loop(5, 4, false);
        // The second step: corrected twice and made again at its end, three plans, and no
        // deviation (left on its first plan, it deviated at its first activation).
        assert!(!moved, "{per_step:?}");
        assert_eq!(per_step[1], (30, 0, 3), "{per_step:?}");
        assert!(per_step[2..].iter().all(|&step| step == (30, 0, 0)), "{per_step:?}");
    }

    #[test]
    fn a_first_plan_guessing_an_early_free_moves_where_a_later_one_would_pay() {
        // The loop above with three activations: under its guess (the gradients freed right
        // after the copy) the plan pinned where the recording left them is as small as the
        // moved one, and it stayed; corrected in the second step, every plan after it held
        // 23 MiB. Weighed as if the gradients lived to the plan's peak, the move pays, and is
        // valid for either free: from the second step on, 20 MiB, no deviation, no correction.
        let (per_step, moved) = batch_copy_loop(5, 3, false);
        assert!(moved, "{per_step:?}");
        assert!(per_step[1..].iter().all(|&(bytes, deviated, _)| (bytes, deviated) == (20, 0)), "{per_step:?}");
        assert!(per_step[2..].iter().all(|&(_, _, replans)| replans == 0), "{per_step:?}");
        // With `zero_grad()` right after the copy, as guessed, the move costs nothing: 15 MiB
        // either way.
        let (first, moved) = batch_copy_loop(5, 3, true);
        assert!(first[1..].iter().all(|&(bytes, deviated, _)| (bytes, deviated) == (15, 0)), "{first:?} {moved}");
    }

    #[test]
    fn a_move_waits_for_a_step_that_follows_its_plan() {
        // `carrying_step`'s first plan moves. A second step of another shape (its first
        // activation 6 MiB) does not follow it: nothing moves, the pinned plan takes the moved
        // one's place, and the step goes on best fit around the gradients where they lie.
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let carried = carrying_step(&mut planned, &mut source, &[]);
        let moved = (planned.plans[0].offsets.clone(), planned.plans[0].bytes);
        let old = planned.slab.expect("the recording's range");
        assert_eq!((planned.unmoved.is_some(), moved.1), (true, 12 * MIB));
        carrying_step_seen(&mut planned, &mut source, &carried, 6 * MIB, |planned, _| {
            assert!(planned.retired.is_none() && planned.unmoved.is_none());
            assert_eq!(planned.slab.map(|slab| slab.base), Some(old.base));
            let pinned = planned.plans.iter().find(|plan| plan.sizes[0] == 4 * MIB).expect("the first shape's plan");
            assert!(pinned.offsets != moved.0 && pinned.bytes == 14 * MIB, "{pinned:?}");
        });
        assert_eq!(planned.plan_stats().unwrap().moves, 0);
    }

    #[test]
    fn a_phase_of_gradients_alone_gives_none_two_places_and_a_wrong_guess_is_made_again() {
        // Gradients made in one step and freed by the next before it makes its own, in a phase
        // that frees nothing else: one place each, 8 MiB.
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let mut grads: Vec<Served> = Vec::new();
        for _ in 0..4 {
            planned.begin_step();
            for g in grads.drain(..) {
                planned.free(&mut source, g, 2 * MIB).unwrap();
            }
            let made: Vec<Served> = (0..4).map(|_| planned.allocate(&mut source, 2 * MIB).unwrap()).collect();
            grads = made.into_iter().map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).unwrap() }).collect();
            planned.reset(&mut source, u64::MAX).unwrap();
            assert!(planned.plans.iter().all(|plan| plan.alternates.is_empty()), "{:?}", planned.plans);
        }
        assert_eq!(planned.plans[0].bytes, 8 * MIB);
        // A step that makes a buffer first, frees a temporary, then frees what it received before
        // making the buffer again: the first plan guesses two places for the buffer; the step it
        // serves shows the buffer freed first, and the plan is made again with one.
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let mut carried: Option<Served> = None;
        let mut sizes = Vec::new();
        for _ in 0..4 {
            planned.begin_step();
            if let Some(old) = carried.take() {
                planned.free(&mut source, old, 2 * MIB).unwrap();
            }
            let buffer = planned.allocate(&mut source, 2 * MIB).unwrap();
            let t = planned.allocate(&mut source, 4 * MIB).unwrap();
            planned.free(&mut source, t, 4 * MIB).unwrap();
            carried = Some(Served { ptr: buffer.ptr, slot: planned.carry(buffer, 2 * MIB).unwrap() });
            planned.reset(&mut source, u64::MAX).unwrap();
            sizes.push((planned.plans[0].alternates.len(), planned.plans[0].guessed, planned.plans[0].bytes));
        }
        assert_eq!(sizes[0], (1, true, 8 * MIB), "{sizes:?}");
        assert!(sizes[1..].iter().all(|&s| s == (0, false, 6 * MIB)), "{sizes:?}");
    }

    #[test]
    fn a_plan_moves_to_a_new_range_leaving_the_carried_memory_where_it_lies_until_freed() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let carried = carrying_step(&mut planned, &mut source, &[]);
        let old = planned.slab.expect("the recording's range");
        assert!(planned.retired.is_none() && planned.unmoved.is_some(), "the move waits for the next step");
        // At the next step's first allocation, which follows the plan, the recording's range
        // keeps the gradients' pages only (4 MiB) and nothing serves from it: the step maps a
        // new one as its plan reaches (4 MiB for that first allocation).
        let next = carrying_step_seen(&mut planned, &mut source, &carried, 4 * MIB, |planned, source| {
            let retired = planned.retired.expect("the slab retired");
            assert_eq!(retired.base, old.base);
            assert!(carried.iter().all(|g| g.ptr >= old.base && g.ptr < old.base + retired.size));
            assert_ne!(planned.slab.expect("a new range").base, old.base);
            assert_eq!((planned.retired_mapped, source.held()), (4 * MIB, 8 * MIB));
        });
        let new = planned.slab.expect("a new range");
        assert_ne!(new.base, old.base);
        assert!(next.iter().all(|g| g.ptr >= new.base + 8 * MIB && g.ptr + 2 * MIB <= new.base + new.size));
        // Freed in that step, the gradients took the old range's pages with them; its addresses
        // stay reserved, nothing mapped, and the phase does not move again.
        assert_eq!(planned.retired.map(|r| (r.base, r.size)), Some((old.base, 0)));
        assert_eq!((planned.retired_mapped, source.ranges[&old.base]), (0, 0));
        assert_eq!(source.held(), 12 * MIB);
        for _ in 0..2 {
            carrying_step(&mut planned, &mut source, &[]);
        }
        assert_eq!((planned.plan_stats().unwrap().moves, planned.slab.unwrap().base), (0, new.base));
        planned.release_all(&mut source).unwrap();
        assert!(source.ranges.is_empty(), "both ranges given back: {:?}", source.ranges);
    }

    #[test]
    fn a_retired_range_whose_memory_the_pool_released_unfreed_gives_its_pages_back_at_the_reset() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        let _carried = carrying_step(&mut planned, &mut source, &[]);
        let old = planned.slab.expect("the recording's range");
        // A step that never frees what it received (a free the pool could not pass on): at its
        // reset nothing carried lives in the old range any more.
        carrying_step_seen(&mut planned, &mut source, &[], 4 * MIB, |planned, _| {
            assert_eq!((planned.retired.map(|r| r.base), planned.retired_mapped), (Some(old.base), 4 * MIB));
        });
        assert_eq!((planned.retired_mapped, source.ranges[&old.base]), (0, 0));
        assert_eq!(planned.touched(), Some(12 * MIB));
    }

    /// Where a bin lent by another pool lies in the tests: far from any range of the fake source.
    const BIN_AT: CUdeviceptr = 3 << 50;

    #[test]
    fn a_bin_holds_the_entries_past_the_plans_last_granule_and_the_slab_maps_a_page_less() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        let sizes = [4 * MIB, MIB / 2];
        assert_eq!(planned.bin(), Some((None, false)), "no bin wanted before a plan exists");
        live_scope(&mut planned, &mut source, &sizes);
        assert_eq!(planned.plans[0].bytes, 9 * MIB / 2);
        assert_eq!(planned.bin(), Some((None, true)));
        let bin = Bin { ptr: BIN_AT, len: MIB };
        planned.set_bin(Some(bin));
        for _ in 0..2 {
            let (ptrs, slab) = live_scope(&mut planned, &mut source, &sizes);
            assert_eq!(ptrs, vec![slab.base, BIN_AT], "the half MiB past 4 MiB is served in the bin");
            assert_eq!(slab.size, 4 * MIB, "two pages mapped, not three");
            let stats = planned.plan_stats().unwrap();
            assert_eq!((stats.planned, stats.deviations), (2, 0));
        }
        // Without the bin the plan maps its own packing again.
        planned.set_bin(None);
        let (ptrs, slab) = live_scope(&mut planned, &mut source, &sizes);
        assert_eq!(ptrs, vec![slab.base, slab.base + 4 * MIB]);
        assert_eq!(slab.size, 6 * MIB);
        // A bin too small for what lies past the boundary changes nothing.
        planned.set_bin(Some(Bin { ptr: BIN_AT, len: MIB / 4 }));
        let (ptrs, slab) = live_scope(&mut planned, &mut source, &sizes);
        assert_eq!((ptrs[1], slab.size), (slab.base + 4 * MIB, 6 * MIB));
    }

    #[test]
    fn a_scope_served_online_takes_a_small_request_in_the_bin_when_its_range_there_is_smallest() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        live_scope(&mut planned, &mut source, &[3 * MIB, MIB]);
        planned.set_bin(Some(Bin { ptr: BIN_AT, len: MIB }));
        // A new shape: served best-fit online. The 3 MiB request fits only the slab; the quarter
        // and the half MiB find no free range in the slab but its end, which is taken last, and
        // go to the bin.
        let (ptrs, slab) = live_scope(&mut planned, &mut source, &[3 * MIB, MIB / 4, MIB / 2]);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned), (1, 2), "the first size matches the plan's, the next do not");
        assert_eq!(ptrs, vec![slab.base, BIN_AT, BIN_AT + MIB / 4]);
        // Once the bin is full, the slab serves.
        let (ptrs, slab) = live_scope(&mut planned, &mut source, &[3 * MIB, MIB / 2, MIB / 2, MIB / 2]);
        assert_eq!(ptrs, vec![slab.base, BIN_AT, BIN_AT + MIB / 2, slab.base + 3 * MIB]);
    }

    #[test]
    fn the_boundary_maps_nothing_ahead_of_the_next_scope_and_a_plan_maps_as_its_cursor_reaches_entries() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        let sizes = [MIB, 2 * MIB, 16 * MIB, 16 * MIB];
        live_scope(&mut planned, &mut source, &sizes);
        assert_eq!(planned.plans[0].bytes, 35 * MIB);
        assert_eq!((source.mapped(), source.holding), (36 * MIB, true), "the recording's pages wait");
        // Another phase takes memory at the boundary (the optimizer state after a first step):
        // as much goes back first, from the top, and the plan is not mapped ahead.
        let state = another_pool_takes(&mut planned, &mut source, 28 * MIB);
        assert_eq!((source.mapped(), source.holding), (8 * MIB, true));
        planned.begin_step();
        let mut ptrs = Vec::new();
        let mut mapped = Vec::new();
        for &size in &sizes {
            ptrs.push(planned.allocate(&mut source, size).unwrap());
            mapped.push(source.mapped());
        }
        assert_eq!(mapped, [8 * MIB, 8 * MIB, 20 * MIB, 36 * MIB], "each entry past the pages left maps up to its end");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (4, 0), "served from the plan throughout");
        for (&ptr, &size) in ptrs.iter().zip(&sizes).rev() {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(source.mapped(), 36 * MIB, "a plan that served keeps its pages for the next scope");
        source.free(state, 28 * MIB).unwrap();
    }

    #[test]
    fn a_smaller_shape_after_the_largest_is_placed_from_the_range_start_not_at_the_larger_plans_offsets() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        // The first scope is the largest (a longer first batch); the next has another shape whose
        // first sizes the first plan's dominate, each buffer smaller.
        live_scope(&mut planned, &mut source, &[MIB, 2 * MIB, 16 * MIB, 16 * MIB]);
        let state = another_pool_takes(&mut planned, &mut source, 12 * MIB);
        let small = [MIB / 2, MIB, 4 * MIB, 4 * MIB];
        planned.begin_step();
        let ptrs: Vec<_> = small.iter().map(|&size| planned.allocate(&mut source, size).unwrap()).collect();
        let base = planned.slab.unwrap().base;
        let offsets: Vec<_> = ptrs.iter().map(|served| served.ptr - base).collect();
        assert_eq!(offsets, [0, MIB / 2, 3 * MIB / 2, 11 * MIB / 2], "best fit from the range's start");
        assert_eq!(source.mapped(), 24 * MIB, "in the pages left mapped, less the other phase's: none mapped");
        assert_eq!(source.held(), 36 * MIB, "beside the other phase's memory");
        for (&ptr, &size) in ptrs.iter().zip(&small).rev() {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(planned.plans.len(), 2, "it recorded its own plan");
        // The same small shape again: served from its own plan.
        let (again, _) = live_scope(&mut planned, &mut source, &small);
        assert_eq!(again, ptrs.iter().map(|served| served.ptr).collect::<Vec<_>>());
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (4, 0));
        source.free(state, 12 * MIB).unwrap();
    }

    #[test]
    fn each_size_is_read_as_the_power_of_the_first_sizes_ratio_that_takes_it_across() {
        const KIB: u64 = 1 << 10;
        // A batch twice as large: the input and the activations in proportion, a gradient the
        // same, attention scores over a doubled length in its square, a tiny buffer any of them.
        let small = [64 * KIB, 3 * MIB, MIB, 256 * KIB, 512];
        let large = [128 * KIB, 6 * MIB, MIB, MIB, 512];
        assert_eq!(size_exponents(&small, &large), Some(vec![1, 1, 0, 2, 2]));
        assert_eq!(size_exponents(&large, &small), Some(vec![1, 1, 0, 2, 2]), "and back");
        let rounded = [64 * KIB, 3 * MIB + 512];
        assert_eq!(size_exponents(&rounded, &[128 * KIB, 6 * MIB + 512]), Some(vec![1, 1]), "within the rounding");
        assert_eq!(size_exponents(&small[..2], &[128 * KIB, 5 * MIB]), None, "a size no power explains");
        assert_eq!(size_exponents(&small, &small), None, "first sizes alike say nothing");
        assert_eq!(size_exponents(&small, &large[..4]), None, "another sequence");
    }

    /// One scope of a batch of `k`: `a` (the input, 2k MiB) and `b` (1 MiB whatever the batch)
    /// overlap, then `c` (3k MiB) comes after `a` is freed, while `b` lives. Best fit in
    /// allocation order cannot put `c` where `a` was; a packing puts `a` over `c`'s place.
    fn batch(k: u64) -> [Op; 4] {
        [Op::Alloc(2 * k * MIB), Op::Alloc(MIB), Op::Free(0), Op::Alloc(3 * k * MIB)]
    }

    #[test]
    fn a_batch_larger_than_any_seen_is_served_from_a_plan_predicted_from_two_smaller_ones() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        let extent = |ptrs: &[CUdeviceptr], base: CUdeviceptr, k: u64| {
            let sizes = [2 * k * MIB, MIB, 3 * k * MIB];
            ptrs.iter().zip(sizes).map(|(&ptr, size)| ptr - base + size).max().unwrap()
        };
        run_ops(&mut planned, &mut source, &batch(1));
        let base = planned.slab.unwrap().base;
        let ptrs = run_ops(&mut planned, &mut source, &batch(2));
        assert_eq!(extent(&ptrs, base, 2), 11 * MIB, "a second shape: best fit from the range's start");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned), (0, 3), "one plan of the sequence: nothing predicted");
        // Two plans of one sequence read `a` and `c` as in proportion to the batch, `b` as not.
        let ptrs = run_ops(&mut planned, &mut source, &batch(4));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 0, 0), "served from the prediction");
        assert_eq!(extent(&ptrs, base, 4), 13 * MIB, "the packing: `a` where `c` goes, where best fit holds 21 MiB");
        assert_eq!(planned.plans.len(), 3, "the prediction went, the scope's own plan was made");
        assert!(planned.plans.iter().all(|plan| !plan.predicted));
        assert!(planned.saved_plans().iter().all(|saved| saved.blocks.len() == 3));
        // Served from its own plan the next time.
        run_ops(&mut planned, &mut source, &batch(4));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned), (3, 0));
    }

    /// A scope of a batch of `k`, long enough to have a prefix ([`IN_ORDER_PREFIX`]): a first
    /// buffer of 64k KiB and one of 512 B, each freed at once (the prefix), then [`batch`]'s
    /// `a`, `b` and `c`, then 512 B allocations, each freed at once, to 32 in all.
    fn long_batch(k: u64) -> Vec<Op> {
        let mut ops = vec![Op::Alloc(k * (64 << 10)), Op::Free(0), Op::Alloc(512), Op::Free(1)];
        ops.extend([Op::Alloc(2 * k * MIB), Op::Alloc(MIB), Op::Free(2), Op::Alloc(3 * k * MIB)]);
        for index in 5..32 {
            ops.extend([Op::Alloc(512), Op::Free(index)]);
        }
        ops
    }

    #[test]
    fn a_batch_larger_than_the_one_plan_is_predicted_once_it_follows_that_plans_sequence() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        run_ops(&mut planned, &mut source, &long_batch(1));
        let base = planned.slab.unwrap().base;
        // Twice the batch, and one plan of the sequence: its prefix (two allocations) is served
        // best fit and read against the plan, the rest from the plan predicted at its end.
        let ptrs = run_ops(&mut planned, &mut source, &long_batch(2));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (30, 2, 0), "the prefix online, then the plan");
        let offsets: Vec<u64> = ptrs[2..5].iter().map(|&ptr| ptr - base).collect();
        assert_eq!(offsets, [0, 6 * MIB, 0], "`c` where `a` was, `b` above: 7 MiB where best fit holds 11");
        assert_eq!(source.mapped(), 8 * MIB);
        assert_eq!(planned.plans.len(), 2, "the prediction went, the scope's own plan was made");
        assert!(planned.plans.iter().all(|plan| !plan.predicted));
        run_ops(&mut planned, &mut source, &long_batch(2));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned), (32, 0), "served from its own plan the next time");
    }

    #[test]
    fn a_larger_batch_that_leaves_the_one_plans_sequence_in_its_prefix_is_served_best_fit() {
        let mut twice = long_batch(2);
        // The second allocation of a size no power of the ratio explains.
        let mut resized = twice.clone();
        resized[2] = Op::Alloc(4096);
        // The first allocation freed after the second is made.
        twice.swap(1, 2);
        // Where the plan frees the first two allocations in order, the scope frees them the
        // other way round (its allocations keep their places among its events).
        let in_order = |k: u64| {
            let mut ops = long_batch(k);
            ops.swap(1, 2);
            ops
        };
        let mut reversed = in_order(2);
        reversed.swap(2, 3);
        // The first allocation past the prefix made before the prefix's last free.
        let mut early = long_batch(2);
        early.swap(3, 4);
        for (first, scope, why) in [
            (long_batch(1), resized, "a size that is not the plan's times the ratio"),
            (long_batch(1), twice, "an allocation out of the plan's order"),
            (in_order(1), reversed, "a free out of the plan's order"),
            (long_batch(1), early, "the allocation past the prefix out of the plan's order"),
            (long_batch(1), long_batch(3), "a ratio past the bound"),
        ] {
            let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
            run_ops(&mut planned, &mut source, &first);
            run_ops(&mut planned, &mut source, &scope);
            let stats = planned.plan_stats().unwrap();
            assert_eq!((stats.planned, stats.unplanned, stats.deviations), (0, 32, 0), "{why}: best fit throughout");
            assert!(planned.template.is_none() && planned.plans.iter().all(|plan| !plan.predicted), "{why}");
        }
    }

    #[test]
    fn a_first_size_of_a_few_hundred_bytes_still_sets_the_ratio() {
        // 512 B then 1 KiB first: a size that small agrees with the square of the ratio too, but
        // the ratio is the first sizes' own.
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        let tiny =
            |k: u64| [Op::Alloc(512 * k), Op::Alloc(2 * k * MIB), Op::Alloc(MIB), Op::Free(1), Op::Alloc(3 * k * MIB)];
        run_ops(&mut planned, &mut source, &tiny(1));
        run_ops(&mut planned, &mut source, &tiny(2));
        run_ops(&mut planned, &mut source, &tiny(4));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (4, 0, 0), "served from the prediction");
    }

    #[test]
    fn a_scope_that_is_not_the_predicted_sequence_leaves_the_prediction_and_goes_on_best_fit() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        run_ops(&mut planned, &mut source, &batch(1));
        run_ops(&mut planned, &mut source, &batch(2));
        // A larger first size, then a third allocation far smaller than its predicted 12 MiB.
        let ops = [Op::Alloc(8 * MIB), Op::Alloc(MIB), Op::Free(0), Op::Alloc(MIB / 2), Op::Alloc(4 * MIB)];
        planned.begin_step();
        let sizes = [8 * MIB, MIB, MIB / 2, 4 * MIB];
        let mut live: Vec<(Served, u64)> = Vec::new();
        let mut sized = sizes.iter();
        for op in ops {
            match op {
                Op::Alloc(size) => {
                    let served = planned.allocate(&mut source, size).unwrap();
                    assert_eq!(Some(&size), sized.next());
                    let (at, end) = (served.ptr, served.ptr + size);
                    assert!(live.iter().all(|&(other, len)| end <= other.ptr || other.ptr + len <= at), "no overlap");
                    live.push((served, size));
                }
                Op::Free(index) => {
                    let (served, size) = live.remove(index);
                    planned.free(&mut source, served, size).unwrap();
                }
            }
        }
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (2, 2, 1), "left at the smaller one");
        for (served, size) in live {
            planned.free(&mut source, served, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert!(planned.plans.iter().all(|plan| !plan.predicted), "the prediction is not kept");
    }

    #[test]
    fn a_plan_that_outgrows_its_slab_grows_it_in_place() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        let key = [512, 512];
        let (_, small) = live_scope(&mut planned, &mut source, &[key[0], key[1], 4 * MIB]);
        let allocs = source.allocs;
        // Same key, a larger last size (a longer sequence): the entry's grown range is not clear,
        // so the scope goes on best-fit in the slab, which grows at its end to hold it.
        let (ptrs, grown) = live_scope(&mut planned, &mut source, &[key[0], key[1], 20 * MIB]);
        assert_eq!(grown.base, small.base, "the same range");
        assert_eq!(source.allocs, allocs, "nothing taken from the pool: no second slab, no chunk");
        assert!(ptrs[2] >= grown.base && ptrs[2] < grown.base + RANGE_LIMIT, "in the range");
        assert!(grown.size >= 20 * MIB, "the new plan's slab holds the larger entry");
        // A smaller scope of another shape: served in the range and recorded; the range keeps the
        // larger plan's pages while it is one of the last eight, and gives back those past the
        // smaller plans at the boundary once it is not.
        let shrinks = source.shrinks;
        let (_, after) = live_scope(&mut planned, &mut source, &[1024, 1024, 4 * MIB]);
        assert_eq!((after.base, after.size, source.shrinks), (small.base, grown.size, shrinks));
        for _ in 0..RECENT_SCOPES_IN_RANGE {
            live_scope(&mut planned, &mut source, &[1024, 1024, 4 * MIB]);
        }
        let after = planned.slab.unwrap();
        assert_eq!(source.allocs, allocs);
        assert!(source.shrinks > shrinks, "pages given back");
        assert!(after.size < grown.size && source.mapped() == after.size, "{} mapped", source.mapped());
    }

    #[test]
    fn a_new_shape_keeps_its_freed_pages_until_the_device_needs_memory() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        live_scope(&mut planned, &mut source, &[MIB, MIB, 14 * MIB]);
        live_scope(&mut planned, &mut source, &[MIB, MIB, 14 * MIB]);
        assert_eq!(source.mapped(), 16 * MIB, "the plan, mapped as it served");
        // A new shape (its first size is larger than the plan's): served online from the range.
        planned.begin_step();
        let mut ptrs: Vec<_> = (0..8).map(|_| planned.allocate(&mut source, 2 * MIB).unwrap()).collect();
        assert_eq!(source.mapped(), 16 * MIB, "it fits the pages mapped");
        // Freed from the top (as a backward pass frees activations) and taken again: the pages
        // stay mapped, and no call reaches the driver.
        let (grows, shrinks, syncs) = (source.grows, source.shrinks, source.syncs);
        for _ in 0..3 {
            for &ptr in ptrs.iter().rev() {
                planned.free(&mut source, ptr, 2 * MIB).unwrap();
            }
            assert!(source.holding);
            let again: Vec<_> = (0..8).map(|_| planned.allocate(&mut source, 2 * MIB).unwrap()).collect();
            assert!(again.iter().zip(&ptrs).all(|(a, b)| a.ptr == b.ptr), "the same places");
            ptrs = again;
        }
        assert_eq!((source.grows, source.shrinks, source.mapped()), (grows, shrinks, 16 * MIB));
        for &ptr in ptrs.iter().rev() {
            planned.free(&mut source, ptr, 2 * MIB).unwrap();
        }
        // Another pool takes memory: as much goes back first, from the free end, in stream order
        // without a wait; the rest stays mapped until more is needed.
        let other = another_pool_takes(&mut planned, &mut source, 4 * MIB);
        assert_eq!((source.mapped(), source.syncs, source.holding), (12 * MIB, syncs, true));
        let more = another_pool_takes(&mut planned, &mut source, 64 * MIB);
        assert_eq!((source.mapped(), source.holding), (0, false));
        planned.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(planned.slab.unwrap().size, 0, "the next scope maps what its plan reaches");
        assert_eq!(source.allocs, 2, "no chunk");
        source.free(other, 4 * MIB).unwrap();
        source.free(more, 64 * MIB).unwrap();
    }

    #[test]
    fn with_ranges_a_new_shape_is_recorded_in_the_same_range() {
        let (mut source, mut planned) = (FakeSource::with_ranges(256 * MIB), planned());
        let (_, first) = live_scope(&mut planned, &mut source, &[4 * MIB, 4 * MIB]);
        let allocs = source.allocs;
        // Another shape (an evaluation pass): served online from the same range, and recorded.
        let (ptrs, second) = live_scope(&mut planned, &mut source, &[MIB, 2 * MIB]);
        assert_eq!(second.base, first.base);
        assert_eq!(ptrs[0], first.base, "best fit from the range's start");
        assert_eq!(source.allocs, allocs, "no chunk");
        assert_eq!(planned.plans.len(), 2, "recorded");
        assert_eq!(second.size, first.size, "the range keeps the pages of the recent, larger plan");
        planned.release_all(&mut source).unwrap();
        assert_eq!((source.held(), source.ranges.len()), (0, 0), "the range is given back whole");
    }

    fn is_out_of_memory<T: std::fmt::Debug>(result: Result<T>) -> bool {
        matches!(result, Err(Error::Driver(error)) if error.is_out_of_memory())
    }

    #[test]
    fn a_scope_served_online_gives_back_the_free_pages_inside_the_range_when_the_device_needs_them() {
        let (mut source, mut planned) = (FakeSource::with_ranges(16 * MIB), planned());
        live_scope(&mut planned, &mut source, &[MIB, MIB, 4 * MIB]);
        // A new shape, served online from the range: 4, 4 and 2 MiB end to end.
        planned.begin_step();
        let a = planned.allocate(&mut source, 4 * MIB).unwrap();
        let b = planned.allocate(&mut source, 4 * MIB).unwrap();
        let c = planned.allocate(&mut source, 2 * MIB).unwrap();
        let base = planned.slab.unwrap().base;
        assert_eq!((a.ptr - base, b.ptr - base, c.ptr - base), (0, 4 * MIB, 8 * MIB));
        assert_eq!(source.held(), 10 * MIB);
        // The stretch freed below live allocations keeps its pages, until another phase takes
        // memory: then they go back first, in stream order without a wait for the stream.
        let syncs = source.syncs;
        planned.free(&mut source, a, 4 * MIB).unwrap();
        assert_eq!((source.held(), source.holding), (10 * MIB, true));
        let other = another_pool_takes(&mut planned, &mut source, 8 * MIB);
        assert_eq!((source.held(), source.syncs), (14 * MIB, syncs));
        // 6 MiB more fit the device only at the range's end.
        assert!(is_out_of_memory(planned.allocate(&mut source, 6 * MIB)));
        assert_eq!(planned.release_unused(&mut source).unwrap(), 0, "the recovery finds no page left to give");
        source.free(other, 8 * MIB).unwrap();
        let other = source.alloc(4 * MIB).unwrap();
        let d = planned.allocate(&mut source, 6 * MIB).unwrap();
        assert_eq!((d.ptr - base, source.held()), (10 * MIB, 16 * MIB), "at the end of the range, the device full");
        let space = planned.free_space().unwrap();
        assert_eq!(space.total_free, 0, "the hole is not held");
        // The other phase lets go: an allocation placed in the hole maps its pages again.
        source.free(other, 4 * MIB).unwrap();
        let e = planned.allocate(&mut source, 4 * MIB).unwrap();
        assert_eq!((e.ptr, source.held()), (base, 16 * MIB), "best fit in the hole, its pages mapped again");
        for (ptr, size) in [(e, 4 * MIB), (d, 6 * MIB), (c, 2 * MIB), (b, 4 * MIB)] {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert!(source.holes.values().all(|pages| pages.is_empty()), "no hole outlives the scope");
        assert_eq!(source.mapped(), planned.slab.unwrap().size, "the slab is mapped in full for the next scope");
    }

    #[test]
    fn a_scope_served_online_from_an_empty_range_takes_the_free_range_at_its_end_last() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        // The first scope, recorded online from the empty range: 1 MiB maps a 2 MiB page, and
        // the page's rounding is the free range at the range's end.
        planned.begin_step();
        let a = planned.allocate(&mut source, MIB).unwrap();
        let b = planned.allocate(&mut source, MIB / 2).unwrap();
        let base = planned.slab.unwrap().base;
        assert_eq!((a.ptr - base, b.ptr - base, source.held()), (0, MIB, 2 * MIB));
        planned.free(&mut source, a, MIB).unwrap();
        // 256 KiB fit the 1 MiB freed below and the 512 KiB at the end, which best fit would
        // take (the smaller): it goes below, and the end stays free for the range to give back
        // or grow into.
        let c = planned.allocate(&mut source, MIB / 4).unwrap();
        assert_eq!(c.ptr, base, "the free range below, not the end");
        // 768 KiB: only the range below holds it, as 1 MiB would only at the end (grown).
        let d = planned.allocate(&mut source, 3 * MIB / 4).unwrap();
        assert_eq!(d.ptr - base, MIB / 4);
        let e = planned.allocate(&mut source, MIB / 2).unwrap();
        assert_eq!((e.ptr - base, source.held()), (3 * MIB / 2, 2 * MIB), "the end, when nothing else holds it");
        for (ptr, size) in [(b, MIB / 2), (c, MIB / 4), (d, 3 * MIB / 4), (e, MIB / 2)] {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
    }

    #[test]
    fn a_scope_online_around_carried_memory_alone_takes_the_free_range_at_its_end_last() {
        // A first step carries 1 MiB into the next, which is another shape: served online in
        // the range, where nothing of its own lives yet, as a first scope is.
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        planned.begin_step();
        let g = planned.allocate(&mut source, MIB).unwrap();
        let g = Served { ptr: g.ptr, slot: planned.carry(g, MIB).unwrap() };
        planned.reset(&mut source, u64::MAX).unwrap();
        planned.begin_step();
        let a = planned.allocate(&mut source, MIB / 2).unwrap();
        let b = planned.allocate(&mut source, MIB / 4).unwrap();
        let base = planned.slab.unwrap().base;
        assert!(planned.online.is_some());
        assert_eq!((g.ptr - base, a.ptr - base, b.ptr - base, source.held()), (0, MIB, 3 * MIB / 2, 2 * MIB));
        planned.free(&mut source, a, MIB / 2).unwrap();
        // 256 KiB fit the 512 KiB freed below and the 256 KiB at the end, which best fit would
        // take: it goes below, and the end stays free for the range to give back or grow into.
        let c = planned.allocate(&mut source, MIB / 4).unwrap();
        assert_eq!(c.ptr - base, MIB, "the free range below, not the end");
        for (ptr, size) in [(g, MIB), (b, MIB / 4), (c, MIB / 4)] {
            planned.free(&mut source, ptr, size).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
    }

    #[test]
    fn a_scope_served_online_gives_back_what_it_freed_before_it_grows() {
        let (mut source, mut planned) = (FakeSource::with_ranges(1024 * MIB), planned());
        // A first scope, recorded online in the range: 512 MiB in pages.
        planned.begin_step();
        let mut ptrs: Vec<_> = (0..256).map(|_| planned.allocate(&mut source, 2 * MIB).unwrap()).collect();
        assert_eq!(source.mapped(), 512 * MIB);
        // Pages freed below live allocations and taken again make no driver call.
        let (grows, shrinks, syncs) = (source.grows, source.shrinks, source.syncs);
        for _ in 0..100 {
            planned.free(&mut source, ptrs[100], 2 * MIB).unwrap();
            ptrs[100] = planned.allocate(&mut source, 2 * MIB).unwrap();
        }
        assert_eq!((source.grows, source.shrinks, source.mapped()), (grows, shrinks, 512 * MIB));
        // Two pages freed below, then 6 MiB that fit neither: before the range grows by 6 MiB,
        // the two freed pages go back, in stream order without a wait for the stream.
        planned.free(&mut source, ptrs[100], 2 * MIB).unwrap();
        planned.free(&mut source, ptrs[50], 2 * MIB).unwrap();
        let big = planned.allocate(&mut source, 6 * MIB).unwrap();
        assert_eq!((source.mapped(), source.syncs), (514 * MIB, syncs));
        assert_eq!(big.ptr - planned.slab.unwrap().base, 512 * MIB, "at the end");
        planned.free(&mut source, big, 6 * MIB).unwrap();
        for (i, &ptr) in ptrs.iter().enumerate().rev() {
            if i != 100 && i != 50 {
                planned.free(&mut source, ptr, 2 * MIB).unwrap();
            }
        }
        planned.reset(&mut source, u64::MAX).unwrap();
    }

    #[test]
    fn a_hole_that_joins_the_free_end_goes_with_it() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        live_scope(&mut planned, &mut source, &[MIB, MIB, 4 * MIB]);
        planned.begin_step();
        let ptrs: Vec<_> = (0..4).map(|_| planned.allocate(&mut source, 4 * MIB).unwrap()).collect();
        planned.free(&mut source, ptrs[2], 4 * MIB).unwrap();
        another_pool_takes(&mut planned, &mut source, 2 * MIB);
        assert_eq!(source.mapped(), 14 * MIB, "a page of the free stretch inside, as much as another pool took");
        another_pool_takes(&mut planned, &mut source, 2 * MIB);
        assert_eq!(source.mapped(), 12 * MIB, "and its second page");
        assert_eq!(planned.release_unused(&mut source).unwrap(), 0, "so memory pressure finds nothing more");
        // The allocation above the hole goes: the hole joins the free end, given back with it
        // when memory is next needed.
        planned.free(&mut source, ptrs[3], 4 * MIB).unwrap();
        another_pool_takes(&mut planned, &mut source, 4 * MIB);
        assert_eq!(planned.slab.unwrap().size, 8 * MIB);
        assert_eq!((source.mapped(), planned.free_space().unwrap().total_free), (8 * MIB, 0));
        for &ptr in ptrs[..2].iter().rev() {
            planned.free(&mut source, ptr, 4 * MIB).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert_eq!(source.mapped(), planned.slab.unwrap().size);
        assert!(source.holes.values().all(|pages| pages.is_empty()));
    }

    #[test]
    fn pages_past_the_live_allocations_go_back_and_the_plan_maps_them_as_its_cursor_reaches_them() {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
        let sizes = [4 * MIB, 2 * MIB, 2 * MIB];
        live_scope(&mut planned, &mut source, &sizes);
        // Served from its plan once, the slab keeps the plan mapped for the next scope.
        let (_, slab) = live_scope(&mut planned, &mut source, &sizes);
        assert_eq!(slab.size, 8 * MIB);
        planned.begin_step();
        let first = planned.allocate(&mut source, sizes[0]).unwrap();
        assert_eq!(first.ptr, slab.base);
        // Memory is short elsewhere: the pages past the live allocation go back.
        assert_eq!(planned.release_unused(&mut source).unwrap(), 4 * MIB);
        assert_eq!(source.mapped(), 4 * MIB);
        let second = planned.allocate(&mut source, sizes[1]).unwrap();
        assert_eq!(source.mapped(), 6 * MIB, "mapped as far as the entry reaches, not the whole plan");
        let third = planned.allocate(&mut source, sizes[2]).unwrap();
        assert_eq!(source.mapped(), 8 * MIB);
        assert_eq!((second.ptr - slab.base, third.ptr - slab.base), (4 * MIB, 6 * MIB), "at the planned offsets");
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 0, 0));
    }

    #[test]
    fn a_plan_the_device_refuses_whole_is_mapped_as_its_cursor_reaches_each_entry() {
        let (mut source, mut planned) = (FakeSource::with_ranges(16 * MIB), planned());
        let sizes = [4 * MIB, 2 * MIB, 2 * MIB];
        live_scope(&mut planned, &mut source, &sizes);
        // Idle, the slab goes back; another phase takes most of the device.
        planned.release_unused(&mut source).unwrap();
        let other = source.alloc(10 * MIB).unwrap();
        planned.begin_step();
        let first = planned.allocate(&mut source, sizes[0]).unwrap();
        assert_eq!(source.mapped(), 4 * MIB, "the plan's 8 MiB were refused; its first entry's 4 were not");
        source.free(other, 10 * MIB).unwrap();
        let rest: Vec<_> = sizes[1..].iter().map(|&size| planned.allocate(&mut source, size).unwrap()).collect();
        let slab = planned.slab.unwrap();
        assert_eq!((first.ptr, rest[0].ptr - slab.base, rest[1].ptr - slab.base), (slab.base, 4 * MIB, 6 * MIB));
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 0, 0), "served from the plan throughout");
    }

    #[test]
    fn a_lent_slab_is_left_alone_and_serves_again_once_taken_back() {
        let sizes = [MIB, MIB, 3 * MIB, 4 * MIB];
        for ranges in [false, true] {
            let mut source = if ranges { FakeSource::with_ranges(64 * MIB) } else { FakeSource::new(64 * MIB) };
            let mut planned = planned();
            let (_, idle) = live_scope(&mut planned, &mut source, &sizes);
            // A growable slab keeps no more pages mapped than the scope left at its end: lending
            // maps what the captured step asks for.
            let bytes = planned.plans[0].bytes;
            let base = planned.lend_slab(&mut source, bytes).unwrap().expect("an idle slab is lent");
            let slab = planned.lent.expect("lent");
            let held = source.held();
            assert_eq!(base, idle.base);
            assert!(slab.size >= bytes);
            assert_eq!(planned.lend_slab(&mut source, slab.size).unwrap(), None, "lent to one captured step at a time");
            assert_eq!(planned.plan_stats().unwrap().slab_bytes, slab.size, "still the phase's slab");
            assert_eq!(planned.free_space().map(|space| space.total_free), Some(0), "none of it is the pool's");
            // Scopes while it is lent are served apart; their ends, a trim policy that keeps
            // nothing and out-of-memory recovery neither free, resize nor replace it.
            for _ in 0..2 {
                planned.begin_step();
                let ptrs: Vec<_> = sizes.iter().map(|&size| planned.allocate(&mut source, size).unwrap()).collect();
                for (&Served { ptr, .. }, &size) in ptrs.iter().zip(&sizes) {
                    assert!(ptr + size <= slab.base || ptr >= slab.base + slab.size, "{ptr:#x} in the lent slab");
                }
                for (&ptr, &size) in ptrs.iter().zip(&sizes).rev() {
                    planned.free(&mut source, ptr, size).unwrap();
                }
                planned.reset(&mut source, 0).unwrap();
                planned.release_unused(&mut source).unwrap();
                assert_eq!(source.held(), held, "the lent slab alone, nothing beside it (ranges: {ranges})");
                assert_eq!(source.live.contains_key(&slab.base), !ranges);
                assert_eq!(source.ranges.get(&slab.base).copied(), ranges.then_some(slab.size));
            }
            assert!(!planned.take_back_slab(&mut source, base + ALIGNMENT).unwrap(), "not the slab lent");
            assert!(planned.take_back_slab(&mut source, base).unwrap());
            assert!(!planned.take_back_slab(&mut source, base).unwrap(), "taken back once");
            let (again, back) = live_scope(&mut planned, &mut source, &sizes);
            assert_eq!(back.base, slab.base);
            assert!(again.iter().all(|&p| p >= slab.base && p < slab.base + slab.size), "served from it again");
            assert_eq!(planned.plan_stats().unwrap().planned, sizes.len() as u64);
            // A slab with an allocation of the scope in it is not lent.
            planned.begin_step();
            let live = planned.allocate(&mut source, MIB).unwrap();
            assert_eq!(planned.lend_slab(&mut source, slab.size).unwrap(), None);
            planned.free(&mut source, live, MIB).unwrap();
            planned.reset(&mut source, u64::MAX).unwrap();
            // Going away with the slab lent gives it back too.
            planned.lend_slab(&mut source, slab.size).unwrap().expect("lent");
            planned.release_all(&mut source).unwrap();
            assert_eq!(source.held(), 0);
        }
    }

    #[test]
    fn saved_plans_serve_the_first_scope_of_a_new_allocator() {
        let (mut source, mut recorded) = (FakeSource::new(1 << 20), planned());
        let first = scope(&mut recorded, &mut source);
        let saved = recorded.saved_plans();
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].blocks.iter().map(|b| b.size).collect::<Vec<_>>(), [4096, 8192, 2048]);
        let (mut source, mut loaded) = (FakeSource::new(1 << 20), {
            let entry = PhaseEntry::new(Phase(0), PhaseSpec::new("p", Scope::Step).strategy(Strategy::PLANNED));
            Planned::with_plans(entry, 8, 2, &saved)
        });
        let ptrs = scope(&mut loaded, &mut source);
        let stats = loaded.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.unplanned, stats.replans), (3, 0, 0), "no recording scope");
        assert_eq!(source.allocs, 1, "the slab alone was taken");
        let slab = *source.live.keys().next().unwrap();
        let offsets: Vec<u64> = ptrs.iter().map(|&p| p - slab).collect();
        assert_eq!(offsets, saved[0].blocks.iter().map(|b| b.offset).collect::<Vec<_>>(), "at the saved offsets");
        assert_eq!(loaded.saved_plans()[0].blocks, saved[0].blocks, "and saved again unchanged");
        assert_eq!(first.len(), 3);
    }

    #[test]
    fn without_a_slab_the_scope_goes_on_from_the_source() {
        let (mut source, mut planned) = (FakeSource::new(12288 + 4096), planned());
        scope(&mut planned, &mut source);
        planned.release_unused(&mut source).unwrap();
        assert_eq!(source.held(), 0, "an idle slab is given back when memory is short");
        let ptrs = scope(&mut planned, &mut source);
        assert_eq!(ptrs.len(), 3);
        assert_eq!(source.live.len(), 1, "the slab is taken again for the next scope");
    }
}
