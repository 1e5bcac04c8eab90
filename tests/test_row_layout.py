"""fastgrpo.loss.row_layout: padded rows run without their attention mask (rolled left where they are left-padded),
and the log-probs, loss and gradients are those of the masked forward, in fp64."""
import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from transformers import AutoModelForCausalLM

from fastgrpo.loss import reference, row_layout
from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.loss.sft import sft_loss

VOCAB = 64


def tiny_model(family, attention):
    if family == "qwen2":
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)
    else:  # a sliding window shorter than the rows: rolling must keep which tokens each position sees
        config = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=3, pad_token_id=0)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


MODELS = {name: tiny_model(*name.split("-")) for name in ("qwen2-sdpa", "qwen2-eager", "gemma2-eager")}


def row_by_row_hidden(model, ids, mask):
    """The oracle: each row's real tokens run alone, without padding or a mask (positions from 0, as the rollout
    engines number them); 0 at padding columns. Needs each row's 1s to be one run."""
    rows = []
    for row_ids, row_mask in zip(ids, mask):
        real = row_mask.nonzero()[:, 0]
        start, stop = (int(real[0]), int(real[-1]) + 1) if len(real) else (0, 0)
        hidden = model.model(input_ids=row_ids[None, start:stop]).last_hidden_state[0] if stop else None
        pad = model.config.hidden_size
        rows.append(torch.cat([torch.zeros(start, pad, dtype=torch.float64),
                               *([] if hidden is None else [hidden]),
                               torch.zeros(len(row_ids) - stop, pad, dtype=torch.float64)]))
    return torch.stack(rows)


def oracle_logps(model, ids, mask, targets):
    logits = model.lm_head(row_by_row_hidden(model, ids, mask))
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat((torch.zeros_like(logps[:, :1]), logps), 1) * targets


@st.composite
def padded_rows(draw, holes=False):
    """ids, attention_mask, completion_mask [B, T]: each row [left padding | prompt | completion | right padding],
    the completion a drawn subset of the run after its first token; holes: some row's mask has a 0 inside its run."""
    B, T = draw(st.integers(1, 4)), draw(st.integers(3, 13))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask, completion = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for row in range(B):
        left = draw(st.integers(0, T - 2))
        stop = draw(st.integers(left + 2, T))
        mask[row, left:stop] = 1
        picked = draw(st.lists(st.booleans(), min_size=stop - left - 1, max_size=stop - left - 1))
        completion[row, left + 1:stop] = torch.tensor(picked, dtype=torch.long)
    if holes:
        row = draw(st.integers(0, B - 1))
        inside = mask[row].nonzero()[:, 0]
        if len(inside) >= 3:
            hole = inside[draw(st.integers(1, len(inside) - 2))]
            mask[row, hole], completion[row, hole] = 0, 0
            if hole + 1 < T:
                completion[row, hole + 1] = 0  # a token after a hole is not predicted from a real position
    ids = torch.randint(1, VOCAB, (B, T), generator=g).masked_fill(mask == 0, 0)
    return ids, mask, completion


def backbone_masks(model, widths=None):
    """Record the attention_mask the backbone is called with (and in `widths`, its input_ids' columns)."""
    seen = []

    def record(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))
        if widths is not None:
            widths.append(kwargs["input_ids"].shape[1])

    return seen, model.model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.fixture(autouse=True, scope="module")
def columns_one_by_one():
    """Rows cut at their longest row exactly (LENGTH_MULTIPLE 1): these rows are shorter than one multiple."""
    saved, row_layout.LENGTH_MULTIPLE = row_layout.LENGTH_MULTIPLE, 1
    yield
    row_layout.LENGTH_MULTIPLE = saved


@pytest.mark.parametrize("name", sorted(MODELS))
@settings(max_examples=12, deadline=None)
@given(batch=padded_rows())
def test_sequence_logprobs_of_padded_rows_are_the_masked_forwards(name, batch):
    model = MODELS[name]
    ids, mask, completion = batch
    widths = []
    seen, handle = backbone_masks(model, widths)
    try:
        got = sequence_logprobs(model, ids, mask, completion)
    finally:
        handle.remove()
    assert seen == [None], "a mask of one run per row reached the backbone"
    assert widths == [int(mask.sum(1).max())], "the backbone ran past the longest row"
    with torch.no_grad():
        want = oracle_logps(model, ids, mask, completion)
    # fp64 on both sides, the same positions (RoPE's angles are fp32 in HF whatever the dtype: other positions would
    # differ by ~1e-7): only the order of the attention's sums differs (~1e-15 relative)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-12)


