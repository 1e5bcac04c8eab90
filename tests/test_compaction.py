"""EngineConfig(finished_rows="skip" / "compact"): finished rows stop costing compute, the samples stay the same.

The sampling noise is keyed per (seed, prompt, sample, step) (rollout/sampling.py), so a row's tokens depend on its
own state alone: a compacted rollout must give the tokens, log-probs, masks, texts and finish reasons of the plain
one BIT FOR BIT (torch.equal, no tolerance), sampled as well as greedy, with the lengths spread by stop tokens.
That holds where the matmuls round a row alike at every batch size: on the CI CPUs (MKL) the tiny models' GEMMs do
at >= 6 rows but not below (their down projection, 128 -> 64, rounds differently at 3-5 rows), so the exact tests
keep MIN_ROWS = 8, and the one that shrinks batches to 2 rows checks tokens equal and log-probs within 1e-6. The
tests run on one intra-op thread: with two, MKL splits a batch's rows between the threads by its size, and on an
AMD EPYC (AVX-512) a row then rounds differently in a batch of 16 than in one of 32 (1 ulp in a few log-probs).

The engine runs on the op's plain-torch attention path here (TRITON_INTERPRET unset, as test_shared_prefix's long
runs do): the interpreted kernel would take minutes for 32 rows x 48 steps, and the kernel's per-row reads are
tested against the torch path in tests/test_decode_attention.py.
"""
import warnings

import pytest
import torch

from fastgrpo.rollout import attention, compaction, decode
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams, row_keys
from tests.test_rollout import PROMPTS, char_tokenizer, completions, teacher_forced_logprobs, tiny_model
from tests.test_rollout_stops import BOS, pieces_text, sentencepiece_tokenizer, tiny_llama, vllm_cut

# 8 prompts x 4 samples = 32 rows: batches of 32, 16 and 8 under the default MIN_ROWS
MORE_PROMPTS = PROMPTS + ["a", "xyz!?", "hello world", "the end", "abc def", "zzz"]
G = 4
CHECK_EVERY = 4  # host syncs (and so compactions) every 4 steps: several within 48 tokens


@pytest.fixture(autouse=True)
def torch_attention_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True)
def one_thread():
    """Each row's math the same at every batch size: no thread split of a batch that depends on its size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def buckets(monkeypatch):
    """(rows of the state, rows of layer 0's cached keys) after each compaction: proof that it ran, and shrank."""
    sizes = []
    compact = compaction.FinishedRows.compact

    def spy(self):
        compact(self)
        sizes.append((self.state.done.shape[0], self.cache.keys[0].shape[0]))

    monkeypatch.setattr(compaction.FinishedRows, "compact", spy)
    return sizes


def run(model, params, mode, stop, seed=3, prompts=MORE_PROMPTS, tokenizer=None, **config):
    config = EngineConfig(finished_rows=mode, check_every=CHECK_EVERY, **config)
    return generate_with_config(model, tokenizer or char_tokenizer(), prompts, G, params, seed=seed, stop=stop,
                                config=config)


def stop_ids(chars: str) -> list[int]:
    return char_tokenizer()(chars, add_special_tokens=False)["input_ids"]


def assert_identical(got, want, what):
    assert torch.equal(got.completion_ids, want.completion_ids), what
    assert torch.equal(got.logprobs, want.logprobs), what
    assert torch.equal(got.completion_mask, want.completion_mask), what
    assert got.finish_reasons == want.finish_reasons and got.texts == want.texts, what


def test_bucket_halves_down_to_min_rows(monkeypatch):
    assert compaction.MIN_ROWS == 8
    assert [compaction.bucket(64, live) for live in (64, 33, 32, 17, 16, 9, 8, 1)] == [64, 64, 32, 32, 16, 16, 8, 8]
    assert compaction.bucket(12, 1) == 12  # 6 < MIN_ROWS: not worth a batch of its own
    assert compaction.bucket(8, 1) == 8 and compaction.bucket(5, 1) == 5
    monkeypatch.setattr(compaction, "MIN_ROWS", 2)
    assert [compaction.bucket(12, live) for live in (7, 6, 4, 3, 2, 1)] == [12, 6, 6, 3, 2, 2]


# (arch, attention options, sampling options, stop characters): greedy rows of a prompt end together, sampled ones
# apart; top-k and the repetition penalty bring the seen-token set ([N, V], gathered too); mistral's sliding window
# and gemma2's eager attention (additive float masks) take the masks' other forms
CASES = {
    "qwen2 sdpa greedy": ("qwen2", {}, dict(temperature=0.0), "eo"),
    "qwen2 sdpa sampled": ("qwen2", {}, dict(temperature=1.0, top_k=20, repetition_penalty=1.2), "e"),
    "llama triton sampled": ("llama", dict(attention="triton"), dict(temperature=0.9, top_p=0.95), "o"),
    "qwen2 shared sampled": ("qwen2", dict(attention="triton", shared_prefix=True), dict(temperature=1.0), "eo"),
    "llama shared greedy": ("llama", dict(attention="triton", shared_prefix=True), dict(temperature=0.0), "e "),
    # the e4m3 buffers and their scales gathered together (as bytes: compaction._select_rows)
    "llama fp8 sampled": ("llama", dict(attention="triton", kv_cache="fp8"), dict(temperature=0.9, top_p=0.95), "o"),
    "qwen2 fp8 shared sampled": ("qwen2", dict(attention="triton", kv_cache="fp8", shared_prefix=True),
                                 dict(temperature=1.0), "eo"),
    "mistral sampled": ("mistral", {}, dict(temperature=1.0, min_p=0.02), "e"),
    "gemma2 sampled": ("gemma2", {}, dict(temperature=1.0), "o"),
}


@pytest.mark.parametrize("case", CASES)
def test_compacted_rollout_is_bit_identical(case, buckets):
    arch, options, sampling, stop = CASES[case]
    model = tiny_model(arch, seed=2)
    params = SamplingParams(max_new_tokens=48, **sampling)
    want = run(model, params, "keep", stop_ids(stop), **options)
    assert not buckets
    got = run(model, params, "compact", stop_ids(stop), **options)
    lengths = want.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 2, lengths  # a spread of lengths, the point of the test
    assert buckets and all(rows == cached < 32 for rows, cached in buckets), buckets
    assert_identical(got, want, case)


def test_engine_outputs_are_identical(buckets):
    """decode.rollout's own outputs, [N, S] each: rows gathered away early read pad / 0 / False after their end,
    as the rows that ran to the end as pads do, and `stopped` comes back for every row."""
    model, tok = tiny_model("llama", seed=2), char_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in MORE_PROMPTS]
    params = SamplingParams(max_new_tokens=48, temperature=1.0)
    keys = row_keys(5, range(len(prompts)), G)
    # a pad id that is not 0: the buffers start as zeros
    out = {mode: decode.rollout(model, prompts, G, params, stop_ids=stop_ids("o"), pad_id=7, keys=keys,
                                config=EngineConfig(finished_rows=mode, check_every=CHECK_EVERY))
           for mode in ("keep", "compact")}
    assert buckets
    for field in ("tokens", "logprobs", "valid", "stopped"):
        assert torch.equal(getattr(out["compact"], field), getattr(out["keep"], field)), field
    assert not out["keep"].stopped.all() and out["keep"].stopped.any()


