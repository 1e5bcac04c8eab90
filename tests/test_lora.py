"""fastgrpo.ops.lora and patch_model's fused_lora against PEFT 0.21's LoRA Linear (real PEFT, tiny shapes, CPU).

The claims: the forward is bitwise PEFT's and so are the gradients of one chunk; chunked gradients are within fp32
rounding of fp64; every case PEFT's vanilla branch does not cover runs PEFT's forward; the backward keeps the
layer's input instead of a copy in the adapter's dtype.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from peft.helpers import disable_input_dtype_casting
import torch.nn.functional as F
from torch import nn

import fastgrpo.patching.forwards as forwards
from fastgrpo.ops.lora import lora_delta
from fastgrpo.patching import patch_model, unpatch_model
from fastgrpo.patching.forwards import lora_linear_forward
from tests.test_patching import batch, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (base dtype, adapter dtype): PEFT upcasts adapters of a bf16 base to fp32 by default; bf16 adapters on request.
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]
# Relative to the largest fp64 value: fp32 sums of <= 100 products; bf16 rounds h and the output (eps 7.8e-3).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ONLY_LORA = dict(rms_norm=False, rope=False, swiglu=False, fused_loss=False)  # the rest stays PEFT's / HF's


class Proj(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def lora_layer(in_features, out_features, r, alpha, base_dtype, adapter_dtype, seed=0, **config):
    """A PEFT LoRA Linear around a frozen nn.Linear; init_lora_weights=False: B is not zero."""
    torch.manual_seed(seed)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], init_lora_weights=False, **config)
    model = get_peft_model(Proj(in_features, out_features).to(base_dtype), lora, autocast_adapter_dtype=False)
    layer = model.base_model.model.proj
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return layer


def fused(layer):
    """The forward patch_model binds, on one layer."""
    return types.MethodType(lora_linear_forward(layer.forward), layer)


def out_and_grads(layer, forward, x, grad_out):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = forward(x)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), x.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad]


shapes = dict(
    n=st.integers(1, 33).map(lambda k: 2 * k - 1),  # odd token counts
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    r=st.integers(1, 8),
    alpha=st.sampled_from([1, 8, 16, 32]),
    rslora=st.booleans(),
    dtypes=st.sampled_from(DTYPES),
)


@given(**shapes)
def test_patched_layer_is_bitwise_peft(n, in_features, out_features, r, alpha, rslora, dtypes):
    layer = lora_layer(in_features, out_features, r, alpha, *dtypes, use_rslora=rslora)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, in_features, generator=g).to(dtypes[0])
    grad_out = torch.randn(1, n, out_features, generator=g)
    want = out_and_grads(layer, layer.forward, x, grad_out)
    got = out_and_grads(layer, fused(layer), x, grad_out)
    for name, a, b in zip(["out", "dx", "dA", "dB"], got, want):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name


@given(**shapes, chunk_tokens=st.integers(1, 70))
def test_chunked_grads_within_rounding_of_fp64(n, in_features, out_features, r, alpha, rslora, dtypes, chunk_tokens):
    base_dtype, adapter_dtype = dtypes
    layer = lora_layer(in_features, out_features, r, alpha, base_dtype, adapter_dtype, use_rslora=rslora)
    weight_a, weight_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scaling = layer.scaling["default"]
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, in_features, generator=g).to(base_dtype)
    grad_out = torch.randn(2, n, out_features, generator=g).to(adapter_dtype)

    def run(x, a, b, delta):
        x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
        out = delta(x, a, b)
        return [out, *torch.autograd.grad(out, (x, a, b), grad_out.to(out.dtype))]

    peft_ops = lambda x, a, b: F.linear(F.linear(x, a), b) * scaling  # noqa: E731 (eager, fp64)
    want = run(x.double(), weight_a.double(), weight_b.double(), peft_ops)
    got = run(x, weight_a, weight_b, lambda x, a, b: lora_delta(x, a, b, scaling, chunk_tokens=chunk_tokens))
    low = TOL[torch.bfloat16 if torch.bfloat16 in dtypes else torch.float32]
    tols = [TOL[adapter_dtype], low, TOL[adapter_dtype], TOL[adapter_dtype]]  # dx is rounded to x's dtype
    for name, a, b, tol in zip(["out", "dx", "dA", "dB"], got, want, tols):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item(), msg=name)
    assert [t.dtype for t in got[1:]] == [base_dtype, adapter_dtype, adapter_dtype]


def test_frozen_input_gets_no_gradient():
    layer = lora_layer(8, 6, 2, 4, torch.bfloat16, torch.float32)
    x = torch.randn(5, 8, dtype=torch.bfloat16)  # e.g. the first layer's input without enable_input_require_grads
    fused(layer)(x).sum().backward()
    assert x.grad is None and layer.lora_A["default"].weight.grad is not None


def test_bad_input():
    a, b = torch.randn(4, 8), torch.randn(6, 4)
    with pytest.raises(ValueError, match="^x: "):
        lora_delta(torch.ones(3, 8, dtype=torch.long), a, b, 2.0)
    with pytest.raises(ValueError, match="^weight_a: expected shape \\[\\*, 7\\]"):
        lora_delta(torch.randn(3, 7), a, b, 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected shape \\[\\*, 4\\]"):
        lora_delta(torch.randn(3, 8), a, b.t(), 2.0)
    with pytest.raises(ValueError, match="^weight_b: expected the dtype of weight_a"):
        lora_delta(torch.randn(3, 8), a, b.bfloat16(), 2.0)
    with pytest.raises(ValueError, match="^scaling: "):
        lora_delta(torch.randn(3, 8), a, b, torch.tensor(2.0))
    with pytest.raises(ValueError, match="^chunk_tokens: "):
        lora_delta(torch.randn(3, 8), a, b, 2.0, chunk_tokens=0)


# --- patched PEFT models -------------------------------------------------------------------------------------------


def lora_model(dtype=torch.float32, seed=0, **config):
    """A tiny Qwen2 with LoRA on all linears; adapters in fp32 (PEFT's default for a bf16 base)."""
    model = tiny_model("qwen2", seed=seed).to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **config))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give A a gradient too
            nn.init.normal_(p, 0.0, 0.1)
    return model.train()


