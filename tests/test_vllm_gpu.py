"""VLLMEngine on a real vLLM, against the built-in engine and the trainer's own log-probs, on tiny bf16 models.

    python -m pytest tests/test_vllm_gpu.py -q -n 5 --dist loadgroup

vLLM's CuMem pool (what release_memory frees) is one per process, and vLLM engines are not freed reliably within
a process: each xdist group builds one engine in its own worker. Run in one process, the later engines are built
with release=False. Engines run eager (enforce_eager): no compile or graph capture to wait for.
"""
import collections
from types import SimpleNamespace

import pytest
import torch
from test_rollout import EOS, PAD, PROMPTS, char_tokenizer, completions
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.rollout import BuiltinEngine, SamplingParams
from fastgrpo.rollout.decode import EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
pytest.importorskip("vllm", reason='needs vLLM: pip install "fastgrpo[vllm]"')

from fastgrpo.rollout.vllm import VLLMEngine  # noqa: E402

SIZES = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None,
)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0)
MAX_MODEL_LEN, MAX_SEQS = 128, 64
KV_BYTES = 2 << 30
# Random weights at HF's init scale give near-uniform next-token distributions, where bf16 kernels that differ
# (vLLM's vs HF's) flip greedy choices: a larger final-norm weight scales the logits up. Larger o_proj / down_proj
# let the layers' outputs, not the token's own embedding, dominate the residual stream (with tied embeddings the
# model would otherwise only repeat its last token).
LOGIT_SCALE, OUTPUT_SCALE = 10.0, 10.0


def tiny(arch: str = "qwen2", lora: bool = False, seed: int = 0, special_tokens: tuple[str, ...] = ()):
    tok = char_tokenizer()
    if special_tokens:  # added after the characters, in the vocabulary the model is built with
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    config = (Qwen2Config(tie_word_embeddings=True, vocab_size=len(tok), **SIZES) if arch == "qwen2"
              else LlamaConfig(tie_word_embeddings=False, vocab_size=len(tok), **SIZES))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(OUTPUT_SCALE)
            layer.mlp.down_proj.weight.mul_(OUTPUT_SCALE)
    if lora:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: a non-zero adapter from the start, so it shows in the outputs
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 init_lora_weights=False))
    return model, tok


def cumem_free() -> bool:
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.instance is None or CuMemAllocator.instance.get_current_usage() == 0


def build_engine(model, tok, **kwargs):
    return VLLMEngine(model, tok, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_SEQS, execution="eager",
                      release=cumem_free(), **kwargs)


def run(engine, prompts=PROMPTS, G=2, sampling=GREEDY, **kwargs):
    engine.reacquire_memory()
    out = engine.generate(prompts, num_generations=G, sampling=sampling, **kwargs)
    engine.release_memory()
    return out


def builtin(model, tok, **kwargs):
    return run(BuiltinEngine(model, tok, EngineConfig(compile=False)), **kwargs)


def next_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1]
    return logits.float().log_softmax(-1)


