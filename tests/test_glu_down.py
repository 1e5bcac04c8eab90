"""glu_down: the GLU product is not kept for the down projection's backward, and every gradient is bit for bit what
down(glu(gate, up)) gives (the product recomputed by the same kernel); other saved-tensor hooks keep theirs."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastgrpo.ops import glu_down as glu_down_module
from fastgrpo.ops.glu_down import glu_down
from fastgrpo.ops.swiglu import ACTIVATIONS, glu
from fastgrpo.patching import patch_model
from tests.test_tiled_mlp import tiny_model, with_lora


def kept_product(monkeypatch):
    """glu_down as it runs under other hooks: down(glu(gate, up)), the product saved by down."""
    monkeypatch.setattr(glu_down_module, "_other_hooks_active", lambda: True)


def gate_up(tokens, width, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, width, generator=g, dtype=dtype).requires_grad_() for _ in range(2)]


def product_alive_after_forward(down, gate, up, activation="silu"):
    """Whether the product down read is still alive once the forward has returned (the output kept)."""
    seen = []
    handle = down.register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(args[0])))
    try:
        out = glu_down(down, gate, up, activation)
    finally:
        handle.remove()
    gc.collect()
    return out, seen[0]() is not None


def test_the_product_is_freed_after_the_forward(monkeypatch):
    """A trained nn.Linear saves its input: with glu_down the product is gone once the forward returns; kept (the
    path under other hooks), it lives on in the graph (the check can fail)."""
    down = nn.Linear(24, 16)
    out, alive = product_alive_after_forward(down, *gate_up(10, 24))
    assert not alive
    kept_product(monkeypatch)
    out_kept, alive_kept = product_alive_after_forward(down, *gate_up(10, 24))
    assert alive_kept
    assert torch.equal(out, out_kept)


def test_no_grad_and_frozen_inputs_run_plain():
    """Without grad, or with gate and up not requiring grad (the GLU keeps nothing), there is nothing to recompute
    from: plain down(glu(...)), no hooks."""
    down = nn.Linear(24, 16)
    gate, up = (t.detach() for t in gate_up(6, 24))
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(glu_down_module, "_other_hooks_active", lambda: calls.append(1) or False)
        with torch.no_grad():
            glu_down(down, *gate_up(6, 24), "silu")
        glu_down(down, gate, up, "silu")
    assert calls == []


def grads(down, gate, up, activation, run):
    down.zero_grad(set_to_none=True)
    gate, up = (t.detach().requires_grad_() for t in (gate, up))
    out = run(down, gate, up, activation)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(grad_out)
    return [out, gate.grad, up.grad] + [p.grad for p in down.parameters()]


def plain(down, gate, up, activation):
    return down(glu(gate, up, activation))


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 37), width=st.integers(1, 29), out=st.integers(1, 19), bias=st.booleans(),
       activation=st.sampled_from(ACTIVATIONS), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_gradients_are_bit_for_bit_the_kept_products(tokens, width, out, bias, activation, dtype):
    torch.manual_seed(tokens * 131 + width)
    down = nn.Linear(width, out, bias=bias, dtype=dtype)
    gate, up = gate_up(tokens, width, dtype)
    got = grads(down, gate, up, activation, glu_down)
    want = grads(down, gate, up, activation, plain)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


def test_views_of_the_product_are_recomputed_with_their_geometry():
    """A down that saves a view of its input (here the rows flattened and a column slice) gets that view back."""
    class Down(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 6, dtype=torch.float64))

        def forward(self, x):
            return x.reshape(-1, x.shape[-1])[:, 1:7] @ self.weight.t()

    down = Down()
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(2, 3, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    got = grads(down, gate, up, "silu", glu_down)
    want = grads(down, gate, up, "silu", plain)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_under_other_saved_tensor_hooks_they_see_every_tensor():
    """torch calls only the innermost hooks: under a non-reentrant checkpoint (its hooks) glu_down keeps out, the
    checkpoint recomputes as usual, and the gradients are those of plain down(glu(...))."""
    from torch.utils.checkpoint import checkpoint

    down = nn.Linear(24, 16, dtype=torch.float64)
    gate, up = gate_up(9, 24, torch.float64)

    def checkpointed(run):
        return lambda d, g, u, a: checkpoint(run, d, g, u, a, use_reentrant=False)

    got = grads(down, gate, up, "silu", checkpointed(glu_down))
    want = grads(down, gate, up, "silu", checkpointed(plain))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        glu_down(down, *gate_up(9, 24, torch.float64), "silu")
    assert any(t.shape == (9, 24) and t.dtype == torch.float64 and not isinstance(t, nn.Parameter) for t in packed)


def assert_trains_as_with_the_product_kept(make_model, tokens, backwards=1):
    """A patched model's loss and its gradients after each of `backwards` backwards (retain_graph between them)
    equal bit for bit to those with the product kept, the down projection's LoRA A among them."""
    runs = []
    for keep in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if keep:
                kept_product(mp)
            model = make_model()
            ids = torch.randint(3, 96, (2, tokens), generator=torch.Generator().manual_seed(0))
            loss = model(input_ids=ids, labels=ids).loss
            grads = []
            for i in range(backwards):
                loss.backward(retain_graph=i < backwards - 1)
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            runs.append((loss.detach(), grads))
    (loss, grads), (loss_kept, grads_kept) = runs
    assert torch.equal(loss, loss_kept)
    for got, kept in zip(grads, grads_kept):
        assert got.keys() == kept.keys() and any("down_proj.lora_A" in n for n in got)
        for n in got:
            assert torch.equal(got[n], kept[n]), n


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma"])
def test_a_patched_lora_model_trains_as_with_the_product_kept(arch):
    """patch_model's MLP forward (separate gate/up, Phi-3's fused gate_up, Gemma's GeGLU) under PEFT LoRA on every
    MLP linear: loss and every gradient equal bit for bit to the product kept; a second backward (retain_graph)
    recomputes it again."""
    assert_trains_as_with_the_product_kept(
        lambda: patch_model(with_lora(tiny_model(arch, torch.float64)), offload_activations=False), 11, backwards=2)


