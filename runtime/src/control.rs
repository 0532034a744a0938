//! Boundary control: which step and micro-step are active, who owns them, and the activity flags
//! raw allocations read under their pool's lock.
//!
//! # The boundary protocol
//!
//! Three primitives (from [`sync`](crate::sync)) make a boundary atomic for other threads: the
//! boundary lock ([`Control::lock`], over [`Steps`]), the activity flags, and each pool's lock.
//!
//! - **A boundary** takes the boundary lock, clears its scope's flag ([`Steps::end`],
//!   [`Steps::end_micro`]), then takes the locks of every pool of the scopes it ends (in registry
//!   order), frees what is live in them and resets them, and lets go of the pool locks, then of
//!   the boundary lock.
//! - **A raw allocation** takes its pool's lock, then asks [`Control::admit_raw`]: it is refused
//!   once the flag is clear. Admitted, it is in the pool (and the raw table) before the lock is
//!   let go. So it lands before the release takes that pool, and is released, or it is refused;
//!   never after the release, where it would outlive its step. Checking the flag before taking
//!   the pool's lock, or clearing it after the release, breaks this.
//! - **A raw free** looks the pool up, takes its lock and takes the allocation out; if a boundary
//!   got there first the pointer is unknown. Each allocation is freed once, by one of them.
//! - **Statistics and metrics** hold the boundary lock while they read the pools, so they see a
//!   release whole or not at all. The pool locks alone would not do: a reader taking them one
//!   after another could straddle a release that holds them all.
//! - **Out-of-memory recovery** holds one pool's lock at a time: it lets go of the failing pool,
//!   takes each pool's lock in turn (the failing one's too) to give back idle memory, and retries
//!   under the failing pool's lock again. Holding the failing pool's lock while trimming the others would deadlock
//!   two recoveries in two pools.
//!
//! Lock order: boundary → pool → raw table. `tests/loom_boundary.rs` checks these rules in every
//! interleaving with loom (`cargo xtask loom`), against the runtime built with loom's primitives.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::phase::Scope;
use crate::sync::{AtomicU8, Mutex, MutexGuard};

/// Set in the activity flags while a step is active.
const STEP_ACTIVE: u8 = 1;
/// Set in the activity flags while a micro-step is active.
const MICRO_ACTIVE: u8 = 2;

/// The active micro-step.
#[derive(Debug)]
pub(crate) struct ActiveMicro {
    pub(crate) index: u32,
    guarded: bool,
    pub(crate) started: Instant,
}

/// The active step.
#[derive(Debug)]
pub(crate) struct ActiveStep {
    pub(crate) index: u64,
    guarded: bool,
    pub(crate) started: Instant,
    micro: Option<ActiveMicro>,
    pub(crate) micro_steps: u32,
    /// Time spent in this step's releases so far.
    pub(crate) release_time: Duration,
}

/// The step state behind the boundary lock.
#[derive(Debug, Default)]
pub(crate) struct Steps {
    step: Option<ActiveStep>,
    next_step: u64,
}

/// The boundary lock and the activity flags.
#[derive(Debug, Default)]
pub(crate) struct Control {
    steps: Mutex<Steps>,
    /// `STEP_ACTIVE | MICRO_ACTIVE`, cleared at the start of a boundary's release; read by raw
    /// allocations under their pool's lock, so an allocation either lands before a release (and
    /// is released) or is refused.
    activity: AtomicU8,
}

impl Control {
    /// Takes the boundary lock: no boundary runs while it is held.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Steps> {
        self.steps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The active step's index, without waiting for a boundary in progress.
    pub(crate) fn active_step_unlocked(&self) -> Option<u64> {
        self.steps.try_lock().ok()?.step.as_ref().map(|step| step.index)
    }

    /// Whether a step is active, as raw allocations see it.
    pub(crate) fn step_active(&self) -> bool {
        self.activity.load(Ordering::Acquire) & STEP_ACTIVE != 0
    }

