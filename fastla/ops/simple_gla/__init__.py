"""Simple GLA (scalar decay): ``fastla.ops.simple_gla`` mirrors ``fla.ops.simple_gla``."""
from fastla.ops.simple_gla.chunk import chunk_simple_gla
from fastla.ops.simple_gla.fused_chunk import fused_chunk_simple_gla
from fastla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
from fastla.ops.simple_gla.parallel import parallel_simple_gla
from fastla.ops.simple_gla.reference import naive_recurrent_simple_gla

__all__ = ["chunk_simple_gla", "fused_chunk_simple_gla", "fused_recurrent_simple_gla", "parallel_simple_gla",
           "naive_recurrent_simple_gla"]
