"""Records PyTorch training and inference runs, on the CPU or a CUDA GPU, as allocation traces
steppool replays.

Each workload runs under ``torch.profiler`` with ``profile_memory=True``, which reports every
allocation and free of the device's allocator (the ``[memory]`` events of the exported chrome
trace, with ``Addr``, ``Bytes`` and ``Total Allocated``). On the CPU that is the CPU allocator;
with ``--device cuda`` it is PyTorch's CUDA caching allocator (whose requests are rounded to
512 bytes), and the manifest also keeps what that allocator itself reserved over the workload
(``torch_cuda``: ``torch.cuda.max_memory_reserved()`` and ``max_memory_allocated()`` from a
cache emptied before it, the ``PYTORCH_CUDA_ALLOC_CONF`` it ran under, and its retries after
running out of memory), the real figure the ``torch-caching`` and ``torch-expandable`` models of
``steppool replay`` stand for. Steps and micro-steps are marked with
``record_function`` ranges named ``steppool_step_N`` and ``steppool_micro_N_K``.

Written per workload, into the output folder (default: ``cli/tests/data/recorded``):

* without micro-steps, an RMM log ``NAME.csv`` (``Thread,Time,Action,Pointer,Size,Stream``,
  nanoseconds from the first allocation) and its sidecar ``NAME.json`` with ``steps_start_ns``,
  as the repository's ``vit_static_train`` and ``t5_varlen_train`` traces are;
* with micro-steps (gradient accumulation), a steppool trace ``NAME.jsonl`` with
  ``step_begin``/``micro_begin``/``micro_end``/``step_end`` events.

and ``manifest.json`` describing every trace (model, pattern, steps, micro-steps, peak live
bytes, events, torch version). With ``--chrome``, also the profiler's own Chrome trace,
gzipped, as ``NAME.pt.trace.json.gz``: ``steppool replay`` reads it directly (memory events,
steps from the ``steppool_step_N`` ranges), as it reads any ``torch.profiler`` trace. Not run by CI:

    python3 -m venv venv && venv/bin/pip install -r benches/traces/requirements.txt
    venv/bin/python benches/traces/record.py [--out DIR] [--only NAME ...] [--seed N] [--steps N]
                                             [--size X] [--width X] [--optimizer O] [--zero-grad Z]
                                             [--clip] [--amp off|bf16|fp16] [--suffix S] [--chrome]
                                             [--device cpu|cuda]

``--steps`` replaces every workload's step count; ``--size`` multiplies every batch dimension
(sequences a batch or micro-batch, images a batch, requests generated together) and ``--width``
every model's width (model dimension, in multiples of 64, attention heads kept, so heads widen;
feed-forward and expert hidden sizes, in multiples of 16; ResNet's base channels). Live memory
grows about linearly with ``--size`` (activations) and with ``--width`` (activations, and weights
and optimizer state quadratically). The defaults (each workload's own steps, size 1, width 1)
record the shapes of the committed traces.

``--optimizer``, ``--zero-grad``, ``--clip`` and ``--amp`` change the training loop the way real
loops differ from these (class ``Loop``); their defaults write the loops as the committed traces
were recorded.

Everything is seeded, but addresses and times differ between runs. On CUDA the workloads run
with CUDA as torch's default device (``torch.set_default_device``), so models, batches and
temporaries are all on the GPU; the same run under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
makes the same requests, so its ``torch_cuda`` figures are PyTorch's expandable mode on the same
trace.
"""

import argparse
import gzip
import json
import math
import os
import random
import shutil
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint


# Micro-batches a step in the accumulation workloads.
ACCUMULATION = 4

# Where the workloads run: `--device`.
DEVICE = torch.device("cpu")


class Scale:
    """`--size` and `--width`: multipliers of the batch dimensions and of the models' widths."""

    def __init__(self, size=1.0, width=1.0):
        if size <= 0 or width <= 0:
            raise ValueError(f"--size {size} and --width {width} must be positive")
        self.size, self.width = size, width

    def batch(self, n):
        """A batch dimension of `n` at size 1."""
        return max(1, round(n * self.size))

    def dim(self, n, multiple):
        """A width of `n` at width 1, a multiple of `multiple`."""
        return max(multiple, round(n * self.width / multiple) * multiple)


