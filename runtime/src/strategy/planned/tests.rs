//! The planned strategy's unit tests, against the fake source.

use super::live::{FOREIGN, SlabAllocation, SlabLive};
use super::replan::{IN_ORDER_MARGIN, LEFT_IN_ORDER_MARGIN, left_in_order, plan_blocks};
use super::select::size_exponents;
use super::slab::RECENT_SCOPES_IN_RANGE;
use super::*;
use crate::error::Error;
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
    // That scope left its plan at its larger buffer (the grown range was the next one's): the
    // plan is laid out in allocation order, where the next scope may leave it as well.
    assert!(plan.varies && plan.in_order);
    assert_eq!(plan.bytes, 28672);
    // The next large batch fits every entry and follows the whole plan.
    sequence(&mut planned, &mut source, &[key[0], key[1], (8192, true), (8192, true), (8192, true)]);
    let stats = planned.plan_stats().unwrap();
    assert_eq!((stats.planned, stats.deviations), (5, 0));
}

#[test]
fn a_scope_that_leaves_a_plan_of_varying_sizes_part_way_makes_the_next_plan_in_allocation_order() {
    let (mut source, mut planned) = (FakeSource::new(4 << 20), planned());
    let key = [(512, false), (512, false)];
    // Three buffers live together: a small one, a large one that does not change, and one that
    // varies (an expert's tokens). A scope that follows its first plan has it packed, the small
    // one above the varying one.
    let first = [key[0], key[1], (2048, true), (MIB, true), (4096, true)];
    sequence(&mut planned, &mut source, &first);
    sequence(&mut planned, &mut source, &first);
    let packed = &planned.plans[0];
    assert!(!packed.in_order && packed.offsets[2] > packed.offsets[4], "{:?}", packed.offsets);
    // The next scope's small buffer is smaller and its varying one larger than ever: the grown
    // range runs into the small one, so the scope leaves its plan there and goes on online.
    let varied = [key[0], key[1], (1024, true), (MIB, true), (8192, true)];
    sequence(&mut planned, &mut source, &varied);
    assert_eq!(planned.plan_stats().unwrap().deviated_scopes, 1, "left at the varying buffer");
    // Its largest sizes need a little more than its own (within 1/128: not shares of a fixed
    // total), and the in-order layout no more than the packing: the next scope may meet a
    // larger size again, so the plan is laid out where best fit from an empty slab would put
    // what the scope places before it leaves.
    let plan = &planned.plans[0];
    assert_eq!(plan.sizes, [512, 512, 2048, MIB, 8192], "the largest sizes");
    assert!(plan.varies && plan.in_order);
    let blocks = plan_blocks(plan);
    let packed = plan::pack(&blocks).size;
    assert!(plan::best_fit_in_order(&blocks).size <= packed + packed / LEFT_IN_ORDER_MARGIN);
    assert_eq!(plan.offsets, plan::best_fit_in_order(&blocks).offsets);
    // A scope that follows it whole has it packed again.
    sequence(&mut planned, &mut source, &varied);
    let stats = planned.plan_stats().unwrap();
    assert_eq!(stats.deviations, 0);
    assert!(!planned.plans[0].in_order, "packed once a scope follows it");
}

#[test]
fn a_scope_that_left_its_plan_where_its_largest_sizes_cost_nothing_more_keeps_the_packing() {
    let (mut source, mut planned) = (FakeSource::new(4 << 20), planned());
    let key = [(512, false), (512, false)];
    let first = [key[0], key[1], (2048, true), (MIB, true), (4096, true)];
    sequence(&mut planned, &mut source, &first);
    sequence(&mut planned, &mut source, &first);
    // Only the varying buffer changes, to a size larger than ever: the scope leaves its plan
    // there as above, but its own sizes are the largest, so nothing says sizes keep varying
    // where the scope peaks (a step that meets one larger size once): packed.
    sequence(&mut planned, &mut source, &[key[0], key[1], (2048, true), (MIB, true), (8192, true)]);
    assert_eq!(planned.plan_stats().unwrap().deviated_scopes, 1, "left at the varying buffer");
    let plan = &planned.plans[0];
    assert!(plan.varies && !plan.in_order);
}

