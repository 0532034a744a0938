//! Vector clocks: how far each stream's work is known to have progressed.
//!
//! Every stream-ordered operation moves its stream one position forward. A stream's clock says,
//! for each stream, the latest position that work now enqueued on it is ordered after (through
//! events, the legacy default stream, or a dependency the allocator inserted). The device's
//! `completed` clock says which positions the host has observed to be complete.

use std::collections::BTreeMap;

/// Identifies a stream inside one simulated driver.
pub(crate) type StreamId = u32;

/// A position per stream; a missing entry is position 0, before any operation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(BTreeMap<StreamId, u64>);

impl Clock {
    /// The position known for `stream`.
    pub(crate) fn get(&self, stream: StreamId) -> u64 {
        self.0.get(&stream).copied().unwrap_or(0)
    }

    /// Raises the position known for `stream` to at least `position`.
    pub(crate) fn advance(&mut self, stream: StreamId, position: u64) {
        let entry = self.0.entry(stream).or_insert(0);
        *entry = (*entry).max(position);
    }

    /// Raises every position to at least the one `other` knows.
    pub(crate) fn join(&mut self, other: &Clock) {
        for (&stream, &position) in &other.0 {
            self.advance(stream, position);
        }
    }

    /// Whether every position `other` knows is known here too.
    #[cfg(test)]
    pub(crate) fn covers(&self, other: &Clock) -> bool {
        other.0.iter().all(|(&stream, &position)| self.get(stream) >= position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_takes_the_larger_position_per_stream() {
        let mut a = Clock::default();
        a.advance(1, 5);
        a.advance(2, 1);
        let mut b = Clock::default();
        b.advance(2, 7);
        b.advance(3, 2);
        a.join(&b);
        assert_eq!((a.get(1), a.get(2), a.get(3), a.get(4)), (5, 7, 2, 0));
        assert!(a.covers(&b) && !b.covers(&a));
    }
}
