"""Activation-offload checkpointing: gradients, the host buffer pool, extra layer inputs, faults, fallbacks.

CPU tests run the offload logic with ActivationOffloader("cpu") (synchronous CPU-to-CPU copies, pageable pool), so
the path that drops the input and recomputes from the host copy is the one compared bitwise against torch's plain
non-reentrant checkpointing (HF's gradient checkpointing with use_reentrant=False).
"""
from __future__ import annotations

import copy
import gc
import time
import warnings
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastgrpo import offload
from fastgrpo.hf.models import architecture, decoder_layers
from fastgrpo.offload import checkpointing as checkpointing_module
from fastgrpo.offload import offloader as offloader_module
from fastgrpo.offload import (
    ActivationOffloader,
    disable_offload_checkpointing,
    enable_offload_checkpointing,
    offload_checkpoint,
)
from fastgrpo.offload.pool import HostBufferPool, OffloadMemoryError, size_class

transformers = pytest.importorskip("transformers")

MIB = 1 << 20


# --- helpers ---------------------------------------------------------------------------------------------------


def tiny_model(arch: str = "qwen2", layers: int = 3, dtype=torch.float32, device="cpu"):
    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    config = transformers.Qwen2Config(**common) if arch == "qwen2" else transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    return model.train()


def hf_checkpointing(model, on: bool) -> None:
    """HF's own gradient checkpointing, non-reentrant (5.24 renamed the methods; 5.17 has the old names)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if on:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


def decoder(model):
    """The HF base model (Qwen2Model / LlamaModel), under PEFT's wrappers if any."""
    return model.get_base_model().model if hasattr(model, "get_base_model") else model.model


def train_step(model, batches, use_cache=False):
    """Forward + backward over micro-batches (gradient accumulation); returns a copy of every gradient."""
    model.zero_grad(set_to_none=True)
    for ids, mask in batches:
        out = decoder(model)(input_ids=ids, attention_mask=mask, use_cache=use_cache)
        hidden = out.last_hidden_state  # hidden: [B, T, H]
        loss = (hidden.float().square().mean(-1) * mask).sum() / len(batches)
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def batches(n=1, B=2, T=12, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, : T // 3] = 0  # left padding: the layers get a real attention mask
        out.append((ids, mask))
    return out


def assert_grads_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


class Block(nn.Module):
    """A residual MLP block with the HF-style extra inputs; counts its runs; can be told to fail."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.runs = 0
        self.grad_modes: list[bool] = []  # torch.is_grad_enabled() at each run
        self.fail_on_run: int | None = None

    def forward(self, hidden_states, scale=None, *, position_embeddings=None, use_cache=False, past_key_values=None):
        self.runs += 1
        self.grad_modes.append(torch.is_grad_enabled())
        if self.runs == self.fail_on_run:
            raise RuntimeError("boom")
        out = torch.tanh(self.fc(hidden_states))
        if position_embeddings is not None:
            cos, sin = position_embeddings
            out = out * cos + sin
        if scale is not None:
            out = out * scale
        if past_key_values is not None:
            past_key_values.append(out.detach())
        return hidden_states + out


def stack_step(blocks, x, offloader=None, plain=False):
    for block in blocks:
        block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    h = x * 1.0
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False) if plain else offload_checkpoint(block, h, offloader=offloader)
    h.square().sum().backward()
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


# --- gradients --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("path", ["offload", "cpu_fallback"])
def test_grads_bitwise_equal_to_plain_checkpointing(arch, path):
    model = tiny_model(arch)
    data = batches()
    hf_checkpointing(model, True)
    want = train_step(model, data)
    hf_checkpointing(model, False)

    offloader = ActivationOffloader("cpu") if path == "offload" else None
    defaults = dict(offloader_module._DEFAULT_OFFLOADERS)  # earlier GPU tests may have made one for their CUDA device
    enable_offload_checkpointing(decoder(model).layers, offloader=offloader)
    got = train_step(model, data)
    assert_grads_equal(got, want)
    if path == "offload":
        assert offloader.pool.num_allocations == len(decoder(model).layers)  # every layer went through the pool
        assert offloader.pool.bytes_in_use == 0 and offloader.num_live == 0
    else:
        assert offloader_module._DEFAULT_OFFLOADERS == defaults  # CPU tensors never reach a (CUDA) default offloader


def test_recompute_reads_the_host_copy():
    """The recompute uses what is in the host buffer: spoil the buffers after forward and the gradients change."""
    buffers = []

    def allocator(nbytes):
        buffers.append(torch.empty(nbytes, dtype=torch.uint8))
        return buffers[-1]

    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 5, 16)
    want = stack_step(blocks, x, plain=True)
    off = ActivationOffloader("cpu", pool=HostBufferPool(pin_memory=False, allocator=allocator))
    got = stack_step(blocks, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    h = x.detach().requires_grad_() * 1.0
    for block in blocks:
        h = offload_checkpoint(block, h, offloader=off)
    for buf in buffers:
        buf.zero_()
    h.square().sum().backward()
    assert not torch.equal(blocks[0].fc.weight.grad, want[2])


def test_recompute_input_is_a_detached_copy():
    """The host copy and the tensor the recompute gets are outside the graph (only torch's checkpoint links it)."""
    seen = []
    block = Block()
    block.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    off = ActivationOffloader("cpu")
    x = torch.randn(3, 16, requires_grad=True)
    h = offload_checkpoint(block, x * 1.0, offloader=off)
    h = offload_checkpoint(block, h, offloader=off)
    assert not any(ref()._host.requires_grad for ref in off._live)
    h.sum().backward()
    forward_inputs, recompute_inputs = seen[:2], seen[2:]
    assert all(t.grad_fn is not None for t in forward_inputs)
    assert len(recompute_inputs) == 2 and all(t.is_leaf and t.requires_grad for t in recompute_inputs)


def test_offloaded_input_is_not_kept_alive():
    block = Block()
    x = torch.randn(4, 16, requires_grad=True)

    h = x * 2.0
    ref = weakref.ref(h)
    out = checkpoint(block, h, use_reentrant=False)
    del h
    assert ref() is not None  # plain checkpointing keeps its input

    off = ActivationOffloader("cpu")
    h = x * 2.0
    ref = weakref.ref(h)
    out = offload_checkpoint(block, h, offloader=off)
    del h
    assert ref() is not None  # the newest input stays until the next one is offloaded (backward needs it first)
    out = offload_checkpoint(block, out, offloader=off)
    assert ref() is None
    out.sum().backward()
    assert x.grad is not None


def test_peft_lora_with_gradient_accumulation():
    peft = pytest.importorskip("peft")
    model = tiny_model("qwen2", layers=2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])
    model = peft.get_peft_model(model, lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)  # B starts at zero: give A a gradient too
    data = batches(n=2)
    hf_checkpointing(model.get_base_model(), True)
    want = train_step(model, data)
    hf_checkpointing(model.get_base_model(), False)
    off = ActivationOffloader("cpu")
    enable_offload_checkpointing(decoder(model).layers, offloader=off)
    got = train_step(model, data)
    assert any("lora_A" in name for name in want) and all("lora" in name for name in want)
    assert_grads_equal(got, want)
    assert off.pool.num_allocations == 2 and off.pool.bytes_in_use == 0  # micro-batch 2 reused micro-batch 1's


def test_retain_graph_twice_doubles_the_gradients():
    blocks = [Block() for _ in range(3)]
    x = torch.randn(3, 16)
    off = ActivationOffloader("cpu")
    h = x * 1.0
    for block in blocks:
        h = offload_checkpoint(block, h, offloader=off)
    loss = h.square().sum()
    loss.backward(retain_graph=True)
    once = blocks[0].fc.weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(blocks[0].fc.weight.grad, 2 * once, rtol=0, atol=0)
    del loss, h
    assert off.pool.bytes_in_use == 0


# --- prefetch order ----------------------------------------------------------------------------------------------


class LoggingCopies(offloader_module._SyncCopies):
    """Logs ("fetch", host ptr) when a copy back starts and ("use", host ptr) when the layer waits on it."""

    def __init__(self, log):
        self.log, self._host_of = log, {}

    def to_device(self, host, device):
        dev, done = super().to_device(host, device)
        self.log.append(("fetch", host.data_ptr()))
        self._host_of[dev.data_ptr()] = host.data_ptr()
        return dev, done

    def wait(self, dev, done):
        self.log.append(("use", self._host_of[dev.data_ptr()]))


def test_backward_prefetches_the_previous_layer_once():
    log = []
    blocks = [Block() for _ in range(4)]
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: log.append(("run", i)))
    off = ActivationOffloader("cpu")
    off._copies = LoggingCopies(log)
    h = torch.randn(2, 16, requires_grad=True) * 1.0
    hosts = []
    for block in blocks:
        h = offload_checkpoint(block, h, offloader=off)
        hosts.append(off._live[-1]()._host.data_ptr())
    log.clear()
    h.sum().backward()
    # The last layer's input never left; from then on the layer before is in flight while a layer recomputes.
    want = [("fetch", hosts[2]), ("run", 3)]
    for i in (2, 1, 0):
        want += [("use", hosts[i])] + ([("fetch", hosts[i - 1])] if i else []) + [("run", i)]
    assert log == want