class Loop:
    """`--optimizer`, `--zero-grad`, `--clip` and `--amp`: how the loop around forward and backward
    is written. The defaults (`None`, "end", no clip, `None`) are the loops of the committed traces.

    * `optimizer`: `None`, each workload's own (AdamW, SGD with momentum for the ResNet), built with
      torch's defaults, which on the CPU are the single-tensor (for-loop) implementations;
      "adamw" forces `foreach=True`, torch's default on CUDA, whose step allocates lists of
      temporaries as large as the parameters; "adamw-fused" one fused kernel a step;
      "adamw-nofore" `foreach=False`; "sgd" SGD with momentum; "adafactor" torch's Adafactor
      (factored second moments: little state).
    * `zero_grad`: "end", `zero_grad(set_to_none=True)` after the optimizer step; "start", the
      same call as the step's first statement, as most loops are written, so gradients stay live
      from the backward pass of one step into the next; "backward", the same call after the
      forward pass, just before the step's first `backward()`, as many tutorials write it, so
      gradients stay live from one step's backward pass through the next step's forward pass;
      "keep", `set_to_none=False` after the optimizer step, so gradients are allocated once and
      stay live.
    * `clip`: `clip_grad_norm_(max_norm=1.0)` before the optimizer step (after unscaling).
    * `amp`: `None`, each workload's own (bf16 autocast for the checkpointed Llama, none else);
      "bf16" autocast to bfloat16; "fp16" autocast to float16 with a `GradScaler`; "off" none.
    * `inputs`: "list", the training workloads' batches made before the first step and kept;
      "step", each step's batch copied at the step's start (as a copy to the device makes it)
      and bound to the name the step before's had, so the new copy is made before the old one
      is freed; "loader", the copy made before the step's mark, as `for batch in loader` makes
      it where the mark is inside the loop body.
    """

    OPTIMIZERS = ("adamw", "adamw-fused", "adamw-nofore", "sgd", "adafactor")
    ZERO_GRAD = ("end", "start", "backward", "keep")
    AMP = ("off", "bf16", "fp16")
    INPUTS = ("list", "step", "loader")

    def __init__(self, optimizer=None, zero_grad="end", clip=False, amp=None, inputs="list"):
        if optimizer is not None and optimizer not in self.OPTIMIZERS:
            raise ValueError(f"--optimizer {optimizer}: one of {self.OPTIMIZERS}")
        if zero_grad not in self.ZERO_GRAD:
            raise ValueError(f"--zero-grad {zero_grad}: one of {self.ZERO_GRAD}")
        if amp is not None and amp not in self.AMP:
            raise ValueError(f"--amp {amp}: one of {self.AMP}")
        if inputs not in self.INPUTS:
            raise ValueError(f"--inputs {inputs}: one of {self.INPUTS}")
        self.optimizer_name, self.zero_grad, self.clip, self.amp = optimizer, zero_grad, clip, amp
        self.inputs = inputs
        self.scaler = None
        # The optimizer whose gradients "backward" zeroes before the step's first backward pass.
        self.to_zero = None

    def is_default(self):
        return (self.optimizer_name is None and self.zero_grad == "end" and not self.clip and self.amp is None
                and self.inputs == "list")

    def describe(self):
        """The options that differ from the defaults, for the manifest."""
        parts = []
        if self.optimizer_name is not None:
            parts.append(f"optimizer {self.optimizer_name}")
        if self.zero_grad != "end":
            parts.append(f"zero_grad {self.zero_grad}")
        if self.clip:
            parts.append("clip_grad_norm_")
        if self.amp is not None:
            parts.append(f"amp {self.amp}")
        if self.inputs != "list":
            parts.append(f"inputs {self.inputs}")
        return ", ".join(parts)

    def optimizer(self, params, own, lr):
        """The workload's optimizer: `own(params)` unless `--optimizer` names one."""
        name = self.optimizer_name
        if name is None:
            return own(params)
        if name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        if name == "adafactor":
            return torch.optim.Adafactor(params, lr=lr)
        kw = {"adamw": dict(foreach=True), "adamw-fused": dict(fused=True), "adamw-nofore": dict(foreach=False)}
        return torch.optim.AdamW(params, lr=lr, **kw[name])

    def autocast(self, own=None):
        """Autocast as `--amp` says, or as the workload's own `own` dtype when it is not given."""
        dtype = own if self.amp is None else {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.amp]
        return torch.autocast(DEVICE.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def begin(self, opt):
        """The step's first statement."""
        if self.zero_grad == "start":
            opt.zero_grad(set_to_none=True)
        elif self.zero_grad == "backward":
            self.to_zero = opt

    def backward(self, loss):
        if self.to_zero is not None:
            self.to_zero.zero_grad(set_to_none=True)
            self.to_zero = None
        if self.amp == "fp16":
            if self.scaler is None:
                self.scaler = torch.amp.GradScaler(DEVICE.type)
                KEEP.append(self.scaler)
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, opt, model):
        """Clipping, the optimizer step and the zeroing of gradients after it."""
        if self.clip:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        if self.zero_grad == "end":
            opt.zero_grad(set_to_none=True)
        elif self.zero_grad == "keep":
            opt.zero_grad(set_to_none=False)


