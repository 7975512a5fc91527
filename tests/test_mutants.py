"""Tests that kill mutants the rest of the suite let through (tools/mutants.py lists them; issue 44).

Each test pins one behaviour a small slip in the code would change while every other test kept passing: the
start-point tolerance from both sides, calibration under grouped-query attention, the claim race of two
processes around a released cell, certify's weight-decay check on both update paths, and details of stiefelize
and of skip mode that the mutation check found untested. The distributed ones are in tests/test_mesh_reductions.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from stiefel_attention import optim
from stiefel_attention.bench import lock
from stiefel_attention.bench.lock import Claims
from stiefel_attention.bench.records import Cell
from stiefel_attention.certify import certify
from stiefel_attention.manifold import isometry_error, random_frame
from stiefel_attention.optim import StiefelAdam, StiefelSGD

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the start-point tolerance (optim._START_TOLERANCE) ------------------------------------------------------


def _frame_with_error(err: float, seed: int = 0) -> torch.Tensor:
    """A (2, 8, 3) float64 frame tensor whose isometry error is err: one column of one frame stretched so that
    its squared norm is 1 + err (W^T W - I then holds err in one diagonal entry)."""
    W = random_frame(2, d=8, r=3, generator=_gen(seed), dtype=F64)
    W[1, :, 2] *= math.sqrt(1.0 + err)
    return W


OPTIMIZERS = [lambda ps: StiefelAdam(ps, lr=0.1), lambda ps: StiefelSGD(ps, lr=0.1)]


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=["adam", "sgd"])
def test_the_start_tolerance_refuses_a_frame_five_times_above_it(make_opt):
    """Round-off never reaches 5e-3; a frame this far off was not orthonormalised, and the message says by how
    much and against what tolerance."""
    W = _frame_with_error(5e-3)
    assert float(isometry_error(W)) == pytest.approx(5e-3, rel=1e-9)
    with pytest.raises(ValueError, match=r"not on the Stiefel manifold: max \|\|W\^T W - I\|\|_F = 0\.005 > 0\.001"):
        make_opt([nn.Parameter(W)])


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=["adam", "sgd"])
@pytest.mark.parametrize("err", [2e-4, 9e-4])
def test_the_start_tolerance_accepts_frames_just_below_it(make_opt, err):
    W = _frame_with_error(err)
    assert float(isometry_error(W)) == pytest.approx(err, rel=1e-9)
    make_opt([nn.Parameter(W)])  # no error


def test_a_float32_frame_cast_to_float64_is_accepted_and_its_round_off_is_of_order_1e6():
    W = random_frame(4, d=64, r=16, generator=_gen(1), dtype=torch.float32).double()
    assert 1e-8 < float(isometry_error(W)) < 1e-5
    for make_opt in OPTIMIZERS:
        make_opt([nn.Parameter(W.clone())])


# --- calibrate under grouped-query attention (convert._least_squares_scale) ---------------------------------


def test_calibrated_temperature_pairs_each_query_head_with_its_own_key_head_under_grouped_query_attention():
    """Llama with 4 query heads sharing 2 key-value heads (query heads 0, 1 read key head 0; 2, 3 read key head
    1): each calibrated temperature must be the least-squares scale of its own head's logits, recomputed here
    from the projections' weights and inputs with no library layout code. Pairing query head h with key head
    h % 2 (the key heads tiled rather than grouped) gives heads 1 and 2 another head's scale."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from stiefel_attention import stiefelize

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    ref = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, 50, (2, 9), generator=_gen(3))
    attn = ref.model.layers[0].self_attn
    seen = []
    hook = attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    ref(ids)
    hook.remove()
    w_q, w_k = attn.q_proj.weight.detach(), attn.k_proj.weight.detach()  # (H r, D), (Hkv r, D): y = x W^T
    model = stiefelize(copy.deepcopy(ref), init="nearest", temperature=True, calibrate=lambda m: m(ids))
    conv = model.model.layers[0].self_attn
    frame_q = conv.q_proj.parametrizations.weight.original0.detach()  # (4, 32, 8)
    frame_k = conv.k_proj.parametrizations.weight.original0.detach()  # (2, 32, 8)
    got = conv.q_proj.parametrizations.weight.original1.detach().exp()  # (4,)

    x = seen[0]  # (B, N, D): q_proj and k_proj read the same normalised hidden states
    heads = lambda t, n: t.unflatten(-1, (n, 8)).transpose(-3, -2)  # (B, N, n r) -> (B, n, N, r)  # noqa: E731
    key_head = torch.tensor([0, 0, 1, 1])
    q_old = heads(x @ w_q.T, 4)
    k_old = heads(x @ w_k.T, 2)[:, key_head]
    q_new = torch.einsum("bnd,hdr->bhnr", x, frame_q)
    k_new = torch.einsum("bnd,hdr->bhnr", x, frame_k)[:, key_head]
    target, a = q_old @ k_old.mT, q_new @ k_new.mT  # (B, 4, N, N); no biases in Llama's q_proj, k_proj
    want = (target * a).sum((0, 2, 3)) / a.square().sum((0, 2, 3))
    assert (want > 0).all()  # so every head takes its fitted scale, none the floor
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    tiled = torch.tensor([0, 1, 0, 1])  # the wrong pairing differs on heads 1 and 2: this test can tell them apart
    k_wrong = torch.einsum("bnd,hdr->bhnr", x, frame_k)[:, tiled]
    a_wrong = q_new @ k_wrong.mT
    wrong = (q_old @ heads(x @ w_k.T, 2)[:, tiled].mT * a_wrong).sum((0, 2, 3)) / a_wrong.square().sum((0, 2, 3))
    assert ((wrong - want).abs() / want)[1:3].min() > 1e-3


