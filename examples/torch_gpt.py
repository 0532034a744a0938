#!/usr/bin/env python3
"""A small GPT trained with variable sequence lengths and periodic evaluation, under one of four
CUDA allocators, printing per step the memory PyTorch reserved and allocated and the step time,
then one comparison table.

    python examples/torch_gpt.py                       # every allocator, one process each
    python examples/torch_gpt.py --allocator steppool  # one allocator

Allocators: ``native`` (PyTorch's caching allocator), ``expandable``
(``expandable_segments:True``), ``async`` (``backend:cudaMallocAsync``), ``steppool``
(``steppool.torch.use()``: the forward and backward passes in a step-scoped phase, released at
each step boundary, which with ``--phase-threads all`` also routes autograd's backward threads;
the rest, the optimizer step included, in the persistent phase ``untagged``). An allocator is chosen before CUDA
starts, so each runs in a process of its own, on the same seed.

Needs a CUDA build of PyTorch and a GPU; steppool from ``pip install ./runtime/torch``.
Under steppool, PyTorch's own memory statistics are not available (a pluggable allocator has
none); the figures come from ``steppool.torch.memory_reserved()`` and its siblings, whose peak
is the device's high-water mark of the pages steppool mapped plus the most its CUDA pools held, an
upper bound, exact where the pools map all their memory. So that every allocator is measured
the same way, the reserved bytes are also sampled through every step (after each block's forward
pass and after its gradient in the backward pass, after the forward and backward passes and after
the optimizer step; the sampling's time is left out of the step time): the table's "sampled"
column is the largest sample, a lower bound of the peak for every allocator, and PyTorch's own
peak where its allocator never gives memory back during the run. Under steppool the step's
release time (its boundary) and its page traffic (bytes of pages mapped and unmapped, the median
step's) are reported too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ALLOCATORS = ("native", "expandable", "async", "steppool")
ENVIRONMENTS = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "async": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "steppool": {},
}
MIB = 1 << 20


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocator", choices=ALLOCATORS + ("all",), default="all")
    parser.add_argument("--strategy", default="planned", help="steppool's strategy for step phases")
    parser.add_argument("--phase-threads", choices=("all", "current"), default="all",
                        help="which threads steppool's step phases route: all (autograd's backward threads too) "
                             "or the current one only (the backward pass then allocates in the persistent phase)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="write this run's summary as JSON here (used by --allocator all)")
    parser.add_argument("--snapshot", help="record the allocation history (segment maps and unmaps included) and write it "
                        "here as a PyTorch memory snapshot pickle, and under PyTorch's allocators the steps' start "
                        "times beside it as <stem>.json (the sidecar `steppool replay` reads); recording slows "
                        "the steps down")
    return parser.parse_args()


def run_all(args: argparse.Namespace) -> int:
    summaries: List[Dict[str, Any]] = []
    for allocator in ALLOCATORS:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
            path = out.name
        command = [sys.executable, os.path.abspath(__file__), "--allocator", allocator, "--json-out", path]
        for name in ("strategy", "phase_threads", "steps", "eval_every", "layers", "hidden", "heads", "vocab", "batch",
                     "min_len", "max_len", "seed"):
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
        print(f"\n== {allocator}", flush=True)
        result = subprocess.run(command, env={**os.environ, **ENVIRONMENTS[allocator]})
        if result.returncode == 0:
            with open(path) as file:
                summaries.append(json.load(file))
        else:
            summaries.append({"allocator": allocator, "failed": f"exit code {result.returncode}"})
        os.unlink(path)
    print()
    print(f"{'allocator':<12}{'peak reserved':>16}{'sampled':>14}{'peak allocated':>16}{'step time':>12}{'vs native':>11}  result")
    native = next((s for s in summaries if s["allocator"] == "native" and "failed" not in s), None)
    for summary in summaries:
        if "failed" in summary:
            print(f"{summary['allocator']:<12}{'':>16}{'':>14}{'':>16}{'':>12}{'':>11}  {summary['failed']}")
            continue
        relative = ""
        if native is not None and native["step_ms"] > 0:
            relative = f"{100 * (summary['step_ms'] / native['step_ms'] - 1):+.1f} %"
        print(
            f"{summary['allocator']:<12}{summary['peak_reserved'] / MIB:>12.1f} MiB{summary['sampled_reserved'] / MIB:>10.1f} MiB"
            f"{summary['peak_allocated'] / MIB:>12.1f} MiB"
            f"{summary['step_ms']:>9.2f} ms{relative:>11}  {summary['result']}"
            + (f", boundary {summary['release_ms']:.2f} ms" if summary.get("release_ms") is not None else "")
            + (f", pages {summary['page_traffic_mib']:.0f} MiB" if summary.get("page_traffic_mib") is not None else "")
        )
    print("(peak reserved under steppool: its mapped pages' high-water mark plus its CUDA pools', an upper bound; sampled: the "
          "largest sample, after each block forward and backward and after each pass, alike for all; "
          "step time: median after the first 5 steps)")
    return 0 if all("failed" not in s for s in summaries) else 1


def run_one(args: argparse.Namespace) -> int:
    # The allocator's settings must be in the environment before PyTorch reads it (as `all` runs
    # each allocator); a setting the caller made is kept.
    for name, value in ENVIRONMENTS[args.allocator].items():
        os.environ.setdefault(name, value)
    try:
        import torch
        from torch import nn
    except ImportError:
        print("torch_gpt.py needs PyTorch with CUDA: pip install torch", file=sys.stderr)
        return 2
    sp = None
    if args.allocator == "steppool":
        import steppool.torch as sp  # noqa: PLC0415 - only this allocator needs it

        sp.use(strategy=args.strategy, device="cuda")
    if not torch.cuda.is_available():
        print("torch_gpt.py needs a CUDA device", file=sys.stderr)
        return 2
    sidecar = None
    if args.snapshot:
        # Under PyTorch's allocators the snapshot's times are the system clock's, as time_ns():
        # the steps' start times go beside it for `steppool replay`. steppool's own history counts
        # from its start, on another clock: no sidecar.
        sidecar = os.path.splitext(args.snapshot)[0] + ".json" if sp is None else None
        if sidecar is not None and args.json_out and os.path.abspath(args.json_out) == os.path.abspath(sidecar):
            print(f"--json-out {args.json_out} is where the snapshot's step sidecar goes: choose another", file=sys.stderr)
            return 2
        if sp is not None:
            sp.start_recording(max_events=2_000_000)
        else:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    torch.manual_seed(args.seed)
    device = torch.device("cuda")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(args.hidden)
            self.attn = nn.MultiheadAttention(args.hidden, args.heads, batch_first=True)
            self.norm2 = nn.LayerNorm(args.hidden)
            self.mlp = nn.Sequential(nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(), nn.Linear(4 * args.hidden, args.hidden))

        def forward(self, x: Any) -> Any:
            length = x.shape[1]
            mask = torch.triu(torch.ones(length, length, device=x.device, dtype=torch.bool), diagonal=1)
            h = self.norm1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.hidden)
            self.position = nn.Embedding(args.max_len, args.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.LayerNorm(args.hidden)
            self.head = nn.Linear(args.hidden, args.vocab, bias=False)

        def forward(self, tokens: Any) -> Any:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.embed(tokens) + self.position(positions)
            for block in self.blocks:
                x = block(x)
                # Samples between blocks, forward and (on autograd's thread) backward.
                sample()
                if x.requires_grad:
                    x.register_hook(lambda _grad: sample())
            return self.head(self.norm(x))

    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(args.seed)

    def batch(length: int) -> Any:
        return torch.randint(0, args.vocab, (args.batch, length + 1), generator=generator).to(device)

    def phase(name: str) -> Any:
        if sp is None:
            return _Nothing()
        return sp.phase(name, scope="step", threads=args.phase_threads)

    def memory() -> Dict[str, int]:
        if sp is not None:
            return {"reserved": sp.memory_reserved(), "max_reserved": sp.max_memory_reserved(),
                    "allocated": sp.memory_allocated()}
        return {"reserved": torch.cuda.memory_reserved(), "max_reserved": torch.cuda.max_memory_reserved(),
                "allocated": torch.cuda.memory_allocated()}

    def reserved_now() -> int:
        return sp.memory_reserved() if sp is not None else torch.cuda.memory_reserved()

    sampled = {"peak": 0, "seconds": 0.0}

    def sample() -> None:
        began = time.perf_counter()
        sampled["peak"] = max(sampled["peak"], reserved_now())
        sampled["seconds"] += time.perf_counter() - began

    step_times: List[float] = []
    steps_start_ns: List[int] = []
    release_times: List[float] = []
    # Per step under steppool: bytes of pages mapped and unmapped (each costs time on a GPU).
    page_traffic: List[int] = []
    peak_allocated = 0
    result = f"completed {args.steps} steps"
    print(f"{'step':>5} {'kind':>5} {'len':>5} {'reserved':>12} {'max reserved':>14} {'allocated':>12} {'time':>10}  loss")
    try:
        for step in range(args.steps):
            steps_start_ns.append(time.time_ns())
            if sp is not None:
                sp.step()
                report = sp.last_step_report()
                if report is not None:
                    release_times.append(report["release_s"])
                    page_traffic.append(sum(p["pages_mapped_bytes"] + p["pages_unmapped_bytes"] for p in report["pools"]))
            evaluating = step > 0 and step % args.eval_every == 0
            length = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=generator))
            tokens = batch(length)
            torch.cuda.synchronize()
            sampled["seconds"] = 0.0
            start = time.perf_counter()
            if evaluating:
                model.eval()
                with torch.no_grad(), phase("evaluation"):
                    logits = model(tokens[:, :-1])
                    sample()
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
                    del logits
                model.train()
            else:
                with phase("activations"):
                    logits = model(tokens[:, :-1])
                    loss_tensor = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                    sample()
                    del logits
                    loss_tensor.backward()
                    sample()
                    loss = loss_tensor.item()
                    del loss_tensor
                optimizer.step()
                sample()
                optimizer.zero_grad(set_to_none=True)
            del tokens
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start - sampled["seconds"]
            if not evaluating:
                step_times.append(elapsed)
            numbers = memory()
            peak_allocated = max(peak_allocated, numbers["allocated"])
            print(f"{step:>5} {'eval' if evaluating else 'train':>5} {length:>5} {numbers['reserved'] / MIB:>8.1f} MiB"
                  f" {numbers['max_reserved'] / MIB:>10.1f} MiB {numbers['allocated'] / MIB:>8.1f} MiB"
                  f" {elapsed * 1000:>7.2f} ms  {loss:.3f}", flush=True)
            if not math.isfinite(loss):
                result = f"loss diverged at step {step}"
                break
    except torch.cuda.OutOfMemoryError as error:
        result = f"OOM at step {step}"
        if sp is not None and sp.last_failure() is not None:
            result += f" ({sp.last_failure().verdict})"
        print(f"out of memory: {error}", file=sys.stderr)
    if sp is not None:
        sp.step()
    times = sorted(step_times[5:] or step_times)
    summary = {
        "allocator": args.allocator,
        "peak_reserved": memory()["max_reserved"],
        "peak_allocated": peak_allocated,
        "step_ms": 1000 * times[len(times) // 2] if times else 0.0,
        "sampled_reserved": sampled["peak"],
        "release_ms": 1000 * sorted(release_times)[len(release_times) // 2] if release_times else None,
        "page_traffic_mib": sorted(page_traffic)[len(page_traffic) // 2] / MIB if page_traffic else None,
        "result": result,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    if sp is not None:
        # steppool's own account (per-phase pools, plan statistics, counters), for reading where
        # its memory and time went.
        summary["steppool"] = sp.telemetry()
    if args.json_out:
        with open(args.json_out, "w") as file:
            json.dump(summary, file)
    if args.snapshot:
        if sp is not None:
            sp.snapshot(args.snapshot)
        else:
            torch.cuda.memory._dump_snapshot(args.snapshot)
    if sidecar is not None:
        with open(sidecar, "w") as file:
            json.dump({"workload": "torch_gpt", "steps_start_ns": steps_start_ns, "torch": torch.__version__}, file)
    return 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


def main() -> int:
    args = parse()
    return run_all(args) if args.allocator == "all" else run_one(args)


if __name__ == "__main__":
    sys.exit(main())
