//! A synthetic transformer training workload, as a stream of allocation events in steppool's
//! trace model ([`steppool_trace::Event`]): allocations and frees whose pointer is the
//! allocation's id, tagged with the phase of their [`Lifetime`], and micro-batch boundaries. Time
//! is a synthetic clock of one nanosecond per event.
//!
//! The same events drive every allocator being compared, so differences in reserved memory come
//! from the allocators alone. The shapes follow a decoder-only transformer trained in bf16 with
//! fp32 master weights and Adam, with gradient accumulation over micro-batches whose sequence
//! lengths vary, the pattern behind most "out of memory with gigabytes free" reports:
//!
//! - weights are allocated once, before the first step;
//! - each micro-batch's forward pass keeps five activations per layer for the backward pass and
//!   uses a short-lived workspace per layer;
//! - the first micro-batch's backward pass allocates the gradients, layer by layer, while it frees
//!   that layer's activations; later micro-batches accumulate into them;
//! - the first optimizer step allocates Adam's two moments while the gradients are still live,
//!   the long-lived-between-short-lived pattern that fragments a shared pool;
//! - the step ends by dropping the gradients (`zero_grad(set_to_none=True)`).

use std::collections::HashMap;

use steppool_trace::{Event, EventKind, Location, Scope, StepSource, Trace, TraceFormat, TracePhase};

/// What an allocation is for: the phase its events are tagged with ([`Event::phase`] is the
/// index in [`Lifetime::ALL`], and in [`phases`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lifetime {
    /// Model weights: for the whole run.
    Weight,
    /// Adam moments: from the first optimizer step on.
    OptimizerState,
    /// Gradients: from the first backward pass of a step to its end.
    Gradient,
    /// Activations saved for the backward pass: within one micro-batch.
    Activation,
    /// Scratch space of one operation: within one micro-batch, or the step's optimizer update.
    Workspace,
}

impl Lifetime {
    /// Every lifetime, in phase order.
    pub const ALL: [Lifetime; 5] =
        [Lifetime::Weight, Lifetime::OptimizerState, Lifetime::Gradient, Lifetime::Activation, Lifetime::Workspace];

    /// The index of its phase.
    pub fn phase(self) -> u16 {
        self as u16
    }

    /// The lifetime an event of the workload is tagged with.
    pub fn of(event: &Event) -> Option<Lifetime> {
        event.phase.and_then(|phase| Lifetime::ALL.get(usize::from(phase)).copied())
    }

    /// Its phase's name, as steppool's built-in phases spell them.
    pub fn name(self) -> &'static str {
        match self {
            Lifetime::Weight => "weights",
            Lifetime::OptimizerState => "optimizer_state",
            Lifetime::Gradient => "gradients",
            Lifetime::Activation => "activations",
            Lifetime::Workspace => "workspace",
        }
    }

    /// The longest scope its allocations fit.
    pub fn scope(self) -> Scope {
        match self {
            Lifetime::Weight | Lifetime::OptimizerState => Scope::Persistent,
            Lifetime::Gradient | Lifetime::Workspace => Scope::Step,
            Lifetime::Activation => Scope::MicroStep,
        }
    }
}

/// The phases the workload's events are tagged with, in [`Lifetime::ALL`] order.
pub fn phases() -> Vec<TracePhase> {
    Lifetime::ALL.iter().map(|l| TracePhase { name: l.name().to_owned(), scope: l.scope() }).collect()
}

/// The model and the batches.
#[derive(Clone, Debug)]
pub struct TransformerConfig {
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Sequences per micro-batch.
    pub batch: u64,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: u32,
    /// Shortest and longest sequence; each micro-batch draws a length in between.
    pub sequence: (u64, u64),
    /// Seed of the sequence lengths.
    pub seed: u64,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self { layers: 16, hidden: 1536, batch: 8, micro_batches: 4, sequence: (256, 2048), seed: 7 }
    }
}

/// The events of one step (micro-batch boundaries included, step boundaries not), and its
/// micro-batches' sequence lengths.
#[derive(Clone, Debug)]
pub struct StepPlan {
    /// Sequence length of each micro-batch.
    pub sequences: Vec<u64>,
    /// The events, in order.
    pub events: Vec<Event>,
}

/// Generates the workload's events step by step.
#[derive(Debug)]
pub struct Workload {
    config: TransformerConfig,
    rng: u64,
    next_id: u32,
    /// Weight ids with sizes, by layer.
    weights: Vec<Vec<(u32, u64)>>,
    has_optimizer_state: bool,
    /// Sizes of the live allocations, by id.
    live: HashMap<u32, u64>,
    /// Events made so far: the clock, and the line each would take in a written trace.
    events: u64,
    /// Steps made so far.
    steps: u64,
}

