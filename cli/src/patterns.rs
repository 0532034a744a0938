//! Generated traces of the workload patterns steppool is judged on, at any size: static BERT,
//! variable-length GPT-2, Llama-style with gradient accumulation, ResNet with variable batch,
//! mixture-of-experts with variable routing, Llama-style with activation checkpointing under bf16
//! autocast, GPT-2 KV-cache generation, training interleaved with evaluation, a sequence-length
//! curriculum with accumulation, GPT-2 batched to a token budget, and generation then training in
//! each step (on-policy fine-tuning).
//!
//! Each trace follows what PyTorch allocates for the real model's shapes (BERT-base, GPT-2 small
//! and medium, TinyLlama's layers, ResNet-50, OLMoE's experts): weights before the first step,
//! Adam's moments at the first optimizer step, activations saved in the forward pass and freed in
//! reverse by the backward pass, gradients from the backward pass to the optimizer step. At scale
//! 1 a trace peaks at a few GiB live; [`PatternOptions::scale`] multiplies every size, so tests
//! replay the same sequence at MiB. Traces carry their step boundaries, and micro-steps where the
//! pattern has them (accumulation; each decoded token of a generation). Deterministic from
//! [`PatternOptions::seed`].

use steppool_trace::{Event, EventKind, Location, Trace, TraceDevice, TraceFormat};

/// Micro-steps of a step in the accumulation patterns.
pub const ACCUMULATION: u32 = 4;

/// Every third step of [`Pattern::TrainEval`] is an evaluation pass.
pub const EVAL_EVERY: u32 = 3;

/// A workload pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// BERT-base training, batch 8 × 512 tokens every step.
    BertStatic,
    /// GPT-2 small training, batch 4, 128 to 1024 tokens drawn per step.
    Gpt2Varlen,
    /// Llama-style (TinyLlama's layers) training, [`ACCUMULATION`] micro-batches a step.
    LlamaAccum,
    /// ResNet-50 training, batch 8 to 32 drawn per step.
    ResnetVarbatch,
    /// Mixture-of-experts training: each expert's token count drawn per step and layer.
    MoeRouting,
    /// Llama-style training with each layer checkpointed and bf16 autocast.
    LlamaCheckpointBf16,
    /// GPT-2 medium generation with a KV cache that grows by concatenation: a request a step, a
    /// micro-step per token.
    Gpt2KvGenerate,
    /// GPT-2 small training with an evaluation pass (no gradients, larger batch) every
    /// [`EVAL_EVERY`]th step.
    TrainEval,
    /// GPT-2 small training whose sequence length grows from 128 to 1024 tokens over the run,
    /// [`ACCUMULATION`] micro-batches a step.
    CurriculumAccum,
    /// GPT-2 small training on batches filled to [`TOKEN_BUDGET`] tokens: 128 to 1024 tokens drawn
    /// per step, and as many sequences as fit, so batch and length both change.
    Gpt2TokenBudget,
    /// GPT-2 small on-policy fine-tuning: each step generates from a drawn prompt with a KV cache,
    /// without gradients, then trains on the sequences it generated.
    RlGenerateTrain,
}

/// Tokens a step of [`Pattern::Gpt2TokenBudget`]: its batch is this over the step's length.
pub const TOKEN_BUDGET: u64 = 4096;

impl Pattern {
    /// Every pattern.
    pub const ALL: [Pattern; 11] = [
        Pattern::BertStatic,
        Pattern::Gpt2Varlen,
        Pattern::LlamaAccum,
        Pattern::ResnetVarbatch,
        Pattern::MoeRouting,
        Pattern::LlamaCheckpointBf16,
        Pattern::Gpt2KvGenerate,
        Pattern::TrainEval,
        Pattern::CurriculumAccum,
        Pattern::Gpt2TokenBudget,
        Pattern::RlGenerateTrain,
    ];

    /// Its name on the command line (the recorded trace of the same pattern has it too).
    pub fn name(self) -> &'static str {
        match self {
            Pattern::BertStatic => "bert_static",
            Pattern::Gpt2Varlen => "gpt2_varlen",
            Pattern::LlamaAccum => "llama_accum",
            Pattern::ResnetVarbatch => "resnet_varbatch",
            Pattern::MoeRouting => "moe_routing",
            Pattern::LlamaCheckpointBf16 => "llama_ckpt_bf16",
            Pattern::Gpt2KvGenerate => "gpt2_kv_generate",
            Pattern::TrainEval => "train_eval",
            Pattern::CurriculumAccum => "curriculum_accum",
            Pattern::Gpt2TokenBudget => "gpt2_token_budget",
            Pattern::RlGenerateTrain => "rl_generate_train",
        }
    }

    /// The pattern named `name`.
    pub fn from_name(name: &str) -> Result<Self, PatternError> {
        Self::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| PatternError::UnknownPattern {
            name: name.to_owned(),
            known: Self::ALL.map(Pattern::name).join(", "),
        })
    }
}

