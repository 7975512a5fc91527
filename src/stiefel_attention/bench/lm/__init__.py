"""Character-level language modelling on tiny Shakespeare: validation loss in nats per character.

run.py (config, cells, one training run), report.py (records -> summary, markdown, plots), on the sequence
base (bench.sequence)."""

from .run import FAMILY

__all__ = ["FAMILY"]
