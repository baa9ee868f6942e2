"""Registers the Gluon (sm_90) kernels with the dispatcher."""
from fastla.backends.gluon import chunk_delta
from fastla.core import dispatch

for _op in ("chunk_gated_delta_rule", "chunk_kda"):
    dispatch.register(_op, "gluon", chunk_delta.supports)(chunk_delta.run)
