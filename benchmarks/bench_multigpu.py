"""Data-parallel GRPO on 2 GPUs vs 1: Qwen2.5-1.5B LoRA (DDP) and full fine-tuning (FSDP2), and Llama-3.1-8B full
fine-tuning with FSDP2 on 2 GPUs capped at 24 GiB each (torch.cuda.set_per_process_memory_fraction).

    python -m benchmarks.bench_multigpu                 # every case; writes results/multigpu-<card>.json, table last
    torchrun --nproc_per_node 2 -m benchmarks.bench_multigpu --case qwen-full --out rows.jsonl   # one case
    python -m benchmarks.bench_multigpu --summarize rows.jsonl --suite NAME   # on the same machine: its card

FASTGRPO_BENCH_BIND=1 pins each rank to its own physical cores; every row carries each rank's host probes
(benchmarks/host_probe.py: when the host had launched the step, its main thread's CPU time, GC pauses, its CPUs).

A step here is the trainer's update of one global batch (GRPOTrainer._update: forward + backward of every micro-
batch, the gradient all-reduce / reduce-scatter, clipping, AdamW), on random token ids with the completion mask and
advantages of a GRPO batch: the part that data parallelism divides (the rollout's decode is latency-bound and
takes about as long for half the rows). The `-step` cases time whole GRPO steps instead (train_step: the rollout of
the full completion with EOS ignored, rewards, reference log-probs, the update). The global batch is the same on 1
and 2 GPUs (whole groups of 8 per rank), so steps/s on 2 GPUs over 1 GPU is the speed-up; peak memory is the
highest of the ranks'. The 2-GPU full fine-tuning case also runs one whole train_step (rollout of 32 tokens under
FSDP2 with gathered weights, rewards, update) to check the per-rank engine on CUDA. Models are built from configs
with random weights and patched (fastgrpo.patch_model, no activation offload or checkpointing but in the `-offload`
cases); bf16 weights, AdamW states in bf16.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import GIB, card_name, print_table, write_results
from benchmarks.e2e import MODEL_CONFIGS
from benchmarks.host_probe import GcClock, bind_local_rank

_QWEN = dict(model="qwen2.5-1.5b", groups=2, prompt=256, completion=1024, micro=8, steps=4)
_FULL = dict(_QWEN, lora_rank=0, baseline="qwen-full")  # the 1-GPU step: resharding and grouping are FSDP2's alone
# the loop benchmark's batch (bench_loop: 8 prompts x 8 generations), 4 micro-batches per rank on 2 GPUs
_FULL_64 = dict(_FULL, groups=8, steps=3, baseline="qwen-full-64")
CASES = {
    # Qwen2.5-1.5B, 2 prompts x 8 generations of 256 + 1024 tokens (the README's e2e shape, two groups)
    "qwen-lora": dict(_QWEN, lora_rank=16),
    "qwen-full": _FULL,
    # the same with fsdp_reshard_after_forward off: each layer gathered once per micro-batch, not twice
    "qwen-full-keep": dict(_FULL, reshard=False),
    # the same with 2 / 4 consecutive layers per FSDP2 group: fewer collectives and per-group hooks on the host
    "qwen-full-g2": dict(_FULL, layers_per_group=2),
    "qwen-full-g4": dict(_FULL, layers_per_group=4),
    "qwen-full-keep-g4": dict(_FULL, reshard=False, layers_per_group=4),
    "qwen-full-keep-g7": dict(_FULL, reshard=False, layers_per_group=7),
    "qwen-full-keep-g14": dict(_FULL, reshard=False, layers_per_group=14),
    # 8 groups: a micro-batch's host work overlaps the previous one's GPU work, as on one GPU
    "qwen-lora-64": dict(_QWEN, lora_rank=16, groups=8, steps=3),
    "qwen-full-64": _FULL_64,
    "qwen-full-keep-g4-64": dict(_FULL_64, reshard=False, layers_per_group=4),
    # the same batch in micro-batches of 16: half the launches per step for the same GPU work (2 per rank on 2 GPUs)
    "qwen-lora-64-mb16": dict(_QWEN, lora_rank=16, groups=8, steps=5, micro=16),
    "qwen-full-64-mb16": dict(_FULL_64, steps=5, micro=16, baseline="qwen-full-64-mb16"),
    "qwen-full-keep-g4-64-mb16": dict(_FULL_64, steps=5, micro=16, reshard=False, layers_per_group=4,
                                      baseline="qwen-full-64-mb16"),
    # LoRA with activation offload (the 24 GB card's setting): the recompute in the backward, and the non-reentrant
    # checkpoint it replaced (offload_old), at micro-batches of 8
    "qwen-lora-64-offload": dict(_QWEN, lora_rank=16, groups=8, steps=3, offload=True),
    "qwen-lora-64-offload-old": dict(_QWEN, lora_rank=16, groups=8, steps=3, offload=True, offload_old=True),
    # whole GRPO steps of that batch (train_step: the rollout of 1024 tokens, EOS ignored, each rank decoding its
    # groups; rewards; reference log-probs at beta 0.04; the update), the first of 3 not timed
    "qwen-lora-64-mb16-step": dict(_QWEN, lora_rank=16, groups=8, steps=3, micro=16, whole_steps=True),
    "qwen-full-keep-g4-64-mb16-step": dict(_FULL_64, steps=3, micro=16, reshard=False, layers_per_group=4,
                                           whole_steps=True, baseline="qwen-full-keep-g4-64-mb16-step"),
    # the same at 32 prompts x 8 (256 rows): each rank decodes 128, where a step's cost depends more on the rows
    "qwen-lora-256-mb16-step": dict(_QWEN, lora_rank=16, groups=32, steps=3, micro=16, whole_steps=True),
    "qwen-full-keep-g4-256-mb16-step": dict(_FULL_64, groups=32, steps=3, micro=16, reshard=False, layers_per_group=4,
                                            whole_steps=True, baseline="qwen-full-keep-g4-256-mb16-step"),
    # and at 64 prompts x 8 (512 rows, 256 a rank)
    "qwen-lora-512-mb16-step": dict(_QWEN, lora_rank=16, groups=64, steps=3, micro=16, whole_steps=True),
    "qwen-full-keep-g4-512-mb16-step": dict(_FULL_64, groups=64, steps=3, micro=16, reshard=False, layers_per_group=4,
                                            whole_steps=True, baseline="qwen-full-keep-g4-512-mb16-step"),
    # full fine-tuning with fsdp_sync_every_micro_batch off: each group gathered and reduced once per minibatch
    "qwen-full-keep-g4-64-mb16-acc": dict(_FULL_64, steps=5, micro=16, reshard=False, layers_per_group=4,
                                          accumulate=True, baseline="qwen-full-64-mb16"),
    "qwen-full-keep-g4-512-mb16-step-acc": dict(_FULL_64, groups=64, steps=3, micro=16, reshard=False,
                                                layers_per_group=4, whole_steps=True, accumulate=True,
                                                baseline="qwen-full-keep-g4-512-mb16-step"),
    # 8B: 2 x 8 x (128 + 256) tokens, weights / gradients / AdamW shards in CPU memory (8B x 2 bytes x 4 over 2
    # ranks is 30 GiB a GPU without offload), micro-batches of 4
    "llama8b-full": dict(model="llama-3.1-8b", lora_rank=0, groups=2, prompt=128, completion=256, micro=4, steps=2,
                         cap_gib=24, cpu_offload=True),
    # one whole train_step of the FSDP2 model (last: its decode step compiles for a while)
    "qwen-full-rollout": dict(_FULL, steps=1, rollout_check=True, baseline=None),
}
G = 8
# what a plain run launches on 2 GPUs (the other grouping cases: --case), in this order while DEADLINE_S lasts
DEFAULT_2GPU = ("qwen-lora", "qwen-full", "qwen-full-keep", "qwen-full-keep-g4", "llama8b-full", "qwen-full-rollout")
# seconds per launch
TIMEOUTS = {**{name: 75 for name in CASES}, "qwen-lora-64": 120, "qwen-full-64": 100,
            **{name: 150 for name in CASES if "-mb16" in name or "-offload" in name},
            "llama8b-full": 150, "qwen-full-rollout": 90}
DEADLINE_S = float(os.environ.get("FASTGRPO_BENCH_DEADLINE", "540"))  # for all launches together
# FASTGRPO_BENCH_CPU=1: the same code path on the CPU (gloo) with a tiny model, to check this file without a GPU
CPU = bool(os.environ.get("FASTGRPO_BENCH_CPU"))
PROFILE = bool(os.environ.get("FASTGRPO_BENCH_PROFILE"))  # one more step under torch.profiler, summary printed
# FASTGRPO_BENCH_BIND=1: each rank pinned to its own physical cores (benchmarks.host_probe.bind_local_rank)
BIND = bool(os.environ.get("FASTGRPO_BENCH_BIND"))
SAMPLE = 4096  # weight elements per tensor compared before and after the steps
if CPU:
    CASES = {name: dict(spec, model="tiny-qwen2", prompt=16, completion=16, micro=4, steps=2)
             for name, spec in CASES.items()}
DEVICE = "cpu" if CPU else "cuda"


def _tokenizer(vocab_size: int, eos: bool = True):
    """Token i is the word `t<i>`, so any sampled id decodes; without `eos` no id ends a completion."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>" if eos else None,
                                   padding_side="left")


