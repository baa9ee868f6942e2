"""Random combinations of the chunked GDN / KDA options (seeded): GVA ratio, head dims, dense or
varlen batches (int32 / int64 offsets, on the host only or both), the gate in the op (with or
without dt_bias, KDA's lower_bound), the l2norm, beta sigmoid and negative eigenvalues, initial
state in either layout, final and intermediate states, strided inputs. On the CPU the Triton tier
(interpreter) against the torch tier; on an sm_90 GPU the Gluon tier against fp64, within 1.5x the
Triton tier's error as in test_gluon_chunk_gdn.py. The same for the plain rule (GLA, Simple GLA,
Lightning), its kernel tiers switched on for the GPU case. Training: the same combinations' gradients
through the Triton backward against fp64, within twice the torch tier's error (its autograd on the
same inputs) plus a floor."""
import random

import pytest
import torch
import torch.nn.functional as F

from fastla.backends.gluon import available
from fastla.backends.triton import chunk_training
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule
from fastla.ops.gla import chunk_gla
from fastla.ops.kda import chunk_kda
from fastla.ops.lightning_attn import chunk_lightning_attn
from fastla.ops.simple_gla import chunk_simple_gla
from tests.helpers import forward_backward, random_final_state_grad, rel_rms, strided_inputs

OPS = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda, "gla": chunk_gla, "simple_gla": chunk_simple_gla,
       "lightning": chunk_lightning_attn}


def random_batch(rng: random.Random, gpu: bool):
    """(lengths or None, B, T, N): a varlen batch of 1-3 sequences or a dense one; ``gpu``: the
    Gluon scan's sizes (64 tokens or more)."""
    if rng.random() < 0.5:
        lengths = [rng.choice([1, 5, 63, 64, 65, 129] + ([300, 700] if gpu else [])) for _ in range(rng.choice([1, 2, 3]))]
        lengths[0] += 64 if gpu else 0                              # (the Gluon scan takes 64 tokens or more)
        return lengths, 1, sum(lengths), len(lengths)
    B, T = rng.choice([1, 2]), rng.choice([64, 65, 130, 500] if gpu else [1, 17, 64, 65, 130])
    return None, B, T, B


def random_offsets(rng: random.Random, lengths) -> dict:
    """The offsets of a varlen batch (int32 or int64), on the host only or on both sides."""
    if not lengths:
        return {}
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=rng.choice([torch.int32, torch.int64]))
    return dict(cu_seqlens_cpu=cu, cu_seqlens=cu.clone()) if rng.random() < 0.5 else dict(cu_seqlens_cpu=cu)


def placed(rng: random.Random, t: dict, opts: dict, gpu: bool, device: str | None = None):
    """A case's tensors on its device (bf16 for the GPU's case, on ``device`` or CUDA; the state and
    g_gamma stay fp32) and its option tensors there too (the host offsets stay), strided views three
    cases in ten."""
    device, dtype = (device or ("cuda" if gpu else "cpu")), (torch.bfloat16 if gpu else torch.float32)
    t = {n: x.to(device) if n in ("initial_state", "g_gamma") else x.to(device, dtype) for n, x in t.items()}
    opts = {n: x.to(device) if torch.is_tensor(x) and n != "cu_seqlens_cpu" else x for n, x in opts.items()}
    if rng.random() < 0.3:
        t = strided_inputs(t)
    return t, opts


