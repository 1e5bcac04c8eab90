"""fastgrpo.course against eager fp64 references written from its docstrings, for what a mutation audit of course.py
found untested: special tokens or a joint tokenization of prompt + output (test_algorithms' tokenizer has neither
merges nor a BOS template), the fp32 log-probs of a bf16 model, the SFT step with rows whose response-token counts
differ from normalize_constant, grpo_clip at cliprange 0, a graph kept in the `ratio` metadata, and the clip
fraction of a microbatch without response tokens.
"""
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fastgrpo import course

f64 = torch.float64
PAD, BOS = 0, 2
CHARS = list("ab13+= ")


def merging_tokenizer():
    """One token per character, plus the merge "=" "1" -> "=1" and a template that adds BOS (as Llama's does): a
    prompt ending in "=" and an output starting with "1" tokenize differently together and apart."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": 1, "<bos>": BOS, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    vocab["=1"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("=", "1")], unk_token="<unk>"))
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>", pad_token="<pad>")


def layout_reference(prompts, outputs, tokenizer):
    """The docstring's layout row by row: prompt ids then output ids, each tokenized alone without special tokens,
    right-padded to the longest pair; input_ids / labels drop the last / first position, response_mask marks the
    labels that are output tokens."""
    pairs = [(tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(o, add_special_tokens=False))
             for p, o in zip(prompts, outputs)]
    width = max(len(p) + len(o) for p, o in pairs)
    ids, is_output = [], []
    for p, o in pairs:
        pad = width - len(p) - len(o)
        ids.append(p + o + [PAD] * pad)
        is_output.append([False] * len(p) + [True] * len(o) + [False] * pad)
    return {"input_ids": [r[:-1] for r in ids], "labels": [r[1:] for r in ids],
            "response_mask": [r[1:] for r in is_output]}


def test_tokenize_prompt_and_output_tokenizes_each_part_alone_without_special_tokens():
    tokenizer = merging_tokenizer()
    one, plus, eq, three, eq_one = (tokenizer.convert_tokens_to_ids(t) for t in ("1", "+", "=", "3", "=1"))
    # The traps are armed: by default the tokenizer adds BOS, and "1+1=" + "13" merges across the boundary.
    assert tokenizer("1+1=")["input_ids"] == [BOS, one, plus, one, eq]
    assert tokenizer.encode("1+1=13", add_special_tokens=False) == [one, plus, one, eq_one, three]
    out = course.tokenize_prompt_and_output(["1+1=", "3"], ["13", "="], tokenizer)
    full = [[one, plus, one, eq, one, three], [three, eq, PAD, PAD, PAD, PAD]]
    assert out["input_ids"].tolist() == [r[:-1] for r in full]
    assert out["labels"].tolist() == [r[1:] for r in full]
    assert out["response_mask"].tolist() == [[False, False, False, True, True], [True, False, False, False, False]]


texts = st.text(alphabet="".join(CHARS), max_size=5)


@given(st.lists(st.tuples(texts, texts), min_size=1, max_size=3).filter(lambda ps: any(p + o for p, o in ps)))
def test_tokenize_prompt_and_output_matches_its_reference(pairs):
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    tokenizer = merging_tokenizer()
    out = course.tokenize_prompt_and_output(prompts, outputs, tokenizer)
    want = layout_reference(prompts, outputs, tokenizer)
    assert {key: value.tolist() for key, value in out.items()} == want
    assert out["response_mask"].dtype == torch.bool


def tiny_llama_bf16(vocab_size):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def test_get_response_log_probs_of_a_bf16_model_are_fp32():
    tokenizer = merging_tokenizer()
    model = tiny_llama_bf16(len(tokenizer))
    batch = course.tokenize_prompt_and_output(["1+1=", "a b"], ["13", " ab="], tokenizer)
    with torch.no_grad():
        out = course.get_response_log_probs(model, batch["input_ids"], batch["labels"], return_token_entropy=True)
        logits = model(batch["input_ids"]).logits.double()  # the model's bf16 logits, exactly
    log_probs = torch.log_softmax(logits, -1)
    want = log_probs.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    want_entropy = -(log_probs.exp() * log_probs).sum(-1)
    assert out["log_probs"].dtype == out["token_entropy"].dtype == torch.float32
    # fp32 log_softmax of the same logits: a few fp32 ulps of |z| + logsumexp (bf16 arithmetic errs ~2^-8 of it).
    atol = 16 * torch.finfo(torch.float32).eps * (logits.abs().max().item() + math.log(logits.shape[-1]))
    torch.testing.assert_close(out["log_probs"].double(), want, rtol=0, atol=atol)
    torch.testing.assert_close(out["token_entropy"].double(), want_entropy, rtol=0, atol=atol)


# --- grpo_clip ---------------------------------------------------------------------------------------------------


def clip_reference(logp, old, advantages, cliprange):
    """The docstring's -min(r A, clip(r, 1 - c, 1 + c) A), its clip flags, and its gradient -r A where unclipped."""
    ratio = torch.exp(logp - old)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(1 - cliprange, 1 + cliprange) * advantages)
    low = (ratio < 1 - cliprange) & (advantages < 0)
    high = (ratio > 1 + cliprange) & (advantages > 0)
    grad = torch.where(low | high, 0.0, -ratio * advantages)
    return loss, low, high, ratio, grad


