"""The built-in engine's bookkeeping at the edges the other rollout tests never reach (found by a mutation audit:
each test failed with one small change of decode.py / generate.py): the repetition penalty's seen tokens against HF
generate on left-padded prompts, a stop at the very last token, the model's own EOS ids, how soon a stop string
ends the decode loop, and what the engine writes after a row's end. Tiny random models on the CPU.
"""
import pytest
import torch

from fastgrpo.rollout import decode, generate
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.stops import StopStrings
from tests.test_rollout import CHARS, EOS, PAD, PROMPTS, char_tokenizer, completions, tiny_model


@pytest.mark.parametrize("penalty", [1.6, 0.6])
def test_repetition_penalty_equals_hf_generate_on_left_padded_prompts(penalty):
    """HF penalizes every token of the row so far, the prompt's and the completion's, and never a left pad (its
    prompt has none). Greedy tokens, and log-probs under the penalized logits (HF's processed scores), row by row;
    PROMPTS' shorter rows are left-padded in the engine's batch."""
    tok, model = char_tokenizer(), tiny_model("qwen2")
    result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0, repetition_penalty=penalty)
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             repetition_penalty=penalty, eos_token_id=EOS, pad_token_id=PAD,
                             return_dict_in_generate=True, output_scores=True)
        want = out.sequences[0, ids.shape[1]:].tolist()
        if EOS in want:
            want = want[: want.index(EOS) + 1]
        assert completions(result)[row] == want, (penalty, prompt)
        want_logp = torch.stack([torch.log_softmax(s[0].double(), -1)[t] for s, t in zip(out.scores, want)])
        got = result.logprobs[row, : len(want)].double()
        # fp32 forwards of other shapes: the bound of the engine-vs-HF tests (tests/test_rollout.py)
        torch.testing.assert_close(got, want_logp, atol=1e-4, rtol=0, msg=f"{penalty} {prompt!r}")


def test_a_stop_on_the_last_token_is_a_stop_not_a_length():
    """The row's last allowed token is its stop token (or completes its stop string): finish_reason "stop", as HF
    and vLLM report; the rows that ran out of tokens "length"."""
    tok, model = char_tokenizer(), tiny_model("llama")
    # row 1 samples its 12th token for the first time there (greedy), and its last two characters appear first there
    free = completions(generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0))[1]
    text = tok.decode(free, skip_special_tokens=True)
    assert len(free) == 12 and free[-1] not in free[:-1] and text.index(text[-2:]) == len(text) - 2, (free, text)
    for stop in (free[-1], text[-2:]):
        result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0, stop=stop)
        assert completions(result)[1] == free, stop
        for row, ids in enumerate(completions(result)):
            assert result.finish_reasons[row] == ("stop" if len(ids) < 12 or row == 1 else "length"), (stop, row)


def test_the_models_generation_config_eos_ids_stop_rows():
    """generation_config.eos_token_id (a list for chat models: e.g. <|im_end|> and <|endoftext|>) stops rows as the
    tokenizer's EOS does, as HF generate stops there."""
    tok, model = char_tokenizer(), tiny_model("llama", seed=1)
    free = completions(generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0))
    chat_end = free[0][4]
    model.generation_config.eos_token_id = [EOS, chat_end]
    result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    for row, full in enumerate(free):
        want = full[: full.index(chat_end) + 1] if chat_end in full else full
        assert completions(result)[row] == want, row
        assert result.finish_reasons[row] == ("stop" if chat_end in full else "length"), row


CHECK_EVERY = 4