def random_case(seed: int, gpu: bool, device: str | None = None):
    """(op, tensors, options) of one seeded combination. ``gpu``: the Gluon scan's shapes (bf16,
    K = 64 or 128, V a multiple of 32, 64 tokens or more) on CUDA or ``device``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    op = rng.choice(["gdn", "kda"])
    H = rng.choice([1, 2])
    HV = H * rng.choice([1, 2, 3])
    K = rng.choice([64, 128] if gpu else [16, 32, 48, 64])
    V = rng.choice([32, 64, 128] if gpu else [16, 32, 48])
    lengths, B, T, N = random_batch(rng, gpu)
    t = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V))
    opts = dict(use_qk_l2norm_in_kernel=rng.random() < 0.6)
    if not opts["use_qk_l2norm_in_kernel"]:
        t["q"], t["k"] = F.normalize(t["q"], dim=-1), F.normalize(t["k"], dim=-1)
    gate = (B, T, HV) if op == "gdn" else (B, T, HV, K)
    if rng.random() < 0.5:
        t["g"] = rnd(*gate)
        opts.update(use_gate_in_kernel=True, A_log=rnd(HV) * 0.5)
        if rng.random() < 0.7:
            opts["dt_bias"] = rnd(HV if op == "gdn" else HV * K)
        if op == "kda" and rng.random() < 0.5:
            opts["lower_bound"] = rng.choice([-5.0, -1.0])
    else:
        t["g"] = F.logsigmoid(rnd(*gate) + 2) * rng.choice([0.01, 1.0, 10.0])
    if rng.random() < 0.5:
        t["beta"] = rnd(B, T, HV)
        opts.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=rng.random() < 0.5)
    else:
        t["beta"] = torch.rand(B, T, HV, generator=gen)
    opts["state_v_first"] = rng.random() < 0.3
    if rng.random() < 0.7:
        t["initial_state"] = rnd(N, HV, V, K) if opts["state_v_first"] else rnd(N, HV, K, V)
    opts["output_final_state"] = rng.random() < 0.8
    opts["return_intermediate_states"] = rng.random() < 0.25
    opts.update(random_offsets(rng, lengths))
    return (op, *placed(rng, t, opts, gpu, device))


def call(op, t, opts, tier):
    with use_tier(tier, strict=True), torch.no_grad():
        out = OPS[op](**t, **opts)
    return out if isinstance(out, tuple) else (out,)


def triton_matches_torch(op, t, opts):
    """The Triton tier (CPU interpreter, fp32 operands) within 2e-5 of the torch tier."""
    want, got = call(op, t, opts, "torch"), call(op, t, opts, "triton")
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None) and (a is None or a.shape == b.shape), f"output {i}"
        assert a is None or rel_rms(a, b) <= 2e-5, f"output {i}: {rel_rms(a, b):.2e}"


def gluon_against_fp64(op, t, opts):
    """The Gluon tier's error against fp64 within 1.5x the Triton tier's plus a floor, finite."""
    gluon, triton = call(op, t, opts, "gluon"), call(op, t, opts, "triton")
    ref_opts = {n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in opts.items()}
    ref = call(op, {n: x.double() for n, x in t.items()}, ref_opts, "torch")
    for i, (g, tr, r) in enumerate(zip(gluon, triton, ref)):
        if r is None:
            continue
        assert torch.isfinite(g).all(), f"output {i} not finite"
        err, err_t = rel_rms(g, r), rel_rms(tr, r)
        assert err <= 1.5 * err_t + 2e-3, f"output {i}: gluon {err:.2e} vs triton {err_t:.2e}"


def outputs_and_gradients(op, t, opts, tier, do, dht):
    """{name: tensor or None}: the op's output, final state and every floating input's gradient
    (tensors and options: A_log, dt_bias, g_gamma) for the loss (o do).sum() + (ht dht).sum()."""
    floating = lambda x: torch.is_tensor(x) and x.is_floating_point()  # noqa: E731
    leaves = {n: x.detach().requires_grad_(True) for n, x in {**t, **opts}.items() if floating(x)}  # (strides kept)
    rest = {n: x for n, x in opts.items() if not floating(x)}

    def fn(x, **kw):
        with use_tier(tier, strict=True):
            return OPS[op](**x, **kw)

    o, ht, grads = forward_backward(fn, leaves, do, dht, **rest)
    return {"o": o, "final_state": ht, **{f"d{n}": g for n, g in grads.items()}}


def three_tiers(op, t, opts, seed):
    """``(fp64, torch tier, triton tier)`` outputs and gradients (outputs_and_gradients) of one case,
    the loss's cotangents drawn from ``seed``; fp64 is the torch tier's autograd on float64 copies."""
    opts = {n: x for n, x in opts.items() if n != "return_intermediate_states"}
    gen = torch.Generator().manual_seed(1000 + seed)
    do = torch.randn(t["v"].shape, generator=gen).to(t["v"].device)
    dht = random_final_state_grad(t, generator=gen, **opts) if opts.get("output_final_state") else None
    as64 = lambda d: {n: x.double() if torch.is_tensor(x) and x.is_floating_point() else x for n, x in d.items()}  # noqa: E731
    return (outputs_and_gradients(op, as64(t), as64(opts), "torch", do, dht),
            outputs_and_gradients(op, t, opts, "torch", do, dht),
            outputs_and_gradients(op, t, opts, "triton", do, dht))


def triton_backward_against_fp64(op, t, opts, seed, floor):
    """The Triton tier's outputs and gradients against fp64 (the torch tier's autograd on float64
    copies) within twice the torch tier's own error plus ``floor``; finite. Sums over every token
    (A_log's, dt_bias's and g_gamma's gradients) cancel, so their errors run 10-100x the others'
    on both tiers: the bound is relative to the torch tier's, not absolute."""
    ref, torch_tier, triton_tier = three_tiers(op, t, opts, seed)
    assert ref.keys() == triton_tier.keys()
    for name, r in ref.items():
        a, b = torch_tier[name], triton_tier[name]
        assert (r is None) == (b is None), f"{name}: None on one side"
        if r is None:
            continue
        assert torch.isfinite(b).all(), f"{name} not finite"
        err, err_torch = rel_rms(b, r), rel_rms(a, r)
        assert err <= 2 * err_torch + floor, f"{name}: triton {err:.2e} vs torch tier {err_torch:.2e}"


cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the CPU interpreter's case (fp32 operands); the GPU case is the Gluon one")
sm90_only = pytest.mark.skipif(not torch.cuda.is_available() or available(torch.device("cuda")) is not None,
                               reason="needs an sm_90 GPU")


# ----------------------------------------------------------------------------- the plain rule

def random_plain_case(seed: int, gpu: bool, device: str | None = None):
    """(op, tensors, options) of one seeded combination of GLA / Simple GLA / Lightning options:
    head dims, dense or varlen batches, Simple GLA's g and / or g_gamma (or neither), Lightning's
    layer, initial state in either layout, the final state, strided inputs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    op = rng.choice(["gla", "simple_gla", "lightning"])
    H = rng.choice([1, 2, 3])
    K = rng.choice([64, 128] if gpu else [16, 32, 48, 64])
    V = rng.choice([32, 64, 128] if gpu else [16, 32, 48])
    lengths, B, T, N = random_batch(rng, gpu)
    t = dict(q=rnd(B, T, H, K), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, H, V))
    opts = {}
    if op == "gla":
        t["g"] = F.logsigmoid(rnd(B, T, H, K) + 2) * rng.choice([0.01, 1.0, 10.0])
    elif op == "simple_gla":
        if rng.random() < 0.7:
            t["g"] = F.logsigmoid(rnd(B, T, H) + 2) * rng.choice([0.01, 1.0, 10.0])
        if rng.random() < 0.5:
            t["g_gamma"] = -torch.rand(H, generator=gen) * rng.choice([0.01, 1.0])
    else:
        opts.update(layer_idx=rng.choice([0, 3, 7]), num_layers=8)
    opts["state_v_first"] = rng.random() < 0.3
    if rng.random() < 0.7:
        t["initial_state"] = rnd(N, H, V, K) if opts["state_v_first"] else rnd(N, H, K, V)
    opts["output_final_state"] = rng.random() < 0.8
    opts.update(random_offsets(rng, lengths))
    return (op, *placed(rng, t, opts, gpu, device))


# ----------------------------------------------------------------------------- the tests

CASES = {"delta": random_case, "plain": random_plain_case}


@cpu_only
@pytest.mark.parametrize("family,seed", [("delta", s) for s in range(6)] + [("plain", s) for s in range(4)])
def test_triton_tier_matches_torch_tier(family, seed):
    triton_matches_torch(*CASES[family](seed, gpu=False))


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("family,seed", [("delta", s) for s in range(24)] + [("plain", s) for s in range(12)])
def test_gluon_tier_against_fp64(family, seed):
    gluon_against_fp64(*CASES[family](seed, gpu=True))


@cpu_only
@pytest.mark.parametrize("family,seed", [("delta", s) for s in range(4)] + [("plain", s) for s in range(4)])
def test_triton_backward_against_fp64(family, seed, monkeypatch):
    """The interpreter's Triton backward (fp32 operands) on the option combinations, every op."""
    monkeypatch.setattr(chunk_training, "ENABLED", True)
    triton_backward_against_fp64(*CASES[family](seed, gpu=False), seed, floor=1e-5)


@cpu_only
def test_triton_backward_bf16_path_in_interpreter(monkeypatch):
    """The GPU case of delta seed 7 (KDA, GVA 2, K 64, V 32, a weak given gate, the l2norm, beta
    sigmoid with negative eigenvalues, the V-first state, strided bf16 inputs) in the interpreter on
    the GPU's bf16 path, forward and backward, products and casts rounded as a GPU's
    (tests/interpreter_emulation.py; the interpreter's truncating casts put it 10x over the torch
    tier), and every access in bounds (it faulted on an H100: docs/notes/chunk-backward.md)."""
    from triton.runtime.interpreter import InterpreterBuilder

    from fastla.backends.triton import chunk_delta, chunk_delta_backward
    from tests import interpreter_emulation

    monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_emulation.emulated_dot(tf32=True))
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", interpreter_emulation.emulated_cast)
    for module in (chunk_delta, chunk_delta_backward):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(chunk_training, "ENABLED", True)
    seen = []
    reverse_scan = chunk_delta_backward.reverse_scan
    monkeypatch.setattr(chunk_delta_backward, "reverse_scan", lambda c, *a, **kw: seen.append(c) or reverse_scan(c, *a, **kw))
    op, t, opts = random_case(7, gpu=True, device="cpu")
    assert op == "kda" and t["q"].dtype == torch.bfloat16
    triton_backward_against_fp64(op, t, opts, 7, floor=1e-2)
    assert seen and all(c.op_dtype == c.state_dtype == torch.bfloat16 for c in seen)     # (the bf16 path ran)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family,seed", [("delta", s) for s in range(12)] + [("plain", s) for s in range(6)])
def test_triton_backward_against_fp64_on_gpu(family, seed, monkeypatch):
    """The GPU's bf16 backward (bf16 operands and chunk states) on the Gluon cases' shapes."""
    from tests.helpers import poison

    op, t, opts = CASES[family](seed, gpu=True)
    poison()
    monkeypatch.setattr(chunk_training, "ENABLED", True)
    triton_backward_against_fp64(op, t, opts, seed, floor=1e-2)
