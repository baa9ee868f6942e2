"""Shared test machinery: realistic inputs per op, calls through the public API and the
references, relative-RMS comparison (NaN never passes), and the device list."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from fastla.backends.triton import interpreting
from fastla.bench.host_stub import strided  # noqa: F401  (the tests' strided views: one definition)
from fastla.ops.gated_delta_rule import (
    chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule,
)
from fastla.ops.gla import chunk_gla, fused_recurrent_gla, naive_recurrent_gla
from fastla.ops.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from fastla.ops.lightning_attn import (
    chunk_lightning_attn, fused_recurrent_lightning_attn, naive_recurrent_lightning_attn,
)
from fastla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla, naive_recurrent_simple_gla

HAS_CUDA = torch.cuda.is_available()
_needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _needs_cuda])]
# tests that force a kernel tier (triton, gluon): their CPU case runs under Triton's interpreter,
# which conftest sets where there is no GPU; on a GPU host without it the case is skipped
_needs_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU inputs reach the kernel tiers only "
                                        "under TRITON_INTERPRET=1")
KERNEL_DEVICES = [pytest.param("cpu", marks=_needs_interpreter), DEVICES[1]]


def skip_unservable(device: str, tier: str) -> None:
    """In a test parametrized by device and tier: skip CPU inputs on a kernel tier without the
    interpreter (as KERNEL_DEVICES does for tests of one kernel tier)."""
    if device == "cpu" and tier != "torch" and not interpreting():
        pytest.skip("CPU inputs reach the kernel tiers only under TRITON_INTERPRET=1")


def poison():
    """Fill the CUDA caching allocator's free blocks with NaN (512 MB), so unwritten outputs fail."""
    x = torch.full((1 << 27,), float("nan"), device="cuda")
    del x


def gpu(test):
    """A test that needs a CUDA device: skipped without one, selected by ``-m gpu``."""
    return pytest.mark.gpu(_needs_cuda(test))

# relative RMS thresholds vs the fp64 reference, by input dtype: (outputs/states, gradients)
TOLERANCE = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (5e-3, 5e-3)}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} vs reference {tuple(ref.shape)}"
    if not torch.isfinite(x).all():
        return float("inf")
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = rel_rms(x, ref)
    assert err <= tol, f"{name}: relative RMS {err:.3e} > {tol:.1e}"


@dataclass(frozen=True)
class OpSpec:
    """How to call one op family: the tensors it takes and its three entry points."""

    name: str
    delta: bool
    gate: str                 # "scalar", "channel", "gamma" (lightning) or "none"
    gva: bool
    chunk: Callable
    recurrent: Callable
    reference: Callable
    gate_arg_recurrent: str   # name of the gate argument of the recurrent op


OPS = {
    "gdn": OpSpec("gdn", True, "scalar", True, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
                  naive_recurrent_gated_delta_rule, "g"),
    "kda": OpSpec("kda", True, "channel", True, chunk_kda, fused_recurrent_kda, naive_recurrent_kda, "g"),
    "gla": OpSpec("gla", False, "channel", False, chunk_gla, fused_recurrent_gla, naive_recurrent_gla, "gk"),
    "simple_gla": OpSpec("simple_gla", False, "scalar", False, chunk_simple_gla, fused_recurrent_simple_gla,
                         naive_recurrent_simple_gla, "g"),
    "lightning": OpSpec("lightning", False, "gamma", False, chunk_lightning_attn, fused_recurrent_lightning_attn,
                        naive_recurrent_lightning_attn, ""),
}
LIGHTNING_LAYERS = {"layer_idx": 3, "num_layers": 8}


def make_inputs(spec: OpSpec, B=2, T=65, H=2, HV=None, K=32, V=32, dtype=torch.float32, device="cpu",
                strength=1.0, h0=True, N=None, v_first=False, seed=None) -> dict:
    """Fresh realistic inputs: l2-normalised k, logsigmoid gates scaled by ``strength``
    (small: decay near 1; large: strong decay), sigmoid beta, random initial state."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    HV = HV or H
    N = N or B
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = {
        "q": rnd(B, T, H, K),
        "k": F.normalize(rnd(B, T, H, K), dim=-1),
        "v": rnd(B, T, HV, V),
    }
    if spec.gate == "scalar":
        t["g"] = strength * F.logsigmoid(rnd(B, T, HV) + 2.0)
    elif spec.gate == "channel":
        t["g"] = strength * F.logsigmoid(rnd(B, T, HV, K) + 2.0)
    if spec.delta:
        t["beta"] = torch.rand(B, T, HV, generator=gen)
    if h0:
        t["initial_state"] = rnd(N, HV, V, K) if v_first else rnd(N, HV, K, V)
    out = {}
    for name, x in t.items():
        x = x.to(device)
        out[name] = x if name == "initial_state" else x.to(dtype)
    return out


def on_device(t: dict, device) -> dict:
    """``t``'s tensors moved to ``device`` (other values as they are)."""
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in t.items()}


