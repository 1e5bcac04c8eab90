"""Where the training half of a fastgrpo GRPO step goes: the old and reference log-prob passes and the update
(loss forward, backward, optimizer) of bench_loop's fastgrpo system, on a synthetic rollout batch.

    python -m benchmarks.profile_update                          # qwen2.5-1.5b-lora, C = 1024, every variant
    python -m benchmarks.profile_update --variants offload --trace-dir /tmp/traces
    python -m benchmarks.profile_update --dry-run                # CPU check: tiny Qwen2 LoRA, 16 + 16 tokens
    python -m benchmarks.profile_update --shape qwen2.5-1.5b-full --variants offload,plain   # full fine-tuning
    python -m benchmarks.profile_update --variants offload,offload-lora-add   # lora_linear against the two-op path
    python -m benchmarks.profile_update --variants offload,offload@20,offload@14 --no-trace   # fewer recomputed layers
    python -m benchmarks.profile_update --variants offload --rollout-correction truncate   # fastgrpo-fp8's update
    python -m benchmarks.profile_update --shape llama-3.1-8b-lora --variants offload --rollout-correction truncate \
        --fp8-base                                              # fastgrpo-fp8train's update (sm89+)

The trainer is bench_loop.fastgrpo_trainer's (same folder, LoRA, GRPOConfig); the batch is what a rollout of 8 x 8
completions of exactly C tokens gives (random ids, a prompt's 8 rows with its ids, every completion token counted)
with random advantages, and the phases are called as GRPOTrainer.train_step calls them. Variants, the same model
re-patched:
  offload     patch_model(offload_activations=True): bench_loop's setting (layer inputs to pinned host memory,
              each layer recomputed in the backward; the MLP tiled in patch_model's default chunks: 14976 tokens
              for Qwen2.5-1.5B, so a micro-batch of 8 x 1280 tokens runs untiled, as offload-untiled)
  offload-tiled    the same in 8192-token chunks (patch_model's default before 2026-11-26)
  offload-untiled  the same with tiled_mlp=False
  offload-lora-add offload as patched before lora_linear: each LoRA layer's base_layer(x), then lora_add per adapter
              (autograd adds the base's and the adapters' input gradients: the "add" it takes out, issue 16)
  offload-nonreentrant  offload as checkpointed before 2026-11-27: torch's non-reentrant checkpoint around each
              layer (its forward with grad, saved tensors packed; the recompute stops at the last one) where the
              layer's forward now runs under no_grad and its backward runs it again
  checkpoint  no offload, HF gradient checkpointing (non-reentrant): what TRL runs
  plain       no offload, no checkpointing: every activation kept
  offload@N   (any offload variant) patch_model(recompute_layers=N): only the first N decoder layers checkpointed
Per variant: one warm-up repeat (Triton autotuning), --repeats timed ones (median wall seconds and torch's peak
GiB per phase), with --sync-sites one repeat counting the host syncs by call site, then (unless --no-trace) one
repeat under torch.profiler summarized per phase by benchmarks.trace_gaps (GPU busy by
kernel category, the top kernels, idle gaps by the host code that was late). JSON: results/update_profile-<card>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_loop import Case, build_folder, fastgrpo_trainer
from benchmarks.common import GIB, card_name, print_table, require_cuda, write_results
from benchmarks.trace_gaps import Trace, print_summary
from fastgrpo.loss.correction import ROLLOUT_CORRECTIONS

PHASES = ("logprobs_old", "logprobs_ref", "update")
VARIANTS = ("offload", "offload-tiled", "offload-untiled", "offload-lora-add", "offload-nonreentrant", "checkpoint",
            "plain")
TILING = {"offload": dict(tiled_mlp=None), "offload-lora-add": dict(tiled_mlp=None),
          "offload-nonreentrant": dict(tiled_mlp=None),
          "offload-tiled": dict(tiled_mlp=True, mlp_chunk_tokens=8192)}


def synthetic_batch(case: Case, vocab: int, device: str) -> tuple[dict, torch.Tensor]:
    """A rollout batch of prompts x generations rows of prompt_length + completion random ids, each prompt's
    generations rows side by side with its ids (as a rollout returns them)."""
    g = torch.Generator().manual_seed(0)
    n, P, C = case.batch, case.prompt_length, case.completion
    ids = torch.randint(3, vocab, (n, P + C), generator=g)
    ids[:, :P] = ids[::case.generations, :P].repeat_interleave(case.generations, 0)
    completion = torch.zeros(n, P + C, dtype=torch.long)
    completion[:, P:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion,
             "rollout_logps": torch.zeros(n, P + C)}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["finish_reasons"] = ["length"] * n
    return batch, torch.randn(n, generator=g).to(device)


def repeat(trainer, batch: dict, advantages: torch.Tensor, clock) -> None:
    """The log-prob passes and the update as train_step runs them (steps 4 and 5)."""
    from fastgrpo.train.loss_setup import prepare_loss_batch

    with clock("logprobs_old"):  # ~0 s where the trainer skips the pass (one optimizer step: _needs_old_pass)
        old = trainer._logprobs(trainer.model, batch) if trainer._needs_old_pass() else None
    with clock("logprobs_ref"):  # the adapter switched off, or full fine-tuning's frozen copy
        ref_model = trainer.model if trainer.ref_model is None else trainer.ref_model
        ref = trainer._logprobs(ref_model, batch, disable_adapter=trainer.ref_model is None)
    with clock("update"):
        loss_batch, _ = prepare_loss_batch(trainer.config, batch, old)
        trainer._update(loss_batch, advantages, old, ref, return_logps=old is None)


class Clock:
    """Wall seconds and torch's peak GiB per phase, synchronized; each phase also a profiler range."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.peaks = cuda, {}, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.profiler.record_function(phase):
            yield
            if self.cuda:
                torch.cuda.synchronize()
        self.seconds.setdefault(phase, []).append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)