/// Why a trace cannot be generated.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum PatternError {
    /// No pattern has this name.
    #[error("no pattern `{name}`; the patterns are {known}")]
    UnknownPattern {
        /// The name asked for.
        name: String,
        /// The names there are.
        known: String,
    },
    /// The scale is not a positive number.
    #[error("scale {scale} is not a positive number")]
    BadScale {
        /// The scale asked for.
        scale: f64,
    },
    /// No steps asked for.
    #[error("a trace needs at least one step")]
    NoSteps,
}

/// How large and how long a generated trace is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PatternOptions {
    /// Steps (requests for [`Pattern::Gpt2KvGenerate`]).
    pub steps: u32,
    /// Seed of every draw (sequence lengths, batches, routing).
    pub seed: u64,
    /// Every size is multiplied by this (rounded up to 16 bytes): 1 for the real shapes, a few GiB
    /// live; 1/1024 for MiB.
    pub scale: f64,
    /// Whether to write micro-step boundaries (otherwise only steps, as an RMM log with a step
    /// sidecar has them; the allocations are the same).
    pub micro_steps: bool,
}

impl Default for PatternOptions {
    fn default() -> Self {
        Self { steps: 8, seed: 7, scale: 1.0, micro_steps: true }
    }
}

/// Generates the trace of `pattern`: a steppool trace (in memory) with its step boundaries and,
/// for the patterns that have them, micro-step boundaries.
pub fn generate(pattern: Pattern, options: &PatternOptions) -> Result<Trace, PatternError> {
    if !(options.scale.is_finite() && options.scale > 0.0) {
        return Err(PatternError::BadScale { scale: options.scale });
    }
    if options.steps == 0 {
        return Err(PatternError::NoSteps);
    }
    let mut g = Gen::new(pattern, options);
    match pattern {
        Pattern::BertStatic => bert_static(&mut g, options.steps),
        Pattern::Gpt2Varlen => gpt2_varlen(&mut g, options.steps),
        Pattern::LlamaAccum => llama_accum(&mut g, options.steps),
        Pattern::ResnetVarbatch => resnet_varbatch(&mut g, options.steps),
        Pattern::MoeRouting => moe_routing(&mut g, options.steps),
        Pattern::LlamaCheckpointBf16 => llama_checkpoint_bf16(&mut g, options.steps),
        Pattern::Gpt2KvGenerate => gpt2_kv_generate(&mut g, options.steps),
        Pattern::TrainEval => train_eval(&mut g, options.steps),
        Pattern::CurriculumAccum => curriculum_accum(&mut g, options.steps),
        Pattern::Gpt2TokenBudget => gpt2_token_budget(&mut g, options.steps),
        Pattern::RlGenerateTrain => rl_generate_train(&mut g, options.steps),
    }
    Ok(g.trace)
}

/// The sequence length of step `step` of [`Pattern::CurriculumAccum`]: 128 tokens at the first
/// step, 1024 at the last, in multiples of 64, never shorter than the step before.
pub fn curriculum_length(step: u32, steps: u32) -> u64 {
    let (first, last) = (128u64, 1024u64);
    let span = u64::from(steps.saturating_sub(1)).max(1);
    (first + (last - first) * u64::from(step) / span) / 64 * 64
}

/// Whether step `step` of [`Pattern::TrainEval`] is an evaluation pass.
pub fn is_eval_step(step: u32) -> bool {
    step % EVAL_EVERY == EVAL_EVERY - 1
}

// ---------------------------------------------------------------------------------------------
// The trace builder.

/// One allocation: where and how large.
#[derive(Clone, Copy, Debug)]
struct Tensor {
    ptr: u64,
    bytes: u64,
}

struct Gen {
    trace: Trace,
    t_ns: u64,
    next_ptr: u64,
    rng: u64,
    scale: f64,
    micro_steps: bool,
}

impl Gen {
    fn new(pattern: Pattern, options: &PatternOptions) -> Self {
        let mut trace = Trace::new(format!("{}.jsonl", pattern.name()), TraceFormat::Steppool);
        trace.driver =
            Some(format!("steppool synth {} (scale {}, seed {})", pattern.name(), options.scale, options.seed));
        trace.threads.push("0".to_owned());
        trace.devices.push(TraceDevice { ordinal: 0, total_bytes: None });
        Self {
            trace,
            t_ns: 0,
            next_ptr: 0x7f00_0000_0000,
            rng: options.seed ^ 0x9e37_79b9_7f4a_7c15,
            scale: options.scale,
            micro_steps: options.micro_steps,
        }
    }

    fn push(&mut self, kind: EventKind, ptr: u64, bytes: u64) {
        self.t_ns += 1_000;
        let mut event = Event::new(self.t_ns, kind, Location::Line(self.trace.events.len() as u64 + 2));
        event.ptr = ptr;
        event.bytes = bytes;
        self.trace.events.push(event);
    }

