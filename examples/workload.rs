//! A synthetic transformer training workload, as a stream of allocation events.
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

/// What an allocation is for; the phase steppool puts it in.
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
    /// Scratch space of one operation: within one micro-batch.
    Workspace,
}

/// One event of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Allocate `bytes` for `lifetime`; `id` names the allocation in later frees.
    Alloc {
        /// The allocation's id, unique in the run.
        id: u32,
        /// What it is for.
        lifetime: Lifetime,
        /// Its size.
        bytes: u64,
    },
    /// Free allocation `id`.
    Free {
        /// The allocation's id.
        id: u32,
    },
    /// A micro-batch begins.
    BeginMicroBatch,
    /// A micro-batch ends.
    EndMicroBatch,
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

/// The events of one step, and its micro-batches' sequence lengths.
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
}

/// Bytes per element: bf16 activations and gradients, fp32 weights and moments.
const BF16: u64 = 2;
const FP32: u64 = 4;

impl Workload {
    /// A workload for `config`.
    pub fn new(config: TransformerConfig) -> Self {
        let rng = config.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        Self { config, rng, next_id: 0, weights: Vec::new(), has_optimizer_state: false }
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }

    fn id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
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
                events.push(Event::Alloc { id, lifetime: Lifetime::Weight, bytes });
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
            events.push(Event::BeginMicroBatch);
            // Forward: five saved activations per layer (input, QKV, attention output, MLP hidden
            // before and after the activation function) and a workspace for attention.
            let mut saved: Vec<Vec<u32>> = Vec::new();
            for _ in 0..layers {
                let workspace = self.id();
                let attention_scratch = b * s * h * BF16 + b * (h / 128) * s * 128 * FP32;
                events.push(Event::Alloc { id: workspace, lifetime: Lifetime::Workspace, bytes: attention_scratch });
                let mut layer = Vec::new();
                for width in [h, 3 * h, h, 4 * h, 4 * h] {
                    let id = self.id();
                    events.push(Event::Alloc { id, lifetime: Lifetime::Activation, bytes: b * s * width * BF16 });
                    layer.push(id);
                }
                events.push(Event::Free { id: workspace });
                saved.push(layer);
            }
            // Backward, last layer first: a workspace for the input gradient, this layer's
            // gradients on the first micro-batch, then its activations go.
            for layer in (0..layers as usize).rev() {
                let workspace = self.id();
                events.push(Event::Alloc { id: workspace, lifetime: Lifetime::Workspace, bytes: 4 * b * s * h * BF16 });
                if micro == 0 {
                    for elements in self.layer_parameters() {
                        let id = self.id();
                        events.push(Event::Alloc { id, lifetime: Lifetime::Gradient, bytes: elements * BF16 });
                        gradients.push(id);
                    }
                }
                for id in saved[layer].drain(..).rev() {
                    events.push(Event::Free { id });
                }
                events.push(Event::Free { id: workspace });
            }
            events.push(Event::EndMicroBatch);
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
                        events.push(Event::Alloc { id, lifetime: Lifetime::OptimizerState, bytes });
                    }
                }
            }
        }
        let scratch = self.id();
        events.push(Event::Alloc { id: scratch, lifetime: Lifetime::Workspace, bytes: 4 * h * h * FP32 });
        events.push(Event::Free { id: scratch });
        for id in gradients {
            events.push(Event::Free { id });
        }
        StepPlan { sequences, events }
    }
}

/// The peak of live bytes over `events`, starting from `live` bytes already held.
pub fn peak_live(events: &[Event], live: u64) -> (u64, u64) {
    let mut sizes = std::collections::HashMap::new();
    let (mut current, mut peak) = (live, live);
    for event in events {
        match *event {
            Event::Alloc { id, bytes, .. } => {
                sizes.insert(id, bytes);
                current += bytes;
                peak = peak.max(current);
            }
            Event::Free { id } => current -= sizes.remove(&id).unwrap_or(0),
            Event::BeginMicroBatch | Event::EndMicroBatch => {}
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
    }
}
