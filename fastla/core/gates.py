"""Gate, beta and normalisation math, in one place for every tier and reference.

All functions are plain differentiable PyTorch and compute in float32 unless the
input is float64 (the references run them in float64).

Log-decay conventions (natural log, ``g <= 0``):

- GDN, computed in the op: ``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h])``,
  ``A_log, dt_bias: [HV]``.
- KDA, computed in the op: ``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h, :])``,
  ``A_log: [HV]``, ``dt_bias: [HV * K]`` viewed as ``[HV, K]``.
- KDA with ``lower_bound``: ``g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias))``
  (``A_log`` optional: without it ``lower_bound * sigmoid(g_raw + dt_bias)``), so that
  ``g`` stays in ``[lower_bound, 0)``.
- Lightning attention: the constant per-head decay
  ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (references); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, as FLA's in-kernel l2norm."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """``sigmoid(beta)``, times 2 when negative eigenvalues are allowed."""
    b = torch.sigmoid(beta.to(compute_dtype(beta)))
    return b * 2.0 if allow_neg_eigval else b


def gdn_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """GDN scalar gate. ``g_raw: [..., HV]`` -> log decay ``[..., HV]``."""
    dt = compute_dtype(g_raw)
    x = g_raw.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt)
    return -torch.exp(A_log.to(dt)) * F.softplus(x)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
) -> torch.Tensor:
    """KDA per-channel gate. ``g_raw: [..., HV, K]`` -> log decay ``[..., HV, K]``."""
    HV, K = g_raw.shape[-2:]
    dt = compute_dtype(g_raw)
    x = g_raw.to(dt)
    if dt_bias is not None:
        x = x + dt_bias.to(dt).view(HV, K)
    if lower_bound is None:
        return -torch.exp(A_log.to(dt)).view(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = torch.exp(A_log.to(dt)).view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device) -> torch.Tensor:
    """Lightning attention's constant per-head log decay ``[H]`` (float32). Eager calls share one
    tensor per (heads, layer, layers, device), built once and noted as a constant of a call plan
    being recorded: a repeated call then runs no op on the device before its kernels, so a plan
    can record it (core/call_plan.py). Read only. Built per call while compiling or capturing a
    CUDA graph (a capture only records the ops that would fill it, so a tensor cached then would
    hold nothing until the graph replays)."""
    from fastla.core import call_plan

    device = torch.device(device)
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _lightning_g_gamma(num_heads, layer_idx, num_layers, device)
    shared = _lightning_g_gamma_shared(num_heads, layer_idx, num_layers, device)
    call_plan.keep_constants(shared)
    return shared


def _lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, device) -> torch.Tensor:
    slope = 8.0 / num_heads * (1.0 - layer_idx / num_layers)
    return -slope * torch.arange(num_heads, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=256)
def _lightning_g_gamma_shared(num_heads: int, layer_idx: int, num_layers: int, device) -> torch.Tensor:
    return _lightning_g_gamma(num_heads, layer_idx, num_layers, device)