# --- extra inputs ------------------------------------------------------------------------------------------------


def test_extra_inputs_and_cache_are_handled():
    block = Block()
    x = torch.randn(2, 5, 16)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    scale = torch.tensor(0.5, requires_grad=True)

    def run(fn):
        block.zero_grad(set_to_none=True)
        scale.grad = None
        h = x.detach().requires_grad_()
        fn(h).sum().backward()
        return h.grad, block.fc.weight.grad, scale.grad

    want = run(lambda h: checkpoint(block, h, scale, position_embeddings=(cos, sin), use_reentrant=False))
    got = run(lambda h: offload_checkpoint(block, h, scale, position_embeddings=(cos, sin),
                                           offloader=ActivationOffloader("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    # Passed by keyword, like an HF layer called with hidden_states=...
    off = ActivationOffloader("cpu")
    got = run(lambda h: offload_checkpoint(block, hidden_states=h, scale=scale, position_embeddings=(cos, sin),
                                           offloader=off))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.pool.num_allocations == 1

    # A wrapped layer asked to write a cache does not (the recompute would write it twice).
    enable_offload_checkpointing([block], offloader=ActivationOffloader("cpu"))
    cache = []
    got = run(lambda h: block(h, scale, position_embeddings=(cos, sin), use_cache=True, past_key_values=cache))
    assert cache == []
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_hf_layers_get_masks_position_embeddings_and_cache():
    """Layers called by the HF model with a padding mask and a KV cache: gradients as HF's checkpointing, no cache."""
    model = tiny_model("qwen2")
    data = batches(n=1)
    hf_checkpointing(model, True)
    want = train_step(model, data, use_cache=True)
    hf_checkpointing(model, False)
    seen = {}
    layer0 = decoder(model).layers[0]
    hook = layer0.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    enable_offload_checkpointing(decoder(model).layers, offloader=ActivationOffloader("cpu"))
    got = train_step(model, data, use_cache=True)
    hook.remove()
    assert_grads_equal(got, want)
    assert seen["attention_mask"] is not None and seen["position_embeddings"] is not None
    assert seen.get("use_cache") is True  # the model asked for a cache; the wrapped layers did not write one

    with torch.no_grad():
        out = decoder(model)(input_ids=data[0][0], attention_mask=data[0][1], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # renamed after transformers 5.17
    assert cache.get_seq_length() == data[0][0].shape[1]  # under no_grad the layers run as before, cache included


# --- faults ------------------------------------------------------------------------------------------------------


def test_exception_in_forward_leaves_pool_and_offloader_usable():
    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 16)
    want = stack_step(blocks, x, plain=True)
    off = ActivationOffloader("cpu")
    blocks[1].fail_on_run = blocks[1].runs + 1
    with pytest.raises(RuntimeError, match="boom"):
        stack_step(blocks, x, off)
    gc.collect()
    assert off.pool.bytes_in_use == 0 and off.num_live == 0
    got = stack_step(blocks, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.pool.bytes_in_use == 0 and off.num_live == 0


def test_exception_in_recompute_returns_buffers():
    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 16)
    off = ActivationOffloader("cpu")
    blocks[2].fail_on_run = blocks[2].runs + 2  # forward passes, the recompute fails
    with pytest.raises(RuntimeError, match="boom"):
        stack_step(blocks, x, off)
    gc.collect()
    assert off.pool.bytes_in_use == 0 and off.num_live == 0
    want = stack_step(blocks, x, plain=True)
    assert all(torch.equal(a, b) for a, b in zip(stack_step(blocks, x, off), want))


def test_pool_limit_raises_naming_the_setting_and_recovers():
    blocks = [Block(width=512) for _ in range(3)]  # 2 x 512 fp32 rows: one 1 MiB size class per layer input
    x = torch.randn(2, 512)
    off = ActivationOffloader("cpu", pool=HostBufferPool(max_bytes=2 * MIB, pin_memory=False))
    with pytest.raises(OffloadMemoryError, match=r"max_bytes=.*offload_activations=False"):
        stack_step(blocks, x, off)
    gc.collect()
    assert off.pool.bytes_in_use == 0 and off.num_live == 0
    off.pool.max_bytes = 3 * MIB
    want = stack_step(blocks, x, plain=True)
    assert all(torch.equal(a, b) for a, b in zip(stack_step(blocks, x, off), want))


def test_pinned_allocation_failure_names_the_setting():
    def fail(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    pool = HostBufferPool(allocator=fail)
    with pytest.raises(OffloadMemoryError, match=r"pinned host memory.*offload_activations=False") as err:
        pool.acquire(5 * MIB)
    assert "max_bytes" in str(err.value) and "cudaHostAlloc" in str(err.value)
    assert pool.bytes_held == 0


# --- the pool ----------------------------------------------------------------------------------------------------


def test_pool_does_not_grow_over_100_steps():
    blocks = [Block() for _ in range(4)]
    off = ActivationOffloader("cpu")
    x = torch.randn(8, 16)
    for step in range(100):
        for _micro in range(2):  # gradient accumulation: two micro-batches per step
            h = x * 1.0
            for block in blocks:
                h = offload_checkpoint(block, h, offloader=off)
            h.sum().backward()
        if step == 0:
            warm = off.pool.num_allocations
        assert off.pool.bytes_in_use == 0 and off.num_live == 0
    assert warm == len(blocks) and off.pool.num_allocations == warm


def test_pool_reuses_buffers_across_nearby_sizes_and_evicts_under_its_limit():
    pool = HostBufferPool(max_bytes=40 * MIB, pin_memory=False)
    a = pool.acquire(17 * MIB)
    pool.release(a)
    b = pool.acquire(17 * MIB + 12345)  # same size class: the same buffer
    assert b.data_ptr() == a.data_ptr() and pool.num_allocations == 1
    pool.release(b)
    c = pool.acquire(30 * MIB)  # 18 + 30 > 40 MiB: the free 18 MiB buffer is dropped first
    assert pool.num_allocations == 2 and pool.bytes_held == c.numel() and pool.num_free == 0
    with pytest.raises(OffloadMemoryError, match="max_bytes"):
        pool.acquire(20 * MIB)  # the 30 MiB buffer is in use: nothing to evict
    pool.release(c)
    assert pool.bytes_in_use == 0 and pool.bytes_free == c.numel()


@given(st.integers(min_value=0, max_value=1 << 40), st.sampled_from([1, 8]))
def test_size_class_bounds(nbytes, steps):
    size = size_class(nbytes, steps)
    assert size >= nbytes and size >= MIB
    assert size <= max(MIB, nbytes * (1 + 1 / steps))
    assert size_class(size, steps) == size
    if steps == 1:
        assert size & (size - 1) == 0  # what torch's pinned allocator gives anyway


# --- wrapped layers: the forward under no_grad, the recompute in the backward ---------------------------------------


def grad_modes(module: nn.Module) -> list[bool]:
    """torch.is_grad_enabled() at each run of `module`, in order."""
    modes = []
    module.register_forward_pre_hook(lambda *a: modes.append(torch.is_grad_enabled()))
    return modes


def test_wrapped_layers_run_forward_without_grad_and_recompute_with_it():
    """A wrapped layer's forward builds no graph (nothing saved, no pack hooks: the host work this scheme removes);
    its backward runs it once more, with grad."""
    model = tiny_model("qwen2", layers=2)
    modes = [grad_modes(layer.mlp) for layer in decoder(model).layers]
    enable_offload_checkpointing(decoder(model).layers, offloader=ActivationOffloader("cpu"))
    train_step(model, batches())
    assert modes == [[False, True], [False, True]]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_wrapped_layers_grads_bitwise_with_dropout_and_autocast(arch):
    """Attention dropout draws random numbers: the recompute must draw the same (the RNG is restored, then left as
    torch's checkpoint leaves it); under CPU bf16 autocast it must cast as the forward did."""
    model = tiny_model(arch)
    for layer in decoder(model).layers:
        layer.self_attn.attention_dropout = 0.3
    data = batches(n=2)

    def step():
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads = train_step(model, data)
        return grads, torch.get_rng_state()

    hf_checkpointing(model, True)
    want, want_rng = step()
    hf_checkpointing(model, False)
    enable_offload_checkpointing(decoder(model).layers, offloader=ActivationOffloader("cpu"))
    got, got_rng = step()
    assert_grads_equal(got, want)
    assert torch.equal(got_rng, want_rng)
    torch.manual_seed(6)  # the check can fail: other draws, other gradients
    with torch.autocast("cpu", dtype=torch.bfloat16):
        other = train_step(model, data)
    assert not all(torch.equal(other[n], want[n]) for n in want)


def test_wrapped_layers_retain_graph_twice_doubles_the_gradients():
    blocks = [Block() for _ in range(3)]
    off = ActivationOffloader("cpu")
    enable_offload_checkpointing(blocks, offloader=off)
    h = torch.randn(3, 16, requires_grad=True) * 1.0
    for block in blocks:
        h = block(h)
    loss = h.square().sum()
    loss.backward(retain_graph=True)
    once = blocks[0].fc.weight.grad.clone()
    assert off.pool.bytes_in_use > 0  # kept for the second backward
    loss.backward()
    torch.testing.assert_close(blocks[0].fc.weight.grad, 2 * once, rtol=0, atol=0)
    del loss, h
    assert off.pool.bytes_in_use == 0
    assert [b.runs for b in blocks] == [3, 3, 3]


def test_wrapped_layer_frees_its_buffer_after_the_backward():
    """Without retain_graph the host buffer is back in the pool once the backward has run, while the output (and so
    the graph) is still referenced: the next micro-batch reuses it."""
    block = Block()
    off = ActivationOffloader("cpu")
    enable_offload_checkpointing([block], offloader=off)
    x = torch.randn(3, 16, requires_grad=True)
    out = block(x * 1.0)
    assert off.pool.bytes_in_use > 0
    out.sum().backward()
    assert off.pool.bytes_in_use == 0 and out.grad_fn is not None


def test_wrapped_layer_returning_a_tuple():
    """A layer returning (hidden, None), as HF layers did before transformers 5: the None passes through and the
    gradients are those of the layer run plainly."""

    class TupleBlock(Block):
        def forward(self, hidden_states):
            return super().forward(hidden_states), None

    block, plain = TupleBlock(), TupleBlock()
    plain.load_state_dict(block.state_dict())
    enable_offload_checkpointing([block], offloader=ActivationOffloader("cpu"))
    x = torch.randn(3, 16)
    grads = []
    for layer in (block, plain):
        h = x.detach().requires_grad_()
        out, extra = layer(h * 1.0)
        assert extra is None
        out.square().sum().backward()
        grads.append((h.grad, layer.fc.weight.grad))
    assert block.grad_modes == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _whole(tensor):
    """A gradient FSDP2 left as a DTensor, as one tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("case", ["scale_requires_grad", "tokens_above_the_mlp_chunk", "sharded_by_fsdp2"])
def test_wrapped_layers_fall_back_to_torch_checkpoint(case, tmp_path):
    """Where the recompute in the backward cannot be used (or costs more), torch's non-reentrant checkpoint runs
    (the forward with grad): same gradients either way."""
    block = Block()
    x = torch.randn(2, 5, 16)
    scale = torch.tensor(0.5, requires_grad=case == "scale_requires_grad")
    enable = dict(tiled_mlp_chunk_tokens=9) if case == "tokens_above_the_mlp_chunk" else {}  # 10 tokens
    want_block = copy.deepcopy(block)

    def run(layer, call):
        layer.zero_grad(set_to_none=True)
        scale.grad = None
        layer.grad_modes.clear()
        h = x.detach().requires_grad_()
        call(h, scale).sum().backward()
        return list(layer.grad_modes), [h.grad, layer.fc.weight.grad, scale.grad]

    _, want = run(want_block, lambda h, s: checkpoint(want_block, h, s, use_reentrant=False))
    enable_offload_checkpointing([block], offloader=ActivationOffloader("cpu"), **enable)
    sharded = case == "sharded_by_fsdp2"
    if sharded:  # as the trainer does: offload enabled by patch_model, then fully_shard on each layer
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        fully_shard(block, mesh=init_device_mesh("cpu", (1,)))
    try:
        got_modes, got = run(block, block)
    finally:
        if sharded:
            torch.distributed.destroy_process_group()
    assert got_modes == [True, True]
    assert all(torch.equal(_whole(a), b) if b is not None else a is None for a, b in zip(got, want))
    block.zero_grad(set_to_none=True)
    if case == "tokens_above_the_mlp_chunk":  # the same call without the reason: one token packed
        enable_offload_checkpointing([block], offloader=ActivationOffloader("cpu"))
        got_modes, again = run(block, block)
        assert got_modes == [False, True]
        assert all(torch.equal(a, b) if b is not None else a is None for a, b in zip(again, want))


def _lora_model(device: str = "cpu", mlp_chunk_tokens: int | None = None):
    """The built-in task's tiny Qwen2 with LoRA on every linear, patched, its layers offload-checkpointed: on the
    CPU through ActivationOffloader("cpu"), on CUDA through the default (pinned, asynchronous) offloader.
    mlp_chunk_tokens: patch_model's, its MLPs tiled (a micro-batch of 24 tokens above a chunk of 16: the recompute
    in the backward skips the tiled MLP's forward)."""
    from peft import LoraConfig, get_peft_model

    import fastgrpo
    from fastgrpo.train import default_task

    model = default_task.build_model(default_task.build_tokenizer(), seed=0)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # B != 0: every adapter's gradient depends on the layers above it
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    offloader = ActivationOffloader("cpu") if device == "cpu" else None
    if mlp_chunk_tokens is not None:
        return fastgrpo.patch_model(model.to(device), offload_activations=offloader or True,
                                    mlp_chunk_tokens=mlp_chunk_tokens).train()
    model = fastgrpo.patch_model(model.to(device))
    enable_offload_checkpointing(decoder_layers(model, architecture(model)), offloader=offloader)
    return model.train()


def _micro_batches(rank: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(3, 30, (2, 12), generator=g).to(device) for _ in range(2)]


def _lora_loss(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float().logsumexp(-1).mean()


def _trained_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def _ddp_rank(rank: int, backend: str, store: str, out: str, mlp_chunk_tokens: int | None) -> None:
    from fastgrpo.train.process_group import _close_process_group

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # 2 processes on a 2-core CI machine
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        found = _ddp_steps(rank, device, mlp_chunk_tokens)
        if rank == 0:
            torch.save(found, out)
    finally:
        # as at torchrun's exit: the model and its DDP wrapper, local to _ddp_steps, are collected before the group
        # closes (DDP's reducer freed after it aborted rank 1 now and then)
        _close_process_group()


def _ddp_steps(rank: int, device: str, mlp_chunk_tokens: int | None) -> dict:
    model = _lora_model(device, mlp_chunk_tokens)
    modes = [grad_modes(layer.mlp) for layer in decoder_layers(model, architecture(model))]
    ddp = nn.parallel.DistributedDataParallel(model)
    steps = []
    for _ in range(2):  # DDP orders its buckets anew after the first step, by when the gradients came
        model.zero_grad(set_to_none=True)
        first, last = _micro_batches(rank, device)
        with ddp.no_sync():
            _lora_loss(ddp, first).backward()
        _lora_loss(ddp, last).backward()
        steps.append(_trained_grads(model))
    return {"steps": steps, "modes": modes}


@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                     reason="needs 2 CUDA GPUs")]),
])
@pytest.mark.parametrize("mlp_chunk_tokens", [None, 16], ids=["untiled", "tiled"])
def test_ddp_averages_the_gradients_of_layers_recomputed_in_the_backward(backend, mlp_chunk_tokens, tmp_path):
    """LoRA under DDP, 2 processes, 2 micro-batches each (no_sync on the first): the layers run their forward
    without grad and recompute in the backward, and every adapter's gradient is the mean of the two processes' own
    (one process each, the same kernels on the same inputs). Bit for bit: DDP halves each gradient before summing
    two, and halving is exact. Each rank on its own GPU under NCCL, with the real pinned, asynchronous offload.
    Tiled: the MLPs run in chunks, skipped in the recompute; their parameters' gradients come from the chunks'
    backward inside the layer's."""
    import torch.multiprocessing as mp

    device = "cuda" if backend == "nccl" else "cpu"
    out = str(tmp_path / "found.pt")
    # spawned, not forked: a child forked after this process ran OpenMP work could hang in its first parallel GEMM
    ranks = mp.start_processes(_ddp_rank, args=(backend, str(tmp_path / "store"), out, mlp_chunk_tokens), nprocs=2,
                               start_method="spawn", join=False)
    deadline = time.monotonic() + 120  # a hung rank fails this test instead of stalling the suite
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the 2 DDP processes did not finish in 120 s")
    found = torch.load(out)
    assert found["modes"] and all(m == [False, True] * 4 for m in found["modes"])  # 2 steps x 2 micro-batches
    alone = []
    for rank in range(2):
        model = _lora_model(device, mlp_chunk_tokens)
        for ids in _micro_batches(rank, device):
            _lora_loss(model, ids).backward()
        alone.append(_trained_grads(model))
    for step in found["steps"]:
        assert step.keys() == alone[0].keys() and len(step) > 20
        for name in step:
            mean = (alone[0][name] + alone[1][name]) / 2
            assert torch.equal(step[name], mean), (name, (step[name] - mean).abs().max().item())
        assert all(g.abs().max() > 0 for g in step.values())


