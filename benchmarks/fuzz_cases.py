"""The training fuzz's cases one process each, for a fault that takes the CUDA context with it
(tests/ops/test_option_fuzz.py::test_triton_backward_against_fp64_on_gpu; docs/notes/
chunk-backward.md: delta seed 7 faulted on an H100).

    python benchmarks/fuzz_cases.py                 # every variant below, CUDA_LAUNCH_BLOCKING=1
    python benchmarks/fuzz_cases.py delta 7 asis    # one case (what each child runs)
    python benchmarks/fuzz_cases.py localize        # seed 7 (KDA, V 32) and plain 1 (GLA, K = V = 64)
                                                    # under knobs and assemblers (~3 min)

A variant of delta seed 7 changes one thing (contiguous inputs, V 64, no initial state, the
K-first state, allow_neg_eigval off; its forward alone with the chunk states on the Gluon or the
Triton tier, as the training path's forward asks them); the other rows run further seeds as they
are. A knob variant ``NAME=value[,NAME=value]`` sets module constants of chunk_channel_backward,
chunk_delta_backward or chunk_training (the first that has the name; ``SAVE_STATES=0``: the
backward recomputes the chunk states), ``ptxas129=value,key,...`` marks those kernels of
chunk_channel_backward (``all``: every one) to be assembled by ptxas 12.9 (launch.newer_ptxas; the
reverse scan and GDN's value and key kernels are, the channel kernels are not). The localize rows
ran before the value kernel's tiles changed (chunk_channel_backward.value_block): their
VALUE_BLOCK_V rows no longer change these cases' tiles (KDA at V <= 32 takes NARROW_VALUE_BLOCK_V,
GLA all of V). A row: the variant, its exit status, its last line (every output's and gradient's
error against fp64, the torch tier's in brackets, ``!`` past the fuzz's bound) and, for a failure,
the last fastla frames (with blocking launches, the faulting launch's)."""
import os
import subprocess
import sys

SEED7 = ["fwd-gluon", "fwd-triton", "asis", "contiguous", "v64", "no-h0", "k-first", "no-neg-eigval"]
ROWS = [("delta", 7, v) for v in SEED7] + [("delta", s, "asis") for s in (8, 9, 10, 11)] + \
       [("plain", s, "asis") for s in range(6)]
# the faults' third call (an H100: KDA at K 64, V 32 faults in the value kernel, V 64 passes; GLA's
# dq wrong at K = V = 64, right at K 64 V 128)
LOCALIZE = [("delta", 7, v) for v in ("asis", "ptxas129=value", "ptxas129=all", "VALUE_BLOCK_V=16", "VALUE_WARPS=4",
                                      "k128")] + \
           [("plain", 1, v) for v in ("asis", "ptxas129=all", "SAVE_STATES=0", "KEY_BLOCK_K=64,KEY_WARPS=8",
                                      "SCORE_DIAGONAL_PRODUCTS=0", "SCORE_BLOCK_K=16", "VALUE_BLOCK_V=64")]
KERNELS = {"value": "_channel_value_grads_kernel", "key": "_channel_key_grads_kernel",
           "score": "_channel_score_grads_kernel", "cumsum": "_channel_cumsum_kernel"}


def parent(rows):
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for family, seed, variant in rows:
        r = subprocess.run([sys.executable, __file__, family, str(seed), variant], env=env, capture_output=True,
                           text=True, timeout=150)
        lines = (r.stdout + r.stderr).strip().splitlines()
        print(f"{family} {seed} {variant:26s} rc={r.returncode} {lines[-1][:220] if lines else ''}", flush=True)
        if r.returncode:
            frames = [ln.strip() for ln in lines if ln.strip().startswith("File ") and "/fastla/" in ln]
            print("    " + " <- ".join(fr.split('"')[1].split("/fastla/")[-1] + ":" + fr.split("line ")[1].split(",")[0]
                                      for fr in reversed(frames[-4:])), flush=True)


def set_knobs(variant: str):
    """Applies a knob or assembler variant (the module's docstring)."""
    from fastla.backends.triton import chunk_channel_backward, chunk_delta_backward, chunk_training, launch

    if variant.startswith("ptxas129="):
        names = variant.split("=", 1)[1].split(",")
        for name in KERNELS if names == ["all"] else names:
            launch.newer_ptxas(getattr(chunk_channel_backward, KERNELS[name]))
        return
    for item in variant.split(","):
        name, value = item.split("=")
        module = next(m for m in (chunk_channel_backward, chunk_delta_backward, chunk_training) if hasattr(m, name))
        old = getattr(module, name)
        setattr(module, name, type(old)(int(value)) if isinstance(old, (bool, int)) else type(old)(value))


def errors_against_fp64(fuzz, op, t, opts, seed) -> str:
    """Every output's and gradient's relative RMS error vs fp64 (the torch tier's in brackets; ``!``
    past test_option_fuzz's bound: twice the torch tier's plus 1e-2; ``nan`` for a non-finite one)."""
    import torch

    ref, torch_tier, triton_tier = fuzz.three_tiers(op, t, opts, seed)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    parts = []
    for name, r in ref.items():
        if r is None:
            continue
        b, a = triton_tier[name], torch_tier[name]
        err, err_torch = fuzz.rel_rms(b, r), fuzz.rel_rms(a, r)
        bad = not torch.isfinite(b).all() or not err <= 2 * err_torch + 1e-2
        parts.append(f"{name} {err:.1e}{'!' if bad else ''}({err_torch:.0e})" if torch.isfinite(b).all() else f"{name} nan!")
    return " ".join(parts)


def child(family: str, seed: int, variant: str):
    import torch

    sys.path.insert(0, os.getcwd())
    import tests.ops.test_option_fuzz as fuzz
    from fastla.backends.triton import chunk_training
    from fastla.core.dispatch import use_tier

    chunk_training.ENABLED = True
    op, t, opts = fuzz.CASES[family](seed, gpu=True)
    if variant.startswith("fwd-"):
        t["g"] = t["g"].float()                       # (the training path's forward gets the gate in fp32)
        with use_tier(variant[4:], strict=True), torch.no_grad():
            out = fuzz.OPS[op](**t, **dict(opts, return_intermediate_states=True))
        torch.cuda.synchronize()
        print("forward ok", [round(x.float().norm().item(), 3) for x in out if x is not None])
        return
    if variant == "contiguous":
        t = {n: x.contiguous() for n, x in t.items()}
    elif variant == "v64":
        t["v"] = torch.randn(*t["v"].shape[:-1], 64, device="cuda").bfloat16()
        t["initial_state"] = torch.randn(*t["initial_state"].shape[:-2], 64, 64, device="cuda")
    elif variant == "no-h0":
        t.pop("initial_state", None)
    elif variant == "k-first":
        opts["state_v_first"] = False
        t["initial_state"] = t["initial_state"].transpose(-1, -2).contiguous()
    elif variant == "no-neg-eigval":
        opts["allow_neg_eigval"] = False
    elif "=" in variant:
        set_knobs(variant)
    elif variant == "k128":
        t = {n: x.contiguous() for n, x in t.items()}
        for n in ("q", "k", "g"):
            t[n] = torch.cat([t[n], t[n]], -1)
        if "initial_state" in t:
            k_axis = -1 if opts["state_v_first"] else -2
            t["initial_state"] = torch.cat([t["initial_state"], t["initial_state"]], k_axis)
    print(errors_against_fp64(fuzz, op, t, opts, seed))


if __name__ == "__main__":
    if len(sys.argv) <= 2:
        parent(LOCALIZE if sys.argv[1:] == ["localize"] else ROWS)
    else:
        child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