    /// Allocates `real` bytes (the real model's size) times the scale. Addresses never repeat.
    fn alloc(&mut self, real: u64) -> Tensor {
        let bytes = ((real as f64 * self.scale).ceil() as u64).next_multiple_of(16).max(16);
        self.alloc_exact(bytes)
    }

    /// Allocates as many bytes as `tensor` has (its gradient).
    fn alloc_like(&mut self, tensor: Tensor) -> Tensor {
        self.alloc_exact(tensor.bytes)
    }

    fn alloc_exact(&mut self, bytes: u64) -> Tensor {
        let ptr = self.next_ptr;
        self.next_ptr += bytes.next_multiple_of(512);
        self.push(EventKind::Alloc, ptr, bytes);
        Tensor { ptr, bytes }
    }

    fn free(&mut self, tensor: Tensor) {
        self.push(EventKind::Free { released: false }, tensor.ptr, tensor.bytes);
    }

    fn free_all(&mut self, tensors: impl IntoIterator<Item = Tensor>) {
        for tensor in tensors {
            self.free(tensor);
        }
    }

    /// An allocation used once and freed at once (a temporary).
    fn scratch(&mut self, real: u64) {
        let tensor = self.alloc(real);
        self.free(tensor);
    }

    /// A temporary as large as `tensor`.
    fn scratch_like(&mut self, tensor: Tensor) {
        let scratch = self.alloc_like(tensor);
        self.free(scratch);
    }

    /// Frees `tensor` in the backward pass: its gradient is allocated first and freed after.
    fn backward_through(&mut self, tensor: Tensor) {
        let grad = self.alloc_like(tensor);
        self.free(tensor);
        self.free(grad);
    }

    fn begin_step(&mut self, step: u32) {
        self.push(EventKind::StepBegin(u64::from(step)), 0, 0);
    }

    fn end_step(&mut self, step: u32) {
        self.push(EventKind::StepEnd(u64::from(step)), 0, 0);
    }

    fn begin_micro(&mut self, step: u32, micro: u32) {
        if self.micro_steps {
            self.push(EventKind::MicroBegin(u64::from(step), micro), 0, 0);
        }
    }

    fn end_micro(&mut self, step: u32, micro: u32) {
        if self.micro_steps {
            self.push(EventKind::MicroEnd(u64::from(step), micro), 0, 0);
        }
    }

