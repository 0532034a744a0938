//! Phases: named lifetime classes of device memory, each with a scope, a strategy, and policies.
//!
//! A phase says how long its allocations live and how they are served. steppool gives each
//! (device, stream, phase) its own CUDA memory pool, so long-lived and short-lived tensors never
//! share one, and releases every allocation of a step-scoped phase at once at the boundary.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use steppool_trace::plans::{PhasePlans, PlanKey};

/// How long a phase's allocations live; defined with the trace model, so that the runtime, its
/// traces and their readers share one type and one spelling (`micro_step`).
pub use steppool_trace::Scope;

/// How a phase's allocations are served from its pools.
///
/// New strategies (such as planned slabs) slot in here; every strategy serves the same
/// allocate / free / reset-at-boundary calls, so the API above does not change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// Every allocation comes straight from the phase's CUDA pool (`cuMemAllocFromPoolAsync`);
    /// a free returns it in stream order, so memory is reused within the step.
    Direct,
    /// Bump allocation, 512-byte aligned, in slabs taken from the phase's CUDA pool. A free does
    /// nothing, except in stack order: freeing the most recent allocation moves the bump pointer
    /// back, so scratch buffers allocated and freed in turn share memory. The boundary resets the
    /// arena in O(1), keeping the slabs for the next step and returning the surplus by the trim
    /// policy. Requests larger than a slab get a slab of their own, reusable once freed.
    Arena {
        /// Size of each slab in bytes.
        slab_bytes: u64,
    },
    /// Best fit inside chunks of about `chunk_bytes` taken from the phase's CUDA pool (as many
    /// requests of the size that opens a chunk as fit, at least one, rounded up to the pool's
    /// 2 MiB granule), for long-lived allocations (weights, optimizer state).
    /// The pool reserves each request rounded up to its granule, so a run of 2.25 MiB tensors
    /// costs 4 MiB apiece unless smaller ones fill the tails; in chunks they lie end to end.
    /// Frees are reused at once; a chunk goes back only when nothing in it is handed out (at a
    /// boundary, by the trim policy, or when memory is short).
    Chunked {
        /// The size of a chunk in bytes, before it is fitted to the request that opens it.
        chunk_bytes: u64,
    },
    /// Offsets planned from a recording, for phases whose scopes repeat (step- or
    /// micro-step-scoped). A scope of a new shape is recorded (the slab, empty, goes back, and
    /// the scope is served best-fit from chunks taken from the CUDA pool, each given back once
    /// nothing in it is handed out); at its
    /// end its allocations are packed into one slab (greedy by size), so that allocations alive
    /// at the same time never overlap. Later scopes of that shape get allocation *i* at its
    /// planned offset when it is no larger than planned, or larger when the grown range is clear
    /// of every live allocation (a plan refreshed after the same allocations and frees with
    /// other sizes keeps, per entry, the largest size seen, or, where the sizes vary in shares of
    /// a fixed total such as tokens routed to experts, the latest sizes laid out in allocation
    /// order). A deviation (a larger size whose
    /// range is taken, an extra allocation, a planned range still held) is served, as is the rest
    /// of that scope, best-fit from the slab's free ranges, then from the chunks, and refreshes
    /// the plan at the scope's end. A chunk goes back as soon as nothing in it is handed out. Plans are keyed by the scope's first `signature_len` sizes, or by
    /// a key the user sets ([`Runtime::set_plan_key`](crate::Runtime::set_plan_key)); at most
    /// `max_plans` are kept (least recently used goes). A scope of a new shape whose sizes fit
    /// a larger shape's plan slot by slot is served from it. One slab serves every plan, sized for
    /// the plan of the last scope; it grows when a larger plan serves. [`PoolStats::plan`](crate::PoolStats::plan) reports hit rate,
    /// deviations, the slab, and each plan's size over its lower bound.
    Planned {
        /// How many plans (shapes) are kept, 1 to 1024.
        max_plans: u32,
        /// How many first sizes of a scope select its plan, 1 to 64.
        signature_len: u32,
    },
    /// Chosen by the phase pool from its first scope: served directly and recorded, then each of
    /// `Direct`, an arena (slabs of [`Strategy::arena_slab`] of the recorded peak) and [`Strategy::PLANNED`] is
    /// tried on the recording over a simulated device, and the one that reserves least from its
    /// second scope on serves every later scope (the rule `steppool replay` recommends by:
    /// `steppool_trace::recommend`). A chosen planned strategy starts with the plan packed from
    /// the recording. For step- or micro-step-scoped phases; the choice is in
    /// [`PoolStats::chosen`](crate::PoolStats::chosen).
    Auto,
}