def test_skip_is_bit_identical_and_compact_samples_from_the_sampling_distribution(buckets):
    """"skip" changes nothing but the finished rows' masks; a compacted rollout's log-probs are those of its tokens
    under the filters (teacher-forced, fp64), as the plain rollout's are (tests/test_rollout.py)."""
    model = tiny_model("qwen2", seed=2)
    params = SamplingParams(max_new_tokens=48, temperature=0.8, top_k=15, top_p=0.9)
    want = run(model, params, "keep", stop_ids("e"), attention="triton")
    assert_identical(run(model, params, "skip", stop_ids("e"), attention="triton"), want, "skip")
    assert not buckets
    got = run(model, params, "compact", stop_ids("e"), attention="triton")
    assert buckets
    forced = teacher_forced_logprobs(model, got, params)
    torch.testing.assert_close(got.logprobs.double(), forced, atol=1e-4, rtol=0)


def test_stop_strings_see_the_compacted_rows(buckets):
    """Stop strings are found on the host at each sync from the current rows' tokens: after a compaction those rows
    are a subset of the call's, whose tokens so far travel with them."""
    model = tiny_model("llama", seed=2)
    params = SamplingParams(max_new_tokens=48, temperature=1.0)
    stop = ["ab", "e ", "o", *stop_ids("?")]
    want = run(model, params, "keep", stop)
    got = run(model, params, "compact", stop)
    assert buckets
    assert_identical(got, want, "stop strings")
    assert "stop" in want.finish_reasons and "length" in want.finish_reasons


