"""``parallel_simple_gla``: FLA 0.6.0's attention-form entry point for Simple GLA.

The output is ``chunk_simple_gla``'s without an initial state (the same tiers). With
``output_attentions`` it also returns the decayed causal scores
    attn[b, h, i, j] = scale (q_i . k_j) exp(G_i - G_j)   for j <= i in the same sequence, else 0
``[B, H, T, T]`` in q's dtype, G the cumulative sum of ``g`` (FLA's ``attn``; FLA refuses them with
``cu_seqlens``, here entries across sequences are 0). The scores are formed in fp32 by row blocks
(G in fp64, each block's exponents relative to its first row), so the temporaries stay at
``B H ROWS T`` fp32 whatever T.
"""
from __future__ import annotations

import torch

from fastla.ops.simple_gla.chunk import chunk_simple_gla

ROWS = 1024   # query rows per block of the attention scores


def parallel_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    output_attentions: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
):
    r"""Simple GLA over whole sequences (no initial or final state).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: log decay ``[B, T, H]`` or None (no decay).
        scale: default ``K ** -0.5``.
        output_attentions: also return the scores ``[B, H, T, T]``.
        cu_seqlens / cu_seqlens_cpu: packed sequences (``B == 1``), as ``chunk_simple_gla``.

    Returns:
        ``(o [B, T, H, V], attn or None)``.
    """
    if not isinstance(output_attentions, bool):
        raise ValueError(f"output_attentions must be a bool, got {type(output_attentions).__name__}")
    o, _ = chunk_simple_gla(q, k, v, g=g, scale=scale, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    if not output_attentions:
        return o, None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return o, _scores(q, k, g, scale, cu_seqlens if cu_seqlens is not None else cu_seqlens_cpu)


def _scores(q, k, g, scale: float, cu_seqlens) -> torch.Tensor:
    """attn ``[B, H, T, T]`` (see the module docstring), by blocks of ROWS query rows."""
    B, T, H, _ = q.shape
    attn = q.new_empty(B, H, T, T)
    qf = q.float().transpose(1, 2)                                   # [B, H, T, K]
    kf = k.float().transpose(1, 2)
    G = g.double().cumsum(1).transpose(1, 2) if g is not None else None    # [B, H, T]
    pos = torch.arange(T, device=q.device)
    seq = None
    if cu_seqlens is not None:                                       # each token's sequence (no host sync)
        seq = torch.searchsorted(cu_seqlens.to(device=q.device, dtype=torch.int64)[1:], pos, right=True)
    for r0 in range(0, T, ROWS):
        r1 = min(r0 + ROWS, T)
        keep = pos[None, :] <= pos[r0:r1, None]                       # [rows, T] causal
        if seq is not None:
            keep = keep & (seq[None, :] == seq[r0:r1, None])
        s = scale * torch.matmul(qf[:, :, r0:r1], kf.transpose(-1, -2))     # [B, H, rows, T]
        if G is not None:
            ref = G[:, :, r0:r0 + 1]
            exponent = (G[:, :, r0:r1, None] - ref[..., None]).float() - (G[:, :, None, :] - ref[..., None]).float()
            s = s * torch.exp(exponent.masked_fill(~keep, float("-inf")))
        attn[:, :, r0:r1] = s.masked_fill(~keep, 0.0).to(attn.dtype)
    return attn