#[test]
fn a_plan_a_scope_left_is_laid_out_in_order_only_within_a_thirty_second_of_its_packing() {
    let block = |size: u64, start: u32, end: u32| Block { size, start, end };
    // A transient buffer, then a long-lived one above it, then one larger than the transient's
    // range: best fit in order puts it above both; the packing puts it where the transient was.
    let costly = [block(128 << 10, 0, 2), block(MIB, 1, 4), block(MIB, 3, 4)];
    let packed = plan::pack(&costly).size;
    assert_eq!((packed, plan::best_fit_in_order(&costly).size), (2 * MIB, 2 * MIB + (128 << 10)));
    assert!(left_in_order(plan::best_fit_in_order(&costly), packed).is_none(), "6 % above the packing");
    let cheap = [block(32 << 10, 0, 2), block(MIB, 1, 4), block(MIB, 3, 4)];
    let in_order =
        left_in_order(plan::best_fit_in_order(&cheap), plan::pack(&cheap).size).expect("1.6 % above the packing");
    assert_eq!(in_order.offsets, plan::best_fit_in_order(&cheap).offsets);
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
fn an_entry_freed_later_than_planned_is_not_handed_out_over() {
    let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
    // Entries 2 and 3 share a place: 2 is freed before 3 is made.
    let planned_order = [Op::Alloc(512), Op::Alloc(512), Op::Alloc(4096), Op::Free(2), Op::Alloc(4096), Op::Free(3)];
    let recorded = run_ops(&mut planned, &mut source, &planned_order);
    let followed = run_ops(&mut planned, &mut source, &planned_order);
    assert_eq!(followed, recorded, "a step that follows its plan gets the recording's places");
    assert_eq!(followed[2], followed[3], "the plan gives entry 3 the place of entry 2");
    let stats = planned.plan_stats().unwrap();
    assert_eq!((stats.planned, stats.unplanned), (4, 0), "every allocation from the plan");
    // Entry 2 lives on past its planned free, over entry 3's planned place.
    let late = [Op::Alloc(512), Op::Alloc(512), Op::Alloc(4096), Op::Alloc(4096), Op::Free(2), Op::Free(3)];
    let ptrs = run_ops(&mut planned, &mut source, &late);
    assert!(ptrs[3] + 4096 <= ptrs[2] || ptrs[2] + 4096 <= ptrs[3], "{:#x} and {:#x} overlap", ptrs[2], ptrs[3]);
    let stats = planned.plan_stats().unwrap();
    assert_eq!((stats.planned, stats.unplanned, stats.deviations), (3, 1, 1), "entry 3 deviated");
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
    use Op::Alloc;
    let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
    run_ops(&mut planned, &mut source, &[Alloc(1024), Alloc(1024), Alloc(2048)]);
    // The same key, another sequence (an expert that routed tokens this time): a larger size
    // in the third entry's place, then an allocation past the plan's end, where the scope
    // leaves it. Its plan is laid out as best fit in allocation order, so a scope that leaves
    // it finds what is live where best fit would have put it: that costs no more than the
    // packing here, which puts the largest first.
    let second = [Alloc(1024), Alloc(1024), Alloc(4096), Alloc(2048)];
    run_ops(&mut planned, &mut source, &second);
    let blocks = blocks_of(&second);
    assert_eq!(planned.plans.len(), 1, "one key");
    let plan = &planned.plans[0];
    assert_eq!(plan.sizes, [1024, 1024, 4096, 2048], "the second scope's plan");
    assert!(plan.in_order);
    assert_eq!(plan.offsets, plan::best_fit_in_order(&blocks).offsets);
    assert_eq!(plan.offsets, [0, 1024, 2048, 6144], "the first allocations from the slab's start");
    assert_ne!(plan.offsets, plan::pack(&blocks).offsets, "not the packing");
}

#[test]
fn a_plan_whose_sequence_changed_is_packed_where_the_order_costs_more_than_its_margin() {
    use Op::{Alloc, Free};
    let (mut source, mut planned) = (FakeSource::new(1 << 20), planned());
    // B is freed once C is allocated, D comes last: best fit in order leaves B's hole under
    // D (8 KiB), the packing places D first (6 KiB); a new plan is packed.
    let first = [Alloc(2048), Alloc(2048), Alloc(1024), Free(1), Alloc(3072)];
    run_ops(&mut planned, &mut source, &first);
    assert!(!planned.plans[0].in_order, "in order costs a third more: packed");
    assert_eq!(planned.plans[0].bytes, 6144);
    // The same key, one allocation inserted: the scope leaves the plan part way. In order its
    // plan would cost a third more again, and a scope that follows it whole would pay that: it
    // is packed, as a new plan is.
    let second = [Alloc(2048), Alloc(2048), Alloc(512), Alloc(1024), Free(1), Alloc(3072)];
    run_ops(&mut planned, &mut source, &second);
    let stats = planned.plan_stats().unwrap();
    assert!(stats.deviations > 0, "the scope left the plan");
    let blocks = blocks_of(&second);
    let (packed, in_order) = (plan::pack(&blocks), plan::best_fit_in_order(&blocks));
    assert!(in_order.size > packed.size + packed.size / IN_ORDER_MARGIN, "{} against {}", in_order.size, packed.size);
    let plan = &planned.plans[0];
    assert_eq!(plan.starts, blocks.iter().map(|b| b.start).collect::<Vec<_>>(), "the second scope's plan");
    assert!(!plan.in_order, "packed");
    assert_eq!((plan.bytes, &plan.offsets), (packed.size, &packed.offsets));
    // The next scope of that sequence follows it whole, in what the packing needs.
    run_ops(&mut planned, &mut source, &second);
    let stats = planned.plan_stats().unwrap();
    assert_eq!((stats.planned, stats.deviations), (5, 0));
    assert_eq!(planned.plans[0].bytes, packed.size);
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
    assert!(in_order.size > packed.size + packed.size / IN_ORDER_MARGIN, "{} against {}", in_order.size, packed.size);
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
    let clear_of = |ptr: CUdeviceptr, size: u64| carried_in.is_none_or(|b| b.ptr + MIB <= ptr || ptr + size <= b.ptr);
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

fn allocate_apart(planned: &mut Planned, source: &mut FakeSource, live: &mut Vec<(Served, u64)>, size: u64) -> Served {
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
        let mut live: Vec<(Served, u64)> = grads.iter().map(|&g| (g, 2 * MIB)).chain(batch.map(|b| (b, MIB))).collect();
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
    assert_eq!((stats[0], stats[1].0), ((0, 0, 1), 1), "the first plan moves, the batch with two places: {stats:?}");
    assert!(stats[1..].iter().all(|&(_, deviations, places)| deviations == 0 && places == 1), "{stats:?}");
}

/// `steps` steps of `a_plan_that_moves_keeps_a_batchs_two_places_apart_from_live_memory`'s loop
/// with the batch copied at the step's end for the next (`for batch in loader`), and from the
/// second step on an optimizer's `extra` temporaries (3 MiB each, made and freed in turn) after
/// the backward pass: the first step, before the optimizer's state exists, makes none, so the
/// batch comes at another index from the second step on. Every hand-out is checked clear of
/// everything live. The first `lead` steps begin with a temporary of a quarter MiB that the later
/// ones do not make, so the step after them is a new shape. Per step: the plan's bytes in MiB,
/// the scopes that deviated, and the moves of its report.
fn optimizer_loop(steps: usize, extra: usize, lead: usize) -> Vec<(u64, u64, u64)> {
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
    let (mut grads, mut batch): (Vec<Served>, Option<Served>) = (Vec::new(), None);
    let mut per_step = Vec::new();
    for step in 0..steps {
        planned.begin_step();
        let mut live: Vec<(Served, u64)> = grads.iter().map(|&g| (g, 2 * MIB)).chain(batch.map(|b| (b, MIB))).collect();
        if step < lead {
            let t = allocate_apart(&mut planned, &mut source, &mut live, MIB / 4);
            free_apart(&mut planned, &mut source, &mut live, t, MIB / 4);
        }
        let a1 = allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB);
        let a2 = allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB);
        for g in grads.drain(..) {
            free_apart(&mut planned, &mut source, &mut live, g, 2 * MIB);
        }
        let t = allocate_apart(&mut planned, &mut source, &mut live, 4 * MIB);
        free_apart(&mut planned, &mut source, &mut live, t, 4 * MIB);
        free_apart(&mut planned, &mut source, &mut live, a2, 4 * MIB);
        let g1 = allocate_apart(&mut planned, &mut source, &mut live, 2 * MIB);
        free_apart(&mut planned, &mut source, &mut live, a1, 4 * MIB);
        let g2 = allocate_apart(&mut planned, &mut source, &mut live, 2 * MIB);
        let extras = [MIB / 2].into_iter().chain(std::iter::repeat_n(3 * MIB, extra));
        for size in extras.take(if step == 0 { 0 } else { extra + 1 }) {
            let o = allocate_apart(&mut planned, &mut source, &mut live, size);
            free_apart(&mut planned, &mut source, &mut live, o, size);
        }
        let b = allocate_apart(&mut planned, &mut source, &mut live, MIB);
        if let Some(old) = batch.take() {
            free_apart(&mut planned, &mut source, &mut live, old, MIB);
        }
        grads = [g1, g2].map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).unwrap() }).to_vec();
        batch = Some(Served { ptr: b.ptr, slot: planned.carry(b, MIB).unwrap() });
        planned.reset(&mut source, u64::MAX).unwrap();
        let stats = planned.plan_stats().unwrap();
        let bytes = planned.plans.iter().filter(|plan| plan.sizes.len() > 6).map(|plan| plan.bytes).max();
        per_step.push((bytes.unwrap_or(planned.plans[0].bytes) / MIB, stats.deviated_scopes, stats.moves));
    }
    planned.release_all(&mut source).unwrap();
    assert!(source.ranges.is_empty(), "every range given back, each retired one too: {:?}", source.ranges);
    per_step
}

