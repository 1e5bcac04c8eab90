"""fastgrpo.rollout.generate on tiny CPU models: HF generate parity, log-probs, stops, seeds, shared weights, errors."""
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BatchEncoding,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from fastgrpo.train import default_task
from fastgrpo.rollout import BuiltinEngine, generate
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.sampling import SamplingParams, process_logits

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?0123456789"
PAD, EOS = 0, 1
PROMPTS = ["hello world", "abc", "the quick brown fox jumps"]


def char_tokenizer():
    """One token per character of CHARS; <pad>=0, <eos>=1, <unk>=2 (the built-in task's tokenizer builder)."""
    return default_task.build_tokenizer(CHARS)


SIZES = dict(
    vocab_size=len(CHARS) + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SIZES),
    "qwen2": lambda: Qwen2Config(**SIZES),
    # sliding window shorter than prompt + completion: the windowed masks matter (tensor and dict forms)
    "mistral": lambda: MistralConfig(**SIZES, sliding_window=8),
    "gemma2": lambda: Gemma2Config(**SIZES, head_dim=16, sliding_window=8, attn_implementation="eager"),
    "qwen2_sliding": lambda: Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=16),
    "gemma": lambda: GemmaConfig(**SIZES, head_dim=16),
    "gemma3": lambda: Gemma3TextConfig(**SIZES, head_dim=16, sliding_window=8),
    "phi3": lambda: Phi3Config(**SIZES, sliding_window=8),
}