@pytest.mark.parametrize("end", [5, 8], ids=["spans-a-sync", "ends-at-a-sync"])
def test_a_stop_string_ends_the_decode_loop_at_the_first_sync_after_it(end):
    """The host looks for stop strings every check_every steps in the tokens so far: a string completed by token
    `end` (1-based) ends the loop at the first sync at or after it, whether it spans the previous sync (end 5: its
    first character came before the sync at 4) or its last token is the one the sync sees last (end 8). The loop's
    width is what the engine computed; the result's ids are cut at the string either way."""
    tok, model = char_tokenizer(), tiny_model("llama")
    prompt = [tok(PROMPTS[1], add_special_tokens=False)["input_ids"]]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    config = EngineConfig(check_every=CHECK_EVERY)
    common = dict(stop_ids=[EOS], pad_id=PAD, keys=None, config=config)
    free = decode.rollout(model, prompt, 1, params, **common)
    ids = free.tokens[0].tolist()
    stop = tok.decode(ids[end - 2: end], skip_special_tokens=True)  # two characters, first completed by token `end`
    assert len(stop) == 2 and stop not in tok.decode(ids[: end - 1], skip_special_tokens=True), (stop, ids)
    assert not free.stopped[0]
    checker = StopStrings(tok, [stop], CHECK_EVERY, prompt, num_generations=1)
    out = decode.rollout(model, prompt, 1, params, stop_check=checker.running_hits, **common)
    sync = -(-end // CHECK_EVERY) * CHECK_EVERY
    assert out.tokens.shape[1] == sync and bool(out.stopped[0]), (out.tokens.shape, sync)
    assert torch.equal(out.tokens[0], free.tokens[0, :sync])


def test_engine_writes_pad_and_log_prob_0_after_a_rows_stop_token():
    """decode.rollout's own [N, S] outputs (what the vLLM-free trainer paths and rollout/compaction.py read): after
    the stop token a row holds pad, log-prob 0 and valid False; the stop token itself is valid with its log-prob."""
    tok, model = char_tokenizer(), tiny_model("llama", seed=1)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=16, temperature=0)
    free = decode.rollout(model, prompts, 2, params, stop_ids=[], pad_id=7, keys=None)
    stop_id = free.tokens[0, 3].item()
    out = decode.rollout(model, prompts, 2, params, stop_ids=[stop_id], pad_id=7, keys=None)
    for row in range(out.tokens.shape[0]):
        hits = (free.tokens[row] == stop_id).nonzero()
        n = hits[0, 0].item() + 1 if len(hits) else free.tokens.shape[1]
        assert out.valid[row].tolist() == [True] * n + [False] * (out.tokens.shape[1] - n), row
        assert torch.equal(out.tokens[row, :n], free.tokens[row, :n]) and torch.all(out.tokens[row, n:] == 7), row
        assert torch.equal(out.logprobs[row, :n], free.logprobs[row, :n]) and torch.all(out.logprobs[row, n:] == 0)
        assert bool(out.stopped[row]) == bool(len(hits)), row
    assert out.stopped.any() and not out.stopped.all()


def test_a_stop_string_is_found_across_a_special_token_the_text_skips():
    """Stop strings are looked for in the text the result holds (special tokens skipped): row 1's greedy completion
    starts e, <pad>, u, whose text reads "eu"; stop="eu" ends it at the u, as it would in the returned text."""
    tok, model = char_tokenizer(), tiny_model("llama")
    free = completions(generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0))[1]
    e, u = tok.convert_tokens_to_ids(["e", "u"])
    assert free[:3] == [e, PAD, u], free
    result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0, stop="eu")
    assert completions(result)[1] == free[:3] and result.texts[1] == "eu" and result.finish_reasons[1] == "stop"


def test_the_tokenizers_eos_stops_rows_whatever_the_generation_config_says():
    tok, model = char_tokenizer(), tiny_model("llama")
    free = completions(generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0))
    tok.eos_token = "i"  # a token some rows sample; the model's generation config names only its own EOS
    eos = tok.convert_tokens_to_ids("i")
    assert model.generation_config.eos_token_id == EOS and any(eos in row for row in free)
    result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0)
    for row, full in enumerate(free):
        assert completions(result)[row] == (full[: full.index(eos) + 1] if eos in full else full), row


def test_the_result_is_as_wide_as_its_longest_completion():
    """Stop strings cut the rows after the engine ran: the result's columns end with the longest kept row (the
    trainer pays for every column), not with the engine's last step."""
    tok, model = char_tokenizer(), tiny_model("llama")
    result = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0, stop=list(CHARS))
    lengths = result.completion_mask.sum(1)
    assert result.completion_ids.shape[1] == int(lengths.max()) < 12, lengths
    assert result.logprobs.shape == result.completion_ids.shape


@pytest.mark.parametrize("shared", [False, True])
def test_a_prompt_longer_than_max_prompt_length_gets_a_cache_that_holds_it(monkeypatch, shared):
    """The cache is sized for max(longest prompt, max_prompt_length): with a small length bucket, one sized for
    max_prompt_length alone (bucket(8 + 10) = 32 slots, a shared prefix of bucket(8) = 16) cannot hold a 39-token
    prompt. Run on the op's torch path (TRITON_INTERPRET unset, as tests/test_warmup.py's equality tests do)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tok, model = char_tokenizer(), tiny_model("qwen2")
    prompts = ["the quick brown fox jumps over the lazy", "b"]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    base = dict(attention="triton", shared_prefix=shared, length_bucket=16)
    got, want = (generate_with_config(model, tok, prompts, 2, params, seed=7, config=EngineConfig(**base, **kw))
                 for kw in (dict(max_prompt_length=8), {}))
    assert completions(got) == completions(want)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)


def test_token_ids_at_the_vocabulary_size_are_refused_and_the_last_id_is_not():
    """An id of exactly vocab_size is past the embeddings (a prompt's would index past them in the prefill): one
    line naming the argument, before any compute; vocab_size - 1 is a token."""
    tok, model = char_tokenizer(), tiny_model("llama")
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: expected token ids in \[0, {V}\), got {V} at position 1$"):
        generate(model, tok, [[3, 4], [5, V]], max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"^stop: expected non-empty strings or token ids in \[0, {V}\), got {V}$"):
        generate(model, tok, [[3, 4]], max_new_tokens=2, stop=[V])
    result = generate(model, tok, [[3, V - 1]], max_new_tokens=2, stop=[V - 1], temperature=0)
    assert result.completion_ids.shape == (1, result.completion_mask.sum().item())