# --- the claim race (bench/lock.py, Claims.claim) -------------------------------------------------------------


def test_a_claim_that_locked_a_file_its_holder_just_removed_starts_again_on_the_new_file(tmp_path, monkeypatch):
    """A holds a cell; B opens the claim file, and before B's flock A releases the cell (unlinks the file and
    closes it). B's lock is then on a file nobody else will look at: B must see that the path now names another
    file (or none), claim the path's file, and so keep C out. Without that check B and C would both hold the cell.
    One process stands for three: flock locks belong to open file descriptions, so two opens conflict."""
    runs = tmp_path / "runs"
    cell = Cell("grok", "stiefel-adam-s0", {"seed": 0})
    a, b, c = Claims(runs), Claims(runs), Claims(runs)
    assert a.claim(cell, {"profile": "smoke"})
    real_lock, released = lock._lock, []

    def release_a_first(fd, block):  # the release lands between B's os.open and B's flock
        if not released:
            released.append(True)
            a.release(cell)
        return real_lock(fd, block)

    monkeypatch.setattr(lock, "_lock", release_a_first)
    try:
        assert b.claim(cell, {"profile": "smoke"})
        assert released == [True]
        monkeypatch.setattr(lock, "_lock", real_lock)
        assert not c.claim(cell, {"profile": "smoke"})  # B's lock is on the file the path names
        assert [o["profile"] for o in c.others()] == ["smoke"]
    finally:
        for claims in (a, b, c):
            claims.release_all()


# --- certify's weight-decay check covers both update paths (certify.check_weight_decay) --------------------


def test_a_reference_path_that_decays_after_projecting_fails_exactly_the_decay_trajectory_check(monkeypatch):
    """The reference (frame-by-frame) path adding weight decay after the tangent projection (so that it acts on
    the frames) must fail check 5's trajectory, and nothing else: the batched path drops the decay analytically,
    so only a check that steps the reference path too can see this."""
    real = optim._tangent_or_refuse

    def decay_after_projecting(params, grads, weight_decay, projector, keep):
        tangent = real(params, grads, 0.0, projector, keep)
        return [g + weight_decay * W for g, W in zip(tangent, params)]

    monkeypatch.setattr(optim, "_tangent_or_refuse", decay_after_projecting)
    failed = [c.property for c in certify(seed=0) if not c.passed]
    assert failed == ["5 weight decay: StiefelAdam(weight_decay>0) trajectory = weight_decay=0"]


# --- stiefelize details (convert.py) ---------------------------------------------------------------------------


def test_the_reported_relative_change_is_the_frobenius_ratio_of_the_query_and_key_blocks():
    """stiefelize_report's relative_change is ||W' - W||_F / ||W||_F over the query and key rows of the packed
    weight (the value rows do not change), not its square."""
    from stiefel_attention import stiefelize

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    before = mha.in_proj_weight.detach().clone()[:64]  # q | k rows; v rows follow
    stiefelize(mha, init="nearest")
    after = mha.in_proj_weight.detach()[:64]
    want = float(torch.linalg.matrix_norm(after - before) / torch.linalg.matrix_norm(before))
    assert 0.1 < want < 0.9  # a change well away from 0 and 1, where x and x^2 differ
    assert mha.stiefelize_report["in_proj_weight"]["relative_change"] == pytest.approx(want, rel=1e-6)


