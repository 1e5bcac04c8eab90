"""The rollout importance-sampling correction (TRL's vllm_importance_sampling_correction, for any engine's log-probs):
the weights and metrics against hand math in fp64, the weights through the fused loss against the reference in fp64,
and the trainer computing them from its old log-probs and the engine's, with the mismatch in its metrics."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference
from fastgrpo.loss.correction import RolloutCorrection, correction_weights, logprob_gap, rollout_correction
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.rollout import BuiltinEngine
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer

f64 = torch.float64
# Two sequences; row 1's last position is padding (its huge difference must not count).
TRAIN = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=f64)
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, 5.0]], dtype=f64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize("mode, level, clip_min, clip_max, expected", [
    # token diffs: row 0 [0.5, -1.0, 0.0], row 1 [0.0, -1.0, (pad)]
    ("truncate", "token", None, 1.5, [[1.5, math.exp(-1), 1.0], [1.0, math.exp(-1), 1.0]]),
    ("truncate", "token", 0.5, 1.5, [[1.5, 0.5, 1.0], [1.0, 0.5, 0.5]]),
    ("mask", "token", 0.5, 1.5, [[0.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
    # sequence sums: row 0 -0.5, row 1 -1.0
    ("truncate", "sequence", None, 3.0, [[math.exp(-0.5)] * 3, [math.exp(-1.0)] * 3]),
    ("mask", "sequence", 0.5, None, [[math.exp(-0.5)] * 3, [0.0] * 3]),
    ("mask", "sequence", None, None, [[math.exp(-0.5)] * 3, [math.exp(-1.0)] * 3]),
])
def test_weights_match_hand_math(mode, level, clip_min, clip_max, expected):
    weights, metrics = rollout_correction(TRAIN, ROLLOUT, MASK, mode, level, clip_min, clip_max)
    expected = torch.tensor(expected, dtype=f64)
    valid = MASK.bool() if level == "token" else torch.ones_like(MASK, dtype=torch.bool)
    assert torch.allclose(weights[valid], expected[valid], rtol=1e-12), weights
    assert metrics["rollout_logp_diff"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.0 + 1.0) / 5, rel=1e-12)
    assert metrics["rollout_logp_diff_max"] == pytest.approx(1.0, rel=1e-12)
    counted = expected[valid] if level == "token" else expected[:, 0]
    assert metrics["rollout_is_weight_mean"] == pytest.approx(counted.mean().item(), rel=1e-12)
    assert (metrics["rollout_is_weight_min"], metrics["rollout_is_weight_max"]) == pytest.approx(
        (counted.min().item(), counted.max().item()), rel=1e-12)  # _max as the mean passed the suite
    raw = torch.exp((TRAIN - ROLLOUT).masked_fill(~MASK.bool(), 0.0))
    raw = raw[valid] if level == "token" else raw.prod(-1)
    share = (counted != raw).double().mean().item()
    assert metrics["rollout_truncated_frac" if mode == "truncate" else "rollout_masked_frac"] == pytest.approx(share)


def test_nan_rollout_logps_count_zero_and_bad_options_name_the_field():
    rollout = ROLLOUT.clone()
    rollout[0, 0] = float("nan")  # a token the engine could not score: ratio 1 there, left out of the diff mean
    weights, metrics = rollout_correction(TRAIN, rollout, MASK, "truncate", "token", None, 3.0)
    assert weights[0, 0] == 1.0 and metrics["rollout_logp_diff"] == pytest.approx(2.0 / 4)
    with pytest.raises(ValueError, match="rollout_correction_clip_min: expected < rollout_correction_clip_max"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "mask", "token", 3.0, 2.0)
    with pytest.raises(ValueError, match="rollout_correction_clip_max: truncate needs a bound"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "truncate", "token", None, None)
    with pytest.raises(ValueError, match="rollout_correction_level: expected one of"):
        rollout_correction(TRAIN, ROLLOUT, MASK, "mask", "batch")


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_through_the_fused_loss_match_the_reference(loss_type, level):
    """The correction as the fused loss's token_weights, against the eager reference, fp64; a masked sequence
    sends no gradient to its hidden states (except through the KL, off here)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 5, 8, 37
    hidden = torch.randn(B, T, H, generator=g, dtype=f64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=f64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    with torch.no_grad():
        old = reference.linear_logprobs(hidden, weight, targets)
    rollout = old + torch.randn(B, T, generator=g, dtype=f64) * 0.3
    rollout[1] = old[1] - 2.0  # sequence 1 is far off: masked at both levels
    token_weights, _ = rollout_correction(old, rollout, mask, "mask", level, 0.2, 3.0)
    advantages = torch.tensor([1.0, -1.0, 0.5], dtype=f64)
    kwargs = dict(old_logps=old + 0.1, token_weights=token_weights, loss_type=loss_type, num_items_in_batch=11.0)
    want, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    got, _ = fused_linear_grpo_loss(hidden, weight, targets, mask, advantages, backend="torch", **kwargs)
    assert abs(float(got) - float(want)) <= 1e-12 * max(1.0, abs(float(want))), (float(got), float(want))
    grads, want_grads = (torch.autograd.grad(x, (hidden, weight)) for x in (got, want))
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    if loss_type != "vespo":  # vespo folds the weights into phi instead (log 0 clamps to log 1e-8: ~0 gradient)
        assert float(grads[0][1].abs().max()) == 0.0


class OffsetEngine(BuiltinEngine):
    """The built-in engine whose reported log-probs are shifted by `offset` on the first completion of each group:
    a stand-in for an engine whose numerics differ from the trainer's."""

    offset = -0.7

    def generate(self, prompts, **kwargs):
        out = super().generate(prompts, **kwargs)
        out.logprobs[:: kwargs["num_generations"]] += self.offset * out.completion_mask[:: kwargs["num_generations"]]
        return out


def test_trainer_weights_the_loss_and_reports_the_mismatch(tmp_path):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 5, "max_steps": 1, "export": False, "progress_bar": False,
                           "output_dir": str(tmp_path), "rollout_correction": "mask",
                           "rollout_correction_level": "token", "rollout_correction_clip_max": 1.5})
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          config, engine=OffsetEngine(model, tokenizer))
    metrics = trainer.train_step()
    # 2 of 8 completions carry every token off by 0.7: exp(0.7) = 2.01 > 1.5 masks them; the rest match to fp32.
    assert 0.0 < metrics["rollout_masked_frac"] <= 0.5 and metrics["rollout_is_weight_min"] == 0.0
    assert metrics["rollout_logp_diff_max"] == pytest.approx(0.7, abs=1e-4)
    assert metrics["rollout_logp_diff"] == pytest.approx(0.7 * metrics["rollout_masked_frac"], abs=1e-4)
    assert math.isfinite(metrics["loss"])