def loss_and_grads(model, ids, mask, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    loss = torch.log_softmax(out.logits.float(), -1)[..., 3].mean()
    if torch.is_grad_enabled() and loss.requires_grad:
        loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.fixture
def delta_calls(monkeypatch):
    """Counts the calls of lora_delta from the patched forwards."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return lora_delta(*args, **kwargs)

    monkeypatch.setattr(forwards, "lora_delta", counting)
    return calls


def test_patched_fp32_model_matches_unpatched(delta_calls):
    model = lora_model()
    patched = patch_model(copy.deepcopy(model), **ONLY_LORA)
    ids, mask = batch(1)
    logits, grads = loss_and_grads(model, ids, mask)
    logits_p, grads_p = loss_and_grads(patched, ids, mask)
    assert len(delta_calls) == len(TARGETS) * 2
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys() and sum("lora_A" in n for n in grads) == len(TARGETS) * 2
    for name in grads:  # dx of q, k, v adds up in another order: fp32 rounding, no more
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_patched_bf16_base_is_as_close_to_fp64_as_peft():
    model = lora_model(torch.bfloat16)
    patched = patch_model(copy.deepcopy(model), **ONLY_LORA)
    ids, mask = batch(2)
    mask = torch.ones_like(mask)  # fp64 eager attention gives NaN on fully masked (left-padded) rows
    logits, grads = loss_and_grads(model, ids, mask)
    logits_p, grads_p = loss_and_grads(patched, ids, mask)
    _, want = loss_and_grads(copy.deepcopy(model).double(), ids, mask)
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys() == want.keys()
    for name in want:
        err, err_p = ((g[name] - want[name]).norm() / want[name].norm() for g in (grads, grads_p))
        assert err_p <= 1.5 * err + 1e-3, name


FALLBACKS = ["dropout_in_training", "dora", "lora_bias", "merged", "disabled", "adapter_names", "autocast",
             "no_input_cast"]


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")  # Qwen2's o_proj and MLP have no bias
@pytest.mark.parametrize("case", FALLBACKS)
def test_cases_outside_the_vanilla_branch_run_peft(case, delta_calls):
    config = {"dropout_in_training": dict(lora_dropout=0.5), "dora": dict(use_dora=True),
              "lora_bias": dict(lora_bias=True)}.get(case, {})
    model = lora_model(**config)
    patched = patch_model(copy.deepcopy(model), **ONLY_LORA)
    assert patched.fastgrpo_patch_summary["patched"]["fused_lora"] == len(TARGETS) * 2
    ids, mask = batch(3)
    kwargs = {}
    if case == "merged":
        model.merge_adapter(), patched.merge_adapter()
    if case == "adapter_names":  # a mixed batch: PEFT allows it in eval mode only
        model.eval(), patched.eval()
        kwargs = dict(adapter_names=["default", "__base__"])
    contexts = {
        "disabled": lambda m: m.disable_adapter(),
        "autocast": lambda m: torch.autocast("cpu", dtype=torch.bfloat16),
        "no_input_cast": lambda m: disable_input_dtype_casting(m),
    }
    results = []
    for m in (model, patched):
        torch.manual_seed(5)  # the same dropout masks
        with contexts.get(case, lambda m: torch.enable_grad())(m):
            results.append(loss_and_grads(m, ids, mask, **kwargs))
    (logits, grads), (logits_p, grads_p) = results
    assert delta_calls == []
    assert torch.equal(logits_p, logits)
    assert grads.keys() == grads_p.keys()
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=0, atol=0, msg=name)


def test_dropout_in_eval_mode_takes_the_fused_path(delta_calls):
    model = lora_model(lora_dropout=0.5).eval()
    patched = patch_model(copy.deepcopy(model), **ONLY_LORA)
    ids, mask = batch(3)
    assert torch.equal(loss_and_grads(patched, ids, mask)[0], loss_and_grads(model, ids, mask)[0])
    assert len(delta_calls) == len(TARGETS) * 2


@pytest.mark.parametrize("second_dtype", [torch.float32, torch.bfloat16])
def test_two_active_adapters(second_dtype, delta_calls):
    """Both adapters' deltas are added; adapters of different dtypes run PEFT, which casts x to each in turn
    (fp32 -> bf16 -> fp32 rounds x for the second one)."""
    layer = lora_layer(12, 10, 3, 6, torch.float32, torch.float32)
    torch.manual_seed(1)
    layer.update_layer("second", 2, 4, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False))
    layer.to(torch.float32)
    for p in list(layer.lora_A["second"].parameters()) + list(layer.lora_B["second"].parameters()):
        p.data = p.data.to(second_dtype)
    order = ["second", "default"] if second_dtype == torch.bfloat16 else ["default", "second"]
    layer.set_adapter(order)
    x = torch.randn(7, 12)
    want, got = layer.forward(x), fused(layer)(x)
    assert torch.equal(got, want) and not torch.equal(want, layer.base_layer(x))
    assert len(delta_calls) == (2 if second_dtype == torch.float32 else 0)


def saved_tensors(run):
    """The tensors autograd saves while `run()` builds its graph."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saved


def test_saved_tensors_hold_the_input_not_an_fp32_copy():
    """q, k and v of a bf16 Qwen2 with fp32 adapters on one input: PEFT saves three fp32 copies of it (4 B per
    element each); the patched layers save the input itself (2 B per element, once)."""
    model = lora_model(torch.bfloat16)
    attn = model.base_model.model.model.layers[0].self_attn
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    params = {p.data_ptr() for p in model.parameters()}
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)  # x: [B, T, hidden]

    def activations(forwards):
        saved = saved_tensors(lambda: [f(x) for f in forwards])
        unique = {t.untyped_storage().data_ptr(): t for t in saved if t.data_ptr() not in params}
        return list(unique.values())

    peft_saved = activations([m.forward for m in layers])
    fused_saved = activations([fused(m) for m in layers])
    def inputs(saved):  # tensors of x's size (linear saves x as [N, in] rows)
        return [t for t in saved if t.numel() == x.numel() and t.shape[-1] == x.shape[-1]]

    assert [t.dtype for t in inputs(peft_saved)] == [torch.float32] * 3
    assert [t.data_ptr() for t in inputs(fused_saved)] == [x.data_ptr()]
    nbytes = [sum(t.nbytes for t in s) for s in (peft_saved, fused_saved)]
    r_outputs = 3 * 2 * 9 * 4 * 4  # the [N, r] fp32 lora_A outputs, kept by both
    assert nbytes == [3 * x.numel() * 4 + r_outputs, x.numel() * 2 + r_outputs]


