"""Precision of two chunked forms of GDN's state update, on the CPU (fp64 with bf16 roundings).

The shipped scan step: X = k S, Y = diag(beta) (v - diag(e^G) X), V_new = P Y,
S' = e^(G_l) S + k^T D V_new (D = diag(e^(G_l - G))), with S, k, Y, V_new and D V_new entering
the products in bf16 as in the sm_90 kernel. The one-product chain of docs/notes/gdn-prefill.md
(v20): S' = e^(G_l) S - N S + k^T D U, N = k^T D W, W = P diag(beta e^G) k, U = P diag(beta) v,
with N, W, U and S in bf16. Both run a random sequence (unit keys, sigmoid beta) and are compared
with the fp64 token-by-token recurrence, for three decays (mild, strong, almost none).

    python benchmarks/gdn_state_form_precision.py [--tokens 4096]
"""
from __future__ import annotations

import argparse
import math

import torch

BT = 64
F64 = torch.float64


def reference(k, v, g, beta):
    S = torch.zeros(k.shape[1], v.shape[1], dtype=F64)
    for t in range(k.shape[0]):
        S = S * math.exp(g[t])
        S = S + beta[t] * torch.outer(k[t], v[t] - k[t] @ S)
    return S


def chunked(k, v, g, beta, form: str, rounded: bool):
    r = (lambda x: x.to(torch.bfloat16).to(F64)) if rounded else (lambda x: x)
    S = torch.zeros(k.shape[1], v.shape[1], dtype=F64)
    for c0 in range(0, k.shape[0], BT):
        kc, vc, bc = k[c0:c0 + BT], v[c0:c0 + BT], beta[c0:c0 + BT]
        G = g[c0:c0 + BT].cumsum(0)
        n = kc.shape[0]
        A = torch.tril((bc[:, None] * (kc @ kc.T)) * torch.exp(G[:, None] - G[None, :]), -1)
        P = r(torch.linalg.inv(torch.eye(n, dtype=F64) + A))
        kb, D = r(kc), torch.exp(G[-1] - G)[:, None]
        if form == "shipped":
            Y = r(bc[:, None] * (vc - torch.exp(G)[:, None] * (kb @ r(S))))
            S = math.exp(G[-1]) * S + kb.T @ r(D * r(P @ Y))
        else:
            W = r(P @ r((bc * torch.exp(G))[:, None] * kc))
            U = r(P @ r(bc[:, None] * vc))
            S = math.exp(G[-1]) * S - r(kb.T @ r(D * W)) @ r(S) + kb.T @ r(D * U)
    return S


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    T = ap.parse_args().tokens
    torch.manual_seed(0)
    K = V = 128
    k = torch.nn.functional.normalize(torch.randn(T, K, dtype=F64), dim=-1)
    v = torch.randn(T, V, dtype=F64)
    beta = torch.sigmoid(torch.randn(T, dtype=F64))
    decays = {"mild": 0.5 * torch.nn.functional.logsigmoid(torch.randn(T, dtype=F64) + 4.0),
              "strong": torch.nn.functional.logsigmoid(torch.randn(T, dtype=F64)),
              "almost none": torch.full((T,), -1e-4, dtype=F64)}
    for name, g in decays.items():
        ref = reference(k, v, g, beta)
        errs = {f"{form} {'bf16' if rounded else 'fp64'}":
                ((chunked(k, v, g, beta, form, rounded) - ref).norm() / ref.norm()).item()
                for form in ("shipped", "one-product") for rounded in (False, True)}
        print(f"{name:12s} " + "  ".join(f"{key} {e:.2e}" for key, e in errs.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
