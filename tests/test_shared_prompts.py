"""fastgrpo.loss.shared_prompts: rows of one prompt run it once, and every hidden state, log-prob, loss and gradient
is the unpacked forward's, in fp64; what cannot pack runs unpacked; the trainer puts a prompt's rows side by side."""
import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from fastgrpo.loss import shared_prompts
from fastgrpo.loss.model import _hidden_and_window, grpo_loss, sequence_logprobs
from fastgrpo.patching import patch_model, unpatch_model
from fastgrpo.train.micro_batches import backbone_tokens, micro_batch_order, prompts_then_lengths

VOCAB = 61
# fp64 with the same per-token math on both sides; only sums over tokens (a prompt token's gradient from its g rows)
# run in another order: ~100 terms of 2^-53 relative each, far under 1e-9
RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture(autouse=True)
def fp64_norms(monkeypatch):
    """transformers' RMSNorms compute in fp32 whatever the dtype, which rounds each token's gradient to 2^-24 where
    a norm passes it back: the packed backward sums a prompt token's gradient over its rows before that rounding,
    the unpacked one after (measured: 1e-7 relative apart). In fp64 throughout, the two agree to ~1e-15."""
    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def tiny_model(family, seed=0):
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0)
    config = (transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def grouped_rows(group_sizes, prompt_length, left_padding, completion_lengths, seed=0):
    """ids, attention_mask, completion_mask [B, T]: each group's rows share a prompt (prompt_length real tokens after
    left_padding), then their own completions (completion_lengths, one per row), right-padded."""
    g = torch.Generator().manual_seed(seed)
    P, C = left_padding + prompt_length, max(max(completion_lengths), 1)
    B = sum(group_sizes)
    ids, mask, completion = (torch.zeros(B, P + C, dtype=torch.long) for _ in range(3))
    row = 0
    for size in group_sizes:
        prompt = torch.randint(1, VOCAB, (prompt_length,), generator=g)
        for _ in range(size):
            n = completion_lengths[row]
            ids[row, left_padding:P] = prompt
            ids[row, P:P + n] = torch.randint(1, VOCAB, (n,), generator=g)
            mask[row, left_padding:P + n] = 1
            completion[row, P:P + n] = 1
            row += 1
    return ids, mask, completion


def unpacked(monkeypatch):
    monkeypatch.setattr(shared_prompts, "plan", lambda *args, **kwargs: None)


def hidden_and_grads(model, ids, mask, completion):
    """The window's hidden states where completion_mask is 1, and the gradients of a fixed random projection."""
    model.zero_grad(set_to_none=True)
    hidden, _, batch = _hidden_and_window(model, ids, mask, completion)
    read = completion[:, batch.window, None].to(hidden.dtype)
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(hidden)
    (hidden * weights * read).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (hidden * read).detach(), grads, batch.packing


@st.composite
def groups(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    C = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(0, C), min_size=sum(sizes), max_size=sum(sizes)))
    return sizes, draw(st.integers(1, 6)), draw(st.integers(0, 2)), lengths, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@settings(max_examples=12, deadline=None)