impl Strategy {
    /// An arena with 64 MiB slabs.
    pub const ARENA: Strategy = Strategy::Arena { slab_bytes: 64 << 20 };

    /// Planned slabs keeping 8 plans, selected by the first 4 sizes of a scope.
    pub const PLANNED: Strategy = Strategy::Planned { max_plans: 8, signature_len: 4 };

    /// `direct`, `arena`, `chunked`, `planned` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Direct => "direct",
            Strategy::Arena { .. } => "arena",
            Strategy::Chunked { .. } => "chunked",
            Strategy::Planned { .. } => "planned",
            Strategy::Auto => "auto",
        }
    }

    /// The arena slab for a phase whose peak of live bytes is `peak_live`: an eighth of it,
    /// rounded up to the 2 MiB granule, between 2 MiB and 256 MiB. Eight slabs keep the unused
    /// tail of each slab (at most the largest allocation that did not fit) small against the
    /// peak, and the bounds keep tiny phases from taking many slabs and large ones from stranding
    /// a huge tail. `steppool replay` and the automatic strategy both size arenas so.
    pub fn arena_slab(peak_live: u64) -> u64 {
        const GRANULE: u64 = 2 << 20;
        (peak_live / 8).next_multiple_of(GRANULE).clamp(GRANULE, 256 << 20)
    }
}

/// What a phase's pools give back to the device at its boundaries.
///
/// Trimming never waits for the GPU: it releases memory whose frees the host has already
/// observed complete, so a boundary does not stall the pipeline. [`Device::release_idle`]
/// synchronizes and releases everything idle, when asked.
///
/// [`Device::release_idle`]: crate::Device::release_idle
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TrimPolicy {
    /// Keep everything reserved.
    Never,
    /// Keep at least the largest need of the last `steps` boundaries, what the next step is
    /// likely to need: the peak of live bytes for the pool strategy, the slabs touched for an
    /// arena. A one-off spike is given back once it leaves the window.
    KeepRecentPeak {
        /// How many boundaries the window spans (at least 1).
        steps: u32,
    },
    /// Keep at least this many bytes.
    KeepBytes(u64),
}

