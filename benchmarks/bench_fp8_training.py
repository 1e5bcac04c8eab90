"""What patch_model(fp8_base=True) does to a full fine-tuning step's numbers: the loss and the gradient of one
micro-batch against an fp32 reference, beside bf16's own distance from it.

    python -m benchmarks.bench_fp8_training                      # Qwen2.5-1.5B shapes, 8 x 1280 random tokens
    python -m benchmarks.bench_fp8_training --lora               # LoRA r16: the adapters' gradients
    python -m benchmarks.bench_fp8_training --dry-run            # CPU check: tiny Qwen2, 2 x 32 tokens

One model of random weights (bench_loop's folder, HF's initialization), one batch of random tokens, the causal LM
loss through the patched model's fused lm_head (labels=ids). Three runs of the same weights: fp32 (the reference),
bf16, and bf16 with fp8_base (every decoder linear's forward and input gradient in e4m3). Per run: the loss, the
gradient's cosine with the reference's and its relative distance ||g - g_ref|| / ||g_ref|| (all parameters as one
vector; also the worst parameter tensor's). bf16's numbers are the floor FP8 adds to. JSON:
results/fp8_training-<card>.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import card_name, print_table, require_cuda, write_results

PRECISIONS = ("fp32", "bf16", "bf16+fp8_base")


def gradients(folder: Path, precision: str, ids: torch.Tensor, device: str, lora: bool
              ) -> tuple[float, list[torch.Tensor]]:
    """(loss, every trained parameter's gradient in fp64 on the CPU) of one forward and backward in `precision`;
    lora: bench_loop's LoRA r16 adapters (the same random A in every run; B is 0, so A's gradients are too)."""
    from transformers import AutoModelForCausalLM

    import fastgrpo

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
    if lora:
        from peft import get_peft_model

        from benchmarks.bench_loop import lora_config

        torch.manual_seed(0)
        model = get_peft_model(model, lora_config())
    fastgrpo.patch_model(model, fp8_base=precision.endswith("fp8_base"))
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.double().cpu() for p in model.parameters() if p.requires_grad]
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return loss.item(), grads


def compare(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    flat, flat_ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref])
    per_tensor = [float(F.cosine_similarity(g.flatten(), r.flatten(), dim=0)) for g, r in zip(grads, ref) if r.norm() > 0]
    flat, flat_ref = flat[flat_ref != 0], flat_ref[flat_ref != 0]  # LoRA's A: 0 in every run
    return {"grad_cosine": float(F.cosine_similarity(flat, flat_ref, dim=0)),
            "grad_rel_error": float((flat - flat_ref).norm() / flat_ref.norm()),
            "worst_tensor_cosine": min(per_tensor)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1280, help="tokens a row (prompt 256 + completion 1024)")
    parser.add_argument("--models-dir", default=str(Path(tempfile.gettempdir()) / "fastgrpo-bench-models"))
    parser.add_argument("--lora", action="store_true", help="LoRA r16 on every linear (bench_loop's), the base frozen")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny Qwen2, 2 x 32 tokens")
    args = parser.parse_args(argv)
    if not args.dry_run:
        require_cuda(parser)
    from benchmarks.bench_loop import build_folder

    device = "cpu" if args.dry_run else "cuda"
    model, rows, tokens = ("tiny-qwen2", 2, 32) if args.dry_run else (args.model, args.rows, args.tokens)
    folder = build_folder(model, Path(args.models_dir), device)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = torch.randint(3, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    results = {precision: gradients(folder, precision, ids, device, args.lora) for precision in PRECISIONS}
    ref_loss, ref_grads = results["fp32"]
    table = []
    for precision in PRECISIONS[1:]:
        loss, grads = results[precision]
        table.append({"precision": precision, "loss": loss, "loss_error": abs(loss - ref_loss),
                      **compare(grads, ref_grads)})
    config = {"model": model, "mode": "lora" if args.lora else "full", "batch": f"{rows} x {tokens}", "reference": "fp32",
              "card": card_name(),
              "reference_loss": ref_loss}
    directory = Path(tempfile.mkdtemp()) if args.dry_run else None
    print(f"wrote {write_results('fp8_training', table, config, directory)}")
    print_table(table, ["precision", "loss", "loss_error", "grad_cosine", "grad_rel_error", "worst_tensor_cosine"])


if __name__ == "__main__":
    main()