    /// Whether a micro-step is active, as raw allocations see it.
    pub(crate) fn micro_step_active(&self) -> bool {
        self.activity.load(Ordering::Acquire) & MICRO_ACTIVE != 0
    }

    /// Admits a raw allocation of a `scope` phase, or refuses it once the boundary that ends that
    /// scope has begun. Called under the pool's lock, after taking it: a boundary clears the flag
    /// before it takes the locks of the pools it releases, so an admitted allocation is in its
    /// pool before the release takes the pool, and is released with it.
    #[inline]
    pub(crate) fn admit_raw(&self, scope: Scope) -> Result<()> {
        match scope {
            Scope::Step if !self.step_active() => Err(Error::NoActiveStep),
            Scope::MicroStep if !self.micro_step_active() => Err(Error::NoActiveMicroStep),
            _ => Ok(()),
        }
    }

    fn set_activity(&self, step: bool, micro: bool) {
        let flags = if step { STEP_ACTIVE } else { 0 } | if micro { MICRO_ACTIVE } else { 0 };
        self.activity.store(flags, Ordering::Release);
    }
}

impl Steps {
    /// The active step's index.
    pub(crate) fn active(&self) -> Option<u64> {
        self.step.as_ref().map(|step| step.index)
    }

    /// Checks that a step may begin; returns its index.
    pub(crate) fn check_begin(&self) -> Result<u64> {
        match &self.step {
            Some(step) => Err(Error::StepActive { index: step.index }),
            None => Ok(self.next_step),
        }
    }

    /// Begins the step [`Steps::check_begin`] named.
    pub(crate) fn begin(&mut self, control: &Control, guarded: bool) -> u64 {
        let index = self.next_step;
        self.next_step += 1;
        self.step = Some(ActiveStep {
            index,
            guarded,
            started: Instant::now(),
            micro: None,
            micro_steps: 0,
            release_time: Duration::ZERO,
        });
        control.set_activity(true, false);
        index
    }

    /// Begins a micro-step of the active step; returns (step, micro-step).
    pub(crate) fn begin_micro(&mut self, control: &Control, guarded: bool) -> Result<(u64, u32)> {
        let step = self.step.as_mut().ok_or(Error::NoActiveStep)?;
        if let Some(micro) = &step.micro {
            return Err(Error::MicroStepActive { step: step.index, index: micro.index });
        }
        let index = step.micro_steps;
        step.micro_steps += 1;
        step.micro = Some(ActiveMicro { index, guarded, started: Instant::now() });
        control.set_activity(true, true);
        Ok((step.index, index))
    }

    /// Ends the active micro-step (refused if a guard owns it and `guarded` is false) and clears
    /// its flag; returns it with its step, whose release time the caller adds to.
    pub(crate) fn end_micro(&mut self, control: &Control, guarded: bool) -> Result<(&mut ActiveStep, ActiveMicro)> {
        let step = self.step.as_mut().ok_or(Error::NoActiveStep)?;
        let micro = step.micro.as_ref().ok_or(Error::NoActiveMicroStep)?;
        if micro.guarded && !guarded {
            return Err(Error::OwnedByGuard { index: step.index });
        }
        let micro = step.micro.take().ok_or(Error::NoActiveMicroStep)?;
        control.set_activity(true, false);
        Ok((step, micro))
    }

    /// Ends the active step (refused if a guard owns it and `guarded` is false) and clears the
    /// flags.
    pub(crate) fn end(&mut self, control: &Control, guarded: bool) -> Result<ActiveStep> {
        let step = self.step.as_ref().ok_or(Error::NoActiveStep)?;
        if step.guarded && !guarded {
            return Err(Error::OwnedByGuard { index: step.index });
        }
        let step = self.step.take().ok_or(Error::NoActiveStep)?;
        control.set_activity(false, false);
        Ok(step)
    }
}