def tiny_model(arch: str, seed: int = 0, lora: bool = False, targets=("q_proj", "v_proj")):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]())
    if lora:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: a non-zero adapter, so "adapter active" changes the outputs
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    return model.eval()


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int):
    """HF generate on one unpadded prompt: (tokens up to and including EOS, log_softmax of its logits there)."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=model.device)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=EOS, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True,
    )
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    if EOS in tokens:
        tokens = tokens[: tokens.index(EOS) + 1]
    logp = [torch.log_softmax(step[0].double(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logp


def completions(result) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(result.completion_ids, result.completion_mask)]


@pytest.mark.parametrize(
    "arch, lora",
    [("llama", False), ("qwen2", False), ("llama", True), ("qwen2", True)]
    + [(arch, False) for arch in ("mistral", "gemma2", "qwen2_sliding", "qwen3", "gemma", "gemma3", "phi3")],
)
def test_greedy_equals_hf_generate(arch, lora):
    tok, model = char_tokenizer(), tiny_model(arch, lora=lora)
    result = generate(model, tok, PROMPTS, num_generations=2, max_new_tokens=24, temperature=0)
    got = completions(result)
    for i, prompt in enumerate(PROMPTS):
        want, want_logp = hf_greedy(model, tok, prompt, 24)
        for row in (2 * i, 2 * i + 1):
            assert got[row] == want, (arch, lora, prompt)
            n = len(want)
            want_t = torch.tensor(want_logp, dtype=torch.float64)
            torch.testing.assert_close(result.logprobs[row, :n].double(), want_t, atol=1e-4, rtol=0)
            assert result.finish_reasons[row] == ("stop" if want[-1] == EOS else "length")


def test_lora_adapter_is_active():
    tok = char_tokenizer()
    base = generate(tiny_model("llama"), tok, PROMPTS, max_new_tokens=16, temperature=0)
    adapted = generate(tiny_model("llama", lora=True), tok, PROMPTS, max_new_tokens=16, temperature=0)
    assert completions(base) != completions(adapted)


def teacher_forced_logprobs(model, result, params: SamplingParams) -> torch.Tensor:
    """Re-score each completion with one full forward and the same filters: [N, L] (0 on pads)."""
    out = torch.zeros(result.completion_ids.shape, dtype=torch.float64)
    for r in range(result.completion_ids.shape[0]):
        prompt = result.prompt_ids[r][result.prompt_mask[r].bool()]
        comp = result.completion_ids[r][result.completion_mask[r].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, comp])[None]).logits[0, len(prompt) - 1: -1]
        processed = process_logits(logits, params, None)
        out[r, : len(comp)] = processed.double().log_softmax(-1).gather(1, comp[:, None])[:, 0]
    return out


def test_sampled_logprobs_are_under_the_sampling_distribution():
    tok, model = char_tokenizer(), tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=20, temperature=0.7, top_k=12, top_p=0.9, min_p=0.05)
    result = generate(model, tok, PROMPTS, num_generations=3, seed=3, **vars_of(params))
    assert result.logprobs.dtype == torch.float32
    want = teacher_forced_logprobs(model, result, params)
    torch.testing.assert_close(result.logprobs.double(), want, atol=1e-4, rtol=0)
    assert torch.all(result.logprobs[result.completion_mask == 0] == 0)
    assert torch.all(torch.isfinite(result.logprobs))


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_logprobs_are_the_trainers_at_the_same_temperature(temperature):
    """Without filters the engine's log-probs are log_softmax(logits / temperature), what the trainer's
    sequence_logprobs computes at config.temperature (with top_k / top_p / min_p they are the filtered ones)."""
    from fastgrpo.loss.model import sequence_logprobs

    tok, model = char_tokenizer(), tiny_model("qwen2")
    result = generate(model, tok, PROMPTS, num_generations=2, max_new_tokens=12, temperature=temperature, seed=1)
    ids = torch.cat([result.prompt_ids, result.completion_ids], 1)
    attention = torch.cat([result.prompt_mask, result.completion_mask], 1)
    completion = torch.cat([torch.zeros_like(result.prompt_mask), result.completion_mask], 1)
    with torch.no_grad():
        train = sequence_logprobs(model, ids, attention, completion, temperature=temperature)
    torch.testing.assert_close(train[:, result.prompt_ids.shape[1]:], result.logprobs, atol=1e-5, rtol=0)


def vars_of(params: SamplingParams) -> dict:
    return {k: getattr(params, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                                             "repetition_penalty")}


def test_groups_are_consecutive_and_shapes_agree():
    tok, model = char_tokenizer(), tiny_model("llama")
    result = generate(model, tok, PROMPTS, num_generations=3, max_new_tokens=10, seed=0)
    N, L = result.completion_ids.shape
    assert N == 9 and result.logprobs.shape == (N, L) and result.prompt_ids.shape[0] == N
    assert len(result.texts) == len(result.finish_reasons) == N
    for i, prompt in enumerate(PROMPTS):
        for row in range(3 * i, 3 * i + 3):
            ids = result.prompt_ids[row][result.prompt_mask[row].bool()].tolist()
            assert tok.decode(ids) == prompt
    # right-padded: the mask is a prefix of ones
    lengths = result.completion_mask.sum(1)
    assert torch.equal(result.completion_mask, (torch.arange(L)[None] < lengths[:, None]).long())
    assert torch.all(result.completion_ids[result.completion_mask == 0] == PAD)


def test_same_seed_same_samples_and_other_seed_differs():
    tok, model = char_tokenizer(), tiny_model("qwen2")
    kw = dict(num_generations=4, max_new_tokens=16, temperature=1.0, repetition_penalty=1.2)
    a, b = generate(model, tok, PROMPTS, seed=7, **kw), generate(model, tok, PROMPTS, seed=7, **kw)
    c = generate(model, tok, PROMPTS, seed=8, **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert completions(a) != completions(c)
    # generations of one prompt are distinct samples, not copies
    assert len({tuple(x) for x in completions(a)[:4]}) > 1


def test_prompt_keys_make_a_prompts_samples_independent_of_the_call():
    """A data-parallel rank generates for its share of a batch: with the same seed and keys (positions in the whole
    batch), its rows equal the whole batch's rows of those prompts; without keys the default is the position."""
    tok, model = char_tokenizer(), tiny_model("qwen2")
    kw = dict(num_generations=3, max_new_tokens=12, temperature=1.0, top_p=0.95, seed=4)
    whole = generate(model, tok, PROMPTS, **kw)
    assert completions(generate(model, tok, PROMPTS, prompt_keys=[0, 1, 2], **kw)) == completions(whole)
    share = generate(model, tok, PROMPTS[1:], prompt_keys=[1, 2], **kw)
    assert completions(share) == completions(whole)[3:]
    torch.testing.assert_close(share.logprobs, whole.logprobs[3:, : share.logprobs.shape[1]], atol=1e-5, rtol=0)
    shifted = generate(model, tok, PROMPTS[1:], **kw)  # keys 0, 1: other samples of the same prompts
    assert completions(shifted) != completions(whole)[3:]
    with pytest.raises(ValueError, match="prompt_keys"):
        generate(model, tok, PROMPTS, prompt_keys=[0, 1], **kw)


