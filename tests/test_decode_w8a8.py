"""EngineConfig(weights="w8a8"): the decode steps multiply the FP8 copy ("fp8"'s: same q, scale, stacked groups) with
fp8_scaled_linear, activations rounded to e4m3 per row; "auto" never picks it.

Checked here: inside the copy every dense linear computes fp8_scaled_linear over quantize_fp8 of its weight
(lm_head of the tiny models, 44 wide, through its fp8_linear fallback); the copy is fp8's, byte for byte; the engine's
log-probs of its own samples stay near the trainer's (bf16), as near as the W8A16 engine's within a factor derived
below, and moved (the copy ran). One compiled layer for all layers: tests/test_warmup.py. The op itself:
tests/test_fp8_scaled_linear.py.

Bound on the engine's gap: "w8a8" rounds each linear's input (e4m3, a scale per row) on top of the weight rounding
both FP8 kinds share. The two roundings have the same relative size (3 mantissa bits, amax scales) and are
independent, so their effects on a log-prob add in quadrature: the mean |gap| should be at most about sqrt(2) that
of "fp8", less here, where lm_head runs W8A16 in both (measured 1.05-1.30x over 3 models x 2 seeds x llama, qwen2);
GAP_FACTOR = 1.5 leaves room for the spread of 64 tokens and fails a quantizer that truncates instead of rounding
(2^-3 relative: 1.7x measured). What it cannot see: per-tensor or missing activation scales (a decode step's rows
are RMS-normalized, of one size, and O(1) values fit e4m3's range unscaled): the op's tests catch those, on rows
of different magnitudes.

The op's plain-torch paths run (ops' use_triton off, as in test_decode_weights.py).
"""
import sys
import warnings

import pytest
import torch

from fastgrpo.hf.peft import dense_linears, dense_weight
from fastgrpo.loss.correction import logprob_gap
from fastgrpo.loss.model import sequence_logprobs
from fastgrpo.ops.fp8_linear import quantize_fp8
from fastgrpo.ops import fp8_scaled_linear as fp8_scaled_linear_module
from fastgrpo.ops.fp8_scaled_linear import GEMMS, fp8_scaled_linear, scaled_mm_fits
from fastgrpo.rollout import decode_weights
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.sampling import SamplingParams
from tests.test_decode_weights import run
from tests.test_rollout import SIZES, tiny_model

W8A8 = EngineConfig(weights="w8a8")
GAP_FACTOR = 1.5  # the module docstring's bound on gap(w8a8) / gap(fp8)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    """Every op on its plain-torch path (tests/test_decode_weights.py says why not by unsetting TRITON_INTERPRET)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fastgrpo.ops.") and hasattr(module, "use_triton"):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: False)


def engine_gap(model, config, G=4, seed=0, new_tokens=16):
    """logprob_gap of the engine's log-probs of its own samples against the trainer's (sequence_logprobs)."""
    result = run(model, config, SamplingParams(max_new_tokens=new_tokens, temperature=1.0), G=G, seed=seed)
    prompt_mask, completion_mask = result.prompt_mask, result.completion_mask
    ids = torch.cat([result.prompt_ids, result.completion_ids], 1)
    mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)
    train = sequence_logprobs(model, ids, torch.cat([prompt_mask, completion_mask], 1), mask)
    return logprob_gap(train.float(), torch.cat([prompt_mask * 0.0, result.logprobs.float()], 1), mask)


def test_copy_is_the_fp8_copy():
    """The same e4m3 weights and scales, stacked in the same groups, at the same bytes."""
    model = tiny_model("qwen2")
    assert decode_weights.copy_bytes(model, "w8a8") == decode_weights.copy_bytes(model, "fp8")
    assert (decode_weights.fused_groups(model, dense_linears(model), "w8a8")
            == decode_weights.fused_groups(model, dense_linears(model), "fp8"))
    def copy(modules):  # each module's copy attributes but the kind; e4m3 tensors as their bytes
        return [{name: value.view(torch.uint8) if getattr(value, "dtype", None) == torch.float8_e4m3fn else value
                 for name, value in vars(m).items() if name.startswith("fastgrpo_") and name != "fastgrpo_copy_kind"}
                for m in modules]

    with decode_weights.copied_weights(model, "fp8") as modules:
        fp8 = copy(modules)
    with decode_weights.copied_weights(model, "w8a8") as modules:
        assert all(m.fastgrpo_copy_kind == "w8a8" for m in modules)
        for got, want in zip(copy(modules), fp8):
            assert got.keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value, name


