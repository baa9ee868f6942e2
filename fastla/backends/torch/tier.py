"""The torch tier: every public op on any device, through :func:`chunked_scan`.

Steps for one call: activate the inputs (gates, l2norm, beta sigmoid, GVA), gather the
tokens into a padded ``[N, L, ...]`` view (varlen, reverse), read the start states (from
``initial_state`` or the serving pool), scan, scatter the output back, and write the
final / intermediate / pool states. Computes in float32 (float64 for float64 inputs);
autograd flows through everything except the in-place pool writes (inference only).
"""
from __future__ import annotations

import torch

from fastla.backends.torch.chunked import chunked_scan
from fastla.core import dispatch
from fastla.core.prepare import activate
from fastla.core.problem import Problem
from fastla.core.varlen import SeqLayout, chunk_counts

PUBLIC_OPS = (
    "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
    "chunk_kda", "fused_recurrent_kda",
    "chunk_gla", "fused_recurrent_gla",
    "chunk_simple_gla", "fused_recurrent_simple_gla",
    "chunk_lightning_attn", "fused_recurrent_lightning_attn",
)


def _supports(problem: Problem) -> str | None:
    if problem.cu_seqlens is not None and problem.cu_seqlens_host is None:
        return "the torch tier needs the sequence offsets on the host: pass cu_seqlens_cpu when capturing a CUDA graph"
    return None


def _state_in(x: torch.Tensor, v_first: bool) -> torch.Tensor:
    """Caller layout -> K-first ``[.., K, V]``."""
    return x.transpose(-1, -2) if v_first else x


def _start_states(p: Problem, dt: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(h0 [N, HV, K, V] or None, start slot per sequence [N] or None)``."""
    if p.pool is None:
        if p.initial_state is None:
            return None, None
        return _state_in(p.initial_state, p.state_v_first).to(dt), None
    idx = p.pool.indices
    if idx.dim() == 1:
        slot = idx
    elif p.pool.num_accepted_tokens is not None:
        slot = idx.gather(1, (p.pool.num_accepted_tokens.to(torch.int64) - 1)[:, None])[:, 0]
    else:
        slot = idx[:, 0]
    slot = slot.to(torch.int64)
    live = (slot >= 0).to(dt)[:, None, None, None]
    h0 = _state_in(p.initial_state[slot.clamp(min=0)], p.state_v_first).to(dt) * live
    return h0, slot


def _write_pool(p: Problem, layout: SeqLayout, slot: torch.Tensor, final: torch.Tensor,
                token_states: torch.Tensor | None) -> None:
    """Write final (1-D indices) or per-token (2-D indices) states into the pool in place."""
    pool = p.initial_state
    to_pool = lambda s: (s.transpose(-1, -2) if p.state_v_first else s).to(pool.dtype)  # noqa: E731
    with torch.no_grad():
        if token_states is None:
            keep = slot >= 0
            pool.index_copy_(0, slot[keep], to_pool(final.detach()[keep]))
            return
        idx = p.pool.indices.to(torch.int64)                                # [N, Tcols]
        t = torch.arange(idx.shape[1], device=idx.device)
        lengths = torch.tensor(layout.lengths, device=idx.device)
        keep = (idx >= 0) & (t[None, :] < lengths[:, None]) & (slot >= 0)[:, None]   # skipped rows write nothing
        L = token_states.shape[1]
        keep_l = keep[:, :L]
        pool.index_copy_(0, idx[:, :L][keep_l], to_pool(token_states.detach()[keep_l]))


def _gather_chunk_states(states: torch.Tensor, layout: SeqLayout, chunk_size: int, varlen: bool) -> torch.Tensor:
    """``[N, NT_max, HV, K, V]`` -> FLA's ``[B, NT, ...]`` (varlen: ``[1, sum of chunks, ...]``)."""
    counts = chunk_counts(list(layout.lengths), chunk_size)
    if not varlen:
        return states[:, :max(counts, default=0)]
    return torch.cat([states[n, :c] for n, c in enumerate(counts)], dim=0)[None]


def run(p: Problem):
    # the tier's float32 math must not be lowered by an enclosing autocast region
    with torch.autocast(p.device.type, enabled=False):
        return _run(p)


def _run(p: Problem):
    a = activate(p)
    dt = a.q.dtype
    layout = SeqLayout.build(p.B, p.T, list(p.cu_seqlens_host) if p.cu_seqlens_host else None, p.reverse,
                             cu_device=p.cu_seqlens)
    per_token = p.pool is not None and p.pool.indices.dim() == 2 and p.T > 0
    chunk = 1 if (a.gv is not None or per_token) else p.chunk_size
    h0, slot = _start_states(p, dt)

    pad = layout.to_padded
    o, final, states = chunked_scan(
        pad(a.q), pad(a.k), pad(a.v), scale=p.scale,
        g=pad(a.g) if a.g is not None else None,
        gk=pad(a.gk) if a.gk is not None else None,
        gv=pad(a.gv) if a.gv is not None else None,
        beta=pad(a.beta) if a.beta is not None else None,
        h0=h0, chunk_size=chunk,
        want_chunk_states=p.return_intermediate_states or per_token,
    )
    if slot is not None:
        o = o * (slot >= 0).to(o.dtype)[:, None, None, None]
    out = layout.from_padded(o).to(p.o_dtype).contiguous()

    if p.pool is not None:
        if not p.pool.disable_state_update:
            token_states = None
            if per_token:
                token_states = torch.cat([states[:, 1:], final[:, None]], dim=1)  # state after each token
            _write_pool(p, layout, slot, final, token_states)
        return out, p.initial_state

    final_state = None
    if p.output_final_state:
        final_state = (final.transpose(-1, -2) if p.state_v_first else final).to(
            torch.float32 if dt != torch.float64 else dt).contiguous()
    if p.return_intermediate_states:
        h = _gather_chunk_states(states, layout, chunk, p.cu_seqlens_host is not None)
        h = (h.transpose(-1, -2) if p.state_v_first else h).to(p.k.dtype)
        return out, final_state, h
    return out, final_state


for _op in PUBLIC_OPS:
    dispatch.register(_op, "torch", _supports)(run)
