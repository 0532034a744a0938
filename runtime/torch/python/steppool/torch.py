"""steppool as PyTorch's CUDA allocator.

Two ways in, both routing the current thread's allocations to a steppool phase:

- ``steppool.torch.use(strategy="planned")`` before the first CUDA tensor makes steppool the
  process's allocator (``torch.cuda.memory.CUDAPluggableAllocator`` +
  ``change_current_allocator``). Every tensor then comes from steppool: outside every phase from
  the persistent phase ``untagged``, inside ``with steppool.torch.phase("activations",
  scope="step"):`` from that phase; ``steppool.torch.step()`` marks the step boundary, which
  releases what step-scoped phases still hold. PyTorch's ``MemPool`` cannot be created under a
  pluggable allocator (its constructor asks the current allocator to create the pool, which
  ``CUDAPluggableAllocator`` does not implement), so in this mode a phase is steppool's own
  per-thread routing.
- Without ``use()``, PyTorch's own caching allocator stays, and ``phase()`` enters
  ``torch.cuda.use_mem_pool(MemPool(allocator=steppool))``: the caching allocator takes the
  segments of that pool from steppool (its ``raw_alloc`` calls steppool's ``alloc_fn`` on the
  allocating thread, which is in the phase) and carves tensors out of them. It keeps those
  segments cached across steps, so only persistent phases are allowed in this mode.

PyTorch's memory statistics (``torch.cuda.memory_reserved()`` and the others) are not available
under a pluggable allocator; :func:`memory_reserved`, :func:`max_memory_reserved` and
:func:`memory_allocated` read steppool's instead.
"""

from __future__ import annotations

import sys
import threading
import warnings as _warnings
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Dict, List, Optional, Tuple, Type

from ._library import native
from .errors import (
    CudaAlreadyInitialisedError,
    InvalidArgumentError,
    TorchUnavailableError,
)

__all__ = [
    "AllocationFailure",
    "PhaseUsage",
    "Step",
    "StepScopeWarning",
    "alloc",
    "current_phase",
    "empty_cache",
    "free",
    "init",
    "last_failure",
    "last_step_report",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "phase",
    "phases",
    "record_stream",
    "serve_metrics",
    "set_memory_fraction",
    "snapshot",
    "start_recording",
    "step",
    "stop_metrics",
    "telemetry",
    "use",
    "warnings",
]

ALLOC_FN = "steppool_torch_alloc"
FREE_FN = "steppool_torch_free"
SCOPES = ("persistent", "step", "micro_step")
THREADS = ("current", "all")
STRATEGIES = ("direct", "arena", "chunked", "planned")


class _State:
    lock = threading.Lock()
    allocator: Any = None
    pools: Dict[Tuple[str, int], Any] = {}
    # Whether the runtime serves a GPU (None: not asked yet).
    on_gpu: Optional[bool] = None
    # (device, stream) pairs whose cuBLAS workspace was made outside step-scoped phases.
    blas_ready: set = set()
    # Step-scoped phases already warned about releasing memory PyTorch still held.
    warned: set = set()


class StepScopeWarning(UserWarning):
    """A step's end released memory of a step-scoped phase that PyTorch still held: a tensor or a
    library workspace made inside the phase outlived the step, and its memory may be handed out
    again while it is in use."""


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415 - optional dependency, imported when asked for
    except ImportError as error:
        raise TorchUnavailableError(
            "steppool.torch needs PyTorch (a CUDA build, 2.5 or later): pip install torch", "torch_missing"
        ) from error
    return torch


def _check_choice(value: Optional[str], allowed: Tuple[str, ...], what: str) -> None:
    if value is not None and value not in allowed:
        raise InvalidArgumentError(f"unknown {what} {value!r}: expected one of {', '.join(allowed)}", "invalid")