def assert_same_greedy(got, want, model, tok, prompts=PROMPTS):
    """Token-for-token equal rows; where a row differs, the trainer's model must rank the two tokens at the first
    difference within bf16 noise (a near-tie either kernel may break), and most rows must agree exactly."""
    a, b = completions(got), completions(want)
    G = got.num_generations
    for r, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        i = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        assert i < min(len(x), len(y)), f"row {r}: one completion is a prefix of the other: {x} vs {y}"
        prompt = tok(prompts[r // G], add_special_tokens=False)["input_ids"]
        logp = next_logprobs(model, prompt + x[:i])
        gap = (logp[x[i]] - logp[y[i]]).abs().item()
        assert gap < 0.15, f"row {r} differs at token {i} ({x[i]} vs {y[i]}) with a log-prob gap of {gap:.3f}"
    assert sum(x == y for x, y in zip(a, b)) * 2 >= len(a), (a, b)


def logprob_errors(out, model, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(|log-prob - the trainer's fused log-prob|, the trainer's log-prob) at each completion token of `out`."""
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1).cuda()
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1).cuda()
    cmask = torch.cat([torch.zeros_like(out.prompt_mask), out.completion_mask], 1).cuda()
    with torch.no_grad():
        ref = sequence_logprobs(model, ids, mask, cmask, temperature=temperature)[:, out.prompt_ids.shape[1]:]
    valid = out.completion_mask.bool().cuda()
    assert (out.logprobs.cuda()[~valid] == 0).all()
    return (out.logprobs.cuda() - ref)[valid].abs(), ref[valid]


def assert_logprobs_within_noise(errors: dict) -> None:
    """vLLM's errors within 3x the built-in engine's own disagreement with the trainer (bf16 noise)."""
    print({k: (round(v.mean().item(), 5), round(v.max().item(), 4)) for k, v in errors.items()})
    assert errors["vllm"].mean() <= 3 * errors["builtin"].mean() + 5e-3
    assert errors["vllm"].mean() < 0.05


def assert_logprobs_match(engine, model, tok) -> None:
    """vLLM's per-token log-probs (temperature 0.7: the processed distribution, not the raw one) against the
    trainer's fused log-probs on the same tokens, within 3x the built-in engine's own disagreement (bf16 noise)."""
    sampling = SamplingParams(max_new_tokens=40, temperature=0.7)
    errors = {}
    for name, out in (("vllm", run(engine, G=8, sampling=sampling, seed=3)),
                      ("builtin", builtin(model, tok, G=8, sampling=sampling, seed=3))):
        errors[name], ref = logprob_errors(out, model, temperature=0.7)
        assert (ref < -1e-2).float().mean() > 0.2  # sampled tokens of some uncertainty, not all logp = 0
    assert_logprobs_within_noise(errors)


def adamw_step(model, lr: float) -> None:
    """One real training step (GRPO loss on random rows, AdamW) on the model's trainable parameters."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (4, 20), generator=g).cuda()
    mask = torch.ones_like(ids)
    cmask = torch.zeros_like(ids)
    cmask[:, 8:] = 1
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    loss, _ = grpo_loss(model, ids, mask, cmask, torch.tensor([1.0, -1.0, 0.5, -0.5], device="cuda"))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ---- full fine-tuning, weights shared (one engine for the group) ----
@pytest.fixture(scope="module")
def shared():
    model, tok = tiny()
    # a KV cache far larger than what the other test workers allocate meanwhile on the same card
    return model, tok, build_engine(model, tok, kv_cache_bytes=KV_BYTES)


@pytest.mark.xdist_group("shared")
def test_parameters_are_views_of_vllm_weights(shared):
    model, _, engine = shared
    attn = engine.vllm_model.model.layers[0].self_attn
    q = model.model.layers[0].self_attn.q_proj.weight
    k = model.model.layers[0].self_attn.k_proj.weight
    assert q.data_ptr() == attn.qkv_proj.weight.data_ptr()
    assert k.data_ptr() == attn.qkv_proj.weight[q.shape[0]:].data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert engine.copies == []  # nothing for load_weights to copy


@pytest.mark.xdist_group("shared")
def test_greedy_tokens_match_builtin_engine(shared):
    model, tok, engine = shared
    got, want = run(engine), builtin(model, tok)
    assert len({t for row in completions(got) for t in row}) > 3  # not a model that repeats one token
    assert_same_greedy(got, want, model, tok)
    assert got.prompt_ids.tolist() == want.prompt_ids.tolist()  # rows grouped by prompt, left-padded alike
    assert got.texts[0] == tok.decode(completions(got)[0], skip_special_tokens=True)


@pytest.mark.xdist_group("shared")
def test_logprobs_match_sequence_logprobs(shared):
    """vLLM's per-token log-probs (temperature 0.7: the processed distribution, not the raw one) against the
    trainer's fused log-probs on the same tokens; the bf16 noise bound is the built-in engine's own disagreement."""
    model, tok, engine = shared
    assert_logprobs_match(engine, model, tok)


@pytest.mark.xdist_group("shared")
def test_stop_strings_cut_like_the_builtin_engine(shared):
    model, tok, engine = shared
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0)
    free = run(engine, G=8, sampling=sampling, seed=5)
    stop = max(set("".join(free.texts)) - {" "}, key="".join(free.texts).count)
    out = run(engine, G=8, sampling=sampling, seed=5, stop=[stop])
    hits = 0
    for ids, text, reason in zip(completions(out), out.texts, out.finish_reasons):
        assert text == tok.decode(ids, skip_special_tokens=True)
        if stop in text:
            hits += 1
            assert reason == "stop" and stop not in tok.decode(ids[:-1], skip_special_tokens=True)
        else:
            assert reason == "length" or ids[-1] == EOS
    assert hits > 0


@pytest.mark.xdist_group("shared")
def test_release_gives_the_kv_cache_back(shared):
    model, tok, engine = shared
    from vllm.device_allocator.cumem import CuMemAllocator

    if not engine.release:
        pytest.skip("another vLLM engine in this process holds the CuMem pool; run with -n 5 --dist loadgroup")
    before = run(engine)
    engine.reacquire_memory()
    torch.cuda.synchronize()
    awake = torch.cuda.mem_get_info()[0]
    kv = sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == "kv_cache")
    engine.release_memory()
    released = torch.cuda.mem_get_info()[0]
    engine.reacquire_memory()
    again = torch.cuda.mem_get_info()[0]
    engine.release_memory()
    print(f"kv {kv / 2**20:.1f} MiB, freed {(released - awake) / 2**20:.1f} MiB, "
          f"taken back {(released - again) / 2**20:.1f} MiB")
    assert kv >= 0.95 * KV_BYTES
    # cudaMemGetInfo is the whole card's: other test workers allocate meanwhile, hence 10%
    assert released - awake >= 0.9 * kv
    assert abs(again - awake) <= 0.1 * kv
    assert completions(run(engine)) == completions(before)  # the weights survived, the stale KV was not read


@pytest.mark.xdist_group("shared")
def test_optimizer_step_reaches_vllm(shared):
    model, tok, engine = shared
    before = run(engine)
    adamw_step(model, lr=5e-2)
    engine.load_weights(model)
    after, want = run(engine), builtin(model, tok)
    assert completions(after) != completions(before)
    assert_same_greedy(after, want, model, tok)


# ---- the syncs that copy: a skipped sync leaves vLLM on the old weights ----
@pytest.mark.xdist_group("copy")
def test_full_copy_mode_needs_the_sync():
    model, tok = tiny(seed=1)
    engine = build_engine(model, tok, share_weights=False)
    assert len(engine.copies) == len(list(model.parameters()))
    before = run(engine)
    adamw_step(model, lr=5e-2)
    assert completions(run(engine)) == completions(before)  # no sync yet: vLLM still runs its own copy
    engine.load_weights(model)
    after = run(engine)
    assert completions(after) != completions(before)
    assert_same_greedy(after, builtin(model, tok), model, tok)


@pytest.mark.parametrize("lora_sync", [pytest.param(s, marks=pytest.mark.xdist_group(f"lora_{s}"))
                                       for s in ("adapter", "merge")])
def test_lora_sync_changes_outputs(lora_sync):
    model, tok = tiny(lora=True, seed=2)
    engine = build_engine(model, tok, lora_sync=lora_sync)
    before = run(engine)
    assert_same_greedy(before, builtin(model, tok), model, tok)  # the adapter is in vLLM's outputs
    adamw_step(model, lr=5e-2)
    assert completions(run(engine)) == completions(before)  # no sync yet
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    engine.load_weights(model)
    assert all(torch.equal(p, lora[n]) for n, p in model.named_parameters() if "lora_" in n)  # sync left them
    after = run(engine)
    assert completions(after) != completions(before)
    assert_same_greedy(after, builtin(model, tok), model, tok)


# ---- Llama: untied lm_head, vLLM's V2 model runner ----
@pytest.mark.xdist_group("llama")
def test_llama_release_update_sync():
    model, tok = tiny("llama", seed=3)
    engine = build_engine(model, tok)
    assert model.lm_head.weight.data_ptr() == engine.vllm_model.lm_head.weight.data_ptr()
    before = run(engine)
    assert_same_greedy(before, builtin(model, tok), model, tok)
    adamw_step(model, lr=5e-2)
    engine.load_weights(model)
    after = run(engine)
    assert completions(after) != completions(before)
    assert_same_greedy(after, builtin(model, tok), model, tok)


# ---- modules_to_save: the merged sync runs the trained copy of an untied lm_head ----
@pytest.mark.xdist_group("modules_to_save")
def test_merge_sync_runs_the_trained_lm_head_copy():
    """LoRA plus modules_to_save=["lm_head"]: vLLM's lm_head is the trained copy, aliased (an optimizer step on it
    needs no copy), not the frozen original the reference policy runs; greedy tokens and log-probs are the trainer's
    model's before and after a training step."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny("llama", seed=4)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                             modules_to_save=["lm_head"], init_lora_weights=False))
    head = model.base_model.model.lm_head
    original = head.original_module.weight
    with torch.no_grad():  # a copy far from the original: vLLM running the original would show in its outputs
        head.modules_to_save["default"].weight.add_(torch.randn_like(original) * original.float().std())
    engine = build_engine(model, tok, lora_sync="merge")
    trained = head.modules_to_save["default"].weight
    assert trained.data_ptr() == engine.vllm_model.lm_head.weight.data_ptr() and trained.requires_grad
    assert original.data_ptr() != trained.data_ptr()
    assert "lm_head.weight" not in {c.hf_name for c in engine.copies}  # the merged LoRA layers' only
    before = run(engine)
    assert_same_greedy(before, builtin(model, tok), model, tok)
    assert_logprobs_match(engine, model, tok)
    adamw_step(model, lr=5e-2)
    engine.load_weights(model)
    after = run(engine)
    assert completions(after) != completions(before)
    assert_same_greedy(after, builtin(model, tok), model, tok)
    assert_logprobs_match(engine, model, tok)


# ---- trainable_token_indices: the merged sync runs the trained rows of a tied embedding / lm_head ----
@pytest.mark.xdist_group("trainable_tokens")
def test_merge_sync_runs_the_trained_token_rows():
    """LoRA plus trainable_token_indices on a tied Qwen2 (PEFT runs the embedding's trained rows in the head too):
    vLLM's tied embedding holds the base rows with the trained rows in place, a copy whose trained rows each sync
    writes, not the frozen base rows the reference policy runs; greedy tokens and log-probs are the trainer's model's
    before and after a training step."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny(seed=5)
    rows = tok("oel ", add_special_tokens=False)["input_ids"]  # in the prompts, and in what the model samples
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                             trainable_token_indices=rows, init_lora_weights=False))
    layer = model.base_model.model.model.embed_tokens.token_adapter
    base, trained = layer.base_layer.weight, layer.trainable_tokens_delta["default"]
    with torch.no_grad():  # rows far from the base's: vLLM running the base rows would show in its outputs
        trained.add_(torch.randn_like(trained) * base.float().std())
    engine = build_engine(model, tok, lora_sync="merge")
    vllm_embedding = engine.vllm_model.model.embed_tokens.weight

    def trained_rows():  # as PEFT's forward runs them: get_merged_weights casts the fp32 deltas to the weight's dtype
        return trained.detach().to(vllm_embedding.dtype)

    assert "model.embed_tokens.weight" in {c.hf_name for c in engine.copies}
    assert base.data_ptr() != vllm_embedding.data_ptr()  # the trainer's base rows stay its own
    assert torch.equal(vllm_embedding[rows], trained_rows())
    before = run(engine)
    assert_same_greedy(before, builtin(model, tok), model, tok)
    assert_logprobs_match(engine, model, tok)
    adamw_step(model, lr=5e-2)
    assert not torch.equal(vllm_embedding[rows], trained_rows())  # no sync yet
    engine.load_weights(model)
    assert torch.equal(vllm_embedding[rows], trained_rows())
    untrained = [i for i in range(base.shape[0]) if i not in rows]
    assert torch.equal(vllm_embedding[untrained], base[untrained])  # the base's rows around them
    after = run(engine)
    assert completions(after) != completions(before)
    assert_same_greedy(after, builtin(model, tok), model, tok)
    assert_logprobs_match(engine, model, tok)