    /// A number in `lo..=hi` (splitmix64).
    fn uniform(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        lo + z % (hi - lo + 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Parameters, gradients and the optimizer.

const FP32: u64 = 4;
const BF16: u64 = 2;

/// A model's parameters (fp32 master weights), their gradients and the optimizer's state.
struct Params {
    weights: Vec<Tensor>,
    grads: Vec<Option<Tensor>>,
    state: Vec<Tensor>,
    /// Buffers of optimizer state per parameter: 2 for Adam, 1 for SGD with momentum.
    state_per_param: usize,
}

impl Params {
    /// Allocates the weights of parameters of `elements` each, for Adam.
    fn load(g: &mut Gen, elements: &[u64]) -> Self {
        let weights: Vec<Tensor> = elements.iter().map(|&n| g.alloc(n * FP32)).collect();
        Self { grads: vec![None; weights.len()], weights, state: Vec::new(), state_per_param: 2 }
    }

    /// The backward pass reaches parameters `indices`: a gradient is allocated for each, or, when
    /// one is already there (accumulation), a temporary is added into it.
    fn backward(&mut self, g: &mut Gen, indices: impl IntoIterator<Item = usize>) {
        for i in indices {
            match self.grads[i] {
                Some(_) => g.scratch_like(self.weights[i]),
                None => self.grads[i] = Some(g.alloc_like(self.weights[i])),
            }
        }
    }

    /// The optimizer's step: its state at the first step (it lives to the end), a temporary per
    /// parameter with a gradient, then the gradients are freed (`zero_grad(set_to_none=True)`).
    fn optimizer_step(&mut self, g: &mut Gen) {
        if self.state.is_empty() {
            for i in 0..self.weights.len() {
                for _ in 0..self.state_per_param {
                    let buffer = g.alloc_like(self.weights[i]);
                    self.state.push(buffer);
                }
            }
        }
        for i in 0..self.weights.len() {
            if self.grads[i].is_some() {
                g.scratch_like(self.weights[i]);
            }
        }
        let grads: Vec<Tensor> = self.grads.iter_mut().filter_map(Option::take).collect();
        g.free_all(grads);
    }
}

// ---------------------------------------------------------------------------------------------
// Transformers.

/// A transformer's shapes.
#[derive(Clone, Copy)]
struct Transformer {
    layers: usize,
    hidden: u64,
    ffn: u64,
    heads: u64,
    kv_heads: u64,
    vocab: u64,
    /// SwiGLU (gate and up projections) rather than one up projection.
    gated: bool,
    /// Fused attention (saves the log-sum-exp) rather than materialized scores.
    fused_attention: bool,
}

/// BERT-base.
const BERT_BASE: Transformer = Transformer {
    layers: 12,
    hidden: 768,
    ffn: 3072,
    heads: 12,
    kv_heads: 12,
    vocab: 30522,
    gated: false,
    fused_attention: false,
};

/// GPT-2 small (124M).
const GPT2_SMALL: Transformer = Transformer {
    layers: 12,
    hidden: 768,
    ffn: 3072,
    heads: 12,
    kv_heads: 12,
    vocab: 50257,
    gated: false,
    fused_attention: false,
};

/// GPT-2 medium (355M).
const GPT2_MEDIUM: Transformer =
    Transformer { layers: 24, hidden: 1024, ffn: 4096, heads: 16, kv_heads: 16, ..GPT2_SMALL };

/// Six layers of TinyLlama-1.1B (hidden 2048, SwiGLU 5632, 32 heads, 4 KV heads, vocab 32000).
const LLAMA_6L: Transformer = Transformer {
    layers: 6,
    hidden: 2048,
    ffn: 5632,
    heads: 32,
    kv_heads: 4,
    vocab: 32000,
    gated: true,
    fused_attention: true,
};

/// How a layer's forward pass keeps what it makes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Saves the activations backward needs, the input included.
    Train,
    /// No gradients: every intermediate is freed once used, the input too.
    NoGrad,
    /// Checkpointed: intermediates freed as in `NoGrad`, but the input kept for the recomputation.
    Checkpoint,
}

impl Transformer {
    fn kv_dim(&self) -> u64 {
        self.kv_heads * (self.hidden / self.heads)
    }

    /// Elements of one layer's parameters: norm, q, k, v, o, norm, then the MLP.
    fn layer_params(&self) -> Vec<u64> {
        let (h, f, kv) = (self.hidden, self.ffn, self.kv_dim());
        let mut p = vec![h, h * h, h * kv, h * kv, h * h, h, h * f];
        if self.gated {
            p.push(h * f);
        }
        p.push(f * h);
        p
    }

    /// Elements of every parameter: the (tied) embedding, the layers, the final norm.
    fn params(&self) -> Vec<u64> {
        let mut p = vec![self.vocab * self.hidden];
        for _ in 0..self.layers {
            p.extend(self.layer_params());
        }
        p.push(self.hidden);
        p
    }

    /// The indices of layer `l`'s parameters in [`Self::params`].
    fn layer_range(&self, l: usize) -> std::ops::Range<usize> {
        let n = self.layer_params().len();
        1 + l * n..1 + (l + 1) * n
    }

    /// One layer's forward pass over `batch × seq` tokens with `a`-byte activations, attending to
    /// `context` positions. Returns what it saved (empty but for `Checkpoint`'s input) and its
    /// output.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        g: &mut Gen,
        mode: Mode,
        batch: u64,
        seq: u64,
        context: u64,
        a: u64,
        x: Tensor,
    ) -> (Vec<Tensor>, Tensor) {
        let tokens = batch * seq;
        let hid = tokens * self.hidden * a;
        let mut saved = vec![x];
        let n1 = g.alloc(hid);
        let q = g.alloc(hid);
        let k = g.alloc(tokens * self.kv_dim() * a);
        let v = g.alloc(tokens * self.kv_dim() * a);
        let attention = if self.fused_attention {
            g.alloc(batch * self.heads * seq * FP32)
        } else {
            let scores = g.alloc(batch * self.heads * seq * context * a);
            let probs = g.alloc(batch * self.heads * seq * context * a);
            g.free(scores);
            probs
        };
        let ctx = g.alloc(hid);
        saved.extend([n1, q, k, v, attention, ctx]);
        let o = g.alloc(hid);
        if mode != Mode::Train {
            let keep = usize::from(mode == Mode::Checkpoint);
            g.free_all(saved.drain(keep..));
        }
        let x1 = g.alloc(hid);
        g.free(o);
        let n2 = g.alloc(hid);
        let up = g.alloc(tokens * self.ffn * a);
        saved.extend([x1, n2, up]);
        if self.gated {
            saved.push(g.alloc(tokens * self.ffn * a));
        }
        saved.push(g.alloc(tokens * self.ffn * a));
        let down = g.alloc(hid);
        let out = g.alloc(hid);
        g.free(down);
        if mode != Mode::Train {
            let keep = usize::from(mode == Mode::Checkpoint);
            g.free_all(saved.drain(keep..));
        }
        (saved, out)
    }

    /// One layer's backward pass: a gradient temporary per saved activation as it is freed, the
    /// layer's weight gradients, and the gradient of its input in place of `dy`'s.
    fn layer_backward(&self, g: &mut Gen, params: &mut Params, l: usize, saved: Vec<Tensor>, dy: Tensor) -> Tensor {
        for tensor in saved.into_iter().rev() {
            g.backward_through(tensor);
        }
        params.backward(g, self.layer_range(l));
        let dx = g.alloc_like(dy);
        g.free(dy);
        dx
    }

    /// The language-model head's forward pass from `x`: final norm, fp32 logits, the loss. Returns
    /// what backward needs (norm output, logits).
    fn head_forward(&self, g: &mut Gen, tokens: u64, a: u64) -> (Tensor, Tensor) {
        let norm = g.alloc(tokens * self.hidden * a);
        let logits = g.alloc(tokens * self.vocab * FP32);
        g.scratch(tokens * self.vocab * FP32); // log-softmax
        g.scratch(FP32); // the loss
        (norm, logits)
    }

    /// The head's backward pass: the logits' gradient, the gradient of the last layer's output.
    fn head_backward(&self, g: &mut Gen, params: &mut Params, tokens: u64, a: u64, head: (Tensor, Tensor)) -> Tensor {
        let (norm, logits) = head;
        let dlogits = g.alloc(tokens * self.vocab * FP32);
        g.free(logits);
        let dy = g.alloc(tokens * self.hidden * a);
        g.free(dlogits);
        g.free(norm);
        let last = params.weights.len() - 1;
        params.backward(g, [0, last]);
        dy
    }

    /// A training forward and backward pass over `batch × seq` tokens.
    fn train_pass(&self, g: &mut Gen, params: &mut Params, batch: u64, seq: u64, a: u64) {
        let tokens = batch * seq;
        let mut x = g.alloc(tokens * self.hidden * a);
        let mut saved = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            let (s, out) = self.layer_forward(g, Mode::Train, batch, seq, seq, a, x);
            saved.push(s);
            x = out;
        }
        let head = self.head_forward(g, tokens, a);
        let mut dy = self.head_backward(g, params, tokens, a, head);
        g.free(x);
        for (l, s) in saved.into_iter().enumerate().rev() {
            dy = self.layer_backward(g, params, l, s, dy);
        }
        params.backward(g, [0]);
        g.free(dy);
    }

