"""Precision of KDA's forward with the prologue's A (the strictly lower [64, 64] block per chunk and
value head that the inverse kernel turns into P = (I + A)^-1) stored in fp32 (shipped) or bf16, on
the CPU: fp64 arithmetic with the kernels' roundings (the gated keys and queries, P, the causal
scores, the state and V_new entering the products in bf16, the output in bf16), against the fp64
token-by-token recurrence. Inputs as the registry draws them (benchmarks' kda configs: l2norm, the
bounded gate computed in the op, beta sigmoid), one value head per draw.

    python benchmarks/kda_a_precision.py [--tokens 2048] [--heads 4]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fastla.core.gates import kda_gate

BT = 64
F64 = torch.float64


def bf16(x):
    return x.to(torch.bfloat16).to(F64)


def reference(q, k, v, g, beta, scale):
    """o [T, V], S [K, V]: S = diag(e^g_t) S + beta_t k_t (v_t - S^T k_t)^T, o_t = scale S^T q_t."""
    S = torch.zeros(k.shape[1], v.shape[1], dtype=F64)
    o = torch.empty(v.shape, dtype=F64)
    for t in range(k.shape[0]):
        S = torch.exp(g[t])[:, None] * S
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
        o[t] = scale * S.T @ q[t]
    return o, S


def chunked(q, k, v, g, beta, scale, a_dtype):
    """The kernels' chunked form with their roundings; A rounded to ``a_dtype`` before the inverse."""
    S = torch.zeros(k.shape[1], v.shape[1], dtype=F64)
    o = torch.empty(v.shape, dtype=F64)
    for c0 in range(0, k.shape[0], BT):
        qc, kc, vc, bc = q[c0:c0 + BT], k[c0:c0 + BT], v[c0:c0 + BT], beta[c0:c0 + BT]
        G = g[c0:c0 + BT].cumsum(0)                                         # [n, K]
        n = kc.shape[0]
        pair = torch.exp(G[:, None, :] - G[None, :, :])                     # [n, n, K]; used below the diagonal
        mask = torch.ones(n, n, dtype=torch.bool).tril(-1)
        A = torch.where(mask, bc[:, None] * torch.einsum("ic,jc,ijc->ij", kc, kc, pair), 0.0)
        A = A.to(a_dtype).to(F64)
        P = bf16(torch.linalg.inv(torch.eye(n, dtype=F64) + A))
        Aqk = bf16(torch.where(mask | torch.eye(n, dtype=torch.bool),
                               scale * torch.einsum("ic,jc,ijc->ij", qc, kc, pair), 0.0))
        kg, qg, kd = bf16(kc * torch.exp(G)), bf16(scale * qc * torch.exp(G)), bf16(kc * torch.exp(G[-1] - G))
        Sb = bf16(S)
        Vn = P @ bf16(bc[:, None] * (vc - kg @ Sb))
        o[c0:c0 + n] = bf16(qg @ Sb + Aqk @ bf16(Vn))
        S = torch.exp(G[-1])[:, None] * S + kd.T @ bf16(Vn)
    return o, S


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    T, K, V = args.tokens, 128, 128
    scale = K ** -0.5
    # the registry's draw; slow decay (softplus gate scaled to ~-0.01 a token: A's entries near
    # beta k_i . k_j); correlated keys (k_i . k_j ~ 0.9: A's entries near beta) with beta in (0, 2)
    cases = ("registry", "slow decay", "correlated keys, beta up to 2")
    for case in cases:
        rows = []
        for head in range(args.heads):
            gen = torch.Generator().manual_seed(head)
            q = F.normalize(torch.randn(T, K, generator=gen, dtype=F64), dim=-1)
            k = torch.randn(T, K, generator=gen, dtype=F64)
            if case.startswith("correlated"):
                k = torch.randn(1, K, generator=gen, dtype=F64) + 0.3 * k
            q, k = bf16(q), bf16(F.normalize(k, dim=-1))                    # (unit rows of bf16 inputs)
            v = bf16(torch.randn(T, V, generator=gen, dtype=F64))
            beta = torch.sigmoid(bf16(torch.randn(T, generator=gen, dtype=F64)))
            beta = 2 * beta if case.startswith("correlated") else beta
            raw = bf16(torch.randn(T, 1, K, generator=gen, dtype=F64))
            A_log = torch.log(torch.empty(1, dtype=F64).uniform_(1.0, 4.0, generator=gen))
            dt_bias = 0.5 * torch.randn(K, generator=gen, dtype=F64)
            if case == "slow decay":
                g = 0.01 * kda_gate(raw, torch.zeros(1, dtype=F64), dt_bias, None)[:, 0]
            else:
                g = kda_gate(raw, A_log, dt_bias, -5.0)[:, 0]               # [T, K], in [-5, 0)
            ro, rS = reference(q, k, v, g, beta, scale)
            errs = []
            for a_dtype in (torch.float32, torch.bfloat16):
                o, S = chunked(q, k, v, g, beta, scale, a_dtype)
                errs += [((o - ro).norm() / ro.norm()).item(), ((S - rS).norm() / rS.norm()).item()]
            rows.append(errs)
        e = torch.tensor(rows).mean(0).tolist()
        print(f"{case:32s} A fp32: o {e[0]:.3e} state {e[1]:.3e} | A bf16: o {e[2]:.3e} state {e[3]:.3e}"
              f" ({args.heads} heads, {T} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
