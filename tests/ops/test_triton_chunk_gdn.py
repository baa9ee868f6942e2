"""The Triton GDN chunked forward against the fp64 reference, through the public op;
on the CPU it runs in the Triton interpreter."""
import os

import pytest
import torch

from fastla.backends.triton import interpreting
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from tests.helpers import (
    KERNEL_DEVICES, OPS, assert_close, call_chunk, call_reference, make_inputs, on_device, strided_inputs,
)

SPEC = OPS["gdn"]


def on_triton(fn, *args, **kwargs):
    with use_tier("triton", strict=True), torch.no_grad():
        return fn(*args, **kwargs)


# on a GPU: bf16 products with fp32 accumulation (FLA's precision; FLA's own error is ~4e-3 on
# such inputs); in the CPU interpreter the kernels use float32 operands
TOL = 2e-5 if interpreting() else 1e-2


def check(t, tol=TOL, **opts):
    o, ht = on_triton(call_chunk, SPEC, t, output_final_state=True, **opts)
    opts.pop("cu_seqlens_cpu", None)                                     # chunk ops only
    ro, rht = call_reference(SPEC, t, output_final_state=True, **opts)
    assert_close("o", o, ro, tol)
    assert_close("final_state", ht, rht, tol)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 128, 130])    # 128: the length-specialized twins (launch.py)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_lengths(T, device):
    check(make_inputs(SPEC, B=2, T=T, H=2, HV=4, K=32, V=32, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [2, 64])
def test_one_token_bf16_wide_heads(B):
    """T = 1 at bf16 with K = V = 128 (the shipped products and tiles): this faulted on the H200
    (illegal address) while T = 1 was specialized to a constant; bf16 tolerance vs fp64."""
    t = make_inputs(SPEC, B=B, T=1, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    o, ht = on_triton(call_chunk, SPEC, t, output_final_state=True)
    ro, rht = call_reference(SPEC, {n: x.double() for n, x in t.items()}, output_final_state=True)
    assert_close("o", o, ro, 2e-2)
    assert_close("final_state", ht, rht, 2e-2)


@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130, 7], [200]])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_varlen(lengths, device):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device)
    check(make_inputs(SPEC, B=1, T=sum(lengths), H=2, HV=6, K=32, V=16, N=len(lengths), device=device), cu_seqlens=cu)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_inputs(device):
    """Strided views (q, k, v split from one projection, sliced gates, beta, state, offsets and the
    gate's parameters) run on this tier, through dense copies, with the contiguous inputs' results."""
    lengths = [70, 1, 59]
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=2, HV=4, K=32, V=32, N=len(lengths), device=device)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device)
    HV = 4
    extra = dict(A_log=torch.randn(HV, device=device) * 0.5, dt_bias=torch.randn(HV, device=device), cu_seqlens=cu)
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, output_final_state=True,
                cu_seqlens_cpu=cu.cpu())
    want = on_triton(chunk_gated_delta_rule, **t, **extra, **opts)
    got = on_triton(chunk_gated_delta_rule, **strided_inputs(t), **strided_inputs(extra), **opts)
    for name, a, b in zip(("o", "final_state"), got, want):
        assert torch.equal(a, b), f"{name} differs with strided inputs"


@pytest.mark.parametrize("K,V", [(32, 48), (64, 64), (128, 128)])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_head_dims(K, V, device):
    check(make_inputs(SPEC, B=1, T=70, H=1, HV=3, K=K, V=V, device=device))


