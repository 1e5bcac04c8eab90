"""The loss API refuses, with a ValueError naming the argument, every input the issue found accepted: loss options
out of range given as keywords to the model-level loss, masks outside {0, 1}, ids outside [0, V), float ids, an
empty batch, and an lm_head on `meta` under accelerate's CPU offload hooks (wrong log-probs before)."""
import pytest
import torch

from fastgrpo.loss import reference
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.ops.fused_linear import fused_linear_logprobs
from fastgrpo.train import default_task


def _model_and_batch(B=2, T=6):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    ids = torch.randint(3, len(tokenizer), (B, T), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    completion = torch.zeros_like(ids)
    completion[:, T // 2:] = 1
    return model, ids, attention, completion


def _entry_points(model, ids, attention, completion, advantages, **options):
    """The loss's three entry points on one batch, as calls: the model-level loss, and the fused lm_head + loss and
    its eager reference over random 8-wide hidden states and an 11-token lm_head."""
    hidden = torch.randn(*ids.shape, 8)
    weight = torch.randn(11, 8)
    targets = ids % 11
    return [lambda: grpo_loss(model, ids, attention, completion, advantages, **options),
            lambda: fused_linear_grpo_loss(hidden, weight, targets, completion, advantages, **options),
            lambda: reference.grpo_loss(hidden, weight, targets, completion, advantages, **options)]


@pytest.mark.parametrize("options, message", [
    (dict(epsilon_low=-0.1), r"epsilon_low: expected a float in \[0, 1\), got -0.1"),
    (dict(epsilon_low=1.0), r"epsilon_low: expected a float in \[0, 1\), got 1.0"),
    (dict(epsilon_high=-0.2), "epsilon_high: expected None or a finite float >= 0"),
    (dict(delta=0.9), "delta: expected None or a float >= 1"),
    (dict(loss_type="dr_grpo", max_completion_length=0), "max_completion_length: expected None or an int >= 1"),
    (dict(loss_type="dr_grpo", max_completion_length=-4), "max_completion_length: expected None or an int >= 1"),
    (dict(num_items_in_batch=0), "num_items_in_batch: expected None or a number > 0"),
    (dict(num_items_in_batch=torch.tensor(-2.0)), "num_items_in_batch: expected None or a number > 0"),
])
def test_model_level_loss_refuses_bad_options(options, message):
    model, ids, attention, completion = _model_and_batch()
    with pytest.raises(ValueError, match=f"^{message}"):
        grpo_loss(model, ids, attention, completion, torch.ones(2), **options)


@pytest.mark.parametrize("change, message", [
    ("completion_half", r"^completion_mask: expected a bool mask or 0/1 values"),
    ("attention_two", r"^attention_mask: expected a bool mask or 0/1 values"),
    ("ids_vocab", r"^input_ids: expected ids in \[0, 41\)"),
    ("ids_negative", r"^input_ids: expected ids in \[0, 41\)"),
    ("ids_float", r"^input_ids: expected an integer dtype"),
    ("empty", r"^input_ids: expected at least one sequence"),
])
def test_model_level_loss_and_logprobs_refuse_bad_tensors(change, message):
    model, ids, attention, completion = _model_and_batch()
    advantages = torch.ones(2)
    if change == "completion_half":
        completion = completion * 0.5
    elif change == "attention_two":
        attention = attention * 2
    elif change == "ids_vocab":
        ids[0, 1] = 41
    elif change == "ids_negative":
        ids[1, 4] = -1
    elif change == "ids_float":
        ids = ids.float()
    else:
        ids, attention, completion, advantages = ids[:0], attention[:0], completion[:0], advantages[:0]
    with pytest.raises(ValueError, match=message):
        grpo_loss(model, ids, attention, completion, advantages)
    with pytest.raises(ValueError, match=message):
        sequence_logprobs(model, ids, attention, completion)


def test_fused_functions_refuse_float_ids_and_binary_masks():
    hidden, weight = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3))
    with pytest.raises(ValueError, match="^target_ids: expected an integer dtype"):
        fused_linear_logprobs(hidden, weight, ids.double())
    with pytest.raises(ValueError, match="^target_ids: expected an integer dtype"):
        fused_linear_grpo_loss(hidden, weight, ids.double(), torch.ones(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="^completion_mask: expected a bool mask or 0/1 values"):
        fused_linear_grpo_loss(hidden, weight, ids, torch.full((2, 3), 0.5), torch.ones(2))


def test_weights_on_meta_under_accelerate_cpu_offload_are_an_error():
    accelerate = pytest.importorskip("accelerate")
    model, ids, attention, completion = _model_and_batch()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))  # weights on meta between calls
    assert model.lm_head.weight.is_meta
    for call in (lambda: sequence_logprobs(model, ids, attention, completion),
                 lambda: grpo_loss(model, ids, attention, completion, torch.ones(2))):
        with pytest.raises(ValueError, match="^model: lm_head.weight is on the meta device"):
            call()


