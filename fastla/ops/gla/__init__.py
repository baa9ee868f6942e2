"""Gated Linear Attention (GLA): ``fastla.ops.gla`` mirrors ``fla.ops.gla``."""
from fastla.ops.gla.chunk import chunk_gla
from fastla.ops.gla.fused_chunk import fused_chunk_gla
from fastla.ops.gla.fused_recurrent import fused_recurrent_gla
from fastla.ops.gla.reference import naive_recurrent_gla

__all__ = ["chunk_gla", "fused_chunk_gla", "fused_recurrent_gla", "naive_recurrent_gla"]