def _reward(prompts, completions, **columns):
    return [len(text) % 97 / 97 for text in completions]


def _build(spec: dict):
    import fastgrpo
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MODEL_CONFIGS[spec["model"]])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if spec["lora_rank"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"],
                                                 target_modules="all-linear"))
    model.config.use_cache = False
    return fastgrpo.patch_model(model, offload_activations=spec.get("offload", False)).train()


def _batch(spec: dict, vocab: int, device) -> tuple[dict, torch.Tensor]:
    """The global batch: groups x G sequences of prompt + completion random ids, every completion token counted."""
    g = torch.Generator().manual_seed(1)
    n, P, C = spec["groups"] * G, spec["prompt"], spec["completion"]
    ids = torch.randint(2, vocab, (n, P + C), generator=g)
    completion = torch.zeros(n, P + C, dtype=torch.long)
    completion[:, P:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
    return {k: v.to(device) for k, v in batch.items()}, torch.randn(n, generator=g).to(device)


def run_case(name: str, out: str) -> None:
    """One case in this process (one of torchrun's ranks, or alone): rank 0 appends its row to `out`."""
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.process_group import init_distributed
    from fastgrpo.train.trainer import GRPOTrainer

    spec = CASES[name]
    bound = bind_local_rank() if BIND else None
    group = init_distributed(DEVICE)
    if "cap_gib" in spec and not CPU:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(spec["cap_gib"] * GIB / total)
    spec = dict(spec, cpu_offload=spec.get("cpu_offload", False) and not CPU)
    t0 = time.perf_counter()
    model = _build(spec)
    whole_steps = spec.get("whole_steps", False)  # their completions run to `completion` tokens: EOS ignored
    if whole_steps:  # the engine stops on the tokenizer's EOS and the generation config's
        model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    dataset = [{"prompt": " ".join(f"t{i}" for i in torch.randint(2, vocab, (spec["prompt"],)).tolist())}
               for _ in range(4 * spec["groups"])]
    config = GRPOConfig(
        model=spec["model"], lora_rank=spec["lora_rank"], batch_size=spec["groups"] * G, num_generations=G,
        micro_batch_size=spec["micro"], max_prompt_length=spec["prompt"], max_completion_length=spec["completion"],
        learning_rate=1e-6, beta=0.04 if whole_steps else 0.0, fsdp_cpu_offload=spec["cpu_offload"],
        fsdp_reshard_after_forward=spec.get("reshard", True), fsdp_layers_per_group=spec.get("layers_per_group", 1),
        fsdp_sync_every_micro_batch=not spec.get("accumulate", False),
        output_dir=tempfile.mkdtemp(), export=False,
        progress_bar=False, logging_steps=0, max_steps=1, device=DEVICE, dtype="bfloat16",
    )
    trainer = GRPOTrainer(model, _tokenizer(vocab, eos=not whole_steps), _reward, dataset, config)
    build_s = time.perf_counter() - t0
    batch, advantages = _batch(spec, vocab, trainer.device)
    batch = {k: trainer.dist.own_rows(v) for k, v in batch.items()}
    advantages = trainer.dist.own_rows(advantages)
    if not CPU:
        torch.cuda.reset_peak_memory_stats()
    before = _weight_sample(trainer.model), _mean_logp(trainer, batch)
    times, probes, losses, phases = [], [], [], []
    launched = _mark_launch_end(trainer)
    with GcClock() as gc_clock:
        for _ in range(spec["steps"]):
            _sync()
            gc_clock.take()
            start, start_cpu = time.perf_counter(), time.thread_time()
            if whole_steps:
                metrics = trainer.train_step()
                losses.append(metrics["loss"])
                phases.append({k: metrics[k] for k in ("rollout_s", "rewards_s", "reference_s", "train_s",
                                                       "completion_length")})
            else:
                losses.append(trainer._update(batch, advantages, None, None)[0]["loss"])
            _sync()
            times.append(time.perf_counter() - start)
            wall, cpu = launched.pop()
            probes.append({"launch_ms": 1000 * (wall - start), "launch_cpu_ms": 1000 * (cpu - start_cpu),
                           "gc_ms": gc_clock.take()})
    moved = _moved(before, trainer, batch, group)
    profile = PROFILE and not spec["cpu_offload"] and not spec.get("rollout_check")  # the timed qwen steps
    # every rank traces the same step: a launch's slow rank shows as the other's GPU waiting in its collectives
    profiles = _gather(group, _profile_step(trainer, batch, advantages, name, group)) if profile else None
    peak = torch.tensor([0.0 if CPU else torch.cuda.max_memory_allocated() / GIB], device=group.device)
    if group.active:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    step = statistics.median(times[1:] or times)  # the first step compiles the Triton kernels
    row = {
        "case": name, "model": spec["model"], "mode": "lora16" if spec["lora_rank"] else "full",
        "gpus": group.world_size, "engine": ("ddp" if spec["lora_rank"] else "fsdp2") if group.active else "single",
        "global_batch": f"{spec['groups'] * G} x ({spec['prompt']} + {spec['completion']})",
        "micro_batch": spec["micro"], "reshard_after_forward": spec.get("reshard", True),
        "layers_per_group": spec.get("layers_per_group", 1),
        "sync_every_micro_batch": not spec.get("accumulate", False), "step_ms": 1000 * step, "steps_s": 1 / step,
        "step_ms_all": [1000 * t for t in times], "loss": losses, "loss_finite": all(map(math.isfinite, losses)),
        "peak_gib_per_gpu": peak.item(), "cap_gib": spec.get("cap_gib"), "cpu_offload": spec["cpu_offload"],
        "build_s": build_s, **moved,
        "cpu_bind": bound is not None, "host_probes": _gather(group, {
            "cpus": sorted(bound or os.sched_getaffinity(0)), "steps": probes}),
    }
    if profiles and all(profiles):
        row["profiles"] = profiles
    if phases:
        row["whole_steps"] = phases
    if spec.get("rollout_check") and group.active:
        row.update(_whole_step(trainer))
    if group.is_main:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def _weight_sample(model) -> list[torch.Tensor]:
    """The first SAMPLE elements of this rank's part of every trained weight, copied."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    # clone: .float() of an fp32 tensor on the CPU is the tensor itself
    return [p.detach().flatten()[:SAMPLE].float().cpu().clone() for p in local]


def _mean_logp(trainer, batch: dict) -> float:
    """Mean log-prob of this rank's completion tokens under the current weights (moves when the model trains)."""
    mask = batch["completion_mask"].bool()
    return trainer._logprobs(trainer.model, batch)[mask].float().mean().item()


def _moved(before: tuple, trainer, batch: dict, group) -> dict:
    """Whether the steps changed the model: the share of sampled weight elements that changed (bf16 weights lose
    updates far below their precision unless rounded stochastically) and the mean completion log-prob before and
    after, both over all ranks."""
    weights, logp = before
    after = _weight_sample(trainer.model)
    counts = torch.tensor([float(sum((a != b).sum().item() for a, b in zip(after, weights))),
                           float(sum(b.numel() for b in weights)), logp, _mean_logp(trainer, batch)],
                          device=group.device)
    if group.active:
        torch.distributed.all_reduce(counts)
        counts[2:] /= group.world_size
    changed, total, logp_before, logp_after = counts.tolist()
    return {"weights_changed_frac": changed / max(total, 1.0), "logp_before": logp_before, "logp_after": logp_after}


def _profile_step(trainer, batch: dict, advantages: torch.Tensor, name: str, group) -> dict | None:
    """One more update under torch.profiler: the kernels that take the step's GPU time, and the GPU's idle gaps
    charged to the host code that was late (benchmarks.trace_gaps); the trace is kept in FASTGRPO_BENCH_TRACE_DIR.
    Returns this rank's summary (None on the CPU, where rank 0 prints the ops' table instead)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.trace_gaps import Trace, print_summary

    activities = [ProfilerActivity.CPU] + ([] if CPU else [ProfilerActivity.CUDA])
    _sync()
    with profile(activities=activities) as prof:
        with record_function("update"):
            trainer._update(batch, advantages, None, None)
            _sync()
    if CPU:
        if group.is_main:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
        return None
    trace_dir = Path(os.environ.get("FASTGRPO_BENCH_TRACE_DIR") or tempfile.mkdtemp())
    path = trace_dir / f"{name}-{group.world_size}gpu-rank{group.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    trace = Trace.load(path)
    summary = trace.summary(trace.window("update"))
    if group.is_main:
        print_summary(f"profile {name} on {group.world_size} GPU(s), rank 0 (trace {path})", summary)
    return summary


def _whole_step(trainer) -> dict:
    """One train_step with a 32-token rollout: the engine on gathered FSDP2 weights, compiled and CUDA-graphed."""
    import dataclasses

    trainer.sampling = dataclasses.replace(trainer.sampling, max_new_tokens=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.train_step()
    fallbacks = [str(w.message)[:160] for w in caught if "rollout:" in str(w.message)]
    return {"whole_step": {k: metrics[k] for k in ("reward", "loss", "rollout_s", "train_s", "completion_length")},
            "rollout_fallback_warnings": fallbacks}


def _mark_launch_end(trainer) -> list:
    """Record (wall, main-thread CPU) time when _update has launched all its work: its last call, dist.mean, comes
    right before the step's final host sync (the wall time includes the waits of its earlier syncs: the token count
    per minibatch). Launch time near the step's time means the host bounds the step; launch CPU time below launch
    wall time means the main thread waited (a sync, the backward, which autograd runs on its own thread, or no
    free core)."""
    marks, mean = [], trainer.dist.mean

    def timed_mean(value):
        marks.append((time.perf_counter(), time.thread_time()))
        return mean(value)

    trainer.dist.mean = timed_mean
    return marks


def _gather(group, probe: dict) -> list[dict]:
    """Every rank's probe, in rank order (rank 0 writes the row)."""
    if not group.active:
        return [probe]
    probes = [None] * group.world_size
    torch.distributed.all_gather_object(probes, probe)
    return probes