# --- fallbacks, no_grad, enable/disable ---------------------------------------------------------------------------


def test_disabled_offloader_is_plain_checkpointing():
    blocks = [Block() for _ in range(2)]
    x = torch.randn(3, 16)
    off = ActivationOffloader("cpu", enabled=False)
    want = stack_step(blocks, x, plain=True)
    assert all(torch.equal(a, b) for a, b in zip(stack_step(blocks, x, off), want))
    assert off.pool.num_allocations == 0


def test_no_grad_and_eval_just_run_the_layer():
    block = Block()
    off = ActivationOffloader("cpu")
    enable_offload_checkpointing([block], offloader=off)
    x = torch.randn(2, 16, requires_grad=True)
    with torch.no_grad():
        block(x)
    block.eval()
    block(x).sum().backward()
    assert block.runs == 2 and off.pool.num_allocations == 0  # no recompute, nothing offloaded
    block.train()
    block(x).sum().backward()
    assert block.runs == 4 and off.pool.num_allocations == 1  # forward + recompute


def test_enable_is_idempotent_and_disable_restores_exactly():
    model = tiny_model("qwen2", layers=2)
    layers = decoder(model).layers
    own = layers[0].forward
    layers[0].forward = own  # an instance-level forward that must come back as the same object
    before = [dict(layer.__dict__) for layer in layers]
    calls = []
    layers[1].mlp.register_forward_pre_hook(lambda *a: calls.append(1))

    enable_offload_checkpointing(layers, offloader=ActivationOffloader("cpu"))
    enable_offload_checkpointing(layers)
    train_step(model, batches())
    assert len(calls) == 2  # forward + one recompute: wrapped once
    disable_offload_checkpointing(layers)
    disable_offload_checkpointing(layers)
    for layer, saved in zip(layers, before):
        assert layer.__dict__.keys() == saved.keys()
        assert all(layer.__dict__[k] is v for k, v in saved.items())


