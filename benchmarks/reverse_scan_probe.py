"""The Triton backward's reverse scan (backends/triton/chunk_delta_backward.py, _reverse_scan_kernel)
against its own recurrence in float64 on the same inputs: ``python benchmarks/reverse_scan_probe.py
RUN.pt [OUT.pt]`` with RUN.pt from ``benchmarks/backward_stages.py run`` (dense batches, the launch's
tensors saved after it ran). Prints, per sequence and chunk (last to first), the relative RMS of the
kernel's dS' (the state gradient stored at each chunk's end), then R and dh0, against the recurrence
with the kernel's bf16 operand roundings (and, for scale, with none); OUT.pt: the launch's tensors
in bf16 where that is exact (to compare runs on the CPU machine)."""
import sys

import torch


def recurrence(a, H, K, scale, gk, rnd):
    """(dS' per global chunk, R, dh0) of the reverse scan on the launch's tensors ``a``."""
    q, k, P, A, do, dht, beta = (a[n].double() for n in ("q", "k", "p_in", "a_in", "do", "dht", "beta"))
    B, T, HV, V = do.shape
    BT, NT = 64, (T + 63) // 64
    dS_chunks = torch.zeros(B * NT, HV, K, V, dtype=torch.float64)
    R = torch.zeros(B, T, HV, V, dtype=torch.float64)
    dh0 = torch.zeros(B, HV, K, V, dtype=torch.float64)
    for b in range(B):
        for hv in range(HV):
            h = hv if gk else hv // (HV // H)
            dS = dht[b, hv].clone()
            for c in reversed(range(NT)):
                dS_chunks[b * NT + c, hv] = dS
                s = slice(c * BT, min(T, (c + 1) * BT))
                n = s.stop - s.start
                qc, kc, doc, bc = q[b, s, h], k[b, s, h], do[b, s, hv], beta[b, s, hv]
                Ac, Pc = A[b, s, hv, :n].tril(), P[b, s, hv, :n].tril()
                if gk:
                    kd, decay = a["kd"].double()[b, s, hv], a["decay"].double()[b * NT + c, hv]
                    dvn = Ac.T @ rnd(doc) + kd @ rnd(dS)
                    dS = dS * decay[:, None] + qc.T @ rnd(doc)
                    eG = torch.ones(n, dtype=torch.float64)
                else:
                    G = a["gcum"].double()[b, s, hv]
                    eG = G.exp()
                    dvn = Ac.T @ rnd(doc) + (G[-1] - G).exp()[:, None] * (kc @ rnd(dS))
                    dS = dS * G[-1].exp() + qc.T @ rnd(scale * eG[:, None] * doc)
                r = Pc.T @ rnd(dvn)
                dS = dS - kc.T @ rnd((eG * bc)[:, None] * r)
                R[b, s, hv] = r
            dh0[b, hv] = dS
    return dS_chunks, R, dh0


def rel(x, y):
    return ((x.double() - y).norm() / y.norm().clamp_min(1e-300)).item()


def main(path, out=None):
    run = torch.load(path)
    key = next(n for n in run if n.startswith("_reverse_scan_kernel"))
    a = run[key]
    B, T, HV, V = a["do"].shape
    gk = a["kd"].dim() == 4
    H = a["q"].shape[2]
    K = a["q"].shape[3]
    scale = K ** -0.5
    bf16 = lambda x: x.to(torch.bfloat16).double()      # noqa: E731
    exact = recurrence(a, H, K, scale, gk, lambda x: x)
    rounded = recurrence(a, H, K, scale, gk, bf16)
    NT = (T + 63) // 64
    print(f"{key} ({'per-channel' if gk else 'scalar'} gate; B {B} T {T} HV {HV}): kernel vs the recurrence "
          "with its roundings (vs exact) | the roundings' own distance from exact")
    for b in range(B):
        line = [f"{rel(a['dh_chunks'][b * NT + c], rounded[0][b * NT + c]):.1e}" for c in reversed(range(NT))]
        print(f"  seq {b} dS' chunks {NT - 1}..0:", " ".join(line))
    for i, name in ((1, "r_out"), (2, "dh0")):
        print(f"  {name}: {rel(a[name], rounded[i]):.1e} ({rel(a[name], exact[i]):.1e}) | {rel(rounded[i], exact[i]):.1e}")
    if out:
        small = {}
        for n, x in a.items():
            y = x.to(torch.bfloat16)
            small[n] = y if torch.equal(y.float(), x) else x
        torch.save({key: small}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