def _host_summary(row: dict) -> str:
    """Per rank: CPUs, median launch wall / CPU ms of the timed steps, GC ms over them."""
    parts = []
    for rank, probe in enumerate(row["host_probes"]):
        timed = probe["steps"][1:] or probe["steps"]
        launch = statistics.median(s["launch_ms"] for s in timed)
        cpu = statistics.median(s["launch_cpu_ms"] for s in timed)
        gc_ms = sum(sum(s["gc_ms"]) for s in timed)
        cpus = len(probe["cpus"])
        parts.append(f"rank {rank}: {cpus} cpus, launch {launch:.0f} ms (cpu {cpu:.0f}), gc {gc_ms:.1f} ms")
    return "; ".join(parts)


def _sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def _code_path(name: str):
    """offload_old cases run as profile_update's offload-nonreentrant variant: the offload wrapper told that its
    recompute in the backward does not apply."""
    if not CASES[name].get("offload_old"):
        return contextlib.nullcontext()
    from benchmarks.profile_update import code_path

    return code_path("offload-nonreentrant")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--out")
    parser.add_argument("--summarize", metavar="ROWS",
                        help="no runs: speed-ups, table and results/<suite>-<card>.json from a rows file that "
                             "--case launches appended to (one 1-GPU row per case family)")
    parser.add_argument("--suite", help="results file name with --summarize (required: not the default runs' file)")
    args = parser.parse_args()
    if args.summarize and not args.suite:
        parser.error("--suite: required with --summarize (results/<suite>-<card>.json)")
    if args.summarize and not Path(args.summarize).is_file():  # else a results file of no rows, earlier runs pushed down
        parser.error(f"--summarize: expected the rows file that --case launches appended to, got {args.summarize!r} "
                     "(no such file)")
    if args.case:
        with _code_path(args.case):
            run_case(args.case, args.out)
    elif args.summarize:
        summarize(args.summarize, args.suite, {"rows_from": args.summarize})
    else:
        out, status = launch_all()
        summarize(out, "multigpu", {"exit_codes": status})