def test_stop_string_cuts_ids_mask_and_text_consistently():
    tok, model = char_tokenizer(), tiny_model("llama")
    free = generate(model, tok, PROMPTS, max_new_tokens=24, temperature=0)
    stop = free.texts[0][6:8]  # a two-character string the first row produces at position 6
    cut = generate(model, tok, PROMPTS, max_new_tokens=24, temperature=0, stop=[stop])
    for row, (ids, text) in enumerate(zip(completions(cut), cut.texts)):
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert ids == completions(free)[row][: len(ids)]
        if stop in free.texts[row]:
            end = free.texts[row].index(stop) + len(stop)
            assert text == free.texts[row][:end] and cut.finish_reasons[row] == "stop"
            assert stop not in tok.decode(ids[:-1])
        else:
            assert ids == completions(free)[row] and cut.finish_reasons[row] == free.finish_reasons[row]
    assert cut.finish_reasons[0] == "stop" and len(completions(cut)[0]) <= 8


@pytest.mark.parametrize("unseen", [False, True], ids=["one-id", "with-unseen-ids"])
def test_stop_token_id_ends_the_row_after_it(unseen):
    """unseen: also every id that no row samples (more than torch.isin's brute-force bound of ~10 N^0.145 ids for N
    rows, past which it sorts them through torch.unique: the engine looks them up instead). This checks the lookup's
    results; the sync that isin's sorting path made inside a CUDA-graph capture only shows on a GPU
    (test_rollout_gpu.py: test_many_stop_ids_keep_the_graph)."""
    tok, model = char_tokenizer(), tiny_model("qwen2")
    free = generate(model, tok, PROMPTS, max_new_tokens=20, temperature=0)
    stop_id = completions(free)[1][4]
    sampled = {t for row in completions(free) for t in row}
    others = [i for i in range(model.config.vocab_size) if i not in sampled] if unseen else []
    assert not unseen or len(others) > 10 * len(PROMPTS) ** 0.145
    cut = generate(model, tok, PROMPTS, max_new_tokens=20, temperature=0, stop=[stop_id, *others])
    for row, ids in enumerate(completions(cut)):
        full = completions(free)[row]
        if stop_id in full:
            assert ids == full[: full.index(stop_id) + 1] and cut.finish_reasons[row] == "stop"
        else:
            assert ids == full


def test_a_special_tokens_text_as_stop_string_stops_at_that_token():
    """The texts skip special tokens, so stop="<unk>" (as "<|im_end|>" for a base model's chat template) was never
    found and the rows ran on to max_new_tokens; it stops at the token now, as HF's stop_strings does."""
    tok, model = char_tokenizer(), tiny_model("qwen2")
    unk = tok.convert_tokens_to_ids("<unk>")
    with torch.no_grad():  # <unk> scores above the token greedy picks 4th in row 0: it is picked there instead
        picked = completions(generate(model, tok, PROMPTS, max_new_tokens=20, temperature=0))[0][3]
        model.lm_head.weight[unk] = model.lm_head.weight[picked] * 1.5
    free = generate(model, tok, PROMPTS, max_new_tokens=20, temperature=0)
    assert unk in completions(free)[0]
    cut = generate(model, tok, PROMPTS, max_new_tokens=20, temperature=0, stop="<unk>")
    for row, full in enumerate(completions(free)):
        want = full[: full.index(unk) + 1] if unk in full else full
        assert completions(cut)[row] == want
        assert cut.finish_reasons[row] == ("stop" if unk in full else free.finish_reasons[row])
    with pytest.raises(ValueError, match="^stop: 'a<unk>' holds the special token '<unk>', which the completions' "
                                         "text .* never shows; pass '<unk>' alone to stop at that token$"):
        generate(model, tok, PROMPTS, max_new_tokens=4, stop=["a<unk>"])


