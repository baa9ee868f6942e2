"""Turn a validated :class:`Problem` into the activated inputs every algorithm consumes.

Applies, in the compute dtype (float32, or float64 for float64 inputs): q/k l2norm,
the gate computed in the op (GDN or KDA form), the constant ``g_gamma``, the beta
sigmoid, and GVA head expansion of q/k. Differentiable; shared by the torch tier and
the references so the gate math exists once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastla.core.gates import beta_activation, compute_dtype, gdn_gate, kda_gate, l2norm
from fastla.core.problem import Problem


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """GVA: value head ``j`` reads q/k head ``j // (HV // H)``. ``[B, T, H, D] -> [B, T, HV, D]``."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)


@dataclass
class Activated:
    q: torch.Tensor              # [B, T, HV, K]
    k: torch.Tensor              # [B, T, HV, K]
    v: torch.Tensor              # [B, T, HV, V]
    g: torch.Tensor | None       # [B, T, HV] scalar log decay
    gk: torch.Tensor | None      # [B, T, HV, K]
    gv: torch.Tensor | None      # [B, T, HV, V]
    beta: torch.Tensor | None    # [B, T, HV] (None: plain rule)


def activate(p: Problem, dtype: torch.dtype | None = None) -> Activated:
    dt = dtype or compute_dtype(p.q)
    q, k = p.q.to(dt), p.k.to(dt)
    if p.use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = expand_heads(q, p.HV), expand_heads(k, p.HV)
    g = p.g
    if g is not None:
        g = gdn_gate(g.to(dt), p.A_log, p.dt_bias) if p.gate_in_op == "gdn" else g.to(dt)
    if p.g_gamma is not None:
        gamma = p.g_gamma.to(dt).expand(p.B, p.T, p.HV)
        g = gamma if g is None else g + gamma
    gk = p.gk
    if gk is not None:
        gk = kda_gate(gk.to(dt), p.A_log, p.dt_bias, p.lower_bound) if p.gate_in_op == "kda" else gk.to(dt)
    gv = p.gv.to(dt) if p.gv is not None else None
    beta = None
    if p.delta:
        if p.beta is None:
            beta = q.new_ones(p.B, p.T, p.HV)
        elif p.beta_sigmoid:
            beta = beta_activation(p.beta.to(dt), p.allow_neg_eigval)
        else:
            beta = p.beta.to(dt)
    return Activated(q, k, p.v.to(dt), g, gk, gv, beta)