@pytest.mark.parametrize("shape, at, value, message", [
    ((2,), (1,), float("nan"), "got NaN at row 1"),
    ((2,), (0,), float("-inf"), "got -inf at row 0"),
    ((2, 6), (1, 4), float("inf"), "got inf at row 1, column 4"),
])
def test_every_loss_entry_point_refuses_nonfinite_advantages(shape, at, value, message):
    """A NaN / inf advantage made the loss NaN (or -inf) silently; it is found in the value read the checks make
    already (no host sync of its own), at its first position."""
    model, ids, attention, completion = _model_and_batch()
    advantages = torch.ones(shape)
    advantages.view(-1)[-1] = float("nan")  # the last entry: an earlier one is named first
    advantages[at] = value
    hidden = torch.randn(2, 6, 8, dtype=torch.float64)
    weight = torch.randn(11, 8, dtype=torch.float64)
    targets = ids % 11
    calls = [lambda: grpo_loss(model, ids, attention, completion, advantages),
             lambda: fused_linear_grpo_loss(hidden, weight, targets, completion, advantages),
             lambda: reference.grpo_loss(hidden, weight, targets, completion, advantages)]
    for call in calls:
        with pytest.raises(ValueError, match=f"^advantages: expected finite values, {message}$"):
            call()


@pytest.mark.parametrize("name", ["old_logps", "ref_logps", "token_weights", "sampling_logps"])
def test_nan_per_token_inputs_at_masked_positions_leave_loss_and_grads_finite(name):
    """Masked positions of the per-token inputs are padding (a NaN log-prob there is allowed): every entry point
    gives the loss and gradients it gives with a finite value there. The reference's were NaN (exp's backward of
    the NaN ratio, times the 0 of the mask)."""
    model, ids, attention, completion = _model_and_batch()
    completion[1, -1] = 0  # padding inside the completion window
    hidden = torch.randn(2, 6, 8, dtype=torch.float64)
    weight = torch.randn(11, 8, dtype=torch.float64)
    targets = ids % 11
    options = dict(beta=0.1, off_policy_mask_threshold=0.0)  # every per-token input enters the loss

    def inputs(value):
        tensors = {key: -torch.rand(2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                   for i, key in enumerate(["old_logps", "ref_logps", "sampling_logps"])}
        tensors["token_weights"] = torch.full((2, 6), 0.5, dtype=torch.float64)
        tensors[name][1, -1] = value
        return tensors

    def model_loss(tensors):
        model.zero_grad()
        loss, _ = grpo_loss(model, ids, attention, completion, torch.tensor([1.0, -1.0]),
                            **{k: v.float() for k, v in tensors.items()}, **options)
        loss.backward()
        return loss, model.lm_head.weight.grad

    def hidden_loss(function, tensors):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = function(h, w, targets, completion, torch.tensor([1.0, -1.0], dtype=torch.float64),
                           **tensors, **options)
        loss.backward()
        return loss, h.grad, w.grad

    for run in (model_loss, lambda t: hidden_loss(fused_linear_grpo_loss, t),
                lambda t: hidden_loss(reference.grpo_loss, t)):
        with_nan, finite = run(inputs(float("nan"))), run(inputs(-1.0))
        for got, expected in zip(with_nan, finite):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["old_logps", "ref_logps", "token_weights"])
@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_every_loss_entry_point_refuses_nonfinite_per_token_inputs_where_completion_mask_is_1(name, value, what):
    """A NaN / inf old or ref log-prob or token weight of a completion token made the loss NaN or inf silently; it
    is found in the value read the checks make already. A NaN at a masked position (padding) is no error."""
    model, ids, attention, completion = _model_and_batch()
    tensors = {"old_logps": -torch.rand(2, 6), "ref_logps": -torch.rand(2, 6), "token_weights": torch.ones(2, 6)}
    tensors[name][0, 1] = float("nan")  # masked: allowed
    tensors[name][1, 4] = value
    tensors["sampling_logps"] = torch.full((2, 6), float("nan"))  # the off-policy mask counts these 0, as TRL's
    calls = _entry_points(model, ids, attention, completion, torch.ones(2), **tensors, beta=0.1)
    expected = "finite values >= 0" if name == "token_weights" else "finite log-probs <= 0"
    message = f"^{name}: expected {expected} where completion_mask is 1, got {what} at row 1, column 4$"
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    tensors[name][1, 4] = 0.5 if name == "token_weights" else -1.0
    for call in calls:
        assert call()[0].isfinite()