def test_a_pad_token_past_the_embeddings_and_a_missing_tokenizer_fail_before_any_compute():
    """A pad token added without resizing the embeddings sent its id through the prefill (IndexError on the CPU, a
    device-side assert on a GPU); id prompts with no tokenizer failed with an AttributeError."""
    tok, model = char_tokenizer(), tiny_model("llama")
    tok.add_special_tokens({"pad_token": "[PAD]"})
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"^tokenizer: its pad token id 44 is outside the model's 44 embeddings .*"
                                         r"model.resize_token_embeddings\(len\(tokenizer\)\) or set "
                                         r"tokenizer.pad_token = tokenizer.eos_token$"):
        generate(model, tok, PROMPTS, max_new_tokens=4)
    with pytest.raises(ValueError, match="^tokenizer: expected a Hugging Face tokenizer .*, got NoneType$"):
        generate(model, None, [[3, 4, 5]], max_new_tokens=4)
    assert not calls


@pytest.mark.parametrize("kwargs, message", [
    (dict(check_every=0), "EngineConfig.check_every: expected an int >= 1, got 0"),  # divided by 0 mid-rollout
    (dict(check_every=2.5), "EngineConfig.check_every: expected an int >= 1, got 2.5"),  # synced every 5th step
    (dict(length_bucket=0), "EngineConfig.length_bucket: expected an int >= 1, got 0"),
    (dict(warmup_steps=-1), "EngineConfig.warmup_steps: expected an int >= 0, got -1"),
    (dict(attention="triton", max_prompt_length=3.5),
     "EngineConfig.max_prompt_length: expected an int >= 1 or None, got 3.5"),
])
def test_engine_config_refuses_step_counts_that_are_not_counts(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig(**kwargs)


def test_in_place_weight_update_is_used_by_the_next_call():
    tok, model = char_tokenizer(), tiny_model("llama", lora=True)
    before = generate(model, tok, PROMPTS, max_new_tokens=16, temperature=0)
    # one optimizer step on the adapter, in place, as the trainer does
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=5.0)
    model.train()
    ids = torch.tensor([tok(PROMPTS[0], add_special_tokens=False)["input_ids"]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    after = generate(model, tok, PROMPTS, max_new_tokens=16, temperature=0)
    assert completions(after) != completions(before)
    for i, prompt in enumerate(PROMPTS):
        assert completions(after)[i] == hf_greedy(model, tok, prompt, 16)[0]


def test_patched_model_generates_what_the_unpatched_one_does():
    import fastgrpo

    tok, model = char_tokenizer(), tiny_model("qwen2")
    want = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    fastgrpo.patch_model(model)
    got = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    assert completions(got) == completions(want)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


def test_training_mode_is_restored():
    tok, model = char_tokenizer(), tiny_model("qwen2")
    model.train()
    # transformers 5.24 renamed gradient_checkpointing_enable (5.17 has only the old name)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    result = generate(model, tok, PROMPTS[:1], max_new_tokens=8, temperature=0)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert completions(result)[0] == hf_greedy(model, tok, PROMPTS[0], 8)[0]


def test_token_id_prompts_equal_text_prompts():
    tok, model = char_tokenizer(), tiny_model("llama")
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    a = generate(model, tok, PROMPTS, max_new_tokens=8, temperature=0)
    b = generate(model, tok, ids, max_new_tokens=8, temperature=0)
    assert torch.equal(a.completion_ids, b.completion_ids)


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        (["x" * 100], {"max_new_tokens": 29}, "prompts\\[0\\].*max_position_embeddings 128"),
        (PROMPTS, {"num_generations": 0}, "num_generations"),
        (PROMPTS, {"top_a": 0.1}, "unknown sampling option 'top_a'"),
        (PROMPTS, {"do_sample": True}, "unknown sampling option 'do_sample'"),
        (PROMPTS, {"max_tokens": 10}, "did you mean 'max_new_tokens'"),
        (PROMPTS, {"temperature": -1.0}, "temperature"),
        (PROMPTS, {"temperature": float("inf")}, "temperature: expected a finite number >= 0, got inf"),
        (PROMPTS, {"repetition_penalty": float("inf")}, "repetition_penalty: expected a finite number > 0"),
        (PROMPTS, {"stop": [""]}, "stop"),
        (PROMPTS, {"stop": [10_000]}, "stop"),
        (PROMPTS, {"seed": 1.5}, "seed"),
        ([], {}, "prompts"),
        ("abc", {}, "prompts"),
        (["abc", ""], {}, "prompts\\[1\\]"),
        ([[3, 4, 999]], {}, "prompts\\[0\\]: expected token ids in \\[0, \\d+\\), got 999 at position 2$"),
        ([[{"role": "user", "content": "say a"}]], {}, "prompts: expected strings or token id lists, got chat"),
        # transformers 5's apply_chat_template(messages) returns a BatchEncoding: it was echoed whole, with no fix
        ([BatchEncoding({"input_ids": [3, 4], "attention_mask": [1, 1]})], {},
         "^prompts\\[0\\]: expected strings or token id lists, got a tokenizer's output \\(BatchEncoding\\); pass "
         "its \\['input_ids'\\], or the text of tokenizer.apply_chat_template"),
        (BatchEncoding({"input_ids": [[3, 4]]}), {}, "^prompts: .*got a tokenizer's output \\(BatchEncoding\\)"),
    ],
)
def test_bad_input_fails_before_any_compute(prompts, kwargs, match):
    tok, model = char_tokenizer(), tiny_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=match):
        generate(model, tok, prompts, **kwargs)
    assert not calls


