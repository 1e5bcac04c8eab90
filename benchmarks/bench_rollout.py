"""fastgrpo.rollout.generate vs HF generate (dynamic cache; static cache + torch.compile) and vLLM, same run.

    python -m pytest benchmarks/bench_rollout.py -q -s

Qwen2.5-1.5B shapes (FASTGRPO_ROLLOUT_MODEL=llama-3.1-8b for Llama-3.1-8B; random weights), bf16, 8 prompts x 8
generations, prompt 256 tokens (random ids), 1024 new tokens, pure sampling (temperature 1, no top-k/top-p) with EOS
ignored, so every row generates exactly 1024 tokens. Our rows (ENGINES): the default engine, an FP8 copy of the
weights (W8A16) and the W8A8 copy with an e4m3 KV cache; `vllm`: vLLM on the same model, prompts and sampling,
through fastgrpo's colocated VLLMEngine (per-token log-probs returned; where vLLM is installed). Each engine gets one
untimed warm-up call (full size where it compiles: ours, vLLM and HF static), then timed calls (wall clock,
synchronized; 3 of ours and vLLM's, 1 of each HF): tokens/s = 64 x 1024 / median seconds, peak GiB above the
weights, total peak GiB. Roofline share = (bytes a decode step must read: every weight the step multiplies, lm_head
included, plus the K/V of the tokens so far, averaged over the steps; as stored: an FP8 copy's and cache's bytes for
those rows) / measured copy bandwidth, divided by the measured time per step. Target: ours >= 8x HF default.
"""
from __future__ import annotations

import gc
import os
import statistics
import time

import pytest
import torch

from benchmarks.common import GIB, card_name, print_table, refuse_script_run, write_results
from benchmarks.e2e import MODEL_CONFIGS

PROMPTS, GENERATIONS, PROMPT_LEN = 8, 8, 256
NEW_TOKENS = int(os.environ.get("FASTGRPO_ROLLOUT_NEW_TOKENS", "1024"))
REPEATS = int(os.environ.get("FASTGRPO_ROLLOUT_REPEATS", "3"))
MODEL = os.environ.get("FASTGRPO_ROLLOUT_MODEL", "qwen2.5-1.5b")
ROWS: list[dict] = []
_SETUP: dict = {}


def _setup() -> dict:
    if _SETUP:
        return _SETUP
    model, tokenizer = build_model(MODEL, "cuda")
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1, model.config.vocab_size, (PROMPTS, PROMPT_LEN), generator=g)
    _SETUP.update(model=model, tokenizer=tokenizer, prompt_ids=prompt_ids, weights=torch.cuda.memory_allocated())
    return _SETUP


