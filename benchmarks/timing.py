"""Side-by-side timing shared by the benchmark scripts."""

from __future__ import annotations

import time


def round_robin(fns: dict, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each function, calling them in turn `repeats` times, so that drift in the
    machine's speed (other load, frequency scaling) hits every contender alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def training_step(model, opt, x, y):
    """One classification training step of model with opt on the fixed batch (x, y), as a callable."""
    import torch.nn.functional as F

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step
