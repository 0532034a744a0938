//! Fault injection: any entry point of the simulated device made to fail, with the codes a real
//! driver returns, so that tests and programs can see what steppool does when the driver fails
//! in the middle of a step.
//!
//! A [`FaultPlan`] says which calls fail and with what:
//! - **when**: the Nth call, every call from the Nth on, or each call at random with a seed and
//!   a rate. Calls are counted from 1 over the entry points the plan covers;
//! - **which entry points**: all of them but `cuGetErrorName`/`cuGetErrorString` (a failing
//!   driver still names its errors), the virtual memory management calls (`cuMemCreate`,
//!   `cuMemMap`, `cuMemSetAccess`, ...) included, or a list;
//! - **what code**: one of [`FaultCode`], picked in turn (or at random with the seed) from the
//!   plan's list.
//!
//! Codes that poison a real context poison the simulated driver: after `CUDA_ERROR_ILLEGAL_ADDRESS`
//! or `CUDA_ERROR_LAUNCH_FAILED` (sticky errors), and after `CUDA_ERROR_DEINITIALIZED` (the driver
//! shutting down, as at process exit), every later call of any entry point returns that code.
//!
//! From the environment, `STEPPOOL_SIM_FAULTS` holds a plan as comma-separated `key=value`
//! pairs (see [`FaultPlan::parse`]): `seed=3,rate=0.001`, `nth=120,code=oom`,
//! `from=500,code=deinitialized`, `rate=0.01,calls=cuMemAllocFromPoolAsync|cuMemFreeAsync`.

use std::fmt;

use crate::bindings::CUresult;

