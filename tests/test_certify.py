"""certify: the checks it runs, the pass/fail logic of ordinary and must-fail checks, and that breaking a
property makes the check of that property fail (and only checks that depend on it)."""

from __future__ import annotations

import math

import pytest
import torch

from stiefel_attention import certify as certify_module
from stiefel_attention import nn as nn_module
from stiefel_attention import optim as optim_module
from stiefel_attention.bench import cli
from stiefel_attention.certify import Check, certify
from stiefel_attention.optim import StiefelAdam

# 11 properties of the rule, 2 of the logit bound; 3 must-fail controls (StiefelSGD's scale, coordinate-wise moment,
# the bound without the input norm)
N_CHECKS = 16


def _by_property(results: list[Check]) -> dict[str, Check]:
    return {c.property: c for c in results}


@pytest.mark.parametrize(
    "residual, must_fail, passed",
    [
        (1e-15, False, True),
        (1e-12, False, True),  # at the tolerance
        (2e-12, False, False),
        (1e-3, True, True),  # a must-fail control whose ablation clearly breaks the property
        (1e-13, True, False),  # ...and one whose ablation did not break it
        (1e-12, True, False),
        (math.nan, False, False),
        (math.nan, True, False),
        (math.inf, True, False),
    ],
)
def test_check_passes_by_its_kind(residual, must_fail, passed):
    assert Check("p", residual, 1e-12, must_fail).passed is passed


def test_certify_runs_every_check_and_all_pass():
    results = certify(seed=1)
    assert len(results) == N_CHECKS and len({c.property for c in results}) == N_CHECKS
    assert sum(c.must_fail for c in results) == 3
    assert {c.property.split()[0] for c in results} == {"1", "2", "3", "4", "5", "6", "7"}  # every proposition
    assert all(c.passed for c in results), [c.property for c in results if not c.passed]


def test_a_retraction_that_is_not_polar_fails_the_conditioning_checks(monkeypatch):
    def skip_the_inverse_root(gram, lo, hi):  # W' = W + xi: no retraction at all
        return torch.eye(gram.shape[-1], dtype=gram.dtype).expand_as(gram).clone()

    monkeypatch.setattr(optim_module, "inv_sqrt_gram", skip_the_inverse_root)
    monkeypatch.setattr(certify_module, "inv_sqrt_gram", skip_the_inverse_root)
    results = _by_property(certify(seed=0))
    failed = {p for p, c in results.items() if not c.passed}
    assert "3 conditioning: ||W^T W - I|| after 100 capped steps" in failed
    assert "3 conditioning: r x r factor exact, ||M^2 (I + xi^T xi) - I||" in failed
    assert results["5 weight decay: ||P_W(lambda W)|| / lambda (normal, so projected to 0)"].passed  # untouched


def test_a_coordinate_wise_second_moment_fails_equivariance_and_steepest_descent(monkeypatch):
    def coordinate_adam(params, **kw):  # what the rule would be with Adam's elementwise v
        return StiefelAdam(params, **{**kw, "second_moment": "coordinate", "batched": False})

    monkeypatch.setattr(certify_module, "StiefelAdam", coordinate_adam)
    failed = [c.property for c in certify(seed=0) if not c.passed]
    # its first step is no longer along -P_W G, and it no longer commutes with rotations; scale freedom,
    # conditioning and the decay no-op do not depend on the second moment's shape and still hold
    assert failed == [
        "1 steepest descent: StiefelAdam's first step is lr * xi* (lr=1e-4, +O(lr^2))",
        "4 O(d)-equivariance: StiefelAdam from (QW, QG) = Q x StiefelAdam from (W, G), 20 steps",
    ]


def test_a_must_fail_control_fails_when_its_ablation_no_longer_breaks_the_property(monkeypatch):
    # StiefelSGD replaced by a scale-free rule: the control that shows SGD is not scale free must now fail
    monkeypatch.setattr(certify_module, "StiefelSGD", lambda params, lr: StiefelAdam(params, lr=lr, eps=0.0))
    failed = [c.property for c in certify(seed=0) if not c.passed]
    assert failed == ["2 scale independence must fail for StiefelSGD (degree one), c=10"]


def test_an_input_norm_that_does_not_normalise_fails_exactly_the_bound_check(monkeypatch):
    monkeypatch.setattr(nn_module, "_rms_norm", lambda x, eps=1e-6: x)
    failed = [c.property for c in certify(seed=0) if not c.passed]
    assert failed == ["7 logit bound: max |s| / (scale T d / sqrt(r)) - 1 with qk_input_norm, inputs to 1e6"]


def test_a_bound_set_too_high_fails_the_attained_check(monkeypatch):
    real = nn_module.StiefelAttention.logit_bound
    monkeypatch.setattr(nn_module.StiefelAttention, "logit_bound", lambda self: 2 * real(self))
    failed = [c.property for c in certify(seed=0) if not c.passed]
    assert failed == ["7 logit bound: attained by inputs along the frames (1 - max |s| / bound; rms eps)"]


def test_the_certify_command_exits_non_zero_when_a_check_fails(monkeypatch, capsys):
    monkeypatch.setattr(certify_module, "StiefelSGD", lambda params, lr: StiefelAdam(params, lr=lr, eps=0.0))
    assert cli.main(["certify"]) == cli.EXIT_FAILED_CHECK
    assert f"{N_CHECKS - 1} of {N_CHECKS} checks pass" in capsys.readouterr().out
