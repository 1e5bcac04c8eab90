"""Tests killing the vLLM adapter mutants the CPU suite let through. vLLM is not installed here: its outputs are
SimpleNamespace stand-ins with the attribute names of vLLM 0.24's RequestOutput / CompletionOutput / Logprob, its
worker LoRA manager one with `_load_adapter`, and `import vllm` inside VLLMEngine.generate a stand-in module whose
SamplingParams and LLM.generate record what they get. The engine itself runs in tests/test_vllm_gpu.py."""
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_rollout_vllm import HEAD_DIM, HEADS, V, flat, tiny, vllm_like

from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.vllm import VLLMEngine, check_model, execution_kwargs, write_model_dir
from fastgrpo.rollout.vllm_lora import InMemoryAdapters, adapter_config, merged_sources, vllm_rank
from fastgrpo.rollout.vllm_requests import sampling_kwargs, to_result
from fastgrpo.rollout.vllm_weights import _covered_rows, bind
from fastgrpo.train.default_task import build_tokenizer


def test_temperature_zero_reaches_vllm_as_zero():
    """vLLM is greedy at temperature 0 only; any other value samples (the built-in engine's greedy rows would not
    match vLLM's)."""
    assert sampling_kwargs(1, SamplingParams(temperature=0), [], [], None)["temperature"] == 0


def test_per_position_logprobs_are_those_of_the_sampled_tokens():
    """vLLM's non-flat form: one {token id: Logprob} dict per position, holding the sampled token and the top ones."""
    tok = build_tokenizer()
    a, b = (tok.convert_tokens_to_ids(ch) for ch in "ab")
    steps = [{a: SimpleNamespace(logprob=-3.0), b: SimpleNamespace(logprob=-0.1)},
             {b: SimpleNamespace(logprob=-2.5), a: SimpleNamespace(logprob=-0.2)}]
    out = SimpleNamespace(prompt_token_ids=[a], outputs=[
        SimpleNamespace(token_ids=[a, b], logprobs=steps, finish_reason="length")])
    r = to_result([out], tok, pad_id=0, num_generations=1)
    assert r.logprobs.tolist() == [[-3.0, -2.5]]  # not the top tokens' -0.1, -0.2


def test_a_non_vocabulary_weight_with_other_rows_is_refused_by_name():
    model, fake = tiny(), vllm_like()
    fake.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(torch.randn(40, HEADS * HEAD_DIM))
    with pytest.raises(ValueError, match=r"no weight for model\.layers\.0\.self_attn\.o_proj\.weight \[32, 32\]"):
        bind(model, fake)


def test_overlapping_row_ranges_do_not_count_as_covered():
    assert _covered_rows([(0, 4), (4, 6)]) == 6
    assert _covered_rows([(0, 4), (2, 6)]) == -1 and _covered_rows([(0, 2), (3, 6)]) == -1


