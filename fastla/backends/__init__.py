"""Tiers that serve the public ops; importing this registers them with :mod:`fastla.core.dispatch`."""
import importlib.util
import logging

from fastla.backends.torch import tier as _torch_tier  # noqa: F401

if importlib.util.find_spec("triton") is not None:
    from fastla.backends.triton import tier as _triton_tier  # noqa: F401
    from fastla.backends.gluon import tier as _gluon_tier  # noqa: F401
else:
    logging.getLogger("fastla").info("fastla: triton is not installed; the triton tier is unavailable")
