"""patch_model / unpatch_model on tiny configs of every supported architecture (fp32, CPU interpreter)."""
import copy
import gc
import sys
import weakref

import pytest
import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM

from fastgrpo.patching import patch as patch_module
from fastgrpo.patching import patch_model, unpatch_model
from fastgrpo.hf.architectures import ARCHITECTURES

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "mistral": lambda: transformers.MistralConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen3": lambda: transformers.Qwen3Config(**TINY),
    "gemma": lambda: transformers.GemmaConfig(**TINY),
    # A logit cap of 0.2 against tiny-model logits of std 0.14 (max 0.5): tanh bends them (30 would be linear here).
    "gemma2": lambda: transformers.Gemma2Config(**TINY, final_logit_softcapping=0.2, query_pre_attn_scalar=8),
    # sliding_window < T: local and global layers both run.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**TINY, sliding_window=4, query_pre_attn_scalar=8),
    # Phi-3 rotates half of each head (partial rotary) and fuses gate_up_proj.
    "phi3": lambda: transformers.Phi3Config(
        **{k: v for k, v in TINY.items() if k != "head_dim"}, partial_rotary_factor=0.5
    ),
}
B, T = 2, 10


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    config = CONFIGS[model_type]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for p in model.parameters():  # norm weights start at 1 (or 0 for Gemma): randomize to test the weight math
        if p.dim() == 1:
            torch.nn.init.normal_(p, 0.0, 0.5)
    return model


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    return input_ids, attention_mask


