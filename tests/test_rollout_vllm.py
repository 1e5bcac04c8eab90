"""The vLLM engine's logic that runs without vLLM: request translation, output conversion, where each trainer
weight lives in vLLM's fused layout and the binding that stores it once, the LoRA merge and adapter tensors, the
config checks and the one-line error without vLLM. The engine itself runs in tests/test_vllm_gpu.py."""
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

from fastgrpo.rollout.requests import stop_token_ids
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.vllm import VLLMEngine, default_kv_cache_bytes
from fastgrpo.rollout.vllm_lora import adapter_tensors, merged_sources, vllm_rank
from fastgrpo.rollout.vllm_requests import check_prompt_keys, fan_out, request_seeds, sampling_kwargs, to_result
from fastgrpo.rollout.vllm_weights import bind, expected_rows, hf_name
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.default_task import build_tokenizer

V, H, HEADS, KV, HEAD_DIM, INTER = 41, 32, 4, 2, 8, 48


def trained_away(model):
    """model with each trainable parameter moved off its initial value (seed 1, unit normal steps): trained rows or
    copies equal to the originals would hide which of the two vLLM runs."""
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param))
    return model


def tiny(tied: bool = True, lora: bool = False):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))
    return model


class Weights(nn.Module):
    """A layer of vLLM's model: frozen random parameters, as vLLM's dummy loader leaves them."""

    def __init__(self, rows: int, cols: int | None, bias: bool = False, **attrs):
        super().__init__()
        shape = (rows, cols) if cols else (rows,)
        self.weight = nn.Parameter(torch.randn(shape), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.randn(rows), requires_grad=False)
        for k, v in attrs.items():
            setattr(self, k, v)


def wrapped(layer: nn.Module, lora: bool) -> nn.Module:
    """vLLM with LoRA enabled puts each wrapped layer's parameters under .base_layer."""
    if not lora:
        return layer
    outer = nn.Module()
    outer.base_layer = layer
    return outer


def vllm_like(tied: bool = True, lora: bool = False) -> nn.Module:
    """vLLM's Qwen2 parameter layout: fused qkv_proj (with bias) and gate_up_proj, vocabulary padded to 64."""
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    root, inner = nn.Module(), nn.Module()
    inner.embed_tokens = wrapped(Weights(64, H, org_vocab_size=V), lora)
    inner.norm = Weights(H, None)
    inner.layers = nn.ModuleList()
    for _ in range(2):
        layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
        attn.qkv_proj = wrapped(Weights(q + 2 * kv, H, bias=True, output_sizes=[q, kv, kv]), lora)
        attn.o_proj = wrapped(Weights(H, q), lora)
        mlp.gate_up_proj = wrapped(Weights(2 * INTER, H, output_sizes=[INTER, INTER]), lora)
        mlp.down_proj = wrapped(Weights(H, INTER), lora)
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm, layer.post_attention_layernorm = Weights(H, None), Weights(H, None)
        inner.layers.append(layer)
    root.model = inner
    if not tied:
        root.lm_head = Weights(64, H, org_vocab_size=V)
    return root


def assert_runs(fake, plain, tied: bool = False):
    """Every weight of the stand-in vLLM model `fake` is the plain model's (PEFT's merge_and_unload of the trained
    one), bound from it the same way into another stand-in. The embedding and lm_head rows are equal bit for bit (a
    modules_to_save copy or trained token rows are put in place, not computed); merged LoRA rows are W + B A * s in
    fp32 both ways, summed in other orders: a few ulps of the largest value apart."""
    want = vllm_like(tied=tied)
    bind(plain, want, share=False)
    wanted = dict(want.named_parameters())
    for name, param in fake.named_parameters():
        rows = expected_rows(name, param, fake.get_submodule)
        got, ref = param[:rows], wanted[name][:rows]
        if "embed_tokens" in name or "lm_head" in name:
            assert torch.equal(got, ref), f"{name}: rows {(got != ref).any(1).nonzero().flatten().tolist()} differ"
            continue
        bound = 4 * torch.finfo(ref.dtype).eps * ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= bound, f"{name}: {err:.3g} from the trained model's value (bound {bound:.3g})"


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 12)[None]).logits


