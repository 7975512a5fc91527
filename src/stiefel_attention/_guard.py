"""What each parameter is, so that no optimizer trains a model wrongly without a word.

Frames are marked where they are made (`StiefelAttention(qk="stiefel")`, `stiefelize`) and wherever
`frames(model)` finds them; parameters that `stiefelize` or `unstiefelize` took out of a model are marked with
the call that replaced them; `param_groups(model)` remembers every parameter's name in the model. One global
optimizer step pre-hook (torch's `register_optimizer_step_pre_hook`) then refuses, before anything is written, a
step of any optimizer that would
- step a frame as an ordinary tensor (torch.optim.AdamW(model.parameters()), the Hugging Face Trainer's default
  optimizer, a StiefelAdam group with stiefel=False): a frame would leave St(d, r) at its first step;
- step a parameter a conversion replaced: an optimizer built before `stiefelize` (or stepped after
  `unstiefelize`) would never train W_Q, W_K again.
An optimizer whose own rule keeps frames on the manifold says so with `keeps_frames_on_manifold`: True, or a
method of the param group (StiefelAdam and StiefelSGD: the groups with stiefel=True).

The hook checks an optimizer again only when its groups or the marks changed, so a step costs a few dictionary
lookups; it is skipped while torch.compile traces a step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["FrameStepError", "forget", "mark_frames", "mark_replaced", "name_of", "remember_names", "role_of"]


class FrameStepError(RuntimeError):
    """An optimizer was about to step a Stiefel frame by the wrong rule, or a parameter no longer in its model;
    nothing was changed."""


@dataclass(frozen=True)
class Replaced:
    """A parameter a conversion took out of its model: by which call, and what to do instead."""

    by: str
    fix: str


_FRAME = "frame"
_ROLES = WeakIdKeyDictionary()  # parameter -> _FRAME or Replaced
_NAMES = WeakIdKeyDictionary()  # parameter -> its qualified name in the model
_generation = 0  # bumped on every new mark: an optimizer checked before must be checked again
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (generation, groups signature)


def mark_frames(named: list[tuple[str | None, Tensor]]) -> None:
    """Mark these (name, parameter) pairs as Stiefel frames, and remember the names that are not None."""
    global _generation
    for name, p in named:
        if _ROLES.get(p) is None:
            _ROLES[p] = _FRAME
            _generation += 1
        if name is not None:
            _NAMES[p] = name


def mark_replaced(named: list[tuple[str, Tensor]], by: str, fix: str) -> None:
    """Mark these parameters as taken out of their model by the call `by`; `fix` says what to do."""
    global _generation
    for name, p in named:
        _ROLES[p] = Replaced(by, fix)
        _NAMES[p] = name
        _generation += 1


def forget(params: list[Tensor]) -> None:
    """These parameters are ordinary tensors again (a frame baked back into a plain weight)."""
    global _generation
    for p in params:
        if _ROLES.pop(p, None) is not None:
            _generation += 1


def remember_names(model: torch.nn.Module) -> None:
    """Remember every parameter's qualified name in model, for messages that name it."""
    for name, p in model.named_parameters():
        _NAMES[p] = name


def role_of(p: Tensor) -> str | Replaced | None:
    return _ROLES.get(p)


def name_of(p: Tensor, fallback: str) -> str:
    """p's name in its model where known (`param_groups(model)`, `frames(model)`), else fallback."""
    name = _NAMES.get(p)
    return fallback if name is None else f"{name} ({fallback})"


def _keeps_frames(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    rule = getattr(optimizer, "keeps_frames_on_manifold", False)
    return bool(rule(group)) if callable(rule) else bool(rule)


def _signature(optimizer: torch.optim.Optimizer) -> tuple:
    return _generation, tuple((id(g["params"]), len(g["params"]), g.get("stiefel")) for g in optimizer.param_groups)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise FrameStepError if a step of optimizer would step a frame wrongly or a replaced parameter."""
    kind = type(optimizer).__name__
    for gi, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            role = _ROLES.get(p)
            if role is None:
                continue
            where = f"param_groups[{gi}]['params'][{i}]"
            name = f"{names[i]} ({where})" if names else name_of(p, where)
            if isinstance(role, Replaced):
                raise FrameStepError(
                    f"{kind} holds {name}, which {role.by} took out of the model: this optimizer would never train "
                    f"what replaced it. {role.fix} Nothing was changed."
                )
            if not _keeps_frames(optimizer, group):
                if hasattr(optimizer, "keeps_frames_on_manifold"):
                    rule = "AdamW (a group with stiefel=False)"
                elif group.get("stiefel"):
                    rule = f"its own rule ({kind} does not read the stiefel=True of param_groups(model))"
                else:
                    rule = "its own rule"
                raise FrameStepError(
                    f"{kind} would step {name}, a Stiefel frame (W_Q or W_K as orthonormal columns), by {rule}, "
                    "as an ordinary tensor: it would leave the manifold at the first step. Train the model with "
                    "StiefelAdam(param_groups(model), ...), which steps frames by the Riemannian rule and every "
                    "other parameter by AdamW; with the Hugging Face Trainer, pass it as "
                    "optimizers=(StiefelAdam(param_groups(model), ...), scheduler). Nothing was changed."
                )


def _step_pre_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if torch.compiler.is_compiling() or not _ROLES:
        return
    signature = _signature(optimizer)
    if _checked.get(optimizer) == signature:
        return
    check_optimizer(optimizer)
    _checked[optimizer] = signature


register_optimizer_step_pre_hook(_step_pre_hook)
