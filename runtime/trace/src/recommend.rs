//! The choice of a strategy from runs measured under each: one rule, which `steppool replay` uses
//! to name its recommended strategy and the runtime's automatic strategy (`Strategy::Auto`) uses to
//! choose a phase's strategy from its recorded first scope.
//!
//! **The rule**: of the candidates whose run completed, the one with the least peak reserved
//! bytes; on a tie, the one listed first. None when no candidate completed.
//!
//! What the peak is measured over is the caller's: `replay` passes each strategy's whole-run peak
//! reserved over the trace (the candidates are its strategies in report order: default-pool,
//! phase-pools, arena, planned); the runtime passes, for each strategy a phase can have (direct,
//! arena, planned, in that order), the peak reserved of its recorded scope replayed again on a
//! simulated device from the second scope on, since its first scope is already served when it
//! chooses. Listing the simpler strategy first makes a tie go to it.

/// One strategy's measured run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// Its name.
    pub name: &'a str,
    /// Whether its run served every allocation.
    pub completed: bool,
    /// The most bytes it reserved over the stretch measured.
    pub peak_reserved: u64,
}

/// The index of the candidate [the rule](self) chooses.
pub fn recommend(candidates: &[Candidate<'_>]) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.completed)
        .min_by_key(|&(index, c)| (c.peak_reserved, index))
        .map(|(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(name: &str, completed: bool, peak_reserved: u64) -> Candidate<'_> {
        Candidate { name, completed, peak_reserved }
    }

    #[test]
    fn the_least_peak_of_those_that_completed_the_first_on_ties() {
        let candidates =
            [candidate("a", true, 30), candidate("b", false, 10), candidate("c", true, 20), candidate("d", true, 20)];
        assert_eq!(recommend(&candidates), Some(2));
        assert_eq!(recommend(&[candidate("a", false, 1)]), None);
        assert_eq!(recommend(&[]), None);
    }
}