#[test]
fn a_step_that_runs_past_its_plans_end_is_planned_from_where_its_batch_comes_and_moves_again() {
    // The second step follows the first step's plan to its end (its first temporary, small,
    // in the batch's entry), then makes the rest of the optimizer's temporaries and its batch
    // best fit. Its plan knows when the next step frees that batch, though the first step made
    // its own at another index (the one made in the same order), and pinned where best fit
    // put the batch it would need 16 MiB: it moves to a new range again, at the third step's
    // start, and needs 14, the step's peak of live bytes and the batch's second place. From
    // there on, no deviation and no move.
    for extra in [1, 2] {
        let per_step = optimizer_loop(6, extra, 0);
        assert_eq!(per_step[2], (14, 0, 1), "{per_step:?}");
        assert!(per_step[3..].iter().all(|&step| step == (14, 0, 0)), "{per_step:?}");
    }
}

#[test]
fn the_first_plan_of_the_shape_a_loop_settles_into_moves_as_a_first_plan_does() {
    // The first two steps begin with a temporary the later ones do not make (a loop's steps
    // marked so that its first steps begin otherwise): the third step is a new shape, served
    // best fit from its start around the gradients and batch the second step carried in, and
    // its plan, pinned where best fit put what it carries, would need more than the step's
    // packing (19 MiB against 16). It may move, as the phase's first plan may: the fourth step
    // follows it in a new range, and from there on nothing deviates or moves.
    let per_step = optimizer_loop(7, 1, 2);
    assert_eq!(per_step[2].0, 16, "{per_step:?}");
    assert_eq!(per_step[3], (16, 0, 1), "{per_step:?}");
    assert!(per_step[4..].iter().all(|&step| step == (16, 0, 0)), "{per_step:?}");
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
        let mut live: Vec<(Served, u64)> = grads.iter().map(|&g| (g, 2 * MIB)).chain(batch.map(|b| (b, MIB))).collect();
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

/// One training step of a loop that calls `zero_grad()` at its top: an activation `a1` (8 MiB)
/// made and freed, `a2` (6 MiB) and `a3` (4 MiB, the peak of 10 MiB), freed, then gradients
/// (2 MiB each) made, which the step frees at its end (the next step's top, before its first
/// allocation) or, where an evaluation step comes next, carries out (`carry`). Returns what it
/// carries.
fn zero_grad_first_step(planned: &mut Planned, source: &mut FakeSource, carry: bool) -> Vec<Served> {
    planned.begin_step();
    let a1 = planned.allocate(source, 8 * MIB).unwrap();
    planned.free(source, a1, 8 * MIB).unwrap();
    let a2 = planned.allocate(source, 6 * MIB).unwrap();
    let a3 = planned.allocate(source, 4 * MIB).unwrap();
    planned.free(source, a2, 6 * MIB).unwrap();
    planned.free(source, a3, 4 * MIB).unwrap();
    let grads = [planned.allocate(source, 2 * MIB).unwrap(), planned.allocate(source, 2 * MIB).unwrap()];
    let mut out = Vec::new();
    for g in grads {
        if carry {
            out.push(Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).expect("carried") });
        } else {
            planned.free(source, g, 2 * MIB).unwrap();
        }
    }
    planned.reset(source, u64::MAX).unwrap();
    out
}

