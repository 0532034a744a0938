//! Why a trace could not be read, with the file and the line (or snapshot record, or byte offset)
//! at fault.

use std::fmt;
use std::path::{Path, PathBuf};

/// Where in a trace file something is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Location {
    /// A line of a text trace, from 1.
    Line(u64),
    /// Entry `index` (from 0) of device `device`'s trace in a PyTorch snapshot.
    Entry {
        /// The device's position in `device_traces`.
        device: u32,
        /// The entry's index in that device's list.
        index: u64,
    },
    /// Block `block` of segment `segment` in a PyTorch snapshot's `segments` (the allocator's
    /// state at the dump), both from 0.
    Block {
        /// The segment's position in `segments`.
        segment: u64,
        /// The block's position in the segment's `blocks`.
        block: u64,
    },
    /// Event `index` (from 0) of a Chrome trace's `traceEvents` (a PyTorch profiler trace).
    TraceEvent(u64),
    /// The whole file, or a place outside its records (the end of a trace).
    File,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(line) => write!(f, "line {line}"),
            Location::Entry { device, index } => write!(f, "device_traces[{device}][{index}]"),
            Location::Block { segment, block } => write!(f, "segments[{segment}].blocks[{block}]"),
            Location::TraceEvent(index) => write!(f, "traceEvents[{index}]"),
            Location::File => f.write_str("the file as a whole"),
        }
    }
}

/// What went wrong reading or analysing a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is none of the formats steppool reads.
    #[error(
        "{path}: not a trace steppool reads: expected an RMM log (header `Thread,Time,Action,Pointer,Size,Stream`), \
         a PyTorch memory snapshot pickle, a PyTorch profiler trace (Chrome trace JSON with `traceEvents`, gzipped or not), \
         or a steppool trace (JSON lines with a `steppool-trace` header)"
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// A record of the trace cannot be used.
    #[error("{path}: {location}: {message}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The line or record.
        location: Location,
        /// What is wrong with it.
        message: String,
    },
    /// A pickle that cannot be decoded (truncated, corrupt, or not a pickle).
    #[error("{path}: not a readable pickle ({message}); a truncated file is the usual cause")]
    Pickle {
        /// The file.
        path: PathBuf,
        /// The decoder's message, with the byte offset.
        message: String,
    },
    /// The step sidecar (`<stem>.json` beside the trace) cannot be used.
    #[error("{path}: step sidecar: {message}")]
    Sidecar {
        /// The sidecar file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl TraceError {
    /// A [`TraceError::Malformed`] of `path` at `location`.
    pub fn malformed(path: &Path, location: Location, message: impl Into<String>) -> Self {
        TraceError::Malformed { path: path.to_owned(), location, message: message.into() }
    }
}

/// A result with [`TraceError`].
pub type Result<T, E = TraceError> = std::result::Result<T, E>;
