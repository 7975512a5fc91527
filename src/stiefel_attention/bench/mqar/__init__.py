"""Multi-query associative recall: steps to 99% test accuracy.

task.py (the batches), run.py (config, cells, one training run), report.py (records -> summary, markdown,
plots), on the sequence base (bench.sequence)."""

from .run import FAMILY

__all__ = ["FAMILY"]