@pytest.mark.parametrize("min_rows, length, ending", [(8, 6, "abcdefgh"), (2, 10, "ab")])
def test_stop_strings_read_each_compacted_rows_own_prompt(buckets, monkeypatch, min_rows, length, ending):
    """A stop string is looked for in a row's text after its own prompt: with a SentencePiece tokenizer, one that
    starts with a space matches at a row's first token after a prompt of text, not after a prompt of special tokens
    alone (<s>: decoded to nothing, as vLLM's text then starts without the space). Prompts of both kinds alternate
    and the strings complete at token 6, after the compaction at step 4 has moved the rows: each row must read its
    own prompt there (vLLM's text, tests/test_rollout_stops.vllm_cut, is the reference). MIN_ROWS 2 and strings of
    10 tokens (fewer rows ending early): compacted again at step 8, each row's prompt is found through both."""
    monkeypatch.setattr(compaction, "MIN_ROWS", min_rows)
    tok = sentencepiece_tokenizer("metaspace")
    model = tiny_llama(len(tok), seed=1)
    text = tok("say hello", add_special_tokens=False)["input_ids"]
    prompts = [text if n % 2 == 0 else [BOS] for n in range(8)]
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    ends = tok.convert_tokens_to_ids(list(ending))  # pieces that continue a word: rows end early
    free = completions(run(model, params, "keep", ends, prompts=prompts, tokenizer=tok))
    # a string per row that runs past its length on plain pieces: its first tokens, "▁" read as a space
    long_rows = [r for r, ids in enumerate(free) if len(ids) > length and min(ids[:length]) > BOS]
    strings = [pieces_text(tok, free[r][:length]) for r in long_rows]
    want = run(model, params, "keep", ends + strings, prompts=prompts, tokenizer=tok)
    buckets.clear()
    got = run(model, params, "compact", ends + strings, prompts=prompts, tokenizer=tok)
    assert len(buckets) >= (1 if min_rows == 8 else 2) and buckets[0][0] < 4 * G * 2, buckets
    if min_rows == 8:
        assert_identical(got, want, "stop strings after each row's prompt")
    else:  # MKL's rounding at <= 5 rows, as in test_batches_down_to_two_rows: the same tokens, log-probs within 1e-6
        assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.completion_mask,
                                                                                     want.completion_mask)
        assert got.finish_reasons == want.finish_reasons and got.texts == want.texts
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)
    for r, ids in enumerate(free):
        cut = vllm_cut(tok, prompts[r // G], ids, strings)
        assert completions(got)[r] == (ids if cut is None else ids[:cut]), (r, cut)
    by_prompt = {kind: [r for r in long_rows if (r // G) % 2 == kind] for kind in (0, 1)}
    assert all(len(completions(got)[r]) == length for r in by_prompt[0]) and by_prompt[0], by_prompt
    assert all(len(completions(got)[r]) > length for r in by_prompt[1]) and by_prompt[1], by_prompt


def test_batches_down_to_two_rows(monkeypatch, buckets):
    """MIN_ROWS lowered to 2: many compactions, odd sizes, per-row prompt copies compacted again. MKL rounds some
    GEMMs of <= 5 rows differently from the same rows in a larger batch (x[:n] @ W.T != (x @ W.T)[:n] for the
    128 -> 64 projection at n = 3..5, torch 2.13), so here: same tokens, log-probs within 1e-6."""
    monkeypatch.setattr(compaction, "MIN_ROWS", 2)
    model = tiny_model("qwen2", seed=2)
    params = SamplingParams(max_new_tokens=48, temperature=1.0)
    want = run(model, params, "keep", stop_ids("eo"), attention="triton", shared_prefix=True)
    got = run(model, params, "compact", stop_ids("eo"), attention="triton", shared_prefix=True)
    assert len(buckets) >= 3 and buckets[-1][0] <= 4, buckets
    assert completions(got) == completions(want) and got.texts == want.texts
    assert torch.equal(got.completion_mask, want.completion_mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("shared", [False, True])
def test_skip_hides_finished_rows_from_the_kernel(shared, monkeypatch):
    """At the first sync after a row's stop token, its mask row keeps only the slot the step writes (the kernel
    reads nothing else of its cache), and a prompt shared by a group is hidden once the whole group has finished;
    running rows see exactly what they see under "keep"."""
    seen = []
    op = attention.decode_attention

    def spy(q, k, v, visible, length, scale=None, prefix_visible=None, **kwargs):
        seen.append((visible.sum(1), None if prefix_visible is None else prefix_visible.sum(1)))
        return op(q, k, v, visible, length, scale, prefix_visible=prefix_visible, **kwargs)

    monkeypatch.setattr(attention, "decode_attention", spy)
    model = tiny_model("qwen2", seed=2)
    layers = model.config.num_hidden_layers
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    options = dict(attention="triton", shared_prefix=shared)
    want = run(model, params, "keep", stop_ids("e"), **options)
    keep, seen[:] = list(seen), []
    got = run(model, params, "skip", stop_ids("e"), **options)
    assert_identical(got, want, "skip")
    assert len(seen) == len(keep)

    lengths = want.completion_mask.sum(1)
    stopped = torch.tensor([reason == "stop" for reason in want.finish_reasons])
    # the stop token is column L - 1; the sync after `steps` columns comes at a multiple of CHECK_EVERY; the decode
    # call of step s (writing column s) runs after the syncs of s columns and fewer
    hidden_from = torch.where(stopped, -(-lengths // CHECK_EVERY) * CHECK_EVERY, 10**9)
    group_hidden_from = hidden_from.view(-1, G).amax(1)
    hid = 0
    for call, ((rows, prefix), (rows_keep, prefix_keep)) in enumerate(zip(seen, keep)):
        s = call // layers + 1
        hidden = s >= hidden_from
        assert torch.equal(rows[~hidden], rows_keep[~hidden]), call
        assert torch.all(rows[hidden] == 1), call
        hid += int(hidden.sum())
        if shared:
            group_hidden = s >= group_hidden_from
            assert torch.equal(prefix[~group_hidden], prefix_keep[~group_hidden]), call
            assert torch.all(prefix[group_hidden] == 0), call
            hid += int(group_hidden.sum())
    assert hid > 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_row_selection_keeps_a_slot_major_layout(dtype):
    """Compaction's row gather keeps an fp8 cache's slot-major V slot-major (a row-major copy would still decode,
    at the slower loads) with the same values; row-major buffers stay row-major."""
    from fastgrpo.rollout.compaction import _select_rows

    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 2, 5, 40, generator=g).to(dtype)  # [N, H, D, M] in memory
    slot_major = values.transpose(2, 3)
    idx = torch.tensor([4, 1, 3])
    got = _select_rows(slot_major, idx)
    assert got.shape == (3, 2, 40, 5) and got.stride(2) == 1
    assert torch.equal(got.view(torch.uint8 if dtype == torch.float8_e4m3fn else dtype).float(),
                       slot_major[idx].view(torch.uint8 if dtype == torch.float8_e4m3fn else dtype).float())
    assert _select_rows(values, idx).is_contiguous()


def test_compacted_step_traces_once_for_every_batch_size(monkeypatch, buckets):
    """The batch dimension is marked dynamic from the first step: torch.compile traces the step once for the 32, 16
    and 8 rows (each batch size would otherwise compile anew on a GPU). A shared prefix traces twice: rows grouped
    by prompt, then rows with their own prompt copy. Backend "eager", fullgraph: the trace is the point."""
    step = torch.compile(decode._forward_sample, backend="eager", fullgraph=True, dynamic=False)
    monkeypatch.setattr(decode, "_compiled", {decode._forward_sample: step}.__getitem__)
    model = tiny_model("qwen2", seed=2)
    params = SamplingParams(max_new_tokens=48, temperature=1.0, repetition_penalty=1.2)
    for options, graphs in (({}, 1), (dict(attention="triton"), 1),
                            (dict(attention="triton", shared_prefix=True), 2),
                            (dict(attention="triton", kv_cache="fp8"), 1)):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        buckets.clear()
        got = run(model, params, "compact", stop_ids("e"), compile=True, compile_scope="step", **options)
        assert len(buckets) >= 2, (options, buckets)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, options
        assert_identical(got, run(model, params, "keep", stop_ids("e"), **options), f"compiled {options}")
    torch._dynamo.reset()


@pytest.mark.parametrize("kwargs, match", [
    (dict(finished_rows="drop"), "finished_rows"),
    (dict(attention="sdpa", finished_rows="skip"), "needs attention='triton'"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(attention="triton"), dict(attention="triton", shared_prefix=True),
                                     dict(attention="triton", kv_cache="fp8", shared_prefix=True)],
                         ids=["sdpa", "triton", "shared", "fp8-shared"])
def test_gpu_compacted_graphed_rollout_gives_keep_tokens(options, buckets):
    """Compiled with Inductor, each batch size replayed as its own CUDA graph: no fallback warning, one trace for all
    batch sizes (at most two with a shared prefix: one per layout), and the plain rollout's tokens (fp32: cuBLAS may
    pick other kernels for other batch sizes, so log-probs within 1e-4, as tests/test_rollout_gpu.py allows compiled
    vs eager)."""
    torch._dynamo.reset()
    model = tiny_model("qwen2", seed=2).cuda()
    params = SamplingParams(max_new_tokens=96, temperature=1.0, top_k=20)
    want = run(model, params, "keep", stop_ids("e"), compile_scope="step", **options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(model, params, "compact", stop_ids("e"), compile_scope="step", **options)
    assert not [str(w.message) for w in caught if str(w.message).startswith("rollout:")]
    assert len(buckets) >= 2, buckets
    assert completions(got) == completions(want)
    assert got.finish_reasons == want.finish_reasons
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
    # At most one trace per layout, none per batch size (3 or more here). Inductor traced the shared-prefix step once
    # for both layouts on an H100 (the CPU test's eager backend traces twice).
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= (2 if options.get("shared_prefix") else 1), graphs
    torch._dynamo.reset()
