#!/usr/bin/env python3
"""steppool's peer harness: the allocators users run today, measured on the same GPU, in the
same run, on the same sequences as steppool's Rust benchmarks.

Peers (each in a process of its own, so that one's cached memory never counts against another):

  driver_pool       the bare driver pool from Python: cudaMallocFromPoolAsync / cudaFreeAsync on
                    the device's default pool with the release threshold raised (CuPy's runtime
                    bindings). Python rows are divided by it, so the interpreter's cost cancels.
  torch_native      PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)
  torch_expandable  the same with expandable_segments:True
  torch_async       PyTorch's backend:cudaMallocAsync
  cupy_pool         cupy.cuda.MemoryPool
  cupy_async        cupy.cuda.MemoryAsyncPool
  rmm_pool          rmm.mr.PoolMemoryResource over CudaMemoryResource (initial size 0: grows on demand)
  rmm_arena         rmm.mr.ArenaMemoryResource over CudaMemoryResource (RMM's default arena size)
  rmm_async         rmm.mr.CudaAsyncMemoryResource

What is measured, in the records schema of benches/src/record.rs (one JSON object per line):
  - latency: one allocation and its free, ns per pair, for the sizes in SEQUENCES/latency.json;
  - fragmentation: every SEQUENCES/<name>.json replayed by allocation id, with the device's
    footprint (cudaMemGetInfo: total - free, above what was in use before) sampled after each
    allocation: peak_reserved_bytes, as the Rust side measures it; where the allocator counts
    its own reservation, that peak too (peak_reserved_allocator_bytes).
A peer whose package is missing, or that fails, is recorded as skipped with the reason.

Usage:
  peers.py --sequences DIR --out FILE [--smoke] [--peers a,b]   measure (needs a GPU)
  peers.py --dry-run --out FILE                                 record every peer as not measured
  peers.py --self-test                                          check the records schema
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PEERS = {
    "driver_pool": ("cupy", {}),
    "torch_native": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": ""}),
    "torch_expandable": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "torch_async": ("torch", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    "cupy_pool": ("cupy", {}),
    "cupy_async": ("cupy", {}),
    "rmm_pool": ("rmm", {}),
    "rmm_arena": ("rmm", {}),
    "rmm_async": ("rmm", {}),
}

RECORD_KEYS = {"line", "bench", "allocator", "metric", "value", "source"}
OPTIONAL_RECORD_KEYS = {"workload", "param"}


def record(bench, allocator, metric, value, workload=None, param=None):
    line = {"line": "record", "bench": bench, "allocator": allocator}
    if workload is not None:
        line["workload"] = workload
    if param is not None:
        line["param"] = int(param)
    line.update({"metric": metric, "value": float(value), "source": "python"})
    return line


def skipped(allocator, reason):
    return {"line": "skipped", "allocator": allocator, "reason": reason, "source": "python"}


def validate(line):
    """Raises ValueError unless `line` fits the records schema the Rust report reads."""
    kind = line.get("line")
    if kind == "record":
        keys = set(line)
        if not RECORD_KEYS <= keys or keys - RECORD_KEYS - OPTIONAL_RECORD_KEYS:
            raise ValueError(f"record keys {sorted(keys)}")
        if not all(isinstance(line[k], str) for k in ("bench", "allocator", "metric", "source")):
            raise ValueError("bench, allocator, metric and source are strings")
        if not isinstance(line["value"], float) or line["value"] != line["value"]:
            raise ValueError("value is a number")
        if "param" in line and not (isinstance(line["param"], int) and line["param"] >= 0):
            raise ValueError("param is a non-negative integer")
        if "workload" in line and not isinstance(line["workload"], str):
            raise ValueError("workload is a string")
    elif kind == "skipped":
        if set(line) != {"line", "allocator", "reason", "source"}:
            raise ValueError(f"skipped keys {sorted(line)}")
    elif kind == "device":
        need = {"name", "kind", "driver", "total_memory", "host"}
        if not need <= set(line) or not {"cpu", "threads", "os"} <= set(line["host"]):
            raise ValueError(f"device keys {sorted(line)}")
    else:
        raise ValueError(f"unknown line kind {kind!r}")
    return line


def host():
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for text in f:
                if text.startswith("model name"):
                    cpu = text.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "threads": os.cpu_count() or 1, "os": f"{platform.system().lower()} {platform.machine()}"}


# ----- the peers, inside their own process ---------------------------------------------------


class Peer:
    """alloc(nbytes) -> handle, free(handle), sync(), used() -> device bytes in use,
    own_reserved() -> the allocator's own count of reserved bytes, or None."""

    def own_reserved(self):
        return None

    def release_cached(self):
        """Gives back what the allocator caches, so each replay starts from an empty cache."""