def test_an_engine_names_a_missing_tokenizer_and_a_sampling_dict():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="^tokenizer: expected a Hugging Face tokenizer \\(it reads text prompts and "
                                         "decodes the completions\\), got NoneType$"):
        generate(model, None, ["say a"])
    with pytest.raises(ValueError, match=r"^sampling: expected a fastgrpo.rollout.SamplingParams .*got dict$"):
        BuiltinEngine(model, char_tokenizer()).generate(["say a"], num_generations=1, sampling={"max_new_tokens": 3})


def gemma2_loaded_off_eager() -> torch.nn.Module:
    """gemma2 as flash_attention_2 or flex_attention load it on a GPU: on an attention other than "eager" that
    soft-caps its scores too (here a registered copy of transformers' eager function and mask); q and k scaled up so
    that the scores pass the cap (1.0) and the cap changes the tokens."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from fastgrpo.hf.models import register_attention

    register_attention("fastgrpo_test_gemma2_own", eager_attention_forward)
    AttentionMaskInterface.register("fastgrpo_test_gemma2_own", eager_mask)
    config = CONFIGS["gemma2"]()
    config.attn_logit_softcapping = 1.0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fastgrpo_test_gemma2_own").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20)
    return model


def test_soft_capping_model_off_eager_decodes_as_hf():
    """The rollout replaced a gemma2 loaded off "eager" with its own SDPA attention, which dropped the soft-cap: other
    log-probs and tokens than the model's, silently. It runs it on eager now, as gemma2 loaded by default."""
    tok, model = char_tokenizer(), gemma2_loaded_off_eager()
    result = generate(model, tok, PROMPTS, num_generations=1, max_new_tokens=12, temperature=0)
    got = completions(result)
    for i, prompt in enumerate(PROMPTS):
        want, want_logp = hf_greedy(model, tok, prompt, 12)
        assert got[i] == want, prompt
        torch.testing.assert_close(result.logprobs[i, :len(want)].double(),
                                   torch.tensor(want_logp, dtype=torch.float64), atol=1e-4, rtol=0)
    assert model.config._attn_implementation == "fastgrpo_test_gemma2_own"  # the model's own, after the rollout
