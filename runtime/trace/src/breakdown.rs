//! Where a run's overhead goes: the split of peak reserved − peak live into size rounding,
//! granule tails, segregation and holes, read from the memory layout at the peak.
//!
//! One definition and one implementation, shared by `steppool replay`, which reads the layout of
//! the simulated device at a run's peak, and by the runtime's `StepReport`, which builds a
//! [`Snapshot`] of what it knows of its pools at each step's peak (see the runtime's `report`
//! module for what that is and what it cannot see).
//!
//! # The moment measured
//!
//! The **peak moment** is, of the allocations after which the run's reservation (summed over
//! devices) is at its highest value `R`, the one after which the most bytes are live, the
//! earliest on ties. (Reservations grow only at allocations, so a moment of peak reservation with
//! the most live bytes is always right after one: the **peak allocation**.) Let `L` be the
//! trace's peak of live bytes (requested sizes) and `ℓ` the live bytes at the peak moment.
//!
//! # The parts
//!
//! At the peak moment the layout is a set of **reserved ranges** (a simulated-device pool's
//! segments; a `cudaMalloc`ed segment or a run of mapped pages in the PyTorch models), each with
//! its reservation granule (2 MiB, or the page) and its **pool**: the memory only that pool's
//! allocations may use (a runtime pool of one phase and stream; a PyTorch stream's small or large
//! pool). Each live allocation occupies a **footprint** inside one range: its size as the
//! allocator serves it (requested bytes rounded to 512, or a whole PyTorch block that was not
//! split).
//!
//! - **Rounding** = Σ over live allocations of footprint − requested bytes.
//! - **Granule tails** = Σ over ranges holding live allocations of `⌈h / g⌉·g − h` (at most
//!   the range's size − `h`), where `h` is the offset just past the range's highest footprint
//!   and `g` its granule: the unused end of the last granule the live data reaches.
//! - The rest of each range's free bytes (size − footprints − tail) is **idle**. Idle bytes in
//!   the pool of the peak allocation are **holes**: free ranges inside what the growing pool
//!   reserved. Idle bytes in any other pool are **segregation**: memory one pool holds while
//!   another is at its peak.
//! - **Unattributed** = `R` − Σ range sizes − Σ footprints outside every range: reservation the
//!   layout does not show in a pool (zero on the simulated device, where every reservation is a
//!   pool's segment; kept so that the sum stays exact whatever the layout).
//! - **Peak shift** = `ℓ − L`, zero or negative: when reserved memory peaks while fewer bytes
//!   are live than at the live peak, the free bytes at the reserved peak include memory that was
//!   live at the other moment.
//!
//! By construction, rounding + tails + segregation + holes + unattributed + peak shift = `R − L`.

use std::iter::Sum;
use std::ops::{Add, AddAssign};

#[cfg(feature = "jsonl")]
use serde::Serialize;

/// A reserved range of the layout at the peak moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    /// Its device.
    pub device: u32,
    /// Start address.
    pub base: u64,
    /// Length in bytes.
    pub size: u64,
    /// Its reservation granule.
    pub granule: u64,
    /// Its pool: ranges with the same number belong to one pool.
    pub pool: usize,
}

/// A live allocation at the peak moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Live {
    /// Its device.
    pub device: u32,
    /// Its address.
    pub addr: u64,
    /// Bytes it occupies.
    pub footprint: u64,
    /// Bytes requested.
    pub requested: u64,
}

/// The layout at the peak moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Bytes reserved, summed over devices (`R`).
    pub reserved: u64,
    /// The reserved ranges.
    pub ranges: Vec<Range>,
    /// The live allocations.
    pub live: Vec<Live>,
    /// The peak allocation's device and address.
    pub peak_allocation: (u32, u64),
}

/// The split of peak reserved − peak live, in bytes. The parts sum to it exactly; see the
/// [module docs](self) for their definitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "jsonl", derive(Serialize))]
pub struct Breakdown {
    /// Footprints beyond the requested bytes.
    pub rounding_bytes: u64,
    /// Unused ends of the last granule the live data of each range reaches.
    pub granule_tail_bytes: u64,
    /// Idle bytes in pools other than the one that served the peak allocation.
    pub segregation_bytes: u64,
    /// Idle bytes in the pool that served the peak allocation.
    pub hole_bytes: u64,
    /// Reservation in no range of the layout.
    pub unattributed_bytes: i64,
    /// Live bytes at the peak moment − peak live bytes (zero or negative).
    pub peak_shift_bytes: i64,
}

impl Breakdown {
    /// The sum of the parts: peak reserved − peak live.
    pub fn total(&self) -> i64 {
        (self.rounding_bytes + self.granule_tail_bytes + self.segregation_bytes + self.hole_bytes) as i64
            + self.unattributed_bytes
            + self.peak_shift_bytes
    }

    /// The parts as `(name, bytes)`, in the order reports print them, by the names metrics and
    /// tables use: `rounding`, `granule_tail`, `segregation`, `holes`, `unattributed`,
    /// `peak_shift`.
    pub fn parts(&self) -> [(&'static str, i64); 6] {
        [
            ("rounding", self.rounding_bytes as i64),
            ("granule_tail", self.granule_tail_bytes as i64),
            ("segregation", self.segregation_bytes as i64),
            ("holes", self.hole_bytes as i64),
            ("unattributed", self.unattributed_bytes),
            ("peak_shift", self.peak_shift_bytes),
        ]
    }
}

impl AddAssign for Breakdown {
    /// Part by part: the breakdown of two disjoint sets of pools is the sum of theirs.
    fn add_assign(&mut self, other: Self) {
        self.rounding_bytes += other.rounding_bytes;
        self.granule_tail_bytes += other.granule_tail_bytes;
        self.segregation_bytes += other.segregation_bytes;
        self.hole_bytes += other.hole_bytes;
        self.unattributed_bytes += other.unattributed_bytes;
        self.peak_shift_bytes += other.peak_shift_bytes;
    }
}

impl Add for Breakdown {
    type Output = Self;