class Torch(Peer):
    def __init__(self, name):
        import torch

        self.torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self.device = torch.device("cuda", 0)
        torch.cuda.init()
        self.package = f"torch {torch.__version__}, CUDA {torch.version.cuda}, backend {torch.cuda.get_allocator_backend()}"
        self.name = torch.cuda.get_device_name(0)
        self.total = torch.cuda.get_device_properties(0).total_memory

    def alloc(self, nbytes):
        return self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device=self.device)

    def free(self, handle):
        del handle

    def sync(self):
        self.torch.cuda.synchronize()

    def used(self):
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def own_reserved(self):
        return self.torch.cuda.memory_reserved()

    def release_cached(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()


class Cupy(Peer):
    def __init__(self, name):
        import cupy

        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        if name == "cupy_pool":
            self.pool = cupy.cuda.MemoryPool()
            self.alloc = self.pool.malloc
        elif name == "cupy_async":
            self.pool = cupy.cuda.MemoryAsyncPool()
            self.alloc = self.pool.malloc
        else:  # driver_pool
            self.pool = None
            self.handle = self.rt.deviceGetDefaultMemPool(0)
            self.rt.memPoolSetAttribute(self.handle, self.rt.cudaMemPoolAttrReleaseThreshold, 2**64 - 1)
            self.alloc = self.driver_alloc
            self.free = self.driver_free
        props = self.rt.getDeviceProperties(0)
        name = props["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.total = int(props["totalGlobalMem"])
        self.package = f"cupy {cupy.__version__}, CUDA runtime {self.rt.runtimeGetVersion()}"

    def driver_alloc(self, nbytes):
        return self.rt.mallocFromPoolAsync(max(nbytes, 1), self.handle, self.stream.ptr)

    def driver_free(self, ptr):
        self.rt.freeAsync(ptr, self.stream.ptr)

    def free(self, handle):
        del handle

    def sync(self):
        self.stream.synchronize()

    def used(self):
        free, total = self.rt.memGetInfo()
        return total - free

    def own_reserved(self):
        return self.pool.total_bytes() if self.pool is not None else None

    def release_cached(self):
        self.stream.synchronize()
        if self.pool is not None:
            self.pool.free_all_blocks()
        else:
            self.rt.memPoolTrimTo(self.handle, 0)


class Rmm(Peer):
    def __init__(self, name):
        import rmm

        self.rmm = rmm
        self.kind = name
        self.mr = self.fresh_resource()
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart
        self.cudart = cudart
        err, props = cudart.cudaGetDeviceProperties(0)
        name = props.name
        self.name = name.decode().rstrip("\0") if isinstance(name, bytes) else str(name)
        self.total = int(props.totalGlobalMem)
        self.package = f"rmm {rmm.__version__}"

    def fresh_resource(self):
        """A new resource of this peer's kind, made current: RMM's pools cannot be emptied."""
        rmm = self.rmm
        upstream = rmm.mr.CudaMemoryResource()
        if self.kind == "rmm_pool":
            mr = rmm.mr.PoolMemoryResource(upstream, initial_pool_size=0)
        elif self.kind == "rmm_arena":
            mr = rmm.mr.ArenaMemoryResource(upstream)
        else:
            mr = rmm.mr.CudaAsyncMemoryResource()
        rmm.mr.set_current_device_resource(mr)
        return mr

    def release_cached(self):
        self.sync()
        self.mr = None
        self.mr = self.fresh_resource()
        self.sync()

    def alloc(self, nbytes):
        return self.rmm.DeviceBuffer(size=max(nbytes, 1))

    def free(self, handle):
        del handle

    def sync(self):
        self.cudart.cudaDeviceSynchronize()

    def used(self):
        err, free, total = self.cudart.cudaMemGetInfo()
        return total - free


def make_peer(name):
    package = PEERS[name][0]
    return {"torch": Torch, "cupy": Cupy, "rmm": Rmm}[package](name)


def latency(peer, name, sizes, smoke, emit):
    pairs = 200 if smoke else 20000
    for size in sizes:
        for _ in range(min(pairs, 100)):
            peer.free(peer.alloc(size))
        samples = []
        for _ in range(3 if smoke else 7):
            start = time.perf_counter_ns()
            for _ in range(pairs):
                peer.free(peer.alloc(size))
            samples.append((time.perf_counter_ns() - start) / pairs)
        peer.sync()
        emit(record("latency", name, "ns", statistics.median(samples), param=size))


def replay(peer, name, sequence, emit):
    ops = sequence["ops"]
    live = {}
    # Every replay starts from an empty cache, as the Rust side's fresh allocators do: what
    # the latency sweep or an earlier sequence left cached would hide this sequence's growth.
    peer.release_cached()
    peer.sync()
    baseline = peer.used()
    own_baseline = peer.own_reserved() or 0
    peak = 0
    own_peak = 0
    for op in ops:
        kind = op["op"]
        if kind == "alloc":
            live[op["id"]] = peer.alloc(op["bytes"])
            peak = max(peak, peer.used() - baseline)
            own = peer.own_reserved()
            if own is not None:
                own_peak = max(own_peak, own - own_baseline)
        elif kind == "free":
            peer.free(live.pop(op["id"]))
        elif kind == "step":
            peer.sync()
    for handle in list(live.values()):
        peer.free(handle)
    live.clear()
    peer.sync()
    emit(record("fragmentation", name, "peak_reserved_bytes", peak, workload=sequence["name"]))
    if peer.own_reserved() is not None:
        emit(record("fragmentation", name, "peak_reserved_allocator_bytes", own_peak, workload=sequence["name"]))


def child(name, sequences_dir, smoke):
    """Measures one peer; prints its records on stdout."""

    def emit(line):
        print(json.dumps(validate(line)), flush=True)

    peer = make_peer(name)
    emit(
        {
            "line": "device",
            "name": peer.name,
            "kind": "gpu",
            "driver": f"python: {peer.package}",
            "driver_version": "",
            "total_memory": peer.total,
            "host": host(),
        }
    )
    with open(os.path.join(sequences_dir, "latency.json")) as f:
        plan = json.load(f)
    latency(peer, name, plan["sizes"], smoke, emit)
    for sequence_name in plan["sequences"]:
        with open(os.path.join(sequences_dir, f"{sequence_name}.json")) as f:
            sequence = json.load(f)
        replay(peer, name, sequence, emit)


# ----- the parent --------------------------------------------------------------------------


def missing_package(package):
    return importlib.util.find_spec(package) is None


def run(args):
    names = args.peers.split(",") if args.peers else list(PEERS)
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        sys.exit(f"peers.py: unknown peers {unknown}; known: {', '.join(PEERS)}")
    lines = []
    for name in names:
        package, env = PEERS[name]
        if args.dry_run:
            lines.append(skipped(name, "dry run: not measured"))
            continue
        if missing_package(package):
            lines.append(skipped(name, f"package {package} is not installed"))
            continue
        command = [sys.executable, os.path.abspath(__file__), "--child", name, "--sequences", args.sequences]
        if args.smoke:
            command.append("--smoke")
        environment = dict(os.environ, **env)
        if environment.get("PYTORCH_CUDA_ALLOC_CONF") == "":
            del environment["PYTORCH_CUDA_ALLOC_CONF"]
        print(f"peers.py: measuring {name}", file=sys.stderr, flush=True)
        done = subprocess.run(command, env=environment, capture_output=True, text=True)
        measured = []
        for text in done.stdout.splitlines():
            try:
                measured.append(validate(json.loads(text)))
            except (ValueError, json.JSONDecodeError) as error:
                print(f"peers.py: {name}: dropped an unreadable line ({error}): {text[:200]}", file=sys.stderr)
        lines.extend(measured)
        if done.returncode != 0:
            tail = [t for t in done.stderr.strip().splitlines() if t.strip()]
            reason = tail[-1] if tail else f"exit status {done.returncode}"
            lines.append(skipped(name, f"failed after {len(measured)} lines: {reason}"[:500]))
            print(done.stderr, file=sys.stderr)
    with open(args.out, "w") as f:
        for line in lines:
            f.write(json.dumps(validate(line)) + "\n")
    for line in lines:
        if line["line"] == "skipped":
            print(f"peers.py: skipped {line['allocator']}: {line['reason']}", file=sys.stderr)
    print(f"peers.py: wrote {len(lines)} lines to {args.out}", file=sys.stderr)


def self_test():
    """Checks the schema: a dry run's output and sample records validate; bad lines do not."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peers.jsonl")
        run(argparse.Namespace(peers=None, dry_run=True, out=out, sequences=tmp, smoke=True))
        with open(out) as f:
            lines = [validate(json.loads(t)) for t in f]
    assert [line["allocator"] for line in lines] == list(PEERS), lines
    validate(record("latency", "torch_native", "ns", 2150, param=4096))
    validate(record("fragmentation", "cupy_pool", "peak_reserved_bytes", 1 << 30, workload="t5"))
    for bad in (
        {"line": "record", "bench": "latency"},
        dict(record("latency", "x", "ns", 1.0), value="fast"),
        dict(record("latency", "x", "ns", 1.0), extra=1),
        {"line": "gossip"},
    ):
        try:
            validate(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
    print("peers.py: self-test passed", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for details.")
    parser.add_argument("--sequences", help="folder written by `steppool-bench-report export-sequences`")
    parser.add_argument("--out", help="records file to write (JSON lines)")
    parser.add_argument("--smoke", action="store_true", help="few pairs per size (the sequences decide the rest)")
    parser.add_argument("--peers", help=f"comma-separated subset of: {', '.join(PEERS)}")
    parser.add_argument("--dry-run", action="store_true", help="import nothing; record every peer as not measured")
    parser.add_argument("--self-test", action="store_true", help="check the records schema and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.self_test:
        self_test()
    elif args.child:
        child(args.child, args.sequences, args.smoke)
    else:
        if not args.out or not (args.sequences or args.dry_run):
            parser.error("--out and --sequences (or --dry-run) are required")
        run(args)


if __name__ == "__main__":
    main()
