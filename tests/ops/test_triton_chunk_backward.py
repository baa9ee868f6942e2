"""The Triton backward of the scalar-gate chunked ops (GDN, Simple GLA, Lightning;
chunk_training.py, chunk_delta_backward.py) against the fp64 reference: every gradient through
the public autograd API, loss (o*do).sum() + (ht*dht).sum(); on the CPU it runs in the Triton
interpreter."""
import pytest
import torch

from fastla.backends.triton import chunk_training, interpreting
from fastla.core import dispatch
from fastla.core.dispatch import use_tier
from fastla.core.validation import build_problem
from tests.helpers import (
    KERNEL_DEVICES, OPS, as_leaves, assert_close, call_chunk, call_reference, forward_backward, gated_case,
    make_inputs, random_final_state_grad,
)

SPEC = OPS["gdn"]
# fp32 operands in the interpreter; on a GPU tf32 products for fp32 inputs (unit roundoff 2^-11:
# ~5e-4 a product; the gradients' bound is 10x, 2e-2; bf16 cases pass their own bounds)
TOL = 2e-5 if interpreting() else 2e-3


@pytest.fixture(autouse=True)
def backward_on(monkeypatch):
    monkeypatch.setattr(chunk_training, "ENABLED", True)


def check(t, extra=None, dht=True, tol=TOL, grad_tol=None, spec=SPEC, param_tol=None, **opts):
    """``t``: the tensors (leaves), ``extra``: leaves the reference takes as keywords too (A_log,
    dt_bias), ``opts``: the op's options (cu_seqlens_cpu to the op under test only). Outputs within
    ``tol``, gradients within ``grad_tol`` (10 x tol) of the fp64 reference, those of ``extra``
    within ``param_tol`` (grad_tol)."""
    extra = extra or {}
    leaves = as_leaves({**t, **extra})
    device = t["q"].device
    do = torch.randn(t["v"].shape, device=device)
    host = opts.pop("cu_seqlens_cpu", None)

    def fast(x, **kw):
        with use_tier("triton", strict=True):
            return call_chunk(spec, x, **kw, **({"cu_seqlens_cpu": host} if host is not None else {}))

    final = opts.get("output_final_state", True)
    opts["output_final_state"] = final
    d_final = random_final_state_grad(t, **opts) if dht and final else None
    o, ht, grads = forward_backward(fast, leaves, do, d_final, **opts)
    ref = lambda x, **kw: call_reference(spec, x, **kw)  # noqa: E731
    ro, rht, rgrads = forward_backward(ref, as_leaves({**t, **extra}, torch.float64), do, d_final, **opts)
    assert_close("o", o, ro, tol)
    if final:
        assert_close("final_state", ht, rht, tol)
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        limit = grad_tol or tol * 10
        assert_close(f"d{name}", g, rgrads[name], param_tol if name in extra and param_tol else limit)


@pytest.mark.parametrize("T", [1, 65])            # (longer: test_strong_decay, test_varlen)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_lengths(T, device):
    check(make_inputs(SPEC, B=2, T=T, H=2, HV=4, K=32, V=32, device=device))


