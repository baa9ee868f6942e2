"""Deterministic, realistic random inputs for a benchmark config.

Every config gets the same tensors on every run (the generator is seeded from the
config name and a run seed). The draws follow how the ops are fed in models:

- ``q``, ``k``, ``v``: ``randn`` in the config dtype; q and k are l2-normalised here
  unless the op normalises them itself (``use_qk_l2norm_in_kernel``).
- precomputed log decays: ``gate_strength * logsigmoid(randn)`` in float32 (strictly
  negative, never zero), clamped to ``lower_bound`` when one is set; raw gates (when
  the op computes the gate, ``use_gate_in_kernel``) are ``randn`` with float32
  ``A_log`` and ``dt_bias``.
- ``beta``: ``sigmoid(randn)``, or the raw logits when the op applies the sigmoid.
- ``initial_state``: float32 ``randn``; ``do`` and ``dht`` for the backward pass.

The same keyword arguments serve fastla and FLA, whose public APIs are identical.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from fastla.bench.registry import BenchConfig, scale_down

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BenchInputs:
    """The tensors of one call (``tensors``, keyword name -> tensor), the upstream
    gradients ``do``/``dht`` of the loss ``(o*do).sum() + (ht*dht).sum()``, and the
    names of the tensors the backward pass differentiates."""

    cfg: BenchConfig
    tensors: dict[str, torch.Tensor]
    do: torch.Tensor
    dht: torch.Tensor | None
    grad_names: tuple[str, ...]


def config_seed(cfg: BenchConfig, seed: int) -> int:
    """A stable per-config seed: the run seed mixed with a hash of the config name."""
    return (seed * 1_000_003 + zlib.crc32(cfg.name.encode())) % (2 ** 62)


class _Draw:
    """Seeded draws on one device."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return x.to(dtype)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        x = torch.rand(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return low + (high - low) * x


