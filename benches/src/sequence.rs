//! Allocation sequences: what the fragmentation and kernel-step benchmarks replay through every
//! allocator, exported as JSON so that the Python peer harness replays exactly the same ones.
//!
//! A sequence is a list of operations: allocate `bytes` under id `id` (ids are dense, from 0,
//! each used once), free id `id`, or end the current step. Each allocation carries the lifetime
//! steppool would give it: `persistent` (weights, optimizer state; never released by a step) or
//! `step` (freed within the step it was allocated in). Allocators without steps ignore it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use steppool_examples::{Event, Lifetime as WorkloadLifetime, TransformerConfig, Workload};

use crate::{BenchError, Result};

/// How long an allocation lives, as steppool sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifetime {
    /// Beyond the step it was allocated in.
    Persistent,
    /// Freed within the step it was allocated in.
    Step,
}

/// One operation of a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Allocate `bytes` as allocation `id`.
    Alloc {
        /// Dense id, from 0, used once.
        id: u32,
        /// Size in bytes.
        bytes: u64,
        /// How long it lives.
        lifetime: Lifetime,
    },
    /// Free allocation `id`.
    Free {
        /// The allocation's id.
        id: u32,
    },
    /// The current step ends; the next begins.
    Step,
}

/// A named allocation sequence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sequence {
    /// Its name, used as the workload in records.
    pub name: String,
    /// Where it comes from.
    pub description: String,
    /// The operations.
    pub ops: Vec<Op>,
}

impl Sequence {
    /// Number of allocations (the ids run from 0 to this).
    pub fn allocations(&self) -> usize {
        self.ops.iter().filter(|op| matches!(op, Op::Alloc { .. })).count()
    }

    /// Number of steps (step boundaries plus one).
    pub fn steps(&self) -> usize {
        self.ops.iter().filter(|op| matches!(op, Op::Step)).count() + 1
    }

    /// The highest sum of live bytes: the least any allocator must reserve.
    pub fn peak_live(&self) -> u64 {
        let mut sizes = vec![0u64; self.allocations()];
        let (mut live, mut peak) = (0u64, 0u64);
        for op in &self.ops {
            match *op {
                Op::Alloc { id, bytes, .. } => {
                    sizes[id as usize] = bytes;
                    live += bytes;
                    peak = peak.max(live);
                }
                Op::Free { id } => live -= sizes[id as usize],
                Op::Step => {}
            }
        }
        peak
    }

    /// Checks what replays rely on: ids dense from 0 in allocation order, each freed at most once
    /// and only after its allocation, and step-lifetime allocations freed in their step.
    pub fn validate(&self) -> Result<()> {
        let error = |index: usize, reason: String| BenchError::Sequence { sequence: self.name.clone(), index, reason };
        // Per id: the step it was allocated in, whether it is live, its lifetime.
        let mut state: Vec<(usize, bool, Lifetime)> = Vec::new();
        let mut step = 0usize;
        for (index, op) in self.ops.iter().enumerate() {
            match *op {
                Op::Alloc { id, lifetime, .. } => {
                    if id as usize != state.len() {
                        return Err(error(index, format!("allocation id {id}, expected {}", state.len())));
                    }
                    state.push((step, true, lifetime));
                }
                Op::Free { id } => match state.get_mut(id as usize) {
                    Some((_, live @ true, _)) => *live = false,
                    Some(_) => return Err(error(index, format!("allocation {id} is freed twice"))),
                    None => return Err(error(index, format!("allocation {id} is freed before it is made"))),
                },
                Op::Step => {
                    if let Some(id) = state.iter().position(|&(s, live, l)| live && l == Lifetime::Step && s == step) {
                        return Err(error(index, format!("step-lifetime allocation {id} outlives its step")));
                    }
                    step += 1;
                }
            }
        }
        Ok(())
    }

    /// Writes the sequence as JSON to `dir/<name>.json`.
    pub fn export(&self, dir: &Path) -> Result<()> {
        let path = dir.join(format!("{}.json", self.name));
        let text = serde_json::to_string(self).expect("sequences serialize");
        std::fs::write(&path, text).map_err(|source| BenchError::Io { path: path.display().to_string(), source })
    }

    /// Reads a sequence written by [`Sequence::export`].
    pub fn import(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| BenchError::Io { path: path.display().to_string(), source })?;
        serde_json::from_str(&text).map_err(|source| BenchError::Json { path: path.display().to_string(), source })
    }
}