@given(case=groups())
def test_packed_hidden_states_and_gradients_are_the_unpacked_ones(family, case):
    model = tiny_model(family)
    ids, mask, completion = grouped_rows(*case)
    if not completion.any():
        return
    got, got_grads, packing = hidden_and_grads(model, ids, mask, completion)
    with pytest.MonkeyPatch.context() as mp:
        unpacked(mp)
        want, want_grads, _ = hidden_and_grads(model, ids, mask, completion)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    if packing is not None:  # every row is a segment of its own prompt's packed row
        assert packing.groups == len(case[0]) and packing.members == max(case[0])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grpo_loss_log_probs_and_gradients_are_the_unpacked_ones(family, monkeypatch):
    model = tiny_model(family)
    ids, mask, completion = grouped_rows([3, 3], 5, 1, [7, 2, 5, 7, 1, 6])
    advantages = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = -torch.rand(ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * completion

    def run():
        loss, metrics = grpo_loss(model, ids, mask, completion, advantages, ref_logps=ref, beta=0.04,
                                  return_logps=True)
        params = [p for p in model.parameters()]
        return loss.detach(), metrics["logps"], sequence_logprobs(model, ids, mask, completion), \
            torch.autograd.grad(loss, params)

    packed = run()
    assert model.config._attn_implementation == shared_prompts.NAME  # the packed attention ran
    unpacked(monkeypatch)
    plain = run()
    for got, want in zip(packed[:3], plain[:3]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for (name, _), got, want in zip(model.named_parameters(), packed[3], plain[3]):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=name)


def test_a_peft_lora_model_packs_with_its_adapter_on_and_off(monkeypatch):
    """The trainer's LoRA case: the adapters' gradients, and the reference log-probs with the adapter disabled."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False))
    ids, mask, completion = grouped_rows([3, 2], 4, 1, [5, 2, 5, 4, 3])
    advantages = torch.randn(5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run():
        loss, _ = grpo_loss(model, ids, mask, completion, advantages)
        trained = [p for p in model.parameters() if p.requires_grad]
        return (sequence_logprobs(model, ids, mask, completion, disable_adapter=True),
                *torch.autograd.grad(loss, trained))

    packed = run()
    assert model.base_model.model.config._attn_implementation == shared_prompts.NAME
    unpacked(monkeypatch)
    for got, want in zip(packed, run()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_recomputed_layers_run_the_packed_attention_again():
    """Checkpointed layers run attention again in the backward, after the forward returned: the gradients are
    still the unpacked forward's (a recompute on plain causal SDPA would let segments see each other's tokens)."""
    model = tiny_model("llama")
    ids, mask, completion = grouped_rows([4], 3, 0, [6, 6, 2, 5])
    patch_model(model, rms_norm=False, rope=False, swiglu=False, offload_activations=True, recompute_layers=2)
    try:
        got, got_grads, packing = hidden_and_grads(model, ids, mask, completion)
        with pytest.MonkeyPatch.context() as mp:
            unpacked(mp)
            want, want_grads, _ = hidden_and_grads(model, ids, mask, completion)
    finally:
        unpatch_model(model)
    assert packing is not None
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=RTOL, atol=ATOL, msg=name)


def test_the_packed_rows_hold_each_prompt_once_then_its_rows_segments():
    ids, mask, completion = grouped_rows([2, 1], 2, 1, [3, 1, 2])
    facts = shared_prompts.device_facts(ids, mask, torch.tensor(3))
    packing = shared_prompts.plan([int(v) for f in facts for v in f.reshape(-1)], facts[-1], ids.shape[1], 3, 5, 6)
    packed, positions = shared_prompts.packed_inputs(ids, packing)
    assert (packing.groups, packing.members, packing.prompt, packing.segment) == (2, 2, 2, 3)
    assert packed[0].tolist() == [*ids[0, 1:3], *ids[0, 3:6], *ids[1, 3:6]]
    assert packed[1].tolist() == [*ids[2, 1:3], *ids[2, 3:6], *ids[2, 3:6]]  # a missing segment: its group's first
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert packing.group.tolist() == [0, 0, 1] and packing.member.tolist() == [0, 1, 0]


@pytest.mark.parametrize("case", ["different prompts", "prompt lengths differ", "one row", "same prompt apart"])
def test_what_cannot_share_a_prompt_runs_unpacked(case):
    sizes, lengths = {"different prompts": ([1, 1, 1], [4, 4, 4]), "one row": ([1], [4])}.get(case, ([3], [4, 4, 4]))
    ids, mask, completion = grouped_rows(sizes, 3, 1, lengths)
    if case == "prompt lengths differ":
        mask[0, 1] = 0
        ids[0, 1] = 0
    if case == "same prompt apart":  # rows 0 and 2 share a prompt, row 1 between them does not
        ids[1, :4] = (ids[1, :4] % (VOCAB - 2)) + 1
    _, _, packing = hidden_and_grads(tiny_model("llama"), ids, mask, completion)
    assert packing is None


def test_packed_rows_that_reach_attention_without_their_layout_are_refused():
    """An architecture that did not hand the packing keyword to attention would run plain SDPA under the placeholder
    mask: every token seeing every other. It is refused instead."""
    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (1, 6))
    shared_prompts.use_packed_attention(model.config)
    with pytest.raises(RuntimeError, match="without fastgrpo_prompt_packing"):
        model.model(input_ids=ids, attention_mask=shared_prompts.placeholder_mask(ids))


@pytest.mark.parametrize("change", ["eager", "sliding window"])
def test_attention_that_is_not_plain_causal_sdpa_does_not_pack(change):
    model = tiny_model("qwen2")
    if change == "eager":
        model.config._attn_implementation = "eager"
    else:
        model.config.sliding_window, model.config.layer_types = 4, ["sliding_attention"] * 2
    assert not shared_prompts.supports(model.config)


def test_a_saved_model_keeps_no_trace_of_the_packed_attention(tmp_path):
    model = tiny_model("llama")
    ids, mask, completion = grouped_rows([2], 3, 0, [4, 4])
    sequence_logprobs(model, ids, mask, completion)
    assert model.config._attn_implementation == shared_prompts.NAME
    model.save_pretrained(tmp_path)
    assert shared_prompts.NAME not in (tmp_path / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    torch.testing.assert_close(sequence_logprobs(reloaded, ids, mask, completion),
                               sequence_logprobs(model, ids, mask, completion), rtol=RTOL, atol=ATOL)


def test_prompts_then_lengths_puts_a_prompts_rows_side_by_side_short_prompts_first():
    # 3 prompts x 2 rows; prompt 1's rows are the shortest, prompt 0's the longest
    lengths = torch.tensor([9, 3, 2, 1, 5, 4])
    order = prompts_then_lengths(torch.tensor([5, 0, 3, 1, 2, 4]), lengths, 2, 6)
    assert order.tolist() == [2, 3, 4, 5, 0, 1]  # a prompt's rows in batch order


def batch_of(prompt, completion_lengths, group_size, columns):
    """A trainer batch: len(completion_lengths) / group_size prompts of `prompt` tokens, completions as given."""
    B = len(completion_lengths)
    mask, completion = torch.zeros(B, columns, dtype=torch.long), torch.zeros(B, columns, dtype=torch.long)
    for row, n in enumerate(completion_lengths):
        mask[row, :prompt + n] = 1
        completion[row, prompt:prompt + n] = 1
    ids = torch.randint(1, VOCAB, (B, columns)) * mask
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def test_micro_batches_by_prompt_where_the_prompt_is_long_and_lengths_alike():
    # 2 prompts x 4 rows of a 256-token prompt, completions 100-112: by prompt, 2 x (256 + 4 x 112) = 1,408 tokens;
    # by length, micro-batches of 4 rows run 4 x 384 each: 3,072
    lengths = [100, 112, 104, 108, 110, 101, 106, 103]
    batch = batch_of(256, lengths, 4, 400)
    order = micro_batch_order(torch.arange(8), batch, 4, 4, tiny_model("llama"))
    assert order.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]  # one prompt per micro-batch; the shorter longest row first


def test_micro_batches_by_length_where_the_prompt_is_short_and_lengths_spread():
    # each prompt's 4 rows: 8, 8, 8 tokens and one of 1,000; by prompt every micro-batch runs four 1,008-token
    # segments, by length three of them run 128 columns
    lengths = [8, 8, 8, 1000] * 4
    batch = batch_of(8, lengths, 4, 1100)
    order = micro_batch_order(torch.arange(16), batch, 4, 4, tiny_model("llama"))
    assert order.tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 3, 7, 11, 15]


def test_micro_batches_by_length_where_the_model_cannot_pack():
    # the batch that goes by prompt above, for a model on eager attention: rows by length, as before packing
    lengths = [100, 112, 104, 108, 110, 101, 106, 103]
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    order = micro_batch_order(torch.arange(8), batch_of(256, lengths, 4, 400), 4, 4, model)
    assert order.tolist() == [0, 5, 7, 2, 6, 3, 4, 1]


def test_backbone_tokens_counts_what_row_layout_and_the_packing_run():
    lengths, prompts = [300, 290, 260, 280], [256] * 4
    # unpacked: 4 rows x 384 columns (300 rounded up to 128); packed: 256 + 4 x 48 (44 rounded up to 16)
    assert backbone_tokens([0, 1, 2, 3], lengths, prompts, 512, 256, 4, 4, pack=False) == 4 * 384
    assert backbone_tokens([0, 1, 2, 3], lengths, prompts, 512, 256, 4, 4, pack=True) == 256 + 4 * 48
    # rows of two prompts (group_size 2): two packed rows
    assert backbone_tokens([0, 1, 2, 3], lengths, prompts, 512, 256, 2, 4, pack=True) == 2 * (256 + 2 * 48)


def gpu_llama(dtype):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


@pytest.mark.gpu
def test_gpu_packed_bf16_is_as_close_to_fp64_as_the_unpacked_forward():
    """On CUDA the segments' attention is SDPA's flash kernel with a bottom-right causal mask and grouped K/V heads.
    Packed and unpacked bf16 are the same math in other kernel orders and shapes, so each is as far from the fp64
    oracle (the unpacked CPU forward) as bf16 rounding puts it: the packed one within 1.5x the unpacked one's
    distance, over the window's hidden states and over all gradients."""
    ids, mask, completion = grouped_rows([4, 4], 37, 3, [50, 61, 9, 64, 33, 64, 2, 40], seed=5)
    oracle = gpu_llama(torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        unpacked(mp)
        want, want_grads, _ = hidden_and_grads(oracle, ids, mask, completion)
    model = gpu_llama(torch.bfloat16).cuda()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in oracle.state_dict().items()})
    cuda = [t.cuda() for t in (ids, mask, completion)]
    runs = {}
    for mode in ("packed", "unpacked"):
        with pytest.MonkeyPatch.context() as mp:
            if mode == "unpacked":
                unpacked(mp)
            hidden, grads, packing = hidden_and_grads(model, *cuda)
        assert (packing is not None) == (mode == "packed")
        runs[mode] = torch.cat([hidden.double().cpu().reshape(-1) - want.reshape(-1)] + [
            (grads[n].double().cpu() - want_grads[n]).reshape(-1) / want_grads[n].abs().max() for n in want_grads])
    distance = {mode: gap.norm().item() for mode, gap in runs.items()}
    assert distance["packed"] <= 1.5 * distance["unpacked"], distance


@pytest.mark.gpu
def test_gpu_a_packed_micro_batch_reads_the_device_once():
    """The packing's indices are made on the device from the facts the checks read: still one host sync from
    fastgrpo's code per micro-batch (a host-to-device copy from pageable memory would wait for the GPU's queue)."""
    import os
    import warnings

    import fastgrpo

    model = gpu_llama(torch.bfloat16).cuda()
    ids, mask, completion = (t.cuda() for t in grouped_rows([4, 4], 20, 0, [30] * 8))
    advantages = torch.randn(8, device="cuda")
    grpo_loss(model, ids, mask, completion, advantages)[0].backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            grpo_loss(model, ids, mask, completion, advantages)[0].backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert model.config._attn_implementation == shared_prompts.NAME
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    package = os.path.dirname(fastgrpo.__file__) + os.sep
    assert len([site for site in syncs if site.startswith(package)]) == 1, syncs