def test_every_loss_entry_point_refuses_negative_token_weights_where_completion_mask_is_1():
    """A negative token weight flipped the sign of its token's policy gradient silently; it is found in the value
    read the checks make already, the fused and the eager loss alike. At a masked position (padding) it is no
    error, and 0 (a token the correction drops) is none either."""
    model, ids, attention, completion = _model_and_batch()
    weights = torch.ones(2, 6)
    weights[0, 1] = -3.0  # masked: allowed
    weights[1, 3] = 0.0
    weights[1, 4] = -0.25
    hidden = torch.randn(2, 6, 8)
    weight = torch.randn(11, 8)
    targets = ids % 11
    calls = [lambda: grpo_loss(model, ids, attention, completion, torch.ones(2), token_weights=weights),
             *(lambda backend=backend: fused_linear_grpo_loss(hidden, weight, targets, completion, torch.ones(2),
                                                              token_weights=weights, backend=backend)
               for backend in ("torch", "triton")),  # Triton under TRITON_INTERPRET=1 (conftest)
             lambda: reference.grpo_loss(hidden, weight, targets, completion, torch.ones(2), token_weights=weights)]
    message = ("^token_weights: expected finite values >= 0 where completion_mask is 1, got a negative value at row 1, "
               "column 4$")
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    weights[1, 4] = 0.25
    for call in calls:
        assert call()[0].isfinite()


@pytest.mark.parametrize("value, what", [(float("inf"), "inf"), (float("-inf"), "-inf"), (0.5, "a positive value")])
def test_every_loss_entry_point_refuses_sampling_logps_that_are_no_log_probs_where_completion_mask_is_1(value, what):
    """An engine's inf log-prob of a sampled token moved the off-policy mask silently (+inf dropped its sequence,
    -inf kept it), and so did a positive one (a negative log-likelihood passed by mistake); they are found in the
    value read the checks make already. NaN (a token the engine could not score), a positive value within rounding
    of 0 and anything at a masked position pass."""
    model, ids, attention, completion = _model_and_batch()
    sampling = -torch.rand(2, 6, generator=torch.Generator().manual_seed(0))
    sampling[0, 1] = float("inf")  # masked: allowed
    sampling[0, 3] = float("nan")
    sampling[0, 4] = 1e-3  # rounding
    sampling[1, 4] = value
    calls = _entry_points(model, ids, attention, completion, torch.tensor([1.0, -1.0]), sampling_logps=sampling,
                          off_policy_mask_threshold=0.0)
    message = (r"^sampling_logps: expected finite log-probs <= 0 \(or NaN\) where completion_mask is 1, got "
               f"{what} at row 1, column 4$")
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    sampling[1, 4] = -0.5
    for call in calls:
        assert call()[0].isfinite()


@pytest.mark.parametrize("name", ["old_logps", "ref_logps"])
def test_every_loss_entry_point_refuses_old_or_ref_logps_above_0_where_completion_mask_is_1(name):
    """A positive old or ref log-prob of a completion token (a negative log-likelihood or a probability passed by
    mistake) moved the ratio and the KL term silently; it is refused in the value read the checks make already, as
    sampling_logps' are. A value within bf16 rounding of 0 and anything at a masked position pass; NaN does not
    (test above): these are the trainer's own log-probs, not an engine's that may not have scored a token."""
    model, ids, attention, completion = _model_and_batch()
    tensors = {"old_logps": -torch.rand(2, 6), "ref_logps": -torch.rand(2, 6)}
    tensors[name][0, 1] = 5.0  # masked: allowed
    tensors[name][0, 4] = 1e-3  # rounding
    tensors[name][1, 4] = 0.7
    calls = _entry_points(model, ids, attention, completion, torch.ones(2), **tensors, beta=0.1)
    message = (f"^{name}: expected finite log-probs <= 0 where completion_mask is 1, got a positive value at row 1, "
               "column 4$")
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call()
    tensors[name][1, 4] = -0.7
    for call in calls:
        assert call()[0].isfinite()
