//! Opaque handles of the simulated driver.
//!
//! A handle is an integer in pointer clothing, never dereferenced: a tag byte, the simulated
//! driver's instance number, the kind of object, and its id. Decoding checks all three, so a
//! stream passed where a pool is expected, a handle of another simulated driver, or a made-up
//! value is refused the way the real driver refuses a bad handle.

/// The kinds of objects behind handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Context = 1,
    Stream = 2,
    Event = 3,
    Pool = 4,
    Module = 5,
    Function = 6,
    Graph = 7,
    GraphExec = 8,
    /// A physical allocation of `cuMemCreate` (`vmm.rs`).
    Physical = 16,
}

const TAG: usize = 0x5E;

/// The handle of object `id` of `kind` in simulated driver `instance`.
pub(crate) fn encode(instance: u16, kind: Kind, id: u32) -> usize {
    (TAG << 56) | ((instance as usize) << 40) | ((kind as usize) << 32) | id as usize
}

/// The id behind `raw` when it is a handle of `kind` from simulated driver `instance`.
pub(crate) fn decode(instance: u16, kind: Kind, raw: usize) -> Option<u32> {
    let matches = raw >> 56 == TAG && (raw >> 40) & 0xFFFF == instance as usize && (raw >> 32) & 0xFF == kind as usize;
    matches.then_some(raw as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_foreign_handles() {
        let raw = encode(7, Kind::Pool, 42);
        assert_eq!(decode(7, Kind::Pool, raw), Some(42));
        assert_eq!(decode(8, Kind::Pool, raw), None, "another simulated driver");
        assert_eq!(decode(7, Kind::Stream, raw), None, "another kind");
        assert_eq!(decode(7, Kind::Pool, 0), None);
        assert_eq!(decode(7, Kind::Pool, 0x1234), None);
    }
}
