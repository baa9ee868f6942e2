"""``fused_chunk_gla``: removed from FLA (0.6.0 keeps the name and raises); kept here for imports."""
from __future__ import annotations


def fused_chunk_gla(**kwargs):
    """Raises NotImplementedError, as FLA 0.6.0 does: use ``chunk_gla``."""
    raise NotImplementedError("fused_chunk_gla is deprecated (FLA 0.6.0 raises too): use chunk_gla")