@pytest.mark.parametrize("lora", [False, True])
def test_every_dense_linear_runs_fp8_scaled_linear(lora):
    """Inside copied_weights("w8a8") each dense linear computes fp8_scaled_linear over quantize_fp8 of its current
    weight (LoRA merged); q/k/v and gate/up as slices of one GEMM over their stacked copy, which may sum in another
    order: one bf16 ulp (2^-7 relative) apart at most, beyond fp32's K u32 of the sum (K <= 128: below 1e-5
    here). Outside, the module's own forward, bit for bit."""
    model = tiny_model("qwen2", lora=lora).bfloat16()
    modules = dense_linears(model)
    head = model.get_output_embeddings()
    assert not scaled_mm_fits(head.out_features, head.in_features)  # lm_head: the fallback, in the same copy
    g = torch.Generator().manual_seed(0)
    inputs = {m: torch.randn(3, 1, m.in_features, generator=g).bfloat16() for m in modules}
    with torch.no_grad():
        before = {m: m(inputs[m]) for m in modules}
        expected = {}
        for m in modules:
            weight, bias = dense_weight(m)
            expected[m] = fp8_scaled_linear(inputs[m], *quantize_fp8(weight), bias)
        with decode_weights.copied_weights(model, "w8a8"):
            for m in modules:
                torch.testing.assert_close(m(inputs[m]), expected[m], atol=1e-5, rtol=2.0**-7)
        for m in modules:
            assert torch.equal(m(inputs[m]), before[m]) and "forward" not in m.__dict__


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, stacked, in the GEMM's epilogue
def test_logprobs_near_the_bf16_trainer(arch):
    """A bf16 tiny model: the w8a8 engine's mean |gap| to the trainer is at most GAP_FACTOR times the fp8 engine's
    (module docstring) and well above the bf16 engine's own (the activations' rounding ran)."""
    model = tiny_model(arch).bfloat16()
    gaps = {kind: engine_gap(model, EngineConfig(weights=kind)) for kind in ("model", "fp8", "w8a8")}
    means = {kind: gap["mean_abs_gap"] for kind, gap in gaps.items()}
    assert gaps["w8a8"]["tokens"] > 0 and gaps["w8a8"]["kl_k3"] >= 0, gaps
    assert 5 * means["model"] < means["w8a8"] <= GAP_FACTOR * means["fp8"], means


# ---- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("arch, lora", [("qwen2", False), ("llama", True)])
def test_gpu_w8a8_engine_compiled_and_graphed(arch, lora, gemm, monkeypatch):
    """On CUDA, bf16, compiled step and CUDA graph (each W8A8 GEMM for the layers, the Triton fp8_linear for
    lm_head, in one graph): no fallback warning, and the gap bound of the CPU test on 48 rows x 32 tokens."""
    monkeypatch.setattr(fp8_scaled_linear_module, "GEMM", gemm)
    torch._dynamo.reset()
    model = tiny_model(arch, lora=lora).cuda().bfloat16()
    assert SIZES["hidden_size"] % 16 == 0 and SIZES["intermediate_size"] % 16 == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gaps = {kind: engine_gap(model, EngineConfig(weights=kind), G=16, seed=1, new_tokens=32)
                for kind in ("fp8", "w8a8")}
    assert not [w for w in caught if str(w.message).startswith("rollout:")], [str(w.message) for w in caught]
    means = {kind: gap["mean_abs_gap"] for kind, gap in gaps.items()}
    assert 0 < means["w8a8"] <= GAP_FACTOR * means["fp8"], means
    torch._dynamo.reset()
