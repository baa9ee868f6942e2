"""The portable Triton tier (any CUDA GPU; the CPU interpreter with ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> str | None:
    """None when Triton kernels can run on ``device``, else the reason they cannot."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    return f"inputs are on {device.type} (Triton kernels need CUDA, or TRITON_INTERPRET=1 on the CPU)"


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the launch plans count waves in them); 132, an
    H200's, off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in host code (Triton 3.6's ``triton.cdiv`` is a constexpr-function wrapper
    that costs a few microseconds a call, several times per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), in host code (see ``cdiv``)."""
    return 1 << (n - 1).bit_length()