/// The description of a phase: its name, scope, strategy and policies.
///
/// ```
/// use steppool::{PhaseSpec, Scope, Strategy};
/// let spec = PhaseSpec::new("kv_cache", Scope::Persistent).budget(8 << 30);
/// let scratch = PhaseSpec::new("scratch", Scope::MicroStep).strategy(Strategy::ARENA);
/// assert_eq!(spec.budget, Some(8 << 30));
/// assert_eq!(scratch.scope, Scope::MicroStep);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PhaseSpec {
    /// A unique name, used in reports and metrics.
    pub name: String,
    /// How long its allocations live.
    pub scope: Scope,
    /// How allocations are served.
    pub strategy: Strategy,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` of its pools. The driver's default, 0, gives memory
    /// back at every synchronization and costs milliseconds to take it again; steppool's default
    /// is `u64::MAX` and lets the trim policy decide.
    pub release_threshold: u64,
    /// What its pools give back at boundaries.
    pub trim: TrimPolicy,
    /// Most bytes its live allocations may hold, summed over devices and streams; a request past
    /// it fails with [`Error::BudgetExceeded`](crate::Error::BudgetExceeded).
    pub budget: Option<u64>,
    /// Plans saved from an earlier run ([`Runtime::saved_plans`](crate::Runtime::saved_plans), or
    /// `steppool plan` from a trace), for a [`Planned`](Strategy::Planned) phase: each of its
    /// pools starts with them, so a scope they select is served from its first allocation, with
    /// no recording scope. Checked by [`PhaseSpec::validate`]; the phase name they carry is not
    /// compared with the spec's.
    pub plans: Option<Arc<PhasePlans>>,
    /// Raw allocations still live when a step ends are kept for the next step, which frees them,
    /// instead of released: memory a training loop hands from one step to the next, such as the
    /// gradients of a loop that calls `zero_grad()` between its forward and backward passes
    /// (made in one step's backward pass, set to `None` in the next). The end of that next step
    /// releases what it still holds. A [`Planned`](Strategy::Planned) phase plans such memory at
    /// one place in every step, clear of what the next step makes before freeing it. For
    /// step-scoped phases of the [`Pool`](Strategy::Direct) and planned strategies; off by
    /// default.
    pub carry: bool,
}

impl PhaseSpec {
    /// A phase with the [`Pool`](Strategy::Direct) strategy, the release threshold raised, no
    /// budget, and a trim policy that suits its scope: [`TrimPolicy::Never`] for persistent
    /// phases, [`TrimPolicy::KeepRecentPeak`] over 8 boundaries for the others.
    pub fn new(name: impl Into<String>, scope: Scope) -> Self {
        let trim = match scope {
            Scope::Persistent => TrimPolicy::Never,
            Scope::Step | Scope::MicroStep => TrimPolicy::KeepRecentPeak { steps: 8 },
        };
        Self {
            name: name.into(),
            scope,
            strategy: Strategy::Direct,
            release_threshold: u64::MAX,
            trim,
            budget: None,
            plans: None,
            carry: false,
        }
    }

    /// Keeping the raw allocations a step leaves live for the next step
    /// ([`PhaseSpec::carry`](PhaseSpec#structfield.carry)).
    ///
    /// ```
    /// use steppool::{PhaseSpec, Runtime, Scope, Strategy};
    /// # fn main() -> Result<(), steppool::Error> {
    /// # let runtime = Runtime::builder().simulated(steppool_sys::sim::SimConfig::with_capacity(1 << 30)).build()?;
    /// let stream = runtime.device(0)?.create_stream()?;
    /// let spec = PhaseSpec::new("grads", Scope::Step).strategy(Strategy::PLANNED).carry(true);
    /// let grads = runtime.declare_phase(spec)?;
    /// let raw = runtime.raw();
    /// raw.begin_step()?;
    /// // SAFETY: the memory is used by nothing, and freed once.
    /// let grad = unsafe { raw.alloc(grads, 4 << 20, &stream)? };
    /// let report = unsafe { raw.end_step()? };
    /// assert_eq!(report.pools[0].used, 4 << 20, "kept for the next step");
    /// raw.begin_step()?;
    /// unsafe { raw.free(grad)? };
    /// unsafe { raw.end_step()? };
    /// # Ok(()) }
    /// ```
    pub fn carry(mut self, carry: bool) -> Self {
        self.carry = carry;
        self
    }

    /// Starting with these saved plans (see [`PhaseSpec::plans`](PhaseSpec#structfield.plans)).
    pub fn plans(mut self, plans: PhasePlans) -> Self {
        self.plans = Some(Arc::new(plans));
        self
    }

    /// With this strategy.
    pub fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// With this release threshold.
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = bytes;
        self
    }

    /// With this trim policy.
    pub fn trim(mut self, trim: TrimPolicy) -> Self {
        self.trim = trim;
        self
    }

    /// With a budget of `bytes`.
    pub fn budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Checks what a runtime relies on: a name, arena slabs and chunks of 512 bytes to 64 TiB, and planned
    /// phases that are step- or micro-step-scoped, with 1 to 1024 plans selected by 1 to 64 sizes;
    /// saved plans only on a planned phase, no more than it keeps, each keyed by as many sizes as
    /// the phase's signature reads (or by a user key), and each valid and overlap-free
    /// ([`PhasePlans::validate`]); carrying only on step-scoped phases of the pool or planned
    /// strategy.
    pub fn validate(&self) -> Result<(), InvalidPhaseSpec> {
        let invalid = |reason: String| Err(InvalidPhaseSpec { phase: self.name.clone(), reason });
        if self.name.is_empty() {
            return invalid("a phase needs a name".to_owned());
        }
        if let Strategy::Arena { slab_bytes } = self.strategy
            && !(MIN_SLAB..=MAX_SLAB).contains(&slab_bytes)
        {
            return invalid(format!("arena slabs of {slab_bytes} bytes: use 512 bytes to 64 TiB"));
        }
        if let Strategy::Chunked { chunk_bytes } = self.strategy
            && !(MIN_SLAB..=MAX_SLAB).contains(&chunk_bytes)
        {
            return invalid(format!("chunks of {chunk_bytes} bytes: use 512 bytes to 64 TiB"));
        }
        if self.strategy == Strategy::Auto && self.scope == Scope::Persistent {
            return invalid(
                "the automatic strategy chooses from a recorded scope: make the phase step- or micro-step-scoped"
                    .to_owned(),
            );
        }
        if let Strategy::Planned { max_plans, signature_len } = self.strategy {
            if self.scope == Scope::Persistent {
                return invalid(
                    "the planned strategy serves scopes that repeat: make the phase step- or micro-step-scoped"
                        .to_owned(),
                );
            }
            if !(1..=MAX_PLANS).contains(&max_plans) {
                return invalid(format!("planned strategy keeping {max_plans} plans: use 1 to {MAX_PLANS}"));
            }
            if !(1..=MAX_SIGNATURE).contains(&signature_len) {
                return invalid(format!(
                    "planned strategy with a signature of {signature_len} sizes: use 1 to {MAX_SIGNATURE}"
                ));
            }
        }
        if self.carry {
            if self.scope != Scope::Step {
                return invalid(format!(
                    "a {} phase cannot carry allocations into the next step: make it step-scoped",
                    self.scope
                ));
            }
            if !matches!(self.strategy, Strategy::Direct | Strategy::Planned { .. }) {
                return invalid(format!(
                    "the {} strategy reclaims its memory at the step's end and cannot carry allocations into the next step: use the pool or planned strategy",
                    self.strategy.name()
                ));
            }
        }
        if let Some(saved) = &self.plans {
            let Strategy::Planned { max_plans, signature_len } = self.strategy else {
                return invalid(format!(
                    "saved plans are for the planned strategy, and the phase uses the {} strategy",
                    self.strategy.name()
                ));
            };
            if saved.plans.len() > max_plans as usize {
                return invalid(format!("{} saved plans for a phase that keeps {max_plans}", saved.plans.len()));
            }
            for (index, plan) in saved.plans.iter().enumerate() {
                let expected = (signature_len as usize).min(plan.blocks.len());
                if let PlanKey::Sizes(sizes) = &plan.key
                    && sizes.len() != expected
                {
                    return invalid(format!(
                        "saved plan {index} is keyed by {} sizes; this phase's signature reads {expected} of its {} allocations",
                        sizes.len(),
                        plan.blocks.len()
                    ));
                }
            }
            if let Err(error) = saved.validate() {
                return invalid(format!("saved plans: {error}"));
            }
        }
        Ok(())
    }
}

