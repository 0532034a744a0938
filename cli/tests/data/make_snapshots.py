"""Writes small PyTorch-memory-snapshot-shaped pickles for the reader's tests.

The layout follows torch/csrc/cuda/memory_snapshot.cpp and the `_snapshot` docstring in
torch/cuda/memory.py: a dict with `segments` and `device_traces`, one list of trace entries per
device, each entry a dict with action, addr, size, stream, time_us and frames. Run with python3;
it writes snapshot_p2.pickle, snapshot_p4.pickle and snapshot_p5.pickle (protocol 5 needs
Python 3.8+), snapshot_notime.pickle (an older PyTorch without time_us), and snapshot_late.pickle
(history recorded only after the model was built: memory allocated before shows in `segments` or
by its free), and snapshot_shared.pickle (entries sharing one frames list, as PyTorch 2.11 writes
them: the pickle refers back to the list, and from inside it to strings seen before it).
"""
import pickle

MiB = 1 << 20


def entry(action, addr, size, t, stream=0, with_time=True):
    e = {"action": action, "addr": addr, "size": size, "stream": stream,
         "frames": [{"filename": "train.py", "line": 10, "name": "forward"}]}
    if action == "oom":
        del e["addr"]
        e["device_free"] = 0
    if with_time:
        e["time_us"] = t
    return e


def trace(with_time=True):
    t = 1_000_000
    out = []

    def add(action, addr, size, stream=0):
        nonlocal t
        t += 10
        out.append(entry(action, addr, size, t, stream, with_time))

    add("segment_alloc", 0x7F0000000000, 64 * MiB)
    add("alloc", 0x7F0000000000, 8 * MiB)          # weights: never freed
    for step in range(3):
        add("alloc", 0x7F0000800000, 4 * MiB)      # activation
        add("alloc", 0x7F0000C00000, 2 * MiB, stream=0x5555)  # on a side stream
        add("free_requested", 0x7F0000C00000, 2 * MiB, stream=0x5555)
        add("free_completed", 0x7F0000C00000, 2 * MiB, stream=0x5555)
        add("free_requested", 0x7F0000800000, 4 * MiB)
        add("free_completed", 0x7F0000800000, 4 * MiB)
    add("oom", 0, 1 << 40)
    add("snapshot", 0, 0)
    return out


def snapshot(with_time=True):
    return {
        "segments": [{"device": 0, "address": 0x7F0000000000, "total_size": 64 * MiB,
                      "allocated_size": 8 * MiB, "active_size": 8 * MiB, "requested_size": 8 * MiB,
                      "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                      "is_expandable": False, "frames": [], "blocks": []}],
        "device_traces": [trace(with_time)],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
    }


def late():
    """Recorded from after the weights (8 MiB) and an optimizer buffer (4 MiB) were allocated: the
    buffer is freed in the trace, the weights are a block still allocated in `segments`, and so
    are two small blocks of a segment whose blocks carry no address (older PyTorch)."""
    t = 2_000_000
    out = []

    def add(action, addr, size):
        nonlocal t
        t += 10
        out.append(entry(action, addr, size, t))

    add("free_requested", 0x7F0000800000, 4 * MiB)
    add("free_completed", 0x7F0000800000, 4 * MiB)
    for step in range(3):
        add("alloc", 0x7F0000C00000, 2 * MiB)
        add("free_requested", 0x7F0000C00000, 2 * MiB)
        add("free_completed", 0x7F0000C00000, 2 * MiB)
    block = lambda size, state, requested=None, **more: dict(
        size=size, requested_size=size if requested is None else requested, state=state, frames=[], **more)
    large = {"device": 0, "address": 0x7F0000000000, "total_size": 64 * MiB, "stream": 0,
             "segment_type": "large", "blocks": [
                 block(8 * MiB, "active_allocated", address=0x7F0000000000),
                 block(56 * MiB, "inactive", address=0x7F0000800000)]}
    small = {"device": 0, "address": 0x7F0010000000, "total_size": 2 * MiB, "stream": 0,
             "segment_type": "small", "blocks": [
                 block(512 * 1024, "active_allocated", requested=500_000),
                 block(1024 * 1024, "inactive"),
                 block(512 * 1024, "active_allocated")]}
    return {"segments": [large, small], "device_traces": [out]}


def shared():
    """One frames list shared by every entry, holding a string the segments used first."""
    snap = snapshot()
    snap["segments"][0]["frames"] = [{"filename": "train.py", "line": 1, "name": "<module>"}]
    frames = [{"filename": "train.py", "line": 10, "name": "forward"}]
    for e in snap["device_traces"][0]:
        e["frames"] = frames
    return snap


for protocol in (2, 4, 5):
    with open(f"snapshot_p{protocol}.pickle", "wb") as f:
        pickle.dump(snapshot(), f, protocol=protocol)
with open("snapshot_notime.pickle", "wb") as f:
    pickle.dump(snapshot(with_time=False), f, protocol=4)
with open("snapshot_late.pickle", "wb") as f:
    pickle.dump(late(), f, protocol=4)
with open("snapshot_shared.pickle", "wb") as f:
    pickle.dump(shared(), f, protocol=4)