def test_never_checkpoints_twice_with_hf_checkpointing():
    model = tiny_model("qwen2", layers=2)
    layers = decoder(model).layers
    calls = []
    layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    data = batches()

    hf_checkpointing(model, True)  # on before ours: ours takes over, HF's comes back on disable
    enable_offload_checkpointing(layers, offloader=ActivationOffloader("cpu"))
    assert not any(layer.gradient_checkpointing for layer in layers)
    train_step(model, data)
    assert len(calls) == 2
    disable_offload_checkpointing(layers)
    assert all(layer.gradient_checkpointing for layer in layers)

    off = ActivationOffloader("cpu")
    enable_offload_checkpointing(layers, offloader=off)
    hf_checkpointing(model, True)  # on after ours: HF's runs alone, with a warning
    calls.clear()
    with pytest.warns(UserWarning, match="HF gradient checkpointing"):
        train_step(model, data)
    assert len(calls) == 2 and off.pool.num_allocations == 0


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="layers"):
        enable_offload_checkpointing([nn.Linear(2, 2), "not a layer"])
    with pytest.raises(ValueError, match="prefetch"):
        ActivationOffloader("cpu", prefetch=-1)
    with pytest.raises(ValueError, match="device"):
        ActivationOffloader("meta")
    with pytest.raises(ValueError, match="max_bytes"):
        HostBufferPool(max_bytes=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: CUDA is not available"):
            ActivationOffloader("cuda")


# --- patch_model(recompute_layers=N): only the first N layers checkpointed -----------------------------------------


def _attention_runs(model) -> list[int]:
    """Per decoder layer, how often its attention module ran (a checkpointed layer's recompute runs it again)."""
    runs = [0] * len(decoder(model).layers)
    for i, layer in enumerate(decoder(model).layers):
        layer.self_attn.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, None])