    /// A forward pass without gradients over `batch × seq` new tokens attending to `context`
    /// positions; returns the logits of the last position.
    fn no_grad_pass(&self, g: &mut Gen, batch: u64, seq: u64, context: u64, a: u64) -> Tensor {
        let tokens = batch * seq;
        let mut x = g.alloc(tokens * self.hidden * a);
        for _ in 0..self.layers {
            x = self.layer_forward(g, Mode::NoGrad, batch, seq, context, a, x).1;
        }
        let norm = g.alloc(tokens * self.hidden * a);
        g.free(x);
        let logits = g.alloc(tokens * self.vocab * a);
        g.free(norm);
        logits
    }

    /// Generates with a KV cache that grows by concatenation: the prompt fills the caches and
    /// gives the first token, then each of `new_tokens` more attends to all before it. With
    /// `ids`, the token ids so far (8 bytes each) are concatenated with each new token, and the
    /// grown sequences returned.
    fn generate(&self, g: &mut Gen, generation: Generation, mut ids: Option<Tensor>) -> Option<Tensor> {
        let Generation { batch, prompt, new_tokens, a, micro_steps_of } = generation;
        let kv_row = batch * self.kv_dim() * a;
        let mut caches: Vec<(Tensor, Tensor)> = Vec::with_capacity(self.layers);
        let append = |g: &mut Gen, ids: &mut Option<Tensor>, length: u64| {
            if let Some(old) = *ids {
                *ids = Some(g.alloc(batch * length * 8));
                g.free(old);
            }
        };
        if let Some(step) = micro_steps_of {
            g.begin_micro(step, 0);
        }
        let mut x = g.alloc(batch * prompt * self.hidden * a);
        for _ in 0..self.layers {
            let k = g.alloc(prompt * kv_row);
            let v = g.alloc(prompt * kv_row);
            caches.push((k, v));
            x = self.layer_forward(g, Mode::NoGrad, batch, prompt, prompt, a, x).1;
        }
        let logits = g.alloc(batch * prompt * self.vocab * a);
        g.free(x);
        let mut next = g.alloc(batch * 8);
        g.free(logits);
        append(g, &mut ids, prompt + 1);
        if let Some(step) = micro_steps_of {
            g.end_micro(step, 0);
        }
        // A micro-step per further token, where the generation has them.
        for token in 0..new_tokens {
            let (micro, context) = (token as u32 + 1, prompt + token + 1);
            if let Some(step) = micro_steps_of {
                g.begin_micro(step, micro);
            }
            let mut x = g.alloc(batch * self.hidden * a);
            g.free(next);
            for cache in caches.iter_mut() {
                let k = g.alloc(context * kv_row);
                g.free(cache.0);
                let v = g.alloc(context * kv_row);
                g.free(cache.1);
                *cache = (k, v);
                x = self.layer_forward(g, Mode::NoGrad, batch, 1, context, a, x).1;
            }
            let logits = g.alloc(batch * self.vocab * a);
            g.free(x);
            next = g.alloc(batch * 8);
            g.free(logits);
            append(g, &mut ids, context + 1);
            if let Some(step) = micro_steps_of {
                g.end_micro(step, micro);
            }
        }
        g.free(next);
        g.free_all(caches.into_iter().flat_map(|(k, v)| [k, v]));
        ids
    }
}

