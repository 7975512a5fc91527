"""Full-batch training steps per second of the grokking profiles, both arms, one thread each.

    python benchmarks/grok_speed.py [--epochs 60] [--json benchmarks/results/grok_speed.json]

The `cpu` profile must finish 20,000 epochs in at most 15 minutes when two runs share this
2-core machine (one thread each); this prints the measured rate and that projection for the
`cpu` and the reference `paper` profile. Arms are timed round-robin in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from timing import round_robin  # benchmarks/timing.py, beside this script

from stiefel_attention.data import modular_task
from stiefel_attention.experiments import grok
from stiefel_attention.nn import ModularTransformer
from stiefel_attention.optim import arm_spec


def steps_per_second(profile: str, epochs: int) -> dict[str, float]:
    steppers = {}
    for arm in grok.ARMS:
        cfg = grok.make_config(profile, arm, seed=0)
        task = modular_task(cfg["model"]["p"], cfg["op"], cfg["train_fraction"], cfg["split_seed"])
        spec = arm_spec(arm)
        torch.manual_seed(0)
        model = ModularTransformer(**cfg["model"], qk=spec.qk, qk_init=spec.qk_init)
        opt = grok._build(cfg, model)

        def step(model=model, opt=opt, x=task.train_tokens, y=task.train_labels):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()  # warm-up
        steppers[arm] = step
    times = round_robin(steppers, epochs, warmup=0)  # each stepper took its warm-up step above
    return {arm: 1.0 / statistics.median(ts) for arm, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=60, help="timed epochs per arm and profile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    result = {}
    for profile in ("cpu", "paper"):
        rates = steps_per_second(profile, args.epochs)
        result[profile] = {"model": grok.PROFILES[profile]["model"], "steps_per_s": rates,
                           "minutes_per_20k_epochs": {a: 20000 / r / 60 for a, r in rates.items()}}
        for arm, r in rates.items():
            print(f"{profile:<6} {arm:<13} {r:7.1f} steps/s  -> 20,000 epochs in {20000 / r / 60:5.1f} min (one thread)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"threads": 1, "torch": torch.__version__, **result}, f, indent=2)


if __name__ == "__main__":
    main()