def init(
    strategy: str = "planned",
    device: Optional[str] = None,
    *,
    persistent_strategy: str = "chunked",
    checked: bool = True,
    record_history: int = 0,
) -> None:
    """Initialises steppool's runtime without touching PyTorch.

    Args:
        strategy: how step-scoped phases are served: ``planned`` (offsets planned from the
            first steps), ``arena``, ``direct`` (each allocation from the CUDA pool) or
            ``chunked``.
        device: ``auto`` (the GPU when one answers, else the simulated device), ``cuda`` or
            ``sim``; None reads ``STEPPOOL_DEVICE`` (``auto`` when unset).
        persistent_strategy: how persistent phases are served (default ``chunked``).
        checked: report frees of pointers a step released as such (on by default).
        record_history: events of allocation history to keep, for :func:`snapshot` (0: off).

    Raises:
        AlreadyInitialisedError: steppool was initialised before (a first allocation
            initialises it with the defaults).
        InvalidArgumentError: an unknown strategy or device.
    """
    _check_choice(strategy, STRATEGIES, "strategy")
    _check_choice(persistent_strategy, STRATEGIES, "strategy")
    config: Dict[str, Any] = {
        "strategy": strategy,
        "persistent_strategy": persistent_strategy,
        "checked": bool(checked),
        "record_history": int(record_history),
    }
    if device is not None:
        config["device"] = device
    native().init(config)


def use(
    strategy: str = "planned",
    device: Optional[str] = None,
    *,
    persistent_strategy: str = "chunked",
    checked: bool = True,
    record_history: int = 0,
) -> None:
    """Makes steppool the process's CUDA allocator for PyTorch.

    Call it before the first CUDA tensor. The arguments are :func:`init`'s; ``device`` may be
    ``auto`` or ``cuda`` (PyTorch's kernels need a GPU's memory, so ``sim`` is refused).

    Raises:
        TorchUnavailableError: PyTorch is not installed, or has no CUDA device.
        CudaAlreadyInitialisedError: PyTorch's allocator is already in use.
    """
    if device is not None and device.strip().lower() in ("sim", "simulated"):
        raise InvalidArgumentError(
            "device='sim' cannot back PyTorch tensors (its memory is not a GPU's); the simulated "
            "device serves steppool.torch.alloc and the tests",
            "invalid",
        )
    torch = _torch()
    if not torch.cuda.is_available():
        raise TorchUnavailableError("PyTorch sees no CUDA device: steppool.torch.use() needs one", "no_cuda")
    with _State.lock:
        if _State.allocator is not None:
            return
        if torch.cuda.is_initialized():
            raise CudaAlreadyInitialisedError(
                "CUDA is already initialised in this process: call steppool.torch.use() before the "
                "first CUDA tensor or torch.cuda call",
                "cuda_initialised",
            )
        init(
            strategy,
            device,
            persistent_strategy=persistent_strategy,
            checked=checked,
            record_history=record_history,
        )
        allocator = torch.cuda.memory.CUDAPluggableAllocator(native().path, ALLOC_FN, FREE_FN)
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as error:
            raise CudaAlreadyInitialisedError(
                f"PyTorch refused to swap its allocator: {error}", "cuda_initialised"
            ) from error
        _State.allocator = allocator


def _mempool_mode() -> bool:
    """Whether phases go through ``torch.cuda.MemPool``: torch is loaded, has CUDA, steppool is
    not the process's allocator, and its runtime serves the GPU (a runtime on the simulated
    device cannot back PyTorch's tensors, so its phases are steppool's own)."""
    if _State.allocator is not None or "torch" not in sys.modules:
        return False
    torch = sys.modules["torch"]
    if not torch.cuda.is_available():
        return False
    if _State.on_gpu is None:
        _State.on_gpu = native().telemetry()["driver"] == "cuda"
    return _State.on_gpu


def _make_blas_workspace(backward: bool = False) -> None:
    """Makes the current stream's cuBLAS and cuBLASLt workspaces before a step-scoped phase is
    entered; with ``backward``, those of autograd's backward thread too.

    PyTorch allocates them on the first matrix product on a stream and keeps them for the
    process's life: made inside a step-scoped phase, the step's end would release memory cuBLAS
    goes on writing (seen on an H200 as ``CUBLAS_STATUS_EXECUTION_FAILED`` some steps later).
    Asking for the handle makes cuBLAS's (32 MiB there); a product with a bias, which PyTorch
    hands to cuBLASLt, makes cuBLASLt's (1 MiB). Both here, in the phase current outside.
    Autograd's backward thread has workspaces of its own, made by its first product: a phase
    that routes every thread would take them (seen on an H200 as ``CUBLAS_STATUS_INTERNAL_ERROR``
    in the second step's backward pass), so a small backward pass makes them first."""
    torch = _torch()
    key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
    if key not in _State.blas_ready:
        torch.cuda.current_blas_handle()
        ones = torch.ones(2, 2, device="cuda")
        torch.nn.functional.linear(ones, ones, ones[0])
        _State.blas_ready.add(key)
    if backward and key + ("backward",) not in _State.blas_ready:
        weight = torch.ones(2, 2, device="cuda", requires_grad=True)
        torch.nn.functional.linear(weight, weight, weight[0]).sum().backward()
        _State.blas_ready.add(key + ("backward",))


