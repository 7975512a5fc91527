"""Pretrained transformers converted to frames: the loss after conversion, the steps to recover, the final loss.

run.py (checkpoints, cells, one fine-tuning run, and its summary)."""

from .run import FAMILY

__all__ = ["FAMILY"]