def test_summary_option_and_unpatch():
    model = lora_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    patch_model(model, fused_lora=False)
    assert "fused_lora" not in model.fastgrpo_patch_summary["patched"] and "forward" not in layer.__dict__
    patch_model(model)
    summary = model.fastgrpo_patch_summary
    assert summary["options"]["fused_lora"] and summary["patched"]["fused_lora"] == len(TARGETS) * 2
    assert "forward" in layer.__dict__
    unpatch_model(model)
    assert "forward" not in layer.__dict__ and not hasattr(model.get_base_model(), "fastgrpo_patch_summary")


def test_deepcopy_falls_back_to_its_own_peft_forward():
    """The copy's PEFT forward (run under disable_adapter) must read the copy's base weights, not the original's."""
    patched = patch_model(lora_model(), **ONLY_LORA)
    twin = copy.deepcopy(patched)
    with torch.no_grad():
        for p in twin.get_base_model().model.layers[0].self_attn.q_proj.base_layer.parameters():
            p.mul_(2.0)
    ids, mask = batch(4)
    plain = unpatch_model(copy.deepcopy(twin))
    with twin.disable_adapter(), plain.disable_adapter(), torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, plain(input_ids=ids).logits)
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_offload_checkpointing_and_tiled_mlp_recompute_the_fused_forward(delta_calls):
    """patch_model's product path (offload checkpointing, which is plain checkpointing on the CPU, and the tiled
    MLP) with and without fused_lora: the same gradients; the recompute runs the fused forward."""
    model = lora_model()
    options = dict(offload_activations=True, mlp_chunk_tokens=4)
    patched, reference = patch_model(copy.deepcopy(model), **options), patch_model(model, **options, fused_lora=False)
    ids, mask = batch(5)
    _, want = loss_and_grads(reference, ids, mask)
    assert delta_calls == []
    _, got = loss_and_grads(patched, ids, mask)
    # forward (4 MLP chunks under no_grad) + checkpoint recompute of attention + MLP chunk recompute, per layer
    assert len(delta_calls) > 2 * len(TARGETS) * 2
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