    fn add(mut self, other: Self) -> Self {
        self += other;
        self
    }
}

impl Sum for Breakdown {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), Add::add)
    }
}

/// The breakdown of `snapshot`, taken at the peak moment, against the trace's peak of live bytes.
pub fn breakdown(snapshot: &Snapshot, peak_live: u64) -> Breakdown {
    let mut ranges = snapshot.ranges.clone();
    ranges.sort_unstable_by_key(|r| (r.device, r.base));
    let find = |device: u32, addr: u64| {
        let at = ranges.partition_point(|r| (r.device, r.base) <= (device, addr));
        at.checked_sub(1).filter(|&i| ranges[i].device == device && addr < ranges[i].base + ranges[i].size)
    };
    // Per range: bytes of footprints, and the offset past the highest one.
    let mut used = vec![(0u64, 0u64); ranges.len()];
    let (mut rounding, mut live, mut outside) = (0u64, 0u64, 0u64);
    for block in &snapshot.live {
        rounding += block.footprint - block.requested;
        live += block.requested;
        match find(block.device, block.addr) {
            Some(i) => {
                used[i].0 += block.footprint;
                used[i].1 = used[i].1.max(block.addr + block.footprint - ranges[i].base);
            }
            None => outside += block.footprint,
        }
    }
    let growing = find(snapshot.peak_allocation.0, snapshot.peak_allocation.1).map(|i| ranges[i].pool);
    let (mut tails, mut holes, mut segregation) = (0u64, 0u64, 0u64);
    for (range, &(bytes, high)) in ranges.iter().zip(&used) {
        // Saturating: live footprints never overlap in a layout the allocator made.
        let tail =
            if high == 0 { 0 } else { high.next_multiple_of(range.granule).min(range.size).saturating_sub(high) };
        let idle = range.size.saturating_sub(bytes + tail);
        tails += tail;
        if Some(range.pool) == growing {
            holes += idle;
        } else {
            segregation += idle;
        }
    }
    let in_ranges: u64 = ranges.iter().map(|r| r.size).sum();
    Breakdown {
        rounding_bytes: rounding,
        granule_tail_bytes: tails,
        segregation_bytes: segregation,
        hole_bytes: holes,
        unattributed_bytes: snapshot.reserved as i64 - in_ranges as i64 - outside as i64,
        peak_shift_bytes: live as i64 - peak_live as i64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn range(base: u64, size: u64, pool: usize) -> Range {
        Range { device: 0, base, size, granule: 2 * MIB, pool }
    }

    fn live(addr: u64, requested: u64) -> Live {
        Live { device: 0, addr, footprint: requested.next_multiple_of(512), requested }
    }

    #[test]
    fn each_part_is_counted_where_it_lies() {
        // Pool 0: an 8 MiB segment with 1 MiB + 100 B at 0 and 3 MiB at 4 MiB: a hole from
        // 1 MiB + 512 to 4 MiB, and the live data reaches 7 MiB of the granule 6..8 MiB: 1 MiB
        // of tail. Pool 1: a 4 MiB segment with 1 MiB live: 1 MiB of tail, then a whole idle
        // granule. The peak allocation is pool 0's 3 MiB.
        let snapshot = Snapshot {
            reserved: 12 * MIB,
            ranges: vec![range(0, 8 * MIB, 0), range(100 * MIB, 4 * MIB, 1)],
            live: vec![live(0, MIB + 100), live(4 * MIB, 3 * MIB), live(100 * MIB, MIB)],
            peak_allocation: (0, 4 * MIB),
        };
        let b = breakdown(&snapshot, 5 * MIB + 100);
        assert_eq!(b.rounding_bytes, 412);
        assert_eq!(b.granule_tail_bytes, MIB + MIB);
        assert_eq!(b.hole_bytes, 4 * MIB - (MIB + 512));
        assert_eq!(b.segregation_bytes, 2 * MIB);
        assert_eq!((b.unattributed_bytes, b.peak_shift_bytes), (0, 0));
        assert_eq!(b.total(), (12 * MIB - (5 * MIB + 100)) as i64);
    }

    #[test]
    fn a_reserved_peak_below_the_live_peak_shows_as_a_shift() {
        let snapshot = Snapshot {
            reserved: 4 * MIB,
            ranges: vec![range(0, 4 * MIB, 0)],
            live: vec![live(0, 2 * MIB)],
            peak_allocation: (0, 0),
        };
        // 3 MiB were live at another moment: 2 MiB of the free memory held them then.
        let b = breakdown(&snapshot, 3 * MIB);
        assert_eq!((b.hole_bytes, b.granule_tail_bytes, b.peak_shift_bytes), (2 * MIB, 0, -(MIB as i64)));
        assert_eq!(b.total(), MIB as i64);
    }

    #[test]
    fn reservation_outside_the_layout_is_unattributed() {
        let snapshot = Snapshot {
            reserved: 6 * MIB,
            ranges: vec![range(0, 2 * MIB, 0)],
            live: vec![live(0, 2 * MIB)],
            peak_allocation: (0, 0),
        };
        let b = breakdown(&snapshot, 2 * MIB);
        assert_eq!(b.unattributed_bytes, (4 * MIB) as i64);
        assert_eq!(b.total(), (4 * MIB) as i64);
    }
}
