"""Time one optimizer step on ViT-B-shaped W_Q, W_K frames, side by side, and the end-to-end
training-step overhead of the stiefel-adam arm over the adamw arm on the default PatchViT.

    python benchmarks/optimizer_step.py [--repeats 15] [--threads N] [--json out.json] [--readme docs/performance.md]

With --readme, the measured table replaces the block between the benchmark markers in that file,
so the performance page shows exactly what the last committed run printed.

Step benchmark: 12 layers x (W_Q, W_K), each 12 heads of St(768, 64).
- StiefelAdam: 24 frame tensors of shape (12, 768, 64), trust region on and off;
- torch.optim.AdamW(foreach=True): the same numbers laid out as ordinary weights, 24 matrices
  of shape (768, 768) (what nn.Linear(768, 768) holds for 12 heads of 64);
- geoopt.optim.RiemannianAdam on geoopt.EuclideanStiefel, 24 tensors (12, 768, 64), if geoopt
  is installed (`pip install stiefel-attention[bench]`);
- the other rules on frames: StiefelMuon (manifold Muon), LandingStiefelAdam (no retraction) and Kong, Wang &
  Tao's Stiefel Adam (the suite's arm); torch.optim.Muon on the (768, 768) matrices.
Each rule on frames also gets a floor: the time of the d-sized batched matrix products its step issues, alone
(counted on one step by ProductCount: r x d times d x r products, "gram", and d x r times r x r, "apply"),
timed in the same rounds; the step's ratio to its floor is what the rest of its work (r x r solves,
elementwise updates) costs.
Methods are timed round-robin (one step of each per round), so machine noise hits all of them
alike; we report medians and ratios of medians. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch
from torch.overrides import TorchFunctionMode

from readme import replace_block  # benchmarks/readme.py, beside this script
from stiefel_attention import LandingStiefelAdam, StiefelAdam, StiefelMuon, param_groups, random_frame
from stiefel_attention.bench.kong import KongStiefelAdam
from stiefel_attention.bench.models import PatchViT
from timing import round_robin, training_step

LAYERS, HEADS, D_MODEL, HEAD_DIM = 12, 12, 768, 64
# sync-free: max_step=0.1 and nonfinite="skip", the configuration whose step never reads the device back
STIEFEL = ("StiefelAdam(max_step=0.1)", "StiefelAdam(no cap)", "StiefelAdam(sync-free)")


def optimizer_step_benchmark(repeats: int) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    gen = torch.Generator().manual_seed(0)
    frames = [random_frame(HEADS, d=D_MODEL, r=HEAD_DIM, generator=gen) for _ in range(2 * LAYERS)]
    grads = [torch.randn(f.shape, generator=gen) * 1e-2 for f in frames]

    def with_grads(tensors):
        params = [t.clone().requires_grad_() for t in tensors]
        for p, g in zip(params, grads):
            p.grad = g.reshape(p.shape).clone()
        return params

    ordinary = [f.permute(1, 0, 2).reshape(D_MODEL, HEADS * HEAD_DIM) for f in frames]  # (768, 768)
    fns = {
        "AdamW(foreach)": torch.optim.AdamW(with_grads(ordinary), lr=1e-3, foreach=True).step,
        "StiefelAdam(max_step=0.1)": StiefelAdam(with_grads(frames), lr=1e-2, max_step=0.1).step,
        "StiefelAdam(no cap)": StiefelAdam(with_grads(frames), lr=1e-2).step,
        "StiefelAdam(sync-free)": StiefelAdam(with_grads(frames), lr=1e-2, max_step=0.1, nonfinite="skip").step,
    }
    try:
        import geoopt

        manifold = geoopt.EuclideanStiefel()
        gparams = [geoopt.ManifoldParameter(f.clone(), manifold=manifold) for f in frames]
        for p, g in zip(gparams, grads):
            p.grad = g.clone()
        fns["geoopt RiemannianAdam"] = geoopt.optim.RiemannianAdam(gparams, lr=1e-2).step
    except ImportError:
        print("geoopt not installed: pip install 'stiefel-attention[compare]' to compare against it")
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None:
        fns["Muon (torch)"] = muon(with_grads(ordinary), lr=1e-2, adjust_lr_fn="match_rms_adamw").step
    fns["StiefelMuon"] = StiefelMuon(with_grads(frames), lr=1e-2).step
    fns["LandingStiefelAdam"] = LandingStiefelAdam(with_grads(frames), lr=1e-2, max_step=0.1).step
    fns["Kong et al. Stiefel Adam"] = KongStiefelAdam(with_grads(frames), lr=1e-3).step
    counts = {name: count_products(fns[name], D_MODEL) for name in FLOORED}
    fns.update(_product_floors(frames, grads, counts))
    times = round_robin(fns, repeats)
    return {name: statistics.median(ts) for name, ts in times.items()}, counts


_MATMULS = {
    *(torch.matmul, torch.linalg.matmul, torch.bmm, torch.baddbmm, torch.mm, torch.addmm),
    *(torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm, torch.Tensor.mm),
    *(torch.Tensor.baddbmm, torch.Tensor.baddbmm_, torch.Tensor.addmm, torch.Tensor.addmm_),
}


class ProductCount(TorchFunctionMode):
    """Counts the d-sized matrix products issued under it: r x d @ d x r ("gram") and d x r @ r x r ("apply")."""

    def __init__(self, d: int):
        super().__init__()
        self.d, self.gram, self.apply = d, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]
            if a.shape[-1] == self.d and b.shape[-2] == self.d:
                self.gram += 1
            elif a.shape[-2] == self.d and b.shape[-2] != self.d:
                self.apply += 1
        return func(*args, **(kwargs or {}))


def count_products(step, d: int) -> tuple[int, int]:
    """(gram, apply) products one call of step issues (counted on the call itself, which also steps)."""
    with ProductCount(d) as counter:
        step()
    return counter.gram, counter.apply


# The rules on frames that get a floor: their steps' products are counted on the benchmark's own frames (after
# its warm-up, so StiefelMuon's count holds the inner iterations that step took) and timed alone.
FLOORED = ("StiefelAdam(max_step=0.1)", "StiefelMuon", "LandingStiefelAdam", "Kong et al. Stiefel Adam")


def _product_floors(frames, grads, counts: dict[str, tuple[int, int]]) -> dict:
    """A callable per rule that issues only its counted products, on the same shapes and batching."""
    W = [f.clone() for f in frames]
    G = [g.clone() for g in grads]
    small = [torch.randn(f.shape[:-2] + (f.shape[-1], f.shape[-1])) for f in frames]  # (H, r, r)

    def floor(n_gram: int, n_apply: int):
        def products():
            for i in range(n_gram):
                torch.matmul(W[i % len(W)].mT, G[i % len(W)])
            for i in range(n_apply):
                torch.matmul(W[i % len(W)], small[i % len(W)])

        return products

    return {f"floor of {name}": floor(*counts[name]) for name in FLOORED}


def training_step_benchmark(repeats: int, batch: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    fns = {}
    for arm, qk in (("adamw", "euclidean"), ("stiefel-adam", "stiefel")):
        torch.manual_seed(0)
        model = PatchViT(qk=qk)
        opt = StiefelAdam(param_groups(model, weight_decay=0.05, frame_lr=1e-2), lr=1e-3)
        fns[arm] = training_step(model, opt, x, y)
    times = round_robin(fns, repeats)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--batch", type=int, default=128, help="batch size of the training-step benchmark")
    ap.add_argument("--json", default=None, help="also write the medians and ratios to this file")
    ap.add_argument("--readme", default=None, help="replace the benchmark block of this markdown file with the table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")

    print(
        f"\nOne optimizer step on {2 * LAYERS} x {HEADS} frames of St({D_MODEL}, {HEAD_DIM}) "
        f"(median of {args.repeats}):"
    )
    step, counts = optimizer_step_benchmark(args.repeats)
    base = step["AdamW(foreach)"]
    print(f"{'method':<36}{'median ms':>10}{'x AdamW':>9}")
    for name, t in step.items():
        print(f"{name:<36}{t * 1e3:>10.1f}{t / base:>9.2f}")
    for name in FLOORED:
        gram, apply = counts[name]
        print(f"{name}: {step[name] / step['floor of ' + name]:.2f}x its floor ({gram} + {apply} products per step)")
    if "geoopt RiemannianAdam" in step:
        g = step["geoopt RiemannianAdam"]
        for name in STIEFEL:
            print(f"{name} is {g / step[name]:.2f}x faster than geoopt RiemannianAdam")

    print(f"\nOne training step of the default PatchViT, batch {args.batch} (median of {args.repeats}):")
    train = training_step_benchmark(args.repeats, args.batch)
    overhead = train["stiefel-adam"] / train["adamw"] - 1.0
    for name, t in train.items():
        print(f"{name:<28}{t * 1e3:>10.1f} ms")
    print(f"stiefel-adam overhead over adamw: {100 * overhead:+.1f}%")
    result = {
        "optimizer_step_s": step,
        "products_per_step": counts,
        "training_step_s": train,
        "overhead": overhead,
        "repeats": args.repeats,
        "batch": args.batch,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.readme:
        replace_block(args.readme, markdown_table(result))


def markdown_table(result: dict) -> str:
    step, train = result["optimizer_step_s"], result["training_step_s"]
    base = step["AdamW(foreach)"]
    lines = [
        f"One optimizer step on the W_Q, W_K of a ViT-B-shaped model ({2 * LAYERS} x {HEADS} frames of "
        f"St({D_MODEL}, {HEAD_DIM})), median of {result['repeats']} round-robin rounds, torch {result['torch']}, "
        f"{result['threads']} threads on {result['machine']} (`benchmarks/optimizer_step.py`):",
        "",
        "StiefelAdam(sync-free) is max_step=0.1 with nonfinite='skip': no device-to-host synchronisation in the step.",
        "",
        "| method | median ms | x AdamW |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |" for name, t in step.items() if not name.startswith("floor of ")
    ]
    if any(name.startswith("floor of ") for name in step):
        lines += [
            "",
            "Each rule on frames against its floor, the d-sized batched products its step issues, timed alone in the "
            "same rounds (counted on the step itself: r x d @ d x r and d x r @ r x r products over all 24 "
            "tensors; r x r solves and elementwise work are the rest):",
            "",
            "| rule | products per step | its products alone, ms | step / floor |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {sum(result['products_per_step'][name])} | {step['floor of ' + name] * 1e3:.1f} | "
            f"{step[name] / step['floor of ' + name]:.2f} |"
            for name in FLOORED
        ]
    if "geoopt RiemannianAdam" in step:
        g = step["geoopt RiemannianAdam"]
        lines += [
            "",
            "StiefelAdam is "
            + " and ".join(f"{g / step[n]:.2f}x ({n})" for n in STIEFEL)
            + " faster than geoopt's RiemannianAdam.",
        ]
    lines += [
        "",
        f"End to end, one training step of the default PatchViT (batch {result['batch']}): adamw arm "
        f"{train['adamw'] * 1e3:.1f} ms, stiefel-adam arm {train['stiefel-adam'] * 1e3:.1f} ms: "
        f"overhead {100 * result['overhead']:+.1f}%.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
