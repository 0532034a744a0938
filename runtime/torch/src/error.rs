//! [`TorchError`]: why a call of the C ABI failed, with the numbers, and its JSON form, which the
//! Python package turns into an exception carrying the same fields.

use serde_json::{Value, json};
use steppool::telemetry::json::oom_json;

/// Why a call failed. The message names the numbers; [`TorchError::to_json`] gives them as
/// fields.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum TorchError {
    /// A size below zero: PyTorch passes `ssize_t`, so a negative value is a caller's bug.
    #[error("invalid size {size}: an allocation size is a byte count, zero or more")]
    BadSize {
        /// The size given.
        size: i64,
    },
    /// A free whose size is not the size the pointer was allocated with.
    #[error("free of {ptr:#x} with size {given}, but it was allocated with {allocated} bytes: not freed")]
    SizeMismatch {
        /// The pointer.
        ptr: u64,
        /// The size the free gave.
        given: i64,
        /// The size allocated.
        allocated: u64,
    },
    /// A device ordinal below zero or past the devices the driver has.
    #[error("device {device} does not exist: the driver has {count} device(s)")]
    BadDevice {
        /// The ordinal given.
        device: i64,
        /// How many devices there are.
        count: usize,
    },
    /// An allocation past the fraction of a device set with the memory-fraction hook.
    #[error(
        "{requested} bytes on device {device} would bring its reserved memory to {would_reserve} bytes, \
         past the memory fraction {fraction} ({allowed} bytes)"
    )]
    MemoryFraction {
        /// Bytes requested.
        requested: u64,
        /// The device.
        device: usize,
        /// Reserved bytes after the request.
        would_reserve: u64,
        /// The fraction set.
        fraction: f64,
        /// The fraction in bytes.
        allowed: u64,
    },
    /// A memory fraction outside 0..=1.
    #[error("memory fraction {fraction} is outside 0..=1")]
    BadFraction {
        /// The fraction given.
        fraction: f64,
    },
    /// `init` after the library was initialised (explicitly, or by a first allocation).
    #[error("steppool is already initialised ({existing}); init can run once, before the first allocation")]
    AlreadyInitialised {
        /// The configuration in force.
        existing: String,
    },
    /// A configuration, name or scope that does not parse.
    #[error("{0}")]
    Invalid(String),
    /// A phase entered with a scope other than the one it was declared with.
    #[error("phase `{phase}` is {existing}-scoped; it was entered as {requested}")]
    ScopeMismatch {
        /// The phase.
        phase: String,
        /// Its scope.
        existing: &'static str,
        /// The scope asked for.
        requested: &'static str,
    },
    /// `phase_leave` on a thread that entered no phase.
    #[error("no phase was entered on this thread")]
    NoPhase,
    /// The history is not being recorded, so there is no snapshot to write.
    #[error("no allocation history was recorded: start recording first (record_history at init, or start_recording)")]
    NotRecording,
    /// A file or socket could not be used.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// What the runtime refused (out of memory, an unknown pointer, a step misused, ...).
    #[error(transparent)]
    Runtime(#[from] steppool::Error),
    /// A panic inside steppool, caught at the boundary.
    #[error("internal error (a panic, caught at the C boundary): {0}")]
    Panic(String),
}

impl TorchError {
    /// A short name of the kind, which the Python package maps to an exception class.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            TorchError::BadSize { .. } => "bad_size",
            TorchError::SizeMismatch { .. } => "size_mismatch",
            TorchError::BadDevice { .. } => "bad_device",
            TorchError::MemoryFraction { .. } => "out_of_memory",
            TorchError::BadFraction { .. } => "invalid",
            TorchError::AlreadyInitialised { .. } => "already_initialised",
            TorchError::Invalid(_) => "invalid",
            TorchError::ScopeMismatch { .. } => "invalid",
            TorchError::NoPhase => "invalid",
            TorchError::NotRecording => "not_recording",
            TorchError::Io { .. } => "io",
            TorchError::Runtime(error) if error.is_out_of_memory() => "out_of_memory",
            TorchError::Runtime(steppool::Error::UnknownPointer { .. }) => "unknown_pointer",
            TorchError::Runtime(steppool::Error::UseAfterRelease { .. }) => "use_after_release",
            TorchError::Runtime(_) => "runtime",
            TorchError::Panic(_) => "panic",
        }
    }

    /// The error as a JSON object: `kind`, `message`, and the numbers as fields (the OOM report
    /// whole under `oom`).
    pub(crate) fn to_json(&self) -> Value {
        let mut value = json!({ "kind": self.kind(), "message": self.to_string() });
        let fields = match self {
            TorchError::BadSize { size } => json!({ "size": size }),
            TorchError::SizeMismatch { ptr, given, allocated } => {
                json!({ "ptr": ptr, "size": given, "allocated_bytes": allocated })
            }
            TorchError::BadDevice { device, count } => json!({ "device": device, "device_count": count }),
            TorchError::MemoryFraction { requested, device, would_reserve, fraction, allowed } => json!({
                "requested_bytes": requested, "device": device, "would_reserve_bytes": would_reserve,
                "fraction": fraction, "allowed_bytes": allowed, "verdict": "limit",
            }),
            TorchError::BadFraction { fraction } => json!({ "fraction": fraction }),
            TorchError::Runtime(error) => match error.oom_report() {
                Some(report) => {
                    let oom = oom_json(report);
                    json!({ "requested_bytes": report.requested, "verdict": oom["verdict"], "oom": oom })
                }
                None => match error {
                    steppool::Error::UnknownPointer { ptr } => json!({ "ptr": ptr }),
                    steppool::Error::UseAfterRelease { ptr, phase, step } => {
                        json!({ "ptr": ptr, "phase": phase, "step": step })
                    }
                    _ => json!({}),
                },
            },
            _ => json!({}),
        };
        if let (Some(object), Value::Object(fields)) = (value.as_object_mut(), fields) {
            object.extend(fields);
        }
        value
    }
}

/// A result of the ABI's calls.
pub(crate) type Result<T, E = TorchError> = std::result::Result<T, E>;
