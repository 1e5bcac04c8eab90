"""Activation offload as a user drives it: patch_model(offload_activations=...), a bounded pool, a failed backward,
a deep copy of a patched model, and the gradients against the plain model.

ActivationOffloader("cpu") runs the offload path itself on CPU tensors (a pageable pool, synchronous copies); the
default offloaders exist per CUDA device, so their release is watched on a CPU one put in their place.
"""
from __future__ import annotations

import copy
import re
import weakref

import pytest
import torch

import fastgrpo
from fastgrpo.offload import (
    ActivationOffloader, HostBufferPool, OffloadMemoryError, enable_offload_checkpointing, offload_checkpoint,
)
from fastgrpo.offload import checkpointing as checkpointing_module
from fastgrpo.offload import offloader as offloader_module

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MIB = 1 << 20
# Every fused kernel off: the offload checkpointing alone, so gradients can be compared bit for bit.
OFFLOAD_ONLY = dict(rms_norm=False, rope=False, swiglu=False, fused_loss=False, fused_lora=False, tiled_mlp=False)


def tiny_model(layers: int = 3, dtype=torch.float64):
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def with_lora(model):
    torch.manual_seed(1)  # init_lora_weights=False: nonzero B, so the adapters' input gradients count
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def cpu_offloader(max_bytes: int | None = None) -> ActivationOffloader:
    return ActivationOffloader("cpu", pool=HostBufferPool(max_bytes=max_bytes, pin_memory=False))


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def step_grads(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch()).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# --- gradients --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("recompute_layers", [None, 0, 1, 3])
def test_offloaded_backward_equals_the_plain_models_in_fp64(lora, recompute_layers):
    plain = with_lora(tiny_model()) if lora else tiny_model()
    want = step_grads(plain)
    model = with_lora(tiny_model()) if lora else tiny_model()
    offloader = cpu_offloader()
    fastgrpo.patch_model(model, offload_activations=offloader, recompute_layers=recompute_layers, **OFFLOAD_ONLY)
    got = step_grads(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    offloaded = 3 if recompute_layers is None else recompute_layers
    assert offloader.pool.num_allocations == offloaded  # one 1 MiB buffer per checkpointed layer: it did offload
    assert offloader.pool.bytes_in_use == 0 and offloader.num_live == 0


# --- an offloader for another device -----------------------------------------------------------------------------


def meta_model():
    """tiny_model not yet placed: its weights on "meta", whose forward reaches the decoder layers (on the CPU, the
    other device a model can be on)."""
    with torch.device("meta"):
        return tiny_model()


def test_an_offloader_for_another_device_is_refused_at_the_first_forward():
    """Before, the layers left it out and checkpointed plainly, without a word. A model on "meta" is not placed yet,
    so patch_model lets it through; its first training forward refuses (the GPU test below: placed weights are
    refused by patch_model). A disabled offloader offloads nothing: any device's inputs pass."""
    ids = torch.randint(0, 96, (2, 12), device="meta")
    model = fastgrpo.patch_model(meta_model(), offload_activations=cpu_offloader(), **OFFLOAD_ONLY)
    with pytest.raises(ValueError, match=r"^offload_activations: the ActivationOffloader is for cpu, and "
                                         r"Qwen2DecoderLayer's input is on meta; pass one made for meta, or "
                                         r"offload_activations=True \(each device's default offloader\)$"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"^offloader: the ActivationOffloader is for cpu, and the input is on meta; "
                                         r"pass one made for meta, or offloader=None"):
        offload_checkpoint(torch.tanh, torch.ones(3, device="meta"), offloader=cpu_offloader())
    disabled = ActivationOffloader("cpu", pool=HostBufferPool(pin_memory=False), enabled=False)  # offloads nothing
    fastgrpo.patch_model(model, offload_activations=disabled, **OFFLOAD_ONLY)
    assert model(input_ids=ids).logits.device.type == "meta"


@pytest.mark.gpu
def test_gpu_an_offloader_for_another_device_is_refused_at_patch_time():
    for model, offloader, found in [(tiny_model(), ActivationOffloader("cuda:0"), "is for cuda:0, and layer 0 "
                                     "(Qwen2DecoderLayer) is on cpu; pass one made for cpu"),
                                    (tiny_model().cuda(), cpu_offloader(), "is for cpu, and layer 0 "
                                     "(Qwen2DecoderLayer) is on cuda:0; pass one made for cuda:0")]:
        with pytest.raises(ValueError, match=rf"^offload_activations: the ActivationOffloader {re.escape(found)}, or "
                                             r"offload_activations=True \(each device's default offloader\)$"):
            fastgrpo.patch_model(model, offload_activations=offloader)
        assert "fastgrpo_patch_summary" not in model.__dict__  # refused before anything was bound
        with pytest.raises(ValueError, match=rf"^offloader: the ActivationOffloader {re.escape(found)}, or "
                                             r"offloader=None"):
            enable_offload_checkpointing(model.model.layers, offloader=offloader)
    # placed after patching: its first training forward refuses
    model = fastgrpo.patch_model(tiny_model().cuda(), offload_activations=ActivationOffloader("cuda:0")).cpu()
    with pytest.raises(ValueError, match=r"^offload_activations: the ActivationOffloader is for cuda:0, and "
                                         r"Qwen2DecoderLayer's input is on cpu; pass one made for cpu"):
        model(**batch())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_an_offloader_for_another_gpu_is_refused_at_patch_time():
    with pytest.raises(ValueError, match=r"^offload_activations: the ActivationOffloader is for cuda:1, and layer 0 "
                                         r"\(Qwen2DecoderLayer\) is on cuda:0; pass one made for cuda:0"):
        fastgrpo.patch_model(tiny_model().to("cuda:0"), offload_activations=ActivationOffloader("cuda:1"))


# --- a bounded pool ---------------------------------------------------------------------------------------------


def test_a_pool_too_small_for_a_step_says_how_much_in_readable_units():
    # Each layer input is far below 1 MiB: one 1 MiB buffer each, the second of which passes the bound.
    model = fastgrpo.patch_model(tiny_model(), offload_activations=cpu_offloader(max_bytes=MIB))
    with pytest.raises(OffloadMemoryError) as err:
        model(**batch()).loss.backward()
    message = str(err.value)
    assert "needs 1.00 MiB more host memory but the pool already holds 1.00 MiB in use" in message, message
    assert "max_bytes=1048576 (1.00 MiB)" in message and "\n" not in message
    with pytest.raises(OffloadMemoryError, match=r"needs 1\.00 MiB more .* max_bytes=1024 \(1\.00 KiB\)"):
        HostBufferPool(max_bytes=1024, pin_memory=False).acquire(10)  # a bound below the smallest buffer


def test_a_step_after_a_failed_backward_names_what_holds_the_pool():
    offloader = cpu_offloader(max_bytes=3 * MIB)  # what one step's three layer inputs need
    model = fastgrpo.patch_model(tiny_model(), offload_activations=offloader)
    fail = []

    def recompute_fails(module, args, output):
        if fail and torch.is_grad_enabled():  # the recompute in the backward (the forward runs under no_grad)
            raise RuntimeError("out of memory in the backward")

    model.model.layers[1].self_attn.register_forward_hook(recompute_fails)
    fail.append(True)
    loss = model(**batch()).loss
    with pytest.raises(RuntimeError, match="out of memory in the backward"):
        loss.backward()
    fail.clear()
    # The failed graph, which `loss` keeps alive, still holds its unreached layers' inputs.
    assert offloader.pool.bytes_in_use > 0
    with pytest.raises(OffloadMemoryError, match=r"free the outputs / losses of forwards whose backward did not run "
                                                 r"or failed \(their graphs hold their inputs' buffers\)"):
        model(**batch()).loss.backward()
    del loss
    assert offloader.pool.bytes_in_use == 0
    model(**batch()).loss.backward()  # the bound suffices again


@pytest.mark.skipif(torch.cuda.is_available() or torch.accelerator.is_available(), reason="this machine can pin")
def test_a_pinned_pool_where_nothing_can_pin_is_refused_when_made():
    with pytest.raises(ValueError, match=r"^pin_memory: True needs CUDA .*HostBufferPool\(pin_memory=False\)"):
        HostBufferPool(max_bytes=8 * MIB)


# --- giving the default pool back -------------------------------------------------------------------------------


@pytest.fixture
def default_cpu_pool(monkeypatch) -> HostBufferPool:
    """The default offloaders' registry holding one CPU offloader with 1 MiB in its pool, and no layer using it."""
    monkeypatch.setattr(offloader_module, "_DEFAULT_OFFLOADERS", {})
    monkeypatch.setattr(checkpointing_module, "_DEFAULT_USERS", weakref.WeakSet())
    pool = offloader_module.default_offloader("cpu").pool
    pool.release(pool.acquire(MIB))
    return pool


def test_unpatching_a_deepcopy_last_releases_the_default_pool(default_cpu_pool):
    model = fastgrpo.patch_model(tiny_model(), offload_activations=True)
    twin = copy.deepcopy(model)  # as fastgrpo.GRPOTrainer makes its reference model
    fastgrpo.unpatch_model(model)
    default_cpu_pool.release(default_cpu_pool.acquire(MIB))  # the copy's steps fill it again
    fastgrpo.unpatch_model(twin)
    assert default_cpu_pool.bytes_held == 0  # no patched model is left to use it


def test_unpatching_one_of_two_patched_models_keeps_the_default_pool(default_cpu_pool):
    first = fastgrpo.patch_model(tiny_model(), offload_activations=True)
    second = fastgrpo.patch_model(tiny_model(), offload_activations=True)
    fastgrpo.unpatch_model(first)
    assert default_cpu_pool.bytes_held == MIB  # second still uses it
    fastgrpo.unpatch_model(second)
    assert default_cpu_pool.bytes_held == 0


def test_recompute_layers_turns_hfs_checkpointing_off_on_the_kept_layers():
    """patch_model(recompute_layers=N) on a model with HF's gradient checkpointing on: the layers after the first N
    keep their activations (HF's flag off there too, as the commands and the TRL drop-in already did), and
    unpatch_model puts HF's flags back."""
    from fastgrpo.patching import patch_model, unpatch_model
    from tests.test_patching import tiny_model

    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.model.layers
    assert len(layers) >= 2 and all(layer.gradient_checkpointing for layer in layers)
    patch_model(model, offload_activations=True, recompute_layers=1)
    assert [bool(layer.gradient_checkpointing) for layer in layers[1:]] == [False] * (len(layers) - 1)
    unpatch_model(model)
    assert all(layer.gradient_checkpointing for layer in layers)