#[test]
fn a_carrying_plan_whose_memory_a_scope_of_another_key_freed_gives_way_to_the_plan_it_replaced() {
    // (the evaluation step's second allocation, whether it carries memory out itself, whether
    // the plan before comes back).
    for (second, eval_carries, restored) in [(3 * MIB, false, true), (3 * MIB, true, false), (14 * MIB, false, false)] {
        let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
        zero_grad_first_step(&mut planned, &mut source, false);
        assert_eq!(
            (planned.plans[0].carries, planned.plans[0].bytes),
            (false, 10 * MIB),
            "the gradients reuse the activations' room"
        );
        // The training step before an evaluation step carries its gradients out: where it
        // confirms the plan laid out in allocation order, the plan made again is a first
        // carrying plan, which guesses them live in the next step up to its peak, apart from the
        // activations.
        let grads = zero_grad_first_step(&mut planned, &mut source, true);
        assert_eq!((planned.plans[0].carries, planned.plans[0].bytes), (true, 12 * MIB));
        assert!(planned.uncarried.is_some());
        // The evaluation step, another key (1 MiB, then `second`), frees them at its end.
        planned.begin_step();
        let e1 = planned.allocate(&mut source, MIB).unwrap();
        let e2 = planned.allocate(&mut source, second).unwrap();
        planned.free(&mut source, e1, MIB).unwrap();
        planned.free(&mut source, e2, second).unwrap();
        let kept = eval_carries.then(|| planned.allocate(&mut source, MIB).unwrap());
        if let Some(kept) = kept {
            planned.carry(kept, MIB).expect("carried");
        }
        for g in grads {
            planned.free(&mut source, g, 2 * MIB).unwrap();
        }
        planned.reset(&mut source, u64::MAX).unwrap();
        assert!(planned.uncarried.is_none());
        let training = planned.plans.iter().find(|p| p.sizes.len() == 5).expect("the training plan");
        if !restored {
            // A step that hands memory on itself is no sign of a loop whose next training step
            // receives nothing; and an evaluation step that held more than the carrying plan
            // needs costs the run's peak what the training steps save, while the gradients
            // apart keep out of its way: the carrying plan stays.
            assert_eq!((training.carries, training.bytes), (true, 12 * MIB), "{second} {eval_carries}");
            continue;
        }
        assert_eq!((training.carries, training.bytes), (false, 10 * MIB), "the plan it replaced");
        let before = planned.plan_stats().unwrap();
        zero_grad_first_step(&mut planned, &mut source, false);
        let after = planned.plan_stats().unwrap();
        assert_eq!((after.planned - before.planned, after.deviations - before.deviations), (5, 0));
        assert_eq!(planned.touched(), Some(10 * MIB));
    }
    // In a loop whose every step hands its gradients to the next (the same key), the first
    // carrying plan stays.
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
    zero_grad_first_step(&mut planned, &mut source, false);
    let mut carried = zero_grad_first_step(&mut planned, &mut source, true);
    for _ in 0..2 {
        carried = carrying_step(&mut planned, &mut source, &carried);
    }
    assert!(planned.plans.iter().all(|p| p.carries), "{:?}", planned.plans);
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
fn a_scope_served_online_leaves_no_more_of_the_range_mapped_than_it_held_at_once() {
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), planned());
    // The recent plans need 24 MiB.
    live_scope(&mut planned, &mut source, &[8 * MIB, 8 * MIB, 8 * MIB]);
    // Another phase takes the idle pages between the scopes, then lets them go.
    let other = another_pool_takes(&mut planned, &mut source, 60 * MIB);
    source.free(other, 60 * MIB).unwrap();
    assert_eq!(source.mapped(), 0);
    // A new shape, served online: 2 and 2 MiB, the first freed, then 6 MiB, which only the
    // range's end holds: the freed page goes back as the end grows.
    planned.begin_step();
    let a = planned.allocate(&mut source, 2 * MIB).unwrap();
    let b = planned.allocate(&mut source, 2 * MIB).unwrap();
    planned.free(&mut source, a, 2 * MIB).unwrap();
    let c = planned.allocate(&mut source, 6 * MIB).unwrap();
    let held = source.mapped();
    assert_eq!((held, planned.slab.unwrap().size, planned.holes.as_slice()), (8 * MIB, 10 * MIB, &[(0, 2 * MIB)][..]));
    planned.free(&mut source, c, 6 * MIB).unwrap();
    planned.free(&mut source, b, 2 * MIB).unwrap();
    // At its end the hole is mapped again for the next scope, but the range is no larger mapped
    // than the scope held it at once (8 MiB), though the recent plans need 24: mapping the 10
    // MiB it spans raised the run's reservation at the boundary.
    planned.reset(&mut source, u64::MAX).unwrap();
    assert!(source.holes.values().all(|pages| pages.is_empty()));
    assert_eq!(source.mapped(), held, "mapped after the scope, {held} at its most");
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

