"""The shared library (``libsteppool_torch``, built from ``runtime/torch``) loaded with ctypes.

Every call goes through :class:`Native`, which declares the C signatures and turns a failed
call into the exception its last error names. The library is found beside this file (where
``pip install`` puts it), or at ``STEPPOOL_TORCH_LIBRARY``.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, Optional

from .errors import SteppoolError, from_json

LIBRARY_VARIABLE = "STEPPOOL_TORCH_LIBRARY"
_SUFFIXES = (".so", ".dylib", ".dll", ".pyd")


def library_path() -> str:
    """The path of the shared library this package loads."""
    explicit = os.environ.get(LIBRARY_VARIABLE)
    if explicit:
        if not Path(explicit).is_file():
            raise SteppoolError(f"{LIBRARY_VARIABLE}={explicit} is not a file", "library")
        return explicit
    here = Path(__file__).parent
    found = sorted(p for p in here.iterdir() if p.name.startswith("_native") and p.name.endswith(_SUFFIXES))
    if not found:
        raise SteppoolError(
            f"steppool's shared library is not installed beside {here} (reinstall with "
            f"`pip install ./runtime/torch`, or set {LIBRARY_VARIABLE})",
            "library",
        )
    return str(found[0])


class Native:
    """The library's functions with their C signatures."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        c = ctypes
        sigs = {
            "steppool_torch_init": (c.c_int, [c.c_char_p]),
            "steppool_torch_alloc": (c.c_void_p, [c.c_ssize_t, c.c_int, c.c_void_p]),
            "steppool_torch_free": (None, [c.c_void_p, c.c_ssize_t, c.c_int, c.c_void_p]),
            "steppool_torch_empty_cache": (None, []),
            "steppool_torch_release_idle": (c.c_int64, []),
            "steppool_torch_set_memory_fraction": (None, [c.c_double, c.c_int]),
            "steppool_torch_record_stream": (None, [c.c_void_p, c.c_void_p]),
            "steppool_torch_phase_enter": (c.c_int, [c.c_char_p, c.c_char_p, c.c_char_p]),
            "steppool_torch_phase_enter_all_threads": (c.c_int, [c.c_char_p, c.c_char_p, c.c_char_p]),
            "steppool_torch_phase_declare": (c.c_int, [c.c_char_p, c.c_char_p, c.c_char_p, c.c_int]),
            "steppool_torch_phase_leave": (c.c_int, []),
            "steppool_torch_current_phase": (c.c_void_p, []),
            "steppool_torch_step": (c.c_int64, []),
            "steppool_torch_end_step": (c.c_int, []),
            "steppool_torch_telemetry_json": (c.c_void_p, []),
            "steppool_torch_start_recording": (c.c_int, [c.c_uint64]),
            "steppool_torch_write_snapshot": (c.c_int, [c.c_char_p]),
            "steppool_torch_serve_metrics": (c.c_int, [c.c_char_p]),
            "steppool_torch_stop_metrics": (None, []),
            "steppool_torch_last_error_json": (c.c_void_p, []),
            "steppool_torch_string_free": (None, [c.c_void_p]),
        }
        for name, (restype, argtypes) in sigs.items():
            function = getattr(lib, name)
            function.restype = restype
            function.argtypes = argtypes
        self.lib = lib

    # ----- plumbing -------------------------------------------------------------------------

    def _string(self, pointer: Optional[int]) -> Optional[str]:
        if not pointer:
            return None
        try:
            return ctypes.string_at(pointer).decode("utf-8")
        finally:
            self.lib.steppool_torch_string_free(pointer)

    def last_error(self) -> Optional[Dict[str, Any]]:
        """The calling thread's last error as a dict, cleared by reading; None if there was none."""
        text = self._string(self.lib.steppool_torch_last_error_json())
        return None if text is None else json.loads(text)

    def _raise(self, what: str) -> None:
        error = self.last_error()
        if error is None:
            raise SteppoolError(f"{what} failed without a reason")
        raise from_json(error)

    def _check(self, code: int, what: str) -> int:
        if code < 0:
            self._raise(what)
        return code

    def _after_void(self, what: str) -> None:
        error = self.last_error()
        if error is not None:
            raise from_json(error)

    # ----- calls ----------------------------------------------------------------------------

    def init(self, config: Dict[str, Any]) -> None:
        self._check(self.lib.steppool_torch_init(json.dumps(config).encode()), "init")

    def alloc(self, size: int, device: int, stream: int) -> int:
        pointer = self.lib.steppool_torch_alloc(size, device, stream)
        if pointer:
            return int(pointer)
        error = self.last_error()
        if error is not None:
            raise from_json(error)
        return 0

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.lib.steppool_torch_free(ptr, size, device, stream)
        self._after_void("free")

    def empty_cache(self) -> int:
        return self._check(int(self.lib.steppool_torch_release_idle()), "empty_cache")

    def set_memory_fraction(self, fraction: float, device: int) -> None:
        self.lib.steppool_torch_set_memory_fraction(fraction, device)
        self._after_void("set_memory_fraction")

    def record_stream(self, ptr: int, stream: int) -> None:
        self.lib.steppool_torch_record_stream(ptr, stream)
        self._after_void("record_stream")

    def phase_enter(self, name: str, scope: str, strategy: Optional[str], all_threads: bool = False) -> None:
        encoded = None if strategy is None else strategy.encode()
        enter = self.lib.steppool_torch_phase_enter_all_threads if all_threads else self.lib.steppool_torch_phase_enter
        self._check(enter(name.encode(), scope.encode(), encoded), "phase_enter")

    def phase_declare(self, name: str, scope: str, strategy: Optional[str], carry: bool) -> None:
        encoded = None if strategy is None else strategy.encode()
        self._check(
            self.lib.steppool_torch_phase_declare(name.encode(), scope.encode(), encoded, int(carry)), "phase_declare"
        )

    def phase_leave(self) -> None:
        self._check(self.lib.steppool_torch_phase_leave(), "phase_leave")

    def current_phase(self) -> str:
        text = self._string(self.lib.steppool_torch_current_phase())
        if text is None:
            self._raise("current_phase")
        return str(text)

    def step(self) -> int:
        return self._check(int(self.lib.steppool_torch_step()), "step")

    def end_step(self) -> None:
        self._check(self.lib.steppool_torch_end_step(), "end_step")

    def telemetry(self) -> Dict[str, Any]:
        text = self._string(self.lib.steppool_torch_telemetry_json())
        if text is None:
            self._raise("telemetry")
        return json.loads(str(text))

    def start_recording(self, max_events: int) -> None:
        self._check(self.lib.steppool_torch_start_recording(max_events), "start_recording")

    def write_snapshot(self, path: str) -> None:
        self._check(self.lib.steppool_torch_write_snapshot(os.fsencode(path)), "write_snapshot")

    def serve_metrics(self, addr: str) -> int:
        return self._check(self.lib.steppool_torch_serve_metrics(addr.encode()), "serve_metrics")

    def stop_metrics(self) -> None:
        self.lib.steppool_torch_stop_metrics()


_LOCK = threading.Lock()
_NATIVE: Optional[Native] = None


def native() -> Native:
    """The loaded library, loaded on first use."""
    global _NATIVE
    with _LOCK:
        if _NATIVE is None:
            _NATIVE = Native(library_path())
        return _NATIVE