def build_model(name: str, device: str):
    """(model, tokenizer): random bf16 weights of MODEL_CONFIGS[name] on `device`, EOS ignored, and a word-level
    fast tokenizer over the whole vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    fields = dict(MODEL_CONFIGS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    # EOS ignored: nothing stops a row, so all engines generate exactly the requested tokens per row
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    # a real fast tokenizer over the whole vocabulary (decoding the texts is part of our call's cost)
    vocab = {f"t{i} ": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    return model, PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0 ")


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write of 1 GiB, median of 20)."""
    import triton.testing

    src = torch.empty(GIB // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def weight_bytes(model) -> int:
    """Bytes of every weight a decode step multiplies: all but the embedding table (a 64-row gather), unless tied."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if model.config.tie_word_embeddings else total - embed.numel() * embed.element_size()


def kv_bytes_per_token(config, fp8: bool = False) -> int:
    """K and V of one token over all layers: bf16, or e4m3 with one fp32 scale per vector (rollout/kv_cache.py)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_vector = head_dim + 4 if fp8 else head_dim * 2
    return config.num_hidden_layers * 2 * config.num_key_value_heads * per_vector


def _step_bytes(model, weights: int | None = None, fp8_cache: bool = False) -> float:
    """Bytes a decode step reads at least: weights it multiplies (not the embedding gather; `weights` when not the
    model's own, e.g. an FP8 copy) + the mean K/V so far (as the cache stores them)."""
    mean_context = PROMPT_LEN + NEW_TOKENS / 2
    weights = weight_bytes(model) if weights is None else weights
    return weights + PROMPTS * GENERATIONS * kv_bytes_per_token(model.config, fp8_cache) * mean_context


def _timed(call, repeats: int) -> dict:
    """`repeats` timed calls (after the caller's warm-up): median seconds, peaks, what the call left allocated."""
    setup = _setup()
    times = []
    for _ in range(repeats):
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated()
        del out
        gc.collect()
        left = torch.cuda.memory_allocated() - before
    seconds = statistics.median(times)
    tokens = PROMPTS * GENERATIONS * NEW_TOKENS
    return {
        "seconds": seconds, "tokens_per_s": tokens / seconds, "ms_per_step": seconds / NEW_TOKENS * 1e3,
        "peak_extra_gib": (peak - setup["weights"]) / GIB, "peak_total_gib": peak / GIB,
        "left_allocated_mib": left / 2**20,
    }


def _row(engine: str, measured: dict, weights: int | None = None, fp8_cache: bool = False) -> None:
    setup = _setup()
    if "bandwidth" not in setup:
        setup["bandwidth"] = _copy_bandwidth()
    roofline_ms = _step_bytes(setup["model"], weights, fp8_cache) / setup["bandwidth"] * 1e3
    ROWS.append({"engine": engine, **measured, "roofline_share": roofline_ms / measured["ms_per_step"]})
    hf = next((r for r in ROWS if r["engine"] == "hf_default"), None)
    vllm = next((r for r in ROWS if r["engine"] == "vllm"), None)
    for row in ROWS:
        if hf is not None:
            row["speedup_vs_hf_default"] = row["tokens_per_s"] / hf["tokens_per_s"]
        if vllm is not None:  # issue 15's target: >= 2x vLLM
            row["speedup_vs_vllm"] = row["tokens_per_s"] / vllm["tokens_per_s"]
    _write(roofline_ms)


# row name -> EngineConfig fields: the default engine, the FP8 copy with 16-bit activations (W8A16), and the fastest
# FP8 rollout (W8A8 copy and an e4m3 KV cache); the FP8 rows' rooflines count the bytes they read
ENGINES = {"fastgrpo": {}, "fastgrpo-fp8": {"weights": "fp8"},
           "fastgrpo-fp8-w8a8-kv": {"weights": "w8a8", "kv_cache": "fp8"}}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fastgrpo_rollout(engine):
    """The engine with ENGINES[engine] (benchmarks/bench_fp8.py has the FP8 GEMMs and the log-prob gap)."""
    from fastgrpo.rollout.decode_weights import copy_bytes
    from fastgrpo.rollout.decode import EngineConfig
    from fastgrpo.rollout.generate import generate_with_config
    from fastgrpo.rollout.sampling import SamplingParams

    setup = _setup()
    prompts = setup["prompt_ids"].tolist()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)

    def call():
        return generate_with_config(setup["model"], setup["tokenizer"], prompts, GENERATIONS, params, seed=0,
                                    config=EngineConfig(**ENGINES[engine]))

    first = time.perf_counter()
    result = call()
    first = time.perf_counter() - first
    assert result.completion_ids.shape == (PROMPTS * GENERATIONS, NEW_TOKENS)
    assert all(r == "length" for r in result.finish_reasons)
    del result
    measured = _timed(call, REPEATS)
    measured["first_call_s"] = first
    # the KV cache and step buffers go back when the call returns (within 64 MiB)
    measured["kv_released"] = measured["left_allocated_mib"] <= 64
    weights = ENGINES[engine].get("weights")
    copy = None if weights is None else copy_bytes(setup["model"], weights)
    _row(engine, measured, copy, ENGINES[engine].get("kv_cache") == "fp8")


