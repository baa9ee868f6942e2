"""Registers the Gluon (sm_90) kernels with the dispatcher."""
from fastla.backends.gluon import chunk_delta, recurrent
from fastla.backends.triton.tier import RECURRENT_OPS
from fastla.core import dispatch

for _op in ("chunk_gated_delta_rule", "chunk_kda", "chunk_gla", "chunk_simple_gla", "chunk_lightning_attn"):
    dispatch.register(_op, "gluon", chunk_delta.supports)(chunk_delta.run)
for _op in RECURRENT_OPS:
    dispatch.register(_op, "gluon", recurrent.supports)(recurrent.run)
