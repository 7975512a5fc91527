"""Everything that needs a GPU, in one prepared run (under 8 minutes on one GPU), with its figures in one JSON.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json          # on a GPU machine
    python benchmarks/gpu_check.py --device cpu --quick --json /tmp/gpu_check.json    # the same checks on a CPU

Checks (each passes or fails, with its numbers):
  parity      ten StiefelAdam steps (frames and an AdamW group) on the device equal the same steps on the CPU
  drift       float32 frames stay orthonormal over 3,000 trust-region steps on the device
  cuda_graph  the sync-free step (max_step set, nonfinite='skip') captured in a CUDA graph and replayed equals the
              eager step (CUDA only)
  compiled    torch.compile(opt.step, fullgraph=True) (inductor; aot_eager with --quick) equals the eager step
Measurements:
  optimizer_step  one step on ViT-B-shaped frames (24 x 12 frames of St(768, 64)): StiefelAdam against AdamW
                  (fused and foreach) and geoopt's RiemannianAdam if installed, timed round-robin, device-synchronised
  cifar_paper     training steps per second of the paper-profile CIFAR PatchViT (adamw and stiefel-adam arms,
                  batch 256, images of CIFAR's shape), and the implied seconds per epoch of the n=10k main cell
Exit status 1 if any check fails. --device cpu runs everything a CPU can (the CUDA graph is reported as skipped);
the test suite runs it that way (tests/test_gpu_check.py), so the script is known to work before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from stiefel_attention import StiefelAdam, isometry_error, random_frame
from timing import training_step  # benchmarks/timing.py, beside this script


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _problem(heads: int, d: int, r: int, seed: int = 0):
    """Frames, an ordinary matrix, and a sequence of gradients for both, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    frames = [random_frame(heads, d=d, r=r, generator=gen) for _ in range(2)]
    matrix = torch.randn(d, heads * r, generator=gen) * 0.02
    grads = [[torch.randn(t.shape, generator=gen) * 1e-2 for t in (*frames, matrix)] for _ in range(10)]
    return [*frames, matrix], grads


def _optimizer(tensors, device, **kw):
    params = [torch.nn.Parameter(t.to(device).clone()) for t in tensors]
    groups = [{"params": params[:2], "stiefel": True, "lr": 0.05}, {"params": params[2:], "stiefel": False}]
    return params, StiefelAdam(groups, lr=1e-2, max_step=0.1, weight_decay=0.1, **kw)


def _run(params, opt, grads, step=None) -> None:
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(p.device)
        (step or opt.step)()


def check_parity(device, quick) -> dict:
    tensors, grads = _problem(4 if quick else 12, 64 if quick else 768, 16 if quick else 64)
    ref_params, ref_opt = _optimizer(tensors, "cpu")
    _run(ref_params, ref_opt, grads)
    params, opt = _optimizer(tensors, device)
    _run(params, opt, grads)
    gap = max(float((p.detach().cpu() - q.detach()).abs().max()) for p, q in zip(params, ref_params))
    return {"passed": gap < 1e-5, "max_abs_difference": gap, "tolerance": 1e-5}


def check_drift(device, quick) -> dict:
    steps = 200 if quick else 3000
    gen = torch.Generator().manual_seed(1)
    W = torch.nn.Parameter(random_frame(12, d=128 if quick else 768, r=64, generator=gen).to(device))
    opt = StiefelAdam([W], lr=0.05, max_step=0.1, nonfinite="skip")
    worst = 0.0
    for i in range(steps):
        W.grad = torch.randn(W.shape, generator=gen).to(device)
        opt.step()
        if (i + 1) % 100 == 0:
            worst = max(worst, float(isometry_error(W)))
    return {"passed": worst < 1e-5, "steps": steps, "max_isometry_error": worst, "tolerance": 1e-5}


def check_cuda_graph(device, quick) -> dict:
    if device.type != "cuda":
        return {"passed": None, "skipped": "needs CUDA"}
    tensors, grads = _problem(12, 768, 64)
    kw = dict(nonfinite="skip", fused=True)
    eager_params, eager_opt = _optimizer(tensors, device, **kw)
    params, opt = _optimizer(tensors, device, **kw)
    static = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static):
        p.grad = g
    for p, g in zip(params, grads[0]):  # a warm-up step on a side stream creates the state, as CUDA graphs need
        p.grad.copy_(g.to(device))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    _run(eager_params, eager_opt, grads[:1])
    for gs in grads[1:]:
        for p, g in zip(params, gs):
            p.grad.copy_(g.to(device))
        graph.replay()
    _run(eager_params, eager_opt, grads[1:])
    _sync(device)
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(params, eager_params))
    return {"passed": gap < 1e-5, "max_abs_difference": gap, "tolerance": 1e-5}


