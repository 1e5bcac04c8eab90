"""EngineConfig(kv_cache="fp8"): the rollout's KV cache in e4m3 with one fp32 scale per (row, slot, K/V head).

What it changes is bounded here, on the same tokens. Each cached element is off by at most q_i = max(|x_i| 2^-4,
2^-10 scale) (ops/decode_attention.py quantize_kv; tests/test_decode_attention.py checks it), and only decode steps
read the cache: the first token's log-prob comes from the prefill, which attends over its own K/V. To first order a
log-prob then moves by at most sum_i |d logp / d e_i| q_i over every cached element e_i a decode step reads. The
reference computes that sum: an fp64 forward of the prompt and the fp8 rollout's tokens in which every query past
the prompt attends over K/V + E (E: zero leaves, one per layer, K and V; the prefill's queries over K/V alone), and
one gradient per token. The fp8 engine's log-probs must lie within that bound of the reference's (which are the
model's own, E = 0), plus the fp32 engine's own distance from fp64 (FP32_SLACK). The bound is the worst case of
every error lined up with its gradient; rounding errors are not, and the measured distance is 4-6% of it (llama,
qwen2, qwen3 here). Key scales read one slot off land at 5x the bound (test_the_bound_sees_a_wrong_scale).

The kernel runs under TRITON_INTERPRET=1 (conftest) for a few tokens; longer rollouts run the op's plain-torch path,
which takes the same e4m3 cache and scales (the kernel is checked against it in test_decode_attention.py).
"""
import copy
import warnings

import pytest
import torch

from fastgrpo.hf.models import attention_implementation, register_attention
from fastgrpo.ops.decode_attention import FP8, FP8_MAX, quantize_kv
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.kv_cache import LayerCache
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_rollout import PROMPTS, char_tokenizer, gemma2_loaded_off_eager, tiny_model

FP8_CACHE = EngineConfig(attention="triton", kv_cache="fp8")
# The fp32 engine's own distance from the fp64 forward on the same tokens: measured 3.4e-7 with the model-dtype cache
# (llama, qwen2, qwen3, 24 tokens, torch 2.13 CPU); 1e-5 leaves room for cuBLAS's and Inductor's fp32 orders on a GPU.
FP32_SLACK = 1e-5
REFERENCE = "fastgrpo_test_fp8_first_order"


def run(model, config, G=2, new_tokens=6, seed=3, prompts=PROMPTS):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    return generate_with_config(model, char_tokenizer(), prompts, G, params, seed=seed, config=config)


def _quantization_bound(states: torch.Tensor) -> torch.Tensor:
    """states [..., D] -> the largest error quantize_kv may make per element (q_i of the module docstring)."""
    scale = states.abs().amax(-1, keepdim=True) / FP8_MAX
    return torch.maximum(states.abs() * 2.0**-4, scale * 2.0**-10)


