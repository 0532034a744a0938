//! [`Stream`] and [`Event`]. Each stream carries the pools of its phases, so finding the pool of
//! an allocation is an index, not a lookup under a shared lock.

use std::fmt;
use std::sync::{Arc, OnceLock};

use steppool_sys::handle::EventHandle;
use steppool_sys::{CUevent, CUevent_flags, CUstream};

use crate::device_core::DeviceCore;
use crate::error::Result;
use crate::pool::PoolSlots;
use crate::stream_core::StreamCore;

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
        self.core.raw()
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
        unsafe { self.core.device.driver.stream_synchronize(self.core.raw()) }?;
        Ok(())
    }

    /// Whether the work enqueued on the stream is complete.
    pub fn is_idle(&self) -> Result<bool> {
        self.core.prepare()?;
        // SAFETY: the stream is live while its core is.
        Ok(unsafe { self.core.device.driver.stream_query(self.core.raw()) }?)
    }

    /// Records an event that completes when the work enqueued so far does.
    pub fn record_event(&self) -> Result<Event> {
        let device = self.core.device.clone();
        device.make_current()?;
        let raw = device.driver.event_create(CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        let event = Event { device, handle: EventHandle::from_raw(raw) };
        self.core.prepare()?;
        // SAFETY: both handles are live.
        unsafe { event.device.driver.event_record(event.raw(), self.core.raw()) }?;
        Ok(event)
    }

    /// Makes work enqueued on this stream from now on wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.core.prepare()?;
        // SAFETY: both handles are live.
        unsafe { self.core.device.driver.stream_wait_event(self.core.raw(), event.raw()) }?;
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
    handle: EventHandle,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Event({:p})", self.handle.raw())
    }
}

impl Event {
    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.handle.raw()
    }

    /// Waits for the recorded work.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live.
        unsafe { self.device.driver.event_synchronize(self.raw()) }?;
        Ok(())
    }

    /// Whether the recorded work is complete.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: the event is live.
        Ok(unsafe { self.device.driver.event_query(self.raw()) }?)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live and not used after this.
        let _ = unsafe { self.device.driver.event_destroy(self.raw()) };
    }
}