@pytest.mark.parametrize("save_states", [True, False])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_varlen(save_states, device, monkeypatch):
    """Mixed lengths; the chunk states kept by the forward or recomputed by the backward."""
    monkeypatch.setattr(chunk_training, "SAVE_STATES", save_states)
    lengths = [1, 63, 64, 65, 130, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=1, HV=2, K=32, V=32, N=len(lengths), device=device)
    check(t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_everything_in_op(device):
    """The gate from A_log and dt_bias (both learned), the l2norm, beta as logits with negative
    eigenvalues, a V-first state; their gradients through PyTorch around the kernels."""
    t = make_inputs(SPEC, B=2, T=70, H=2, HV=4, K=32, V=48, device=device, v_first=True)
    t["g"] = torch.randn_like(t["g"])
    t["beta"] = torch.randn_like(t["beta"])
    extra = dict(A_log=torch.randn(4, device=device) * 0.5, dt_bias=torch.randn(4, device=device))
    check(t, extra, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          allow_neg_eigval=True, state_v_first=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_without_states(device):
    """No initial state, no final state: the output's gradient alone."""
    check(make_inputs(SPEC, B=1, T=100, H=1, HV=1, K=64, V=64, device=device, h0=False),
          output_final_state=False)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strong_decay(device):
    check(make_inputs(SPEC, B=1, T=130, H=2, HV=2, K=32, V=32, device=device, strength=20.0))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_served_where_it_can(device, monkeypatch):
    """Calls the Triton backward cannot serve say why and go to the torch tier; off, it says so."""
    t = as_leaves(make_inputs(SPEC, B=1, T=64, H=1, K=32, V=32, device=device))
    p = build_problem("chunk_gated_delta_rule", **t, delta=True, gva=True, return_intermediate_states=True)
    assert "return_intermediate_states" in dict(dispatch.explain("chunk_gated_delta_rule", p))["triton"]
    p = build_problem("chunk_gated_delta_rule", **t, delta=True, gva=True)
    assert dict(dispatch.explain("chunk_gated_delta_rule", p))["triton"] is None
    monkeypatch.setattr(chunk_training, "ENABLED", False)
    assert "FASTLA_TRITON_BACKWARD" in dict(dispatch.explain("chunk_gated_delta_rule", p))["triton"]
    kda = OPS["kda"]
    tk = as_leaves(make_inputs(kda, B=1, T=64, H=1, K=32, V=32, device=device))
    pk = build_problem("chunk_kda", gk=tk.pop("g"), **tk, delta=True, gva=True, chunk_size=32)
    monkeypatch.setattr(chunk_training, "ENABLED", True)
    assert "chunk_size" in dict(dispatch.explain("chunk_kda", pk))["triton"]
    monkeypatch.setattr(chunk_training, "ENABLED", ("chunk_gated_delta_rule",))      # (one op on)
    assert dict(dispatch.explain("chunk_gated_delta_rule", p))["triton"] is None
    assert "FASTLA_TRITON_BACKWARD" in dict(dispatch.explain("chunk_kda", pk))["triton"]


def check_bf16(op, device, lengths=None, T=400, K=128, V=None):
    """bf16 inputs, every activation in the op (tests.helpers.gated_case): every gradient against
    the fp64 reference within FLA-level error (its bf16 forward is ~4e-3 off). A_log's and
    dt_bias's gradients are sums of dg over every token (of each head; KDA's dt_bias of each head
    and channel), where bf16 operands' rounding cancels less than the values do: on an H100 KDA's
    dA_log at K = V = 64 drew 3.5e-3 to 2.4e-2 on five seeds, ddt_bias 7e-3 to 1e-2, while dg,
    from which autograd forms both, stayed within 3.6e-3 (docs/notes/chunk-backward.md); KDA's get
    5e-2 (GDN's drew 3.7-5.0e-3: the common 2e-2)."""
    t, extra, opts = gated_case(op, T=T, K=K, device=device, lengths=lengths, V=V)
    check(t, extra, tol=1e-2, grad_tol=2e-2, param_tol=5e-2 if op == "kda" else None, spec=OPS[op], **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_bf16_wide_heads_on_gpu(op, varlen):
    """The shipped products at K = V = 128: bf16 operands, fp32 accumulation, bf16 chunk states."""
    from tests.helpers import poison

    poison()
    check_bf16(op, "cuda", [300, 1, 64, 65, 500] if varlen else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_one_row_chunk_on_gpu():
    """GDN dense at T = 65 (each sequence's last chunk one row): the key kernel pipelined over two
    stages got dk 2.7e-2 off on an H100 there (1.4e-1 varlen with 1-row chunks), the interpreter
    right; one stage passes (chunk_delta_backward.KEY_STAGES)."""
    from tests.helpers import poison

    poison()
    check_bf16("gdn", "cuda", T=65)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("varlen", [False, True])
def test_bf16_kda_score_loops_on_gpu(varlen, monkeypatch):
    """KDA's score kernel with every diagonal block a row and a column at a time (the wide blocks'
    form) at the bounded gate, where the default takes the products."""
    from fastla.backends.triton import chunk_channel_backward
    from tests.helpers import poison

    monkeypatch.setattr(chunk_channel_backward, "SCORE_DIAGONAL_PRODUCTS", False)
    poison()
    check_bf16("kda", "cuda", [300, 1, 64, 65, 500] if varlen else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [16, 64])
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_bf16_narrow_heads_on_gpu(op, K):
    """K = V = 16 (the reverse scan's 16-column build, whose bf16 products faulted on an H100 as an
    A/B at K = 128: docs/notes/chunk-backward.md) and 64, bf16."""
    from tests.helpers import poison

    poison()
    check_bf16(op, "cuda", K=K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K,V", [(64, 32), (128, 32), (128, 24)])
def test_bf16_kda_narrow_values_on_gpu(K, V):
    """KDA at V <= 32, whose value kernel's one 32-column tile faulted under CUDA 12.8's ptxas on an
    H100 (K 64, V 32); 16-column tiles passed there (chunk_channel_backward.value_block)."""
    from tests.helpers import poison

    poison()
    check_bf16("kda", "cuda", K=K, V=V)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("op", ["gla", "simple_gla", "lightning"])
def test_bf16_plain_rule_on_gpu(op, K):
    """The plain rule's bf16 backward at K = V = 64 (GLA's value kernel once lost its products
    there: two tiles, docs/notes/chunk-backward.md) and 128."""
    from tests.helpers import poison

    poison()
    spec = OPS[op]
    check(make_inputs(spec, B=2, T=400, H=2, K=K, V=K, dtype=torch.bfloat16, device="cuda"), spec=spec, tol=1e-2,
          grad_tol=2e-2)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's products, rounded as a GPU's")
@pytest.mark.parametrize("op,varlen", [("gdn", False), ("gdn", True)])
def test_bf16_path_in_interpreter(op, varlen, monkeypatch):
    """The GPU's bf16 path in the interpreter (which otherwise runs the backward on float32
    operands and states): bf16 operands and chunk states (kept by the forward), float32 operands
    rounded to tf32, casts to bf16 rounded to nearest (tests/interpreter_emulation.py). KDA's
    bf16 path: test_option_fuzz.py's test_triton_backward_bf16_path_in_interpreter (dense, GVA;
    its varlen indexing runs in the other interpreter tests)."""
    from triton.runtime.interpreter import InterpreterBuilder

    from fastla.backends.triton import chunk_delta_backward
    from tests import interpreter_emulation

    monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_emulation.emulated_dot(tf32=True))
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", interpreter_emulation.emulated_cast)
    monkeypatch.setattr(chunk_delta_backward, "interpreting", lambda: False)
    seen = []
    reverse_scan = chunk_delta_backward.reverse_scan
    monkeypatch.setattr(chunk_delta_backward, "reverse_scan", lambda c, *a, **kw: seen.append(c) or reverse_scan(c, *a, **kw))
    monkeypatch.setattr(chunk_delta_backward, "chunk_states", lambda *a, **kw: pytest.fail("states recomputed"))
    check_bf16(op, "cpu", [50, 1, 64, 20] if varlen else None, T=80, K=32)
    assert seen and all(c.op_dtype == c.state_dtype == torch.bfloat16 for c in seen)


@pytest.mark.parametrize("op", ["simple_gla", "lightning"])
@pytest.mark.parametrize("T", [1, 65, 130])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_plain_rule(op, T, device):
    """Simple GLA (a gate per token) and Lightning (the constant per-head decay): no beta, V_new = v."""
    spec = OPS[op]
    check(make_inputs(spec, B=2, T=T, H=2, K=32, V=32, device=device), spec=spec)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_plain_rule_varlen_gate_and_constant_decay(device):
    """Simple GLA with both g and g_gamma (their sum decays; both learned) and varlen offsets."""
    spec = OPS["simple_gla"]
    lengths = [1, 64, 70, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(spec, B=1, T=sum(lengths), H=2, K=32, V=48, device=device, N=len(lengths))
    check(t, dict(g_gamma=-torch.rand(2, device=device)), spec=spec, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


@pytest.mark.parametrize("op,T", [("kda", 1), ("gla", 1), ("gla", 70)])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_channel_gates(op, T, device):
    """Per-channel gates: KDA (GVA; longer sequences in the tests below) and GLA (the plain rule)."""
    spec = OPS[op]
    check(make_inputs(spec, B=2, T=T, H=2, HV=4 if spec.gva else None, K=32, V=32, device=device), spec=spec)


@pytest.mark.parametrize("op", ["kda", "gla"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_channel_gates_varlen_strong_decay(op, device):
    """Mixed lengths (partial blocks and chunks) under strong decay (spans of hundreds of nats in a
    16-token block: the blocks' references and the exact diagonal keep every exponent <= 0); the
    score kernel's diagonal blocks both ways: the whole ones, past the span limit, by the loops,
    the short ones (1-5 rows) by the products."""
    spec = OPS[op]
    lengths = [1, 17, 64, 79, 5]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(spec, B=1, T=sum(lengths), H=1, HV=2 if spec.gva else None, K=32, V=48, device=device,
                    N=len(lengths), strength=30.0)
    check(t, spec=spec, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


@pytest.mark.parametrize("lower_bound,fused_gate", [(None, True), (-5.0, True), (-5.0, False)])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kda_everything_in_op(lower_bound, device, fused_gate, monkeypatch):
    """The KDA gate from learned A_log and dt_bias (softplus, or bounded by lower_bound with
    safe_gate; in PyTorch or by gate_grads' kernels, whose every gate form test_fused_kda_gate
    checks), the l2norm, beta logits, a V-first state."""
    monkeypatch.setattr(chunk_training, "FUSED_KDA_GATE", fused_gate)
    spec = OPS["kda"]
    t = make_inputs(spec, B=1, T=90, H=2, HV=4, K=32, V=32, device=device, v_first=True)
    t["g"] = torch.randn_like(t["g"])
    t["beta"] = torch.randn_like(t["beta"])
    extra = dict(A_log=torch.randn(4, device=device) * 0.5, dt_bias=torch.randn(4 * 32, device=device))
    check(t, extra, spec=spec, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
          use_beta_sigmoid_in_kernel=True, state_v_first=True, safe_gate=lower_bound is not None,
          lower_bound=lower_bound)


@pytest.mark.parametrize("K", [48, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate", ["softplus", "bounded", "bounded-no-A", "no-bias"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fused_kda_gate(gate, dtype, K, device):
    """gate_grads.kda_gate (two Triton kernels) against fastla.core.gates.kda_gate in fp64: the log
    decay and the gradients of g_raw, A_log and dt_bias, 70 token rows (not a multiple of the
    kernels' 32), K a power of two or not."""
    from fastla.backends.triton import gate_grads
    from fastla.core.gates import kda_gate

    gen = torch.Generator().manual_seed(7)
    B, T, HV = 2, 35, 3
    g_raw = (2 * torch.randn(B, T, HV, K, generator=gen)).to(dtype)
    A_log = None if gate == "bounded-no-A" else torch.randn(HV, generator=gen) * 0.5
    dt_bias = None if gate == "no-bias" else torch.randn(HV * K, generator=gen)
    lower_bound = None if gate in ("softplus", "no-bias") else -5.0
    dgk = torch.randn(B, T, HV, K, generator=gen)
    named = {n: x for n, x in (("g_raw", g_raw), ("A_log", A_log), ("dt_bias", dt_bias)) if x is not None}

    def run(fn, dev, float_dtype, raw_dtype):
        xs = {n: x.detach().to(dev, raw_dtype if n == "g_raw" else float_dtype).requires_grad_()
              for n, x in named.items()}
        out = fn(xs["g_raw"], xs.get("A_log"), xs.get("dt_bias"), lower_bound)
        out.backward(dgk.to(dev, out.dtype))
        return out, {n: x.grad for n, x in xs.items()}

    out, got = run(gate_grads.kda_gate, device, torch.float32, dtype)
    ref, want = run(kda_gate, "cpu", torch.float64, torch.float64)
    assert out.dtype == torch.float32
    assert got["g_raw"].dtype == dtype
    assert_close("gk", out.cpu(), ref, 1e-6)
    for name, g in got.items():
        # (d g_raw is stored in g_raw's dtype: bf16's rounding, 2^-9)
        assert_close(f"d{name}", g.cpu(), want[name], 4e-3 if dtype == torch.bfloat16 and name == "g_raw" else 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("varlen", [False, True])
def test_bf16_fused_kda_gate_on_gpu(varlen, monkeypatch):
    """KDA's bf16 cases with the gate by gate_grads' kernels (chunk_training.FUSED_KDA_GATE)."""
    from tests.helpers import poison

    monkeypatch.setattr(chunk_training, "FUSED_KDA_GATE", True)
    poison()
    check_bf16("kda", "cuda", [300, 1, 64, 65, 500] if varlen else None)


@pytest.mark.parametrize("op", ["gdn", "simple_gla"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strong_decay_partial_chunk(op, device):
    """A partial last chunk under decay past e^-88 within it: the rows past the end must not turn
    the scores' gate factors into inf (inf * 0 made dg NaN before)."""
    spec = OPS[op]
    check(make_inputs(spec, B=1, T=40, H=1, K=32, V=32, device=device, strength=30.0), spec=spec)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_without_gate(op, device):
    """g=None (no decay), which the forward accepts."""
    spec = OPS[op]
    t = make_inputs(spec, B=1, T=70, H=1, K=32, V=32, device=device)
    del t["g"]
    check(t, spec=spec, g=None)