#[test]
fn what_a_plan_leaves_live_after_its_last_allocation_lies_on_as_few_pages_as_its_gaps_allow() {
    const MIB: u64 = 1 << 20;
    let (mut source, mut planned) = (FakeSource::new(1 << 30), planned());
    planned.begin_step();
    // Activations: `a` below the first 2 MiB boundary, `b` across it, `c` and `d` above it.
    let a = planned.allocate(&mut source, 7 * MIB / 4).unwrap();
    let b = planned.allocate(&mut source, 2 * MIB).unwrap();
    let c = planned.allocate(&mut source, MIB / 4).unwrap();
    let d = planned.allocate(&mut source, MIB).unwrap();
    planned.free(&mut source, a, 7 * MIB / 4).unwrap();
    let first = planned.allocate(&mut source, MIB / 4).unwrap(); // a gradient, where `a` was
    planned.free(&mut source, c, MIB / 4).unwrap();
    // Best fit puts the second gradient into `c`'s quarter MiB, on the next 2 MiB page.
    let second = planned.allocate(&mut source, MIB / 4).unwrap();
    planned.free(&mut source, b, 2 * MIB).unwrap();
    planned.free(&mut source, d, MIB).unwrap();
    let last = planned.allocate(&mut source, 512).unwrap();
    planned.free(&mut source, last, 512).unwrap();
    planned.free(&mut source, first, MIB / 4).unwrap();
    planned.free(&mut source, second, MIB / 4).unwrap();
    planned.reset(&mut source, u64::MAX).unwrap();

    let plan = &planned.plans[0];
    let packing = plan::Packing { offsets: plan.offsets.clone(), size: plan.bytes };
    assert!(plan::is_valid(&plan_blocks(plan), &packing));
    let pages_of =
        |entry: usize| [plan.offsets[entry] / GRANULE, (plan.offsets[entry] + plan.sizes[entry] - 1) / GRANULE];
    let pages: std::collections::BTreeSet<u64> = [4, 5, 6].into_iter().flat_map(pages_of).collect();
    assert_eq!(pages.len(), 1, "the two gradients and the last allocation on one page: {:?}", plan.offsets);
    assert_eq!(plan.bytes, 5 * MIB, "and the plan no larger for it");
}

