//! The registry: a runtime's devices, phases and pools, and the one lock under which any of them
//! is created or changed.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use steppool_sys::Driver;

use crate::device_core::{DeviceCore, GivesBackFreed};
use crate::error::{Error, Result};
use crate::phase::{MAX_PHASES, Phase, PhaseEntry, PhaseSpec};
use crate::pool::{PhasePool, PoolSinks, PoolSlots};
use crate::stream_core::StreamCore;

/// Devices, phases and pools.
#[derive(Debug)]
pub(crate) struct Registry {
    devices: Vec<OnceLock<Arc<DeviceCore>>>,
    phases: RwLock<Vec<Arc<PhaseEntry>>>,
    /// Every pool, weakly: a pool belongs to its stream (and the persistent buffers and raw
    /// allocations on it, and the step whose buffers used it: `StepPools`), and goes away with
    /// them while the stream is still live.
    pools: RwLock<Vec<Weak<PhasePool>>>,
    /// Serializes pool creation, phase spec changes and peer grants (all rare); the hot path
    /// reads a stream's pool slots without it.
    creating: Mutex<()>,
}

impl Registry {
    /// A registry for `device_count` devices and the built-in phases.
    pub(crate) fn new(device_count: usize) -> Self {
        let phases = Phase::built_in_specs()
            .into_iter()
            .enumerate()
            .map(|(index, spec)| PhaseEntry::new(Phase(index as u16), spec))
            .collect();
        Self {
            devices: (0..device_count).map(|_| OnceLock::new()).collect(),
            phases: RwLock::new(phases),
            pools: RwLock::new(Vec::new()),
            creating: Mutex::new(()),
        }
    }

    /// Takes the creation lock.
    pub(crate) fn creating(&self) -> MutexGuard<'_, ()> {
        self.creating.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Device `ordinal`, opened (its primary context retained) on first use.
    pub(crate) fn device(&self, driver: &Driver, ordinal: usize) -> Result<Arc<DeviceCore>> {
        let slot = self.devices.get(ordinal).ok_or(Error::NoSuchDevice { ordinal, count: self.devices.len() })?;
        if let Some(core) = slot.get() {
            return Ok(core.clone());
        }
        let _creating = self.creating();
        if let Some(core) = slot.get() {
            return Ok(core.clone());
        }
        let core = Arc::new(DeviceCore::open(driver, ordinal)?);
        let _ = slot.set(core.clone());
        Ok(core)
    }

    /// The devices opened so far.
    pub(crate) fn open_devices(&self) -> Vec<Arc<DeviceCore>> {
        self.devices.iter().filter_map(|slot| slot.get().cloned()).collect()
    }

    /// Device `ordinal` if it was opened.
    pub(crate) fn opened(&self, ordinal: usize) -> Option<&Arc<DeviceCore>> {
        self.devices.get(ordinal)?.get()
    }

    pub(crate) fn phase(&self, phase: Phase) -> Result<Arc<PhaseEntry>> {
        let phases = read(&self.phases);
        let count = phases.len();
        phases.get(phase.index()).cloned().ok_or(Error::UnknownPhase { index: phase.index(), count })
    }

    pub(crate) fn phases(&self) -> RwLockReadGuard<'_, Vec<Arc<PhaseEntry>>> {
        read(&self.phases)
    }

    /// Declares a new phase.
    pub(crate) fn declare_phase(&self, spec: PhaseSpec) -> Result<Phase> {
        spec.validate()?;
        let mut phases = write(&self.phases);
        if phases.iter().any(|entry| entry.spec.name == spec.name) {
            return Err(Error::DuplicatePhase { name: spec.name });
        }
        if phases.len() >= MAX_PHASES {
            return Err(Error::TooManyPhases { max: MAX_PHASES });
        }
        let phase = Phase(phases.len() as u16);
        phases.push(PhaseEntry::new(phase, spec));
        Ok(phase)
    }

    /// Replaces a phase's spec; only before its first pool exists.
    pub(crate) fn set_phase_spec(&self, phase: Phase, spec: PhaseSpec) -> Result<()> {
        spec.validate()?;
        let _creating = self.creating();
        let mut phases = write(&self.phases);
        let count = phases.len();
        let entry = phases.get(phase.index()).ok_or(Error::UnknownPhase { index: phase.index(), count })?;
        if entry.in_use.load(Ordering::Acquire) {
            return Err(Error::PhaseInUse { phase: entry.spec.name.clone() });
        }
        if phases.iter().any(|other| other.phase != phase && other.spec.name == spec.name) {
            return Err(Error::DuplicatePhase { name: spec.name });
        }
        phases[phase.index()] = PhaseEntry::new(phase, spec);
        Ok(())
    }

    /// Every live pool, in creation order.
    pub(crate) fn pools(&self) -> Vec<Arc<PhasePool>> {
        read(&self.pools).iter().filter_map(Weak::upgrade).collect()
    }

    /// Every live pool on device `device`.
    pub(crate) fn pools_on(&self, device: usize) -> Vec<Arc<PhasePool>> {
        self.pools().into_iter().filter(|pool| pool.device_ordinal() == device).collect()
    }

    /// The pool of `phase` in `slots` (a stream's), created on first use; `created` runs on a
    /// new pool before anyone else can see it. Borrowed from the slot: an index, no reference
    /// counted.
    #[inline]
    pub(crate) fn pool<'s>(
        &self,
        stream: &Arc<StreamCore>,
        slots: &'s PoolSlots,
        phase: Phase,
        sinks: impl FnOnce() -> PoolSinks,
        created: impl FnOnce(&PhasePool) -> Result<()>,
    ) -> Result<&'s Arc<PhasePool>> {
        let slot = slots
            .get(phase.index())
            .ok_or_else(|| Error::UnknownPhase { index: phase.index(), count: read(&self.phases).len() })?;
        if let Some(pool) = slot.get() {
            return Ok(pool);
        }
        self.create_pool(stream, slot, phase, sinks, created)
    }

    /// [`Registry::pool`] when the slot is empty: creates the pool under the creation lock.
    #[cold]
    fn create_pool<'s>(
        &self,
        stream: &Arc<StreamCore>,
        slot: &'s OnceLock<Arc<PhasePool>>,
        phase: Phase,
        sinks: impl FnOnce() -> PoolSinks,
        created: impl FnOnce(&PhasePool) -> Result<()>,
    ) -> Result<&'s Arc<PhasePool>> {
        let _creating = self.creating();
        if let Some(pool) = slot.get() {
            return Ok(pool);
        }
        // Read under the creation lock, which `set_phase_spec` takes too: the spec cannot
        // change between this read and marking the phase in use.
        let entry = self.phase(phase)?;
        entry.in_use.store(true, Ordering::Release);
        let peers = stream.device.peers();
        let pool = Arc::new(PhasePool::new(entry, stream.clone(), &peers, sinks())?);
        created(&pool)?;
        let gives_back = Arc::downgrade(&pool) as Weak<dyn GivesBackFreed>;
        stream.device.freed.register(gives_back);
        let mut pools = write(&self.pools);
        pools.retain(|pool| pool.strong_count() > 0);
        pools.push(Arc::downgrade(&pool));
        drop(pools);
        Ok(slot.get_or_init(|| pool))
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}
