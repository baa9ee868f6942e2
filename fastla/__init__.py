"""fastla: fast linear-attention kernels with flash-linear-attention's API.

``from fla.ops.kda import chunk_kda`` becomes ``from fastla.ops.kda import chunk_kda``.
"""
from fastla import backends  # noqa: F401  (registers the tiers with the dispatcher)
from fastla.ops import (  # noqa: F401
    chunk_gated_delta_rule, chunk_gla, chunk_kda, chunk_lightning_attn, chunk_simple_gla,
    fused_recurrent_gated_delta_rule, fused_recurrent_gla, fused_recurrent_kda, fused_recurrent_lightning_attn,
    fused_recurrent_simple_gla,
)

__version__ = "0.1.0"