def _warn_about_released(report: Optional[Dict[str, Any]]) -> None:
    """Warns, once per phase, when the step that ended released memory of a step-scoped phase
    while steppool is PyTorch's allocator: PyTorch held it still (it frees every tensor it drops)."""
    if report is None:
        return
    for entry in report.get("phases", []):
        name, released = entry.get("phase"), int(entry.get("released_bytes", 0))
        if released > 0 and entry.get("scope") != "persistent" and name not in _State.warned:
            _State.warned.add(name)
            _warnings.warn(
                f"step {report.get('step')} ended while PyTorch still held {released} bytes of the "
                f"step-scoped phase {name!r}; they were released and may be handed out again while "
                "in use. Make tensors and library workspaces that outlive a step outside step-scoped "
                "phases (a warm-up step before the first steppool.torch.step(), say).",
                StepScopeWarning,
                stacklevel=3,
            )


def _mempool(name: str) -> Any:
    torch = _torch()
    device = torch.cuda.current_device()
    with _State.lock:
        key = (name, device)
        if key not in _State.pools:
            allocator = torch.cuda.memory.CUDAPluggableAllocator(native().path, ALLOC_FN, FREE_FN)
            # The pool keeps a plain pointer to the allocator: keep the allocator alive beside it.
            _State.pools[key] = (allocator, torch.cuda.MemPool(allocator=allocator.allocator()))
        return _State.pools[key][1]


class _Phase:
    """The context manager :func:`phase` returns."""

    def __init__(
        self, name: str, scope: str, strategy: Optional[str], all_threads: bool = False, carry: bool = False
    ) -> None:
        _check_choice(scope, SCOPES, "scope")
        _check_choice(strategy, STRATEGIES, "strategy")
        if carry and scope != "step":
            raise InvalidArgumentError(
                f"phase {name!r} is {scope}-scoped: only a step-scoped phase carries memory into the next step",
                "invalid",
            )
        self.name, self.scope, self.strategy, self.all_threads = name, scope, strategy, all_threads
        self.carry = carry
        self._pool_context: Any = None

    def __enter__(self) -> "_Phase":
        mempool = _mempool_mode()
        if mempool and self.scope != "persistent":
            raise InvalidArgumentError(
                f"phase {self.name!r} is {self.scope}-scoped, but steppool is not PyTorch's allocator: "
                "under torch.cuda.MemPool the caching allocator keeps steppool's segments across steps, "
                "so only persistent phases are allowed. Call steppool.torch.use() first for step scopes.",
                "invalid",
            )
        if mempool and self.all_threads:
            raise InvalidArgumentError(
                f"phase {self.name!r} with threads='all' routes other threads' allocations, which only steppool as "
                "PyTorch's allocator sees: call steppool.torch.use() first.",
                "invalid",
            )
        if _State.allocator is not None and self.scope != "persistent":
            _make_blas_workspace(backward=self.all_threads)
        if self.carry:
            native().phase_declare(self.name, self.scope, self.strategy, True)
        native().phase_enter(self.name, self.scope, self.strategy, self.all_threads)
        if mempool:
            torch = _torch()
            try:
                self._pool_context = torch.cuda.use_mem_pool(_mempool(self.name))
                self._pool_context.__enter__()
            except BaseException:
                native().phase_leave()
                raise
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        try:
            if self._pool_context is not None:
                self._pool_context.__exit__(exc_type, exc, traceback)
                self._pool_context = None
        finally:
            native().phase_leave()