@pytest.mark.parametrize("strength", [1e-3, 30.0])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decay_strength(strength, device):
    check(make_inputs(SPEC, B=1, T=130, H=1, HV=2, K=32, V=32, strength=strength, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_state_v_first_and_no_state(device):
    t = make_inputs(SPEC, B=2, T=70, H=1, HV=2, K=32, V=16, v_first=True, device=device)
    check(t, state_v_first=True)
    check(make_inputs(SPEC, B=2, T=70, H=1, HV=2, K=32, V=16, h0=False, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_everything_in_op(device):
    B, T, H, HV, K, V = 1, 90, 2, 4, 32, 32
    t = on_device(dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                       g=torch.randn(B, T, HV), beta=torch.randn(B, T, HV), initial_state=torch.randn(B, HV, K, V)),
                  device)
    opts = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, device=device) * 0.5,
                dt_bias=torch.randn(HV, device=device), use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, output_final_state=True)
    o, ht = on_triton(chunk_gated_delta_rule, **t, **opts)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, **t, **opts)
    assert_close("o", o, ro, TOL)
    assert_close("final_state", ht, rht, TOL)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_intermediate_states_match_torch_tier(varlen, device):
    t = make_inputs(SPEC, B=1 if varlen else 2, T=150, H=1, HV=2, K=32, V=16, N=3 if varlen else None, device=device)
    opts = dict(output_final_state=True, return_intermediate_states=True)
    if varlen:
        opts["cu_seqlens"] = torch.tensor([0, 70, 71, 150], device=device)
    with torch.inference_mode():
        o, ht, h = on_triton(call_chunk, SPEC, t, **opts)
        with use_tier("torch", strict=True):
            ro, rht, rh = call_chunk(SPEC, t, **opts)
    assert h.shape == rh.shape
    assert_close("h", h, rh, TOL)
    assert_close("o", o, ro, TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.skipif("FASTLA_TRITON_BACKWARD" in os.environ, reason="the default is what this checks")
def test_training_on_the_triton_tier_by_default(device):
    """A GDN forward whose inputs require grad is served by the Triton tier (its Triton backward,
    on by default; tests/ops/test_triton_chunk_backward.py checks its gradients)."""
    from fastla.core import dispatch
    from fastla.core.validation import build_problem
    t = make_inputs(SPEC, B=1, T=8, H=1, device=device)
    q = t["q"].requires_grad_()
    problem = build_problem("chunk_gated_delta_rule", q=q, k=t["k"], v=t["v"], g=t["g"], beta=t["beta"],
                            delta=True, gva=True)
    assert dict(dispatch.explain("chunk_gated_delta_rule", problem))["triton"] is None


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_correlated_keys_stay_exact(device):
    """Strongly correlated keys make I + A ill-conditioned: the inverse must still be exact (to the
    products' precision: fp32 in the interpreter, bf16 on a GPU)."""
    torch.manual_seed(0)
    B, T, H, K, V = 1, 128, 1, 16, 16
    shared = torch.randn(K)
    k = torch.nn.functional.normalize(shared + 0.3 * torch.randn(B, T, H, K), dim=-1)
    t = dict(q=torch.randn(B, T, H, K), k=k, v=torch.randn(B, T, H, V), g=torch.full((B, T, H), -0.01),
             beta=torch.full((B, T, H), 0.9), initial_state=torch.randn(B, H, K, V))
    check(on_device(t, device), tol=1e-4 if interpreting() else TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_beta_none_with_sigmoid_means_one_in_the_recurrent_sense(device):
    """The torch tier's convention: beta omitted is 1, whatever the beta-sigmoid flag says."""
    t = make_inputs(SPEC, B=1, T=70, H=1, K=16, V=16, device=device)
    t["beta"] = None
    with use_tier("torch", strict=True):
        ro, rht = chunk_gated_delta_rule(**t, output_final_state=True, use_beta_sigmoid_in_kernel=True)
    o, ht = on_triton(chunk_gated_delta_rule, **t, output_final_state=True, use_beta_sigmoid_in_kernel=True)
    assert_close("o", o, ro, TOL)
    assert_close("ht", ht, rht, TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_small_head_dim(device):
    check(make_inputs(SPEC, B=1, T=40, H=1, K=8, V=8, device=device))


@pytest.mark.parametrize("variant", ["three_stages", "wide_tiles", "segments_of_one_chunk", "segments_of_two_chunks",
                                     "segments_narrow_combine", "inverse_per_value_head", "inverse_shared_heads"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_launch_variants(variant, device, monkeypatch):
    """The non-default launch variants the GPU sweep times compute the same function (shared
    heads: both value heads in one inverse program, which this small grid would not choose)."""
    from fastla.backends.triton import chunk_delta, chunk_prepare
    if variant == "inverse_shared_heads":
        monkeypatch.setattr(chunk_prepare, "INVERSE_PROGRAMS_PER_SM", 0)
    config = {"three_stages": chunk_delta.ChunkConfig(scan_stages=3),
              "wide_tiles": chunk_delta.ChunkConfig(scan_block_v=64, scan_warps=8),
              "segments_of_one_chunk": chunk_delta.ChunkConfig(segment_chunks=1),
              "segments_of_two_chunks": chunk_delta.ChunkConfig(segment_chunks=2, scan_block_v=16),
              "segments_narrow_combine": chunk_delta.ChunkConfig(segment_chunks=2, combine_block_v=16),
              "inverse_per_value_head": chunk_delta.ChunkConfig(inverse_heads=1, inverse_warps=2),
              "inverse_shared_heads": chunk_delta.ChunkConfig(inverse_heads=2)}[variant]
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: config)
    lengths = [1, 63, 64, 65, 130]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=1, HV=2, K=32, V=64, N=len(lengths), device=device)
    check(t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_sequence_parallel_segments(v_first, h0, device, monkeypatch):
    """Segments of a long sequence run in parallel from their exact start states (summary pass:
    end state from zero and transition; combine; replay): output, final and chunk states match."""
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: chunk_delta.ChunkConfig(segment_chunks=2))
    t = make_inputs(SPEC, B=2, T=330, H=1, HV=2, K=32, V=16, h0=h0, v_first=v_first, device=device)
    opts = dict(output_final_state=True, return_intermediate_states=True, state_v_first=v_first)
    with torch.inference_mode():
        o, ht, h = on_triton(call_chunk, SPEC, t, **opts)
        with use_tier("torch", strict=True):
            ro, rht, rh = call_chunk(SPEC, t, **opts)
    assert_close("o", o, ro, TOL)
    assert_close("final_state", ht, rht, TOL)
    assert_close("h", h, rh, TOL)


def test_segment_heuristic():
    """Split only when lanes leave SMs idle and the sequence is long (cost model in chunk_delta)."""
    from fastla.backends.triton import chunk_delta
    plan = lambda lanes, counts: chunk_delta.segment_length(lanes, 2, 4, counts, 132)  # noqa: E731  (BV 64, K = V = 128, H200)
    assert plan(8, [512]) == 32                     # 1x32k HV8: 16 segments per head
    assert plan(64, [512]) == 0                     # HV64: the grid is already full
    assert plan(16, [128]) == 0                     # 1x8k HV16: the split does not pay
    assert plan(8, [128]) == 16                     # 1x8k HV8: 8 and 16 tie, the longer wins (measured)
    assert plan(8, [12]) == 0                       # too short
    assert plan(8, [512]) % chunk_delta.MIN_SEGMENT_CHUNKS == 0
    # with the sm_90 tier's summary pass (its gain): 1x8k HV16 splits; varlen 9x16k splits its
    # long sequences at HV8 (the short ones fill the waves: whole 110 steps, 24-chunk segments 53;
    # no summaries of last segments), not at HV16 (110 vs 69 at 32 chunks)
    from fastla.backends.gluon.chunk_delta import SEGMENT_GAIN_SM90 as gain
    varlen = [-(-n // 64) for n in (7000, 1300, 547, 2048, 963, 271, 3063, 1, 1191)]
    assert chunk_delta.segment_length(16, 2, 4, [128], 132, gain) == 16
    assert chunk_delta.segment_length(72, 2, 4, varlen, 132, gain) == 24
    assert chunk_delta.segment_length(144, 2, 4, varlen, 132, gain) == 0
    assert chunk_delta.segment_length(8, 2, 4, [512], 132, gain) == 32
    assert chunk_delta.segment_length(32, 2, 4, [512], 132, gain) == 0    # 1x32k HV32: measured a loss


def test_segment_cost_model_takes_waves_and_mixed_lengths():
    """The split's cost model: list scheduling (longest first on the first free slot) is the
    waves model on dense batches, and on mixed lengths the short programs fill beside the long."""
    from collections import Counter

    from fastla.backends.triton.chunk_delta import _makespan
    assert _makespan(Counter({10: 264}), 264) == 10
    assert _makespan(Counter({10: 265}), 264) == 20                 # a second wave
    assert _makespan(Counter({110: 8, 5: 500}), 264) == 110        # under the longest
    assert _makespan(Counter({4: 3, 3: 3, 2: 3}), 3) == 9 and _makespan(Counter({7: 1, 3: 3}), 2) == 9
    assert _makespan(Counter({0: 4}), 2) == 0 and _makespan(Counter(), 8) == 0


def test_varlen_sequence_orders():
    """Whole varlen sequences in two orders: longest first (ties by index; the sm_90 scans'
    dispatch order) and as given."""
    from types import SimpleNamespace

    from fastla.backends.triton import chunk_delta
    cu = (0, 130, 130, 1000, 1001, 1065, 1930)              # 3, 0, 14, 1, 1 and 14 chunks
    p = SimpleNamespace(cu_seqlens_host=cu, cu_seqlens=torch.tensor(cu), device=torch.device("cpu"))
    index, starts, total, orders, offsets = chunk_delta._varlen_index(p)
    assert total == 33 and starts.tolist() == [0, 3, 3, 17, 18, 19]
    assert orders.tolist() == [[2, 5, 0, 3, 4, 1], [0, 1, 2, 3, 4, 5]]
    assert offsets.dtype == torch.int64 and offsets.tolist() == list(cu)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_offsets_on_the_host_only(op, device):
    """Offsets given only as cu_seqlens_cpu (no device cu_seqlens) are a varlen batch on this tier,
    as on the torch tier (it ran them as one dense sequence and wrote past its buffers)."""
    from tests.ops.test_triton_chunk_kda import SPEC as KDA
    spec = SPEC if op == "gdn" else KDA
    lengths = [70, 1, 30]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(spec, B=1, T=sum(lengths), H=1, HV=2, K=32, V=16, N=len(lengths), device=device)
    host_only = on_triton(call_chunk, spec, t, output_final_state=True, cu_seqlens_cpu=cu)
    both = on_triton(call_chunk, spec, t, output_final_state=True, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    for name, a, b in zip(("o", "final_state"), host_only, both):
        assert torch.equal(a, b), f"{name} differs with the offsets on the host only"


def test_inverse_heads_per_program():
    """Value heads share an inverse program while the grid keeps 6 programs per SM (H200: 792)."""
    from fastla.backends.triton.chunk_prepare import values_per_program
    assert values_per_program(4, 4, 32768, 132) == 4                 # 1x32k HV64
    assert values_per_program(4, 4, 4096, 132) == 4                  # 1x32k HV8: 1024 programs
    assert values_per_program(4, 4, 2088, 132) == 2                  # varlen 9x16k HV8
    assert values_per_program(4, 4, 1024, 132) == 1                  # 1x8k HV8
    assert values_per_program(3, 4, 100, 132) == 1 and values_per_program(6, 4, 10 ** 6, 132) == 3


@pytest.mark.parametrize("segments", [0, 1])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_empty_sequence_keeps_its_initial_state(segments, device, monkeypatch):
    """An empty sequence in a varlen batch: zero output rows, final state = its initial state,
    with and without the segment split (an empty sequence gets one empty segment)."""
    from fastla.backends.triton import chunk_delta
    monkeypatch.setattr(chunk_delta, "default_config", lambda p, **kw: chunk_delta.ChunkConfig(segment_chunks=segments))
    lengths = [130, 0, 65]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(SPEC, B=1, T=sum(lengths), H=1, HV=2, K=16, V=16, N=len(lengths), device=device)
    check(t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


def test_tables_used_in_a_graph_capture_are_never_evicted():
    from fastla.backends.triton.chunk_delta import _HostTables
    tables = _HostTables(limit=4)
    kept = tables.get("captured", lambda: torch.arange(3), pin=True)
    for i in range(10):
        tables.get(i, lambda: torch.zeros(1))
    assert tables.cached("captured") and tables.get("captured", lambda: None) is kept
    assert len(tables.cache) == 4 and not tables.cached(0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_pieces_carry_the_state(device):
    """A sequence run as pieces of whole chunks (chunk_delta.run_in_pieces: the sm_90 tier's GDN
    pipeline cuts it so), each piece starting from the previous one's final state: the whole call's
    output and final state, in both state layouts, with and without an initial state, and for
    offsets [0, T] (a packed batch of one sequence: the pieces drop them); the last piece ends
    mid-chunk."""
    from fastla.backends.triton import chunk_delta
    from fastla.core.validation import build_problem

    T = 150
    cu = torch.tensor([0, T])
    for v_first, h0, offsets, pieces in ((False, True, False, 3), (True, False, False, 2), (False, True, True, 2)):
        t = make_inputs(SPEC, B=1, T=T, H=1, HV=2, K=32, V=32, h0=h0, v_first=v_first, device=device)
        varlen = dict(cu_seqlens=cu.to(device), cu_seqlens_cpu=cu) if offsets else {}
        problem = build_problem("chunk_gated_delta_rule", **t, delta=True, gva=True, output_final_state=True,
                                state_v_first=v_first, **varlen)
        with use_tier("triton", strict=True), torch.no_grad():
            whole_o, whole_ht = chunk_delta.run(problem)
            cuts = chunk_delta.piece_cuts(T, pieces)
            assert cuts == ([0, 64, 128, T] if pieces == 3 else [0, 64, T])
            o, ht = chunk_delta.run_in_pieces(problem, cuts, lambda sub, out: chunk_delta.run(sub, out=out))
        assert_close("o", o, whole_o, 1e-6)
        assert_close("final_state", ht, whole_ht, 1e-6)
