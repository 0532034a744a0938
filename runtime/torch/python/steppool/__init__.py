"""steppool: stream-ordered GPU memory pools per phase, released at step boundaries, with
fragmentation telemetry; here as PyTorch's CUDA allocator.

``steppool.torch`` has everything: ``use()``, ``phase()``, ``step()`` and the telemetry
readers. The shared library behind it is steppool's C ABI (``runtime/torch`` in the
repository), loaded with ctypes.
"""

from . import torch
from ._library import library_path
from .errors import (
    AlreadyInitialisedError,
    CudaAlreadyInitialisedError,
    InvalidArgumentError,
    NotRecordingError,
    OutOfMemoryError,
    SteppoolError,
    TorchUnavailableError,
    UnknownPointerError,
    UseAfterReleaseError,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyInitialisedError",
    "CudaAlreadyInitialisedError",
    "InvalidArgumentError",
    "NotRecordingError",
    "OutOfMemoryError",
    "SteppoolError",
    "TorchUnavailableError",
    "UnknownPointerError",
    "UseAfterReleaseError",
    "library_path",
    "torch",
]
