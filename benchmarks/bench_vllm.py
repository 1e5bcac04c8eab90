"""The vLLM engine against the built-in engine and HF generate: tokens/s, weight syncs, memory, and GRPO runs.

    python -m benchmarks.bench_vllm                                  # every case
    python -m benchmarks.bench_vllm --cases grpo rollout-qwen2.5-1.5b  # some

Each case runs in its own process (vLLM's CuMem pool is one per process) and adds its rows to
benchmarks/results/vllm-<card>.json as it ends; a failing case leaves a row with its error.

rollout-<model>: random weights of the model's shapes built from its config (benchmarks.common), bf16; the vLLM
engine writes the config and a tokenizer to a local folder and takes the weights from the trainer's tensors
(load_format="dummy", then the binding). 8 prompts of 256 random ids x 8 generations, 1024 new tokens, pure
sampling (temperature 1), EOS ignored. Built-in engine: one warm-up call (it compiles), one timed. HF generate:
HF_NEW_TOKENS new tokens (its tokens/s at 1024 would take a minute a model). vLLM: one warm-up, timed seeded (as
the trainer calls it) and unseeded. Memory from cudaMemGetInfo (the device's used bytes, torch's cache emptied):
`base` with the trainer's weights alone, then vLLM built, during a rollout (KV mapped) and after release_memory
(the training phase). qwen2.5-1.5b also wraps the model in LoRA r=16 (all linears) with lora_sync="merge" (vLLM
then runs the plain model: its rollout speed is full fine-tuning's) and times a full-weight copy through vLLM's
own load_weights (what a vLLM that keeps its own copy pays per step); lora-adapter-qwen2.5-1.5b the same LoRA
through vLLM's LoRA path.

grpo: `fastgrpo train` of the built-in task on the GPU (bf16) for each arm (built-in engine; vLLM; vLLM with the
rollout correction) and each of GRPO_SEEDS, all at once; reward curves (mean over seeds, min-max band) side by side
in vllm_grpo_rewards.png, and per arm the mean and seed-to-seed spread of the last ten steps' reward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import GIB, RESULTS_DIR, card_name, print_table, require_cuda, versions

PROMPTS, GENERATIONS, PROMPT_LEN = 8, 8, 256
NEW_TOKENS = int(os.environ.get("FASTGRPO_VLLM_NEW_TOKENS", "1024"))
HF_NEW_TOKENS = int(os.environ.get("FASTGRPO_VLLM_HF_NEW_TOKENS", "64"))
GRPO_STEPS = int(os.environ.get("FASTGRPO_VLLM_GRPO_STEPS", "100"))
GRPO_SEEDS = [int(s) for s in os.environ.get("FASTGRPO_VLLM_GRPO_SEEDS", "0 1 2").split()]
LORA_RANK = 16
CASES = ("grpo", "rollout-qwen2.5-1.5b", "lora-adapter-qwen2.5-1.5b", "rollout-llama-3.1-8b")


# ---- measurement helpers ----
def used_gib() -> float:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GIB


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Median wall seconds of fn() (synchronized) and its last result."""
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def tokens_per_s(out, seconds: float) -> float:
    return out.completion_mask.sum().item() / seconds


