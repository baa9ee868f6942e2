"""The Triton KDA chunked forward (chunk_prepare_kda.py + the scan's per-channel step) against the
fp64 reference, through the public op; on the CPU it runs in the Triton interpreter."""
import dataclasses

import pytest
import torch

from fastla.backends.triton import interpreting
from fastla.core.dispatch import use_tier
from fastla.ops.kda import chunk_kda, naive_recurrent_kda
from tests.helpers import (
    KERNEL_DEVICES, OPS, assert_close, call_chunk, call_reference, gpu, make_inputs, on_device, strided_inputs,
)

SPEC = OPS["kda"]
TOL = 2e-5 if interpreting() else 1e-2          # fp32 operands in the interpreter; bf16 / tf32 on a GPU


def on_tier(fn, *args, tier="triton", **kwargs):
    with use_tier(tier, strict=True), torch.no_grad():
        return fn(*args, **kwargs)


def check(t, tol=TOL, **opts):
    o, ht = on_tier(call_chunk, SPEC, t, output_final_state=True, **opts)
    opts.pop("cu_seqlens_cpu", None)
    ro, rht = call_reference(SPEC, t, output_final_state=True, **opts)
    assert_close("o", o, ro, tol)
    assert_close("final_state", ht, rht, tol)


@pytest.mark.parametrize("T", [1, 130])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_lengths_and_gva(T, device):
    check(make_inputs(SPEC, B=2, T=T, H=1, HV=2, K=32, V=16, device=device))


@gpu
def test_fp32_head_dims_128():
    """fp32 inputs at K = V = 128 on the GPU: the scan's fp32 tiles need 311 KB of shared memory at
    its two stages, more than Hopper's 227 KB; the launcher builds it at one (launch.py)."""
    check(make_inputs(SPEC, B=1, T=70, H=1, K=128, V=128, device="cuda"))


@pytest.mark.parametrize("strength", [1e-3, 100.0])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decay_strength(strength, device):
    """100: in-block decay spans far beyond SPAN_LIMIT (the exact pairwise diagonal), no inf / NaN."""
    check(make_inputs(SPEC, B=1, T=80, H=1, K=32, V=16, strength=strength, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_varlen_and_state_v_first(device):
    lengths = [1, 63, 64, 65, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=1, HV=2, K=32, V=16, N=len(lengths), v_first=True, device=device)
    check(t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, state_v_first=True)


@pytest.mark.parametrize("lower_bound", [None, -5.0, 1.0])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_everything_in_op(lower_bound, device):
    """KDA gate (softplus or bounded sigmoid), l2norm, beta sigmoid and negative eigenvalues in the op;
    a positive lower_bound (a rising gate, accepted without safe_gate) on the exact path."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 32, 16
    gen = torch.Generator().manual_seed(1)
    t = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
             v=torch.randn(B, T, HV, V, generator=gen), g=torch.randn(B, T, HV, K, generator=gen),
             beta=torch.randn(B, T, HV, generator=gen), initial_state=torch.randn(B, HV, K, V, generator=gen))
    opts = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen) * 0.5,
                dt_bias=torch.randn(HV * K, generator=gen), lower_bound=lower_bound,
                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                output_final_state=True)
    t, opts = on_device(t, device), on_device(opts, device)
    o, ht = on_tier(chunk_kda, **t, **opts)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    ro, rht = naive_recurrent_kda(q, k, v, **t, **opts)
    assert_close("o", o, ro, TOL)
    assert_close("final_state", ht, rht, TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_inputs(device):
    """Strided views of every input (q, k, v, the raw gate, beta, the state, the offsets, A_log and
    dt_bias) run on this tier, through dense copies, with the contiguous inputs' results."""
    lengths, HV, K = [70, 1, 59], 2, 32
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=1, HV=HV, K=K, V=16, N=len(lengths), device=device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device)
    extra = dict(A_log=torch.randn(HV, device=device) * 0.5, dt_bias=torch.randn(HV * K, device=device),
                 cu_seqlens=cu)
    opts = dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, output_final_state=True,
                cu_seqlens_cpu=cu.cpu())
    want = on_tier(chunk_kda, **t, **extra, **opts)
    got = on_tier(chunk_kda, **strided_inputs(t), **strided_inputs(extra), **opts)
    for name, a, b in zip(("o", "final_state"), got, want):
        assert torch.equal(a, b), f"{name} differs with strided inputs"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_segments_and_intermediate_states(device, monkeypatch):
    """Sequence parallelism (summary with the exact per-channel transition, combine, replay) and
    the chunk-start states, against the torch tier."""
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: chunk_delta.ChunkConfig(segment_chunks=1))
    t = make_inputs(SPEC, B=1, T=150, H=1, K=16, V=16, device=device)
    opts = dict(output_final_state=True, return_intermediate_states=True)
    with torch.inference_mode():
        o, ht, h = on_tier(call_chunk, SPEC, t, **opts)
        with use_tier("torch", strict=True):
            ro, rht, rh = call_chunk(SPEC, t, **opts)
    assert_close("o", o, ro, TOL)
    assert_close("final_state", ht, rht, TOL)
    assert_close("h", h, rh, TOL)


