"""Packed batches past 2^31 elements on the GPU tiers (users: FLA #1173, 32-bit offsets overflowed
at about 524K tokens x 32 heads x 128).

A varlen batch of three sequences, 64 q/k and value heads, K = V = 128: the last sequence's q, k,
v, output (KDA: gate and prologue buffers) and (GDN) chunk states all lie past element 2^31 of
their tensors. Each sequence is run alone too (each such call stays under 2^31), and the batch must give
what the sequences give alone: the output, the final states and the chunk states. A 32-bit offset
would read or write another sequence's rows, or fault. The kernels' offsets were audited as int64
on the CPU (sm_90 IR of every variant, docs/notes/gdn-prefill.md v25); this runs them.

About 40-50 GB of GPU memory a case; `gpu_checks.sh tests` runs this file as its own group, in its
own process (an address fault ends the process)."""
import pytest
import torch
import torch.nn.functional as F

from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule
from fastla.ops.kda import chunk_kda
from tests.helpers import gpu, poison

H = HV = 64
K = V = 128
HEAD = 2 ** 31 // (HV * V)          # tokens before the last sequence: its first element is element 2^31
LENGTHS = (HEAD // 2, HEAD // 2, 1064)


def _inputs(op: str, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(LENGTHS)
    rnd = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    kw = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V),
              beta=torch.rand(1, T, HV, device="cuda", generator=gen).bfloat16(),
              initial_state=rnd(len(LENGTHS), HV, K, V, dtype=torch.float32), use_qk_l2norm_in_kernel=True)
    if op == "gdn":
        kw["g"] = F.logsigmoid(rnd(1, T, HV, dtype=torch.float32) + 3.0)
    else:                       # the registry's gate: raw input, A_log and dt_bias in the op, bounded
        kw.update(g=rnd(1, T, HV, K), A_log=rnd(HV, dtype=torch.float32), dt_bias=rnd(HV * K, dtype=torch.float32),
                  use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    return kw


def _rel_rms(x: torch.Tensor, ref: torch.Tensor, rows: int = 512) -> float:
    """``helpers.rel_rms`` over dim 1 in slices (a sequence's output is 2 GB in bf16); inf if any
    value is not finite."""
    assert x.shape == ref.shape, f"shape {tuple(x.shape)} vs {tuple(ref.shape)}"
    num = den = 0.0
    for i in range(0, x.shape[1], rows):
        a, b = x[:, i:i + rows].float(), ref[:, i:i + rows].float()
        if not torch.isfinite(a).all():
            return float("inf")
        num += (a - b).double().square().sum().item()
        den += b.double().square().sum().item()
    return (num / max(den, 1e-300)) ** 0.5


def _sequence(kw: dict, n: int) -> dict:
    """Sequence ``n`` of the batch alone (views of the batch's tensors)."""
    start = sum(LENGTHS[:n])
    part = {name: x[:, start:start + LENGTHS[n]] if isinstance(x, torch.Tensor) and x.dim() >= 3
            and name != "initial_state" else x for name, x in kw.items()}
    part["initial_state"] = kw["initial_state"][n:n + 1]
    return part


@pytest.fixture(autouse=True)
def _release_memory():
    """Give the cached blocks back after each case (groups of tests run side by side, each in its own
    process)."""
    yield
    torch.cuda.empty_cache()


@gpu
@pytest.mark.parametrize("tier", ["gluon", "triton"])
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_a_batch_past_2_31_elements_equals_its_sequences_alone(op, tier):
    if tier == "gluon" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    fn = chunk_gated_delta_rule if op == "gdn" else chunk_kda
    kw = _inputs(op, seed=7)
    assert kw["v"][:, sum(LENGTHS[:2]):].storage_offset() >= 2 ** 31
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    chunks = [0, *torch.tensor([-(-n // 64) for n in LENGTHS]).cumsum(0).tolist()]
    torch.cuda.empty_cache()
    poison()
    states = op == "gdn"            # (KDA's chunk states share the scan's code; 9 GB less at its peak)
    with use_tier(tier, strict=True), torch.no_grad():
        o, ht, *h = fn(**kw, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, output_final_state=True,
                       return_intermediate_states=states)
        assert not states or (h[0].shape[1] == chunks[-1] and h[0][:, chunks[2]:].storage_offset() >= 2 ** 31)
        for n in range(len(LENGTHS)):
            o_n, ht_n, *h_n = fn(**_sequence(kw, n), output_final_state=True, return_intermediate_states=states)
            pairs = [("o", o[:, cu[n]:cu[n + 1]], o_n), ("final state", ht[n:n + 1], ht_n)]
            if states:
                pairs.append(("chunk states", h[0][:, chunks[n]:chunks[n + 1]], h_n[0]))
            for name, batch, alone in pairs:
                err = _rel_rms(batch, alone)        # (a wrong row's error is ~1; plans may differ: tf32 merges)
                assert err <= 1e-2, f"sequence {n} ({LENGTHS[n]} tokens): {name} differs from alone by {err:.2e}"
            del o_n, ht_n, h_n, pairs


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
def test_a_pool_past_2_31_elements_equals_a_small_pool(dtype):
    """Decode on a state pool of 2100 slots (64 heads of 128 x 128: slots from 2048 on start past
    element 2^31; the bf16 pool takes the sm_90 streaming decode, the fp32 one the Triton kernel):
    outputs and updated slots equal those of a 40-slot pool holding the slots used (32 MB or more in
    bf16: the same kernel)."""
    from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as decode

    gen = torch.Generator(device="cuda").manual_seed(11)
    rnd = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    used = [2099, 2050, 7]
    N = len(used) + 1                                   # the last row is padding (slot -1)
    pool = rnd(2100, HV, K, V, dtype=dtype)
    small = rnd(40, HV, K, V, dtype=dtype)
    small[:len(used)] = pool[used]
    kw = dict(q=rnd(1, N, H, K), k=rnd(1, N, H, K), v=rnd(1, N, HV, V),
              g=F.logsigmoid(rnd(1, N, HV, dtype=torch.float32) + 3.0),
              beta=torch.rand(1, N, HV, device="cuda", generator=gen).bfloat16(), use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.arange(N + 1, device="cuda"), cu_seqlens_cpu=torch.arange(N + 1))
    poison()
    with torch.no_grad():
        o_big, _ = decode(**kw, initial_state=pool, ssm_state_indices=torch.tensor(used + [-1], device="cuda"))
        o_small, _ = decode(**kw, initial_state=small, ssm_state_indices=torch.tensor([0, 1, 2, -1], device="cuda"))
    assert torch.equal(o_big, o_small), "outputs differ"
    assert torch.equal(pool[used], small[:len(used)]), "updated slots differ"