def test_recompute_layers_checkpoints_only_the_first_n(arch, n):
    """The first n layers run twice (forward + recompute) and offload their input; the rest run once. The gradients
    are bitwise those of the patched model without checkpointing: a recompute on the CPU repeats the same ops."""
    from fastgrpo.patching import patch_model

    steps = batches(n=2)
    want = train_step(patch_model(tiny_model(arch), offload_activations=False), steps)
    offloader = ActivationOffloader("cpu", pool=HostBufferPool(pin_memory=False))  # the offload path on CPU tensors
    model = patch_model(tiny_model(arch), offload_activations=offloader, recompute_layers=n)
    runs = _attention_runs(model)
    got = train_step(model, steps)
    checkpointed = 3 if n is None else n
    assert runs == [4] * checkpointed + [2] * (3 - checkpointed)  # two micro-batches
    assert offloader.pool.num_allocations == checkpointed  # one host buffer per offloaded input, reused
    assert model.fastgrpo_patch_summary["patched"].get("offload_activations", 0) == checkpointed
    assert_grads_equal(got, want)


def test_recompute_layers_tiles_the_mlp_of_checkpointed_layers_only():
    from fastgrpo.patching import patch_model

    model = patch_model(tiny_model(), offload_activations=True, recompute_layers=1, mlp_chunk_tokens=4)
    assert model.fastgrpo_patch_summary["patched"]["tiled_mlp"] == 1  # a kept layer holds its intermediates anyway
    assert "forward" in decoder(model).layers[0].mlp.__dict__
    model = patch_model(model, offload_activations=True, recompute_layers=1, tiled_mlp=True, mlp_chunk_tokens=4)
    assert model.fastgrpo_patch_summary["patched"]["tiled_mlp"] == 3  # forced: every MLP
    model = patch_model(model, offload_activations=True, recompute_layers=0)
    assert model.fastgrpo_patch_summary["patched"].get("tiled_mlp", 0) == 0


