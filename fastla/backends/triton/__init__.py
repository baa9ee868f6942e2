"""The portable Triton tier (any CUDA GPU; the CPU interpreter with ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

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