@pytest.mark.parametrize("tied", [True, False])
def test_bind_makes_every_weight_a_view_of_vllm_rows(tied):
    model, fake = tiny(tied), vllm_like(tied)
    want = logits(model)
    assert bind(model, fake) == []
    torch.testing.assert_close(logits(model), want, rtol=0, atol=0)  # same values, now in vLLM's storage
    attn, hf_attn = fake.model.layers[1].self_attn, model.model.layers[1].self_attn
    qkv = attn.qkv_proj.weight
    assert hf_attn.k_proj.weight.data_ptr() == qkv[HEADS * HEAD_DIM:].data_ptr()
    assert hf_attn.v_proj.bias.data_ptr() == attn.qkv_proj.bias[(HEADS + KV) * HEAD_DIM:].data_ptr()
    up = model.model.layers[0].mlp.up_proj.weight
    assert up.data_ptr() == fake.model.layers[0].mlp.gate_up_proj.weight[INTER:].data_ptr() and up.requires_grad
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():  # an optimizer step on the trainer's parameter is a step on vLLM's rows
        hf_attn.v_proj.weight.add_(1.0)
    torch.testing.assert_close(qkv[(HEADS + KV) * HEAD_DIM:], hf_attn.v_proj.weight.detach())


def test_bind_without_sharing_returns_copies_that_refresh():
    model, fake = tiny(), vllm_like()
    copies = bind(model, fake, share=False)
    assert len(copies) == len(list(model.parameters()))
    gate = model.model.layers[0].mlp.gate_proj.weight
    fused = fake.model.layers[0].mlp.gate_up_proj.weight
    torch.testing.assert_close(fused[:INTER], gate.detach())
    assert gate.data_ptr() != fused.data_ptr()
    with torch.no_grad():
        gate.mul_(2.0)
    assert not torch.equal(fused[:INTER], gate.detach())  # a skipped sync leaves vLLM's copy behind
    for c in copies:
        c.refresh()
    torch.testing.assert_close(fused[:INTER], gate.detach())


def test_bind_lora_adapter_mode_shares_the_base_under_base_layer():
    model, fake = tiny(lora=True), vllm_like(lora=True)
    assert bind(model, fake) == []
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert base.data_ptr() == fake.model.layers[0].self_attn.qkv_proj.base_layer.weight.data_ptr()
    assert not base.requires_grad


def test_bind_lora_merge_mode_copies_merged_weights():
    model, fake = tiny(lora=True), vllm_like()
    merged = merged_sources(model)
    assert len(merged) == 6  # q, v, down in 2 layers
    bases = {n: p.detach().clone() for n, p in model.named_parameters() if n in merged}
    copies = bind(model, fake, merged=merged)
    assert {c.hf_name for c in copies} == {hf_name(n) for n in merged}
    assert all(torch.equal(p, bases[n]) for n, p in model.named_parameters() if n in merged)  # base untouched
    reference = model.merge_and_unload()  # PEFT's own merge, for comparison
    q = fake.model.layers[1].self_attn.qkv_proj.weight[: HEADS * HEAD_DIM]
    torch.testing.assert_close(q, reference.model.layers[1].self_attn.q_proj.weight.detach(), rtol=0, atol=1e-6)


def test_bind_refuses_a_layout_it_cannot_place_and_weights_left_random():
    model, fake = tiny(), vllm_like()
    fake.model.layers[0].self_attn.qkv_proj.output_sizes = [HEADS * HEAD_DIM]  # no k/v rows
    with pytest.raises(ValueError, match="no weight for model.layers.0.self_attn.k_proj.weight"):
        bind(model, fake)
    model, fake = tiny(), vllm_like()
    fake.model.extra = Weights(4, H)
    with pytest.raises(ValueError, match="model.extra.weight"):
        bind(model, fake)


def test_adapter_tensors_are_clones_with_peft_names():
    model = tiny(lora=True)
    tensors = adapter_tensors(model)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert name in tensors and len(tensors) == 12
    tensors[name].mul_(2.0)  # vLLM scales lora_B in place when it loads the adapter
    assert not torch.equal(tensors[name], model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
    assert [vllm_rank(r) for r in (1, 4, 16, 17)] == [1, 8, 16, 32]
    with pytest.raises(ValueError, match="lora_rank"):
        vllm_rank(1024)


def test_sampling_kwargs_carry_every_option():
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, repetition_penalty=1.2)
    assert sampling_kwargs(4, params, ["###"], [5], 11) == dict(
        n=4, max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1, repetition_penalty=1.2, stop=["###"],
        stop_token_ids=[5], seed=11, logprobs=0, flat_logprobs=True, include_stop_str_in_output=True,
        detokenize=True, ignore_eos=True, skip_special_tokens=True,
    )
    assert sampling_kwargs(2, params, [], [], None)["detokenize"] is False  # no stop strings: decode once at the end


