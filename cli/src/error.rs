//! Why a replay could not run; reading a trace fails with [`steppool_trace::TraceError`].

use steppool_trace::Location;

/// What went wrong setting up or running a replay (running out of memory is a result, not an
/// error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A replay setting that cannot work.
    #[error("{0}")]
    Invalid(String),
    /// The runtime refused something the replay relies on.
    #[error("replay of event {event} ({location}) under `{strategy}`: {source}")]
    Runtime {
        /// The strategy being replayed.
        strategy: String,
        /// The event's index in the trace.
        event: usize,
        /// Its line or record.
        location: Location,
        /// What the runtime said.
        source: Box<steppool::Error>,
    },
}

/// A result with [`ReplayError`].
pub type Result<T, E = ReplayError> = std::result::Result<T, E>;