def phase(
    name: str, scope: str = "persistent", strategy: Optional[str] = None, threads: str = "current", carry: bool = False
) -> _Phase:
    """Routes the current thread's allocations to the steppool phase ``name`` inside a ``with``.

    Args:
        name: the phase; built-in ones are ``weights``, ``optimizer_state`` (persistent),
            ``activations``, ``gradients``, ``workspace`` (step-scoped); any other name is
            declared on first use.
        scope: ``persistent`` (never released by a step), ``step`` (released at the next
            :func:`step` boundary: its tensors must be gone by then) or ``micro_step``.
        strategy: the phase's strategy; None takes the one :func:`init`/:func:`use` chose.
        threads: ``current`` routes the current thread only; ``all`` also routes every thread
            that has entered no phase of its own while this one is open. Autograd runs the
            backward pass of a ``loss.backward()`` on threads of its own: with ``current`` their
            allocations (gradients, the backward pass's temporaries) go to the persistent phase
            ``untagged``, with ``all`` to this phase. Use ``all`` only where no other thread
            allocates tensors that outlive the step meanwhile (a thread prefetching the next
            batch, say): a step-scoped phase's memory is released at the step's end.
        carry: for a step-scoped phase, keep what a step leaves live for the next step, whose
            end releases what is still held: the gradients of a loop that calls
            ``optimizer.zero_grad()`` at its top or between its forward and backward passes live
            from one step's backward pass into the next step. Set before the phase's first
            allocation.
    """
    _check_choice(threads, THREADS, "threads")
    return _Phase(name, scope, strategy, threads == "all", carry)