def _qkv(cfg: BenchConfig, draw: _Draw) -> dict[str, torch.Tensor]:
    dtype = DTYPES[cfg.dtype]
    q = draw.randn(cfg.B, cfg.T, cfg.H, cfg.K)
    k = draw.randn(cfg.B, cfg.T, cfg.H, cfg.K)
    v = draw.randn(cfg.B, cfg.T, cfg.HV, cfg.V)
    if not cfg.options.get("use_qk_l2norm_in_kernel", False):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return {"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype)}


def _log_decay(cfg: BenchConfig, draw: _Draw, *shape: int) -> torch.Tensor:
    g = cfg.gate_strength * F.logsigmoid(draw.randn(*shape))
    lower = cfg.options.get("lower_bound")
    return g.clamp(min=lower) if lower is not None else g


def _raw_gate(cfg: BenchConfig, draw: _Draw, shape: tuple[int, ...], bias_size: int) -> dict[str, torch.Tensor]:
    """Raw gate input plus ``A_log`` ``[HV]`` and ``dt_bias`` for ops that compute the gate."""
    return {
        "g": draw.randn(*shape, dtype=DTYPES[cfg.dtype]),
        "A_log": torch.log(draw.uniform(cfg.HV, low=1.0, high=4.0)),
        "dt_bias": 0.5 * draw.randn(bias_size),
    }


def gamma_decays(H: int) -> torch.Tensor:
    """Simple GLA's per-head constant log decays ``log(1 - 2^-x)``, x from 5 to 12 (RetNet-like)."""
    x = torch.linspace(5.0, 12.0, H, dtype=torch.float64)
    return torch.log1p(-torch.exp2(-x)).float()


def _gates(cfg: BenchConfig, draw: _Draw) -> dict[str, torch.Tensor]:
    kind = cfg.spec.gate
    in_op = cfg.options.get("use_gate_in_kernel", False)
    if kind == "scalar":
        shape = (cfg.B, cfg.T, cfg.HV)
        return _raw_gate(cfg, draw, shape, cfg.HV) if in_op else {"g": _log_decay(cfg, draw, *shape)}
    if kind == "channel":
        shape = (cfg.B, cfg.T, cfg.HV, cfg.K)
        return _raw_gate(cfg, draw, shape, cfg.HV * cfg.K) if in_op else {"g": _log_decay(cfg, draw, *shape)}
    if kind == "gamma":
        return {"g_gamma": gamma_decays(cfg.H).to(draw.device)}
    return {}


def _beta(cfg: BenchConfig, draw: _Draw) -> dict[str, torch.Tensor]:
    if not cfg.spec.delta:
        return {}
    logits = draw.randn(cfg.B, cfg.T, cfg.HV)
    beta = logits if cfg.options.get("use_beta_sigmoid_in_kernel", False) else torch.sigmoid(logits)
    return {"beta": beta.to(DTYPES[cfg.dtype])}


def _varlen(cfg: BenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    if cfg.lengths is None:
        return {}
    offsets = [0]
    for n in cfg.lengths:
        offsets.append(offsets[-1] + n)
    cpu = torch.tensor(offsets, dtype=torch.int64)
    return {"cu_seqlens": cpu.to(device), "cu_seqlens_cpu": cpu}


def _grad_names(cfg: BenchConfig, tensors: dict[str, torch.Tensor]) -> tuple[str, ...]:
    names = ["q", "k", "v"]
    if cfg.spec.gate in ("scalar", "channel"):
        names.append("g")
    names += [n for n in ("beta", "initial_state", "A_log", "dt_bias") if n in tensors]
    return tuple(names)


def make_inputs(cfg: BenchConfig, device: str | torch.device = "cuda", seed: int = 0,
                tiny: bool = False) -> BenchInputs:
    """The inputs of ``cfg`` on ``device``; ``tiny`` shrinks the problem to about 64
    tokens (same heads, options and varlen shape) for CPU tests."""
    if tiny:
        cfg = scale_down(cfg)
    device = torch.device(device)
    draw = _Draw(device, config_seed(cfg, seed))
    tensors = {**_qkv(cfg, draw), **_gates(cfg, draw), **_beta(cfg, draw)}
    if cfg.initial_state:
        tensors["initial_state"] = draw.randn(cfg.N, cfg.HV, cfg.K, cfg.V)
    tensors.update(_varlen(cfg, device))
    do = draw.randn(cfg.B, cfg.T, cfg.HV, cfg.V, dtype=DTYPES[cfg.dtype])
    dht = draw.randn(cfg.N, cfg.HV, cfg.K, cfg.V) if cfg.options.get("output_final_state") else None
    return BenchInputs(cfg, tensors, do, dht, _grad_names(cfg, tensors))


def call_kwargs(inputs: BenchInputs) -> dict[str, object]:
    """Keyword arguments of one call of the config's public op (fastla or FLA)."""
    return {**inputs.tensors, **inputs.cfg.options}


def fresh_state(inputs: BenchInputs) -> BenchInputs:
    """A copy whose ``initial_state`` is a clone, for calls that must not see a state
    another call may have updated."""
    if "initial_state" not in inputs.tensors:
        return inputs
    tensors = dict(inputs.tensors, initial_state=inputs.tensors["initial_state"].clone())
    return replace(inputs, tensors=tensors)


def with_grad(inputs: BenchInputs) -> tuple[BenchInputs, list[torch.Tensor]]:
    """New leaf views (sharing storage, no copy) of the differentiated tensors, with
    ``requires_grad``; returns the inputs using them and the leaves in ``grad_names`` order."""
    tensors = dict(inputs.tensors)
    leaves = []
    for name in inputs.grad_names:
        leaf = tensors[name].detach().requires_grad_(True)
        tensors[name] = leaf
        leaves.append(leaf)
    return replace(inputs, tensors=tensors), leaves


def to_float64(inputs: BenchInputs) -> BenchInputs:
    """float64 copies of every floating tensor (indices and ``cu_seqlens`` unchanged)."""
    def cast(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None or not x.is_floating_point():
            return x
        return x.detach().to(torch.float64)

    tensors = {name: cast(x) for name, x in inputs.tensors.items()}
    return replace(inputs, tensors=tensors, do=cast(inputs.do), dht=cast(inputs.dht))


def expected_shapes(cfg: BenchConfig) -> dict[str, tuple[int, ...]]:
    """The shape each input tensor of ``cfg`` must have (what the API documents)."""
    B, T, H, HV, K, V, N = cfg.B, cfg.T, cfg.H, cfg.HV, cfg.K, cfg.V, cfg.N
    shapes: dict[str, tuple[int, ...]] = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, HV, V)}
    if cfg.spec.gate == "scalar":
        shapes["g"] = (B, T, HV)
    elif cfg.spec.gate == "channel":
        shapes["g"] = (B, T, HV, K)
    elif cfg.spec.gate == "gamma":
        shapes["g_gamma"] = (H,)
    if cfg.options.get("use_gate_in_kernel", False):
        shapes["A_log"] = (HV,)
        shapes["dt_bias"] = (HV * K,) if cfg.spec.gate == "channel" else (HV,)
    if cfg.spec.delta:
        shapes["beta"] = (B, T, HV)
    if cfg.initial_state:
        shapes["initial_state"] = (N, HV, K, V)
    if cfg.lengths is not None:
        shapes["cu_seqlens"] = shapes["cu_seqlens_cpu"] = (N + 1,)
    return shapes


CHUNK = 64
BWD_FLOP_FACTOR = 2.8  # ALGORITHMS.md: GDN backward ~0.5M FLOP per token-head vs ~180K forward


def flops_per_token_head(cfg: BenchConfig, mode: str) -> float:
    """Matmul FLOPs per token and value head of the chunked (or recurrent) algorithm.

    Chunked delta rule: ``Q K^T``, ``K K^T``, ``W``, ``U`` and ``A V_new`` cost ``2 C D``
    each, ``W S``, ``Q S`` and the state update ``2 K V`` each (~180K at K=V=128, C=64).
    Plain rule: ``Q K^T``, ``A V``, ``Q S``, state update (~100K). Decode: decay, ``S^T k``,
    update and ``S^T q`` on the ``K x V`` state (~7 K V). Backward: ``BWD_FLOP_FACTOR``
    times the forward.
    """
    K, V = cfg.K, cfg.V
    if mode == "decode":
        return (7 if cfg.spec.delta else 5) * K * V
    if cfg.spec.delta:
        fwd = 2 * CHUNK * (3 * K + 2 * V) + 6 * K * V
    else:
        fwd = 2 * CHUNK * (K + V) + 4 * K * V
    return fwd * (1 + BWD_FLOP_FACTOR) if mode == "fwdbwd" else fwd


def _nbytes(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.numel() * x.element_size()


def work(inputs: BenchInputs, mode: str) -> tuple[float, float]:
    """``(flops, bytes)`` of one call: FLOPs from :func:`flops_per_token_head`, bytes the
    minimal HBM traffic (every input read once, ``o`` and the final state written once;
    the backward adds reading inputs, ``do``, ``dht`` and writing every gradient)."""
    cfg = inputs.cfg
    flops = flops_per_token_head(cfg, mode) * cfg.token_heads
    device_inputs = sum(_nbytes(x) for name, x in inputs.tensors.items() if name != "cu_seqlens_cpu")
    state = cfg.N * cfg.HV * cfg.K * cfg.V * 4 if cfg.options.get("output_final_state") else 0
    fwd_bytes = device_inputs + _nbytes(inputs.do) + state
    if mode != "fwdbwd":
        return float(flops), float(fwd_bytes)
    grads = sum(_nbytes(inputs.tensors[n]) for n in inputs.grad_names)
    bwd_bytes = device_inputs + _nbytes(inputs.do) + _nbytes(inputs.dht) + grads
    return float(flops), float(fwd_bytes + bwd_bytes)
