"""``python -m fastla demo | check | bench``.

- ``demo``: every public op forward and backward on small shapes on the best device
  present, with the relative error against the fp64 reference and the time per call.
- ``check``: versions, the GPU, and which tier serves each op (and why the others don't).
- ``bench``: the H200 benchmark harness (:mod:`fastla.bench.runner`).
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

import fastla
from fastla.core import dispatch
from fastla.core.reference import reference_for
from fastla.core.validation import build_problem
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fastla.ops.gla import chunk_gla, fused_recurrent_gla
from fastla.ops.kda import chunk_kda, fused_recurrent_kda
from fastla.ops.lightning_attn import chunk_lightning_attn, fused_recurrent_lightning_attn
from fastla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla


def _demo_cases(device, B=2, T=256, H=4, HV=8, K=64, V=64):
    """(public op, its kwargs, kwargs describing the same function to build_problem)."""
    def randn(*s):
        return torch.randn(*s, device=device)

    q, k = randn(B, T, H, K), F.normalize(randn(B, T, H, K), dim=-1)
    v_gva, v = randn(B, T, HV, V), randn(B, T, H, V)
    g_raw, gk_raw = randn(B, T, HV), randn(B, T, HV, K)
    beta_raw = randn(B, T, HV)
    A_log, dt_gdn, dt_kda = randn(HV) * 0.3, randn(HV), randn(HV * K)
    h0_gva, h0 = randn(B, HV, K, V), randn(B, H, K, V)
    g_gla = F.logsigmoid(randn(B, T, H, K)) / 8
    g_sgla = F.logsigmoid(randn(B, T, H))
    gdn = dict(q=q, k=k, v=v_gva, g=g_raw, beta=beta_raw, initial_state=h0_gva, use_gate_in_kernel=True,
               A_log=A_log, dt_bias=dt_gdn, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    gdn_p = dict(q=q, k=k, v=v_gva, g=g_raw, beta=beta_raw, initial_state=h0_gva, delta=True, gva=True,
                 gate_in_op="gdn", A_log=A_log, dt_bias=dt_gdn, use_qk_l2norm=True, beta_sigmoid=True)
    kda = dict(q=q, k=k, v=v_gva, g=gk_raw, beta=beta_raw, initial_state=h0_gva, use_gate_in_kernel=True,
               A_log=A_log, dt_bias=dt_kda, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               safe_gate=True, lower_bound=-5.0)
    kda_p = dict(q=q, k=k, v=v_gva, gk=gk_raw, beta=beta_raw, initial_state=h0_gva, delta=True, gva=True,
                 gate_in_op="kda", A_log=A_log, dt_bias=dt_kda, lower_bound=-5.0, use_qk_l2norm=True,
                 beta_sigmoid=True)
    gamma = fastla.core.gates.lightning_g_gamma(H, 2, 8, device)
    plain = dict(q=q, k=k, v=v, initial_state=h0)
    plain_p = dict(q=q, k=k, v=v, initial_state=h0, delta=False, gva=False)
    return [
        ("chunk_gated_delta_rule", chunk_gated_delta_rule, gdn, gdn_p),
        ("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule, gdn, gdn_p),
        ("chunk_kda", chunk_kda, kda, kda_p),
        ("fused_recurrent_kda", fused_recurrent_kda,
         {n: x for n, x in kda.items() if n != "safe_gate"}, kda_p),
        ("chunk_gla", chunk_gla, dict(plain, g=g_gla), dict(plain_p, gk=g_gla)),
        ("fused_recurrent_gla", fused_recurrent_gla, dict(plain, gk=g_gla), dict(plain_p, gk=g_gla)),
        ("chunk_simple_gla", chunk_simple_gla, dict(plain, g=g_sgla), dict(plain_p, g=g_sgla)),
        ("fused_recurrent_simple_gla", fused_recurrent_simple_gla, dict(plain, g=g_sgla), dict(plain_p, g=g_sgla)),
        ("chunk_lightning_attn", chunk_lightning_attn, dict(plain, layer_idx=2, num_layers=8),
         dict(plain_p, g_gamma=gamma)),
        ("fused_recurrent_lightning_attn", fused_recurrent_lightning_attn, dict(plain, layer_idx=2, num_layers=8),
         dict(plain_p, g_gamma=gamma)),
    ]


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def demo(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.manual_seed(0)
    print(f"fastla {fastla.__version__} demo on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'})")
    print(f"{'op':34s} {'tier':6s} {'fwd err':>9s} {'state err':>9s} {'fwd ms':>8s} {'fwd+bwd ms':>10s}")
    worst = 0.0
    for name, fn, kwargs, pkw in _demo_cases(device):
        problem = build_problem(name, output_final_state=True, **pkw)
        tier, _ = dispatch.select(name, problem)
        ref_o, ref_h = reference_for(problem)
        o, ht = fn(**kwargs, output_final_state=True)
        err_o, err_h = _rel(o, ref_o), _rel(ht, ref_h)
        worst = max(worst, err_o, err_h)
        leaves = {n: (x.detach().clone().requires_grad_(True) if isinstance(x, torch.Tensor) and n != "A_log"
                      else x) for n, x in kwargs.items()}
        _sync(device)
        t0 = time.perf_counter()
        fn(**kwargs, output_final_state=True)
        _sync(device)
        t1 = time.perf_counter()
        o, ht = fn(**leaves, output_final_state=True)
        ((o.float() * torch.ones_like(o, dtype=torch.float32)).sum() + ht.sum()).backward()
        _sync(device)
        t2 = time.perf_counter()
        print(f"{name:34s} {tier:6s} {err_o:9.2e} {err_h:9.2e} {1e3 * (t1 - t0):8.2f} {1e3 * (t2 - t1):10.2f}")
    ok = worst < 1e-4
    print(f"largest relative error vs the fp64 reference: {worst:.2e} ({'ok' if ok else 'TOO LARGE'})")
    return 0 if ok else 1


def check(args) -> int:
    import importlib.util

    def version(mod):
        if importlib.util.find_spec(mod) is None:
            return "not installed"
        try:
            return getattr(importlib.import_module(mod), "__version__", "installed")
        except Exception as exc:  # a broken install is worth reporting, not crashing on
            return f"import fails ({type(exc).__name__}: {exc})"

    print(f"fastla   {fastla.__version__}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {version('triton')}")
    print(f"fla      {version('fla')}")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"gpu      {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}, "
              f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    else:
        print("gpu      none (CUDA not available): every op runs on the torch tier")
    forced = dispatch.requested_tier()
    print(f"FASTLA_BACKEND: {forced or 'unset (automatic)'}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, _, _, pkw in _demo_cases(device, B=1, T=64, H=2, HV=4, K=64, V=64):
        problem = build_problem(name, **pkw)
        chosen, _ = dispatch.select(name, problem)
        reasons = "; ".join(f"{tier}: {why}" for tier, why in dispatch.explain(name, problem) if why)
        print(f"{name:34s} -> {chosen:6s} ({reasons or 'first choice'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run every op forward and backward, errors and times")
    p_demo.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is present")
    sub.add_parser("check", help="versions, GPU and the tier serving each op")
    sub.add_parser("bench", help="benchmark against FLA (GPU); see python -m fastla bench --help", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from fastla.bench.runner import main as bench_main
        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return demo(args) if args.command == "demo" else check(args)