# ---- special tokens as stops: an added special token (a chat model's <|im_end|>), PAD and EOS, emitted ----
IM_END = "<|im_end|>"
CHAT_PROMPTS = [*PROMPTS, "zebra", "what is 12 and 30?", "hi, how are you"]


@pytest.fixture(scope="module")
def chat():
    """An untied Llama whose tokenizer adds <|im_end|> as a special token and whose generation config lists it beside
    EOS (as Qwen2.5-Instruct's does) when the engine is built. `source`: the character greedy decoding picks most
    often between two other characters (the rows repeat characters a lot; without any, most often), which `emit`
    makes it pick another token in place of."""
    model, tok = tiny("llama", seed=6, special_tokens=(IM_END,))
    im_end = tok.convert_tokens_to_ids(IM_END)
    model.generation_config.eos_token_id = [EOS, im_end]
    engine = build_engine(model, tok)
    free, special = completions(builtin(model, tok, prompts=CHAT_PROMPTS)), set(tok.all_special_ids)
    between = collections.Counter(b for ids in free for a, b, c in zip(ids, ids[1:], ids[2:])
                                  if not {a, b, c} & special and a != b != c)
    picked = between or collections.Counter(t for ids in free for t in ids if t not in special)
    rows = (model.model.embed_tokens.weight, model.lm_head.weight)
    return SimpleNamespace(model=model, tok=tok, engine=engine, im_end=im_end, source=picked.most_common(1)[0][0],
                           rows=rows, original=[w.detach().clone() for w in rows])