def test_vllm_stops_at_the_ids_of_the_call_alone():
    """vLLM added to each request the EOS ids of the tokenizer and generation_config.json it read when it was built:
    a generation config changed since (an EOS id dropped, as for a chat model trained to end its turns with
    <|im_end|> alone) still stopped vLLM's rows where the built-in engine's ran on. Each request now carries every
    id a row stops at, computed at the call as the built-in engine computes them, and vLLM's own are off."""
    tok = build_tokenizer()
    eos, im_end, chat_eos = tok.eos_token_id, 7, 9
    config = GenerationConfig(eos_token_id=[im_end, eos])
    assert stop_token_ids([5, im_end], tok, config) == [5, im_end, eos]
    config.eos_token_id = chat_eos  # changed after the engine was built
    ids = stop_token_ids([], tok, config)
    assert ids == [eos, chat_eos]
    kwargs = sampling_kwargs(1, SamplingParams(temperature=0), [], ids, None)
    assert kwargs["stop_token_ids"] == ids and kwargs["ignore_eos"] is True
    assert stop_token_ids([5], tok, None) == [5, eos]  # a model without a generation config
    tok.eos_token = None
    assert stop_token_ids([], tok, GenerationConfig(eos_token_id=[eos, im_end])) == [eos, im_end]
    assert stop_token_ids([], tok, None) == []


def test_greedy_requests_fan_out_one_sample_each():
    """vLLM refuses n > 1 with greedy sampling: each prompt goes out num_generations times, grouped by prompt."""
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    assert fan_out([[1], [2, 3]], 3, greedy) == ([[1], [1], [1], [2, 3], [2, 3], [2, 3]], 1)
    assert fan_out([[1], [2, 3]], 3, sampled) == ([[1], [2, 3]], 3)
    assert fan_out([[1]], 1, greedy) == ([[1]], 1)


def test_request_seeds_depend_on_seed_and_key_alone():
    seeds = request_seeds(7, [0, 1, 2, 5], num_generations=8)
    assert len(set(seeds)) == 4 and all(0 <= s < 2**62 - 8 for s in seeds)
    assert request_seeds(7, [5, 2], 8) == [seeds[3], seeds[2]]  # a prompt's seed ignores the other prompts
    assert request_seeds(8, [0], 8) != seeds[:1] and request_seeds(None, [0, 1], 8) == [None, None]
    assert check_prompt_keys(None, 3) == [0, 1, 2]
    for keys, match in (([1, 2], "one key per prompt"), ([1, "a", 2], "list of ints"), ((1, True, 2), "list")):
        with pytest.raises(ValueError, match=match):
            check_prompt_keys(keys, 3)


def flat(ids, logps):
    """vLLM's FlatLogprobs for logprobs=0: one entry per position, the sampled token's."""
    return SimpleNamespace(start_indices=list(range(len(ids))), token_ids=list(ids), logprobs=list(logps))