/// The variable-length transformer of `steppool-examples` (the training loop's workload) for
/// `steps` steps: weights first, Adam's moments on the first step, activations, workspaces and
/// gradients within each step, sequence lengths drawn per micro-batch.
pub fn transformer(name: &str, config: TransformerConfig, steps: usize) -> Sequence {
    let description = format!(
        "synthetic transformer: {} layers, hidden {}, batch {}, {} micro-batches, sequence {}..={}, seed {}, {} steps",
        config.layers,
        config.hidden,
        config.batch,
        config.micro_batches,
        config.sequence.0,
        config.sequence.1,
        config.seed,
        steps
    );
    let mut workload = Workload::new(config);
    let mut ids = std::collections::HashMap::new();
    let mut ops = Vec::new();
    convert(&workload.setup(), &mut ids, &mut ops);
    for step in 0..steps {
        if step > 0 {
            ops.push(Op::Step);
        }
        convert(&workload.step().events, &mut ids, &mut ops);
    }
    Sequence { name: name.to_owned(), description, ops }
}

/// Appends workload events as operations, giving allocations dense ids; micro-batch markers are
/// dropped (every step-lifetime allocation is freed within its step either way).
fn convert(events: &[Event], ids: &mut std::collections::HashMap<u32, u32>, ops: &mut Vec<Op>) {
    for event in events {
        match *event {
            Event::Alloc { id, lifetime, bytes } => {
                let dense = ids.len() as u32;
                ids.insert(id, dense);
                let lifetime = match lifetime {
                    WorkloadLifetime::Weight | WorkloadLifetime::OptimizerState => Lifetime::Persistent,
                    WorkloadLifetime::Gradient | WorkloadLifetime::Activation | WorkloadLifetime::Workspace => {
                        Lifetime::Step
                    }
                };
                ops.push(Op::Alloc { id: dense, bytes, lifetime });
            }
            Event::Free { id } => ops.push(Op::Free { id: ids[&id] }),
            Event::BeginMicroBatch | Event::EndMicroBatch => {}
        }
    }
}

/// The fragmentation benchmark's synthetic workload: the training loop's transformer (16 layers,
/// hidden 1536, 8 × 4 micro-batches of 256 to 2048 tokens) for 12 steps; 2 layers, hidden 256 and
/// 3 steps in smoke mode.
pub fn varlen_transformer(smoke: bool) -> Sequence {
    if smoke {
        let config = TransformerConfig { layers: 2, hidden: 256, ..TransformerConfig::default() };
        transformer("transformer_varlen", config, 3)
    } else {
        transformer("transformer_varlen", TransformerConfig::default(), 12)
    }
}

/// The kernel-step benchmark's workload: the same transformer with a fixed sequence length, so
/// every step has the same shape: 8 layers, hidden 4096, 4 × 2 micro-batches of 1024 tokens
/// (about 14 GB written per step and 26 GB live at the peak, 19 GB of it fp32 weights and Adam
/// moments); 2 layers and hidden 512 in smoke mode. Its first step allocates the optimizer state;
/// later steps are identical.
pub fn fixed_transformer(smoke: bool) -> TransformerConfig {
    let base = TransformerConfig { micro_batches: 2, batch: 4, sequence: (1024, 1024), ..TransformerConfig::default() };
    if smoke {
        TransformerConfig { layers: 2, hidden: 512, ..base }
    } else {
        TransformerConfig { layers: 8, hidden: 4096, ..base }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transformer_is_valid_and_step_shaped() {
        let sequence = varlen_transformer(true);
        sequence.validate().unwrap();
        assert_eq!(sequence.steps(), 3);
        assert!(sequence.peak_live() > 0);
        let persistent =
            sequence.ops.iter().filter(|op| matches!(op, Op::Alloc { lifetime: Lifetime::Persistent, .. })).count();
        // 6 weights per layer, then two Adam moments for each.
        assert_eq!(persistent, 2 * 6 * 3);
    }

    #[test]
    fn validation_names_the_bad_operation() {
        let mut sequence = Sequence {
            name: "bad".into(),
            description: String::new(),
            ops: vec![Op::Alloc { id: 0, bytes: 1, lifetime: Lifetime::Step }, Op::Step],
        };
        let error = sequence.validate().unwrap_err().to_string();
        assert!(error.contains("operation 1") && error.contains("outlives its step"), "{error}");
        sequence.ops = vec![Op::Free { id: 0 }];
        assert!(sequence.validate().unwrap_err().to_string().contains("before it is made"));
        sequence.ops = vec![Op::Alloc { id: 1, bytes: 1, lifetime: Lifetime::Step }];
        assert!(sequence.validate().unwrap_err().to_string().contains("expected 0"));
    }

    #[test]
    fn sequences_round_trip_through_json() {
        let sequence = varlen_transformer(true);
        let dir = std::env::temp_dir().join(format!("steppool-seq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        sequence.export(&dir).unwrap();
        let back = Sequence::import(&dir.join("transformer_varlen.json")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(back, sequence);
        let text = serde_json::to_string(&sequence.ops[0]).unwrap();
        assert_eq!(text, r#"{"op":"alloc","id":0,"bytes":786432,"lifetime":"persistent"}"#);
    }
}
