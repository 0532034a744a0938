"""Writes profiler_schedule.pt.trace.json.gz, a PyTorch profiler trace for the reader's tests.

A two-layer MLP trained with AdamW for six iterations on the CPU under
``torch.profiler.profile(profile_memory=True, schedule=schedule(wait=1, warmup=1, active=3))``,
``prof.step()`` after each iteration, exported by ``tensorboard_trace_handler(use_gzip=True)``
as users export it: the three active iterations are ``ProfilerStep#N`` ranges, and the memory
the skipped iterations and the model's construction allocated is never shown. Needs torch
(``pip install -r benches/traces/requirements.txt``); run from this folder.
"""
import glob
import os
import shutil
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
opt = torch.optim.AdamW(model.parameters())
out = tempfile.mkdtemp()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
             schedule=schedule(wait=1, warmup=1, active=3),
             on_trace_ready=tensorboard_trace_handler(out, use_gzip=True)) as prof:
    for _ in range(6):
        x = torch.randn(32, 64)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        prof.step()
(written,) = glob.glob(os.path.join(out, "*.pt.trace.json.gz"))
shutil.move(written, "profiler_schedule.pt.trace.json.gz")
shutil.rmtree(out)
