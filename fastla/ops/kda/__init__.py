"""Kimi Delta Attention (KDA): ``fastla.ops.kda`` mirrors ``fla.ops.kda``."""
from fastla.ops.kda.chunk import chunk_kda
from fastla.ops.kda.fused_recurrent import fused_recurrent_kda
from fastla.ops.kda.reference import naive_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda"]