def emit(chat, token: int) -> None:
    """Greedy decoding picks `token` in place of chat.source: its lm_head row becomes 1.1x the source's (the source's
    logit, positive where it wins, scaled past it; a larger factor also wins where the source came second) and its
    embedding row the source's (the row goes on as after the source); every other row is its original. vLLM runs the
    same rows (shared); its prefix cache is reset."""
    embedding, head = chat.rows
    with torch.no_grad():
        for weight, original in zip(chat.rows, chat.original):
            weight.copy_(original)
        embedding[token] = embedding[chat.source]
        head[token] = head[chat.source] * 1.1
    chat.engine.load_weights(chat.model)


def rollouts(chat, **kwargs):
    """(vLLM's, the built-in engine's) greedy rollouts of CHAT_PROMPTS."""
    return (run(chat.engine, prompts=CHAT_PROMPTS, **kwargs),
            builtin(chat.model, chat.tok, prompts=CHAT_PROMPTS, **kwargs))


def assert_same_rollout(got, want, chat) -> None:
    """Greedy tokens as assert_same_greedy; where a row agrees, its mask, text (special tokens skipped) and finish
    reason too; each engine's log-probs (at temperature 1, as greedy returns them) against the trainer's."""
    assert_same_greedy(got, want, chat.model, chat.tok, CHAT_PROMPTS)
    for r, (x, y) in enumerate(zip(completions(got), completions(want))):
        assert got.texts[r] == chat.tok.decode(x, skip_special_tokens=True) and IM_END not in got.texts[r], r
        if x == y:
            assert got.completion_mask[r].nonzero().tolist() == want.completion_mask[r].nonzero().tolist(), r
            assert (got.texts[r], got.finish_reasons[r]) == (want.texts[r], want.finish_reasons[r]), r
    assert_logprobs_within_noise({name: logprob_errors(out, chat.model, temperature=1.0)[0]
                                  for name, out in (("vllm", got), ("builtin", want))})