def build(model_name: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from benchmarks.e2e import MODEL_CONFIGS

    fields = dict(MODEL_CONFIGS[model_name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # EOS ignored: every row generates NEW_TOKENS
    model.generation_config.pad_token_id = 0
    vocab = {f"t{i} ": i for i in range(config.vocab_size)}  # a real fast tokenizer over the whole vocabulary
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0 ")
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, config.vocab_size, (PROMPTS, PROMPT_LEN), generator=g).tolist()
    return model, tokenizer, prompts


def sampling(new_tokens: int = NEW_TOKENS):
    from fastgrpo.rollout import SamplingParams

    return SamplingParams(max_new_tokens=new_tokens, temperature=1.0)


def builtin_rows(model, tok, prompts) -> list[dict]:
    from fastgrpo.rollout import BuiltinEngine

    engine = BuiltinEngine(model, tok)
    call = lambda: engine.generate(prompts, num_generations=GENERATIONS, sampling=sampling(), seed=0)  # noqa: E731
    first, _ = timed(call)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds, out = timed(call)
    extra = (torch.cuda.max_memory_allocated() - before) / GIB
    row = {"engine": "builtin", "tokens_per_s": tokens_per_s(out, seconds), "seconds": seconds,
           "first_call_s": first, "rollout_extra_gib": extra, "training_extra_gib": 0.0}
    del out
    return [row]


def hf_rows(model, prompts) -> list[dict]:
    ids = torch.tensor(prompts, device="cuda")

    def call(n):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=n, num_return_sequences=GENERATIONS, pad_token_id=0)

    call(4)
    seconds, out = timed(lambda: call(HF_NEW_TOKENS))
    new = (out.shape[1] - PROMPT_LEN) * out.shape[0]
    return [{"engine": "hf_generate", "tokens_per_s": new / seconds, "seconds": seconds,
             "new_tokens": HF_NEW_TOKENS}]


def vllm_rows(model, tok, prompts, label: str, **engine_kwargs) -> tuple[list[dict], object]:
    from vllm.device_allocator.cumem import CuMemAllocator

    from fastgrpo.rollout.vllm import VLLMEngine

    base = used_gib()
    start = time.perf_counter()
    engine = VLLMEngine(model, tok, max_model_len=PROMPT_LEN + NEW_TOKENS, max_num_seqs=PROMPTS * GENERATIONS,
                        **engine_kwargs)
    build_s = time.perf_counter() - start
    built = used_gib()
    kv = sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == "kv_cache")

    def call(seed):
        return engine.generate(prompts, num_generations=GENERATIONS, sampling=sampling(), seed=seed)

    first, _ = timed(lambda: call(0))
    seconds, out = timed(lambda: call(0))
    unseeded_s, _ = timed(lambda: call(None))
    assert out.completion_ids.shape == (PROMPTS * GENERATIONS, NEW_TOKENS), out.completion_ids.shape
    rollout = used_gib()
    release_s, _ = timed(engine.release_memory)
    released = used_gib()
    reacquire_s, _ = timed(engine.reacquire_memory)
    sync_s, _ = timed(lambda: engine.load_weights(model), repeats=5)
    engine.release_memory()
    row = {
        "engine": label, "tokens_per_s": tokens_per_s(out, seconds), "seconds": seconds,
        "tokens_per_s_unseeded": tokens_per_s(out, unseeded_s), "first_call_s": first, "build_s": build_s,
        "kv_cache_gib": kv / GIB, "base_used_gib": base, "built_extra_gib": built - base,
        "rollout_extra_gib": rollout - base, "training_extra_gib": released - base,
        "release_ms": release_s * 1e3, "reacquire_ms": reacquire_s * 1e3, "sync_ms": sync_s * 1e3,
        "copies": len(engine.copies), **{k: v for k, v in engine_kwargs.items() if isinstance(v, (str, bool))},
    }
    return [row], engine


def full_copy_sync_ms(engine, model) -> float:
    """A full weight sync the way a vLLM that keeps its own copy does it (TRL): vLLM's load_weights from the
    trainer's tensors in memory. The tensors are clones here (the shared ones would copy onto themselves)."""
    from fastgrpo.rollout.vllm_weights import hf_name, is_adapter_param

    state = [(hf_name(n), p.detach().clone()) for n, p in model.named_parameters() if not is_adapter_param(n)]
    engine.reacquire_memory()
    seconds, _ = timed(lambda: engine.vllm_model.load_weights(iter(state)), repeats=3)
    engine.release_memory()
    return seconds * 1e3


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules="all-linear"))


