//! Early warnings: what a rule says when it fires, with the numbers that triggered it. The rules
//! that fire them are in [`telemetry`](crate::telemetry).

use std::fmt;

use steppool_sys::bytes::Bytes;

/// What a warning says, with the numbers that triggered it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum WarningKind {
    /// See [`FragmentationRule`](crate::telemetry::FragmentationRule).
    Fragmentation {
        /// The phase.
        phase: String,
        /// Its ratio in the step that fired.
        ratio: f64,
        /// The rule's threshold.
        threshold: f64,
        /// Consecutive steps above it.
        steps: u32,
        /// The largest peak of live bytes of the phase in the rule's window.
        peak_used: u64,
        /// Its peak reservation in the step that fired.
        peak_reserved: u64,
    },
    /// See [`ScatteredFreeRule`](crate::telemetry::ScatteredFreeRule).
    ScatteredFree {
        /// The phase.
        phase: String,
        /// The pool's stream.
        stream: u32,
        /// The largest request of the pool in the window.
        largest_request: u64,
        /// The largest free piece in the pool.
        largest_free: u64,
        /// All free bytes in the pool.
        total_free: u64,
        /// Free device memory.
        device_free: u64,
    },
    /// See [`ReservedCreepRule`](crate::telemetry::ReservedCreepRule).
    ReservedCreep {
        /// The phase.
        phase: String,
        /// Steps in the window.
        steps: u32,
        /// Reserved at the end of the window's first step.
        reserved_from: u64,
        /// Reserved now.
        reserved_to: u64,
        /// Peak live bytes in the window's first step.
        peak_used_from: u64,
        /// Peak live bytes now.
        peak_used_to: u64,
    },
    /// See [`LowHeadroomRule`](crate::telemetry::LowHeadroomRule).
    LowHeadroom {
        /// Free device memory plus reserved memory without live data.
        headroom: u64,
        /// The largest step demand in the window.
        demand: u64,
        /// Free device memory.
        device_free: u64,
        /// The rule's margin.
        margin: f64,
    },
}

/// The early-warning rules, one per kind of [`Warning`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum WarningRule {
    /// [`FragmentationRule`](crate::telemetry::FragmentationRule).
    Fragmentation,
    /// [`ScatteredFreeRule`](crate::telemetry::ScatteredFreeRule).
    ScatteredFree,
    /// [`ReservedCreepRule`](crate::telemetry::ReservedCreepRule).
    ReservedCreep,
    /// [`LowHeadroomRule`](crate::telemetry::LowHeadroomRule).
    LowHeadroom,
}

impl WarningRule {
    /// The rule's name: `fragmentation`, `scattered_free`, `reserved_creep` or `low_headroom`.
    pub fn name(self) -> &'static str {
        match self {
            WarningRule::Fragmentation => "fragmentation",
            WarningRule::ScatteredFree => "scattered_free",
            WarningRule::ReservedCreep => "reserved_creep",
            WarningRule::LowHeadroom => "low_headroom",
        }
    }
}

impl fmt::Display for WarningRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One firing of a rule.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Warning {
    /// The step whose end evaluated it.
    pub step: u64,
    /// The device.
    pub device: usize,
    /// What it says.
    pub kind: WarningKind,
}

impl Warning {
    /// The rule that fired it.
    pub fn rule(&self) -> WarningRule {
        match self.kind {
            WarningKind::Fragmentation { .. } => WarningRule::Fragmentation,
            WarningKind::ScatteredFree { .. } => WarningRule::ScatteredFree,
            WarningKind::ReservedCreep { .. } => WarningRule::ReservedCreep,
            WarningKind::LowHeadroom { .. } => WarningRule::LowHeadroom,
        }
    }

    /// The phase it is about, if one.
    pub fn phase(&self) -> Option<&str> {
        match &self.kind {
            WarningKind::Fragmentation { phase, .. }
            | WarningKind::ScatteredFree { phase, .. }
            | WarningKind::ReservedCreep { phase, .. } => Some(phase),
            WarningKind::LowHeadroom { .. } => None,
        }
    }
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} device {}: ", self.step, self.device)?;
        match &self.kind {
            WarningKind::Fragmentation { phase, ratio, threshold, steps, peak_used, peak_reserved } => write!(
                f,
                "fragmentation of `{phase}` above {:.0}% for {steps} steps: {:.1}% now ({} reserved at the peak, while recent steps needed at most {} live)",
                threshold * 100.0,
                ratio * 100.0,
                Bytes(*peak_reserved),
                Bytes(*peak_used),
            ),
            WarningKind::ScatteredFree { phase, stream, largest_request, largest_free, total_free, device_free } => {
                write!(
                    f,
                    "free memory of `{phase}` on stream {stream} is scattered: {} free but the largest piece is {}, and the device has {} free, while recent steps asked for {} at once; the next such request will fail",
                    Bytes(*total_free),
                    Bytes(*largest_free),
                    Bytes(*device_free),
                    Bytes(*largest_request),
                )
            }
            WarningKind::ReservedCreep { phase, steps, reserved_from, reserved_to, peak_used_from, peak_used_to } => {
                write!(
                    f,
                    "reserved memory of `{phase}` grew from {} to {} over {steps} steps while its peak live bytes stayed at {} → {}: creep or a leak of reservations",
                    Bytes(*reserved_from),
                    Bytes(*reserved_to),
                    Bytes(*peak_used_from),
                    Bytes(*peak_used_to),
                )
            }
            WarningKind::LowHeadroom { headroom, demand, device_free, margin } => write!(
                f,
                "headroom {} ({} free on the device, the rest reserved without live data) is short of the largest recent step demand {}, with {:.0}% margin on what must come from the device: the next such step may run out of memory",
                Bytes(*headroom),
                Bytes(*device_free),
                Bytes(*demand),
                margin * 100.0,
            ),
        }
    }
}