/// What [`Transformer::generate`] generates: `new_tokens` + 1 tokens after a `prompt`-token prompt
/// for `batch` sequences, with activations and caches of `a` bytes an element; a micro-step per
/// token within step `micro_steps_of`, where it names one.
#[derive(Clone, Copy)]
struct Generation {
    batch: u64,
    prompt: u64,
    new_tokens: u64,
    a: u64,
    micro_steps_of: Option<u32>,
}

// ---------------------------------------------------------------------------------------------
// The patterns.

fn training(g: &mut Gen, model: &Transformer, steps: u32, mut batch: impl FnMut(&mut Gen, u32) -> (u64, u64)) {
    let mut params = Params::load(g, &model.params());
    for step in 0..steps {
        g.begin_step(step);
        let (b, s) = batch(g, step);
        model.train_pass(g, &mut params, b, s, FP32);
        params.optimizer_step(g);
        g.end_step(step);
    }
}

fn accumulation(g: &mut Gen, model: &Transformer, steps: u32, a: u64, batch: impl Fn(u32) -> (u64, u64)) {
    let mut params = Params::load(g, &model.params());
    for step in 0..steps {
        g.begin_step(step);
        let (b, s) = batch(step);
        for micro in 0..ACCUMULATION {
            g.begin_micro(step, micro);
            model.train_pass(g, &mut params, b, s, a);
            g.end_micro(step, micro);
        }
        params.optimizer_step(g);
        g.end_step(step);
    }
}

fn bert_static(g: &mut Gen, steps: u32) {
    training(g, &BERT_BASE, steps, |_, _| (8, 512));
}

fn gpt2_varlen(g: &mut Gen, steps: u32) {
    training(g, &GPT2_SMALL, steps, |g, _| (4, g.uniform(2, 16) * 64));
}

fn gpt2_token_budget(g: &mut Gen, steps: u32) {
    training(g, &GPT2_SMALL, steps, |g, _| {
        let seq = g.uniform(2, 16) * 64;
        (TOKEN_BUDGET / seq, seq)
    });
}

fn llama_accum(g: &mut Gen, steps: u32) {
    accumulation(g, &LLAMA_6L, steps, BF16, |_| (1, 2048));
}

fn curriculum_accum(g: &mut Gen, steps: u32) {
    accumulation(g, &GPT2_SMALL, steps, FP32, |step| (4, curriculum_length(step, steps)));
}

fn train_eval(g: &mut Gen, steps: u32) {
    let model = GPT2_SMALL;
    let mut params = Params::load(g, &model.params());
    for step in 0..steps {
        g.begin_step(step);
        if is_eval_step(step) {
            // Evaluation: two larger batches, no gradients, the loss in fp32.
            for _ in 0..2 {
                let logits = model.no_grad_pass(g, 16, 512, 512, FP32);
                g.scratch(16 * 512 * model.vocab * FP32);
                g.free(logits);
            }
        } else {
            model.train_pass(g, &mut params, 8, 512, FP32);
            params.optimizer_step(g);
        }
        g.end_step(step);
    }
}

fn llama_checkpoint_bf16(g: &mut Gen, steps: u32) {
    let model = LLAMA_6L;
    let (batch, seq) = (4u64, 2048u64);
    let tokens = batch * seq;
    let mut params = Params::load(g, &model.params());
    let layer_elements = model.layer_params();
    for step in 0..steps {
        g.begin_step(step);
        // Forward under autocast: each layer's weights cast to bf16 (autocast keeps the casts
        // until the region ends), only each layer's input kept.
        let mut casts = Vec::new();
        let mut x = g.alloc(tokens * model.hidden * FP32);
        let mut inputs = Vec::with_capacity(model.layers);
        for _ in 0..model.layers {
            casts.extend(layer_elements.iter().map(|&n| g.alloc(n * BF16)));
            let (kept, out) = model.layer_forward(g, Mode::Checkpoint, batch, seq, seq, BF16, x);
            inputs.push(kept[0]);
            x = out;
        }
        let head = model.head_forward(g, tokens, BF16);
        g.free_all(casts);
        let mut dy = model.head_backward(g, &mut params, tokens, BF16, head);
        g.free(x);
        // Backward: each layer recomputed (its casts again), then its gradients.
        for (l, input) in inputs.into_iter().enumerate().rev() {
            let casts: Vec<Tensor> = layer_elements.iter().map(|&n| g.alloc(n * BF16)).collect();
            let (saved, out) = model.layer_forward(g, Mode::Train, batch, seq, seq, BF16, input);
            g.free(out);
            dy = model.layer_backward(g, &mut params, l, saved, dy);
            g.free_all(casts);
        }
        params.backward(g, [0]);
        g.free(dy);
        params.optimizer_step(g);
        g.end_step(step);
    }
}