def test_vllm_rollout():
    """vLLM in the same run, after our rows: fastgrpo.rollout.vllm.VLLMEngine sharing the model's weights, CUDA
    graphs, per-token log-probs. `tokens_per_s` with the per-prompt seeds the trainer passes, `tokens_per_s_unseeded`
    without (vLLM's per-request generators cost it time); memory from the device's used bytes (vLLM allocates
    outside torch's allocator): `rollout_extra_gib` above the model, with the KV cache mapped."""
    pytest.importorskip("vllm")
    from benchmarks.bench_vllm import used_gib
    from fastgrpo.rollout.sampling import SamplingParams
    from fastgrpo.rollout.vllm import VLLMEngine

    setup = _setup()
    torch._dynamo.reset()  # our compiled steps hold the tensors they were traced with
    base = used_gib()
    start = time.perf_counter()
    engine = VLLMEngine(setup["model"], setup["tokenizer"], max_model_len=PROMPT_LEN + NEW_TOKENS,
                        max_num_seqs=PROMPTS * GENERATIONS, execution="graphs")
    build_s = time.perf_counter() - start
    prompts = setup["prompt_ids"].tolist()
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)

    def call(seed):
        return lambda: engine.generate(prompts, num_generations=GENERATIONS, sampling=params, seed=seed)

    first = time.perf_counter()
    result = call(0)()
    first = time.perf_counter() - first
    assert result.completion_ids.shape == (PROMPTS * GENERATIONS, NEW_TOKENS)
    assert result.logprobs.shape == result.completion_ids.shape and bool((result.logprobs < 0).all())
    del result
    measured = {k: v for k, v in _timed(call(0), REPEATS).items() if k in ("seconds", "tokens_per_s", "ms_per_step")}
    measured.update(tokens_per_s_unseeded=_timed(call(None), REPEATS)["tokens_per_s"], first_call_s=first,
                    build_s=build_s, rollout_extra_gib=used_gib() - base)
    engine.release_memory()
    _row("vllm", measured)


def _hf_call(static: bool, new_tokens: int):
    setup = _setup()
    ids = setup["prompt_ids"].cuda()
    kwargs = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=new_tokens, num_return_sequences=GENERATIONS, pad_token_id=0,
    )
    if static:
        kwargs["cache_implementation"] = "static"  # HF compiles the forward itself (reduce-overhead) on CUDA
    return lambda: setup["model"].generate(**kwargs)


@pytest.mark.parametrize("engine", ["hf_default", "hf_static_compile"])
def test_hf_generate(engine):
    static = engine == "hf_static_compile"
    try:
        # warm-up: the static cache's compiled graphs are per shape, so its warm-up is full size; the dynamic
        # cache's is not (one full call of it is ~1 min); one timed call each (they are the slow ones)
        first = time.perf_counter()
        warm_tokens = NEW_TOKENS if static else 16
        out = _hf_call(static, warm_tokens)()
        first = time.perf_counter() - first
        assert out.shape == (PROMPTS * GENERATIONS, PROMPT_LEN + warm_tokens)  # EOS off: every row full length
        del out
        measured = _timed(_hf_call(static, NEW_TOKENS), 1)
    except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal to the other rows
        ROWS.append({"engine": engine, "error": repr(err)[:300]})
        _write(None)
        raise
    measured["first_call_s"] = first
    _row(engine, measured)


def _write(roofline_ms) -> None:
    write_results(f"rollout_{MODEL}", ROWS, {
        "model": f"{MODEL} shapes, random weights, bf16, sdpa", "card": card_name(),
        "prompts": PROMPTS, "generations": GENERATIONS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
        "sampling": "temperature 1, top_k 0, top_p 1, EOS ignored", "timed_calls": REPEATS,
        "copy_bandwidth_tb_s": _SETUP.get("bandwidth", 0) / 1e12, "roofline_ms_per_step": roofline_ms,
        "target": "fastgrpo tokens/s >= 8x hf_default; >= 2x vllm (issue 15)",
    })


def teardown_module(module):
    if ROWS:
        print()
        print_table(ROWS, ["engine", "tokens_per_s", "tokens_per_s_unseeded", "speedup_vs_hf_default", "speedup_vs_vllm",
                           "ms_per_step", "roofline_share", "peak_extra_gib", "peak_total_gib", "left_allocated_mib",
                           "first_call_s"])


if __name__ == "__main__":
    refuse_script_run(__file__)