@pytest.mark.gpu
def test_gpu_a_kept_llama_mlp_holds_one_product_less():
    """bf16 on CUDA (the Triton GLU, a PEFT LoRA down_proj over a frozen base): the memory the forward leaves for
    the backward is one [N, I] product less than with the product kept, and the gradients are bit for bit equal."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    tokens, hidden, width = 4096, 512, 1792
    module = nn.ModuleDict({"down_proj": nn.Linear(width, hidden, bias=False)})
    down = get_peft_model(module, LoraConfig(r=8, target_modules=["down_proj"])).base_model.model.down_proj
    down = down.to("cuda", torch.bfloat16)
    gate, up = (torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    held, results = {}, {}
    for keep in (False, True, False):  # the first run also allocates cuBLAS' workspace: measured again last
        with pytest.MonkeyPatch.context() as mp:
            if keep:
                kept_product(mp)
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = glu_down(down, g, u, "silu")
            held[keep] = torch.cuda.memory_allocated() - before
            out.float().square().sum().backward()
            results[keep] = [out, g.grad, u.grad] + [p.grad for p in down.parameters() if p.requires_grad]
            down.zero_grad(set_to_none=True)
    product = tokens * width * 2
    assert held[True] - held[False] == product, (held, product)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def test_an_fp8_base_lora_model_trains_as_with_the_product_kept():
    """patch_model(fp8_base=True) (the measured setting: the down projection's base in e4m3, its LoRA A gradient
    reading the product), bf16 on the CPU: loss and gradients equal bit for bit to the product kept."""
    assert_trains_as_with_the_product_kept(
        lambda: patch_model(with_lora(tiny_model("llama", torch.bfloat16)), offload_activations=False, fp8_base=True),
        9)
