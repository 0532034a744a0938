//! Driver handles as `Send + Sync` newtypes, for the long-lived structs that keep them.
//!
//! `CUcontext`, `CUstream`, `CUevent` and `CUmemoryPool` are raw pointers, so a struct that holds
//! one is neither `Send` nor `Sync`, and each such struct would need an `unsafe impl` of its own.
//! These wrappers carry that argument once, here, for the handle alone: a struct that holds a
//! [`StreamHandle`] instead of a `CUstream` is `Send + Sync` when its other fields are.
//!
//! A wrapper promises nothing about the handle's liveness. [`Driver`](crate::Driver)'s methods
//! take the raw handle ([`raw`](StreamHandle::raw)), and those that act on one stay `unsafe`:
//! whoever stores a handle still answers for it being live and of that driver when it is used.

use std::fmt;

use crate::bindings::{CUcontext, CUevent, CUmemoryPool, CUstream};

/// Declares one `#[repr(transparent)]` wrapper per driver handle type, with its accessors, its
/// `Debug` and its `Send + Sync`.
macro_rules! handles {
    ($($(#[$doc:meta])* $name:ident($raw:ty);)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name($raw);

        impl $name {
            /// Wraps a raw handle. Nothing is checked or retained: the wrapper is as live as the
            /// handle it holds.
            pub const fn from_raw(raw: $raw) -> Self {
                Self(raw)
            }

            /// The raw handle, to pass to [`Driver`](crate::Driver) or to other CUDA code.
            pub const fn raw(self) -> $raw {
                self.0
            }

            /// Whether the handle is null (for a stream: the default stream).
            pub fn is_null(self) -> bool {
                self.0.is_null()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:p})"), self.0)
            }
        }

        // SAFETY: a driver handle is an opaque token that Rust code never dereferences; only the
        // driver reads what it points to. The CUDA driver API is thread-safe: any thread may pass
        // a context, stream, event or pool handle to it, and a context may be current on several
        // threads at once ("Context Management" in the driver API reference). Moving the token
        // to another thread, or reading it from several, is therefore sound; whether the handle
        // is still live is the concern of the `unsafe` driver calls that use it, not of this type.
        unsafe impl Send for $name {}
        // SAFETY: as for `Send`: the wrapper is an immutable copy of an opaque token.
        unsafe impl Sync for $name {}
    )*};
}

handles! {
    /// A `CUcontext`: a device's primary context, or any context of the driver.
    ContextHandle(CUcontext);
    /// A `CUstream`, including the special handles `NULL`,
    /// [`CU_STREAM_LEGACY`](crate::CU_STREAM_LEGACY) and
    /// [`CU_STREAM_PER_THREAD`](crate::CU_STREAM_PER_THREAD).
    StreamHandle(CUstream);
    /// A `CUevent`.
    EventHandle(CUevent);
    /// A `CUmemoryPool`.
    PoolHandle(CUmemoryPool);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CU_STREAM_LEGACY;

    #[test]
    fn handles_are_send_sync_and_as_small_as_the_raw_handle() {
        fn shared<T: Send + Sync + Copy>() {}
        shared::<ContextHandle>();
        shared::<StreamHandle>();
        shared::<EventHandle>();
        shared::<PoolHandle>();
        assert_eq!(size_of::<StreamHandle>(), size_of::<CUstream>());
        assert_eq!(size_of::<Option<PoolHandle>>(), size_of::<Option<CUmemoryPool>>());
    }

    #[test]
    fn handles_round_trip_and_print_their_address() {
        let legacy = StreamHandle::from_raw(CU_STREAM_LEGACY);
        assert_eq!(legacy.raw(), CU_STREAM_LEGACY);
        assert!(!legacy.is_null());
        assert!(StreamHandle::from_raw(std::ptr::null_mut()).is_null());
        assert_eq!(format!("{legacy:?}"), "StreamHandle(0x1)");
        assert_ne!(legacy, StreamHandle::from_raw(crate::CU_STREAM_PER_THREAD));
    }
}