def _perturbed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention, one unpadded row: queries at positions >= `decode_from` read key + E_k, value + E_v (the
    cache), the others key, value. Records each layer's (E, bound) pairs on the module's `_fp8_probe`."""
    probe = module._fp8_probe
    T = query.shape[2]
    G = query.shape[1] // key.shape[1]
    e_k = torch.zeros_like(key, requires_grad=True)
    e_v = torch.zeros_like(value, requires_grad=True)
    probe["leaves"] += [e_k, e_v]
    probe["bounds"] += [_quantization_bound(key.detach()), _quantization_bound(value.detach())]
    causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()

    def attend(k, v):
        scores = query @ k.repeat_interleave(G, 1).transpose(-1, -2) * scaling
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v.repeat_interleave(G, 1)

    decode_rows = (torch.arange(T, device=query.device) >= probe["decode_from"])[:, None]
    out = torch.where(decode_rows, attend(key + e_k, value + e_v), attend(key, value))
    return out.transpose(1, 2).contiguous(), None


def first_order_reference(model, result) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [N, L] of result's tokens under the fp64 model, their first-order bound [N, L]) as the module
    docstring describes; temperature 1, no filters."""
    register_attention(REFERENCE, _perturbed_attention)
    ref = copy.deepcopy(model).double()
    probe = {}
    for module in ref.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            module._fp8_probe = probe
    logp = torch.zeros(result.completion_ids.shape, dtype=torch.float64)
    bound = torch.zeros_like(logp)
    with attention_implementation(ref, REFERENCE):
        for r in range(logp.shape[0]):
            prompt = result.prompt_ids[r][result.prompt_mask[r].bool()].cpu()
            comp = result.completion_ids[r][result.completion_mask[r].bool()].cpu()
            probe.update(leaves=[], bounds=[], decode_from=len(prompt))
            ids = torch.cat([prompt, comp[:-1]])[None]
            logits = ref(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0, len(prompt) - 1:]
            token_logp = logits.log_softmax(-1).gather(1, comp[:, None])[:, 0]
            logp[r, : len(comp)] = token_logp.detach()
            for t in range(1, len(comp)):  # t = 0 is the prefill's: no cache read
                grads = torch.autograd.grad(token_logp[t], probe["leaves"], retain_graph=True)
                bound[r, t] = sum((g.abs() * q).sum() for g, q in zip(grads, probe["bounds"]))
    return logp, bound


def assert_within_first_order(model, result, what):
    logp, bound = first_order_reference(model, result)
    err = (result.logprobs.cpu().double() - logp).abs()
    worst = (err - bound - FP32_SLACK).argmax()
    assert (err <= bound + FP32_SLACK).all(), (
        f"{what}: |logp - ref| {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e} + {FP32_SLACK}")
    return err, bound


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kernel_rollout_within_the_first_order_bound(arch):
    """The interpreted Triton kernel reading the e4m3 cache, 6 tokens (qwen3: q/k norms, head_dim 16 != 64 / 4)."""
    model = tiny_model(arch)
    got = run(model, FP8_CACHE)
    err, bound = assert_within_first_order(model, got, arch)
    assert bound[:, 1:].min() > 0 and err[:, 1:].max() > 0  # the cache was read, and it did change the log-probs
    assert err[:, 0].max() <= FP32_SLACK  # the first token's: the prefill's own K/V


@pytest.mark.parametrize("arch, options", [
    ("qwen2", {}), ("llama", dict(shared_prefix=True)), ("qwen2", dict(finished_rows="compact", check_every=4))])
def test_long_rollout_within_the_first_order_bound(arch, options, monkeypatch):
    """24 tokens (slots past one 16-slot tile, 6 host syncs) through the op's plain-torch path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model(arch)
    config = EngineConfig(attention="triton", kv_cache="fp8", length_bucket=16, **options)
    got = run(model, config, G=3, new_tokens=24)
    assert_within_first_order(model, got, f"{arch} {options}")


def test_the_bound_sees_a_wrong_scale(monkeypatch):
    """The control: a cache written right but whose key scales are read one slot off (an easy bug) lands outside
    the bound. Its power comes from the pad slots: a pad token's K is all zero (its embedding row is), stored with
    scale 1, so the shifted read gives the next slot a scale ~100x its own. Between real tokens a shift is invisible
    here: the tiny models' K vectors (RMS-normed input) have amaxes within a few percent of each other, an error of
    the size of the quantization's own (reading another head's, row's or slot's scale stayed at ~6% of the bound).
    The kernel tests (test_decode_attention.py) are what catch a misread scale between real tokens."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    read = LayerCache.decode_kwargs

    def shifted(self, layer_idx):
        kwargs = read(self, layer_idx)
        return {**kwargs, "k_scale": kwargs["k_scale"].roll(1, dims=2)}

    monkeypatch.setattr(LayerCache, "decode_kwargs", shifted)
    model = tiny_model("llama")
    with pytest.raises(AssertionError, match="bound"):
        assert_within_first_order(model, run(model, FP8_CACHE, new_tokens=12), "shifted scales")