/// Bytes per element: bf16 activations and gradients, fp32 weights and moments.
const BF16: u64 = 2;
const FP32: u64 = 4;

impl Workload {
    /// A workload for `config`.
    pub fn new(config: TransformerConfig) -> Self {
        let rng = config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        Self {
            config,
            rng,
            next_id: 0,
            weights: Vec::new(),
            has_optimizer_state: false,
            live: HashMap::new(),
            events: 0,
            steps: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    /// The next event: one nanosecond after the last, on the line after it.
    fn event(&mut self, kind: EventKind) -> Event {
        let event = Event::new(self.events, kind, Location::Line(self.events + 2));
        self.events += 1;
        event
    }

    /// Allocates `bytes` for `lifetime` under `id`.
    fn alloc(&mut self, events: &mut Vec<Event>, id: u32, lifetime: Lifetime, bytes: u64) {
        let mut event = self.event(EventKind::Alloc);
        (event.ptr, event.bytes, event.phase) = (u64::from(id), bytes, Some(lifetime.phase()));
        self.live.insert(id, bytes);
        events.push(event);
    }

    /// Frees allocation `id`, with the size and phase of its allocation.
    fn free(&mut self, events: &mut Vec<Event>, id: u32, lifetime: Lifetime) {
        let mut event = self.event(EventKind::Free { released: false });
        let bytes = self.live.remove(&id).expect("the workload frees only what it allocated");
        (event.ptr, event.bytes, event.phase) = (u64::from(id), bytes, Some(lifetime.phase()));
        events.push(event);
    }

    fn random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Element counts of one layer's parameters: QKV, attention output, two MLP matrices, two norms.
    fn layer_parameters(&self) -> [u64; 6] {
        let h = self.config.hidden;
        [3 * h * h, h * h, 4 * h * h, 4 * h * h, h, h]
    }

    /// The events that load the model: every weight, layer by layer.
    pub fn setup(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        for _ in 0..self.config.layers {
            let mut layer = Vec::new();
            for elements in self.layer_parameters() {
                let (id, bytes) = (self.id(), elements * FP32);
                self.alloc(&mut events, id, Lifetime::Weight, bytes);
                layer.push((id, bytes));
            }
            self.weights.push(layer);
        }
        events
    }

    /// Total bytes of the weights.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.iter().flatten().map(|&(_, bytes)| bytes).sum()
    }

    /// The events of the next step.
    pub fn step(&mut self) -> StepPlan {
        let TransformerConfig { layers, hidden: h, batch: b, micro_batches, sequence: (shortest, longest), .. } =
            self.config.clone();
        let mut events = Vec::new();
        let mut sequences = Vec::new();
        let mut gradients: Vec<u32> = Vec::new();
        for micro in 0..micro_batches {
            let steps = (longest - shortest) / 64 + 1;
            let s = shortest + (self.random() % steps) * 64;
            sequences.push(s);
            let begin = self.event(EventKind::MicroBegin(self.steps, micro));
            events.push(begin);
            // Forward: five saved activations per layer (input, QKV, attention output, MLP hidden
            // before and after the activation function) and a workspace for attention.
            let mut saved: Vec<Vec<u32>> = Vec::new();
            for _ in 0..layers {
                let workspace = self.id();
                let attention_scratch = b * s * h * BF16 + b * (h / 128) * s * 128 * FP32;
                self.alloc(&mut events, workspace, Lifetime::Workspace, attention_scratch);
                let mut layer = Vec::new();
                for width in [h, 3 * h, h, 4 * h, 4 * h] {
                    let id = self.id();
                    self.alloc(&mut events, id, Lifetime::Activation, b * s * width * BF16);
                    layer.push(id);
                }
                self.free(&mut events, workspace, Lifetime::Workspace);
                saved.push(layer);
            }
            // Backward, last layer first: a workspace for the input gradient, this layer's
            // gradients on the first micro-batch, then its activations go.
            for layer in (0..layers as usize).rev() {
                let workspace = self.id();
                self.alloc(&mut events, workspace, Lifetime::Workspace, 4 * b * s * h * BF16);
                if micro == 0 {
                    for elements in self.layer_parameters() {
                        let id = self.id();
                        self.alloc(&mut events, id, Lifetime::Gradient, elements * BF16);
                        gradients.push(id);
                    }
                }
                for id in saved[layer].drain(..).rev() {
                    self.free(&mut events, id, Lifetime::Activation);
                }
                self.free(&mut events, workspace, Lifetime::Workspace);
            }
            let end = self.event(EventKind::MicroEnd(self.steps, micro));
            events.push(end);
        }
        // The optimizer step: Adam's moments appear on the first one, while gradients are live,
        // then a scratch buffer the size of the largest parameter.
        if !self.has_optimizer_state {
            self.has_optimizer_state = true;
            for layer in 0..self.weights.len() {
                for index in 0..self.weights[layer].len() {
                    let bytes = self.weights[layer][index].1;
                    for _ in 0..2 {
                        let id = self.id();
                        self.alloc(&mut events, id, Lifetime::OptimizerState, bytes);
                    }
                }
            }
        }
        let scratch = self.id();
        self.alloc(&mut events, scratch, Lifetime::Workspace, 4 * h * h * FP32);
        self.free(&mut events, scratch, Lifetime::Workspace);
        for id in gradients {
            self.free(&mut events, id, Lifetime::Gradient);
        }
        self.steps += 1;
        StepPlan { sequences, events }
    }

    /// The whole run as a trace: the model's setup, then `steps` steps, each between its step
    /// boundaries, on device 0, stream 0, thread `0`, with the workload's [`phases`].
    pub fn trace(mut self, steps: u64) -> Trace {
        let mut trace = Trace::new("synthetic transformer", TraceFormat::Steppool);
        trace.phases = phases();
        trace.threads.push("0".to_owned());
        trace.events = self.setup();
        for _ in 0..steps {
            let n = self.steps;
            let begin = self.event(EventKind::StepBegin(n));
            trace.events.push(begin);
            let plan = self.step();
            trace.events.extend(plan.events);
            let end = self.event(EventKind::StepEnd(n));
            trace.events.push(end);
        }
        trace.note_device(0);
        trace.steps = StepSource::Trace;
        trace
    }
}

/// The peak of live bytes over `events`, starting from `live` bytes already held, and the bytes
/// live after them.
pub fn peak_live(events: &[Event], live: u64) -> (u64, u64) {
    let (mut current, mut peak) = (live, live);
    for event in events {
        match event.kind {
            EventKind::Alloc => {
                current += event.bytes;
                peak = peak.max(current);
            }
            EventKind::Free { .. } => current -= event.bytes,
            _ => {}
        }
    }
    (peak, current)
}

/// `path` with a run's name before its extension, for examples that write one file per run:
/// `steps.jsonl` and `plain` give `steps-plain.jsonl`.
pub fn path_for(path: &str, run: &str) -> String {
    let path = std::path::Path::new(path);
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("telemetry");
    let name = match path.extension().and_then(|e| e.to_str()) {
        Some(ext) => format!("{stem}-{run}.{ext}"),
        None => format!("{stem}-{run}"),
    };
    path.with_file_name(name).to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_step_frees_what_it_allocates_except_the_optimizer_state() {
        let mut workload = Workload::new(TransformerConfig { layers: 2, hidden: 64, ..TransformerConfig::default() });
        let setup = workload.setup();
        let (_, after_setup) = peak_live(&setup, 0);
        assert_eq!(after_setup, workload.weight_bytes());
        let first = workload.step();
        let (_, after_first) = peak_live(&first.events, after_setup);
        assert_eq!(after_first, 3 * after_setup, "weights plus two Adam moments");
        let second = workload.step();
        let (peak, after_second) = peak_live(&second.events, after_first);
        assert_eq!(after_second, after_first, "later steps free everything they allocate");
        assert!(peak > after_first);
        assert_eq!(second.sequences.len(), 4);
        assert!(second.sequences.iter().all(|&s| (256..=2048).contains(&s) && s % 64 == 0));
        let micro = |kind: fn(&EventKind) -> bool| second.events.iter().filter(|e| kind(&e.kind)).count();
        assert_eq!(micro(|k| matches!(k, EventKind::MicroBegin(1, _))), 4);
        assert_eq!(micro(|k| matches!(k, EventKind::MicroEnd(1, _))), 4);
    }

    #[test]
    fn the_trace_tags_every_allocation_with_a_phase_whose_scope_fits() {
        let trace = Workload::new(TransformerConfig { layers: 2, hidden: 64, ..TransformerConfig::default() }).trace(3);
        assert_eq!(trace.step_count(), 3);
        assert!(trace.events.windows(2).all(|w| w[0].t_ns < w[1].t_ns));
        let analysis = steppool_trace::analysis::analyse(&trace).unwrap();
        assert!(analysis.warnings.is_empty(), "{:?}", analysis.warnings.lines());
        for allocation in &analysis.allocations {
            let lifetime = Lifetime::of(&trace.events[allocation.event]).unwrap();
            assert_eq!(allocation.scope, lifetime.scope(), "{lifetime:?}");
        }
    }
}