@pytest.mark.xdist_group("special_tokens")
@pytest.mark.parametrize("emitted, stop, config_eos", [
    ("im_end", "id", False), ("im_end", "text", False), ("im_end", None, True),
    ("pad", "id", False), ("pad", "text", False), ("eos", None, False),
], ids=["added-id", "added-text", "generation-config", "pad-id", "pad-text", "tokenizer-eos"])
def test_special_token_stops_like_the_builtin_engine(chat, monkeypatch, emitted, stop, config_eos):
    """A special token greedy decoding emits stops a row when it is in the stop ids, as its id or its text (which
    the texts never show), in the generation config's EOS list, or the tokenizer's EOS: the row ends with it."""
    token = {"im_end": chat.im_end, "pad": PAD, "eos": EOS}[emitted]
    if not config_eos:  # <|im_end|> stops through the stop argument alone
        monkeypatch.setattr(chat.model.generation_config, "eos_token_id", EOS)
    emit(chat, token)
    stops = {"id": [token], "text": chat.tok.convert_ids_to_tokens(token), None: None}[stop]
    got, want = rollouts(chat, stop=stops)
    assert_same_rollout(got, want, chat)
    ended = [ids for ids in completions(got) if token in ids]
    assert ended, completions(got)  # emitted
    assert all(ids.index(token) == len(ids) - 1 for ids in ended), ended
    assert all(reason == "stop" for ids, reason in zip(completions(got), got.finish_reasons) if token in ids)


