"""The "use the kernels in your own loop" API as a user's own loop calls it: grpo_loss, sequence_logprobs and sft_loss
on a real (tiny, random) HF model, against an eager fp64 reference of the README's formulas, and the inputs users
get wrong, each refused in one line naming the argument."""
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import fastgrpo

B, P, C, V = 3, 4, 5, 97


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def padded_batch():
    """[left padding | prompt | completion | right padding] rows of P + C columns."""
    input_ids = torch.randint(1, V, (B, P + C), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(B, P + C, dtype=torch.long)
    completion_mask = torch.zeros(B, P + C, dtype=torch.long)
    completion_mask[:, P:] = 1
    attention_mask[0, 0] = 0  # a shorter prompt
    attention_mask[1, -2:] = completion_mask[1, -2:] = 0  # a shorter completion
    return input_ids, attention_mask, completion_mask


def eager_logps(model, input_ids, attention_mask, completion_mask, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.double() / temperature
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    logps = torch.cat([torch.zeros(B, 1, dtype=logps.dtype), logps], 1)  # position t: token t
    return torch.where(completion_mask.bool(), logps, 0.0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_grpo_loss_is_the_readme_formula_in_fp64(loss_type):
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    advantages = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    temperature, eps_low, eps_high, beta = 0.7, 0.2, 0.28, 0.04
    with torch.no_grad():
        logp = eager_logps(model, input_ids, attention_mask, completion_mask, temperature)
    noise = torch.randn(B, P + C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    old = torch.where(completion_mask.bool(), (logp + 0.3 * noise).clamp(max=0.0), 0.0)
    ref = torch.where(completion_mask.bool(), logp - 0.1, 0.0)
    loss, _ = fastgrpo.grpo_loss(model, input_ids, attention_mask, completion_mask, advantages, old_logps=old,
                                 ref_logps=ref, loss_type=loss_type, beta=beta, temperature=temperature,
                                 epsilon_low=eps_low, epsilon_high=eps_high, max_completion_length=C)
    r = torch.exp(logp - old)
    a = advantages[:, None]
    per_token = -torch.min(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a) + beta * (
        torch.exp(ref - logp) - (ref - logp) - 1)
    m = completion_mask.double()
    expected = {"grpo": ((per_token * m).sum(1) / m.sum(1)).mean(), "bnpo": (per_token * m).sum() / m.sum(),
                "dr_grpo": (per_token * m).sum() / (B * C)}[loss_type]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["old_logps", "ref_logps"])
def test_integer_old_or_ref_logps_are_refused(name):
    # A long tensor of log-probs (e.g. from torch.zeros_like(input_ids)) truncated every value to an int silently.
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    given = {name: torch.zeros(B, P + C, dtype=torch.long)}
    with pytest.raises(ValueError, match=f"^{name}: expected a floating dtype, got int64$"):
        fastgrpo.grpo_loss(model, input_ids, attention_mask, completion_mask, torch.ones(B), beta=0.1, **given)


@pytest.mark.parametrize("temperature", [float("inf"), "1.0", True])
def test_sequence_logprobs_refuses_a_temperature_grpo_loss_refuses(temperature):
    # inf gave every token log(1 / V) silently; a string raised a TypeError from inside the kernel's launcher.
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    with pytest.raises(ValueError, match=r"^temperature: expected a finite float > 0, got "):
        fastgrpo.sequence_logprobs(model, input_ids, attention_mask, completion_mask, temperature=temperature)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), "1.0", True])
def test_the_fused_head_ops_refuse_a_temperature_that_is_no_positive_finite_number(temperature):
    # inf gave every token log(1 / V) silently (fused_linear_logprobs / fused_linear_grpo_loss check it themselves)
    hidden, weight, ids = torch.randn(3, 16), torch.randn(11, 16), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"^temperature: expected a finite float > 0, got "):
        fastgrpo.fused_linear_logprobs(hidden, weight, ids, temperature=temperature)


@pytest.mark.parametrize("function", ["grpo_loss", "sequence_logprobs"])
def test_a_completion_token_on_padding_is_refused(function):
    # sft_loss refuses a response token where attention_mask is 0; grpo_loss scored it as a real completion token.
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    completion_mask[1, -1] = 1  # row 1's right padding
    args = (model, input_ids, attention_mask, completion_mask) + ((torch.ones(B),) if function == "grpo_loss" else ())
    with pytest.raises(ValueError, match=r"^completion_mask: is 1 where attention_mask is 0 \(row 1, column 8\)"):
        getattr(fastgrpo, function)(*args)


@pytest.mark.parametrize("num_items_in_batch", [float("inf"), "13", True, torch.tensor([13, 13])])
def test_sft_loss_refuses_a_normalizer_that_is_no_positive_count(num_items_in_batch):
    # inf gave a zero loss silently; a string raised a TypeError; True divided by 1; two counts broadcast.
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    with pytest.raises(ValueError, match=r"^num_items_in_batch: expected > 0 \(response tokens of the step\) or None"):
        fastgrpo.sft_loss(model, input_ids, attention_mask, completion_mask, num_items_in_batch=num_items_in_batch)


def test_sft_loss_takes_a_count_as_a_number_or_a_tensor():
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    with torch.no_grad():
        expected = -eager_logps(model, input_ids, attention_mask, completion_mask, 1.0).sum() / 26
    for count in (26, 26.0, torch.tensor(26), torch.tensor([26.0])):
        loss, _ = fastgrpo.sft_loss(model, input_ids, attention_mask, completion_mask, num_items_in_batch=count)
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-7, atol=1e-9)


def test_bool_advantages_are_refused():
    # a mask passed as advantages trained as advantages of 0 and 1
    model = tiny_llama()
    input_ids, attention_mask, completion_mask = padded_batch()
    with pytest.raises(ValueError, match=r"^advantages: expected numbers, got a bool tensor$"):
        fastgrpo.grpo_loss(model, input_ids, attention_mask, completion_mask,
                           torch.ones(input_ids.shape[0], dtype=torch.bool))
