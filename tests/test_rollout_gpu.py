"""The rollout's CUDA path (compiled decode step replayed as a CUDA graph) against its eager path and HF generate.

    python -m pytest tests/test_rollout_gpu.py -q -m gpu
"""
import warnings

import pytest
import torch
from test_rollout import EOS, PAD, PROMPTS, char_tokenizer, completions, hf_greedy, tiny_model
from transformers import AutoModelForCausalLM, Qwen2Config

from fastgrpo.rollout import generate
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams

pytestmark = pytest.mark.gpu
EAGER = EngineConfig(compile=False)


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Each test builds new models; without a reset they would pile up past dynamo's recompile limit (8), after
    which it silently runs the step eagerly."""
    torch._dynamo.reset()
    yield


def cuda_model(arch: str, lora: bool = False):
    # fp32 (TF32 is off by default): the compiled and eager paths then agree token for token with HF
    return tiny_model(arch, lora=lora).cuda()


def no_fallback_warnings(fn):
    """Run fn and fail if the engine fell back from compile or from the CUDA graph."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in caught if str(w.message).startswith("rollout:")], [str(w.message) for w in caught]
    return out


@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("llama", True), ("gemma2", False)])
def test_graphed_greedy_equals_eager_and_hf(arch, lora):
    tok, model = char_tokenizer(), cuda_model(arch, lora)
    params = SamplingParams(max_new_tokens=40, temperature=0)
    graphed = no_fallback_warnings(lambda: generate_with_config(model, tok, PROMPTS, 2, params))
    eager = generate_with_config(model, tok, PROMPTS, 2, params, config=EAGER)
    assert completions(graphed) == completions(eager)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, atol=1e-4, rtol=0)
    for i, prompt in enumerate(PROMPTS):
        assert completions(graphed)[2 * i] == hf_greedy(model, tok, prompt, 40)[0]


def test_bf16_lora_model_runs_compiled_and_graphed():
    tok = char_tokenizer()
    model = tiny_model("qwen2", lora=True).to("cuda", torch.bfloat16)
    result = no_fallback_warnings(lambda: generate(model, tok, PROMPTS, num_generations=4, max_new_tokens=40,
                                                   temperature=1.0, top_p=0.9, seed=0))
    assert result.completion_ids.shape[0] == 12 and result.logprobs.dtype == torch.float32
    assert torch.all(torch.isfinite(result.logprobs)) and torch.all(result.logprobs <= 0)


def test_graphed_sampling_equals_eager_with_the_same_seed():
    tok, model = char_tokenizer(), cuda_model("qwen2")
    params = SamplingParams(max_new_tokens=40, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01,
                            repetition_penalty=1.1)
    graphed = no_fallback_warnings(lambda: generate_with_config(model, tok, PROMPTS, 4, params, seed=5))
    again = generate_with_config(model, tok, PROMPTS, 4, params, seed=5)
    eager = generate_with_config(model, tok, PROMPTS, 4, params, seed=5, config=EAGER)
    assert torch.equal(graphed.completion_ids, again.completion_ids)
    assert completions(graphed) == completions(eager)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, atol=1e-4, rtol=0)


def test_stop_strings_and_early_exit_under_graphs():
    tok, model = char_tokenizer(), cuda_model("llama")
    free = generate(model, tok, PROMPTS, max_new_tokens=64, temperature=0)
    stop = free.texts[0][20:22]
    cut = no_fallback_warnings(lambda: generate(model, tok, PROMPTS, max_new_tokens=64, temperature=0, stop=stop))
    for row, text in enumerate(cut.texts):
        assert text == tok.decode(completions(cut)[row], skip_special_tokens=True)
        assert completions(cut)[row] == completions(free)[row][: len(completions(cut)[row])]
    assert cut.finish_reasons[0] == "stop"


def test_many_stop_ids_keep_the_graph():
    """One stop id that a row samples and every id that none does (more than torch.isin's brute-force bound, past
    which it sorts them through torch.unique: a host sync inside the captured step). The step stays graphed and
    the rows end where the eager engine's do."""
    tok, model = char_tokenizer(), cuda_model("qwen2")
    params = SamplingParams(max_new_tokens=40, temperature=0)
    free = generate_with_config(model, tok, PROMPTS, 4, params, config=EAGER)
    sampled = {t for row in completions(free) for t in row}
    stop = [completions(free)[1][30], *(i for i in range(model.config.vocab_size) if i not in sampled)]
    assert len(stop) > 10 * len(completions(free)) ** 0.145
    graphed = no_fallback_warnings(lambda: generate_with_config(model, tok, PROMPTS, 4, params, stop=stop))
    eager = generate_with_config(model, tok, PROMPTS, 4, params, stop=stop, config=EAGER)
    assert completions(graphed) == completions(eager) and "stop" in graphed.finish_reasons


def test_in_place_weight_update_is_seen_by_the_next_graphed_call():
    tok, model = char_tokenizer(), cuda_model("qwen2")
    before = generate(model, tok, PROMPTS, max_new_tokens=24, temperature=0)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.mul_(-3.0)
    after = generate(model, tok, PROMPTS, max_new_tokens=24, temperature=0)
    assert completions(after) != completions(before)
    for i, prompt in enumerate(PROMPTS):
        assert completions(after)[i] == hf_greedy(model, tok, prompt, 24)[0]


def test_kv_memory_is_released_after_the_rollout():
    """A cache of ~600 MiB (4 layers x K/V x 64 rows x 1152 slots x 4 heads x 64 x fp32) is gone after the call."""
    tok = char_tokenizer()
    tok.eos_token = None  # nothing stops a row: every row is 1024 tokens long
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=44, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=2048, eos_token_id=EOS, pad_token_id=PAD,
    )
    model = AutoModelForCausalLM.from_config(config).cuda().eval()
    model.generation_config.eos_token_id = None
    prompts = ["the quick brown fox jumps over the lazy dog"] * 8
    generate(model, tok, prompts, num_generations=8, max_new_tokens=1024, seed=0)  # compile, warm the allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = generate(model, tok, prompts, num_generations=8, max_new_tokens=1024, seed=1)
    torch.cuda.synchronize()
    kv_bytes = 4 * 2 * 64 * 1152 * 4 * 64 * 4
    assert torch.cuda.max_memory_allocated() - before >= kv_bytes  # the cache did exist
    assert torch.cuda.memory_allocated() - before <= 64 * 2**20
    assert result.completion_ids.shape == (64, 1024)