@settings(max_examples=12, deadline=None)
@given(batch=padded_rows(holes=True))
def test_a_mask_with_a_hole_reaches_the_backbone(batch):
    model = MODELS["qwen2-sdpa"]
    ids, mask, completion = batch
    seen, handle = backbone_masks(model)
    try:
        got = sequence_logprobs(model, ids, mask, completion)
    finally:
        handle.remove()
    holed = bool(((mask[:, 1:] - mask[:, :-1]) == 1).sum(1).add(mask[:, 0]).gt(1).any())
    assert (seen[0] is mask) == holed
    if holed:  # the forward as given: positions 0..T-1, the mask kept
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        want = torch.where(completion[:, 1:].bool(), want, 0.0)
        torch.testing.assert_close(got[:, 1:].double(), want, rtol=0, atol=1e-12)


def test_a_completion_token_after_padding_keeps_the_mask():
    """A completion token whose predicting position is padding: the masked forward decides what it sees."""
    model = MODELS["qwen2-sdpa"]
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    completion = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]])
    seen, handle = backbone_masks(model)
    try:
        sequence_logprobs(model, ids, mask, completion)
    finally:
        handle.remove()
    assert seen[0] is mask


@pytest.mark.parametrize("name", ["qwen2-sdpa", "gemma2-eager"])
@settings(max_examples=6, deadline=None)
@given(batch=padded_rows(), beta=st.sampled_from([0.0, 0.04]))
def test_grpo_loss_and_gradients_of_padded_rows_are_the_masked_forwards(name, batch, beta):
    model = MODELS[name]
    ids, mask, completion = batch
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(ids.shape[0], generator=g, dtype=torch.float64)
    ref = (-torch.rand(ids.shape, generator=g, dtype=torch.float64)) * completion if beta else None
    params = [p for p in model.parameters()]
    loss, _ = grpo_loss(model, ids, mask, completion, advantages, ref_logps=ref, beta=beta)
    got = torch.autograd.grad(loss, params, allow_unused=True)
    hidden = row_by_row_hidden(model, ids, mask)[:, :-1]
    want_loss, _ = reference.grpo_loss(hidden, model.lm_head.weight, ids[:, 1:], completion[:, 1:], advantages,
                                       ref_logps=None if ref is None else ref[:, 1:], beta=beta,
                                       softcap=getattr(model.config, "final_logit_softcapping", None))
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    for (n, _), a, b in zip(model.named_parameters(), got, want):
        if b is None:
            assert a is None or not a.any(), n
        elif name.startswith("gemma2") and "norm" in n:
            # Gemma's RMSNorm scales in fp32 whatever the dtype: these grads are fp32 sums over the <= 52 positions,
            # in another order than the oracle's row-by-row runs: <= 52 roundings of 2^-24 each, relative
            bound = 52 * 2**-24 * b.abs().max().item()
            assert (a - b).abs().max().item() <= bound, (n, (a - b).abs().max().item(), bound)
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=n)


@settings(max_examples=10, deadline=None)
@given(batch=padded_rows())
def test_sft_loss_of_padded_rows_is_the_masked_forwards(batch):
    model = MODELS["qwen2-sdpa"]
    ids, mask, response = batch
    seen, handle = backbone_masks(model)
    try:
        loss, _ = sft_loss(model, ids, mask, response)
    finally:
        handle.remove()
    assert seen == [None]
    with torch.no_grad():
        logps = oracle_logps(model, ids, mask, response)
    want = -logps.sum() / response.sum().clamp(min=1)
    torch.testing.assert_close(loss.detach(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("multiple, longest, T, length", [(128, 5, 13, 13), (128, 100, 300, 128), (128, 129, 300, 256),
                                                          (128, 290, 300, 300), (1, 7, 13, 7)])
def test_rows_are_cut_to_a_multiple_past_the_longest(monkeypatch, multiple, longest, T, length):
    """A few lengths recur across micro-batches (each new length was a new shape for the kernels: slower on an
    H200), never past the rows given."""
    monkeypatch.setattr(row_layout, "LENGTH_MULTIPLE", multiple)
    mask = torch.zeros(2, T, dtype=torch.long)
    mask[0, :longest] = 1
    assert row_layout.unpadded(mask, 1, 0, longest).length == length