def test_recompute_layers_repatched_unwraps_the_kept_layers():
    from fastgrpo.patching import patch_model, unpatch_model

    model = patch_model(tiny_model(), offload_activations=True)
    patch_model(model, offload_activations=True, recompute_layers=1)
    assert ["_fastgrpo_offload" in layer.__dict__ for layer in decoder(model).layers] == [True, False, False]
    unpatch_model(model)
    assert ["_fastgrpo_offload" in layer.__dict__ for layer in decoder(model).layers] == [False, False, False]


def test_recompute_layers_bad_values_name_the_argument():
    from fastgrpo.patching import patch_model

    model = tiny_model()
    for value, message in [(4, "expected at most the model's 3 decoder layers, got 4"), (-1, "expected an int >= 0"),
                           (True, "expected an int >= 0"), ("2", "expected an int >= 0")]:
        with pytest.raises(ValueError, match=f"recompute_layers: {message}"):
            patch_model(model, offload_activations=True, recompute_layers=value)
    with pytest.raises(ValueError, match="recompute_layers: chooses the layers offload_activations checkpoints"):
        patch_model(model, recompute_layers=1)
    assert "fastgrpo_patch_summary" not in model.__dict__  # refused before anything was bound


def test_trainer_recompute_layers_with_hf_checkpointing(tmp_path):
    """GRPOConfig(gradient_checkpointing=True, recompute_layers=1): HF's per-layer flag stays on in the first layer
    only; alongside offload_activations the first layer is ours and the others run plain."""
    from fastgrpo import GRPOConfig
    from fastgrpo.train import default_task
    from fastgrpo.train.loading import load_model_and_tokenizer

    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    base = dict(model=str(tmp_path), dtype="float32", device="cpu", recompute_layers=1)
    model, _ = load_model_and_tokenizer(GRPOConfig(**base, gradient_checkpointing=True, patch=False))
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    model, _ = load_model_and_tokenizer(GRPOConfig(**base, gradient_checkpointing=True, offload_activations=True))
    assert [(layer.gradient_checkpointing, "_fastgrpo_offload" in layer.__dict__)
            for layer in model.model.layers] == [(False, True), (False, False)]
    with pytest.raises(ValueError, match="recompute_layers: expected at most the model's 2 decoder layers, got 3"):
        load_model_and_tokenizer(GRPOConfig(**{**base, "recompute_layers": 3}, gradient_checkpointing=True))


