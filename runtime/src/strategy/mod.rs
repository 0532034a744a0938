//! Strategies: how a phase pool serves allocations from the memory it takes from the device.
//!
//! Every strategy implements [`Allocator`]: allocate, free, and reset at the boundary of the
//! phase's scope. A strategy takes memory only through a [`Source`], so each one is tested in its
//! own file against `FakeSource` (`source::fake`, built for tests); in a pool the source is the
//! device's ([`DeviceSource`](crate::source::DeviceSource)).
//!
//! - [`Direct`]: every allocation and free goes to the source (the phase's CUDA pool).
//! - [`Arena`]: bump allocation in slabs; memory comes back in stack order or at the reset.
//! - [`Chunked`]: best fit in chunks taken from the pool, for long-lived allocations (see
//!   `chunks.rs`, which the planned strategy's unplanned allocations use too).
//! - [`Planned`]: the scope's sequence is recorded and packed; later scopes are served at the
//!   planned offsets of one slab (see `planned/`; the packing is `steppool_trace::packing`),
//!   or from plans saved by an earlier run (`steppool_trace::plans`).
//! - [`Auto`]: the first scope is served directly and recorded; each of the others is tried on
//!   the recording over a simulated device, and the pool goes on with the one
//!   `steppool_trace::recommend` chooses (see `auto.rs`).

mod arena;
mod auto;
mod chunked;
mod chunks;
mod direct;
mod planned;

use std::fmt;
use std::sync::Arc;

use steppool_sys::CUdeviceptr;
use steppool_trace::plans::SavedPlan;

pub(crate) use arena::Arena;
pub(crate) use auto::Auto;
pub(crate) use chunked::Chunked;
pub(crate) use direct::Direct;
pub(crate) use planned::Planned;

use crate::error::Result;
use crate::phase::{PhaseEntry, Strategy};
use crate::report::{FreeSpace, PlanStats};
use crate::source::Source;

/// An allocation as a strategy hands it out: its address, and the slot the strategy filed its
/// record under. The allocation's free passes both back ([`Allocator::free`]), so a strategy that
/// keeps a record per allocation (the planned strategy: which plan entry it is, whether it is
/// late) finds it by index rather than by hashing the address on every free. The pool keeps the
/// slot beside the pointer: in the [`Buffer`](crate::Buffer), or in the raw allocation's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Served {
    /// The allocation's device address.
    pub(crate) ptr: CUdeviceptr,
    /// Where the strategy filed it; [`Served::NO_SLOT`] where it files nothing.
    pub(crate) slot: u32,
}

impl Served {
    /// The slot of a strategy that keeps no record per allocation.
    pub(crate) const NO_SLOT: u32 = u32::MAX;

    /// An allocation the strategy keeps no record of.
    pub(crate) fn unfiled(ptr: CUdeviceptr) -> Self {
        Self { ptr, slot: Self::NO_SLOT }
    }
}

/// A strategy's state in one phase pool. Called under the pool's lock.
pub(crate) trait Allocator: Send + fmt::Debug {
    /// Memory for `bytes` (more than 0) in the pool's stream order,
    /// [`ALIGNMENT`](crate::phase::ALIGNMENT)-aligned.
    fn allocate(&mut self, source: &mut dyn Source, bytes: u64) -> Result<Served>;

    /// Gives back an allocation of `bytes`, as [`Allocator::allocate`] handed it out.
    fn free(&mut self, source: &mut dyn Source, served: Served, bytes: u64) -> Result<()>;

    /// The phase's scope has ended: start over, keeping at least `keep` bytes of what the
    /// strategy holds for the next scope. A strategy that [reclaims](Allocator::reclaims_live)
    /// takes back what is still handed out; the others find every allocation already freed.
    fn reset(&mut self, source: &mut dyn Source, keep: u64) -> Result<()>;

    /// Keeps an allocation of the scope that is ending live into the next scope (a phase that
    /// carries, [`PhaseSpec::carry`](crate::PhaseSpec::carry)), before [`Allocator::reset`]:
    /// its free comes in the next scope, or the pool releases it at that scope's end. Returns the
    /// slot its free passes from now on, or `None` where the strategy cannot keep memory past its
    /// scope (then the pool releases it now, as it releases any other phase's).
    fn carry(&mut self, _served: Served, _bytes: u64) -> Option<u32> {
        None
    }

    /// Whether [`Allocator::reset`] takes back allocations still handed out (buffers leaked with
    /// `mem::forget`): true for strategies that carve their own memory (arena, planned slab).
    fn reclaims_live(&self) -> bool {
        true
    }

    /// What the scope needed, for the trim policy: the high-water mark of memory it touched, or
    /// `None` when the strategy holds nothing of its own and the pool's peak of live bytes says it.
    fn touched(&self) -> Option<u64> {
        None
    }

    /// The free space inside what the strategy holds, where it knows the layout.
    fn free_space(&self) -> Option<FreeSpace> {
        None
    }