def launch_all() -> tuple[str, dict]:
    """Every default case, each its own launch, while DEADLINE_S lasts; returns the rows file and exit codes."""
    out = str(Path(tempfile.mkdtemp()) / "rows.jsonl")
    me = [sys.executable, "-m", "benchmarks.bench_multigpu"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    status, start = {}, time.monotonic()
    # the 1-GPU baselines side by side, one on each GPU; then the 2-GPU runs one after another
    phases = [[(c, me, {"CUDA_VISIBLE_DEVICES": str(i)}) for i, c in enumerate(("qwen-lora", "qwen-full"))],
              *([(c, torchrun + me[1:], {})] for c in DEFAULT_2GPU)]
    for phase in phases:
        left = DEADLINE_S - (time.monotonic() - start)
        if left < 20:
            status.update({f"{c}/{'1' if env else '2'}gpu": "skipped (deadline)" for c, _, env in phase})
            continue
        running = [(c, subprocess.Popen(cmd + ["--case", c, "--out", out], env={**os.environ, **env}), env)
                   for c, cmd, env in phase]
        for case, proc, env in running:
            key = f"{case}/{'1' if env else '2'}gpu"
            remaining = DEADLINE_S - (time.monotonic() - start)
            try:
                status[key] = proc.wait(timeout=max(1.0, min(TIMEOUTS[case], remaining)))
            except subprocess.TimeoutExpired:
                proc.terminate()  # SIGTERM: torchrun's agent stops its workers first (SIGKILL would orphan them)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                status[key] = "timeout"
    return out, status


def summarize(out: str, suite: str, config: dict) -> None:
    """Speed-ups over the 1-GPU row of each case's family, results JSON, per-rank host probes, table last."""
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()] if Path(out).exists() else []
    single = {}  # a case's 1-GPU step: the median of its launches (run before and after the 2-GPU ones)
    for r in rows:
        if r["gpus"] == 1:
            single.setdefault(r["case"], []).append(r["step_ms"])
    for r in rows:
        baseline = CASES[r["case"]].get("baseline", r["case"])
        base = statistics.median(single[baseline]) if r["gpus"] > 1 and baseline in single else None
        r["speedup"] = base / r["step_ms"] if base else None
    path = write_results(suite, rows, {**config, "cases": CASES, "card": card_name(),
                                       "gpus_visible": torch.cuda.device_count()})
    print(json.dumps(config))
    print(f"wrote {path}")
    for r in rows:
        if "whole_step" in r or r["cpu_offload"]:
            print(r["case"], {k: r.get(k) for k in ("step_ms_all", "loss", "whole_step", "rollout_fallback_warnings")})
    for r in rows:
        if "host_probes" in r:
            print(r["case"], f"{r['gpus']} GPU(s)", "bound" if r["cpu_bind"] else "unbound", _host_summary(r))
    print_table(rows, ["case", "gpus", "engine", "global_batch", "step_ms", "steps_s", "speedup",
                       "peak_gib_per_gpu", "cap_gib", "weights_changed_frac", "logp_before", "logp_after"])


if __name__ == "__main__":
    main()
