"""No silent wrong training: every way a user could train frames wrongly is refused before anything is written,
with a message that names the parameter and the fix (issue: frames that cannot be stepped by the wrong optimizer,
checkpoints that are checked, every misuse a clear error)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stiefel_attention import (
    StiefelAdam,
    StiefelAttention,
    StiefelSGD,
    frames,
    isometry_error,
    param_groups,
    polar_retract,
    stiefelize,
    unstiefelize,
)
from stiefel_attention.bench.models import CharGPT
from stiefel_attention.convert import FUNCTION_CHANGE_TOLERANCE, StiefelizeError, plain_state_dict
from stiefel_attention.metrics import attention_metrics
from stiefel_attention.optim import FrameStepError, NonFiniteGradientError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _gpt2(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50))


BATCH = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))


def _loss(model) -> torch.Tensor:
    if isinstance(model, CharGPT):
        return F.cross_entropy(model(BATCH).reshape(-1, 50), BATCH.roll(-1, 1).reshape(-1))
    return model(input_ids=BATCH, labels=BATCH).loss


def _char_gpt(**options):
    torch.manual_seed(0)
    return CharGPT(50, 12, d_model=32, n_layers=2, n_heads=2, head_dim=8, mlp_ratio=2, **options)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --- 1. an ordinary optimizer never steps a frame ---------------------------------------------------------------


@pytest.mark.parametrize("make", [_llama, _char_gpt], ids=["stiefelized-llama", "StiefelAttention"])
@pytest.mark.parametrize("groups", ["parameters", "param_groups"])
def test_adamw_on_a_model_with_frames_is_refused_before_anything_moves(make, groups):
    model = stiefelize(make()) if make is _llama else make()
    opt = torch.optim.AdamW(model.parameters() if groups == "parameters" else param_groups(model), lr=1e-2)
    _loss(model).backward()
    before = _snapshot(model)
    with pytest.raises(FrameStepError, match=r"Stiefel frame.*StiefelAdam\(param_groups\(model\)") as info:
        opt.step()
    assert _unchanged(model, before) and not opt.state  # nothing stepped, no moment made
    if make is _llama:
        assert "model.layers.0.self_attn.q_proj.parametrizations.weight.original0" in str(info.value)
    if groups == "param_groups":
        assert "does not read the stiefel=True" in str(info.value)


def test_the_hugging_face_trainer_without_optimizers_is_refused_and_names_the_way_out(tmp_path):
    model = stiefelize(_llama())
    data = [{"input_ids": BATCH[i], "labels": BATCH[i]} for i in range(2)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    before = [p.detach().clone() for _, p in frames(model)]
    with pytest.raises(FrameStepError, match=r"optimizers=\(StiefelAdam\(param_groups\(model\)"):
        trainer.train()
    assert all(torch.equal(p, b) for (_, p), b in zip(frames(model), before))
    # with the optimizer passed, it trains and the frames stay frames
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2), lr=1e-3)
    transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None)).train()
    assert all(float(isometry_error(p)) < 1e-5 for _, p in frames(model))
    assert not all(torch.equal(p, b) for (_, p), b in zip(frames(model), before))


@pytest.mark.parametrize("qk", ["euclidean", "parametrized", "frozen"])
def test_arms_without_frames_train_with_any_optimizer(qk):
    model = _char_gpt(qk=qk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model).backward()
    opt.step()  # no refusal


def test_a_frame_in_an_adamw_group_of_stiefel_adam_is_refused_at_construction():
    model = _char_gpt()
    with pytest.raises(FrameStepError, match=r"\]\[4\], a Stiefel frame .*AdamW \(a group with stiefel=False\)"):
        StiefelAdam([{"params": list(model.parameters()), "stiefel": False}])
    frames(model)  # once the model's frames have been listed, messages name them as the model does
    with pytest.raises(FrameStepError, match=r"blocks\.0\.attn\.w_q \(param_groups\[0\]\['params'\]\[4\]\)"):
        StiefelAdam([{"params": list(model.parameters()), "stiefel": False}])


def test_an_optimizer_that_keeps_frames_on_the_manifold_can_say_so():
    model = _char_gpt()

    class Retracting(torch.optim.SGD):
        keeps_frames_on_manifold = True

    opt = Retracting(model.parameters(), lr=0.0)
    _loss(model).backward()
    opt.step()


# --- 2. an optimizer built before stiefelize, or stepped after unstiefelize -------------------------------------


def test_an_optimizer_built_before_stiefelize_is_refused_naming_the_call():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stiefelize(model)
    _loss(model).backward()
    with pytest.raises(FrameStepError, match=r"q_proj\.weight .*which stiefelize\(model\) took out of the model"):
        opt.step()


def test_an_optimizer_stepped_after_unstiefelize_is_refused_and_a_new_one_trains():
    model = stiefelize(_llama())
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2))
    unstiefelize(model)
    _loss(model).backward()
    with pytest.raises(FrameStepError, match=r"which unstiefelize\(model\) took out.*build a new optimizer"):
        opt.step()
    torch.optim.AdamW(model.parameters()).step()  # the plain model trains with any optimizer


# --- 3. frames cast to half precision after the optimizer was built --------------------------------------------


def test_frames_cast_to_bfloat16_after_construction_are_refused_at_step():
    model = _char_gpt()
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2))
    model.to(torch.bfloat16)
    _loss(model).backward()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.w_q .*has dtype torch.bfloat16.*step was refused"):
        opt.step()
    assert _unchanged(model, before)


# --- 4. frames made non-orthonormal after the optimizer was built ----------------------------------------------


def test_frames_loaded_into_the_model_after_construction_are_checked_at_the_next_step():
    model = _char_gpt()
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2))
    _loss(model).backward()
    opt.step()  # a normal step first: the optimizer's own writes are not rechecked
    state = model.state_dict()
    state["blocks.1.attn.w_k"] = 3.0 * state["blocks.1.attn.w_k"]
    model.load_state_dict(state)
    _loss(model).backward()
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.w_k .*is not on the Stiefel manifold"):
        opt.step()


def test_the_start_check_runs_again_after_the_optimizers_own_load_state_dict(monkeypatch):
    model = _char_gpt()
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2))
    _loss(model).backward()
    opt.step()
    with torch.no_grad():  # an edit that the version counters cannot see: a new tensor behind .data
        model.blocks[0].attn.w_q.data = 2.0 * model.blocks[0].attn.w_q.data
    checked = []
    from stiefel_attention import optim as optim_module

    real = optim_module._check_start
    monkeypatch.setattr(
        optim_module, "_check_start", lambda p, where, *tol: (checked.append(where), real(p, where, *tol))
    )
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="is not on the Stiefel manifold"):
        opt.step()
    assert checked  # every frame was checked again
    checked.clear()
    with torch.no_grad():
        model.blocks[0].attn.w_q.data = 0.5 * model.blocks[0].attn.w_q.data  # back on the manifold
    opt.load_state_dict(opt.state_dict())
    opt.step()
    opt.step()  # and after a clean step, nothing is checked again
    assert len(checked) == len(frames(model))


# --- 5. optimizer state for other shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("other", [dict(n_heads=4, head_dim=8, d_model=32), dict(head_dim=4), dict(d_model=48)])
def test_optimizer_state_of_another_shape_is_refused_at_load_naming_the_parameter(other):
    shape = dict(d_model=32, n_heads=2, head_dim=8)
    torch.manual_seed(0)
    theirs = CharGPT(50, 12, n_layers=1, mlp_ratio=2, **{**shape, **other})
    opt_theirs = StiefelAdam(param_groups(theirs, frame_lr=1e-2))
    _loss(theirs).backward()
    opt_theirs.step()
    torch.manual_seed(0)
    mine = CharGPT(50, 12, n_layers=1, mlp_ratio=2, **shape)
    opt = StiefelAdam(param_groups(mine, frame_lr=1e-2))
    with pytest.raises(ValueError, match=r"load_state_dict: the saved '\w+' of .* has shape .*Nothing was loaded"):
        opt.load_state_dict(opt_theirs.state_dict())
    assert not opt.state


# --- 6. arguments out of range ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=math.inf), "invalid learning rate"),
        (dict(lr=math.nan), "invalid learning rate"),
        (dict(weight_decay=math.inf), "invalid weight_decay"),
        (dict(max_step=math.inf), "invalid max_step"),
        (dict(betas=(0.9,)), r"invalid betas: \(0.9,\); a pair"),
        (dict(betas=0.9), "invalid betas"),
        (dict(eps=math.inf), "invalid eps"),
    ],
)
@pytest.mark.parametrize("cls", [StiefelAdam, StiefelSGD])
def test_optimizer_arguments_out_of_range_are_refused(cls, kwargs, match):
    frame = torch.linalg.qr(torch.randn(8, 3)).Q.requires_grad_()
    args = {"lr": 1e-2, **kwargs} if cls is StiefelSGD else kwargs
    with pytest.raises(ValueError, match=match):
        cls([frame], **args)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
@pytest.mark.parametrize("arg", ["n_heads", "head_dim", "d_model"])
def test_attention_sizes_that_are_not_whole_positive_numbers_are_refused(arg, bad):
    sizes = dict(d_model=16, n_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=f"{arg} must be a whole number >= 1, got {bad!r}"):
        StiefelAttention(**{**sizes, arg: bad})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polar_retract_refuses_inputs_without_a_polar_factor(dtype):
    W = torch.zeros(2, 6, 3, dtype=dtype)
    with pytest.raises(ValueError, match="rank-deficient"):
        polar_retract(W, torch.zeros_like(W))
    Y = torch.randn(6, 3, dtype=dtype)
    Y[:, 2] = Y[:, 1]  # a repeated column
    with pytest.raises(ValueError, match="rank-deficient"):
        polar_retract(Y, torch.zeros_like(Y))
    fine = torch.randn(4, 6, 3, dtype=dtype)
    assert float(isometry_error(polar_retract(fine, torch.zeros_like(fine)))) < 1e-5


# --- 7. attention_metrics on a stiefelized model ------------------------------------------------------------------


def test_attention_metrics_of_a_stiefelized_model_says_why_it_cannot_measure_it():
    model = stiefelize(_llama())
    with pytest.raises(ValueError, match=r"converted by stiefelize \(4 frame tensors.*bilinear_spectrum"):
        attention_metrics(model, lambda: model(input_ids=BATCH))
    with pytest.raises(ValueError, match="no StiefelAttention layer"):
        attention_metrics(nn.Linear(2, 2), lambda: None)


# --- 8. save_pretrained of a stiefelized model ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_save_pretrained_writes_the_plain_layout_that_a_plain_model_loads(make, tmp_path):
    model = stiefelize(make(1), init="orthonormal").eval()
    with torch.no_grad():
        want = model(input_ids=BATCH).logits
    model.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=BATCH).logits, want, rtol=1e-5, atol=1e-5)
    restored = stiefelize(plain, init="nearest")
    for (name, a), (_, b) in zip(frames(restored), frames(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert not any("parametrizations" in k for k in plain_state_dict(model))
    assert any("parametrizations" in k for k in model.state_dict())  # state_dict keeps the frames (exact resume)
    # the file holds both layouts: a stiefelized model (the Trainer's resume, strict=False) gets the frames exactly
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    again = stiefelize(make(2), init="orthonormal")
    result = again.load_state_dict(saved, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # GPT-2's is tied
    for (name, a), (_, b) in zip(frames(again), frames(model)):
        assert torch.equal(a, b), name
    # a plain checkpoint loaded into a stiefelized model: its nearest frames
    into = stiefelize(make(3), init="orthonormal")
    into.load_state_dict(plain.state_dict())
    for (name, a), (_, b) in zip(frames(into), frames(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    unstiefelize(model)
    assert "save_pretrained" not in vars(model)


# --- messages -------------------------------------------------------------------------------------------------------


def test_a_non_finite_gradient_error_names_the_parameter_as_the_model_does():
    model = stiefelize(_llama())
    opt = StiefelAdam(param_groups(model, frame_lr=1e-2))
    _loss(model).backward()
    frame = dict(model.named_parameters())["model.layers.1.self_attn.k_proj.parametrizations.weight.original0"]
    frame.grad[0, 0, 0] = math.nan
    dict(model.named_parameters())["lm_head.weight"].grad[0, 0] = math.inf
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    text = str(info.value)
    assert "model.layers.1.self_attn.k_proj.parametrizations.weight.original0" in text and "lm_head.weight" in text


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_stiefelize_twice_says_already_stiefelized_for_every_layout(make):
    model = stiefelize(make())
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(StiefelizeError, match=r"already stiefelized, in part .*unstiefelize\(model\) first") as info:
        stiefelize(model, init="nearest")
    assert len(str(info.value)) < 400
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_nearest_warns_that_the_function_changes_only_above_its_stated_tolerance(caplog):
    model = stiefelize(_llama(), init="orthonormal")
    unstiefelize(model)  # orthonormal heads in float32: nearest moves them by round-off only
    with caplog.at_level(logging.INFO, logger="stiefel_attention"):
        stiefelize(model, init="nearest")
    change = max(r["relative_change"] for r in model.stiefelize_report.values())
    assert 0 < change < FUNCTION_CHANGE_TOLERANCE
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "round-off" in caplog.records[0].message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stiefel_attention"):
        stiefelize(_llama(), init="nearest")  # Hugging Face's std-0.02 weights: far from orthonormal
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "the function changes" in caplog.records[0].message
