//! The raw-pointer table: which pool each pointer of the raw API came from, and, in checked mode,
//! the ranges live and released, for precise reports of misuse.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use dashmap::DashMap;
use steppool_sys::CUdeviceptr;

use crate::error::{Error, Result};
use crate::phase::Phase;
use crate::pool::PhasePool;

/// How many released ranges checked mode remembers.
const RELEASED_LOG_CAPACITY: usize = 1 << 20;

/// Raw pointers released at boundaries, for checked mode's use-after-release reports.
#[derive(Debug, Default)]
struct ReleasedLog {
    /// base → (size, phase, step).
    ranges: BTreeMap<CUdeviceptr, (u64, Phase, u64)>,
    order: VecDeque<CUdeviceptr>,
}

impl ReleasedLog {
    fn forget_overlaps(&mut self, ptr: CUdeviceptr, len: u64) {
        let overlapping: Vec<CUdeviceptr> = self
            .ranges
            .range(..ptr + len.max(1))
            .rev()
            .take_while(|&(&base, &(size, _, _))| base + size > ptr)
            .map(|(&base, _)| base)
            .collect();
        for base in overlapping {
            self.ranges.remove(&base);
        }
    }

    fn insert(&mut self, ptr: CUdeviceptr, size: u64, phase: Phase, step: u64) {
        self.ranges.insert(ptr, (size, phase, step));
        self.order.push_back(ptr);
        while self.order.len() > RELEASED_LOG_CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.ranges.remove(&old);
            }
        }
    }

    fn find(&self, ptr: CUdeviceptr) -> Option<(Phase, u64)> {
        let (&base, &(size, phase, step)) = self.ranges.range(..=ptr).next_back()?;
        (ptr < base + size.max(1)).then_some((phase, step))
    }
}

/// Pointers handed out by the raw API, and their pools.
///
/// Lock order: a pool's lock, then the table; never the table, then a pool (look the pool up,
/// let go of the entry, then lock it).
#[derive(Debug)]
pub(crate) struct RawTable {
    checked: bool,
    pools: DashMap<CUdeviceptr, Arc<PhasePool>>,
    /// Checked mode: live raw allocations by address, for range checks.
    ranges: Mutex<BTreeMap<CUdeviceptr, (u64, Phase)>>,
    /// Checked mode: raw allocations released at boundaries.
    released: Mutex<ReleasedLog>,
}

impl RawTable {
    pub(crate) fn new(checked: bool) -> Self {
        Self { checked, pools: DashMap::new(), ranges: Mutex::default(), released: Mutex::default() }
    }

    pub(crate) fn is_checked(&self) -> bool {
        self.checked
    }

    /// Registers a pointer `pool` just handed out (under the pool's lock).
    pub(crate) fn register(&self, ptr: CUdeviceptr, bytes: u64, pool: &Arc<PhasePool>) {
        self.pools.insert(ptr, pool.clone());
        if self.checked {
            self.ranges.lock().unwrap_or_else(PoisonError::into_inner).insert(ptr, (bytes, pool.phase()));
            self.released.lock().unwrap_or_else(PoisonError::into_inner).forget_overlaps(ptr, bytes);
        }
    }

    /// The pool a pointer came from.
    pub(crate) fn pool_of(&self, ptr: CUdeviceptr) -> Option<Arc<PhasePool>> {
        self.pools.get(&ptr).map(|entry| entry.value().clone())
    }

    /// Drops released or freed pointers of `pool`; checked mode remembers the ones a boundary of
    /// `step` released.
    pub(crate) fn forget(&self, pool: &PhasePool, pointers: &[(CUdeviceptr, u64)], step: Option<u64>) {
        if pointers.is_empty() {
            return;
        }
        for (ptr, _) in pointers {
            // Only this pool's entry: the address may already serve another pool's allocation.
            self.pools.remove_if(ptr, |_, owner| std::ptr::eq(Arc::as_ptr(owner), pool));
        }
        if self.checked {
            let mut ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
            let mut log = self.released.lock().unwrap_or_else(PoisonError::into_inner);
            for &(ptr, bytes) in pointers {
                ranges.remove(&ptr);
                if let Some(step) = step {
                    log.insert(ptr, bytes, pool.phase(), step);
                }
            }
        }
    }

    /// In checked mode, the live allocation holding `ptr`: `(base, size)`.
    pub(crate) fn range_of(&self, ptr: CUdeviceptr) -> Option<(CUdeviceptr, u64)> {
        let ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
        let (&base, &(size, _)) = ranges.range(..=ptr).next_back()?;
        (ptr < base + size).then_some((base, size))
    }

    /// The error for a pointer the table does not know: in checked mode, the step that released
    /// it if one did. `phase_name` names a phase.
    pub(crate) fn unknown(&self, ptr: CUdeviceptr, phase_name: impl Fn(Phase) -> String) -> Error {
        if self.checked {
            let found = self.released.lock().unwrap_or_else(PoisonError::into_inner).find(ptr);
            if let Some((phase, step)) = found {
                return Error::UseAfterRelease { ptr, phase: phase_name(phase), step };
            }
        }
        Error::UnknownPointer { ptr }
    }
}

/// `Ok` if `[ptr, ptr + len)` lies inside `[base, base + size)`.
pub(crate) fn within(ptr: CUdeviceptr, len: u64, base: CUdeviceptr, size: u64) -> Result<()> {
    if ptr.checked_add(len).is_some_and(|end| end <= base + size) {
        Ok(())
    } else {
        Err(Error::OutOfBounds { ptr, len, base, size })
    }
}