# --- GPU -----------------------------------------------------------------------------------------------------------


def _gpu_model(layers=4, dtype=torch.bfloat16):
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().train()


def _gpu_batches(n=2, B=2, T=512):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 512, (B, T), generator=g).cuda(), torch.ones(B, T, dtype=torch.long, device="cuda"))
            for _ in range(n)]


# --- giving host memory back ------------------------------------------------------------------------------------


def test_clear_while_offloaded_keeps_the_inputs_and_drops_their_buffers_after():
    blocks = [Block() for _ in range(3)]
    x = torch.randn(4, 16)
    want = stack_step(blocks, x, plain=True)
    off = ActivationOffloader("cpu")
    x = x.detach().requires_grad_()
    h = x * 1.0
    for block in blocks:
        h = offload_checkpoint(block, h, offloader=off)
    in_flight = off.pool.bytes_in_use
    offload.release_host_memory(off)
    assert off.pool.bytes_held == in_flight  # what the live inputs hold stays with them
    # New requests get new buffers, never the in-flight ones: spoil what they get.
    spoiled = [off.pool.acquire(1) for _ in range(3)]
    for buf in spoiled:
        buf.fill_(255)
    h.square().sum().backward()
    got = [x.grad] + [p.grad for b in blocks for p in b.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for buf in spoiled:
        off.pool.release(buf)
    assert off.pool.bytes_in_use == 0 and off.pool.bytes_held == sum(buf.numel() for buf in spoiled)
    offload.release_host_memory(off)
    assert off.pool.bytes_held == 0 and off.pool.num_free == 0


def test_release_host_memory_empties_the_default_pools(monkeypatch):
    monkeypatch.setattr(offloader_module, "_DEFAULT_OFFLOADERS", {})
    pool = offload.default_offloader("cpu").pool
    pool.release(pool.acquire(3 * MIB))
    assert pool.bytes_held > 0
    offload.release_host_memory()
    assert pool.bytes_held == 0
    with pytest.raises(ValueError, match="offloader: expected an ActivationOffloader or None, got HostBufferPool"):
        offload.release_host_memory(pool)


def test_disabling_the_last_layer_on_the_default_offloader_releases_it(monkeypatch):
    monkeypatch.setattr(offloader_module, "_DEFAULT_OFFLOADERS", {})
    monkeypatch.setattr(checkpointing_module, "_DEFAULT_USERS", weakref.WeakSet())
    pool = offload.default_offloader("cpu").pool
    a, b, own = Block(), Block(), Block()
    enable_offload_checkpointing([a, b])
    enable_offload_checkpointing([own], offloader=ActivationOffloader("cpu"))
    pool.release(pool.acquire(MIB))
    disable_offload_checkpointing([a, own])
    assert pool.bytes_held == MIB  # b still uses it
    disable_offload_checkpointing([b])
    assert pool.bytes_held == 0


def test_del_frees_an_enabled_layer_without_gc():
    block = Block()
    enable_offload_checkpointing([block], offloader=ActivationOffloader("cpu"))
    block(torch.randn(2, 16, requires_grad=True)).sum().backward()
    ref = weakref.ref(block)
    gc.collect()
    gc.disable()
    try:
        del block
        assert ref() is None
    finally:
        gc.enable()


def _max_rel_err(got: dict, want: dict) -> float:
    return max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item() for k in want)


@pytest.mark.gpu
def test_gpu_grads_within_bf16_noise_of_hf_checkpointing():
    data = _gpu_batches()
    model = _gpu_model()
    want = train_step(copy.deepcopy(model).float(), data)  # fp32 oracle on the same (bf16-rounded) weights
    hf_checkpointing(model, True)
    hf = train_step(model, data)
    hf_checkpointing(model, False)
    off = ActivationOffloader("cuda")
    enable_offload_checkpointing(decoder(model).layers, offloader=off)
    ours = train_step(model, data)
    torch.cuda.synchronize()
    err_hf, err_ours = _max_rel_err(hf, want), _max_rel_err(ours, want)
    assert err_ours <= 1.1 * err_hf + 1e-3, (err_ours, err_hf)
    assert off.pool.num_allocations == len(decoder(model).layers) and off.pool.pin_memory
    assert off.pool.bytes_in_use == 0 and off.num_live == 0


@pytest.mark.gpu
def test_gpu_recompute_layers_offloads_the_first_n_within_bf16_noise():
    """patch_model(recompute_layers=2) of 4 layers on the CUDA offloader: two inputs offloaded, two layers run once,
    gradients as close to the fp32 oracle as HF checkpointing's (the same bound as the test above)."""
    from fastgrpo.patching import patch_model

    data = _gpu_batches()
    model = _gpu_model()
    want = train_step(copy.deepcopy(model).float(), data)
    hf_checkpointing(model, True)
    hf = train_step(model, data)
    hf_checkpointing(model, False)
    off = ActivationOffloader("cuda")
    # the kernels off: the layers' math is HF's, as in the test above; only the checkpointing differs
    patch_model(model, rms_norm=False, rope=False, swiglu=False, offload_activations=off, recompute_layers=2)
    runs = _attention_runs(model)
    ours = train_step(model, data)
    torch.cuda.synchronize()
    err_hf, err_ours = _max_rel_err(hf, want), _max_rel_err(ours, want)
    assert err_ours <= 1.1 * err_hf + 1e-3, (err_ours, err_hf)
    assert runs == [4, 4, 2, 2]
    assert off.pool.num_allocations == 2 and off.pool.bytes_in_use == 0 and off.num_live == 0