/// A training step before an evaluation step whose gradients live through it, in a loop that
/// sets them to `None` between the passes: it receives nothing, makes its gradients (two of
/// 2 MiB) while an 8 MiB activation is live, and carries them out. Returns them.
fn step_before_evaluation(planned: &mut Planned, source: &mut FakeSource) -> Vec<Served> {
    planned.begin_step();
    let a1 = planned.allocate(source, 8 * MIB).unwrap();
    let grads = [planned.allocate(source, 2 * MIB).unwrap(), planned.allocate(source, 2 * MIB).unwrap()];
    planned.free(source, a1, 8 * MIB).unwrap();
    let a2 = planned.allocate(source, 6 * MIB).unwrap();
    planned.free(source, a2, 6 * MIB).unwrap();
    let out = grads.map(|g| Served { ptr: g.ptr, slot: planned.carry(g, 2 * MIB).expect("carried") }).to_vec();
    planned.reset(source, u64::MAX).unwrap();
    out
}

/// The training step after it, of the same first sizes (8 MiB, then 2 MiB) and another
/// sequence: it frees what it received after its first allocation, and carries nothing out.
fn step_after_evaluation(planned: &mut Planned, source: &mut FakeSource, received: Vec<Served>) {
    planned.begin_step();
    let x = planned.allocate(source, 8 * MIB).unwrap();
    for g in received {
        planned.free(source, g, 2 * MIB).unwrap();
    }
    let h = planned.allocate(source, 2 * MIB).unwrap();
    planned.free(source, x, 8 * MIB).unwrap();
    let c = planned.allocate(source, 5 * MIB).unwrap();
    planned.free(source, c, 5 * MIB).unwrap();
    planned.free(source, h, 2 * MIB).unwrap();
    planned.reset(source, u64::MAX).unwrap();
}

/// `rounds` of a step before an evaluation step and the step after it: per round, the scopes
/// that left their plan (the counters are the last scope's).
fn evaluation_rounds(planned: &mut Planned, source: &mut FakeSource, rounds: usize) -> Vec<u64> {
    (0..rounds)
        .map(|_| {
            let received = step_before_evaluation(planned, source);
            let before = planned.plan_stats().unwrap().deviated_scopes;
            step_after_evaluation(planned, source, received);
            before + planned.plan_stats().unwrap().deviated_scopes
        })
        .collect()
}

#[test]
fn scopes_of_one_key_that_do_and_do_not_receive_carried_memory_keep_a_plan_each() {
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
    let deviated = evaluation_rounds(&mut planned, &mut source, 4);
    // The first step after is a new sequence under the key; from then on each kind follows its
    // own plan (with one plan for both, each left the other's, scope after scope).
    assert_eq!(deviated, [1, 0, 0, 0]);
    let mut kinds: Vec<(bool, bool)> = planned.plans.iter().map(|plan| (plan.received, plan.carries)).collect();
    kinds.sort_unstable();
    assert_eq!(kinds, [(false, true), (true, false)], "one plan of the key that carries, one that received");
    // Saved, both are kept, and a run that loads them serves each kind from its plan from the
    // first round on (with one plan of the key saved, the other kind left it every round).
    let saved = planned.saved_plans();
    let mut received: Vec<bool> = saved.iter().map(|plan| plan.received).collect();
    received.sort_unstable();
    assert_eq!(received, [false, true]);
    let spec = PhaseSpec::new("p", Scope::Step).strategy(Strategy::PLANNED).carry(true);
    let mut loaded = Planned::with_plans(PhaseEntry::new(Phase(0), spec), 8, 2, &saved);
    let mut source = FakeSource::with_ranges(64 * MIB);
    assert_eq!(evaluation_rounds(&mut loaded, &mut source, 3), [0, 0, 0]);
}

