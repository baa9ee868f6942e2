"""The token-by-token recurrence that defines every op: the ground truth of the tests.

One loop serves all variants. Per head and token, with the state ``S`` (``K x V``)::

    S = Diag(exp(gk_t)) * exp(g_t) * S * Diag(exp(gv_t))     (each gate optional)
    delta rule (beta given):  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T
    plain rule:               S = S + k_t v_t^T
    o_t = scale * S^T q_t

:func:`recurrent_reference` takes ``[B, T, HV, D]`` inputs with gates and beta already
activated; :func:`reference_for` runs it on a validated call (the public references
``naive_recurrent_<op>`` are thin wrappers around it). It runs in ``dtype`` (float64 by default) and loops
over sequences and tokens: slow by design, and differentiable.
"""
from __future__ import annotations

import torch

from fastla.core.prepare import activate
from fastla.core.problem import Problem
from fastla.core.varlen import SeqLayout, host_cu_seqlens


def recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    reverse: bool = False,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns ``o [B, T, HV, V]`` in ``dtype`` and the final state ``[N, HV, K, V]`` (or V-first)."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    layout = SeqLayout.build(B, T, host_cu_seqlens(cu_seqlens, None), reverse)
    flat = lambda x: None if x is None else x.reshape(B * T, *x.shape[2:]).to(dtype)  # noqa: E731
    qf, kf, vf, gf, gkf, gvf, bf = map(flat, (q, k, v, g, gk, gv, beta))
    outs = [None] * (B * T)
    finals = []
    for n in range(layout.N):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
            S = S.transpose(-1, -2) if state_v_first else S
        else:
            S = qf.new_zeros(HV, K, V)
        L, s0 = layout.lengths[n], layout.starts[n]
        order = range(L - 1, -1, -1) if reverse else range(L)
        for t in order:
            i = s0 + t
            if gf is not None:
                S = S * gf[i].exp()[:, None, None]
            if gkf is not None:
                S = S * gkf[i].exp()[:, :, None]
            if gvf is not None:
                S = S * gvf[i].exp()[:, None, :]
            if bf is not None:
                u = bf[i][:, None] * (vf[i] - torch.einsum("hk,hkv->hv", kf[i], S))
            else:
                u = vf[i]
            S = S + kf[i][:, :, None] * u[:, None, :]
            outs[i] = scale * torch.einsum("hk,hkv->hv", qf[i], S)
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    zero = qf.new_zeros(HV, V)
    o = torch.stack([x if x is not None else zero for x in outs]).reshape(B, T, HV, V)
    final = torch.stack(finals) if output_final_state else None
    return o, final


def reference_for(p: Problem, dtype: torch.dtype = torch.float64):
    """The token-by-token result of a validated call: ``(o, final_state)`` in ``dtype``."""
    a = activate(p, dtype)
    return recurrent_reference(
        a.q, a.k, a.v, scale=p.scale, g=a.g, gk=a.gk, gv=a.gv, beta=a.beta,
        initial_state=p.initial_state, output_final_state=p.output_final_state,
        state_v_first=p.state_v_first, cu_seqlens=None if p.cu_seqlens_host is None else torch.tensor(p.cu_seqlens_host),
        reverse=p.reverse, dtype=dtype,
    )