    /// Memory is short (out-of-memory recovery): give back what the current scope has not
    /// touched and will not need unless it grows. Returns the bytes given back.
    fn release_unused(&mut self, _source: &mut dyn Source) -> Result<u64> {
        Ok(0)
    }

    /// Another pool on the device is about to take `bytes` of new memory: give back that much of
    /// the pages of freed memory kept mapped ([`Source::hold_freed`]), or all of them if fewer.
    /// Returns the bytes given back.
    fn give_back_freed(&mut self, _source: &mut dyn Source, _bytes: u64) -> Result<u64> {
        Ok(0)
    }

    /// The pool is going away: give everything back.
    fn release_all(&mut self, source: &mut dyn Source) -> Result<()>;

    /// A step begins: counters kept per step start over.
    fn begin_step(&mut self) {}

    /// The plans the strategy keeps, as a plan file saves them (the planned strategy's).
    fn saved_plans(&self) -> Vec<SavedPlan> {
        Vec::new()
    }

    /// The strategy an [`Auto`](Strategy::Auto) phase pool chose, once it has.
    fn chosen(&self) -> Option<Strategy> {
        None
    }

    /// The planned strategy's numbers over the current step.
    fn plan_stats(&self) -> Option<PlanStats> {
        None
    }

    /// Lends the memory a packed plan is served from, holding at least `bytes`, to a captured
    /// step's graph executable for its life: its base, or `None` when the strategy has none to
    /// lend (not planned, lent already, an allocation of the scope lives in it, the device refused
    /// the memory). Until [`Allocator::take_back_slab`], the strategy neither resizes, unmaps nor
    /// frees it, nor hands any of it out, and takes no second slab beside it.
    fn lend_slab(&mut self, _source: &mut dyn Source, _bytes: u64) -> Result<Option<CUdeviceptr>> {
        Ok(None)
    }

    /// Takes back the slab lent at `base` ([`Allocator::lend_slab`]), once nothing can launch on
    /// it; it serves again in the stream's order. False when nothing is lent at `base`.
    fn take_back_slab(&mut self, _source: &mut dyn Source, _base: CUdeviceptr) -> Result<bool> {
        Ok(false)
    }

    /// The packed plan a captured step would be served from (the most recently used), read-only;
    /// `None` for other strategies and before a plan exists.
    fn plan_view(&self) -> Option<PlanView> {
        None
    }

    /// A strategy of long-lived allocations in a range that grows in place lends the unused end
    /// of the last page its allocations touch, to a planned pool on the same stream that packs
    /// the top of its plans there ([`Allocator::set_bin`]): the two pools then pay one partly
    /// used page between them, not one each. The loan is a hand-out of the lender's, so nothing
    /// of the lender's goes there while it lasts. `current` is the loan made before: while `lend`
    /// it stays if it is still that end, otherwise it comes back and the end as it is now is lent
    /// (`None` when there is none); without `lend` it comes back and nothing is lent. Called
    /// between steps, when nothing of the borrower lives in the loan.
    fn lend_tail(&mut self, current: Option<Bin>, _lend: bool) -> Option<Bin> {
        debug_assert!(current.is_none(), "a loan made by a strategy that lends none");
        None
    }

    /// For a strategy that packs the top of its plans into a bin lent by another pool
    /// ([`Allocator::lend_tail`]): the bin it holds, and whether it wants one. `None` for the
    /// others.
    fn bin(&self) -> Option<(Option<Bin>, bool)> {
        None
    }

    /// Takes `bin` as the strategy's bin (see [`Allocator::lend_tail`]); called between steps,
    /// when nothing lives in the one it replaces.
    fn set_bin(&mut self, _bin: Option<Bin>) {}
}

/// Memory one pool lends another (see [`Allocator::lend_tail`]): its address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bin {
    /// Where it starts.
    pub(crate) ptr: CUdeviceptr,
    /// Its bytes.
    pub(crate) len: u64,
}

/// A read-only view of a packed plan: entry *i* (in allocation order) is `sizes[i]` bytes at
/// `offsets[i]` in a slab of `bytes`. What a captured step is served from (`capture.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PlanView {
    /// Each entry's size, aligned.
    pub(crate) sizes: Vec<u64>,
    /// Each entry's offset in the slab.
    pub(crate) offsets: Vec<u64>,
    /// The slab size the plan needs.
    pub(crate) bytes: u64,
}

/// The allocator state for a phase's strategy.
pub(crate) fn allocator(entry: &Arc<PhaseEntry>) -> Box<dyn Allocator> {
    match entry.spec.strategy {
        Strategy::Direct => Box::new(Direct),
        Strategy::Arena { slab_bytes } => Box::new(Arena::new(slab_bytes)),
        Strategy::Chunked { chunk_bytes } => Box::new(Chunked::new(chunk_bytes)),
        Strategy::Auto => Box::new(Auto::new(entry.clone())),
        Strategy::Planned { max_plans, signature_len } => match &entry.spec.plans {
            Some(saved) => Box::new(Planned::with_plans(entry.clone(), max_plans, signature_len, &saved.plans)),
            None => Box::new(Planned::new(entry.clone(), max_plans, signature_len)),
        },
    }
}