fn gpt2_kv_generate(g: &mut Gen, steps: u32) {
    let model = GPT2_MEDIUM;
    // fp16 weights for inference, live to the end.
    for elements in model.params() {
        g.alloc(elements * BF16);
    }
    for step in 0..steps {
        g.begin_step(step);
        let prompt = g.uniform(1, 8) * 64;
        let new_tokens = g.uniform(2, 6) * 8;
        model.generate(g, Generation { batch: 8, prompt, new_tokens, a: BF16, micro_steps_of: Some(step) }, None);
        g.end_step(step);
    }
}

fn rl_generate_train(g: &mut Gen, steps: u32) {
    let model = GPT2_SMALL;
    let batch = 8u64;
    let mut params = Params::load(g, &model.params());
    for step in 0..steps {
        g.begin_step(step);
        let prompt = g.uniform(1, 4) * 64;
        let new_tokens = g.uniform(2, 8) * 16;
        // The prompts' token ids, then the sequences as they grow: what the training pass reads.
        let ids = g.alloc(batch * prompt * 8);
        let generation = Generation { batch, prompt, new_tokens, a: FP32, micro_steps_of: None };
        let sequences = model.generate(g, generation, Some(ids)).expect("the sequences generated");
        model.train_pass(g, &mut params, batch, prompt + new_tokens + 1, FP32);
        g.free(sequences);
        params.optimizer_step(g);
        g.end_step(step);
    }
}

/// ResNet-50's bottlenecks per stage: (blocks, middle channels, output channels, side of the
/// feature map at 224 × 224 input).
const RESNET50: [(u32, u64, u64, u64); 4] =
    [(3, 64, 256, 56), (4, 128, 512, 28), (6, 256, 1024, 14), (3, 512, 2048, 7)];

fn resnet_varbatch(g: &mut Gen, steps: u32) {
    // Parameters: the stem, then per bottleneck three convolutions with their batch norms and,
    // in each stage's first block, the projection; then the classifier.
    let mut elements = vec![3 * 64 * 49, 64, 64];
    let mut cin = 64;
    for &(blocks, mid, out, _) in &RESNET50 {
        for b in 0..blocks {
            elements.extend([cin * mid, mid, mid, mid * mid * 9, mid, mid, mid * out, out, out]);
            if b == 0 {
                elements.extend([cin * out, out, out]);
            }
            cin = out;
        }
    }
    elements.extend([2048 * 1000, 1000]);
    let mut params = Params::load(g, &elements);
    params.state_per_param = 1;
    let all = params.weights.len();
    for step in 0..steps {
        g.begin_step(step);
        let batch = g.uniform(1, 4) * 8;
        let image = g.alloc(batch * 3 * 224 * 224 * FP32);
        let mut saved = vec![image];
        // Stem: convolution, batch norm, ReLU at 112², max-pool to 56².
        for _ in 0..3 {
            saved.push(g.alloc(batch * 64 * 112 * 112 * FP32));
        }
        let mut x = g.alloc(batch * 64 * 56 * 56 * FP32);
        saved.push(x);
        for &(blocks, mid, out, side) in &RESNET50 {
            for b in 0..blocks {
                let inner = if b == 0 && side != 56 { side * 2 } else { side };
                let map = |c: u64| batch * c * side * side * FP32;
                // conv1 → bn → relu at the input's resolution, conv2 (strided) → bn → relu,
                // conv3 → bn, projection, add, relu.
                for _ in 0..3 {
                    saved.push(g.alloc(batch * mid * inner * inner * FP32));
                }
                for _ in 0..3 {
                    saved.push(g.alloc(map(mid)));
                }
                saved.push(g.alloc(map(out)));
                saved.push(g.alloc(map(out)));
                if b == 0 {
                    saved.push(g.alloc(map(out)));
                    saved.push(g.alloc(map(out)));
                }
                let sum = g.alloc(map(out));
                x = g.alloc(map(out));
                g.free(sum);
                saved.push(x);
            }
        }
        let pooled = g.alloc(batch * 2048 * FP32);
        let logits = g.alloc(batch * 1000 * FP32);
        g.scratch(batch * 1000 * FP32);
        // Backward.
        let dlogits = g.alloc(batch * 1000 * FP32);
        g.free(logits);
        params.backward(g, [all - 2, all - 1]);
        let dpooled = g.alloc_like(pooled);
        g.free(dlogits);
        g.free(pooled);
        g.free(dpooled);
        let mut index = all - 2;
        for tensor in saved.into_iter().rev() {
            g.backward_through(tensor);
            // Spread the parameters' gradients over the backward pass, three at a time.
            if index > 0 {
                let from = index.saturating_sub(3);
                params.backward(g, from..index);
                index = from;
            }
        }
        params.backward(g, 0..index);
        // SGD with momentum: one buffer per parameter, allocated at the first step.
        params.optimizer_step(g);
        g.end_step(step);
    }
}