@pytest.mark.xdist_group("special_tokens")
def test_a_special_token_that_is_no_stop_is_skipped_in_texts_and_stop_strings(chat, monkeypatch):
    """<|im_end|> emitted, dropped from the generation config's EOS ids after the engine was built (vLLM stopped
    there, at the ids it read at its build): rows run on past it, their texts skip it, and a stop string of the two
    characters around it (first seen there where a row has such a span) cuts the row where the built-in engine does."""
    monkeypatch.setattr(chat.model.generation_config, "eos_token_id", EOS)
    emit(chat, chat.im_end)
    free, want = rollouts(chat)
    assert_same_rollout(free, want, chat)
    tok, rows = chat.tok, completions(free)

    def text(ids):
        return tok.decode(ids, skip_special_tokens=True)

    spans = [(r, i) for r, ids in enumerate(rows) for i in range(1, len(ids) - 1)
             if ids[i] == chat.im_end and not {ids[i - 1], ids[i + 1]} & set(tok.all_special_ids)]
    assert spans, rows  # a row ran on past <|im_end|>, between two characters
    # the string's first occurrence spans <|im_end|> where a row has one such (its characters are often repeated)
    r, i = min(spans, key=lambda s: text(rows[s[0]][s[1] - 1:s[1] + 2]) in text(rows[s[0]][:s[1]]))
    stop = text(rows[r][i - 1:i + 2])
    got, want = rollouts(chat, stop=[stop])
    assert_same_rollout(got, want, chat)
    hits = 0
    for ids, reason in zip(completions(got), got.finish_reasons):
        if stop in text(ids):
            hits += 1
            assert reason == "stop" and stop not in text(ids[:-1]), (stop, ids)
        else:
            assert reason == "length" or ids[-1] == EOS, (stop, ids)
    assert hits > 0, (stop, rows[r])
