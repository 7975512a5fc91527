"""CIFAR-10 patches: a small PatchViT, final test accuracy (the paper's headline testbed).

run.py (config, cells, one training run), data.py (the dataset: download, JPEG mirror, splits), report.py
(records -> summary, markdown, plots, claim rows)."""

from .run import FAMILY

__all__ = ["FAMILY"]
