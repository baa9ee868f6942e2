"""Gated DeltaNet (GDN): ``fastla.ops.gated_delta_rule`` mirrors ``fla.ops.gated_delta_rule``."""
from fastla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule, chunk_gdn
from fastla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule, fused_recurrent_gdn
from fastla.ops.gated_delta_rule.reference import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule", "chunk_gdn",
    "fused_recurrent_gated_delta_rule", "fused_recurrent_gdn",
    "naive_chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule",
]
