"""Exceptions of the steppool package: each carries the numbers of the failure as attributes."""

from __future__ import annotations

from typing import Any, Dict, Optional


class SteppoolError(Exception):
    """A call into steppool failed.

    Attributes:
        kind: the failure's kind, as the library names it (``"bad_size"``, ``"out_of_memory"``...).
        details: every field the library gave, numbers included.
    """

    def __init__(self, message: str, kind: str = "error", details: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.details: Dict[str, Any] = dict(details or {})

    @property
    def message(self) -> str:
        """The library's message."""
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(SteppoolError, ValueError):
    """A size, device, scope, strategy or configuration steppool refuses."""


class OutOfMemoryError(SteppoolError, MemoryError):
    """An allocation could not be served.

    Attributes:
        requested_bytes: what was asked for.
        verdict: ``"fragmentation"`` (enough reserved-but-unused memory existed, in pieces the
            request could not use), ``"demand"`` (live data really needs it) or ``"limit"`` (a
            memory fraction refused it).
        oom: the whole out-of-memory report (device free/total, per-pool reserved/used), or None.
    """

    @property
    def requested_bytes(self) -> Optional[int]:
        """Bytes requested."""
        return self.details.get("requested_bytes")

    @property
    def verdict(self) -> Optional[str]:
        """``fragmentation``, ``demand`` or ``limit``."""
        return self.details.get("verdict")

    @property
    def oom(self) -> Optional[Dict[str, Any]]:
        """The runtime's out-of-memory report, when there is one."""
        return self.details.get("oom")


class UnknownPointerError(SteppoolError):
    """A pointer steppool does not hold (never allocated here, or already freed)."""

    @property
    def ptr(self) -> Optional[int]:
        """The pointer."""
        return self.details.get("ptr")


class UseAfterReleaseError(UnknownPointerError):
    """A pointer a step boundary released was freed or used again: its tensor outlived its step."""

    @property
    def step(self) -> Optional[int]:
        """The step whose end released it."""
        return self.details.get("step")

    @property
    def phase(self) -> Optional[str]:
        """The pointer's phase."""
        return self.details.get("phase")


class AlreadyInitialisedError(SteppoolError):
    """steppool's runtime was initialised before (by ``init``/``use`` or a first allocation)."""


class CudaAlreadyInitialisedError(SteppoolError):
    """PyTorch's CUDA allocator is already in use: ``use()`` must run before the first CUDA tensor."""


class TorchUnavailableError(SteppoolError, ImportError):
    """PyTorch, or a CUDA build of it, is not installed."""


class NotRecordingError(SteppoolError):
    """A snapshot was asked for, but no allocation history was recorded."""


_BY_KIND = {
    "bad_size": InvalidArgumentError,
    "size_mismatch": InvalidArgumentError,
    "bad_device": InvalidArgumentError,
    "invalid": InvalidArgumentError,
    "out_of_memory": OutOfMemoryError,
    "unknown_pointer": UnknownPointerError,
    "use_after_release": UseAfterReleaseError,
    "already_initialised": AlreadyInitialisedError,
    "not_recording": NotRecordingError,
}


def from_json(error: Dict[str, Any]) -> SteppoolError:
    """The exception for an error object of the library (``kind``, ``message`` and fields)."""
    kind = str(error.get("kind", "error"))
    details = {key: value for key, value in error.items() if key not in ("kind", "message")}
    return _BY_KIND.get(kind, SteppoolError)(str(error.get("message", kind)), kind, details)
