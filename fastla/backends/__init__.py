"""Tiers that serve the public ops; importing this registers them with :mod:`fastla.core.dispatch`."""
from fastla.backends.torch import tier as _torch_tier  # noqa: F401
