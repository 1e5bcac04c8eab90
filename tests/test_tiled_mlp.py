"""Token-tiled MLP: gradients equal to the untiled MLP, no_grad, offload checkpointing, MLP forward counts, bad input.

The MLP forward count is the FLOP claim: under non-reentrant checkpointing (HF's or fastgrpo.offload's) the
recompute of a llama/qwen layer stops before a tiled MLP, so it runs twice per step, as an untiled one does.
"""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import transformers
from torch.utils.checkpoint import set_checkpoint_early_stop

from fastgrpo.offload import ActivationOffloader, enable_offload_checkpointing
from fastgrpo.ops.tiled_mlp import tiled_mlp
from fastgrpo.patching import patch_model, unpatch_model
from fastgrpo.patching.forwards import mlp_forward

TINY = dict(
    vocab_size=96, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
CONFIGS = {
    "llama": transformers.LlamaConfig,  # SwiGLU
    "gemma": transformers.GemmaConfig,  # GeGLU (tanh)
    "phi3": transformers.Phi3Config,  # one fused gate_up_proj
    "gemma2": lambda **kw: transformers.Gemma2Config(**kw, query_pre_attn_scalar=4),  # normalizes the MLP output
}
TIGHT = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def tiny_model(arch="llama", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    config = CONFIGS[arch](**TINY)
    config._attn_implementation = "eager"  # gemma2 has no sdpa
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    for p in model.parameters():
        if p.dim() == 1:  # norm weights start at 1 (Gemma: 0); randomize so the norms are not identities
            torch.nn.init.normal_(p, 0.0, 0.5)
    return model


def with_lora(model, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    targets = ["gate_proj", "up_proj", "gate_up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # nonzero, so both LoRA factors get gradients
    return model


def mlp_grads(mlp, x, grad_out, run):
    """(out, dx, {param: grad}) of run(mlp, x) against grad_out."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = run(mlp, x)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}


def assert_close_all(got, want, dtype):
    out, dx, grads = got
    out_w, dx_w, grads_w = want
    torch.testing.assert_close(out, out_w, **TIGHT[dtype])
    torch.testing.assert_close(dx, dx_w, **TIGHT[dtype])
    assert grads.keys() == grads_w.keys() and grads_w
    for name in grads_w:
        torch.testing.assert_close(grads[name], grads_w[name], **TIGHT[dtype], msg=name)


def count_mlp_rows(model) -> list[int]:
    """Tokens each MLP forward run sees, appended per call of down_proj (the last linear of every MLP)."""
    rows: list[int] = []
    for module in model.modules():
        if type(module).__name__.endswith("MLP"):
            module.down_proj.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[:-1].numel()))
    return rows


def decoder_step(model, ids):
    model.zero_grad(set_to_none=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state  # hidden: [B, T, H]
    (hidden.square().sum() / hidden.numel()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def hf_checkpointing(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def tile(model, chunk_tokens):
    """Only the tiled MLP (no fused kernels) through patch_model."""
    return patch_model(
        model, rms_norm=False, rope=False, swiglu=False, fused_loss=False, tiled_mlp=True, mlp_chunk_tokens=chunk_tokens
    )


def ids_batch(B=3, T=7, seed=1):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


# --- one MLP: gradients equal to the untiled one ----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 4, 20])  # 21 tokens: 21 chunks, 6 (last one 1 token), 2 (last one 1 token)
def test_grads_equal_untiled(arch, dtype, chunk):
    mlp = tiny_model(arch, dtype).model.layers[0].mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, TINY["hidden_size"], dtype=dtype, generator=g)
    grad_out = torch.randn(3, 7, TINY["hidden_size"], dtype=dtype, generator=g)
    want = mlp_grads(mlp, x, grad_out, lambda m, x: m(x))
    got = mlp_grads(mlp, x, grad_out, lambda m, x: tiled_mlp(m, x, chunk_tokens=chunk))
    assert got[0].shape == x.shape
    assert_close_all(got, want, dtype)


def test_bf16_param_grads_sum_their_chunks_in_fp32():
    """A bf16 linear over 512 one-token chunks: each chunk's weight gradient g_t x_t^T is rounded to bf16 once
    (2^-8 of it), the chunks are summed in fp32 (512 x 2^-24 of the running sum), the total rounded once (2^-8 |ref|):
    bound 2^-8 (S + |ref|) + 2^-15 S, S = sum_t |g_t| |x_t| (fp64 of the same bf16 inputs). All terms positive here,
    so a bf16 running sum stalls at 256 of them (its spacing there is 2 terms), far below the 512."""
    lin = torch.nn.Linear(4, 4, bias=False).bfloat16()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 512, 4, generator=g).bfloat16()
    grad_out = (0.5 + torch.rand(1, 512, 4, generator=g)).bfloat16()
    out = tiled_mlp(lin, x, chunk_tokens=1)
    (got,) = torch.autograd.grad(out, lin.weight, grad_out)
    ref = grad_out[0].double().T @ x[0].double()
    S = grad_out[0].double().abs().T @ x[0].double().abs()
    tol = 2.0**-8 * (S + ref.abs()) + 2.0**-15 * S
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, bound there {tol.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_patched_fused_forward_with_lora_equal_untiled(arch):
    """The forward patch_model binds (fused SwiGLU/GeGLU, Phi-3's gate_up) over PEFT LoRA linears, fp32."""
    model = with_lora(tiny_model(arch, torch.float32))
    mlp = model.get_base_model().model.layers[0].mlp
    fused = types.MethodType(mlp_forward("gelu_tanh" if arch == "gemma" else "silu", arch == "phi3"), mlp)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, TINY["hidden_size"], generator=g)
    grad_out = torch.randn(2, 9, TINY["hidden_size"], generator=g)
    want = mlp_grads(mlp, x, grad_out, lambda m, x: fused(x))
    got = mlp_grads(mlp, x, grad_out, lambda m, x: tiled_mlp(m, x, chunk_tokens=5, forward=fused))
    linears = 2 if arch == "phi3" else 3
    assert sum("lora_" in n for n in got[2]) == 2 * linears and not any("base_layer" in n for n in got[2])
    assert_close_all(got, want, torch.float32)


def test_bf16_with_fp32_lora_adapters_within_bf16_noise():
    """bf16 base, PEFT's default fp32 adapters: tiled errors against fp64 no larger than untiled ones (+ slack)."""
    model = with_lora(tiny_model("llama", torch.float64))
    mlp64 = model.get_base_model().model.layers[0].mlp
    mlp = copy.deepcopy(mlp64)
    for name, p in mlp.named_parameters():
        p.data = p.data.to(torch.float32 if "lora_" in name else torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 13, TINY["hidden_size"], dtype=torch.float64, generator=g)
    grad_out = torch.randn(5, 13, TINY["hidden_size"], dtype=torch.float64, generator=g)
    want = mlp_grads(mlp64, x, grad_out, lambda m, x: m(x))
    errors = {}
    for name, run in (("untiled", lambda m, x: m(x)), ("tiled", lambda m, x: tiled_mlp(m, x, chunk_tokens=8))):
        out, dx, grads = mlp_grads(mlp, x.bfloat16(), grad_out.bfloat16(), run)
        assert out.dtype == dx.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
        pairs = [(out, want[0]), (dx, want[1])] + [(grads[k], want[2][k]) for k in want[2]]
        errors[name] = [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]
    assert len(errors["tiled"]) == 2 + 6
    for tiled, untiled in zip(errors["tiled"], errors["untiled"]):
        assert tiled <= 1.5 * untiled + 1e-3


def test_lora_dropout_draws_the_same_masks_in_the_recompute():
    """Chunked eagerly with autograd, same seed: the tiled backward must replay each chunk's dropout mask."""
    model = with_lora(tiny_model("llama"), dropout=0.5)
    mlp = model.get_base_model().model.layers[0].mlp
    g = torch.Generator().manual_seed(4)
    x = torch.randn(23, TINY["hidden_size"], dtype=torch.float64, generator=g)
    grad_out = torch.randn(23, TINY["hidden_size"], dtype=torch.float64, generator=g)

    def eager_chunks(m, x):
        return torch.cat([m(x[i : i + 6]) for i in range(0, 23, 6)])

    torch.manual_seed(5)
    want = mlp_grads(mlp, x, grad_out, eager_chunks)
    torch.manual_seed(5)
    got = mlp_grads(mlp, x, grad_out, lambda m, x: tiled_mlp(m, x, chunk_tokens=6))
    assert_close_all(got, want, torch.float64)
    torch.manual_seed(5)
    after_eager = (eager_chunks(mlp, x), torch.rand(3))
    torch.manual_seed(5)
    after_tiled = (tiled_mlp(mlp, x, chunk_tokens=6).detach(), torch.rand(3))
    assert torch.equal(after_tiled[1], after_eager[1])  # the backward leaves the RNG where the caller had it


def test_autograd_grad_returns_param_grads_without_touching_dot_grad():
    mlp = with_lora(tiny_model("llama")).get_base_model().model.layers[0].mlp
    x = torch.randn(2, 11, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    params = [p for p in mlp.parameters() if p.requires_grad]
    want = torch.autograd.grad(mlp(x).sin().sum(), [x, *params])
    got = torch.autograd.grad(tiled_mlp(mlp, x, chunk_tokens=3).sin().sum(), [x, *params])
    assert all(p.grad is None for p in params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TIGHT[torch.float64])


def test_frozen_input_and_retain_graph():
    """x without grad: only param grads; backward twice with retain_graph accumulates twice."""
    mlp = tiny_model("llama").model.layers[0].mlp
    x = torch.randn(17, TINY["hidden_size"], dtype=torch.float64)
    mlp(x).sum().backward()
    want = {n: 2 * p.grad for n, p in mlp.named_parameters()}
    mlp.zero_grad(set_to_none=True)
    out = tiled_mlp(mlp, x, chunk_tokens=5).sum()
    out.backward(retain_graph=True)
    out.backward()
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want[n], **TIGHT[torch.float64])


def test_autocast_is_restored_in_the_recompute():
    mlp = tiny_model("llama", torch.float32).model.layers[0].mlp
    dtypes = []
    mlp.down_proj.register_forward_pre_hook(lambda m, args: dtypes.append(args[0].dtype))
    x = torch.randn(10, TINY["hidden_size"], requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tiled_mlp(mlp, x, chunk_tokens=4)
    out.float().sum().backward()
    assert dtypes == [torch.bfloat16] * 6  # 3 chunks in forward, 3 in the backward's recompute
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32


# --- no_grad, short inputs ----------------------------------------------------------------------------------------


def test_no_grad_and_short_inputs_just_run():
    mlp = tiny_model("llama").model.layers[0].mlp
    rows = count_mlp_rows(mlp)
    x = torch.randn(2, 9, TINY["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        want = mlp(x)
        got = tiled_mlp(mlp, x, chunk_tokens=4)
    assert not got.requires_grad and rows == [18, 4, 4, 4, 4, 2]
    torch.testing.assert_close(got, want, **TIGHT[torch.float64])
    with torch.inference_mode():
        torch.testing.assert_close(tiled_mlp(mlp, x, chunk_tokens=4), want, **TIGHT[torch.float64])
    rows.clear()
    x.requires_grad_()
    out = tiled_mlp(mlp, x, chunk_tokens=18)  # 18 tokens fit one chunk: the plain forward, its own graph
    assert rows == [18] and type(out.grad_fn).__name__ != "_ChunkedForwardBackward"


# --- a tiny HF model: offload checkpointing, HF checkpointing, product path ------------------------------------


@pytest.mark.parametrize("arch, lora", [("llama", False), ("llama", True), ("gemma2", False)])
def test_offload_checkpointing_with_tiling_equals_plain_hf(arch, lora):
    """The offload wrapper not told the chunk recomputes every layer in the backward, running the tiled MLP again:
    gemma2's recompute must run it (its norm reads the output), not skip it."""
    model = tiny_model(arch)
    model = with_lora(model) if lora else model
    ids = ids_batch()
    want = decoder_step(model, ids)
    tiled = tile(copy.deepcopy(model), chunk_tokens=4)  # 21 tokens: 6 chunks
    layers = (tiled.get_base_model() if lora else tiled).model.layers
    enable_offload_checkpointing(layers, offloader=ActivationOffloader("cpu"))
    got = decoder_step(tiled, ids)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TIGHT[torch.float64], msg=name)


def test_product_path_patch_model_offload_activations():
    """patch_model(offload_activations=True): fused kernels + offload + tiled MLP, fp32, vs plain HF."""
    model = with_lora(tiny_model("llama", torch.float32))
    ids = ids_batch(B=2, T=9)
    want = decoder_step(model, ids)
    patched = patch_model(copy.deepcopy(model), offload_activations=True, mlp_chunk_tokens=7)
    summary = patched.fastgrpo_patch_summary
    assert summary["options"]["tiled_mlp"] is True and summary["patched"]["tiled_mlp"] == 2
    got = decoder_step(patched, ids)
    for name in want:  # fused RMSNorm / RoPE / SwiGLU kernels: fp32 rounding, as in test_patching
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("checkpointing,arch", [("offload", "llama"), ("hf", "llama"), ("offload", "phi3"),
                                                 ("offload", "gemma2")])
def test_checkpoint_recompute_stops_before_the_tiled_mlp(checkpointing, arch):
    """MLP tokens per step: plain checkpointing runs every MLP twice (forward + recompute); tiled under
    checkpointing also twice (forward, then the chunks in its backward: the recompute stops before it). With early
    stop off the recompute runs the tiled forward too: three times, which shows the count sees it. Gemma2 normalizes
    the MLP output, so its recompute has to run the MLP: three times either way. The offload wrapper is told the
    chunk (as patch_model does): above it, it checkpoints the non-reentrant way."""
    ids = ids_batch()
    n = ids.numel() * TINY["num_hidden_layers"]  # 42 MLP tokens per forward

    def tokens_per_step(tiled: bool) -> int:
        model = tile(tiny_model(arch), chunk_tokens=4) if tiled else tiny_model(arch)
        if checkpointing == "offload":
            enable_offload_checkpointing(model.model.layers, offloader=ActivationOffloader("cpu"),
                                         tiled_mlp_chunk_tokens=4 if tiled else None)
        else:
            hf_checkpointing(model)
        rows = count_mlp_rows(model)
        decoder_step(model, ids)
        return sum(rows)

    assert tokens_per_step(tiled=False) == 2 * n
    assert tokens_per_step(tiled=True) == (3 if arch == "gemma2" else 2) * n
    with set_checkpoint_early_stop(False):
        assert tokens_per_step(tiled=True) == 3 * n


def _grad_modes(modules) -> list[list[bool]]:
    modes = [[] for _ in modules]
    for found, module in zip(modes, modules):
        module.register_forward_pre_hook(lambda *a, found=found: found.append(torch.is_grad_enabled()))
    return modes


@pytest.mark.parametrize("arch", ["llama", "gemma", "gemma2", "phi3"])
def test_recompute_in_the_backward_skips_the_tiled_mlp_where_its_output_is_only_added(arch):
    """patch_model's offload above the tiled MLP's chunk (21 tokens, chunks of 4), LoRA with dropout on every MLP
    linear: where the architecture's data says the layer only adds the MLP output (llama, gemma), the layer runs under
    no_grad and is recomputed in the backward (its attention sees grad off, then on), the recompute skips the MLP's
    chunks (two MLP forwards per step, not three), and the gradients are bitwise those of the non-reentrant scheme
    (which the others keep: gemma2 normalizes the output, phi3's residual dropout draws after the MLP's)."""
    from fastgrpo.hf.architectures import ARCHITECTURES

    ids = ids_batch()
    n = ids.numel() * TINY["num_hidden_layers"]
    only_added = ARCHITECTURES[arch].mlp_output_added_as_is
    assert only_added == (arch in ("llama", "gemma"))

    def step(scheme_follows_the_data: bool):
        model = with_lora(tiny_model(arch), dropout=0.3)
        patch_model(model, rms_norm=False, rope=False, swiglu=False, fused_loss=False,
                    offload_activations=ActivationOffloader("cpu"), mlp_chunk_tokens=4)
        layers = model.get_base_model().model.layers
        if not scheme_follows_the_data:  # told nothing: above the chunk, the non-reentrant scheme
            enable_offload_checkpointing(layers, offloader=ActivationOffloader("cpu"), tiled_mlp_chunk_tokens=4)
        modes = _grad_modes([layer.self_attn for layer in layers])
        rows = count_mlp_rows(model)
        torch.manual_seed(7)
        grads = decoder_step(model, ids)
        return grads, modes, sum(rows)

    got, modes, tokens = step(True)
    want, want_modes, want_tokens = step(False)
    assert want_modes == [[True, True]] * 2
    assert modes == ([[False, True]] * 2 if only_added else want_modes)
    assert tokens == want_tokens == (3 if arch == "gemma2" else 2) * n
    assert got.keys() == want.keys() and any("lora_A" in name for name in want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_recompute_that_skips_a_read_mlp_output_gives_nan_not_wrong_numbers():
    """Gemma2 normalizes its MLP output: told (wrongly) that the layers only add it, the recompute's NaN placeholder
    reaches the gradients of what lies under the MLP, so a wrong architecture entry is loud."""
    model = tile(tiny_model("gemma2"), chunk_tokens=4)
    enable_offload_checkpointing(model.model.layers, offloader=ActivationOffloader("cpu"), tiled_mlp_chunk_tokens=4,
                                 mlp_output_only_added=True)
    grads = decoder_step(model, ids_batch())
    assert torch.isnan(grads["model.layers.0.self_attn.q_proj.weight"]).any()


def test_without_checkpointing_tiling_costs_one_mlp_forward():
    ids = ids_batch()
    rows = count_mlp_rows(tile(model := tiny_model("llama"), chunk_tokens=4))
    decoder_step(model, ids)
    assert sum(rows) == 2 * ids.numel() * TINY["num_hidden_layers"]


# --- wiring --------------------------------------------------------------------------------------------------------


def test_patch_model_options_summary_and_unpatch():
    model = tiny_model("phi3", torch.float32)
    mlps = [layer.mlp for layer in model.model.layers]
    assert "tiled_mlp" not in patch_model(model).fastgrpo_patch_summary["patched"]  # offload off: tiling off
    assert patch_model(model, offload_activations=True, tiled_mlp=False).fastgrpo_patch_summary["options"][
        "tiled_mlp"
    ] is False
    summary = patch_model(model, tiled_mlp=True, mlp_chunk_tokens=3).fastgrpo_patch_summary
    assert summary["patched"]["tiled_mlp"] == 2 and summary["patched"]["swiglu"] == 2
    assert summary["options"]["mlp_chunk_tokens"] == 3
    rows = count_mlp_rows(model)
    with torch.no_grad():
        model(input_ids=ids_batch(B=1, T=7))
    assert rows == [3, 3, 1] * 2  # each MLP in chunks of 3 tokens
    unpatch_model(model)
    assert all("forward" not in mlp.__dict__ for mlp in mlps)


# --- bad input -----------------------------------------------------------------------------------------------------


def test_bad_input():
    mlp = tiny_model("llama").model.layers[0].mlp
    x = torch.randn(9, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="chunk_tokens"):
            tiled_mlp(mlp, x, chunk_tokens=bad)
    with pytest.raises(ValueError, match="x: expected a floating dtype"):
        tiled_mlp(mlp, torch.ones(9, TINY["hidden_size"], dtype=torch.long))
    with pytest.raises(ValueError, match="x: expected a torch.Tensor"):
        tiled_mlp(mlp, [[1.0]])
    with pytest.raises(ValueError, match=r"module: tiled_mlp needs a forward mapping \[..., 16\] to \[..., 16\]"):
        tiled_mlp(mlp, x, chunk_tokens=4, forward=lambda x: mlp.gate_proj(x))
    with pytest.raises(ValueError, match="mlp_chunk_tokens"):
        patch_model(tiny_model("llama"), tiled_mlp=True, mlp_chunk_tokens=0)
    out = tiled_mlp(mlp, x, chunk_tokens=4).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, x, create_graph=True)


# --- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_bf16_within_noise_and_less_memory():
    """A Qwen2.5-1.5B-sized MLP at 32K tokens, bf16, full fine-tuning: tiled grads as close to fp64 as untiled
    ones; peak well below (untiled keeps 4 x 0.55 GiB of [32K, 8960] intermediates; tiled the fp32 dW sums)."""
    config = transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960)
    torch.manual_seed(0)
    mlp = transformers.models.qwen2.modeling_qwen2.Qwen2MLP(config).cuda()
    x = torch.randn(32768, 1536, device="cuda") * 0.5
    grad_out = torch.randn(32768, 1536, device="cuda")
    want = mlp_grads(mlp.double(), x.double(), grad_out.double(), lambda m, x: m(x))
    mlp = mlp.bfloat16()
    errors, peaks = {}, {}
    for name, run in (("untiled", lambda m, x: m(x)), ("tiled", lambda m, x: tiled_mlp(m, x, chunk_tokens=4096))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = mlp_grads(mlp, x.bfloat16(), grad_out.bfloat16(), run)
        peaks[name] = torch.cuda.max_memory_allocated() - base
        errors[name] = [(a.double() - b).norm() / b.norm() for a, b in zip(got[:2], want[:2])] + [
            (got[2][k].double() - want[2][k]).norm() / want[2][k].norm() for k in want[2]
        ]
    for tiled, untiled in zip(errors["tiled"], errors["untiled"]):
        assert tiled <= 1.5 * untiled + 1e-3
    assert peaks["tiled"] < 0.6 * peaks["untiled"]


# --- patch_model's default chunk ----------------------------------------------------------------------------------


def test_chunk_tokens_keep_each_intermediate_within_the_budget():
    from fastgrpo.ops.tiled_mlp import DEFAULT_CHUNK_BYTES, chunk_tokens_for

    assert chunk_tokens_for(8960, 2) == 14976  # Qwen2.5-1.5B, bf16
    assert chunk_tokens_for(14336, 2) == 9344  # Llama-3.1-8B, bf16
    for size, element in ((8960, 2), (14336, 2), (24, 8), (100_000_000, 4)):
        tokens = chunk_tokens_for(size, element)
        assert tokens % 128 == 0 and tokens >= 128
        assert tokens == 128 or tokens * size * element <= DEFAULT_CHUNK_BYTES < (tokens + 128) * size * element


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_patch_model_chunks_by_the_models_intermediate_size(arch):
    from fastgrpo.ops.tiled_mlp import chunk_tokens_for

    model = tiny_model(arch, dtype=torch.bfloat16)
    patch_model(model, tiled_mlp=True)
    options = model.fastgrpo_patch_summary["options"]
    widest = TINY["intermediate_size"] * (2 if arch == "phi3" else 1)  # phi3's fused gate_up: [tokens, 2I]
    assert options["mlp_chunk_tokens"] == chunk_tokens_for(widest, 2)
    assert patch_model(tiny_model(arch), tiled_mlp=False).fastgrpo_patch_summary["options"]["mlp_chunk_tokens"] is None
