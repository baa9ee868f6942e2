"""Lightning Attention: ``fastla.ops.lightning_attn`` mirrors ``fla.ops.lightning_attn``."""
from fastla.ops.lightning_attn.chunk import chunk_lightning_attn
from fastla.ops.lightning_attn.fused_recurrent import fused_recurrent_lightning_attn
from fastla.ops.lightning_attn.reference import naive_recurrent_lightning_attn

__all__ = ["chunk_lightning_attn", "fused_recurrent_lightning_attn", "naive_recurrent_lightning_attn"]
