"""Registers the Triton kernels with the dispatcher."""
from fastla.backends.triton import chunk_training, recurrent
from fastla.core import dispatch

RECURRENT_OPS = (
    "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_gla",
    "fused_recurrent_simple_gla", "fused_recurrent_lightning_attn",
)

for _op in RECURRENT_OPS:
    dispatch.register(_op, "triton", recurrent.supports)(recurrent.run)
for _op in ("chunk_gated_delta_rule", "chunk_kda", "chunk_gla", "chunk_simple_gla", "chunk_lightning_attn"):
    dispatch.register(_op, "triton", chunk_training.supports)(chunk_training.run)