def test_square_heads_convert_to_orthogonal_frames():
    """head_dim = d_model (one head reading the whole input) is a frame on St(d, d): converted, not refused."""
    from stiefel_attention import frames, stiefelize

    torch.manual_seed(0)
    mha = stiefelize(nn.MultiheadAttention(8, 1, batch_first=True), init="nearest")
    found = frames(mha)
    assert [tuple(p.shape) for _, p in found] == [(1, 8, 8), (1, 8, 8)]
    assert all(float(isometry_error(p)) < 1e-4 for _, p in found)  # float32 polar factors of ill-conditioned heads
    StiefelAdam([p for _, p in found], lr=0.01)  # frames the optimizer accepts
    x = torch.randn(2, 5, 8)
    assert torch.isfinite(mha(x, x, x)[0]).all()


def test_calibration_reads_the_inputs_of_the_model_in_eval_mode_whatever_mode_it_is_in():
    """calibrate runs the model without dropout (GPT-2's embedding dropout at 0.5 here, before every projection),
    so a model in training mode gets the temperatures of the same model in eval mode, and keeps its mode."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from stiefel_attention import stiefelize

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=16, embd_pdrop=0.5, attn_pdrop=0.0, resid_pdrop=0.0
    )
    ref = transformers.GPT2LMHeadModel(config).double().train()
    ids = torch.randint(0, 50, (2, 9), generator=_gen(3))

    def temperatures(model):
        converted = stiefelize(copy.deepcopy(model), init="nearest", temperature=True, calibrate=lambda m: m(ids))
        return converted, converted.transformer.h[0].attn.c_attn.parametrizations.weight.original3.detach()

    trained, in_training = temperatures(ref)
    _, in_eval = temperatures(copy.deepcopy(ref).eval())
    torch.testing.assert_close(in_training, in_eval, rtol=1e-12, atol=0)
    assert trained.training and trained.transformer.drop.training  # its mode given back


def test_the_input_norm_hook_normalises_the_first_argument_and_passes_the_others_on():
    from stiefel_attention.convert import NormalisedInput

    x, extra = torch.randn(2, 3, 8, generator=_gen(4), dtype=F64), object()
    out = NormalisedInput()(nn.Identity(), (x, extra, 3))
    assert len(out) == 3 and out[1] is extra and out[2] == 3
    torch.testing.assert_close(out[0].square().mean(-1), torch.ones(2, 3, dtype=F64), rtol=1e-5, atol=0)


# --- skip mode: a finite gradient whose squared norm overflows (optim.py) ------------------------------------


def test_skip_mode_leaves_a_frame_whose_gradient_norm_overflows_as_it_was():
    """A float32 gradient with entries of 1e20 is finite, but its squared norm is not: stepping that frame would put
    inf into its second moment and freeze it for good. Skip mode leaves it and its moments as they were (as for a
    NaN), steps the other frames, and the frame trains again at the next ordinary gradient."""
    W = nn.Parameter(random_frame(3, d=8, r=3, generator=_gen(5), dtype=torch.float32))
    opt = StiefelAdam([W], lr=0.1, max_step=0.1, nonfinite="skip")
    W.grad = torch.randn(3, 8, 3, generator=_gen(6))
    opt.step()
    before, v_before = W.detach().clone(), opt.state[W]["exp_avg_sq"].clone()
    grad = torch.randn(3, 8, 3, generator=_gen(7))
    grad[1] = 1e20 * optim.project_tangent(W.detach()[1], grad[1])  # finite; its squared norm overflows float32
    assert torch.isfinite(grad).all() and not torch.isfinite(grad[1].square().sum())
    W.grad = grad
    opt.step()
    assert torch.equal(W.detach()[1], before[1]) and torch.equal(opt.state[W]["exp_avg_sq"][1], v_before[1])
    assert not torch.equal(W.detach()[0], before[0]) and not torch.equal(W.detach()[2], before[2])
    W.grad = torch.randn(3, 8, 3, generator=_gen(8))
    opt.step()
    assert not torch.equal(W.detach()[1], before[1]) and torch.isfinite(opt.state[W]["exp_avg_sq"]).all()