@pytest.mark.gpu
def test_gpu_layer_inputs_leave_the_gpu():
    """After forward, HF checkpointing holds every layer input on the GPU; offload holds about none."""
    model = _gpu_model(layers=6)
    ids, mask = _gpu_batches(n=1, B=4, T=1024)[0]
    input_bytes = ids.numel() * model.config.hidden_size * 2

    def allocated_after_forward():
        # Earlier tests leave CUDA tensors in reference cycles (models with instance-bound forwards): a gc pass
        # inside the forward would free them and shrink `held`. Cached blocks split to fit earlier tests' sizes
        # may be handed out whole (a block is not split when < 1 MiB would remain) and grow it.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = decoder(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.cuda.synchronize()
        # An input freed while its copy to the host ran (record_stream) counts as allocated until the allocator
        # next processes its events, at a malloc or here: without this, ours could count 1-2 inputs too many.
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        return held

    hf_checkpointing(model, True)
    hf = allocated_after_forward()
    hf_checkpointing(model, False)
    enable_offload_checkpointing(decoder(model).layers, offloader=ActivationOffloader("cuda"))
    ours = allocated_after_forward()
    assert hf - ours >= 0.9 * (len(decoder(model).layers) - 1) * input_bytes, (hf, ours, input_bytes)


@pytest.mark.gpu
def test_gpu_pinned_limit_error_then_recovery():
    model = _gpu_model()
    data = _gpu_batches(n=1)
    want_layers = len(decoder(model).layers)
    off = ActivationOffloader("cuda", pool=HostBufferPool(max_bytes=2 * MIB))
    enable_offload_checkpointing(decoder(model).layers, offloader=off)
    with pytest.raises(OffloadMemoryError, match=r"max_bytes=.*offload_activations=False"):
        train_step(model, data)
    gc.collect()
    assert off.pool.bytes_in_use == 0 and off.num_live == 0
    off.pool.max_bytes = None
    hf_checkpointing(model, True)
    disable_offload_checkpointing(decoder(model).layers)
    want = train_step(model, data)
    hf_checkpointing(model, False)
    enable_offload_checkpointing(decoder(model).layers, offloader=off)
    got = train_step(model, data)
    assert _max_rel_err(got, want) < 1e-2
    assert off.pool.num_allocations == want_layers


@pytest.mark.gpu
def test_gpu_exception_in_layer_leaves_stream_and_pool_usable():
    blocks = [Block(width=256).cuda() for _ in range(3)]
    x = torch.randn(64, 256, device="cuda")
    off = ActivationOffloader("cuda")
    want = stack_step(blocks, x, plain=True)
    blocks[1].fail_on_run = blocks[1].runs + 1
    with pytest.raises(RuntimeError, match="boom"):
        stack_step(blocks, x, off)
    gc.collect()
    assert off.pool.bytes_in_use == 0 and off.num_live == 0
    for _ in range(3):
        got = stack_step(blocks, x, off)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert off.pool.num_allocations == 3


@pytest.mark.gpu
def test_gpu_unpatch_gives_the_pinned_memory_back(monkeypatch):
    from fastgrpo.patching import patch_model, unpatch_model

    monkeypatch.setattr(checkpointing_module, "_DEFAULT_USERS", weakref.WeakSet())  # layers earlier tests left enabled
    model = _gpu_model()
    offload.release_host_memory()  # what earlier tests left in the default pools and torch's pinned cache
    pinned_before = _pinned_bytes()
    patch_model(model, offload_activations=True)
    train_step(model, _gpu_batches(n=1))
    torch.cuda.synchronize()
    pool = offload.default_offloader("cuda").pool
    assert pool.pin_memory and pool.bytes_held >= (len(decoder(model).layers) - 1) * MIB
    unpatch_model(model)
    assert pool.bytes_held == 0
    if pinned_before is None:
        pytest.skip("no torch.cuda.host_memory_stats in this torch: the pool is empty, torch's pinned pages unchecked")
    assert _pinned_bytes() <= pinned_before  # torch's pinned cache emptied too: the pages went back to the OS


def _pinned_bytes() -> int | None:
    """Pinned host bytes torch's host allocator holds (in use + cached), or None where torch does not say."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return stats.get("allocated_bytes.current")


@pytest.mark.gpu
def test_gpu_del_frees_a_patched_model_without_gc():
    from fastgrpo.patching import patch_model

    ids, mask = _gpu_batches(n=1)[0]

    def trained_patched_model():
        model = patch_model(_gpu_model(), offload_activations=True)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()  # fused loss + offload + tiled MLP
        return model

    trained_patched_model()  # warm-up: cuBLAS workspaces, kernels and the copy stream outlive the model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    model = trained_patched_model()
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    weights_and_grads = sum(t.numel() * t.element_size() for t in tensors)
    del tensors
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - baseline >= weights_and_grads
    gc.collect()  # anything else in cycles goes now: below, only reference counting frees memory
    gc.disable()
    try:
        del model
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # inputs freed under record_stream count until their events are processed
        assert torch.cuda.memory_allocated() <= baseline
    finally:
        gc.enable()
