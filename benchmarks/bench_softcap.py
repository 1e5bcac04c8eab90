"""Gemma-2 logit soft-capping in the fused lm_head + GRPO loss: what the cap costs, and eager for comparison.

    python -m pytest benchmarks/bench_softcap.py -q -s

Gemma-2-2B shapes (H = 2304, V = 256000, cap = 30), bf16, B = 8, T = 2048, token-level bnpo loss with old and ref
log-probs, beta = 0.04, lm_head trained. Cases: `eager` (logits, cap * tanh(logits / cap) in fp32, log_softmax and
the loss, autograd), `ours_nocap` and `ours_cap` (fastgrpo.fused_linear_grpo_loss without / with softcap=30).
Median ms (triton.testing.do_bench) and peak GiB above the inputs.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.common import eager_grpo_loss, measure, print_table, refuse_script_run, write_results
from fastgrpo.loss.fused import fused_linear_grpo_loss

H, V, CAP, B, T, BETA = 2304, 256000, 30.0, 8, 2048, 0.04
ROWS: list[dict] = []
_DATA: dict = {}


def _data() -> dict:
    if not _DATA:
        torch.manual_seed(0)
        logps = torch.randn(B, T, device="cuda") - 12.0
        _DATA.update(
            hidden=torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_(),
            weight=(torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_(),
            targets=torch.randint(0, V, (B, T), device="cuda"), mask=torch.ones(B, T, device="cuda", dtype=torch.bool),
            advantages=torch.randn(B, device="cuda"),
            old=logps + 0.1 * torch.randn(B, T, device="cuda"), ref=logps + 0.1 * torch.randn(B, T, device="cuda"),
        )
    return _DATA


def _ours(d, softcap):
    loss, _ = fused_linear_grpo_loss(
        d["hidden"], d["weight"], d["targets"], d["mask"], d["advantages"], old_logps=d["old"], ref_logps=d["ref"],
        beta=BETA, softcap=softcap, backend="triton",
    )
    return loss


CASES = {
    "eager": lambda d: eager_grpo_loss(d, BETA, CAP), "ours_nocap": lambda d: _ours(d, None),
    "ours_cap": lambda d: _ours(d, CAP),
}


@pytest.mark.parametrize("case", list(CASES))
def test_case(case):
    d = _data()

    def step():
        d["hidden"].grad = d["weight"].grad = None
        CASES[case](d).backward()

    row = {"H": H, "V": V, "tokens": B * T, "case": case, "softcap": None if case == "ours_nocap" else CAP}
    row.update(measure(step))
    nocap = next((r["ms"] for r in ROWS if r["case"] == "ours_nocap"), None)
    if row["ms"]:
        row["tokens_per_s"] = B * T / row["ms"] * 1e3
        if case == "ours_cap" and nocap:
            row["x_nocap"] = row["ms"] / nocap
    ROWS.append(row)
    write_results("softcap", ROWS, {
        "shape": "Gemma-2-2B lm_head", "batch": B, "T": T, "dtype": "bfloat16",
        "loss": "bnpo, token level, beta=0.04, old+ref log-probs, lm_head trained",
        "timing": "triton.testing.do_bench median, fwd+bwd; peak GiB above the inputs on the first call",
    })


def teardown_module(module):
    _DATA.clear()
    if ROWS:
        print()
        print_table(ROWS, ["H", "V", "tokens", "case", "softcap", "ms", "peak_gib", "x_nocap", "tokens_per_s"])


if __name__ == "__main__":
    refuse_script_run(__file__)