/// One step of a mixture of experts that copies its next batch (1 MiB) at its end, as
/// `for batch in loader` does with the step marked inside the loop: two small key allocations,
/// then the experts' buffers (`experts`, live together: the tokens routed to each), freed, then
/// the next batch, made before the one carried in is freed, and carried out. Every hand-out is
/// checked clear of the batch carried in.
fn expert_step(planned: &mut Planned, source: &mut FakeSource, carried_in: Option<Served>, experts: &[u64]) -> Served {
    let clear_of = |ptr: CUdeviceptr, size: u64| carried_in.is_none_or(|b| b.ptr + MIB <= ptr || ptr + size <= b.ptr);
    planned.begin_step();
    for _ in 0..2 {
        let key = planned.allocate(source, 512).unwrap();
        planned.free(source, key, 512).unwrap();
    }
    let buffers: Vec<Served> = experts
        .iter()
        .map(|&size| {
            let buffer = planned.allocate(source, size).unwrap();
            assert!(clear_of(buffer.ptr, size));
            buffer
        })
        .collect();
    for (&buffer, &size) in buffers.iter().zip(experts).rev() {
        planned.free(source, buffer, size).unwrap();
    }
    let batch = planned.allocate(source, MIB).unwrap();
    assert!(clear_of(batch.ptr, MIB));
    if let Some(old) = carried_in {
        planned.free(source, old, MIB).unwrap();
    }
    let out = Served { ptr: batch.ptr, slot: planned.carry(batch, MIB).expect("carried") };
    planned.reset(source, u64::MAX).unwrap();
    out
}

#[test]
fn a_carrying_plan_sizes_each_entry_to_the_largest_seen_in_its_place() {
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
    // Buffers that vary together (a batch of another size), then one larger and one smaller
    // than ever, in a scope that needs less than the largest did: each entry of the next plan
    // is the largest seen in its place, so both shapes follow it from then on.
    let rounds: [[u64; 2]; 6] = [[2, 2], [3, 3], [4, 1], [3, 3], [4, 1], [3, 3]].map(|r| r.map(|m| m * MIB));
    let (mut batch, mut deviations) = (None, Vec::new());
    for experts in rounds {
        batch = Some(expert_step(&mut planned, &mut source, batch, &experts));
        deviations.push(planned.plan_stats().unwrap().deviations);
    }
    // Without the largest sizes, the plan made after the third round holds its sizes, and the
    // fifth, like the third, leaves it.
    assert_eq!(deviations, [0, 1, 1, 0, 0, 0]);
    let plan = &planned.plans[0];
    assert!(plan.carries && plan.varies);
    assert_eq!(plan.largest[2..], [4 * MIB, 3 * MIB, MIB], "the batch carried out keeps its size");
}

#[test]
fn a_carrying_scope_that_left_another_sequence_part_way_is_planned_in_allocation_order() {
    let (mut source, mut planned) = (FakeSource::with_ranges(64 * MIB), carrying());
    // The first step routes to two experts; the next, under the same key, to a third as well
    // (another sequence), and leaves the first step's plan there. Its plan is laid out as best
    // fit in allocation order around the batch it carries out, where the next scope of that
    // kind may leave it too: what it placed before is where best fit would have put it.
    let batch = expert_step(&mut planned, &mut source, None, &[2 * MIB, 2 * MIB]);
    let batch = expert_step(&mut planned, &mut source, Some(batch), &[2 * MIB, 2 * MIB, 2 * MIB]);
    assert_eq!(planned.plan_stats().unwrap().deviated_scopes, 1, "left the first plan");
    let plan = planned.plans.iter().find(|plan| plan.sizes.len() == 6).expect("the three experts' plan");
    assert!(plan.carries && plan.in_order, "laid out in allocation order");
    // Each expert above the one before, as best fit, all above the batch's own place; its
    // second place is where the batch carried in lies.
    let (own, experts) = (plan.offsets[5], &plan.offsets[2..5]);
    assert!(experts[0] >= own + MIB && experts.windows(2).all(|w| w[1] == w[0] + 2 * MIB), "{plan:?}");
    assert_eq!(plan.alternates, [(5, batch.ptr - planned.slab.unwrap().base)]);
    // The batch came at another index than the first step's, the one made in the same order,
    // so the plan knows where the next step frees it: nothing guessed, and the next scopes of
    // its sequence follow it to the end.
    assert!(!plan.guessed);
    let mut batch = batch;
    for _ in 0..2 {
        batch = expert_step(&mut planned, &mut source, Some(batch), &[2 * MIB, 2 * MIB, 2 * MIB]);
        let stats = planned.plan_stats().unwrap();
        assert_eq!((stats.planned, stats.deviations), (6, 0));
    }
}

