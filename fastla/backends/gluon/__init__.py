"""The Hopper (sm_90) tier: Gluon kernels on the hot paths, served only where they were built
and checked (an sm_90 GPU, the Triton release whose Gluon API they use)."""
from __future__ import annotations

import functools

import torch

GLUON_TRITON = "3.6"        # Gluon's API changes between Triton minor releases


@functools.lru_cache(maxsize=None)
def _gluon_import_error() -> str | None:
    import triton

    if not triton.__version__.startswith(GLUON_TRITON + "."):
        return f"Triton {triton.__version__} (the Gluon kernels are written for {GLUON_TRITON}.x)"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError as exc:
        return f"Gluon is not importable ({exc})"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def available(device: torch.device) -> str | None:
    """None when the sm_90 Gluon kernels can run on ``device``, else the reason they cannot."""
    if device.type != "cuda":
        return f"inputs are on {device.type} (the Gluon kernels need an sm_90 GPU)"
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if (major, minor) != (9, 0):
        return f"compute capability {major}.{minor} (the Gluon kernels are built for sm_90)"
    return _gluon_import_error()
