//! Boundary control: which step and micro-step are active, who owns them, and the activity flags
//! raw allocations read under their pool's lock.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

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