def _offset_trainer(tmp_path, **fields):
    """A default-task trainer over OffsetEngine, its weights nudged away from the reference (seeded), so that the
    correction and the KL both act."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 2,
                           "max_completion_length": 5, "max_steps": 1, "export": False, "progress_bar": False,
                           "output_dir": str(tmp_path), "beta": 0.1, **fields})
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          config, engine=OffsetEngine(model, tokenizer))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return trainer


@pytest.mark.parametrize("mode, level, clip", [("truncate", "sequence", 1.5), ("mask", "token", 1.5)])
def test_one_update_weights_itself_as_an_old_pass_would(tmp_path, mode, level, clip):
    """One optimizer step with the correction on: no old pass (the reference pass alone), the loss weighting each
    micro-batch from its own forward's log-probs; the step equals one with the old pass forced, metrics and
    gradients: the same fp32 ops (the trainer test of the old log-probs from the loss derives the bounds)."""
    from tests.test_trainer import _counting_logprobs, assert_one_adamw_step_apart

    fields = dict(rollout_correction=mode, rollout_correction_level=level, rollout_correction_clip_max=clip)
    fast, forced = _offset_trainer(tmp_path / "fast", **fields), _offset_trainer(tmp_path / "old", **fields)
    forced._needs_old_pass = lambda: True  # the old pass, and the weights prepare_loss_batch takes from it
    fast_calls, forced_calls = _counting_logprobs(fast), _counting_logprobs(forced)
    got, want = fast.train_step(), forced.train_step()
    assert fast_calls == [fast.ref_model] and forced_calls == [forced.model, forced.ref_model]
    changed = "rollout_truncated_frac" if mode == "truncate" else "rollout_masked_frac"
    assert 0 < want[changed] < 1 and want["rollout_logp_diff_max"] == pytest.approx(0.7, abs=1e-4)
    for key in ("loss", "grad_norm", "kl", "rollout_logp_diff", "rollout_logp_diff_max", "rollout_is_weight_mean",
                "rollout_is_weight_min", "rollout_is_weight_max", changed):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert_one_adamw_step_apart(fast, forced)


def test_the_weights_move_the_step(tmp_path):
    """The self-weighted step is not the uncorrected one: the loss and the gradients change."""
    corrected = _offset_trainer(tmp_path / "c", rollout_correction="mask", rollout_correction_level="token",
                                rollout_correction_clip_max=1.5)
    plain = _offset_trainer(tmp_path / "p")
    got, want = corrected.train_step(), plain.train_step()
    assert got["loss"] != pytest.approx(want["loss"], rel=1e-3)
    assert "rollout_masked_frac" in got and "rollout_masked_frac" not in want


def test_grpo_loss_checks_the_correction_inputs():
    from fastgrpo.loss.model import grpo_loss

    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    ids = torch.randint(3, 20, (2, 6))
    completion = torch.zeros_like(ids)
    completion[:, 3:] = 1
    args = (model, ids, torch.ones_like(ids), completion, torch.ones(2))
    correction = RolloutCorrection("truncate")
    with pytest.raises(ValueError, match="rollout_logps: the rollout correction needs"):
        grpo_loss(*args, rollout_correction=correction)
    with pytest.raises(ValueError, match="token_weights: the rollout correction computes them"):
        grpo_loss(*args, rollout_correction=correction, rollout_logps=torch.zeros(2, 6),
                  token_weights=torch.ones(2, 6))
    with pytest.raises(ValueError, match="rollout_logps: expected"):
        grpo_loss(*args, rollout_correction=correction, rollout_logps=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="rollout_correction: expected mode"):
        grpo_loss(*args, rollout_correction=RolloutCorrection("none"), rollout_logps=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="rollout_correction: expected a fastgrpo"):
        grpo_loss(*args, rollout_correction="truncate", rollout_logps=torch.zeros(2, 6))


@pytest.mark.gpu
def test_one_update_weights_itself_on_gpu(tmp_path):
    """The same on CUDA, bf16, patched (the lm_head's log-probs through the Triton kernel): no old pass, the shifted
    completions' weights truncated, a finite step; and with two optimizer steps the old pass is back."""
    import fastgrpo

    for iterations, passes in ((1, 1), (2, 2)):
        tokenizer = default_task.build_tokenizer()
        model = fastgrpo.patch_model(default_task.build_model(tokenizer).to("cuda", torch.bfloat16))
        config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 4,
                               "max_completion_length": 5, "max_steps": 1, "export": False, "progress_bar": False,
                               "output_dir": str(tmp_path / str(iterations)), "beta": 0.1, "device": "cuda",
                               "dtype": "bfloat16", "num_iterations": iterations, "rollout_correction": "truncate",
                               "rollout_correction_clip_max": 1.5})
        trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                              config, engine=OffsetEngine(model, tokenizer))
        calls, logprobs = [], trainer._logprobs
        trainer._logprobs = lambda m, *args, **kwargs: calls.append(m) or logprobs(m, *args, **kwargs)
        metrics = trainer.train_step()
        assert len(calls) == passes, calls  # the reference pass, and the old pass only with two optimizer steps
        assert 0 < metrics["rollout_truncated_frac"] <= 0.5 and metrics["rollout_is_weight_max"] == 1.5
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