def test_to_result_groups_pads_masks_and_decodes():
    tok = build_tokenizer()
    a, b, c = (tok.convert_tokens_to_ids(ch) for ch in "abc")
    eos = tok.eos_token_id
    completion = lambda ids, lps, reason: SimpleNamespace(token_ids=ids, logprobs=flat(ids, lps), finish_reason=reason)
    outputs = [
        SimpleNamespace(prompt_token_ids=[a, b, c], outputs=[
            completion([a, b], [-0.5, -1.0], "length"), completion([c, eos], [-2.0, -0.1], "stop")]),
        SimpleNamespace(prompt_token_ids=[c], outputs=[
            completion([a, a, a], [-0.1, -0.2, -0.3], "stop"), completion([b], [-0.4], "abort")]),
    ]
    r = to_result(outputs, tok, pad_id=0, num_generations=2)
    assert r.prompt_ids.tolist() == [[a, b, c], [a, b, c], [0, 0, c], [0, 0, c]]
    assert r.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert r.completion_ids.tolist() == [[a, b, 0], [c, eos, 0], [a, a, a], [b, 0, 0]]
    assert r.completion_mask.tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert torch.equal(r.logprobs, torch.tensor([[-0.5, -1.0, 0], [-2.0, -0.1, 0], [-0.1, -0.2, -0.3], [-0.4, 0, 0]]))
    assert r.texts == ["ab", "c", "aaa", "b"] and r.finish_reasons == ["length", "stop", "stop", "length"]
    with pytest.raises(ValueError, match="outputs"):
        to_result(outputs, tok, pad_id=0, num_generations=3)
    # greedy fan-out: one completion per request, num_generations consecutive requests per prompt
    single = [SimpleNamespace(prompt_token_ids=out.prompt_token_ids, outputs=[c]) for out in outputs
              for c in out.outputs]
    fanned = to_result(single, tok, pad_id=0, num_generations=2, per_request=1)
    assert torch.equal(fanned.completion_ids, r.completion_ids) and fanned.num_generations == 2
    with pytest.raises(ValueError, match="outputs"):
        to_result(single[:3], tok, pad_id=0, num_generations=2, per_request=1)
    wrong = SimpleNamespace(prompt_token_ids=[a], outputs=[SimpleNamespace(
        token_ids=[a], logprobs=flat([b], [-1.0]), finish_reason="stop")])
    with pytest.raises(ValueError, match="sampled tokens"):
        to_result([wrong], tok, pad_id=0, num_generations=1)


def test_without_vllm_the_engine_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ValueError, match=r'pip install "fastgrpo\[vllm\]" \(vllm==0.24.0\)') as err:
        VLLMEngine(tiny(), build_tokenizer(), max_model_len=32)
    assert "\n" not in str(err.value)


def test_trainer_builds_the_engine_from_the_config(monkeypatch):
    from fastgrpo.train import default_task
    from fastgrpo.train.trainer import GRPOTrainer

    monkeypatch.setitem(sys.modules, "vllm", None)
    tok = default_task.build_tokenizer()
    config = GRPOConfig(rollout_engine="vllm", device="cuda", batch_size=4, num_generations=2, max_steps=1,
                        micro_batch_size=4, max_prompt_length=16, max_completion_length=8)
    with pytest.raises(ValueError, match=r"rollout_engine 'vllm' needs vLLM: pip install"):
        GRPOTrainer(default_task.build_model(tok), tok, default_task.repeat_letter_reward,
                    default_task.build_dataset(8), config)


def test_config_checks_the_rollout_engine():
    assert GRPOConfig().rollout_engine == "builtin"
    GRPOConfig(rollout_engine="vllm", vllm_gpu_memory_utilization=0.5, vllm_lora_sync="merge")
    for fields, match in [
        (dict(rollout_engine="vlm"), "rollout_engine"),
        (dict(rollout_engine="vllm", model="/m", load_in_4bit=True, lora_rank=8), "vllm cannot share a 4-bit"),
        (dict(rollout_engine="vllm", device="cpu"), "device='cuda'"),
        (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization"),
        (dict(vllm_lora_sync="both"), "vllm_lora_sync"),
        (dict(vllm_execution="fast"), "vllm_execution"),
        (dict(rollout_engine="vllm", rollout_weights="fp8"), "rollout_weights: applies to the builtin engine"),
        (dict(rollout_engine="vllm", rollout_attention="sdpa"), "rollout_attention: applies to the builtin engine"),
        (dict(rollout_attention="flash"), "rollout_attention"),
        (dict(rollout_weights="int4"), "rollout_weights"),
        (dict(rollout_kv_cache="int8"), "rollout_kv_cache"),
        (dict(rollout_kv_cache="fp8", rollout_attention="sdpa"), "rollout_kv_cache: fp8 is read by the decode"),
        (dict(rollout_engine="vllm", rollout_kv_cache="fp8"), "rollout_kv_cache: applies to the builtin engine"),
    ]:
        with pytest.raises(ValueError, match=match):
            GRPOConfig(**fields)


def test_default_kv_cache_is_one_batch():
    config = SimpleNamespace(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=28)
    # 28 layers x (K, V) x 2 heads x 128 x 2 bytes = 28 KiB per token; 64 rows x (64 + 1) blocks of 16 tokens
    assert default_kv_cache_bytes(config, torch.bfloat16, 64, 1024) == 64 * 65 * 16 * 28672 + (64 << 20)