/// One step of a new shape for [`gradients_of_a_new_shape_are_made_at_the_lowest_free_range_and_lie_together`]:
/// `prefix` small allocations of fixed sizes first (the embedding's; the same first sizes as
/// the steps before, so a plan is selected), three activations of `activation` bytes with a
/// 1 MiB mask after each of the first two, the gradients `carried` in freed between the passes,
/// the masks freed, then four 1 MiB gradients made as the activations go, carried into the next
/// step, and `padding` small allocations made and freed (an optimizer step of many tensors).
/// Returns the gradients' offsets in the range.
fn new_shape_step(
    planned: &mut Planned,
    source: &mut FakeSource,
    carried: &mut Vec<Served>,
    activation: u64,
    prefix: usize,
    padding: usize,
) -> Vec<u64> {
    planned.begin_step();
    let small: Vec<Served> = (0..prefix).map(|_| planned.allocate(source, 4096).unwrap()).collect();
    let x1 = planned.allocate(source, activation).unwrap();
    let m1 = planned.allocate(source, MIB).unwrap();
    let x2 = planned.allocate(source, activation).unwrap();
    let m2 = planned.allocate(source, MIB).unwrap();
    let x3 = planned.allocate(source, activation).unwrap();
    for served in carried.drain(..) {
        planned.free(source, served, MIB).unwrap();
    }
    planned.free(source, m1, MIB).unwrap();
    planned.free(source, m2, MIB).unwrap();
    let mut gradients = vec![planned.allocate(source, MIB).unwrap()];
    for (served, size) in [(x3, activation), (x2, activation), (x1, activation)] {
        planned.free(source, served, size).unwrap();
        gradients.push(planned.allocate(source, MIB).unwrap());
    }
    for served in small {
        planned.free(source, served, 4096).unwrap();
    }
    for _ in 0..padding {
        let t = planned.allocate(source, 512).unwrap();
        planned.free(source, t, 512).unwrap();
    }
    let base = planned.slab.expect("a slab").base;
    let offsets = gradients.iter().map(|g| g.ptr - base).collect();
    for g in gradients {
        carried.push(Served { ptr: g.ptr, slot: planned.carry(g, MIB).expect("carried") });
    }
    planned.reset(source, u64::MAX).unwrap();
    offsets
}

#[test]
fn gradients_of_a_new_shape_are_made_at_the_lowest_free_range_and_lie_together() {
    // Every step another shape (its activations 256 KiB larger), so every step is served online
    // from its start ([`new_shape_step`]). Best fit puts the first gradients into the masks'
    // holes, between the activations, where the next step's forward pass finds them pinned
    // (step 3: at 15.25, 7.75, 0 and 8.75 MiB). Of the sizes carried in, they take the lowest
    // free range instead, and lie together at the range's start.
    let mut source = FakeSource::with_ranges(256 * MIB);
    let mut planned = carrying();
    let mut carried: Vec<Served> = Vec::new();
    for step in 0..6u64 {
        let activation = 4 * MIB + step * 256 * 1024;
        let offsets = new_shape_step(&mut planned, &mut source, &mut carried, activation, 0, 0);
        if step == 0 {
            // Nothing carried in: best fit, the first gradient in the first mask's hole.
            assert_eq!(offsets[0], activation, "step 0: {offsets:?}");
        } else {
            assert_eq!(offsets, [0, MIB, 2 * MIB, 3 * MIB], "step {step}");
        }
        assert_eq!(planned.plan_stats().unwrap().planned, 0, "step {step} served online");
    }
    // The same steps after 20 small allocations of fixed sizes and before 400 more: the second
    // step follows the first one's plan through those 20 and leaves it at an activation larger
    // than planned. That is past the first 16 allocations but within the plan's first
    // sixteenth (of 429): a new shape still.
    let mut source = FakeSource::with_ranges(256 * MIB);
    let mut planned = carrying();
    let mut carried: Vec<Served> = Vec::new();
    let mut served_from_plans = 0;
    for step in 0..6u64 {
        let activation = 4 * MIB + step * 256 * 1024;
        let offsets = new_shape_step(&mut planned, &mut source, &mut carried, activation, 20, 400);
        let stats = planned.plan_stats().unwrap();
        let from_plan = stats.planned - std::mem::replace(&mut served_from_plans, stats.planned);
        if step == 1 {
            assert!((17..429 / 16).contains(&from_plan), "step {step}: {from_plan} served from its plan");
        }
        if step > 0 {
            assert_eq!(offsets, [0, MIB, 2 * MIB, 3 * MIB], "step {step}");
        }
    }
}