def check_compiled(device, quick) -> dict:
    tensors, grads = _problem(4 if quick else 12, 64 if quick else 768, 16 if quick else 64)
    kw = dict(nonfinite="skip", foreach=True)
    eager_params, eager_opt = _optimizer(tensors, device, **kw)
    params, opt = _optimizer(tensors, device, **kw)
    backend = "aot_eager" if quick else "inductor"
    torch._dynamo.reset()
    try:
        step = torch.compile(opt.step, fullgraph=True, backend=backend)
        _run(params, opt, grads, step)
    finally:
        torch._dynamo.reset()
    _run(eager_params, eager_opt, grads)
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(params, eager_params))
    return {"passed": gap < 1e-5, "backend": backend, "max_abs_difference": gap, "tolerance": 1e-5}


def _timed(fns: dict, repeats: int, device) -> dict[str, float]:
    for _ in range(2):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure_optimizer_step(device, quick) -> dict:
    layers, heads, d, r = (2, 4, 128, 32) if quick else (12, 12, 768, 64)
    gen = torch.Generator().manual_seed(0)
    frames = [random_frame(heads, d=d, r=r, generator=gen) for _ in range(2 * layers)]
    grads = [torch.randn(f.shape, generator=gen) * 1e-2 for f in frames]

    def params(tensors):
        ps = [torch.nn.Parameter(t.to(device).clone()) for t in tensors]
        for p, g in zip(ps, grads):
            p.grad = g.reshape(p.shape).to(device).clone()
        return ps

    ordinary = [f.permute(1, 0, 2).reshape(d, heads * r) for f in frames]
    fns = {
        "AdamW(foreach)": torch.optim.AdamW(params(ordinary), lr=1e-3, foreach=True).step,
        "StiefelAdam(max_step=0.1)": StiefelAdam(params(frames), lr=1e-2, max_step=0.1).step,
        "StiefelAdam(sync-free)": StiefelAdam(params(frames), lr=1e-2, max_step=0.1, nonfinite="skip").step,
    }
    if device.type == "cuda":
        fns["AdamW(fused)"] = torch.optim.AdamW(params(ordinary), lr=1e-3, fused=True).step
    try:
        import geoopt

        gp = [geoopt.ManifoldParameter(f.to(device).clone(), manifold=geoopt.EuclideanStiefel()) for f in frames]
        for p, g in zip(gp, grads):
            p.grad = g.to(device).clone()
        fns["geoopt RiemannianAdam"] = geoopt.optim.RiemannianAdam(gp, lr=1e-2).step
    except ImportError:
        pass
    medians = _timed(fns, 5 if quick else 30, device)
    base = medians["AdamW(foreach)"]
    return {
        "shape": f"{2 * layers} x {heads} frames of St({d}, {r})",
        "median_ms": {n: 1e3 * t for n, t in medians.items()},
        "x_adamw_foreach": {n: t / base for n, t in medians.items()},
    }


def measure_cifar_paper(device, quick) -> dict:
    from stiefel_attention.bench.arms import HyperParameters, attention_options, build_optimizers
    from stiefel_attention.bench.cifar.config import PROFILES
    from stiefel_attention.bench.models import PatchViT

    prof = PROFILES["paper"]
    batch = 16 if quick else prof["batch_size"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    fns = {}
    for arm in ("adamw", "stiefel-adam"):
        torch.manual_seed(0)
        model = PatchViT(**prof["model"], **attention_options(arm)).to(device)
        (opt,) = build_optimizers(model, arm, HyperParameters(lr=1e-3, weight_decay=0.05, frame_lr=1e-2, max_step=0.1))
        fns[arm] = training_step(model, opt, x, y)
    medians = _timed(fns, 3 if quick else 20, device)
    n_main = prof["n_main"]
    return {
        "model": prof["model"],
        "batch": batch,
        "steps_per_s": {arm: 1.0 / t for arm, t in medians.items()},
        "s_per_epoch_n_main": {arm: t * (n_main // batch) for arm, t in medians.items()},
        "n_main": n_main,
    }


CHECKS = {"parity": check_parity, "drift": check_drift, "cuda_graph": check_cuda_graph, "compiled": check_compiled}
MEASUREMENTS = {"optimizer_step": measure_optimizer_step, "cifar_paper": measure_cifar_paper}


def run_checks(device: str, quick: bool = False) -> dict:
    dev = torch.device(device)
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "quick": quick,
        "checks": {},
        "measurements": {},
    }
    t_all = time.perf_counter()
    for name, fn in CHECKS.items():
        t0 = time.perf_counter()
        try:
            out["checks"][name] = fn(dev, quick)
        except Exception as err:  # a check that crashes is a failed check, with its reason, and the rest still run
            out["checks"][name] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
        out["checks"][name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {out['checks'][name]}", file=sys.stderr, flush=True)
    for name, fn in MEASUREMENTS.items():
        t0 = time.perf_counter()
        out["measurements"][name] = fn(dev, quick)
        out["measurements"][name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {out['measurements'][name]}", file=sys.stderr, flush=True)
    out["seconds"] = time.perf_counter() - t_all
    out["all_passed"] = all(c["passed"] is not False for c in out["checks"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes, aot_eager instead of inductor (CPU runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --device cpu to run the CPU parts", file=sys.stderr)
        return 2
    torch.set_flush_denormal(True)
    result = run_checks(args.device, args.quick)
    text = json.dumps(result, indent=2)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
