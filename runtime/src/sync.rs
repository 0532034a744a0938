//! The synchronization primitives of the boundary protocol: the boundary lock and the activity
//! flags ([`Control`](crate::control)) and each pool's lock ([`PhasePool`](crate::pool)).
//!
//! They are std's in every build but one: with `--cfg loom` they are the
//! [loom](https://docs.rs/loom) model checker's, and `tests/loom_boundary.rs` explores every
//! interleaving (up to a preemption bound) of the runtime's own code at these primitives: step
//! ends against raw allocations and frees, out-of-memory recovery against other threads'
//! allocations, statistics read during a release. Nothing else changes between the two builds:
//! the runtime that is checked is the runtime that ships. State behind other locks (the
//! raw-pointer table, the registry, the telemetry, the driver) is touched in single linearizable
//! operations, which the model takes as atomic steps between these primitives.
//!
//! A loom build is for those tests only: its primitives work inside `loom::model` and nowhere
//! else. `cargo xtask loom` runs them (see ARCHITECTURE.md, "The boundary protocol").

#[cfg(loom)]
pub(crate) use loom::sync::atomic::AtomicU8;
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::AtomicU8;
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