/// A phase spec the runtime cannot serve (it becomes
/// [`Error::InvalidPhaseSpec`](crate::Error::InvalidPhaseSpec) where the runtime is asked to use it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("phase `{phase}`: {reason}")]
pub struct InvalidPhaseSpec {
    /// The phase.
    pub phase: String,
    /// What is wrong.
    pub reason: String,
}

/// The smallest and largest arena slab.
const MIN_SLAB: u64 = 512;
const MAX_SLAB: u64 = 1 << 46;

/// The most plans a planned phase pool keeps, and the longest signature.
const MAX_PLANS: u32 = 1024;
const MAX_SIGNATURE: u32 = 64;

/// A phase of a [`Runtime`](crate::Runtime): one of the built-in constants or a phase returned by
/// [`Runtime::declare_phase`](crate::Runtime::declare_phase).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Phase(pub(crate) u16);

impl Phase {
    /// Model weights: persistent.
    pub const WEIGHTS: Phase = Phase(0);
    /// Optimizer state (moments, master weights): persistent.
    pub const OPTIMIZER_STATE: Phase = Phase(1);
    /// Activations kept for the backward pass: released at the step end.
    pub const ACTIVATIONS: Phase = Phase(2);
    /// Gradients, accumulated over micro-steps: released at the step end.
    pub const GRADIENTS: Phase = Phase(3);
    /// Short-lived scratch buffers: an arena reset at the step end.
    pub const WORKSPACE: Phase = Phase(4);

    /// The phases every runtime starts with.
    pub const BUILT_IN: [Phase; 5] =
        [Phase::WEIGHTS, Phase::OPTIMIZER_STATE, Phase::ACTIVATIONS, Phase::GRADIENTS, Phase::WORKSPACE];

    /// The phase's index in its runtime, from 0.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    pub(crate) fn built_in_specs() -> Vec<PhaseSpec> {
        vec![
            PhaseSpec::new("weights", Scope::Persistent),
            PhaseSpec::new("optimizer_state", Scope::Persistent),
            PhaseSpec::new("activations", Scope::Step),
            PhaseSpec::new("gradients", Scope::Step),
            PhaseSpec::new("workspace", Scope::Step).strategy(Strategy::ARENA),
        ]
    }
}

/// Alignment of every allocation a phase hands out.
pub(crate) const ALIGNMENT: u64 = 512;

/// The most phases one runtime can have, built-in ones included.
pub const MAX_PHASES: usize = 64;

/// A phase as the runtime holds it: its spec and the bytes it holds, for its budget.
#[derive(Debug)]
pub(crate) struct PhaseEntry {
    pub(crate) phase: Phase,
    pub(crate) spec: PhaseSpec,
    /// Live bytes over all its pools; maintained only when the spec has a budget.
    pub(crate) live: AtomicU64,
    /// Set once a pool of this phase exists; the spec is fixed from then on.
    pub(crate) in_use: AtomicBool,
    /// Planned strategy: the user's key that selects the plan of the next scope.
    pub(crate) plan_key: Mutex<Option<u64>>,
}

impl PhaseEntry {
    pub(crate) fn new(phase: Phase, spec: PhaseSpec) -> Arc<Self> {
        Arc::new(Self {
            phase,
            spec,
            live: AtomicU64::new(0),
            in_use: AtomicBool::new(false),
            plan_key: Mutex::new(None),
        })
    }
}