@given(B=st.integers(1, 5), T=st.integers(1, 9), seed=st.integers(0, 2**16), mode=st.sampled_from(["truncate", "mask"]),
       level=st.sampled_from(["token", "sequence"]), clip_min=st.sampled_from([None, 0.3]),
       clip_max=st.sampled_from([None, 1.2, 3.0]))
def test_loss_side_weights_are_rollout_corrections(B, T, seed, mode, level, clip_min, clip_max):
    """correction_weights (what the loss computes, no host sync) equals rollout_correction's weights bit for bit:
    any shapes, masks with empty rows, NaN engine log-probs."""
    if mode == "truncate" and clip_min is None and clip_max is None:
        clip_max = 3.0
    g = torch.Generator().manual_seed(seed)
    train = -torch.randn(B, T, generator=g).abs() * 0.5
    rollout = (train + torch.randn(B, T, generator=g) * 0.3).clamp(max=0.0)  # log-probs, as an engine's are
    rollout[torch.rand(B, T, generator=g) < 0.1] = float("nan")
    mask = (torch.rand(B, T, generator=g) < 0.7).long()
    want, _ = rollout_correction(train, rollout, mask, mode, level, clip_min, clip_max)
    got = correction_weights(train, rollout, mask, RolloutCorrection(mode, level, clip_min, clip_max))
    assert got.shape == (B, T) and torch.equal(got, want)