fn moe_routing(g: &mut Gen, steps: u32) {
    // OLMoE's attention and expert shapes (hidden 2048, 16 heads, experts of 1024), 8 experts
    // with top-2 routing, 4 layers, vocab 50304.
    let attn = Transformer {
        layers: 4,
        hidden: 2048,
        ffn: 1024,
        heads: 16,
        kv_heads: 16,
        vocab: 50304,
        gated: true,
        fused_attention: true,
    };
    let (experts, top_k) = (8u64, 2u64);
    let (batch, seq) = (4u64, 1024u64);
    let (h, f, a) = (attn.hidden, attn.ffn, BF16);
    // Parameters: embedding, per layer attention (norm, q, k, v, o, norm), router, experts
    // (gate, up, down each), final norm.
    let per_layer = 7 + 3 * experts as usize;
    let mut elements = vec![attn.vocab * h];
    for _ in 0..attn.layers {
        elements.extend([h, h * h, h * h, h * h, h * h, h, h * experts]);
        for _ in 0..experts {
            elements.extend([h * f, h * f, f * h]);
        }
    }
    elements.push(h);
    let mut params = Params::load(g, &elements);
    let tokens = batch * seq;
    for step in 0..steps {
        g.begin_step(step);
        let mut x = g.alloc(tokens * h * a);
        let mut layers = Vec::new();
        for _ in 0..attn.layers {
            // Attention: as a transformer layer's first half.
            let mut saved = vec![x];
            for bytes in [tokens * h * a, tokens * h * a, tokens * h * a, tokens * h * a] {
                saved.push(g.alloc(bytes));
            }
            saved.push(g.alloc(batch * attn.heads * seq * FP32));
            saved.push(g.alloc(tokens * h * a));
            let x1 = g.alloc(tokens * h * a);
            let n2 = g.alloc(tokens * h * a);
            saved.extend([x1, n2]);
            // Router: logits, probabilities, top-k.
            let router_logits = g.alloc(tokens * experts * FP32);
            let probs = g.alloc(tokens * experts * FP32);
            g.free(router_logits);
            let chosen = g.alloc(tokens * top_k * 8);
            saved.extend([probs, chosen]);
            // Each expert's share of the tokens: skewed weights drawn per step and layer, some
            // experts left without tokens.
            let weights: Vec<u64> = (0..experts).map(|_| g.uniform(0, 3).pow(2)).collect();
            let total: u64 = weights.iter().sum::<u64>().max(1);
            let mut routed = Vec::new();
            for (e, &w) in weights.iter().enumerate() {
                let count = tokens * top_k * w / total;
                if count == 0 {
                    continue;
                }
                let index = g.alloc(count * 8);
                let input = g.alloc(count * h * a);
                let gate = g.alloc(count * f * a);
                let up = g.alloc(count * f * a);
                let act = g.alloc(count * f * a);
                let down = g.alloc(count * h * a);
                let weighted = g.alloc(count * h * a);
                g.free(down);
                routed.push((e, [index, input, gate, up, act, weighted]));
            }
            let combined = g.alloc(tokens * h * a);
            x = g.alloc(tokens * h * a);
            g.free(combined);
            layers.push((saved, routed));
        }
        let head = attn.head_forward(g, tokens, a);
        let mut dy = attn.head_backward(g, &mut params, tokens, a, head);
        g.free(x);
        for (l, (saved, routed)) in layers.into_iter().enumerate().rev() {
            let base = 1 + l * per_layer;
            for (e, tensors) in routed.into_iter().rev() {
                for tensor in tensors.into_iter().rev() {
                    g.backward_through(tensor);
                }
                // Only the experts that saw tokens get gradients this step.
                let first = base + 7 + 3 * e;
                params.backward(g, first..first + 3);
            }
            for tensor in saved.into_iter().rev() {
                g.backward_through(tensor);
            }
            params.backward(g, base..base + 7);
            let dx = g.alloc_like(dy);
            g.free(dy);
            dy = dx;
        }
        params.backward(g, [0]);
        g.free(dy);
        params.optimizer_step(g);
        g.end_step(step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_patterns() {
        for pattern in Pattern::ALL {
            assert_eq!(Pattern::from_name(pattern.name()), Ok(pattern));
        }
        let error = Pattern::from_name("bert").unwrap_err().to_string();
        assert!(error.contains("no pattern `bert`") && error.contains("moe_routing"), "{error}");
    }

    #[test]
    fn bad_options_are_refused() {
        for scale in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let options = PatternOptions { scale, ..PatternOptions::default() };
            assert!(matches!(generate(Pattern::BertStatic, &options), Err(PatternError::BadScale { .. })));
        }
        let options = PatternOptions { steps: 0, ..PatternOptions::default() };
        assert_eq!(generate(Pattern::BertStatic, &options).unwrap_err(), PatternError::NoSteps);
    }

    #[test]
    fn curriculum_lengths_go_from_128_to_1024() {
        let lengths: Vec<u64> = (0..8).map(|s| curriculum_length(s, 8)).collect();
        assert_eq!((lengths[0], lengths[7]), (128, 1024));
        assert!(lengths.windows(2).all(|w| w[0] <= w[1]), "{lengths:?}");
        assert_eq!(curriculum_length(0, 1), 128);
    }
}
