//! Interoperation with the frameworks steppool is embedded in, each behind a cargo feature of its
//! own so that the runtime depends on none of them by default.
//!
//! - [`cudarc`] (feature `cudarc`): typed views of buffers for cudarc's launches and copies,
//!   steppool and cudarc streams over one `CUstream`, and routing cudarc's allocations into a
//!   phase's pool.

#[cfg(feature = "cudarc")]
pub mod cudarc;