@pytest.mark.parametrize("value, what", [(float("inf"), "inf"), (float("-inf"), "-inf"), (0.5, "a positive value")])
def test_inf_or_positive_rollout_logps_where_the_mask_is_1_are_refused(value, what):
    """An engine's inf log-prob of a sampled token made its weight inf or 0 silently (nan_to_num's largest float), a
    positive one (no log-prob: a negative log-likelihood passed by mistake) a wrong weight; the correction and the
    model-level loss refuse them in the value read they make already. NaN (a token the engine could not score) still
    counts 0, and an inf at a masked position is padding."""
    from fastgrpo.loss.model import grpo_loss

    rollout = ROLLOUT.clone()
    rollout[1, 2] = float("inf")  # masked: allowed
    rollout[0, 0] = float("nan")  # could not score: allowed
    rollout[1, 1] = value
    message = (f"^rollout_logps: expected finite log-probs <= 0 \\(or NaN\\) where mask is 1, got {what} at row 1, "
               "column 1$")
    with pytest.raises(ValueError, match=message):
        rollout_correction(TRAIN, rollout, MASK, "truncate", "token", None, 3.0)
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    ids = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    completion = torch.zeros_like(ids)
    completion[:, 3:] = 1
    engine = torch.full((2, 6), -0.5)
    engine[0, 1] = float("-inf")  # masked: allowed
    engine[0, 4] = float("nan")
    engine[1, 5] = value
    old = -torch.rand(2, 6, generator=torch.Generator().manual_seed(1))
    message = message.replace("where mask", "where completion_mask").replace("column 1", "column 5")
    for old_logps in (None, old):  # the weights from this forward, or from old_logps
        args = (model, ids, torch.ones_like(ids), completion, torch.ones(2))
        kwargs = dict(old_logps=old_logps, rollout_correction=RolloutCorrection("truncate"))
        with pytest.raises(ValueError, match=message):
            grpo_loss(*args, rollout_logps=engine, **kwargs)
        engine_ok = engine.clone()
        engine_ok[1, 5] = -0.5
        assert grpo_loss(*args, rollout_logps=engine_ok, **kwargs)[0].isfinite()


@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (0.5, "a positive value")])
def test_train_logps_must_be_finite_log_probs_where_the_mask_is_1(value, what):
    """The trainer's own log-probs (old_logps), which the weights are taken towards: a positive one (no log-prob) made
    a wrong weight silently, as in the loss's old_logps check; NaN is refused too (only an engine may leave a token
    unscored). A masked position is padding."""
    train = TRAIN.clone()
    train[1, 2] = 7.0  # masked: allowed
    assert rollout_correction(train, ROLLOUT, MASK, "truncate", "token", None, 3.0)[0].isfinite().all()
    train[0, 1] = value
    message = f"^train_logps: expected finite log-probs <= 0 where mask is 1, got {what} at row 0, column 1$"
    with pytest.raises(ValueError, match=message):
        rollout_correction(train, ROLLOUT, MASK, "truncate", "token", None, 3.0)