# ---- cases (each in its own process) ----
def case_rollout(model_name: str) -> list[dict]:
    model, tok, prompts = build(model_name)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    rows = builtin_rows(model, tok, prompts) + hf_rows(model, prompts)
    torch._dynamo.reset()  # the built-in engine's compiled step holds the weights it was traced with
    torch.cuda.empty_cache()
    if model_name.startswith("qwen"):
        # LoRA merged into vLLM's copy of the adapted weights: vLLM runs the plain model (full FT's speed)
        model = lora(model)
        vrows, engine = vllm_rows(model, tok, prompts, "vllm", execution="graphs", lora_sync="merge")
        vrows[0]["full_copy_sync_ms"] = full_copy_sync_ms(engine, model)
        vrows[0]["note"] = "LoRA r16 merge (vLLM runs the plain model); sync_ms = merged LoRA sync"
    else:
        vrows, engine = vllm_rows(model, tok, prompts, "vllm", execution="graphs")
        vrows[0]["note"] = "full fine-tuning, every weight shared; sync_ms = nothing to copy"
    rows += vrows
    for row in rows:
        row.update(model=model_name, weights_gib=weights)
    return rows


def case_lora_adapter(model_name: str) -> list[dict]:
    model, tok, prompts = build(model_name)
    model = lora(model)
    rows, _ = vllm_rows(model, tok, prompts, "vllm_lora_adapter", execution="graphs", lora_sync="adapter")
    rows[0].update(model=model_name, note="LoRA r16 through vLLM's LoRA path; sync_ms = adapter sync")
    return rows


GRPO_ARMS = {  # name: extra `fastgrpo train` flags
    "builtin": ["--rollout-engine", "builtin"],
    "vllm": ["--rollout-engine", "vllm", "--vllm-execution", "eager"],
    # the same vLLM run with TRL's rollout correction (its metrics measure the engine/trainer log-prob gap)
    "vllm-truncate": ["--rollout-engine", "vllm", "--vllm-execution", "eager", "--rollout-correction", "truncate"],
}


def case_grpo() -> list[dict]:
    """Every arm x seed at once (the curves, not the speed, are compared), each its own `fastgrpo train`."""
    runs = {}
    for arm, flags in GRPO_ARMS.items():
        for seed in GRPO_SEEDS:
            out = Path(tempfile.mkdtemp(prefix=f"grpo-{arm}-{seed}-"))
            cmd = [sys.executable, "-m", "fastgrpo.train.cli", "train", "--device", "cuda", "--dtype", "bfloat16",
                   "--max-steps", str(GRPO_STEPS), "--seed", str(seed), "--output-dir", str(out / "run"), *flags,
                   "--no-export", "--no-progress-bar"]
            log = open(out / "log", "w")
            runs[arm, seed] = (out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.perf_counter())
    rows = []
    for (arm, seed), (out, proc, start) in runs.items():
        rc = proc.wait()
        metrics = out / "run" / "metrics.jsonl"
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        rewards = [m["reward"] for m in steps]
        gaps = [m["rollout_logp_diff"] for m in steps if "rollout_logp_diff" in m]
        row = {"engine": arm, "seed": seed, "case": "grpo", "rc": rc, "steps": len(steps),
               "wall_s": time.perf_counter() - start,
               "reward_first10": statistics.mean(rewards[:10]) if rewards else None,
               "reward_last10": statistics.mean(rewards[-10:]) if rewards else None, "rewards": rewards,
               "rollout_logp_diff_mean": statistics.mean(gaps) if gaps else None,
               "peak_gpu_mem_gib": max((m.get("peak_gpu_mem_gib", 0) for m in steps), default=None)}
        if rc:
            row["error"] = (out / "log").read_text()[-1500:]
        rows.append(row)
    _plot(rows)
    return rows