def gated_case(op: str, B=2, T=400, K=128, dtype=torch.bfloat16, device="cpu", lengths=None, seed=None, V=None):
    """GDN or KDA with every activation in the op: the gate from A_log / dt_bias (KDA's bounded, with
    safe_gate), q/k l2norm, beta from logits through the sigmoid, GVA (H = 2, HV = 4), V = K unless given;
    ``lengths``: a varlen batch of those sequences. ``(tensors, extra (A_log, dt_bias), options)``,
    made on the CPU from ``seed`` (fresh when None) and moved to ``device``, so a GPU run and an
    interpreter run with one seed see the same numbers."""
    seed = seed if seed is not None else torch.randint(0, 2**31, ()).item()
    if lengths:
        B, T = 1, sum(lengths)
    t = make_inputs(OPS[op], B=B, T=T, H=2, HV=4, K=K, V=V or K, dtype=dtype, N=len(lengths) if lengths else None,
                    seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    t["g"] = torch.randn(t["g"].shape, generator=gen)
    t["beta"] = torch.randn(t["beta"].shape, generator=gen).to(dtype)
    extra = dict(A_log=torch.randn(4, generator=gen) * 0.5,
                 dt_bias=torch.randn(4 if op == "gdn" else 4 * K, generator=gen))
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    if op == "kda":
        opts.update(safe_gate=True, lower_bound=-5.0)
    if lengths:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        opts.update(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    return on_device(t, device), on_device(extra, device), opts


def strided_inputs(t: dict) -> dict:
    """Every tensor of ``t`` as a strided view (``strided``), the values unchanged."""
    out = {n: strided(x) if isinstance(x, torch.Tensor) else x for n, x in t.items()}
    assert not any(isinstance(x, torch.Tensor) and x.numel() > 1 and x.is_contiguous() for x in out.values())
    return out


def extra_args(spec: OpSpec) -> dict:
    return dict(LIGHTNING_LAYERS) if spec.gate == "gamma" else {}


def call_chunk(spec: OpSpec, t: dict, **opts):
    return spec.chunk(**t, **extra_args(spec), **opts)


def call_recurrent(spec: OpSpec, t: dict, **opts):
    t = dict(t)
    if spec.gate_arg_recurrent and spec.gate_arg_recurrent != "g" and "g" in t:
        t[spec.gate_arg_recurrent] = t.pop("g")
    return spec.recurrent(**t, **extra_args(spec), **opts)


def call_reference(spec: OpSpec, t: dict, **opts):
    t = dict(t)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    return spec.reference(q, k, v, **t, **extra_args(spec), **opts)


def as_leaves(t: dict, dtype=None) -> dict:
    """Detached copies requiring grad (optionally cast, e.g. to float64 for the reference)."""
    return {n: (x.detach().to(dtype) if dtype else x.detach().clone()).requires_grad_(True) for n, x in t.items()}


def random_final_state_grad(t: dict, cu_seqlens=None, state_v_first=False, generator=None, **_) -> torch.Tensor:
    """A random gradient for the op's final state (float32, [N, HV, K, V], V-first [N, HV, V, K]),
    shaped from the inputs so that no forward runs just to learn it (drawn on the CPU from
    ``generator`` when given)."""
    q, v = t["q"], t["v"]
    N = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    K, V = q.shape[-1], v.shape[-1]
    shape = (N, v.shape[-2], *((V, K) if state_v_first else (K, V)))
    if generator is None:
        return torch.randn(shape, device=q.device)
    return torch.randn(shape, generator=generator).to(q.device)


def forward_backward(fn: Callable, leaves: dict, do: torch.Tensor, dht: torch.Tensor | None, **opts):
    """Run ``fn`` on ``leaves``, backprop ``(o*do).sum() + (ht*dht).sum()``; return o, ht, grads."""
    o, ht = fn(leaves, **opts)[:2]
    loss = (o.double() * do.double()).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.double()).sum()
    loss.backward()
    grads = {n: x.grad for n, x in leaves.items()}
    return o, ht, grads