# ---------------------------------------------------------------------------------------------
# Models: small versions of the architectures the patterns name.


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Multi-head attention with grouped key/value heads and an optional KV cache."""

    def __init__(self, dim, heads, kv_heads, bias):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(dim, dim, bias=bias)

    def forward(self, x, causal, cache=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            # A growing cache, as Hugging Face's DynamicCache grows it: one concatenation a token.
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and s > 1)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, dim, hidden, gated):
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(dim, hidden * (2 if gated else 1), bias=not gated)
        self.down = nn.Linear(hidden, dim, bias=not gated)

    def forward(self, x):
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-k routing over experts: each expert sees a different number of tokens each batch."""

    def __init__(self, dim, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Mlp(dim, hidden, gated=True) for _ in range(experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            y = expert(x.index_select(0, token)) * weights[token, slot].unsqueeze(-1)
            # In the output's dtype, as Hugging Face's MoE layers add it: under autocast the
            # experts compute in the lower precision.
            out = out.index_add(0, token, y.to(out.dtype))
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn, llama, experts=0, top_k=2):
        super().__init__()
        norm = (lambda: RMSNorm(dim)) if llama else (lambda: nn.LayerNorm(dim))
        self.norm1, self.norm2 = norm(), norm()
        self.attn = Attention(dim, heads, kv_heads, bias=not llama)
        self.mlp = MoE(dim, ffn, experts, top_k) if experts else Mlp(dim, ffn, gated=llama)

    def forward(self, x, causal, cache=None):
        x = x + self.attn(self.norm1(x), causal, cache)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """BERT (bidirectional, learned positions), GPT-2 (causal, learned positions) or Llama-style
    (causal, RMSNorm, SwiGLU, grouped KV heads) stacks, with a language-model head."""

    def __init__(self, vocab, dim, layers, heads, ffn, causal, llama=False, kv_heads=None, experts=0,
                 max_len=1024, checkpointed=False):
        super().__init__()
        self.causal, self.checkpointed = causal, checkpointed
        self.embed = nn.Embedding(vocab, dim)
        self.pos = None if llama else nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, kv_heads or heads, ffn, llama, experts) for _ in range(layers))
        self.norm = RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, caches=None, offset=0):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(offset, offset + tokens.shape[1]))
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            if self.checkpointed and self.training:
                x = checkpoint(block, x, self.causal, use_reentrant=False)
            else:
                x = block(x, self.causal, cache)
        return self.head(self.norm(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (two basic blocks a stage) at reduced width."""

    def __init__(self, width=32, classes=100):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for stage, cout in enumerate([width, width * 2, width * 4, width * 8]):
            for i in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and i == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


# Models and optimizers outlive the recording, as they outlive the steps of a training process:
# their memory is live at the end of the trace.
KEEP = []


# ---------------------------------------------------------------------------------------------
# Workloads. Each takes `mark(step, micro=None)`, a context manager naming the region, the step
# count, the `Scale` and the `Loop`, and runs its steps; models and optimizers are built inside the
# recording so weights are in the trace.


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def adamw(lr):
    """The workloads' own AdamW, with torch's defaults."""
    return lambda params: torch.optim.AdamW(params, lr=lr)


def train_steps(model, opt, batches, mark, loop, micro=1, autocast=None):
    """`batches[step][micro]` is a token tensor; each micro-step runs forward and backward, the
    optimizer steps once per step. Under `--inputs step` or `loader` each step's batch is copied
    into new tensors (as a loader's batch is copied to the device) inside the step or before its
    mark, and the copy of the step before is dropped when the name is bound again."""
    held = None
    for step, micro_batches in enumerate(batches):
        if loop.inputs == "loader":
            held = [tokens.clone() for tokens in micro_batches]
        with mark(step):
            if loop.inputs == "step":
                held = [tokens.clone() for tokens in micro_batches]
            if held is not None:
                micro_batches = held
            loop.begin(opt)
            for k, tokens in enumerate(micro_batches):
                with mark(step, k if micro > 1 else None):
                    with loop.autocast(autocast):
                        logits = model(tokens)
                        loss = lm_loss(logits.float(), tokens) / len(micro_batches)
                    loop.backward(loss)
                    del logits, loss
            loop.step(opt, model)


def bert_static(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(1024, 16), scale.batch(8)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=False, max_len=128)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    batches = [[torch.randint(0, 8192, (batch, 128))] for _ in range(steps)]
    train_steps(model, opt, batches, mark, loop)
    return dict(model=f"BERT-style encoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192, 128 positions",
                pattern=f"static shapes: batch {batch} x 128 tokens every step, masked-LM head, AdamW")


def gpt2_training(mark, scale, loop, shapes):
    """The small GPT-2-style decoder trained with AdamW on one batch a step, of `shapes[step]`
    (sequences, tokens); returns its manifest `model`."""
    dim, ffn = scale.dim(256, 64), scale.dim(1024, 16)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=True, max_len=512)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    batches = [[torch.randint(0, 8192, shape)] for shape in shapes]
    train_steps(model, opt, batches, mark, loop)
    return f"GPT-2-style decoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192"


def gpt2_varlen(mark, steps, scale, loop):
    batch = scale.batch(4)
    lengths = [random.choice(range(64, 513, 32)) for _ in range(steps)]
    return dict(model=gpt2_training(mark, scale, loop, [(batch, s) for s in lengths]),
                pattern=f"variable sequence length per step (batch {batch}, lengths {lengths}), AdamW")


def llama_accum(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(688, 16), scale.batch(2)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=8, kv_heads=2, ffn=ffn, causal=True, llama=True)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    batches = [[torch.randint(0, 8192, (batch, 256)) for _ in range(ACCUMULATION)] for _ in range(steps)]
    train_steps(model, opt, batches, mark, loop, micro=ACCUMULATION)
    return dict(model=f"Llama-style decoder, 4 layers, d={dim}, 8 heads / 2 KV heads, SwiGLU {ffn}, vocab 8192",
                pattern=f"4x gradient accumulation: 4 micro-batches of {batch} x 256 tokens, one optimizer step a step")


def resnet_varbatch(mark, steps, scale, loop):
    width = scale.dim(16, 1)
    model = ResNet(width=width)
    opt = loop.optimizer(model.parameters(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 0.1)
    KEEP.append((model, opt))
    sizes = [scale.batch(random.choice([8, 12, 16, 24, 32])) for _ in range(steps)]
    for step, batch in enumerate(sizes):
        with mark(step):
            loop.begin(opt)
            x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 100, (batch,))
            with loop.autocast():
                loss = F.cross_entropy(model(x), y)
            loop.backward(loss)
            del loss
            loop.step(opt, model)
            del x, y
    return dict(model=f"ResNet-18 layout at width {width}, 32x32 images, 100 classes, BatchNorm",
                pattern=f"variable batch per step ({sizes}), SGD with momentum")


def moe_routing(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(192, 64), scale.dim(384, 16), scale.batch(4)
    model = Transformer(vocab=4096, dim=dim, layers=3, heads=4, ffn=ffn, causal=True, llama=True, experts=8)
    opt = loop.optimizer(model.parameters(), adamw(1e-3), 1e-3)
    KEEP.append((model, opt))
    batches = [[torch.randint(0, 4096, (batch, 128))] for _ in range(steps)]
    train_steps(model, opt, batches, mark, loop)
    return dict(model=f"mixture-of-experts decoder, 3 layers, d={dim}, 8 SwiGLU experts of {ffn}, top-2, vocab 4096"
                      + ("" if batch == 4 else f", batch {batch} x 128"),
                pattern="variable routing: each expert's token count changes every step and layer, AdamW")


def llama_ckpt_bf16(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(688, 16), scale.batch(4)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=8, kv_heads=2, ffn=ffn, causal=True, llama=True,
                        checkpointed=True)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    batches = [[torch.randint(0, 8192, (batch, 256))] for _ in range(steps)]
    train_steps(model, opt, batches, mark, loop, autocast=torch.bfloat16)
    return dict(model=f"Llama-style decoder, 4 layers, d={dim}, 8 heads / 2 KV heads, SwiGLU {ffn}, vocab 8192",
                pattern=f"activation checkpointing per block (non-reentrant) under bf16 autocast, batch {batch} x 256")


def decode(model, prompt, new, keep_sequence=False):
    """Generates `new` tokens after the token ids `prompt` with a KV cache that grows by
    concatenation; with `keep_sequence`, returns the ids with each token concatenated to them."""
    caches = [dict() for _ in model.blocks]
    sequence = prompt
    logits = model(prompt, caches, 0)
    del prompt
    for offset in range(sequence.shape[1], sequence.shape[1] + new):
        token = logits[:, -1:].argmax(-1)
        if keep_sequence:
            sequence = torch.cat([sequence, token], dim=1)
        logits = model(token, caches, offset)
    # Freed as the loops written out did: the caches and logits, the prompt, the last token.
    del caches, logits
    kept = sequence if keep_sequence else None
    del sequence, token
    return kept


@torch.no_grad()
def gpt2_kv_generate(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(1024, 16), scale.batch(8)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=True, max_len=1024).eval()
    KEEP.append(model)
    requests = [(random.choice(range(32, 257, 16)), random.choice(range(16, 49, 8))) for _ in range(steps)]
    for step, (prompt, new) in enumerate(requests):
        with mark(step):
            with loop.autocast():
                decode(model, torch.randint(0, 8192, (batch, prompt)), new)
    return dict(model=f"GPT-2-style decoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192, inference",
                pattern=f"KV-cache generation, batch {batch}, one request a step (prompt, new tokens): {requests}; "
                        "the cache grows by concatenation each token")


def train_eval(mark, steps, scale, loop):
    dim, ffn, train, evaluate = scale.dim(256, 64), scale.dim(1024, 16), scale.batch(8), scale.batch(16)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=True, max_len=256)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    kinds = []
    for step in range(steps):
        with mark(step):
            if step % 3 == 2:
                kinds.append("eval")
                model.eval()
                with torch.no_grad():
                    for _ in range(2):
                        tokens = torch.randint(0, 8192, (evaluate, 256))
                        with loop.autocast():
                            loss = lm_loss(model(tokens).float(), tokens)
                        del loss
                model.train()
            else:
                kinds.append("train")
                loop.begin(opt)
                tokens = torch.randint(0, 8192, (train, 256))
                with loop.autocast():
                    loss = lm_loss(model(tokens).float(), tokens)
                loop.backward(loss)
                del loss
                loop.step(opt, model)
            del tokens
    return dict(model=f"GPT-2-style decoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192",
                pattern=f"training interleaved with evaluation passes (each its own step): {kinds}; "
                        f"train batch {train} x 256, eval 2 batches of {evaluate} x 256 without gradients")


def curriculum_accum(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(1024, 16), scale.batch(2)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=True, max_len=512)
    opt = loop.optimizer(model.parameters(), adamw(1e-4), 1e-4)
    KEEP.append((model, opt))
    lengths = [int(64 + (512 - 64) * step / max(steps - 1, 1)) // 32 * 32 for step in range(steps)]
    batches = [[torch.randint(0, 8192, (batch, s)) for _ in range(ACCUMULATION)] for s in lengths]
    train_steps(model, opt, batches, mark, loop, micro=ACCUMULATION)
    return dict(model=f"GPT-2-style decoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192",
                pattern=f"sequence-length curriculum {lengths} with 4x gradient accumulation (micro-batch {batch})")


def gpt2_token_budget(mark, steps, scale, loop):
    budget = scale.batch(2048)
    # Batches bucketed by length and filled to a token budget, as fairseq's `max_tokens` and
    # length-grouped samplers do: batch and length both change, their product about constant.
    shapes = [(max(budget // s, 1), s) for s in (random.choice(range(64, 513, 32)) for _ in range(steps))]
    return dict(model=gpt2_training(mark, scale, loop, shapes),
                pattern=f"token-budget batching: {budget} tokens a step as (batch, length) {shapes}, AdamW")


def rl_generate_train(mark, steps, scale, loop):
    dim, ffn, batch = scale.dim(256, 64), scale.dim(1024, 16), scale.batch(4)
    model = Transformer(vocab=8192, dim=dim, layers=4, heads=4, ffn=ffn, causal=True, max_len=512)
    opt = loop.optimizer(model.parameters(), adamw(1e-5), 1e-5)
    KEEP.append((model, opt))
    rollouts = [(random.choice(range(32, 129, 16)), random.choice(range(16, 49, 16))) for _ in range(steps)]
    for step, (prompt, new) in enumerate(rollouts):
        with mark(step):
            # On-policy fine-tuning: the model generates from a prompt with its KV cache, without
            # gradients, then trains on its own sequences, all in one step.
            model.eval()
            with torch.no_grad(), loop.autocast():
                sequence = decode(model, torch.randint(0, 8192, (batch, prompt)), new, keep_sequence=True)
            model.train()
            loop.begin(opt)
            with loop.autocast():
                loss = lm_loss(model(sequence).float(), sequence)
            loop.backward(loss)
            del loss, sequence
            loop.step(opt, model)
    return dict(model=f"GPT-2-style decoder, 4 layers, d={dim}, ffn {ffn}, vocab 8192",
                pattern=f"generate then train in each step (on-policy fine-tuning), batch {batch}, "
                        f"(prompt, new tokens) {rollouts}, AdamW")


WORKLOADS = {
    "bert_static": (bert_static, 8),
    "gpt2_varlen": (gpt2_varlen, 8),
    "llama_accum": (llama_accum, 6),
    "resnet_varbatch": (resnet_varbatch, 8),
    "moe_routing": (moe_routing, 8),
    "llama_ckpt_bf16": (llama_ckpt_bf16, 6),
    "gpt2_kv_generate": (gpt2_kv_generate, 6),
    "train_eval": (train_eval, 9),
    "curriculum_accum": (curriculum_accum, 6),
    "gpt2_token_budget": (gpt2_token_budget, 8),
    "rl_generate_train": (rl_generate_train, 6),
}

# ---------------------------------------------------------------------------------------------
# Recording and writing.


class Marks:
    """`record_function` ranges named after steps and micro-steps."""

    def __call__(self, step, micro=None):
        return record_function(f"steppool_step_{step}" if micro is None else f"steppool_micro_{step}_{micro}")


def record(name, out_dir, seed, steps=None, scale=Scale(), loop=None, suffix="", keep_chrome=False):
    """Records workload `name` into `out_dir` as `name` + `suffix`; returns its manifest entry."""
    fn, default_steps = WORKLOADS[name]
    workload, name = name, name + suffix
    steps = steps or default_steps
    random.seed(seed)
    torch.manual_seed(seed)
    chrome = os.path.join(out_dir, f".{name}.chrome.json")
    cuda = DEVICE.type == "cuda"
    if cuda:
        # What PyTorch's allocator reserves for this workload alone: the cache of the one before
        # is given back, and the peaks start again.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=True) as prof:
        info = fn(Marks(), steps, scale, loop or Loop())
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        info["torch_cuda"] = dict(
            allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
            alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
            device=torch.cuda.get_device_name(),
        )
    prof.export_chrome_trace(chrome)
    with open(chrome) as f:
        events = json.load(f)["traceEvents"]
    if keep_chrome:
        with open(chrome, "rb") as f, gzip.open(os.path.join(out_dir, f"{name}.pt.trace.json.gz"), "wb") as z:
            shutil.copyfileobj(f, z)
    os.remove(chrome)
    KEEP.clear()

    # c10's device types: 0 the CPU, 1 CUDA. A CUDA run's CPU tensors are left out.
    memory = [e for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == (1 if cuda else 0)]
    memory.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    ranges = {}
    for e in events:
        n = e.get("name", "")
        # The host's ranges; a CUDA run also has the GPU's copies of them (`gpu_user_annotation`).
        if e.get("ph") == "X" and n.startswith("steppool_") and e.get("cat") != "gpu_user_annotation":
            ranges.setdefault(n, (e["ts"], e["ts"] + e["dur"]))
    t0 = memory[0]["ts"]
    ns = lambda ts: int(round((ts - t0) * 1000))

    rows, live, implied = [], {}, 0
    for e in memory:
        a = e["args"]
        addr, size, t, tid = a["Addr"], a["Bytes"], ns(e["ts"]), e["tid"]
        if size > 0:
            if addr in live:
                # The allocator handed out an address whose free the profiler did not report.
                rows.append((t, "free", addr, live.pop(addr), tid))
                implied += 1
            live[addr] = size
            rows.append((t, "alloc", addr, size, tid))
        elif size < 0 and addr in live:
            rows.append((t, "free", addr, live.pop(addr), tid))
        # A free of memory allocated before the recording began is left out, as RMM would.
    peak, total = 0, 0
    for _, action, _, size, _ in rows:
        total += size if action == "alloc" else -size
        peak = max(peak, total)

    step_starts = [ns(ranges[f"steppool_step_{s}"][0]) for s in range(steps)]
    micro = sum(1 for n in ranges if n.startswith("steppool_micro_0_"))
    if micro:
        path = os.path.join(out_dir, f"{name}.jsonl")
        boundaries = []
        for s in range(steps):
            begin, end = ranges[f"steppool_step_{s}"]
            boundaries.append((ns(begin), 0, {"event": "step_begin", "step": s}))
            boundaries.append((ns(end), 3, {"event": "step_end", "step": s}))
            for k in range(micro):
                mb, me = ranges[f"steppool_micro_{s}_{k}"]
                boundaries.append((ns(mb), 1, {"event": "micro_begin", "step": s, "micro": k}))
                boundaries.append((ns(me), 2, {"event": "micro_end", "step": s, "micro": k}))
        boundaries.sort(key=lambda b: (b[0], b[1]))
        lines = [json.dumps({"format": "steppool-trace", "version": 1,
                             "driver": f"torch {torch.__version__} {DEVICE.type.upper()} profiler (profile_memory)",
                             "devices": [{"ordinal": 0, "total_bytes": None}], "phases": [],
                             "dropped_events": 0}, separators=(",", ":"))]
        b, last = 0, 0
        for t, action, addr, size, _ in rows:
            while b < len(boundaries) and boundaries[b][0] <= t:
                bt, _, ev = boundaries[b]
                last = max(last, bt)
                lines.append(json.dumps({"t_ns": last, **ev}, separators=(",", ":")))
                b += 1
            last = max(last, t)
            # Device, stream and thread are left at their default, 0, to keep the file small (the
            # workloads allocate on one thread).
            lines.append(json.dumps({"t_ns": last, "event": action, "ptr": addr, "bytes": size},
                                    separators=(",", ":")))
        for bt, _, ev in boundaries[b:]:
            last = max(last, bt)
            lines.append(json.dumps({"t_ns": last, **ev}, separators=(",", ":")))
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    else:
        path = os.path.join(out_dir, f"{name}.csv")
        with open(path, "w") as f:
            f.write("Thread,Time,Action,Pointer,Size,Stream\n")
            for t, action, addr, size, thread in rows:
                f.write(f"{thread},{t},{'allocate' if action == 'alloc' else 'free'},{addr:#x},{size},0x0\n")
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({"workload": name, "steps_start_ns": step_starts, "events": len(rows),
                       "torch": torch.__version__}, f)
    extra = {} if loop is None or loop.is_default() else {"loop": loop.describe()}
    if keep_chrome:
        extra["chrome"] = f"{name}.pt.trace.json.gz"
    if suffix:
        extra["workload"] = workload
    return dict(file=os.path.basename(path), format="steppool-jsonl" if micro else "rmm-csv+sidecar",
                steps=steps, micro_steps_per_step=micro, events=len(rows),
                allocations=sum(1 for r in rows if r[1] == "alloc"), peak_live_bytes=peak,
                live_at_end_bytes=total, implied_frees=implied,
                bytes=os.path.getsize(path), seed=seed, size=scale.size, width=scale.width, **info, **extra)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_out = os.path.join(here, "..", "..", "cli", "tests", "data", "recorded")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--only", nargs="*", choices=sorted(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="steps of every workload (default: each its own)")
    parser.add_argument("--size", type=float, default=1.0, help="multiplier of every batch dimension")
    parser.add_argument("--width", type=float, default=1.0, help="multiplier of every model's width")
    parser.add_argument("--optimizer", choices=Loop.OPTIMIZERS,
                        help="optimizer of every training workload (default: each its own)")
    parser.add_argument("--zero-grad", choices=Loop.ZERO_GRAD, default="end",
                        help="where gradients are set to None: end (after the step), start, backward (before the first backward pass), keep (zeroed in place)")
    parser.add_argument("--clip", action="store_true", help="clip_grad_norm_ before the optimizer step")
    parser.add_argument("--amp", choices=Loop.AMP, help="autocast (fp16 with a GradScaler; default: each workload's own)")
    parser.add_argument("--inputs", choices=Loop.INPUTS, default="list",
                        help="training batches: list (made before the first step, kept), step (copied inside each step), loader (copied before each step's mark, as `for batch in loader`)")
    parser.add_argument("--suffix", default="", help="appended to each trace's name (file and manifest entry)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the workloads run: the CPU, or the first CUDA GPU (PyTorch's caching allocator)")
    parser.add_argument("--chrome", action="store_true",
                        help="also keep the profiler's Chrome trace, gzipped, as NAME.pt.trace.json.gz")
    args = parser.parse_args()
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1")
    if args.size <= 0 or args.width <= 0:
        parser.error(f"--size {args.size} and --width {args.width} must be positive")
    scale = Scale(args.size, args.width)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: this torch sees no CUDA device")
        torch.set_default_device(DEVICE)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = {"traces": {}}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    where = "the CPU" if DEVICE.type == "cpu" else torch.cuda.get_device_name()
    manifest["recorded_with"] = (f"benches/traces/record.py, torch {torch.__version__} on {where}, "
                                 "torch.profiler profile_memory=True, one thread")
    for name in args.only or WORKLOADS:
        loop = Loop(args.optimizer, args.zero_grad, args.clip, args.amp, args.inputs)
        entry = record(name, args.out, args.seed, args.steps, scale, loop, args.suffix, args.chrome)
        entry["torch"] = torch.__version__
        manifest["traces"][name + args.suffix] = entry
        print(f"{name + args.suffix}: {entry['events']} events, peak live {entry['peak_live_bytes'] / 2**20:.1f} MiB, "
              f"{entry['bytes'] / 2**20:.2f} MiB file", file=sys.stderr)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