@pytest.mark.parametrize("mode, clip_min", [("mask", None), ("mask", 0.5), ("truncate", 0.5)])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_that_overflow_to_inf_are_refused(mode, clip_min, level):
    """With clip_max None nothing bounds the weight from above: exp(train - rollout) past fp32's largest number was
    an inf token weight, an inf loss. rollout_correction finds it in its metrics' read, the model-level loss given
    old_logps in its value read, and without them (weighting itself from its own forward) in a read after the loss
    is queued; the same ratio with a bound is masked / truncated as before."""
    from fastgrpo.loss.model import grpo_loss

    train = TRAIN.float()
    rollout = ROLLOUT.float()
    rollout[1, 1] = -120.0  # exp(-1.2 + 120) overflows fp32
    at = "row 1" if level == "sequence" else "row 1, column 1"
    message = (f"^rollout_correction_clip_max: None leaves the importance weights unbounded, and the weight at {at} "
               r"overflowed to inf \(exp of the trainer's minus the engine's log-probs\); set a bound, e.g. 3.0$")
    with pytest.raises(ValueError, match=message):
        rollout_correction(train, rollout, MASK, mode, level, clip_min, None)
    weights, _ = rollout_correction(train, rollout, MASK, mode, level, clip_min, 3.0)
    assert weights.isfinite().all()
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    ids = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    completion = torch.zeros_like(ids)
    completion[:, 3:] = 1
    old, engine = torch.full((2, 6), -1.0), torch.full((2, 6), -1.0)
    engine[1, 4] = -120.0
    args = (model, ids, torch.ones_like(ids), completion, torch.ones(2))
    message = message.replace("column 1", "column 4")
    for old_logps in (old, None):  # the tiny model's own log-probs are near log(1/41): exp(-3.7 + 120) overflows too
        with pytest.raises(ValueError, match=message):
            grpo_loss(*args, old_logps=old_logps, rollout_logps=engine,
                      rollout_correction=RolloutCorrection(mode, level, clip_min, None))
        loss, _ = grpo_loss(*args, old_logps=old_logps, rollout_logps=engine,
                            rollout_correction=RolloutCorrection(mode, level, clip_min, 3.0))
        assert loss.isfinite()


def test_a_self_weighted_step_whose_weights_overflow_stops_the_run(tmp_path):
    """One optimizer step with the correction on and no old pass (the loss weights itself from its own forward):
    with clip_max None an engine far below the trainer made the loss inf; the loss refuses the weights (the step's
    rollout_correction metrics did, after the optimizer step) before the step is logged or saved."""
    from fastgrpo.train.checkpoint import list_checkpoints

    class FarEngine(OffsetEngine):
        offset = -100.0  # exp(100) overflows fp32

    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                           "max_completion_length": 5, "max_steps": 1, "export": False, "progress_bar": False,
                           "output_dir": str(tmp_path), "rollout_correction": "mask",
                           "rollout_correction_level": "token", "rollout_correction_clip_max": None})
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(16),
                          config, engine=FarEngine(model, tokenizer))
    with pytest.raises(ValueError, match=r"^rollout_correction_clip_max: None leaves the importance weights unbounded, "
                                         r"and the weight at row 0, column \d+ overflowed to inf"):
        trainer.train()
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("name, value, what", [
    ("rollout_logps", float("inf"), "inf"), ("rollout_logps", float("-inf"), "-inf"),
    ("rollout_logps", 0.5, "a positive value"), ("train_logps", float("nan"), "NaN"),
    ("train_logps", float("-inf"), "-inf"), ("train_logps", 0.5, "a positive value"),
])
def test_logprob_gap_refuses_log_probs_that_made_it_inf_or_nan(name, value, what):
    """An inf log-prob where mask is 1 made the gap inf (or kl_k3 NaN) silently, and a train NaN was left out as if
    the engine could not score it: logprob_gap checks its inputs as rollout_correction does, in one host read. A NaN
    rollout log-prob is still left out, and padding (mask 0) holds anything."""
    logps = {"train_logps": TRAIN.clone(), "rollout_logps": ROLLOUT.clone()}  # ROLLOUT[1, 2] = 5.0: padding
    logps["rollout_logps"][0, 2] = float("nan")
    logps[name][1, 1] = value
    expected = r"finite log-probs <= 0 \(or NaN\)" if name == "rollout_logps" else "finite log-probs <= 0"
    with pytest.raises(ValueError, match=f"^{name}: expected {expected} where mask is 1, got {what} at row 1, "
                                         "column 1$"):
        logprob_gap(logps["train_logps"], logps["rollout_logps"], MASK)
    logps[name][1, 1] = -0.5
    got = logprob_gap(logps["train_logps"], logps["rollout_logps"], MASK)
    assert got["tokens"] == 4 and all(math.isfinite(v) for v in got.values())
