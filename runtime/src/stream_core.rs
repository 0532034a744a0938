//! A stream as the runtime holds it: its device, its handle, and the stream-order calls the pools
//! make on it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use steppool_sys::handle::StreamHandle;
use steppool_sys::{CUevent_flags, CUstream};

use crate::device_core::DeviceCore;
use crate::error::{Error, Result};

static NEXT_STREAM: AtomicU32 = AtomicU32::new(1);

/// A stream as the runtime holds it; destroyed on drop when steppool created it.
pub(crate) struct StreamCore {
    pub(crate) device: Arc<DeviceCore>,
    handle: StreamHandle,
    owned: bool,
    /// Unique in the process; names the stream in reports.
    pub(crate) id: u32,
    /// The id of the runtime it belongs to, to refuse foreign streams.
    pub(crate) runtime: u64,
}

impl StreamCore {
    pub(crate) fn new(device: Arc<DeviceCore>, raw: CUstream, owned: bool, runtime: u64) -> Self {
        let id = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        Self { device, handle: StreamHandle::from_raw(raw), owned, id, runtime }
    }

    /// The stream's driver handle.
    #[inline]
    pub(crate) fn raw(&self) -> CUstream {
        self.handle.raw()
    }

    /// Readies the calling thread for a call on this stream: the special handles (`NULL`, legacy,
    /// per-thread) mean the current context's stream, so that context must be current.
    pub(crate) fn prepare(&self) -> Result<()> {
        if (self.raw() as usize) <= 2 {
            self.device.make_current()?;
        }
        Ok(())
    }

    /// Makes later work on this stream wait for the work enqueued so far on `other`, which may be
    /// on another device: the event is made and recorded in `other`'s context, as
    /// `cuEventRecord` requires, and a stream may wait on an event of any context.
    pub(crate) fn wait_for(&self, other: &StreamCore) -> Result<()> {
        let driver = &self.device.driver;
        other.device.make_current()?;
        let event = driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: `event` was just created in `other`'s (now current) context, and `other` is
        // live while its core is.
        let recorded = unsafe { driver.event_record(event, other.raw()) }.map_err(Error::from);
        let ordered = recorded.and_then(|()| {
            self.prepare()?;
            // SAFETY: this stream is live while its core is; the event was recorded above.
            Ok(unsafe { driver.stream_wait_event(self.raw(), event) }?)
        });
        // SAFETY: the event is not used after this; a pending wait keeps what it needs.
        let destroyed = unsafe { driver.event_destroy(event) };
        ordered?;
        destroyed?;
        Ok(())
    }
}

impl fmt::Debug for StreamCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({} on device {})", self.id, self.device.ordinal)
    }
}

impl Drop for StreamCore {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: steppool created this stream and nothing uses it any more: pools and
            // buffers on it hold this core. Work already enqueued still completes.
            let _ = unsafe { self.device.driver.stream_destroy(self.raw()) };
        }
    }
}