/// A code an injected fault returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultCode {
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    OutOfMemory,
    /// `CUDA_ERROR_NOT_READY`.
    NotReady,
    /// `CUDA_ERROR_INVALID_VALUE`.
    InvalidValue,
    /// `CUDA_ERROR_INVALID_HANDLE`.
    InvalidHandle,
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`: sticky, the context is poisoned.
    IllegalAddress,
    /// `CUDA_ERROR_LAUNCH_FAILED`: sticky, the context is poisoned.
    LaunchFailed,
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
    CaptureInvalidated,
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
    CaptureUnsupported,
    /// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down; every later call fails too.
    Deinitialized,
}

impl FaultCode {
    /// Every code, in the order of their names in [`FaultCode::name`].
    pub const ALL: [FaultCode; 9] = [
        FaultCode::OutOfMemory,
        FaultCode::NotReady,
        FaultCode::InvalidValue,
        FaultCode::InvalidHandle,
        FaultCode::IllegalAddress,
        FaultCode::LaunchFailed,
        FaultCode::CaptureInvalidated,
        FaultCode::CaptureUnsupported,
        FaultCode::Deinitialized,
    ];

    /// The codes a plan uses when it names none: those a call can return and the program go on
    /// after (no sticky error, no shutdown).
    pub const RECOVERABLE: [FaultCode; 5] = [
        FaultCode::OutOfMemory,
        FaultCode::NotReady,
        FaultCode::InvalidValue,
        FaultCode::InvalidHandle,
        FaultCode::CaptureInvalidated,
    ];

    /// The name a plan spells it with.
    pub fn name(self) -> &'static str {
        match self {
            FaultCode::OutOfMemory => "oom",
            FaultCode::NotReady => "not_ready",
            FaultCode::InvalidValue => "invalid_value",
            FaultCode::InvalidHandle => "invalid_handle",
            FaultCode::IllegalAddress => "illegal_address",
            FaultCode::LaunchFailed => "launch_failed",
            FaultCode::CaptureInvalidated => "capture_invalidated",
            FaultCode::CaptureUnsupported => "capture_unsupported",
            FaultCode::Deinitialized => "deinitialized",
        }
    }

    /// The driver's code.
    pub fn code(self) -> CUresult {
        match self {
            FaultCode::OutOfMemory => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            FaultCode::NotReady => CUresult::CUDA_ERROR_NOT_READY,
            FaultCode::InvalidValue => CUresult::CUDA_ERROR_INVALID_VALUE,
            FaultCode::InvalidHandle => CUresult::CUDA_ERROR_INVALID_HANDLE,
            FaultCode::IllegalAddress => CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            FaultCode::LaunchFailed => CUresult::CUDA_ERROR_LAUNCH_FAILED,
            FaultCode::CaptureInvalidated => CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            FaultCode::CaptureUnsupported => CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            FaultCode::Deinitialized => CUresult::CUDA_ERROR_DEINITIALIZED,
        }
    }

    /// Whether every later call returns this code too: a sticky error, or the driver shut down.
    pub fn poisons(self) -> bool {
        matches!(self, FaultCode::IllegalAddress | FaultCode::LaunchFailed | FaultCode::Deinitialized)
    }
}

/// When a plan's faults fire.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Trigger {
    /// Call `n` (from 1) of the covered entry points, once.
    Nth(u64),
    /// Every covered call from call `n` (from 1) on.
    From(u64),
    /// Each covered call, with probability `rate`, from a generator seeded with `seed`.
    Random {
        /// The seed: the same seed and calls give the same faults.
        seed: u64,
        /// The probability of a fault per call, in `[0, 1]`.
        rate: f64,
    },
}

/// Which calls of the simulated device fail, and with what: a [`Trigger`] (the Nth call, every
/// call from the Nth on, or each call at random with a seed and a rate, counting the covered
/// entry points' calls from 1), the [`FaultCode`]s used in turn (sticky errors and a shutdown
/// poison every later call of any entry point), and the entry points covered (all but
/// `cuGetErrorName` and `cuGetErrorString` unless listed). [`FaultPlan::parse`] reads the
/// `STEPPOOL_SIM_FAULTS` syntax.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultPlan {
    /// When faults fire.
    pub trigger: Trigger,
    /// The codes, used in turn (for `Random`, picked at random); never empty.
    pub codes: Vec<FaultCode>,
    /// The entry points covered (their exported names, such as `cuMemAllocFromPoolAsync`);
    /// `None` for all but `cuGetErrorName` and `cuGetErrorString`.
    pub calls: Option<Vec<String>>,
}

/// Why a fault plan was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "STEPPOOL_SIM_FAULTS=`{value}`: {reason}; write for example `seed=3,rate=0.001`, `nth=120,code=oom` or \
     `from=500,code=deinitialized` (codes: oom, not_ready, invalid_value, invalid_handle, illegal_address, \
     launch_failed, capture_invalidated, capture_unsupported, deinitialized; `calls=` a `|`-separated list of \
     entry points)"
)]
pub struct FaultPlanError {
    /// The plan as written.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FaultPlan {
    /// Call `n` fails with `code`.
    pub fn nth(n: u64, code: FaultCode) -> Self {
        Self { trigger: Trigger::Nth(n), codes: vec![code], calls: None }
    }

    /// Every call from call `n` on fails with `code`.
    pub fn from_call(n: u64, code: FaultCode) -> Self {
        Self { trigger: Trigger::From(n), codes: vec![code], calls: None }
    }

    /// Each call fails with probability `rate`, with one of the [recoverable](FaultCode::RECOVERABLE)
    /// codes.
    pub fn random(seed: u64, rate: f64) -> Self {
        Self { trigger: Trigger::Random { seed, rate }, codes: FaultCode::RECOVERABLE.to_vec(), calls: None }
    }

    /// The same plan with these codes.
    pub fn codes(mut self, codes: &[FaultCode]) -> Self {
        self.codes = codes.to_vec();
        self
    }

    /// The same plan covering only these entry points.
    pub fn calls(mut self, calls: &[&str]) -> Self {
        self.calls = Some(calls.iter().map(|&c| c.to_owned()).collect());
        self
    }

    /// Reads a plan: comma-separated `key=value` pairs, one trigger (`nth=N`, `from=N`, or
    /// `rate=R` with an optional `seed=S`, 0 by default), then optionally `code=NAME` or
    /// `codes=NAME|NAME…` and `calls=NAME|NAME…`.
    pub fn parse(value: &str) -> Result<Self, FaultPlanError> {
        let refuse = |reason: String| FaultPlanError { value: value.to_owned(), reason };
        let (mut nth, mut from, mut seed, mut rate, mut codes, mut calls) = (None, None, None, None, None, None);
        for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, text) = pair.split_once('=').ok_or_else(|| refuse(format!("`{pair}` is not key=value")))?;
            let number = || text.parse::<u64>().map_err(|_| refuse(format!("{key}=`{text}` is not a whole number")));
            match key {
                "nth" => nth = Some(number()?),
                "from" => from = Some(number()?),
                "seed" => seed = Some(number()?),
                "rate" => {
                    let r: f64 = text.parse().map_err(|_| refuse(format!("rate=`{text}` is not a number")))?;
                    if !(0.0..=1.0).contains(&r) {
                        return Err(refuse(format!("rate={text} is outside [0, 1]")));
                    }
                    rate = Some(r);
                }
                "code" | "codes" => {
                    let list = text
                        .split('|')
                        .map(|name| {
                            FaultCode::ALL
                                .into_iter()
                                .find(|c| c.name() == name)
                                .ok_or_else(|| refuse(format!("`{name}` is not a fault code")))
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    codes = Some(list);
                }
                "calls" => calls = Some(text.split('|').map(str::to_owned).collect::<Vec<_>>()),
                other => return Err(refuse(format!("unknown key `{other}`"))),
            }
        }
        let trigger = match (nth, from, rate) {
            (Some(0), None, None) | (None, Some(0), None) => return Err(refuse("calls count from 1".to_owned())),
            (Some(n), None, None) => Trigger::Nth(n),
            (None, Some(n), None) => Trigger::From(n),
            (None, None, Some(rate)) => Trigger::Random { seed: seed.unwrap_or(0), rate },
            (None, None, None) => return Err(refuse("no trigger: give nth=, from= or rate=".to_owned())),
            _ => return Err(refuse("more than one trigger: give one of nth=, from= and rate=".to_owned())),
        };
        if seed.is_some() && !matches!(trigger, Trigger::Random { .. }) {
            return Err(refuse("seed= goes with rate=".to_owned()));
        }
        let codes = codes.unwrap_or_else(|| match trigger {
            Trigger::Random { .. } => FaultCode::RECOVERABLE.to_vec(),
            _ => vec![FaultCode::OutOfMemory],
        });
        if codes.is_empty() {
            return Err(refuse("no code".to_owned()));
        }
        Ok(Self { trigger, codes, calls })
    }

    /// Whether the plan covers `entry_point`.
    fn covers(&self, entry_point: &str) -> bool {
        match &self.calls {
            Some(calls) => calls.iter().any(|c| c == entry_point),
            None => !matches!(entry_point, "cuGetErrorName" | "cuGetErrorString"),
        }
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.trigger {
            Trigger::Nth(n) => write!(f, "nth={n}")?,
            Trigger::From(n) => write!(f, "from={n}")?,
            Trigger::Random { seed, rate } => write!(f, "seed={seed},rate={rate}")?,
        }
        let codes: Vec<&str> = self.codes.iter().map(|c| c.name()).collect();
        write!(f, ",codes={}", codes.join("|"))?;
        if let Some(calls) = &self.calls {
            write!(f, ",calls={}", calls.join("|"))?;
        }
        Ok(())
    }
}

/// A plan being carried out: the calls counted, the faults fired, the poison if any.
#[derive(Debug)]
pub(crate) struct Faults {
    plan: Option<FaultPlan>,
    calls: u64,
    fired: u64,
    rng: u64,
    poisoned: Option<FaultCode>,
}

impl Faults {
    pub(crate) fn new(plan: Option<FaultPlan>) -> Self {
        let mut faults = Self { plan: None, calls: 0, fired: 0, rng: 0, poisoned: None };
        faults.set(plan);
        faults
    }

    /// Replaces the plan and starts counting afresh; the poison stays (a poisoned driver is not
    /// healed by a new plan).
    pub(crate) fn set(&mut self, plan: Option<FaultPlan>) {
        self.rng = match &plan {
            Some(FaultPlan { trigger: Trigger::Random { seed, .. }, .. }) => seed ^ 0x9e37_79b9_7f4a_7c15,
            _ => 0,
        };
        self.plan = plan;
        self.calls = 0;
    }

    /// Faults fired so far.
    pub(crate) fn fired(&self) -> u64 {
        self.fired
    }

    /// The poison, if a sticky error or a shutdown fired.
    pub(crate) fn poisoned(&self) -> Option<FaultCode> {
        self.poisoned
    }

    /// Whether the call of `entry_point` about to run fails, and with which code.
    pub(crate) fn check(&mut self, entry_point: &str) -> Option<CUresult> {
        if let Some(poison) = self.poisoned
            && !matches!(entry_point, "cuGetErrorName" | "cuGetErrorString")
        {
            return Some(poison.code());
        }
        let plan = self.plan.as_ref()?;
        if !plan.covers(entry_point) {
            return None;
        }
        self.calls += 1;
        let (fire, pick) = match plan.trigger {
            Trigger::Nth(n) => (self.calls == n, self.fired),
            Trigger::From(n) => (self.calls >= n, self.fired),
            Trigger::Random { rate, .. } => {
                // 53 random bits as a fraction in [0, 1).
                let draw = (splitmix(&mut self.rng) >> 11) as f64 / (1u64 << 53) as f64;
                let fire = draw < rate;
                (fire, if fire { splitmix(&mut self.rng) } else { 0 })
            }
        };
        if !fire {
            return None;
        }
        let codes = &plan.codes;
        let code = codes[(pick % codes.len() as u64) as usize];
        self.fired += 1;
        if code.poisons() {
            self.poisoned = Some(code);
        }
        Some(code.code())
    }
}

/// splitmix64: the next pseudo-random number of `state`.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_read_and_print_back() {
        for text in [
            "seed=3,rate=0.001,codes=oom|not_ready|invalid_value|invalid_handle|capture_invalidated",
            "nth=120,codes=oom",
            "from=500,codes=deinitialized",
            "seed=0,rate=0.01,codes=illegal_address,calls=cuMemAllocFromPoolAsync|cuMemFreeAsync",
        ] {
            assert_eq!(FaultPlan::parse(text).unwrap().to_string(), text);
        }
        assert_eq!(FaultPlan::parse("seed=3,rate=0.001").unwrap(), FaultPlan::random(3, 0.001));
        assert_eq!(FaultPlan::parse("nth=7").unwrap(), FaultPlan::nth(7, FaultCode::OutOfMemory));
    }

    #[test]
    fn bad_plans_say_what_is_wrong() {
        for (text, reason) in [
            ("", "no trigger"),
            ("nth=0", "count from 1"),
            ("nth=1,from=2", "more than one trigger"),
            ("rate=2", "outside [0, 1]"),
            ("rate=x", "not a number"),
            ("nth=3,seed=1", "seed= goes with rate="),
            ("nth=3,code=segfault", "`segfault` is not a fault code"),
            ("nth", "not key=value"),
            ("every=3", "unknown key `every`"),
        ] {
            let error = FaultPlan::parse(text).unwrap_err();
            assert!(error.reason.contains(reason), "{text}: {}", error.reason);
            assert!(error.to_string().contains("seed=3,rate=0.001"), "the message shows the syntax");
        }
    }

    #[test]
    fn nth_and_from_fire_on_their_calls_of_the_covered_entry_points() {
        let mut faults = Faults::new(Some(FaultPlan::nth(3, FaultCode::InvalidValue).calls(&["cuMemAlloc_v2"])));
        let seen: Vec<Option<CUresult>> =
            ["cuMemAlloc_v2", "cuMemFree_v2", "cuMemAlloc_v2", "cuMemAlloc_v2", "cuMemAlloc_v2"]
                .into_iter()
                .map(|name| faults.check(name))
                .collect();
        assert_eq!(seen, [None, None, None, Some(CUresult::CUDA_ERROR_INVALID_VALUE), None]);
        let mut faults = Faults::new(Some(FaultPlan::from_call(2, FaultCode::NotReady)));
        assert_eq!(faults.check("cuStreamQuery"), None);
        assert_eq!(faults.check("cuStreamQuery"), Some(CUresult::CUDA_ERROR_NOT_READY));
        assert_eq!(faults.check("cuMemGetInfo_v2"), Some(CUresult::CUDA_ERROR_NOT_READY));
        assert_eq!(faults.check("cuGetErrorName"), None, "errors can still be named");
        assert_eq!(faults.fired(), 2);
    }

    #[test]
    fn random_faults_follow_their_seed_and_rate() {
        let run = |seed| {
            let mut faults = Faults::new(Some(FaultPlan::random(seed, 0.1)));
            (0..10_000).map(|_| faults.check("cuStreamQuery")).collect::<Vec<_>>()
        };
        let (a, b, c) = (run(1), run(1), run(2));
        assert_eq!(a, b, "same seed, same faults");
        assert_ne!(a, c, "another seed, other faults");
        let fired = a.iter().flatten().count();
        assert!((800..1200).contains(&fired), "about 10 % of 10 000: {fired}");
        let codes: std::collections::HashSet<_> = a.iter().flatten().collect();
        assert_eq!(codes.len(), FaultCode::RECOVERABLE.len(), "every recoverable code drawn");
    }

    #[test]
    fn sticky_errors_and_shutdown_poison_every_later_call() {
        for code in [FaultCode::IllegalAddress, FaultCode::LaunchFailed, FaultCode::Deinitialized] {
            let mut faults = Faults::new(Some(FaultPlan::nth(2, code).calls(&["cuLaunchKernel"])));
            assert_eq!(faults.check("cuLaunchKernel"), None);
            assert_eq!(faults.check("cuLaunchKernel"), Some(code.code()));
            for name in ["cuMemFreeAsync", "cuStreamSynchronize", "cuCtxGetCurrent"] {
                assert_eq!(faults.check(name), Some(code.code()), "{name} after {code:?}");
            }
            assert_eq!(faults.check("cuGetErrorString"), None);
            faults.set(None);
            assert_eq!(faults.check("cuMemAlloc_v2"), Some(code.code()), "a new plan does not heal it");
        }
        let mut faults = Faults::new(Some(FaultPlan::nth(1, FaultCode::OutOfMemory)));
        assert!(faults.check("cuMemAlloc_v2").is_some());
        assert_eq!(faults.check("cuMemAlloc_v2"), None, "out of memory poisons nothing");
        assert_eq!(faults.poisoned(), None);
    }
}
