//! The lifetime class of a phase: how long its allocations live, spelled one way in every file
//! steppool reads or writes.

use std::fmt;

/// How long a phase's allocations live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Until freed; no step boundary touches them (weights, optimizer state). Allocated from the
    /// runtime itself.
    Persistent,
    /// Until the end of the step at the latest (activations, gradients, workspace). Allocated from
    /// a step or one of its micro-steps.
    Step,
    /// Until the end of the micro-step at the latest (per-micro-batch activations under gradient
    /// accumulation). Allocated from a micro-step.
    MicroStep,
}

impl Scope {
    /// Every scope, from the longest-lived to the shortest.
    pub const ALL: [Scope; 3] = [Scope::Persistent, Scope::Step, Scope::MicroStep];

    /// `persistent`, `step` or `micro_step`: the spelling of step reports, traces and CLI output.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Persistent => "persistent",
            Scope::Step => "step",
            Scope::MicroStep => "micro_step",
        }
    }

    /// The scope [`Scope::name`] spells `name`.
    pub fn from_name(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.name() == name)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_use_underscores() {
        for scope in Scope::ALL {
            assert_eq!(Scope::from_name(scope.name()), Some(scope));
            assert_eq!(scope.to_string(), scope.name());
        }
        assert_eq!(Scope::MicroStep.name(), "micro_step");
        assert_eq!(Scope::from_name("micro-step"), None, "the old spelling is the version 1 reader's business");
    }
}
