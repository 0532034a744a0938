//! Streams and events. Each stream carries the pools of its phases, so finding the pool of an
//! allocation is an index, not a lookup under a shared lock.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use steppool_sys::{CUevent, CUevent_flags, CUstream};

use crate::device::DeviceCore;
use crate::error::{Error, Result};
use crate::phase::MAX_PHASES;
use crate::pool::PhasePool;
use crate::runtime::RuntimeInner;

static NEXT_STREAM: AtomicU32 = AtomicU32::new(1);

/// A stream as the runtime holds it; destroyed on drop when steppool created it.
pub(crate) struct StreamCore {
    pub(crate) device: Arc<DeviceCore>,
    pub(crate) raw: CUstream,
    owned: bool,
    /// Unique in the process; names the stream in reports.
    pub(crate) id: u32,
    /// The id of the runtime it belongs to, to refuse foreign streams.
    pub(crate) runtime: u64,
}

// SAFETY: a CUstream is an opaque driver handle that may be used from any thread (the driver API
// is thread-safe); the handle is never mutated after construction.
unsafe impl Send for StreamCore {}
// SAFETY: as above.
unsafe impl Sync for StreamCore {}

impl StreamCore {
    pub(crate) fn new(device: Arc<DeviceCore>, raw: CUstream, owned: bool, runtime: &Arc<RuntimeInner>) -> Self {
        let id = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        Self { device, raw, owned, id, runtime: runtime.id }
    }

    /// Readies the calling thread for a call on this stream: the special handles (`NULL`, legacy,
    /// per-thread) mean the current context's stream, so that context must be current.
    pub(crate) fn prepare(&self) -> Result<()> {
        if (self.raw as usize) <= 2 {
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
        let recorded = unsafe { driver.event_record(event, other.raw) }.map_err(Error::from);
        let ordered = recorded.and_then(|()| {
            self.prepare()?;
            // SAFETY: this stream is live while its core is; the event was recorded above.
            Ok(unsafe { driver.stream_wait_event(self.raw, event) }?)
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
            let _ = unsafe { self.device.driver.stream_destroy(self.raw) };
        }
    }
}

/// The pools of one stream, by phase index.
pub(crate) type PoolSlots = [OnceLock<Arc<PhasePool>>; MAX_PHASES];

/// A stream of a [`Device`](crate::Device): created by steppool, or wrapped from a framework's.
/// Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Stream {
    pub(crate) core: Arc<StreamCore>,
    pub(crate) pools: Arc<PoolSlots>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({} on device {})", self.core.id, self.core.device.ordinal)
    }
}

impl Stream {
    pub(crate) fn new(core: StreamCore) -> Self {
        Self { core: Arc::new(core), pools: Arc::new(std::array::from_fn(|_| OnceLock::new())) }
    }

    /// The raw handle, to launch work on.
    pub fn raw(&self) -> CUstream {
        self.core.raw
    }

    /// The stream's id, as reports name it.
    pub fn id(&self) -> u32 {
        self.core.id
    }

    /// The ordinal of its device.
    pub fn device_ordinal(&self) -> usize {
        self.core.device.ordinal
    }

    /// Waits for the work enqueued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.core.prepare()?;
        // SAFETY: the stream is live while its core is.
        unsafe { self.core.device.driver.stream_synchronize(self.core.raw) }?;
        Ok(())
    }

    /// Whether the work enqueued on the stream is complete.
    pub fn is_idle(&self) -> Result<bool> {
        self.core.prepare()?;
        // SAFETY: the stream is live while its core is.
        Ok(unsafe { self.core.device.driver.stream_query(self.core.raw) }?)
    }

    /// Records an event that completes when the work enqueued so far does.
    pub fn record_event(&self) -> Result<Event> {
        let device = self.core.device.clone();
        device.make_current()?;
        let raw = device.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        let event = Event { device, raw };
        self.core.prepare()?;
        // SAFETY: both handles are live.
        unsafe { event.device.driver.event_record(event.raw, self.core.raw) }?;
        Ok(event)
    }

    /// Makes work enqueued on this stream from now on wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.core.prepare()?;
        // SAFETY: both handles are live.
        unsafe { self.core.device.driver.stream_wait_event(self.core.raw, event.raw) }?;
        Ok(())
    }

    /// Makes work enqueued on this stream from now on wait for the work enqueued so far on `other`.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        self.core.wait_for(&other.core)
    }
}

/// An event; destroyed on drop.
pub struct Event {
    device: Arc<DeviceCore>,
    raw: CUevent,
}

// SAFETY: a CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for Event {}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({:p})", self.raw)
    }
}

impl Event {
    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// Waits for the recorded work.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        unsafe { self.device.driver.event_synchronize(self.raw) }?;
        Ok(())
    }

    /// Whether the recorded work is complete.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: the event is live.
        Ok(unsafe { self.device.driver.event_query(self.raw) }?)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live and not used after this.
        let _ = unsafe { self.device.driver.event_destroy(self.raw) };
    }
}
