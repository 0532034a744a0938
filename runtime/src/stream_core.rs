//! A stream as the runtime holds it: its device, its handle, and the stream-order calls the pools
//! make on it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use steppool_sys::handle::StreamHandle;
use steppool_sys::{CUevent_flags, CUstream, CUstreamCaptureStatus, DriverError};

use crate::device_core::DeviceCore;
use crate::error::{CaptureError, Error, Result};

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
    /// The driver's capture epoch ([`Driver::capture_epoch`](steppool_sys::Driver::capture_epoch))
    /// when the stream was last found outside capture; [`NEVER_SEEN`] before that.
    outside_capture_at: AtomicU64,
}

/// No capture epoch: the stream was never found outside capture.
const NEVER_SEEN: u64 = u64::MAX;

impl StreamCore {
    pub(crate) fn new(device: Arc<DeviceCore>, raw: CUstream, owned: bool, runtime: u64) -> Self {
        let id = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        let outside_capture_at = AtomicU64::new(NEVER_SEEN);
        Self { device, handle: StreamHandle::from_raw(raw), owned, id, runtime, outside_capture_at }
    }

    /// Whether steppool created the stream (and destroys it with the core), rather than
    /// wrapping a caller's, which the caller may destroy once the wrapper is gone.
    #[inline]
    pub(crate) fn is_owned(&self) -> bool {
        self.owned
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

/// Stream capture, as the allocation path, frees and boundaries ask about it.
impl StreamCore {
    /// Whether the stream is capturing (`cuStreamGetCaptureInfo`): `None` when not, else the
    /// capture's id and whether it was invalidated.
    ///
    /// Asked at every allocation, so the answer is kept where the driver can say it has not
    /// changed: a stream found outside capture stays so while the driver's capture epoch (which
    /// moves before any stream begins or joins a capture) reads the same. The epoch is read
    /// before the question, so a capture begun after it is seen by the next call. The real
    /// driver has no epoch (captures are begun by callers it does not see) and is asked every
    /// time; so are the special handles (`NULL`, legacy, per-thread), whose stream depends on
    /// the calling thread.
    #[inline]
    pub(crate) fn capture(&self) -> Result<Option<(u64, bool)>> {
        let epoch = if (self.raw() as usize) <= 2 { None } else { self.device.driver.capture_epoch() };
        if let Some(epoch) = epoch
            && self.outside_capture_at.load(Ordering::Acquire) == epoch
        {
            return Ok(None);
        }
        let capture = self.ask_capture()?;
        if let (None, Some(epoch)) = (capture, epoch) {
            self.outside_capture_at.store(epoch, Ordering::Release);
        }
        Ok(capture)
    }

    /// [`StreamCore::capture`], asking the driver.
    #[cold]
    fn ask_capture(&self) -> Result<Option<(u64, bool)>> {
        self.prepare()?;
        let driver = &self.device.driver;
        // SAFETY: this stream is live while its core is.
        let (status, id) = match unsafe { driver.stream_capture_info(self.raw()) } {
            Ok(info) => (info.status, info.id),
            // Before 11.3 there is no `cuStreamGetCaptureInfo_v2`: the status alone, id 0.
            // SAFETY: as above.
            Err(DriverError::MissingSymbol { .. }) => (unsafe { driver.stream_is_capturing(self.raw()) }?, 0),
            Err(error) => return Err(error.into()),
        };
        let invalidated = status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED;
        Ok((status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some((id, invalidated)))
    }

    /// Ends a capture the runtime cannot serve and destroys its graph, so that the stream is
    /// usable again; returns the error that says so.
    #[cold]
    pub(crate) fn end_capture(&self, operation: &'static str, id: u64, invalidated: bool) -> Error {
        let driver = &self.device.driver;
        // SAFETY: this stream is live while its core is.
        if let Ok(graph) = unsafe { driver.stream_end_capture(self.raw()) } {
            // SAFETY: the graph was just returned by the driver and is used by nobody else.
            let _ = unsafe { driver.graph_destroy(graph) };
        }
        let stream = self.id;
        if invalidated {
            Error::Capture(CaptureError::Invalidated { stream, id })
        } else {
            Error::Capture(CaptureError::Unsafe { operation, stream, id })
        }
    }

    /// Fails with a [`CaptureError`], ending the capture, when the stream is capturing; with the
    /// driver's error when it cannot tell.
    #[inline]
    pub(crate) fn refuse_capture(&self, operation: &'static str) -> Result<()> {
        match self.capture()? {
            None => Ok(()),
            Some((id, invalidated)) => Err(self.end_capture(operation, id, invalidated)),
        }
    }

    /// As [`StreamCore::refuse_capture`] for an operation that must go on whatever the answer (a
    /// boundary's release): a stream that cannot say whether it captures is taken as not
    /// capturing, and the release's own calls report the driver's state.
    pub(crate) fn end_any_capture(&self, operation: &'static str) -> Result<()> {
        match self.capture() {
            Ok(Some((id, invalidated))) => Err(self.end_capture(operation, id, invalidated)),
            _ => Ok(()),
        }
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