class Step:
    """A step that :func:`step` began; as a context manager it ends the step on exit."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> "Step":
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        if native().telemetry().get("active_step") == self.index:
            native().end_step()
            if _State.allocator is not None:
                _warn_about_released(last_step_report())

    def __repr__(self) -> str:
        return f"Step({self.index})"


def step() -> Step:
    """Marks the step boundary: ends the active step, if any, releasing everything its
    step-scoped phases still hold (planned phases learn from it), and begins the next.

    Call it at the top of each iteration, or use it as ``with steppool.torch.step():`` around
    one (the step then ends at the block's end). Returns the new :class:`Step`.

    Warns (:class:`StepScopeWarning`, once per phase) when the step that ended released memory
    PyTorch still held.
    """
    index = native().step()
    if _State.allocator is not None:
        _warn_about_released(last_step_report())
    return Step(index)


@dataclass(frozen=True)
class PhaseUsage:
    """One phase on one device now, and at its peaks over the current step."""

    device: int
    phase: str
    scope: str
    strategy: str
    used_bytes: int
    reserved_bytes: int
    peak_used_bytes: int
    peak_reserved_bytes: int
    reserved_unused_bytes: int
    fragmentation_ratio: float
    """``1 - peak_used / peak_reserved`` over the current step."""
    largest_free_bytes: Optional[int]
    """The largest free block inside what the phase holds, where its strategy knows it."""


@dataclass(frozen=True)
class AllocationFailure:
    """The last allocation steppool could not serve, with the reason PyTorch does not show."""

    requested_bytes: int
    device: int
    phase: str
    kind: str
    message: str
    verdict: Optional[str]
    """``fragmentation``, ``demand`` or ``limit`` for an out-of-memory failure."""
    oom: Optional[Dict[str, Any]]


def telemetry() -> Dict[str, Any]:
    """Everything steppool reports, as one dict: ``phases``, ``devices`` (free/total and
    reserved/used), ``warnings``, ``last_failure``, ``last_step`` (the last step report),
    ``counters`` of the allocator's calls, the active step and the configuration."""
    return native().telemetry()


def phases() -> List[PhaseUsage]:
    """Per phase and device: used and reserved bytes, peaks, fragmentation ratio, largest free."""
    fields = PhaseUsage.__dataclass_fields__
    return [PhaseUsage(**{k: v for k, v in p.items() if k in fields}) for p in telemetry()["phases"]]


def warnings() -> List[Dict[str, Any]]:
    """The most recent early warnings (fragmentation, scattered free space, reserved creep...)."""
    return list(telemetry()["warnings"])


def last_failure() -> Optional[AllocationFailure]:
    """The last allocation that failed, with its out-of-memory verdict; None if none failed."""
    failure = telemetry()["last_failure"]
    if failure is None:
        return None
    error = failure["error"]
    return AllocationFailure(
        requested_bytes=failure["requested_bytes"],
        device=failure["device"],
        phase=failure["phase"],
        kind=error.get("kind", "error"),
        message=error.get("message", ""),
        verdict=error.get("verdict"),
        oom=error.get("oom"),
    )


def last_step_report() -> Optional[Dict[str, Any]]:
    """The report of the last step ended (per phase peaks, releases, fragmentation, plans)."""
    return telemetry()["last_step"]


def _device_usage(device: Optional[int]) -> Dict[str, Any]:
    ordinal = 0 if device is None else int(device)
    for entry in telemetry()["devices"]:
        if entry["device"] == ordinal:
            return dict(entry)
    return {"reserved_bytes": 0, "used_bytes": 0, "reserved_high_bytes": 0, "used_high_bytes": 0, "mapped_high_bytes": 0}


def memory_reserved(device: Optional[int] = None) -> int:
    """Bytes steppool's pools hold on ``device`` (default 0): ``torch.cuda.memory_reserved()``."""
    return int(_device_usage(device)["reserved_bytes"])


def max_memory_reserved(device: Optional[int] = None) -> int:
    """The most steppool held on ``device`` at once, bounded from above: the device's own
    high-water mark of the pages mapped into its pools' address ranges, plus the most each pool's
    CUDA pool held (never above the sum of the pools' high-water marks). Exact where the pools map
    all their memory, as they do on a GPU with virtual memory management; it never understates
    (``torch.cuda.max_memory_reserved()`` is exact)."""
    return int(_device_usage(device)["reserved_high_bytes"])


def memory_allocated(device: Optional[int] = None) -> int:
    """Bytes of live allocations on ``device``: ``torch.cuda.memory_allocated()``."""
    return int(_device_usage(device)["used_bytes"])


def start_recording(max_events: int = 100_000) -> None:
    """Starts recording the allocation history (keeping the most recent ``max_events``)."""
    native().start_recording(int(max_events))


def snapshot(path: str) -> None:
    """Writes the recorded history as a PyTorch memory snapshot pickle, for
    ``python -m torch.cuda._memory_viz trace_plot PATH`` or pytorch.org/memory_viz.

    Raises:
        NotRecordingError: nothing was recorded (pass ``record_history`` or call
            :func:`start_recording` first).
    """
    native().write_snapshot(str(path))


def serve_metrics(addr: str = "127.0.0.1:9400") -> int:
    """Serves Prometheus metrics at ``GET /metrics`` on ``addr`` (port 0: any free port) from a
    thread of the library; returns the port."""
    return native().serve_metrics(addr)


def stop_metrics() -> None:
    """Stops the metrics server."""
    native().stop_metrics()


def empty_cache() -> int:
    """Gives back what steppool's pools hold without live data (``torch.cuda.empty_cache()``
    does not reach a pluggable allocator); returns the bytes released."""
    return native().empty_cache()


def set_memory_fraction(fraction: float, device: int = 0) -> None:
    """Fails allocations on ``device`` once steppool's pools would reserve more than
    ``fraction`` (0 to 1) of its memory, as ``torch.cuda.set_per_process_memory_fraction``."""
    native().set_memory_fraction(float(fraction), int(device))


def _pointer(value: Any) -> int:
    if isinstance(value, int):
        return value
    storage = getattr(value, "untyped_storage", None)
    if storage is not None:
        return int(storage().data_ptr())
    raise InvalidArgumentError(f"expected a tensor or a pointer, got {type(value).__name__}", "invalid")


def _stream(value: Any) -> int:
    if isinstance(value, int):
        return value
    handle = getattr(value, "cuda_stream", None)
    if handle is None:
        raise InvalidArgumentError(f"expected a stream or a handle, got {type(value).__name__}", "invalid")
    return int(handle)


def record_stream(tensor: Any, stream: Any) -> None:
    """Work on ``stream`` uses ``tensor`` (or a pointer): its free waits for that work.
    ``Tensor.record_stream`` does not reach a pluggable allocator; call this instead."""
    native().record_stream(_pointer(tensor), _stream(stream))


def alloc(size: int, device: int = 0, stream: Any = 0) -> int:
    """Allocates ``size`` bytes in the current thread's phase, as PyTorch's ``alloc_fn`` does;
    returns the device pointer (0 for zero bytes). For frameworks other than PyTorch, and tests.

    Raises:
        OutOfMemoryError: with ``requested_bytes`` and the ``verdict``.
        InvalidArgumentError: a negative size, an unknown device.
    """
    return native().alloc(int(size), int(device), _stream(stream))


def free(ptr: int, size: int, device: int = 0, stream: Any = 0) -> None:
    """Frees ``ptr`` (allocated with ``size`` bytes), as PyTorch's ``free_fn`` does. 0 is
    ignored.

    Raises:
        UnknownPointerError: a pointer steppool does not hold (UseAfterReleaseError: one a step
            released).
        InvalidArgumentError: a size other than the allocated one (nothing is freed).
    """
    native().free(int(ptr), int(size), int(device), _stream(stream))


def current_phase() -> str:
    """The phase the current thread's allocations go to now."""
    return native().current_phase()