def grpo_summary(rows: list[dict]) -> list[dict]:
    """Per arm over its seeds: the mean and the seed-to-seed standard deviation of the last ten steps' reward."""
    summary = []
    for arm in dict.fromkeys(r["engine"] for r in rows):
        last = [r["reward_last10"] for r in rows if r["engine"] == arm and r.get("reward_last10") is not None]
        summary.append({"engine": arm, "seeds": len(last),
                        "reward_last10_mean": statistics.mean(last) if last else None,
                        "reward_last10_sd": statistics.stdev(last) if len(last) > 1 else None,
                        "reward_last10_all": [round(x, 3) for x in last]})
    return summary


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm in dict.fromkeys(r["engine"] for r in rows):
        curves = torch.tensor([r["rewards"] for r in rows if r["engine"] == arm and len(r["rewards"]) == GRPO_STEPS])
        if not len(curves):
            continue
        steps = range(1, GRPO_STEPS + 1)
        line, = ax.plot(steps, curves.mean(0), label=f"{arm} (mean of {len(curves)} seeds)")
        ax.fill_between(steps, curves.min(0).values, curves.max(0).values, color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="mean reward", title=f"GRPO, built-in task, {card_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "vllm_grpo_rewards.png", dpi=120)


def run_case(name: str) -> list[dict]:
    if name == "grpo":
        return case_grpo()
    kind, _, model_name = name.partition("-")
    if kind == "rollout":
        return case_rollout(model_name)
    return case_lora_adapter(model_name.removeprefix("adapter-"))


# ---- driver ----
def results_path() -> Path:
    import re

    return RESULTS_DIR / f"vllm-{re.sub(r'[^a-z0-9]+', '-', card_name().lower()).strip('-')}.json"


def record(case: str, rows: list[dict]) -> None:
    """Replace this case's rows in the results file (the other cases' rows stay)."""
    import datetime

    path = results_path()
    payload = json.loads(path.read_text()) if path.exists() else {"suite": "vllm", "rows": []}
    payload["rows"] = [r for r in payload["rows"] if r.get("case") != case] + [{"case": case, **r} for r in rows]
    payload.update(card=card_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   versions={**versions(), "vllm": _vllm_version()}, config={
                       "prompts": PROMPTS, "generations": GENERATIONS, "prompt_len": PROMPT_LEN,
                       "new_tokens": NEW_TOKENS, "hf_new_tokens": HF_NEW_TOKENS, "lora_rank": LORA_RANK,
                       "grpo_steps": GRPO_STEPS, "grpo_seeds": GRPO_SEEDS,
                       "sampling": "temperature 1, top_k 0, top_p 1, EOS ignored"})
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _vllm_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("vllm")
    except md.PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--run-case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    args = parser.parse_args()
    require_cuda(parser, cpu_check=None)
    if args.run_case:  # the child process of one case
        args.out.write_text(json.dumps(run_case(args.run_case)))
        return 0
    status = 0
    for case in args.cases:
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--run-case", case, "--out", str(out)]
        print(f"=== {case}", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, stderr=subprocess.PIPE, text=True)
            error = None if proc.returncode == 0 else proc.stderr[-2000:]
        except subprocess.TimeoutExpired as err:
            error = f"timed out after {args.timeout} s: {(err.stderr or b'')[-1000:]!r}"
        if error is None:
            rows = json.loads(out.read_text())
        else:
            status = 1
            print(error, file=sys.stderr)
            rows = [{"error": error}]
        record(case, rows)
    rows = json.loads(results_path().read_text())["rows"]
    for selected, columns in (
        ([r for r in rows if r["case"] != "grpo"],
         ["case", "engine", "tokens_per_s", "tokens_per_s_unseeded", "sync_ms", "full_copy_sync_ms", "kv_cache_gib",
          "rollout_extra_gib", "training_extra_gib", "build_s", "first_call_s", "error"]),
        ([r for r in rows if r["case"] == "grpo"], ["engine", "seed", "steps", "reward_first10", "reward_last10",
                                                     "rollout_logp_diff_mean", "wall_s", "error"]),
        (grpo_summary([r for r in rows if r["case"] == "grpo"]),
         ["engine", "seeds", "reward_last10_mean", "reward_last10_sd", "reward_last10_all"]),
    ):
        if selected:
            print_table(selected, columns)
    return status


if __name__ == "__main__":
    sys.exit(main())
