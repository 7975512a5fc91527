"""Full-batch training steps per second of the grokking profiles, both arms, one thread each.

    python benchmarks/grok_speed.py [--epochs 60] [--json benchmarks/results/grok_speed.json]
        [--readme docs/performance.md]

The `cpu` profile must finish 20,000 epochs in at most 15 minutes when two runs share this
2-core machine (one thread each); this prints the measured rate and that projection for the
`cpu` and the reference `paper` profile. Arms are timed round-robin in one process. With
--readme, the table replaces the block between the grok-speed markers in that file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch
import torch.nn.functional as F

from readme import replace_block  # benchmarks/readme.py, beside this script
from stiefel_attention.bench.arms import attention_options
from stiefel_attention.bench.grok import run as grok
from stiefel_attention.bench.grok.task import modular_task
from stiefel_attention.bench.models import ModularTransformer
from timing import round_robin


def steps_per_second(profile: str, epochs: int) -> dict[str, float]:
    steppers = {}
    for arm in grok.ARMS:
        cfg = grok.make_config(profile, arm, seed=0)
        task = modular_task(cfg["model"]["p"], cfg["op"], cfg["train_fraction"], cfg["split_seed"])
        torch.manual_seed(0)
        model = ModularTransformer(**cfg["model"], **attention_options(arm))
        (opt,) = grok._build(cfg, model)

        def step(model=model, opt=opt, x=task.train_tokens, y=task.train_labels):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()  # warm-up
        steppers[arm] = step
    times = round_robin(steppers, epochs, warmup=0)  # each stepper took its warm-up step above
    return {arm: 1.0 / statistics.median(ts) for arm, ts in times.items()}


def markdown_table(result: dict) -> str:
    lines = [
        f"Full-batch training epochs per second of the grokking model, one thread, torch {torch.__version__}, "
        f"{platform.machine()} (`benchmarks/grok_speed.py`; median of timed epochs, arms round-robin):",
        "",
        "| profile | model | arm | epochs/s | 20,000 epochs |",
        "|---|---|---|---|---|",
    ]
    for profile in ("cpu", "paper"):
        m = result[profile]["model"]
        shape = f"p={m['p']}, d_model {m['d_model']}, {m['n_heads']} heads of {m['head_dim']}, MLP {m['d_mlp']}"
        for arm, rate in result[profile]["steps_per_s"].items():
            lines.append(f"| {profile} | {shape} | {arm} | {rate:.1f} | {20000 / rate / 60:.1f} min |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=60, help="timed epochs per arm and profile")
    ap.add_argument("--json", default=None)
    ap.add_argument("--readme", default=None, help="file with <!-- grok-speed:start/end --> markers to update")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    result = {}
    for profile in ("cpu", "paper"):
        rates = steps_per_second(profile, args.epochs)
        result[profile] = {
            "model": grok.PROFILES[profile]["model"],
            "steps_per_s": rates,
            "minutes_per_20k_epochs": {a: 20000 / r / 60 for a, r in rates.items()},
        }
        for arm, r in rates.items():
            print(
                f"{profile:<6} {arm:<13} {r:7.1f} steps/s  -> 20,000 epochs in {20000 / r / 60:5.1f} min (one thread)"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"threads": 1, "torch": torch.__version__, **result}, f, indent=2)
    if args.readme:
        replace_block(args.readme, markdown_table(result), "<!-- grok-speed:start -->", "<!-- grok-speed:end -->")


if __name__ == "__main__":
    main()
