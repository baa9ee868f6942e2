"""Host time per eager call of registry configs: calls issued back to back under no_grad, no
sync inside a loop (the GPU lags, the launch queue absorbs the calls), the best of five loops.
A call whose GPU time exceeds its host time fills the queue and then reads the GPU's time, not
the host's (KDA 1x8k H64: ~850 us a call).

    python benchmarks/host_time.py [--configs NAME,..] [--libs fastla,fla] [--label TEXT]

A config prefixed ``pool:`` (a decode config) runs the serving form: a pool of 2N slots updated
in place through ssm_state_indices. For an A/B of two trees, run it twice with PYTHONPATH
pointing at each tree's ``fastla``; ``--plans off`` times fastla without its call plans
(fastla/core/call_plan.py), ``--plans on,off`` both in one process."""
from __future__ import annotations

import argparse
import time

import torch

from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.bench.runner import load_op
from fastla.core import call_plan

CONFIGS = ("gdn-decode/h16-hv32/n1,kda-decode/h32-hv32/n16,pool:gdn-decode/h16-hv32/n16,"
           "gdn/h2-hv8/1x8192,gdn/h4-hv16/1x8192")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--libs", default="fastla,fla")
    ap.add_argument("--label", default="")
    ap.add_argument("--plans", default="on", help="fastla's call plans: on, off or on,off")
    args = ap.parse_args()
    for name in args.configs.split(","):
        pool = name.startswith("pool:")
        cfg = get_config(name.removeprefix("pool:"))
        kw = call_kwargs(make_inputs(cfg, "cuda"))
        if pool:
            N = kw["q"].shape[0]
            kw["initial_state"] = torch.zeros(2 * N, *kw["initial_state"].shape[1:], device="cuda")
            kw["ssm_state_indices"] = torch.arange(0, 2 * N, 2, device="cuda", dtype=torch.int32)
            kw.pop("output_final_state", None)
        runs = [(lib, plans) for lib in args.libs.split(",")
                for plans in (args.plans.split(",") if lib == "fastla" else ["-"])]
        for lib, plans in runs:
            op = load_op(lib, cfg)
            call_plan.ENABLED = plans != "off"
            calls = 200 if "decode" in name else 60
            with torch.no_grad():
                for _ in range(5):
                    op(**kw)
                torch.cuda.synchronize()
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(calls):
                        op(**kw)
                    best = min(best, (time.perf_counter() - start) / calls)
                    torch.cuda.synchronize()
            tag = lib if plans == "-" else f"{lib}/plans-{plans}"
            print(f"{args.label:8s} {name:34s} {tag:16s} host {best * 1e6:7.1f} us per call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