@pytest.mark.parametrize("warps,block_k", [(4, 32), (2, 16)])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_prologue_launch_variants(warps, block_k, device, monkeypatch):
    """The prologue's other launch shapes (the sweep times them) compute the same function; K = 64
    runs two or four channel slices."""
    from fastla.backends.triton import chunk_delta
    config = chunk_delta.ChunkConfig(kda_prepare_warps=warps, kda_prepare_block_k=block_k)
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: config)
    check(make_inputs(SPEC, B=1, T=70, H=1, K=64, V=16, device=device))


def bf16_case(case: str):
    """Inputs and options of a GPU case: bf16 at K = V = 128 (64 for v-first-k64), every option as
    the registry uses it. The bounded-* cases take the bounded gate (lower_bound -5) on the
    varlen batch, at K = 64 with v_first, bare (no A_log, dt_bias, l2norm or beta sigmoid), with
    allow_neg_eigval, or with lower_bound -8 (wide: spans past 16 x 5); a case ending in -whole
    takes T = 1024 (whole chunks) instead of 1000."""
    K = V = 64 if case in ("v-first-k64", "bounded-k64") else 128
    lengths = [1, 300, 64, 1000, 77] if case in ("varlen", "bounded-varlen") else None
    B, T = (1, sum(lengths)) if lengths else (2, 1024 if case.endswith("-whole") else 1000)
    t = make_inputs(SPEC, B=B, T=T, H=2, HV=4, K=K, V=V, dtype=torch.bfloat16, device="cuda",
                    strength=100.0 if case == "strong-decay" else 1.0, N=len(lengths) if lengths else None,
                    v_first=K == 64)
    opts = dict(use_qk_l2norm_in_kernel=case != "bounded-plain", state_v_first=K == 64)
    if case == "bounded-plain":
        opts.update(use_gate_in_kernel=True, lower_bound=-5.0)
        t["g"] = torch.randn_like(t["g"]) * 3
    elif case in ("unbounded-gate", "bounded-gate") or case.startswith("bounded-"):
        opts.update(use_gate_in_kernel=True, A_log=torch.randn(4, device="cuda") * 0.5,
                    dt_bias=torch.randn(4 * K, device="cuda"), use_beta_sigmoid_in_kernel=True)
        opts.update(lower_bound=-5.0) if case != "unbounded-gate" else None
        opts.update(lower_bound=-8.0) if case == "bounded-wide" else None
        opts.update(allow_neg_eigval=True) if case == "bounded-neg-eigval" else None
        t["g"] = torch.randn_like(t["g"]) * 3
    if lengths:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        opts.update(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    return t, opts


def fp64_reference(t, opts):
    """The token-by-token reference's output and final state in fp64 for inputs ``t`` and options
    ``opts`` (a case's, as bf16_case gives them)."""
    return call_reference(SPEC, {n: x.double() for n, x in t.items()}, output_final_state=True,
                          **{n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x)
                             for n, x in opts.items() if n != "cu_seqlens_cpu"})