def test_cache_stores_the_quantized_prompt_at_about_half_the_bytes(monkeypatch, caches):
    """Prompt slots: the e4m3 cache holds quantize_kv of exactly what the model-dtype cache holds (same prefill).
    Bytes: per layer, slot and K/V head 2 x (D x 1 + 4) instead of 2 x D x 4 (fp32 tiny model), plain and shared.
    Its V buffers are slot-major."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model("qwen2")
    cfg = model.config
    layers, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    P = max(map(len, PROMPTS))
    for shared in (False, True):
        caches.clear()
        for kv_cache in ("model", "fp8"):
            run(model, EngineConfig(attention="triton", kv_cache=kv_cache, shared_prefix=shared, length_bucket=16))
        full, fp8 = caches
        assert fp8.nbytes() * 4 * D == full.nbytes() * (D + 4)
        slots = full.nbytes() // (2 * layers * H * D * 4)
        assert fp8.nbytes() == 2 * layers * H * slots * (D + 4)
        stores = ((full.prefix_keys, fp8.prefix_keys, fp8.prefix_key_scales), (full.prefix_values, fp8.prefix_values,
                  fp8.prefix_value_scales)) if shared else ((full.keys, fp8.keys, fp8.key_scales),
                                                            (full.values, fp8.values, fp8.value_scales))
        for layer in range(layers):  # V slot-major (the decode kernel's fast layout for an e4m3 V), K row-major
            for values in (fp8.values, *([fp8.prefix_values] if shared else [])):
                assert values[layer].stride(2) == 1 and values[layer].stride(3) == values[layer].shape[2]
            assert fp8.keys[layer].stride(3) == 1
        for want, got, scales in stores:
            for layer in range(layers):
                assert got[layer].dtype == FP8 and scales[layer].dtype == torch.float32
                q, scale = quantize_kv(want[layer][:, :, :P])
                assert torch.equal(got[layer][:, :, :P].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(scales[layer][:, :, :P], scale)


@pytest.mark.parametrize("shared", [False, True])
def test_engine_vouches_for_a_cache_that_is_finite(monkeypatch, caches, shared):
    """The engine's cache is zero-allocated and written with the model's K/V only, so every decode call passes
    v_finite (the kernel then reads whole slot-major V tiles without zeroing hidden slots): every V slot is finite
    after a rollout, left pads and unwritten slots included."""
    from fastgrpo.kernels import decode_attention as kernels

    flags, forward = [], kernels.decode_attention_fwd
    monkeypatch.setattr(kernels, "decode_attention_fwd",
                        lambda *args, **kw: flags.append(kw.get("v_finite")) or forward(*args, **kw))
    run(tiny_model("llama"), EngineConfig(attention="triton", kv_cache="fp8", shared_prefix=shared), new_tokens=4)
    assert flags and all(flags)
    (cache,) = caches
    values = [*cache.values.values(), *(cache.prefix_values.values() if shared else [])]
    assert values and all(torch.isfinite(v.float()).all() for v in values)


def test_compiled_cache_write_is_the_eager_one_with_no_dtype_view(monkeypatch):
    """LayerCache.update under torch.compile writes the bytes and scales the eager path writes (uint8 view: eager
    index_copy_ has no float8 kernel), and its traced graph holds no dtype view of the cache: on an H100 the write
    through one was not made in place under the Triton decode kernel (a whole-cache copy per layer and step)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    N, H, M, D = 3, 2, 16, 8
    slot = torch.tensor([5])
    key, value = (torch.randn(N, H, 1, D, generator=g) for _ in range(2))

    def write(keys, values, key_scales, value_scales):
        cache = LayerCache(keys, values, slot, {"k_scale": key_scales, "v_scale": value_scales})
        return cache.update(key, value, 0)

    def empty():
        return [torch.zeros(N, H, M, D).to(FP8) for _ in range(2)] + [torch.ones(N, H, M) for _ in range(2)]

    graphs = []

    def inductor(gm, example_inputs):  # the graph Dynamo traced, lowered as torch.compile's default would
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    eager, compiled = empty(), empty()
    write(*eager)
    torch.compile(write, backend=inductor, fullgraph=True)(*compiled)
    for want, got in zip(eager, compiled):
        if want.dtype == FP8:
            want, got = want.view(torch.uint8), got.view(torch.uint8)
        assert torch.equal(want, got)
    assert eager[0].view(torch.uint8)[:, :, 5].any()  # the slot was written
    views = [n for n in graphs[0].graph.nodes if n.op == "call_method" and n.target == "view"
             and any(isinstance(a, torch.dtype) for a in n.args[1:])]
    assert not views, [n.format_node() for n in views]


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache="int8"), "kv_cache"),
    (dict(kv_cache="fp8", attention="sdpa"), "kv_cache='fp8': needs attention='triton'"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_auto_attention_picks_the_kernel():
    assert EngineConfig(kv_cache="fp8").resolved(torch.device("cpu")).attention == "triton"
    assert EngineConfig().resolved(torch.device("cpu")).attention == "sdpa"


def test_eager_attention_model_is_refused(monkeypatch):
    """gemma2 stays on "eager" attention (soft-capping): it would be handed e4m3 K/V; refused before any compute."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kv_cache='fp8'.*eager"):
        run(tiny_model("gemma2"), FP8_CACHE)


def test_soft_capping_model_off_eager_is_refused(monkeypatch):
    """gemma2 loaded on another attention (flash_attention_2, flex) soft-caps too: the engine's attention got its
    softcap with the e4m3 cache and raised NotImplementedError at the first decode step, after the prefill. It runs
    on eager in a rollout now, which an fp8 cache is refused for before any compute."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kv_cache='fp8'.*runs 'eager'.*use kv_cache='model'"):
        run(gemma2_loaded_off_eager(), FP8_CACHE)


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_graphed_fp8_rollout_within_the_first_order_bound(shared):
    """On CUDA: the step compiled with Inductor and replayed as a CUDA graph (no fallback warning), the kernel reading
    the e4m3 cache; log-probs within the first-order bound (on the CPU, fp64) of the model's."""
    torch._dynamo.reset()
    model = tiny_model("qwen2").cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(model, EngineConfig(kv_cache="fp8", shared_prefix=shared, length_bucket=16), G=4, new_tokens=40)
    assert not [str(w.message) for w in caught if str(w.message).startswith("rollout:")]
    assert_within_first_order(model.cpu(), got, f"gpu shared={shared}")
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_bf16_model_decodes_graphed_from_the_fp8_cache():
    """A bf16 model (the kernel's e4m3 dots on the FP8 tensor cores; the fp32 test above takes its fp32 branch)
    decodes compiled and replayed as one CUDA graph: no "rollout:" fallback, which would make the mode's speed an
    eager step's (the first H100 measurement of this mode, 1.8x slower per step than the bf16 cache, was a cache
    write copying the whole cache, since fixed)."""
    torch._dynamo.reset()
    model = tiny_model("llama").to(torch.bfloat16).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(model, EngineConfig(kv_cache="fp8", length_bucket=16), G=4, new_tokens=40)
    assert not [str(w.message) for w in caught if str(w.message).startswith("rollout:")]
    assert torch.isfinite(got.logprobs).all()
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_before_ada_refuses_the_fp8_cache(monkeypatch):
    """e4m3 needs compute capability 8.9: an older GPU gets one line naming kv_cache, before any work."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    model = tiny_model("qwen2").cuda()
    with pytest.raises(ValueError, match="kv_cache='fp8': e4m3 needs a GPU of compute capability 8.9"):
        run(model, EngineConfig(kv_cache="fp8"))
