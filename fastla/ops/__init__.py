"""Public ops, with the module paths of ``fla.ops``: ``fla.ops.<op>`` becomes ``fastla.ops.<op>``."""
from fastla.ops.gated_delta_rule import (
    chunk_gated_delta_rule, chunk_gdn, fused_recurrent_gated_delta_rule, fused_recurrent_gdn,
)
from fastla.ops.gla import chunk_gla, fused_chunk_gla, fused_recurrent_gla
from fastla.ops.kda import chunk_kda, fused_recurrent_kda
from fastla.ops.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn
from fastla.ops.simple_gla import (
    chunk_simple_gla, fused_chunk_simple_gla, fused_recurrent_simple_gla, parallel_simple_gla,
)

__all__ = [
    "chunk_gated_delta_rule", "chunk_gdn", "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_gla", "fused_chunk_gla", "fused_recurrent_gla",
    "chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla", "parallel_simple_gla",
    "chunk_lightning_attn", "fused_recurrent_lightning_attn",
]