def check_fp64(t, opts, tier="triton", **extra):
    """The tier's output and final state against the fp64 reference (tolerance 2e-2)."""
    o, ht, *rest = on_tier(call_chunk, SPEC, t, output_final_state=True, tier=tier, **opts, **extra)
    ro, rht = fp64_reference(t, opts)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert_close("o", o, ro, 2e-2)
    assert_close("final_state", ht, rht, 2e-2)
    return rest


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "strong-decay", "unbounded-gate", "bounded-gate",
                                  "v-first-k64"])
def test_bf16_wide_heads(case):
    """bf16 at K = V = 128 (the shipped tiles) against fp64, every option as the registry uses it."""
    check_fp64(*bf16_case(case))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", ["dense", "strong-decay", "bounded-gate"])
@pytest.mark.parametrize("warps,block_k,maxnreg", [(2, 16, None), (1, 32, None), (4, 32, None), (2, 16, 168)])
def test_bf16_prologue_launch_variants(case, warps, block_k, maxnreg, monkeypatch):
    """The prologue's launch shapes that the sweep times, against fp64 on the GPU."""
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(
        original(p, **kw), kda_prepare_warps=warps, kda_prepare_block_k=block_k, kda_prepare_maxnreg=maxnreg))
    check_fp64(*bf16_case(case))


@pytest.mark.gpu
@gpu
def test_bf16_segments_and_intermediate_states(monkeypatch):
    """Sequence parallelism forced on (8-chunk segments) with the chunk-start states: output and
    final state against fp64, the states against the unsplit run."""
    from fastla.backends.triton import chunk_delta
    original = chunk_delta.default_config
    t, opts = bf16_case("bounded-gate")
    t = {n: x[:1] for n, x in t.items()}
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=0))
    (h_whole,) = check_fp64(t, opts, return_intermediate_states=True)
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: dataclasses.replace(original(p, **kw), segment_chunks=8))
    (h,) = check_fp64(t, opts, return_intermediate_states=True)
    assert torch.isfinite(h).all()
    assert_close("h", h, h_whole, 2e-2)