def test_a_trainer_weight_in_another_dtype_is_copied_not_aliased():
    """fp32 trainer weights over a vLLM model in another dtype: the trainer keeps its dtype, vLLM gets copies."""
    model, fake = tiny(), vllm_like().double()
    copies = bind(model, fake)
    assert len(copies) == len(list(model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    q = model.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(fake.model.layers[0].self_attn.qkv_proj.weight[: HEADS * HEAD_DIM], q.double())


def test_a_lora_on_the_embedding_is_merged_into_vllms_embedding():
    model = get_peft_model(tiny(tied=False), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"],
                                                  init_lora_weights=False))
    merged = merged_sources(model)
    embed = "base_model.model.model.embed_tokens.base_layer.weight"
    assert embed in merged
    fake = vllm_like(tied=False)
    copies = bind(model, fake, merged=merged)
    assert "model.embed_tokens.weight" in {c.hf_name for c in copies}
    layer = model.base_model.model.model.embed_tokens
    want = layer.base_layer.weight + layer.get_delta_weight("default")
    torch.testing.assert_close(fake.model.embed_tokens.weight[:V], want.detach(), rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_merge_sync_refuses_a_lora_on_a_tied_embedding(target):
    """vLLM's tied lm_head IS its embedding: W + B A written there changed both, while the trainer's tied partner
    stays W (0.7 apart in these logits). Refused before vLLM builds."""
    model = get_peft_model(tiny(tied=True), LoraConfig(r=4, lora_alpha=8, target_modules=[target],
                                                       init_lora_weights=False))
    with pytest.raises(ValueError, match=rf"^model: {'model.embed_tokens' if target == 'embed_tokens' else 'lm_head'}: "
                       r"vLLM ties the embedding and lm_head, so the merged weight sync would put the LoRA on both"):
        merged_sources(model)


def _peft(**options):
    return get_peft_model(tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **options))


def test_adapter_config_carries_alpha_and_rslora():
    assert adapter_config(_peft(use_rslora=True)) == {
        "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_rslora": True}


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize("option, named", [
    ({"use_dora": True}, "use_dora"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias"), ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
])
def test_adapter_sync_refuses_what_vllms_lora_does_not_run(option, named):
    with pytest.raises(ValueError, match=f"vLLM's LoRA does not run adapters with .*{named}.*use lora_sync='merge'"):
        adapter_config(_peft(**option))


def test_vllm_rank_is_the_smallest_allowed_that_holds_r():
    assert [vllm_rank(r) for r in (200, 257, 300, 321)] == [256, 320, 320, 512]


def test_in_memory_adapters_hand_other_paths_to_vllm_and_take_only_mem_paths():
    seen = []
    manager = SimpleNamespace(_load_adapter=lambda request: seen.append(request.lora_path) or "stock")
    adapters = InMemoryAdapters(manager)
    assert manager._load_adapter(SimpleNamespace(lora_path="/disk/adapter")) == "stock"
    assert seen == ["/disk/adapter"]
    with pytest.raises(ValueError, match=r"path: expected mem://"):
        adapters.put("/disk/adapter", {}, {})


@pytest.mark.parametrize("flag", ["is_loaded_in_4bit", "is_loaded_in_8bit"])
def test_a_bitsandbytes_base_is_refused(flag):
    model = tiny()
    setattr(model, flag, True)
    with pytest.raises(ValueError, match=r"^model: vLLM cannot share a bitsandbytes-quantized base; use a bf16 base, "
                                         r"or the built-in engine \(GRPOConfig\(rollout_engine='builtin'\), "
                                         r"--rollout-engine builtin, or fastgrpo\.rollout\.BuiltinEngine in place "
                                         r"of VLLMEngine\), which generates with the 4-bit model$"):
        check_model(model)


def test_model_dir_names_the_base_architecture_without_quantization(tmp_path):
    model = _peft()
    model.get_base_model().config.quantization_config = {"load_in_4bit": True}
    write_model_dir(str(tmp_path), model, build_tokenizer())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and "quantization_config" not in config


def test_execution_modes_without_graphs_need_no_vllm():
    assert execution_kwargs("eager", 8) == {"enforce_eager": True} and execution_kwargs("compile", 8) == {}


class _LLM:
    """vllm.LLM's generate: records its arguments and answers each request with n completions of one token."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm, lora_request):
        self.calls.append(dict(prompts=prompts, params=params, lora_request=lora_request))
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[
            SimpleNamespace(token_ids=[5], logprobs=flat([5], [-1.0]), finish_reason="length")] * s["n"])
            for p, s in zip(prompts, params)]


@pytest.fixture
def engine(monkeypatch):
    """A VLLMEngine as __init__ leaves it, without vLLM: the stand-in LLM, no LoRA adapter, KV cache mapped."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=dict))
    model = tiny()
    model.generation_config.eos_token_id = [1, 7]
    e = object.__new__(VLLMEngine)
    e.model, e.tokenizer, e.vocab, e.device, e.max_model_len = model, build_tokenizer(), 200, "cpu", 12
    e.llm, e._adapters, e._released, e.release = _LLM(), None, False, True
    return e


def test_generate_stops_at_every_eos_of_the_tokenizer_and_generation_config(engine):
    engine.generate(["ab"], num_generations=2, sampling=SamplingParams(max_new_tokens=4), stop=["xy", 9])
    (params,) = engine.llm.calls[0]["params"]
    assert params["stop"] == ["xy"] and params["stop_token_ids"] == [9, engine.tokenizer.eos_token_id, 7]


def test_generate_sends_the_stop_ids_of_the_call_with_vllms_own_eos_off(engine):
    """vLLM also stops at the EOS ids it read when it was built (the tokenizer's, generation_config.json's) unless
    ignore_eos: an id dropped from the generation config since still stopped its rows. The request carries every
    stop id of the call, a special token's text as its id, and looks for stop strings with special tokens skipped."""
    engine.model.generation_config.eos_token_id = [1, 9]  # 7 dropped after the build
    engine.generate(["ab"], num_generations=1, sampling=SamplingParams(max_new_tokens=4), stop=["<pad>", "xy"])
    (params,) = engine.llm.calls[0]["params"]
    assert params["stop"] == ["xy"] and params["stop_token_ids"] == [0, 1, 9]
    assert params["ignore_eos"] is True and params["skip_special_tokens"] is True


def test_generate_fills_max_model_len_exactly_and_refuses_one_more(engine):
    engine.generate(["abcd"], num_generations=1, sampling=SamplingParams(max_new_tokens=8))  # 4 + 8 == 12
    with pytest.raises(ValueError, match=r"prompts\[1\]: 5 tokens \+ max_new_tokens 8 exceeds .* max_model_len 12"):
        engine.generate(["ab", "abcde"], num_generations=1, sampling=SamplingParams(max_new_tokens=8))


def test_greedy_generate_sends_each_prompt_g_times_and_groups_the_rows(engine):
    r = engine.generate(["a", "bc"], num_generations=3, sampling=SamplingParams(temperature=0, max_new_tokens=2),
                        seed=5)
    call = engine.llm.calls[0]
    assert [len(p["prompt_token_ids"]) for p in call["prompts"]] == [1, 1, 1, 2, 2, 2]
    assert all(p["n"] == 1 for p in call["params"]) and call["lora_request"] is None
    assert r.completion_ids.shape == (6, 1) and r.prompt_mask.sum(1).tolist() == [1, 1, 1, 2, 2, 2]


def test_generate_sends_the_adapter_request_when_the_adapter_syncs(engine):
    engine._adapters, engine._lora_request = object(), "the adapter's LoRARequest"
    engine.generate(["a"], num_generations=2, sampling=SamplingParams(max_new_tokens=2))
    assert engine.llm.calls[0]["lora_request"] == "the adapter's LoRARequest"


def test_generate_seeds_each_prompt_from_its_key(engine):
    """The trainer passes each prompt's dataset index: a prompt's samples must not depend on its position."""
    from fastgrpo.rollout.vllm_requests import request_seeds

    engine.generate(["a", "b"], num_generations=2, sampling=SamplingParams(max_new_tokens=2), seed=7,
                    prompt_keys=[5, 2])
    assert [p["seed"] for p in engine.llm.calls[0]["params"]] == request_seeds(7, [5, 2], 2)


def test_to_result_keeps_one_column_when_every_completion_is_empty():
    out = SimpleNamespace(prompt_token_ids=[3], outputs=[
        SimpleNamespace(token_ids=[], logprobs=flat([], []), finish_reason="abort")])
    r = to_result([out], build_tokenizer(), pad_id=0, num_generations=1)
    assert r.completion_ids.tolist() == [[0]] and r.completion_mask.tolist() == [[0]] and r.texts == [""]


class _Sync:
    """The parts of vLLM load_weights / reacquire_memory touch: prefix-cache reset, LoRA reload, KV wake-up."""

    def __init__(self):
        self.events = []
        self.llm_engine = SimpleNamespace(add_lora=lambda request: self.events.append(("add_lora", request)))

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return True

    def wake_up(self, tags):
        self.events.append(("wake_up", tags))


def test_load_weights_refreshes_copies_resends_the_adapter_and_drops_the_prefix_cache(engine):
    model = _peft()
    refreshed = []
    put = []
    engine.model, engine.copies = model, [SimpleNamespace(refresh=lambda: refreshed.append(1))]
    engine.llm = _Sync()
    engine._adapters = SimpleNamespace(put=lambda path, tensors, config: put.append((path, sorted(tensors), config)))
    engine._adapter_config, engine._lora_reload = adapter_config(model), "reload request"
    engine.load_weights(model)
    assert refreshed == [1] and put[0][0] == "mem://fastgrpo/adapter" and len(put[0][1]) == 4
    assert engine.llm.events == [("add_lora", "reload request"), "reset_prefix_cache"]
    with pytest.raises(ValueError, match="model: the vLLM engine shares the weights of the model it was built on"):
        engine.load_weights(tiny())


def test_the_kv_cache_comes_back_without_the_prefix_cache(engine, monkeypatch):
    """The pages come back holding garbage: a prefix hit on them would decode from it."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    engine.llm = engine.worker = _Sync()
    engine._released = True
    engine.reacquire_memory()
    assert engine.llm.events == [("wake_up", ["kv_cache"]), "reset_prefix_cache"] and not engine._released
