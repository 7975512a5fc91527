"""The base the sequence testbeds (lm, mqar) share: family.py plans the experiments in which every arm runs
(main, the two-stage lr-sweep, the factorial); report.py holds the summaries, markdown and plots they share."""

from .family import SequenceFamily

__all__ = ["SequenceFamily"]
