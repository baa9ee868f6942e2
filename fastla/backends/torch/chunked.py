"""The chunked linear-attention scan in plain PyTorch: one engine for GLA, Simple GLA,
Lightning, GDN and KDA.

Inputs (already activated, l2-normalised, GVA-expanded and padded to ``[N, L, ...]``,
float32 or float64):

    q, k   [N, L, H, K]        v      [N, L, H, V]
    g      [N, L, H]           scalar log decay (GDN, Simple GLA), or None
    gk     [N, L, H, K]        per-key-channel log decay (GLA, KDA), or None
    gv     [N, L, H, V]        per-value-channel log decay (recurrent GLA/GDN only; chunk_size 1)
    beta   [N, L, H]           delta-rule strength; None selects the plain (non-delta) rule
    h0     [N, H, K, V]        initial state (K-first), or None

Per chunk of C tokens, with ``G`` the inclusive in-chunk cumsum of the log decay and
``Gamma_ij = exp(G_i - G_j)`` (``i >= j``, always <= 1, so strong decay never overflows):

    Aqk = scale * causal(Gamma * Q K^T)                 (per channel for gk)
    delta rule:  Tm = I + diag(beta) strict(Gamma * K K^T)
                 U = Tm^-1 diag(beta) V,  W = Tm^-1 diag(beta) (exp(G) * K)
                 V_new = U - W S_c
    plain rule:  V_new = V
    O = scale * (exp(G) * Q) S_c + Aqk V_new
    S_{c+1} = exp(G_C) * S_c + (exp(G_C - G) * K)^T V_new

Everything parallel over chunks is computed for all chunks at once; only the state
scan loops, once per chunk (never per token). Differentiable through autograd.
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

# Sub-chunk rows of the per-channel score factorisation (see _channel_scores_block).
_SUB = 16
# Per-channel decayed scores materialise [.., C, C, K]; bound that buffer per step.
_PER_CHANNEL_SCORE_BYTES = 256 * 1024 * 1024


def _to_chunks(x: torch.Tensor, NT: int, C: int) -> torch.Tensor:
    """``[N, L, H, *d]`` -> ``[N, H, NT, C, *d]``, zero padded to ``NT * C`` tokens."""
    N, L, H = x.shape[:3]
    pad = NT * C - L
    if pad:
        x = torch.cat([x, x.new_zeros(N, pad, *x.shape[2:])], dim=1)
    x = x.reshape(N, NT, C, H, *x.shape[3:])
    return x.movedim(3, 1)


def _causal_mask(C: int, strict: bool, device) -> torch.Tensor:
    i = torch.arange(C, device=device)
    return (i[None, :] < i[:, None]) if strict else (i[None, :] <= i[:, None])


def _channel_scores_block(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """Per-channel decayed scores of whole chunks, exact for any decay strength.

    The chunk splits into sub-chunks of ``_SUB`` rows. Row block ``p`` against every
    earlier column goes through one matmul, factored around ``r``, the first row of ``p``:
    ``exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)`` with ``i >= r > j``, both factors
    <= 1. The diagonal blocks (``i, j`` in the same sub-chunk) are formed element-wise.
    a, b, G: [M, C, K] -> [M, C, C].
    """
    M, C, K = a.shape
    S = _SUB if C % _SUB == 0 else C
    ns = C // S
    Gs = G.view(M, ns, S, K)
    ref = Gs[:, :, :1, :]                                                   # [M, ns, 1, K]
    a_rows = a.view(M, ns, S, K) * (Gs - ref).exp()                         # [M, ns, S, K]
    before = torch.arange(C, device=a.device)[None, :] < (torch.arange(ns, device=a.device) * S)[:, None]
    col_decay = (ref - G[:, None, :, :]).masked_fill(~before[None, :, :, None], float("-inf")).exp()
    off = a_rows @ (b[:, None, :, :] * col_decay).transpose(-1, -2)         # [M, ns, S, C]
    inner = Gs[:, :, :, None, :] - Gs[:, :, None, :, :]                     # [M, ns, S, S, K]
    inner = inner.masked_fill(~_causal_mask(S, strict, a.device)[..., None], float("-inf")).exp()
    diag = (a.view(M, ns, S, 1, K) * b.view(M, ns, 1, S, K) * inner).sum(-1)  # [M, ns, S, S]
    eye = torch.eye(ns, dtype=a.dtype, device=a.device).view(ns, 1, ns, 1)
    return off.reshape(M, C, C) + (diag[:, :, :, None, :] * eye).reshape(M, C, C)


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool) -> torch.Tensor:
    """``S_ij = sum_c a_ic b_jc exp(G_ic - G_jc)`` on the causal (or strict) lower triangle.

    a, b: [N, H, NT, C, K]; G: [N, H, NT, C, 1] (scalar decay) or [N, H, NT, C, K].
    Returns [N, H, NT, C, C].
    """
    C = a.shape[-2]
    if G.shape[-1] == 1:
        mask = _causal_mask(C, strict, a.device)
        diff = G - G.transpose(-1, -2)                                      # [.., C, C]
        decay = diff.masked_fill(~mask, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * decay
    # per channel: in slices of chunks to bound the element-wise buffers; under autograd
    # each slice is recomputed in the backward instead of kept
    lead, K = a.shape[:-2], a.shape[-1]
    a, b, G = (x.reshape(-1, C, K) for x in (a, b, G))
    per_chunk = (C * _SUB + 2 * C) * K * a.element_size() * 4
    step = max(1, _PER_CHANNEL_SCORE_BYTES // per_chunk)
    grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or G.requires_grad)
    out = []
    for s in range(0, a.shape[0], step):
        args = (a[s:s + step], b[s:s + step], G[s:s + step], strict)
        if grad:
            out.append(checkpoint(_channel_scores_block, *args, use_reentrant=False))
        else:
            out.append(_channel_scores_block(*args))
    return torch.cat(out).reshape(*lead, C, C)


def chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    chunk_size: int = 64,
    want_chunk_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over padded sequences.

    Returns ``o [N, L, H, V]``, the final state ``[N, H, K, V]`` and, when asked, the
    state at the start of every chunk ``[N, NT, H, K, V]``.
    """
    N, L, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if gv is not None and C != 1:
        raise ValueError("chunked_scan: a per-value-channel gate (gv) needs chunk_size=1")
    NT = max(1, math.ceil(L / C))
    dt = q.dtype

    qc, kc, vc = (_to_chunks(x, NT, C) for x in (q, k, v))                 # [N, H, NT, C, D]
    logd = torch.zeros(N, H, NT, C, 1, dtype=dt, device=q.device)
    if g is not None:
        logd = logd + _to_chunks(g, NT, C)[..., None]
    if gk is not None:
        logd = logd + _to_chunks(gk, NT, C)
    G = logd.cumsum(dim=3)                                                  # [N, H, NT, C, 1|K]
    G_last = G[:, :, :, -1:, :]                                             # [N, H, NT, 1, 1|K]
    decay_q = G.exp()
    decay_k = (G_last - G).exp()
    Gv = _to_chunks(gv, NT, C) if gv is not None else None                  # [N, H, NT, 1, V]

    Aqk = scale * _decayed_scores(qc, kc, G, strict=False)                  # [N, H, NT, C, C]
    if beta is not None:
        bc = _to_chunks(beta, NT, C)[..., None]                             # [N, H, NT, C, 1]
        Akk = _decayed_scores(kc, kc, G, strict=True) * bc
        eye = torch.eye(C, dtype=dt, device=q.device)
        Tm = Akk + eye
        U = torch.linalg.solve_triangular(Tm, bc * vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(Tm, bc * decay_q * kc, upper=False, unitriangular=True)
    else:
        U, W = vc, None
    kd = (decay_k * kc).transpose(-1, -2)                                   # [N, H, NT, K, C]
    state_decay = G_last.squeeze(-2).exp()[..., None]                       # [N, H, NT, 1|K, 1]

    S = h0.to(dt) if h0 is not None else q.new_zeros(N, H, K, V)
    states, v_new = [], []
    for c in range(NT):
        states.append(S)
        u = U[:, :, c]
        if W is not None:
            ws = W[:, :, c] @ S                                             # [N, H, C, V]
            if Gv is not None:
                ws = ws * Gv[:, :, c].exp()
            u = u - ws
        v_new.append(u)
        S_dec = state_decay[:, :, c] * S
        if Gv is not None:
            S_dec = S_dec * Gv[:, :, c, -1, None, :].exp()
        S = S_dec + kd[:, :, c] @ u

    Sst = torch.stack(states, dim=2)                                        # [N, H, NT, K, V]
    Vn = torch.stack(v_new, dim=2)                                          # [N, H, NT, C, V]
    inter = (scale * decay_q * qc) @ Sst
    if Gv is not None:
        inter = inter * Gv.exp()
    o = inter + Aqk @ Vn                                                    # [N, H, NT, C, V]
    o = o.movedim(1, 3).reshape(N, NT * C, H, V)[:, :L]
    chunk_states = Sst.movedim(1, 2) if want_chunk_states else None
    return o, S, chunk_states