def forward_logps_grads(model, input_ids, attention_mask):
    model.zero_grad()
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    logps = torch.log_softmax(out.logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    (logps * attention_mask[:, 1:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [h.detach() for h in out.hidden_states], logps.detach(), grads


def test_table_covers_the_issue_list():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3"} <= set(
        ARCHITECTURES
    )


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_patched_matches_unpatched(model_type):
    model = tiny_model(model_type)
    patched = patch_model(copy.deepcopy(model))
    counts = patched.fastgrpo_patch_summary["patched"]
    layers = model.config.num_hidden_layers
    assert counts["rope"] == layers and counts["swiglu"] == layers and counts["rms_norm"] >= 2 * layers + 1
    assert patched.fastgrpo_patch_summary["skipped"] == {}
    ids, mask = batch()
    hidden, logps, grads = forward_logps_grads(model, ids, mask)
    hidden_p, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    for h, h_p in zip(hidden, hidden_p):
        torch.testing.assert_close(h_p, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_p.keys() and len(grads) == len(list(model.parameters()))
    assert_fp32_grads_close(grads_p, grads)


def assert_fp32_grads_close(grads_p: dict, grads: dict, ulps: int = 64) -> None:
    """Two correct fp32 backward passes that round in another order differ by a few fp32 eps times the size of
    the terms each gradient element sums, and those are bounded by the model's largest gradient element, not the
    element's own (a k_proj bias gradient is ~0 by cancellation). Seen over 8 architectures x 4 seeds: at most 11
    eps x that scale; the bound is `ulps` eps. A wrong gradient is off by the order of the gradient itself."""
    scale = max(g.abs().max().item() for g in grads.values())
    tol = ulps * torch.finfo(torch.float32).eps * scale
    for name, g in grads.items():
        err = (grads_p[name] - g).abs().max().item()
        assert err <= tol, (
            f"{name}: max |patched - unpatched| = {err:.3g} > {tol:.3g} ({ulps} fp32 eps x max |grad| {scale:.3g})"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_patched_matches_unpatched_on_cuda(model_type):
    # The compiled Triton kernels (the CPU tests run the interpreter), fp32 on the GPU. Gradients are judged against
    # an fp64 run: the patched error may be at most twice the unpatched fp32 error (+1e-6 of the norm). An
    # elementwise fp32-vs-fp32 check is noise-bound here: Gemma-3's tied embedding gradient (max 23) differs by
    # 2.5e-5 between two fp32 runs even with fused_loss=False (H200, 2026-11-26).
    model = tiny_model(model_type).cuda()
    patched = patch_model(copy.deepcopy(model))
    ids, _ = (t.cuda() for t in batch())
    mask = torch.ones_like(ids)  # HF's eager attention gives NaN rows for left padding in fp64; the CPU test pads
    hidden, logps, grads = forward_logps_grads(model, ids, mask)
    hidden_p, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    _, _, grads64 = forward_logps_grads(copy.deepcopy(model).double(), ids, mask)
    for h, h_p in zip(hidden, hidden_p):
        torch.testing.assert_close(h_p, h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    for name, g64 in grads64.items():
        norm = g64.norm().item()
        err_patched = (grads_p[name].double() - g64).norm().item() / norm
        err_eager = (grads[name].double() - g64).norm().item() / norm
        assert err_patched <= 2 * err_eager + 1e-6, (name, err_patched, err_eager)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma3_text", "phi3"])
def test_generate_with_kv_cache(model_type):
    # The rollout engine decodes with the patched modules: T = 1 steps with a cache and cache_position.
    model = tiny_model(model_type).eval()
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(1)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out_p = patched.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(out_p.sequences, out.sequences)
    for s, s_p in zip(out.scores, out_p.scores):
        torch.testing.assert_close(s_p, s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: soft-capped logits
def test_labels_loss_without_logits_matches_hf(model_type):
    model = tiny_model(model_type)
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(2)
    labels = ids.masked_fill(mask == 0, -100)
    out, out_p = model(input_ids=ids, attention_mask=mask, labels=labels), patched(
        input_ids=ids, attention_mask=mask, labels=labels
    )
    assert out_p.logits is None
    torch.testing.assert_close(out_p.loss, out.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    out_p.loss.backward()
    torch.testing.assert_close(patched.lm_head.weight.grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_labels_all_ignored_give_a_zero_loss_and_zero_gradients():
    """No label left (every one -100): loss +0.0, where HF's mean is NaN (0 / 0); a batch with nothing to learn
    adds nothing to the gradients instead of turning them NaN."""
    patched = patch_model(tiny_model("llama"))
    ids, mask = batch(2)
    loss = patched(input_ids=ids, attention_mask=mask, labels=torch.full_like(ids, -100)).loss
    assert loss.item() == 0.0 and not loss.signbit()
    loss.backward()
    assert all(not p.grad.any() for p in patched.parameters() if p.grad is not None)


def test_labels_with_return_dict_false_give_hfs_tuple():
    """A tuple caller reads (loss, logits, ...): the patched model gives HF's own, logits included."""
    model = tiny_model("llama")
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(2)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
        out_p = patched(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(out_p, tuple) and len(out_p) == len(out)
    torch.testing.assert_close(out_p[0], out[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_p[1], out[1], rtol=1e-5, atol=1e-5)


def test_labels_loss_reads_the_soft_cap_from_the_config():
    model = tiny_model("gemma2")
    patched = patch_model(copy.deepcopy(model))
    assert patched.fastgrpo_patch_summary["patched"]["fused_loss"] == 1
    ids, mask = batch(2)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        capped = patched(input_ids=ids, attention_mask=mask, labels=labels).loss
        for m in (model, patched):
            m.config.final_logit_softcapping = None
        uncapped = patched(input_ids=ids, attention_mask=mask, labels=labels).loss
        torch.testing.assert_close(uncapped, model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert abs(float(capped - uncapped)) > 1e-3  # the cap changes the loss by far more than the tolerance


def _instance_forwards(model):
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def test_instance_level_only():
    model_a, model_b = tiny_model("qwen3"), tiny_model("qwen3")
    classes = {type(m) for m in model_a.modules()}
    class_forwards = {cls: cls.__dict__.get("forward") for cls in classes}
    modeling = sys.modules[type(model_a).__module__]
    rope_fn = modeling.apply_rotary_pos_emb
    patch_model(model_a)
    assert all(f is None for f in _instance_forwards(model_b).values())
    assert {cls: cls.__dict__.get("forward") for cls in classes} == class_forwards
    assert modeling.apply_rotary_pos_emb is rope_fn


def test_unpatch_restores_exactly():
    model = tiny_model("gemma3_text")
    before = _instance_forwards(model)
    ids, mask = batch(3)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    patch_model(model)
    assert unpatch_model(model) is model
    assert _instance_forwards(model) == before
    assert not hasattr(model, "fastgrpo_patch_summary")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)


def test_patch_twice_is_idempotent_and_new_options_repatch():
    model = patch_model(tiny_model("llama"))
    forwards = _instance_forwards(model)
    summary = model.fastgrpo_patch_summary
    assert patch_model(model) is model
    assert _instance_forwards(model) == forwards  # the same bound objects: nothing wrapped twice
    assert model.fastgrpo_patch_summary is summary
    patch_model(model, rope=False)
    assert "rope" not in model.fastgrpo_patch_summary["patched"]
    assert model.model.layers[0].self_attn.__dict__.get("forward") is None


def test_unpatch_of_unpatched_model_is_a_no_op():
    model = tiny_model("llama")
    before = _instance_forwards(model)
    assert unpatch_model(model) is model
    assert _instance_forwards(model) == before
    with pytest.raises(ValueError, match="^model: expected the torch module patch_model was given, got str$"):
        unpatch_model("model")


def test_options_turn_kinds_off():
    model = patch_model(tiny_model("qwen2"), rms_norm=False, swiglu=False, fused_loss=False)
    assert model.fastgrpo_patch_summary["patched"] == {"rope": 2}


def test_not_a_causal_lm():
    with pytest.raises(ValueError, match="causal LM"):
        patch_model(AutoModel.from_config(CONFIGS["llama"]()))
    with pytest.raises(ValueError, match="causal LM"):
        patch_model(torch.nn.Linear(2, 2))


def test_unsupported_model_type_lists_supported_ones():
    gpt2 = AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: \[.*'llama'.*'phi3'"):
        patch_model(gpt2)


def test_peft_lora_parity_and_unpatch():
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: make the adapter do something
            torch.nn.init.normal_(p, 0.0, 0.1)
    patched = patch_model(copy.deepcopy(model))
    assert patched.fastgrpo_patch_summary["patched"]["rope"] == 2
    ids, mask = batch(4)
    _, logps, grads = forward_logps_grads(model, ids, mask)
    _, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_p.keys() and all("lora_" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
    unpatch_model(patched)
    assert all(f is None for f in _instance_forwards(patched).values())


def test_lora_on_lm_head_keeps_the_library_loss():
    # The fused loss reads lm_head.weight, which on a LoRA layer is the base weight alone.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, 0.0, 0.5)
    patched = patch_model(copy.deepcopy(model))
    ids, mask = batch(5)
    labels = ids.masked_fill(mask == 0, -100)
    out, out_p = model(input_ids=ids, attention_mask=mask, labels=labels), patched(
        input_ids=ids, attention_mask=mask, labels=labels
    )
    torch.testing.assert_close(out_p.loss, out.loss, rtol=1e-5, atol=1e-6)


def test_accelerate_hooks_are_kept():
    # device_map / 4-bit loading wraps module forwards with accelerate hooks that call `_old_forward`.
    accelerate_hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")
    model = tiny_model("llama")
    hooked = copy.deepcopy(model)
    calls = []

    class CountingHook(accelerate_hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(type(module).__name__)
            return args, kwargs

    for module in (hooked.model.norm, hooked.model.layers[0].mlp, hooked.model.layers[0].self_attn):
        accelerate_hooks.add_hook_to_module(module, CountingHook())
    old_forwards = {name: m.__dict__.get("_old_forward") for name, m in hooked.named_modules()}
    patch_model(hooked)
    ids, mask = batch(7)
    with torch.no_grad():
        torch.testing.assert_close(hooked(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    assert sorted(calls) == ["LlamaAttention", "LlamaMLP", "LlamaRMSNorm"]
    assert hooked.model.norm.__dict__["_old_forward"] is not old_forwards["model.norm"]
    unpatch_model(hooked)
    assert {name: m.__dict__.get("_old_forward") for name, m in hooked.named_modules()} == old_forwards


def test_offload_activations_wires_fastgrpo_offload(monkeypatch):
    calls = []
    monkeypatch.setattr(patch_module, "enable_offload_checkpointing",
                        lambda layers, offloader, tiled_mlp_chunk_tokens, mlp_output_only_added: calls.append(
                            ("enable", list(layers), offloader, tiled_mlp_chunk_tokens, mlp_output_only_added)))
    monkeypatch.setattr(patch_module, "disable_offload_checkpointing",
                        lambda layers: calls.append(("disable", list(layers))))
    model = tiny_model("llama")
    chunk = patch_model(model, offload_activations=True).fastgrpo_patch_summary["options"]["mlp_chunk_tokens"]
    unpatch_model(model)
    patch_model(model, offload_activations=True, tiled_mlp=False)  # the wrapper learns that the MLPs run whole
    unpatch_model(model)
    layers = list(model.model.layers)
    assert isinstance(chunk, int)
    assert calls == [("enable", layers, None, chunk, True), ("disable", layers),  # llama: MLP output added as is
                     ("enable", layers, None, None, True), ("disable", layers)]


def test_offload_activations_with_the_real_module():
    model = tiny_model("qwen2").train()
    before = _instance_forwards(model)
    patched = patch_model(copy.deepcopy(model), offload_activations=True)
    assert patched.fastgrpo_patch_summary["patched"]["offload_activations"] == 2
    ids, mask = batch(6)
    _, logps, grads = forward_logps_grads(model, ids, mask)
    _, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
    unpatch_model(patched)
    assert _instance_forwards(patched) == before


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_del_frees_a_patched_model_without_gc(wrap):
    """Instance-bound forwards hold their module weakly: reference counting alone frees a patched model (a cycle
    would keep its GPU memory until the next gc pass, after `del model; torch.cuda.empty_cache()`)."""
    model = tiny_model("qwen2").train()
    if wrap == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]))
    patch_model(model, offload_activations=True, mlp_chunk_tokens=4)  # CPU: offload falls back to checkpointing
    ids, _ = batch(8)
    model(input_ids=ids, labels=ids).loss.backward()
    hf_model = model.get_base_model() if wrap == "peft" else model
    refs = [weakref.ref(hf_model), weakref.ref(hf_model.model.layers[0]), weakref.ref(hf_model.model.layers[0].mlp)]
    del hf_model
    gc.collect()  # what the library or earlier tests left in cycles
    gc.disable()
    try:
        del model
        assert [ref() is None for ref in refs] == [True, True, True]
    finally:
        gc.enable()


def test_deepcopy_of_a_patched_model_is_its_own():
    """The copy's forwards (and the ones they wrap: tiled MLP, fused loss) run the copy's weights; its unpatch
    restores the copy's modules (GRPOTrainer deep-copies a patched model for the KL reference)."""
    model = patch_model(tiny_model("qwen2").train(), offload_activations=True, mlp_chunk_tokens=4)
    twin = copy.deepcopy(model)
    ids, mask = batch(9)
    with torch.no_grad():
        want = twin(input_ids=ids, attention_mask=mask).logits
        for p in model.parameters():
            p.add_(0.5)
        assert torch.equal(twin(input_ids=ids, attention_mask=mask).logits, want)
    twin(input_ids=ids, labels=ids).loss.backward()  # tiled MLP recompute + offload checkpointing on the copy
    assert all(p.grad is None for p in model.parameters())
    assert twin.model.layers[0].mlp.gate_proj.weight.grad is not None
    unpatch_model(twin)
    assert all(f is None for f in _instance_forwards(twin).values())
    assert "_fastgrpo_offload" not in twin.model.layers[0].__dict__
    assert model.model.layers[0].mlp.__dict__.get("forward") is not None
    assert "_fastgrpo_offload" in model.model.layers[0].__dict__


def test_offload_activations_takes_an_offloader():
    from fastgrpo.offload import ActivationOffloader, HostBufferPool, OffloadMemoryError, release_host_memory

    model = tiny_model("qwen2").train()
    mib = 1 << 20
    # A CPU offloader: the offload path itself runs on CPU tensors (the default one falls back to checkpointing).
    offloader = ActivationOffloader("cpu", pool=HostBufferPool(max_bytes=2 * mib, pin_memory=False))
    patched = patch_model(copy.deepcopy(model), offload_activations=offloader)
    assert patched.fastgrpo_patch_summary["options"]["offload_activations"] is offloader
    ids, mask = batch(10)
    _, logps, grads = forward_logps_grads(model, ids, mask)
    _, logps_p, grads_p = forward_logps_grads(patched, ids, mask)
    assert offloader.pool.num_allocations == 2  # one 1 MiB buffer per layer input: the pool given is the one used
    torch.testing.assert_close(logps_p, logps, rtol=1e-5, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert copy.deepcopy(patched).model.layers[0]._fastgrpo_offload.offloader is offloader  # shared, not copied

    small = ActivationOffloader("cpu", pool=HostBufferPool(max_bytes=1 * mib, pin_memory=False))
    patch_model(patched, offload_activations=small)  # another offloader: repatched; its bound holds
    with pytest.raises(OffloadMemoryError, match="max_bytes"):
        forward_logps_grads(patched, ids, mask)
    unpatch_model(patched)
    assert offloader.pool.bytes_held > 0  # the caller's offloader: unpatch leaves it alone
    release_host_memory(offloader)
    assert offloader.pool.bytes_held == 0

    with pytest.raises(ValueError, match="offload_activations: expected a bool or .*ActivationOffloader, got str"):
        patch_model(model, offload_activations="cpu")


@pytest.mark.gpu
def test_bitsandbytes_4bit_base_with_lora(tmp_path, delta_calls):
    bnb = pytest.importorskip(
        "bitsandbytes", reason="bitsandbytes is not installed (GPU wheel: tools/device-wheels.sh)"
    )
    from peft import LoraConfig, get_peft_model

    from fastgrpo.loss.model import grpo_loss

    config = transformers.Qwen2Config(**{**TINY, "hidden_size": 128, "intermediate_size": 256})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4"
    )

    def load():
        base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cuda")
        torch.manual_seed(0)
        return get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "gate_proj"]))

    model, patched = load(), patch_model(load())
    gate_proj = patched.base_model.model.model.layers[0].mlp.gate_proj
    assert isinstance(gate_proj.base_layer, bnb.nn.Linear4bit)
    # PEFT's QLoRA layer class, with fused_lora's forward bound on the instance
    assert type(gate_proj).__module__ == "peft.tuners.lora.bnb" and "forward" in gate_proj.__dict__
    assert patched.fastgrpo_patch_summary["patched"]["swiglu"] == 2
    assert patched.fastgrpo_patch_summary["patched"]["fused_lora"] == 3 * 2  # q, v, gate_proj of 2 layers
    ids, mask = (t.cuda() for t in batch(5))
    completion = torch.zeros_like(mask)
    completion[:, 6:] = 1
    advantages = torch.tensor([1.0, -1.0], device="cuda")
    losses, grads = [], []
    for m in (model, patched):
        loss, _ = grpo_loss(m, ids, mask, completion, advantages)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten().float() for n, p in m.named_parameters() if p.grad is not None]))
    # the patched forward ran the fused branch in every 4-bit LoRA layer, in the default lora_dtype="input"
    assert delta_calls == ["lora_add"] * 3 * 2
    # bf16 compute on both sides: the patched step must agree with the unpatched one to bf16 noise.
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.99