@given(st.integers(1, 3), st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       st.booleans())
def test_grpo_clip_loss_matches_its_formula(rows, cols, seed, cliprange, flat_advantages):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, cols, generator=gen, dtype=f64) * 3).requires_grad_()
    old = logp.detach() + 0.5 * torch.randn(rows, cols, generator=gen, dtype=f64)
    advantages = torch.randn(rows, 1, generator=gen, dtype=f64)
    loss, meta = course.compute_grpo_clip_loss(advantages.view(-1) if flat_advantages else advantages, logp, old,
                                               cliprange)
    want, low, high, ratio, grad = clip_reference(logp.detach(), old, advantages, cliprange)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(meta["clipped_low"], low) and torch.equal(meta["clipped_high"], high)
    assert torch.equal(meta["clipped"], low | high)
    torch.testing.assert_close(meta["ratio"], ratio, rtol=1e-12, atol=0)
    assert not meta["ratio"].requires_grad  # metadata is for logging: it keeps no autograd graph alive
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cliprange", [1.0, 1.5, math.inf, math.nan, -0.1])
def test_cliprange_outside_0_1_is_refused_naming_cliprange(cliprange):
    # cliprange >= 1 was refused naming epsilon_low, an argument of fastgrpo's own loss the caller never passed.
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="^cliprange: expected"):
        course.compute_grpo_clip_loss(torch.ones(2, 1), x, x, cliprange)


# --- Microbatch train steps --------------------------------------------------------------------------------------


@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from([0.5, 3.0, 42.0]),
       st.integers(1, 4))
def test_sft_microbatch_step_matches_its_formula(rows, cols, seed, normalize_constant, steps):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, cols, generator=gen, dtype=f64) * 3).requires_grad_()
    mask = torch.rand(rows, cols, generator=gen) < 0.6
    loss, meta = course.sft_microbatch_train_step(logp, mask, steps, normalize_constant)
    # mean_b(sum_t -logp m / normalize_constant) / steps: the constant, never the row's token count.
    m = mask.to(f64)
    want = (-(logp.detach() * m).sum(-1) / normalize_constant).mean() / steps
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(logp.grad, -m / (normalize_constant * rows * steps), rtol=1e-12, atol=1e-15)
    assert meta["response_tokens"].item() == mask.sum().item()


def grpo_step_reference(logp, mask, steps, loss_type, rewards, advantages, old, cliprange):
    """mean_b(masked_mean(per-token loss, mask, dim=-1)) / steps with an empty row adding 0, and the clip fraction
    (clipped response tokens / response tokens, 0 without any)."""
    m = mask.to(f64)
    if loss_type == "grpo_clip":
        per_token, low, high, _, _ = clip_reference(logp, old, advantages, cliprange)
        clipped = ((low | high) & mask).sum() / max(mask.sum().item(), 1)
    else:
        per_token, clipped = -(rewards if loss_type == "no_baseline" else advantages) * logp, None
    rows = (per_token * m).sum(-1) / m.sum(-1).clamp(min=1)
    return rows.mean() / steps, clipped


@pytest.mark.parametrize("loss_type", course.PG_LOSS_TYPES)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.5, 0.9]),
       st.integers(1, 3))
@example(rows=2, cols=3, seed=0, keep=0.0, steps=2)  # no response token at all
def test_grpo_microbatch_step_matches_its_formula(loss_type, rows, cols, seed, keep, steps):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, cols, generator=gen, dtype=f64) * 3).requires_grad_()
    old = logp.detach() + 0.5 * torch.randn(rows, cols, generator=gen, dtype=f64)
    mask = torch.rand(rows, cols, generator=gen) < keep
    rewards, advantages = torch.rand(rows, 1, generator=gen, dtype=f64), torch.randn(rows, 1, generator=gen, dtype=f64)
    loss, meta = course.grpo_microbatch_train_step(logp, mask, steps, loss_type, rewards, advantages, old, 0.2)
    leaf = logp.detach().clone().requires_grad_()
    want, clip_fraction = grpo_step_reference(leaf, mask, steps, loss_type, rewards, advantages, old, 0.2)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(logp.grad, leaf.grad, rtol=1e-12, atol=1e-15)
    if clip_fraction is not None:
        assert meta["clip_fraction"].item() == pytest.approx(clip_fraction.item(), abs=1e-15)


@pytest.mark.parametrize("step", ["sft", "grpo"])
def test_log_probs_without_a_graph_are_refused_naming_policy_log_probs(step):
    """A step calls backward: log-probs computed under no_grad (or detached) get one line naming the argument, not
    torch's "element 0 of tensors does not require grad" from inside the backward."""
    log_probs = -torch.rand(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"^policy_log_probs: expected a tensor that requires grad"):
        if step == "sft":
            course.sft_microbatch_train_step(log_probs, mask, 1)
        else:
            course.grpo_microbatch_train_step(log_probs, mask, 1, "no_baseline",
                                              raw_rewards=torch.ones(2, 1))