def set_variant(trainer, variant: str, fp8_base: bool = False) -> None:
    import fastgrpo

    model = trainer.model
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    variant, _, layers = variant.partition("@")
    tiling = TILING.get(variant, dict(tiled_mlp=False))
    fastgrpo.patch_model(model, offload_activations=variant.startswith("offload"),
                         recompute_layers=int(layers) if layers else None, fp8_base=fp8_base, **tiling)
    if variant == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def code_path(variant: str):
    """offload-lora-add: patch_model's LoRA forward told that no base is one lora_linear can stand in for.
    offload-nonreentrant: the offload wrapper told that its recompute in the backward does not apply."""
    from fastgrpo.offload import checkpointing
    from fastgrpo.patching import forwards

    check, recompute = forwards._frozen_plain_linear, checkpointing._recomputes_in_backward
    name = variant.partition("@")[0]
    if name == "offload-lora-add":
        forwards._frozen_plain_linear = lambda layer, x: False
    if name == "offload-nonreentrant":
        checkpointing._recomputes_in_backward = lambda *args: False
    try:
        yield
    finally:
        forwards._frozen_plain_linear, checkpointing._recomputes_in_backward = check, recompute


def python_profile(trainer, batch, advantages, variant: str, cuda: bool) -> None:
    """One more repeat under cProfile: where the host's time goes when the GPU waits for it (the Python frames
    that torch.profiler's trace shows only as gaps)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    repeat(trainer, batch, advantages, Clock(cuda))
    profiler.disable()
    print(f"--- {variant}: host time by Python function (cProfile, one repeat)")
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


def sync_sites(trainer, batch, advantages, variant: str) -> list[tuple[str, int]]:
    """One more repeat with torch.cuda's sync debug mode: each operation that makes the host wait for the GPU, counted
    by where it was called from (the innermost frames of fastgrpo, transformers, peft or torch.nn)."""
    import traceback
    import warnings

    counts: dict[str, int] = {}
    keep = ("fastgrpo/", "transformers/", "peft/", "torch/nn/", "benchmarks/")

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in keep)]
        site = " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                          for f in reversed(frames[-3:]))
        counts[site] = counts.get(site, 0) + 1

    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # reports itself once: before the recording starts
        warnings.showwarning = record
        try:
            repeat(trainer, batch, advantages, Clock(cuda=False))
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    print(f"--- {variant}: {sum(counts.values())} host syncs in one repeat, by call site")
    for site, n in ranked:
        print(f"{n:6d}  {site}")
    return ranked


def profile_variant(trainer, batch, advantages, variant: str, repeats: int, trace_dir: Path,
                    python: bool = False, syncs: bool = False, no_trace: bool = False, fp8_base: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    set_variant(trainer, variant, fp8_base)
    repeat(trainer, batch, advantages, Clock(cuda))  # warm-up: Triton autotuning, allocator
    clock = Clock(cuda)
    for _ in range(repeats):
        repeat(trainer, batch, advantages, clock)
    row = {"variant": variant, **{f"{p}_s": statistics.median(clock.seconds[p]) for p in PHASES},
           **{f"{p}_peak_gib": clock.peaks[p] for p in PHASES}}
    row["total_s"] = sum(row[f"{p}_s"] for p in PHASES)
    if python:
        python_profile(trainer, batch, advantages, variant, cuda)
    if not cuda:  # the dry run checks the phases, not the trace
        return row
    if syncs:
        row["sync_sites"] = sync_sites(trainer, batch, advantages, variant)
    if no_trace:
        return row
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        repeat(trainer, batch, advantages, Clock(cuda))
    path = trace_dir / f"update-{variant}.json"
    prof.export_chrome_trace(str(path))
    trace = Trace.load(path)
    for phase in PHASES:
        summary = trace.summary(trace.window(phase))
        print_summary(f"{variant} / {phase}", summary)
        row[f"{phase}_profile"] = summary
    with open(path, "rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b-lora")
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models-dir", default=str(Path(tempfile.gettempdir()) / "fastgrpo-bench-models"))
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--python-profile", action="store_true", help="also one repeat under cProfile")
    parser.add_argument("--sync-sites", action="store_true", help="also one repeat counting host syncs by call site")
    parser.add_argument("--no-trace", action="store_true", help="timings only, no profiled repeat")
    parser.add_argument("--rollout-correction", default="none", choices=ROLLOUT_CORRECTIONS,
                        help="GRPOConfig.rollout_correction: with one optimizer step the loss weights itself from its "
                             "own forward, as fastgrpo-fp8 runs it (the synthetic rollout log-probs are 0)")
    parser.add_argument("--fp8-base", action="store_true",
                        help="patch_model(fp8_base=True): the base's GEMMs in e4m3 (LoRA's frozen base; full "
                             "fine-tuning's decoder linears), as fastgrpo-fp8train runs them")
    parser.add_argument("--dry-run", action="store_true", help="CPU check: tiny Qwen2 in --shape's mode, 2 x 4 x (16 + 16)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for variant in variants:  # before the model is built
        name, at, layers = variant.partition("@")
        if name not in VARIANTS or (at and not (name.startswith("offload") and layers.isdigit())):
            raise SystemExit(f"--variants: expected names from {','.join(VARIANTS)} (offload ones with an optional "
                             f"@<recompute_layers>), got {variant!r}")
    if not args.dry_run:
        require_cuda(parser)
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp())
    trace_dir.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else "cuda"
    case = Case(system="fastgrpo", shape=args.shape, completion=args.completion, device=device)
    if args.dry_run:
        case = dataclasses.replace(case, shape=f"tiny-qwen2-{case.mode}", completion=16, prompt_length=16, prompts=2,
                                   generations=4, micro_batch=4)
        args.models_dir = tempfile.mkdtemp(prefix="profile-update-models-")
    case = dataclasses.replace(case, folder=str(build_folder(case.model, Path(args.models_dir), device)))
    trainer = fastgrpo_trainer(case, "fp8train" if args.fp8_base else "builtin")
    trainer.config = dataclasses.replace(trainer.config, rollout_correction=args.rollout_correction)
    batch, advantages = synthetic_batch(case, trainer.model.config.vocab_size, device)
    rows = []
    for variant in variants:
        with code_path(variant):
            rows.append(profile_variant(trainer, batch, advantages, variant, args.repeats, trace_dir,
                                        args.python_profile, args.sync_sites, args.no_trace, args.fp8_base))
    config = {"shape": case.shape, "completion": case.completion, "batch": f"{case.batch} x ({case.prompt_length} + "
              f"{case.completion})", "micro_batch": case.micro_batch, "beta": case.beta, "repeats": args.repeats,
              "rollout_correction": args.rollout_correction, "fp8_base": args.fp8_base, "card": card_name(), "trace_dir": str(trace_dir)}
    directory = Path(tempfile.mkdtemp()) if args.dry_run else None
    print(f"wrote {write_results('update_profile', rows, config, directory)}")
    print_table(rows, ["variant", *[f"{p}_s" for p in PHASES], "total_s", *[f"{p}_peak_gib" for p in PHASES]])


if __name__ == "__main__":
    main()
