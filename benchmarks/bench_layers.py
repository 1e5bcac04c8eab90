"""Each fused layer kernel against the Hugging Face module it replaces; forward, backward, full.

    python -m pytest benchmarks/bench_layers.py -q -s

Qwen2.5-1.5B shapes, bf16, 8 x 4096 tokens: RMSNorm over H=1536 (Llama and Gemma rounding), RoPE on q [8, 12, T,
128] and k [8, 2, T, 128] (HF's transposed layout), SwiGLU / GeGLU over I=8960. Rows: median ms and peak GiB above
the inputs (first call), and the largest |fused - HF| of the forward output and of the input gradient.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.common import measure, print_table, refuse_script_run, write_results

B, T, H, I, HEADS, KV_HEADS, D = 8, 4096, 1536, 8960, 12, 2, 128
ROWS: list[dict] = []


def _rms_case(variant):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from fastgrpo.ops.rms_norm import rms_norm

    module = (Qwen2RMSNorm(H, eps=1e-6) if variant == "llama" else GemmaRMSNorm(H, eps=1e-6)).cuda().bfloat16()
    torch.nn.init.normal_(module.weight, 0.5, 0.1)
    offset, cast = (0.0, True) if variant == "llama" else (1.0, False)
    x = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)
    return [x], module, lambda x: rms_norm(x, module.weight, 1e-6, offset, cast)


def _rope_case(_):
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from fastgrpo.ops.rope import apply_rotary

    q = torch.randn(B, T, HEADS, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, T, KV_HEADS, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    freqs = torch.arange(T, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    return [q, k], lambda q, k: apply_rotary_pos_emb(q, k, cos, sin), lambda q, k: apply_rotary(q, k, cos, sin)


def _glu_case(activation):
    from transformers.activations import ACT2FN

    from fastgrpo.ops.swiglu import glu

    act = ACT2FN["silu" if activation == "silu" else "gelu_pytorch_tanh"]
    gate = torch.randn(B, T, I, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(B, T, I, device="cuda", dtype=torch.bfloat16)
    return [gate, up], lambda g, u: act(g) * u, lambda g, u: glu(g, u, activation)


CASES = {
    "rms_norm[llama]": (_rms_case, "llama"),
    "rms_norm[gemma]": (_rms_case, "gemma"),
    "rope": (_rope_case, None),
    "swiglu": (_glu_case, "silu"),
    "geglu": (_glu_case, "gelu_tanh"),
}


def _outputs(fn, inputs):
    out = fn(*inputs)
    return out if isinstance(out, tuple) else (out,)


def _bench(fn, inputs, mode):
    leaves = [t.detach().requires_grad_() for t in inputs]
    grads = [torch.randn_like(o) for o in _outputs(fn, leaves)]
    if mode == "fwd":
        return measure(lambda: _outputs(fn, leaves))
    if mode == "full":
        return measure(lambda: torch.autograd.backward(_outputs(fn, leaves), grads))
    outs = _outputs(fn, leaves)
    return measure(lambda: torch.autograd.backward(outs, grads, retain_graph=True))


def _errors(hf, fused, inputs):
    results = []
    for fn in (hf, fused):
        leaves = [t.detach().requires_grad_() for t in inputs]
        outs = _outputs(fn, leaves)
        torch.manual_seed(0)
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
        results.append((outs[0].float(), leaves[0].grad.float()))
    (y, dx), (y_f, dx_f) = results
    return (y - y_f).abs().max().item(), (dx - dx_f).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_layer(case):
    make, arg = CASES[case]
    inputs, hf, fused = make(arg)
    fwd_err, grad_err = _errors(hf, fused, inputs)
    for mode in ("fwd", "bwd", "full"):
        for impl, fn in (("hf", hf), ("fastgrpo", fused)):
            ROWS.append({"layer": case, "mode": mode, "impl": impl, **_bench(fn, inputs, mode),
                         "max_err_out": fwd_err if impl == "fastgrpo" else None,
                         "max_err_grad": grad_err if impl == "fastgrpo" else None})
        hf_ms, ours_ms = ROWS[-2]["ms"], ROWS[-1]["ms"]
        ROWS[-1]["speedup"] = hf_ms / ours_ms if hf_ms and ours_ms else None


def teardown_module(module):
    if ROWS:
        path = write_results("layers", ROWS, {"B": B, "T": T, "H": H, "I": I, "heads": HEADS, "kv_heads": KV_HEADS,
                                              "head_dim": D, "dtype": "bfloat16"})
        print(f"\nwrote {path}")
        print_table(ROWS, ["layer", "mode", "impl", "ms", "peak_gib", "speedup", "max_err_out", "max_err_grad"])


if __name__ == "__main__":
    refuse_script_run(__file__)