# --- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_qwen2_lora_step_peaks_lower_with_matching_grads():
    """Two Qwen2.5-1.5B-shaped layers (bf16 base, fp32 LoRA r=16 on all linears) at 2 x 4096 tokens, patched with
    every other option the same: PEFT's saved fp32 input copies are (6 x 1536 + 8960) x 4 B = 72.6 KiB per token
    and layer; the fused branch keeps the bf16 inputs (at most 24 KiB where nothing else holds them)."""
    config = transformers.Qwen2Config(
        vocab_size=4096, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)).cuda().train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, 0.0, 0.02)
    assert model.base_model.model.model.layers[0].mlp.down_proj.lora_A["default"].weight.dtype == torch.float32
    ids = torch.randint(0, config.vocab_size, (2, 4096), generator=torch.Generator().manual_seed(1)).cuda()
    losses, grads, peaks = {}, {}, {}
    for fused_lora in (False, True):
        patch_model(model, fused_lora=fused_lora)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks[fused_lora] = torch.cuda.max_memory_allocated() - start
        losses[fused_lora] = loss.detach()
        grads[fused_lora] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        del loss
    assert model.fastgrpo_patch_summary["patched"]["fused_lora"] == len(TARGETS) * config.num_hidden_layers
    unpatch_model(model)
    # Same ops in the forward (bitwise on the CPU, see above); the backward sums dx of q, k, v in another order, so
    # LoRA grads of earlier layers differ by bf16 rounding of the activation gradients.
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) == 2 * len(TARGETS) * 2
    for name, want in grads[False].items():
        assert (grads[True][name] - want).norm() <= 2e-2 * want.norm(), name
    copies = config.num_hidden_layers * ids.numel() * (6 * 1536 + 8960) * 4
    assert peaks[False] - peaks[True] >= 0.4 * copies, (peaks, copies)
