"""Times the driver's virtual-memory calls on this GPU, per call, for handles of 2, 32 and 512 MiB:
what a page steppool maps into a range that grows in place costs (create, map, grant access,
unmap, release), and what mapping the same handles at another address costs.

    python3 benches/peers/vmm_cost.py      # needs a CUDA build of PyTorch (for the context) and a GPU

Prints one JSON object: per handle size, microseconds per call (`set_access_range`: one call over
all the handles of a round).
"""
import ctypes, json, sys, time
import torch
torch.cuda.init(); torch.zeros(1, device="cuda")
cu = ctypes.CDLL("libcuda.so.1")
u64 = ctypes.c_uint64
class Loc(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class Prop(ctypes.Structure): _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc), ("meta", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]
class Access(ctypes.Structure): _fields_ = [("loc", Loc), ("flags", ctypes.c_int)]
def ok(r, what):
    if r != 0: raise SystemExit(f"{what}: CUresult {r}")
prop = Prop(1, 0, Loc(1, 0), None)
acc = Access(Loc(1, 0), 3)
for f in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"):
    getattr(cu, f).restype = ctypes.c_int
out = {}
for page_mib, n in ((2, 256), (32, 16), (512, 1)):
    size = page_mib << 20
    base = u64(); ok(cu.cuMemAddressReserve(ctypes.byref(base), u64(size * n * 2), u64(0), u64(0), u64(0)), "reserve")
    t = {}
    def timed(name, fn):
        s = time.perf_counter(); fn(); t[name] = t.get(name, 0.0) + time.perf_counter() - s
    for rnd in range(3):
        handles = []
        def create():
            for _ in range(n):
                h = u64(); ok(cu.cuMemCreate(ctypes.byref(h), u64(size), ctypes.byref(prop), u64(0)), "create"); handles.append(h)
        timed("create", create)
        timed("map", lambda: [ok(cu.cuMemMap(u64(base.value + i * size), u64(size), u64(0), h, u64(0)), "map") for i, h in enumerate(handles)])
        timed("set_access_each", lambda: [ok(cu.cuMemSetAccess(u64(base.value + i * size), u64(size), ctypes.byref(acc), u64(1)), "access") for i in range(n)])
        timed("unmap", lambda: [ok(cu.cuMemUnmap(u64(base.value + i * size), u64(size)), "unmap") for i in range(n)])
        # The same handles mapped again elsewhere: what moving a page between ranges costs.
        other = base.value + n * size
        timed("remap", lambda: [ok(cu.cuMemMap(u64(other + i * size), u64(size), u64(0), h, u64(0)), "remap") for i, h in enumerate(handles)])
        timed("set_access_range", lambda: ok(cu.cuMemSetAccess(u64(other), u64(size * n), ctypes.byref(acc), u64(1)), "access"))
        timed("unmap2", lambda: [ok(cu.cuMemUnmap(u64(other + i * size), u64(size)), "unmap") for i in range(n)])
        timed("release", lambda: [ok(cu.cuMemRelease(h), "release") for h in handles])
    calls = 3 * n
    out[f"{page_mib}MiB"] = {k: round(v / (3 if k == "set_access_range" else calls) * 1e6, 2) for k, v in t.items()}
    out[f"{page_mib}MiB"]["pages"] = n
print(json.dumps(out))
