"""Fwd+bwd of the GRPO loss through the lm_head, ours vs eager PyTorch vs Liger vs one cuBLAS GEMM.

    python -m pytest benchmarks/bench_fused_linear.py -q -s

bf16, B = 8, V = 151936, H in {1536, 4096}, T in {1024, 2048, 4096, 8192}; token-level bnpo loss with old and
ref log-probs, beta = 0.04, every token valid. Cases per shape: `gemm` (one [N, H] x [H, V] GEMM, bf16 out: the
floor is 3 of them with a trained lm_head, 2 with a frozen one), `eager` (logits + fp32 log_softmax + the loss from
fastgrpo.loss.grpo, autograd), `liger` (LigerFusedLinearGRPOLoss from the liger-kernel wheel, when installed), and
`ours_full` / `ours_frozen` (fastgrpo.fused_linear_grpo_loss with the lm_head trained / frozen). Median ms
(triton.testing.do_bench) and peak GiB above the inputs, incl. the gradients. Targets: ours_full <= 1.2x 3 GEMMs,
ours_frozen <= 1.2x 2 GEMMs, peak <= Liger's.

Environment knobs for a shorter run: FASTGRPO_FL_H="1536", FASTGRPO_FL_T="1024,8192",
FASTGRPO_FL_CASES="gemm,ours_full", FASTGRPO_FL_CHUNKS="default,2048" (ours at several chunk sizes).
"""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.common import eager_grpo_loss, measure, print_table, refuse_script_run, write_results
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.ops import fused_linear

V, B, BETA = 151936, 8, 0.04


def _env_list(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


HS = [int(h) for h in _env_list("FASTGRPO_FL_H", "1536,4096")]
TS = [int(t) for t in _env_list("FASTGRPO_FL_T", "1024,2048,4096,8192")]
CASES = _env_list("FASTGRPO_FL_CASES", "gemm,eager,liger,ours_full,ours_frozen")
CHUNKS = [None if c == "default" else int(c) for c in _env_list("FASTGRPO_FL_CHUNKS", "default")]
ROWS: list[dict] = []
_DATA: dict = {}


def _data(H: int, T: int) -> dict:
    if _DATA.get("shape") != (H, T):
        _DATA.clear()
        torch._dynamo.reset()  # Liger's torch.compile'd chunk loss: recompiling for a new shape failed on torch 2.11
        torch.manual_seed(0)
        hidden = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)
        weight = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16)
        logps = torch.randn(B, T, device="cuda") - 12.0
        _DATA.update(
            shape=(H, T), hidden=hidden.requires_grad_(), weight=weight,
            targets=torch.randint(0, V, (B, T), device="cuda"),
            mask=torch.ones(B, T, device="cuda", dtype=torch.bool), advantages=torch.randn(B, device="cuda"),
            old=logps + 0.1 * torch.randn(B, T, device="cuda"), ref=logps + 0.1 * torch.randn(B, T, device="cuda"),
        )
    return _DATA


def _liger(d):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    if "liger" not in d:
        d["liger"] = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_high=0.2, loss_type="bnpo", use_ref_model=False)
    out = d["liger"](d["hidden"], d["weight"], d["targets"], d["mask"], d["advantages"],
                     ref_per_token_logps=d["ref"], old_per_token_logps=d["old"])
    return out[0] if isinstance(out, tuple) else out


def _ours(d):
    loss, _ = fused_linear_grpo_loss(
        d["hidden"], d["weight"], d["targets"], d["mask"], d["advantages"], old_logps=d["old"], ref_logps=d["ref"],
        beta=BETA, backend="triton",
    )
    return loss


def _step_fn(case: str, d: dict, chunk: int | None):
    hidden, weight = d["hidden"], d["weight"]
    if case == "gemm":
        h2d = hidden.detach().view(-1, hidden.shape[-1])
        return lambda: torch.mm(h2d, weight.t())
    weight.requires_grad_(case != "ours_frozen")
    loss_fn = {
        "eager": lambda d: eager_grpo_loss(d, BETA), "liger": _liger, "ours_full": _ours, "ours_frozen": _ours,
    }[case]

    def step():
        hidden.grad = weight.grad = None
        with fused_linear.chunk_rows(chunk):
            loss_fn(d).backward()

    return step


PARAMS = [
    (H, T, case, chunk)
    for H in HS for T in TS for case in CASES
    for chunk in (CHUNKS if case.startswith("ours") else [None])
]


@pytest.mark.parametrize("H,T,case,chunk", PARAMS, ids=[f"H{h}-T{t}-{c}-{k or 'default'}" for h, t, c, k in PARAMS])
def test_case(H, T, case, chunk):
    if case == "liger":
        pytest.importorskip("liger_kernel")
    d = _data(H, T)
    row = {"H": H, "T": T, "tokens": B * T, "case": case, "chunk": chunk}
    try:
        row.update(measure(_step_fn(case, d, chunk)))
    except Exception as exc:  # a baseline that breaks (e.g. a compile error) is reported, not fatal for the run
        if case.startswith("ours"):
            raise
        row.update(ms=None, peak_gib=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    d["hidden"].grad = d["weight"].grad = None
    gemm = next((r["ms"] for r in ROWS if (r["H"], r["T"], r["case"]) == (H, T, "gemm")), None)
    if gemm and row["ms"]:
        row["x_gemm"] = row["ms"] / gemm
        if case.startswith("ours"):
            floor = 2 if case == "ours_frozen" else 3
            row["x_floor"] = row["ms"] / (floor * gemm)
            row["meets_time"] = row["x_floor"] <= 1.2
    liger = next((r for r in ROWS if (r["H"], r["T"], r["case"]) == (H, T, "liger")), None)
    if case.startswith("ours") and liger and liger["peak_gib"] and row["peak_gib"]:
        row["meets_memory"] = row["peak_gib"] <= liger["peak_gib"]
    if row["ms"]:
        row["tokens_per_s"] = B * T / row["ms"] * 1e3
    ROWS.append(row)
    write_results("fused_linear", ROWS, {
        "batch": B, "vocab": V, "dtype": "bfloat16", "loss": "bnpo, token level, beta=0.04, old+ref log-probs",
        "timing": "triton.testing.do_bench median, fwd+bwd; peak GiB above the inputs on the first call",
        "targets": {"ours_full_x_3gemm": 1.2, "ours_frozen_x_2gemm": 1.2, "peak": "<= liger"},
    })


def teardown_module(module):
    _DATA.clear()
    if ROWS:
        print()
        print_table(ROWS, ["H", "tokens", "case", "chunk", "ms", "peak_gib", "x_gemm", "x_floor", "meets_time",
                           "meets_memory", "error"])


if __name__ == "__main__":
    refuse_script_run(__file__)