@pytest.mark.parametrize("gate,delta", [("softplus", True), ("given", True), ("bounded", True), ("given", False)])
@pytest.mark.parametrize("varlen", [False, True])
def test_wide_blocks_rewrite_flagged_blocks_exactly(gate, delta, varlen):
    """The wide-block kernel (chunk_prepare_kda_wide.py) on random block flags under decay far
    past the sm_90 prologue's span limit: every entry it owns (the flagged blocks' diagonals, their
    columns below, their rows left of the unflagged column blocks, their gated keys and queries)
    equals fp64, everything else stays poisoned. Without the delta rule (GLA): no A nor kg written, the rest as for KDA."""
    from fastla.backends.torch.chunked import _channel_scores_block
    from fastla.backends.triton import chunk_prepare_kda_wide
    from fastla.backends.triton.activations import BETA_SIGMOID
    from fastla.core.gates import kda_gate, l2norm
    from fastla.core.validation import build_problem

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreting():
        pytest.skip("the Triton kernels need CUDA or the interpreter")
    gen = torch.Generator().manual_seed(5)
    lengths = [70, 1, 129] if varlen else None
    B, T, H, HV, K = (1, sum(lengths), 2, 4, 32) if varlen else (2, 130, 2, 4, 32)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, K, generator=gen)
    beta = torch.randn(B, T, HV, generator=gen)
    gate_opts = {}
    if gate == "softplus":                             # -e^A softplus(g + dt_bias): spans to ~100 nats a token
        g = torch.randn(B, T, HV, K, generator=gen) * 4
        gate_opts = dict(gate_in_op="kda", A_log=torch.full((HV,), 1.5), dt_bias=torch.randn(HV * K, generator=gen) * 3)
        G = kda_gate(g.double(), gate_opts["A_log"].double(), gate_opts["dt_bias"].double(), None)
    elif gate == "bounded":                            # lower_bound sigmoid(e^A (g + dt_bias)), down to -20 a token
        g = torch.randn(B, T, HV, K, generator=gen) * 4
        gate_opts = dict(gate_in_op="kda", A_log=torch.zeros(HV), dt_bias=torch.randn(HV * K, generator=gen),
                         lower_bound=-20.0)
        G = kda_gate(g.double(), gate_opts["A_log"].double(), gate_opts["dt_bias"].double(), -20.0)
    else:                                              # a given log decay, some channels x 100
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, generator=gen))
        g[..., ::3] *= 100.0
        G = g.double()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()) if varlen else None
    p = build_problem("chunk_kda", q=q, k=k, v=v, gk=g, beta=beta, delta=True, gva=True, use_qk_l2norm=True,
                      cu_seqlens=cu, **gate_opts)
    p = dataclasses.replace(p, delta=delta)
    p = dataclasses.replace(p, q=p.q.to(device), k=p.k.to(device), gk=p.gk.to(device),
                            **{n: getattr(p, n).to(device) for n in ("A_log", "dt_bias") if getattr(p, n) is not None})
    seqs = [(0, n, s) for s, n in zip(cu[:-1].tolist(), lengths)] if varlen else \
           [(b, T, 0) for b in range(B)]
    chunks = [(b, s + c, min(n - c, 64)) for b, n, s in seqs for c in range(0, n, 64)]
    tables = (None, None)
    if varlen:                                         # (sequence, chunk within it) per chunk
        index = [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // 64))]
        tables = (cu.to(device), torch.tensor(index, dtype=torch.int32, device=device))
    total = len(chunks)
    flags = torch.randint(0, 16, (total, HV), generator=gen, dtype=torch.int32)
    flags[0] = 15
    nan = float("nan")
    a_kk, scores = (torch.full((B, T, HV, 64), nan, device=device) for _ in range(2))
    kg, kd, qg = (torch.full((B, T, HV, K), nan, device=device) for _ in range(3))
    chunk_prepare_kda_wide.launch(p, beta.to(device), BETA_SIGMOID, total, tables, a_kk, scores, kg, kd, qg,
                                  flags.to(device))

    kn, qn = l2norm(k.double()), l2norm(q.double()) * p.scale
    for i_c, (b, t0, n) in enumerate(chunks):
        rows = slice(t0, t0 + n)
        for hv in range(HV):
            kc, qc = kn[b, rows, hv // 2], qn[b, rows, hv // 2]
            Gc = G[b, rows, hv].cumsum(0)
            A = _channel_scores_block(kc[None], kc[None], Gc[None], strict=True)[0] * \
                torch.sigmoid(beta[b, rows, hv].double())[:, None]
            Aqk = _channel_scores_block(qc[None], kc[None], Gc[None], strict=False)[0]
            mine = torch.zeros(n, 64, dtype=torch.bool)           # entries the kernel writes
            own = torch.zeros(n, dtype=torch.bool)                # rows of flagged blocks
            for bi in range(4):
                for bj in range(bi + 1):
                    if (flags[i_c, hv] >> bi) & 1 or (flags[i_c, hv] >> bj) & 1:
                        mine[16 * bi:16 * bi + 16, 16 * bj:16 * bj + 16] = True
                own[16 * bi:16 * bi + 16] = bool((flags[i_c, hv] >> bi) & 1)
            for name, x, ref in (("A", a_kk, A), ("Aqk", scores, Aqk)):
                got = x[b, rows, hv].double().cpu()
                if name == "A" and not delta:
                    assert got.isnan().all(), (name, i_c, hv)              # GLA: no A
                    continue
                assert got[~mine].isnan().all(), (name, i_c, hv)
                ref = torch.nn.functional.pad(ref, (0, 64 - n))[mine]
                assert torch.allclose(got[mine], ref, rtol=1e-4, atol=1e-5), (name, i_c, hv)
            ek = torch.stack([Gc.exp() * kc, (Gc[-1] - Gc).exp() * kc, Gc.exp() * qc])
            for x, ref in zip((kg, kd, qg), ek):
                got = x[b, rows, hv].double().cpu()
                if x is kg and not delta:
                    assert got.isnan().all()                                # GLA: no kg
                    continue
                # fp32 exponents: the cumsum's rounding grows with |G| (up to ~2500 nats here)
                rtol = 1e-4 + 1e-6 * Gc.abs().max().item()
                assert got[~own].isnan().all() and torch.allclose(got[own], ref[own], rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("kernel", ["triton", "triton-beta-cols", "sm90", "sm90-beta-cols"])
@pytest.mark.parametrize("varlen", [False, True])
def test_inverse_kernel_matches_fp64(varlen, kernel):
    """The KDA inverse kernel (chunk_prepare_kda.launch_inverse after the sm_90 prologue; ``sm90``:
    its Gluon port, chunk_inverse_sm90.launch_kda, on an sm_90 GPU only): P = (I + A)^-1 per chunk and
    value head from a strictly lower fp32 A, partial last chunks included, against torch's fp64
    inverse of that A; rows past a chunk's end and entries on and above the diagonal are never read
    (poisoned) and rows past the end never written. ``*-beta-cols``: P diag(sigmoid(beta))
    (gluon/chunk_delta.BETA_IN_P), the same bound scaled by the columns' beta."""
    from types import SimpleNamespace

    from fastla.backends.triton import chunk_prepare_kda
    from fastla.backends.triton.activations import BETA_SIGMOID

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreting():
        pytest.skip("the Triton kernels need CUDA or the interpreter")
    if kernel.startswith("sm90"):
        from fastla.backends.gluon import available, chunk_inverse_sm90
        if device == "cpu" or available(torch.device(device)) is not None:
            pytest.skip("the Gluon kernel needs an sm_90 GPU")
    gen = torch.Generator().manual_seed(3)
    lengths = [70, 1, 129] if varlen else None
    B, T, HV = (1, sum(lengths), 3) if varlen else (2, 130, 3)
    seqs = [(0, n, s) for s, n in zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths)] if varlen else \
        [(b, T, 0) for b in range(B)]
    chunks = [(b, s + c, min(n - c, 64)) for b, n, s in seqs for c in range(0, n, 64)]
    nan = float("nan")
    a = torch.full((B, T, HV, 64), nan)
    for b, t0, n in chunks:         # beta (k_i . k_j) decay-like entries, up to ~1; NaN on and above the diagonal
        x = torch.randn(HV, n, 64, generator=gen) * 0.4
        a[b, t0:t0 + n] = torch.where(torch.ones(n, 64, dtype=torch.bool).tril(-1), x, nan).transpose(0, 1)
    tables = (None, None)
    if varlen:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        index = [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // 64))]
        tables = (cu.to(device), torch.tensor(index, dtype=torch.int32, device=device))
    out = torch.full((B, T, HV, 64), nan, device=device)
    launch = chunk_inverse_sm90.launch_kda if kernel.startswith("sm90") else chunk_prepare_kda.launch_inverse
    beta = torch.randn(B, T, HV, generator=gen) * 2
    cols = dict(beta=beta.to(device), beta_mode=BETA_SIGMOID) if kernel.endswith("beta-cols") else {}
    launch(SimpleNamespace(T=T, HV=HV), len(chunks), tables, a.to(device), out, **cols)
    for b, t0, n in chunks:
        for hv in range(HV):
            blk = a[b, t0:t0 + n, hv, :n].double().nan_to_num()
            eye = torch.eye(n, dtype=torch.float64)
            # (a triangular solve: exact zeros above the diagonal, where torch.linalg.inv leaves
            # ~1e-17 that the componentwise bound, ~1e-20 there, does not admit)
            ref = torch.linalg.solve_triangular(eye + blk, eye, upper=False, unitriangular=True)
            got = out[b, t0:t0 + n, hv].double().cpu()
            # on a GPU the block merges take tf32 operands (FLA's merge precision, u = 2^-11); the
            # bound is a triangular inverse's componentwise one, u |P| |I + A| |P| (Higham, Accuracy
            # and Stability, ch. 8): the H200 came within 0.08 of it here (0.07 on an entry of 30);
            # a swapped diagonal block or a dropped merge exceeds it 600x; the interpreter multiplies
            # in fp32
            if interpreting():
                tol = 1e-5 * (1 + ref.abs())
            else:
                tol = 2.0 ** -11 * (ref.abs() @ (eye + blk).abs() @ ref.abs())
            if cols:                # P diag(beta): the columns' factors scale P and its bound
                scale = beta[b, t0:t0 + n, hv].double().sigmoid()[None, :]
                ref, tol = ref * scale, tol * scale + 1e-7 * ref.abs() * scale
            assert ((got[:, :n] - ref).abs() <= tol).all(), (b, t0, hv)
            assert (got[:, n:] == 0).all(), (b, t0, hv)     # whole rows: zeros right of the chunk's end
