"""One whole GRPO step of each stack a user picks from: same models, data and settings, one process per system.

    python -m benchmarks.bench_loop --shapes qwen2.5-1.5b-lora --completions 1024 4096
    python -m benchmarks.bench_loop --max-fit                  # longest completion in a 24 GiB cap
    python -m benchmarks.bench_loop --dry-run                  # CPU: tiny folders, fastgrpo steps, error rows

Systems, each case in its own subprocess (vLLM's CuMem pool is one per process; Unsloth rewrites TRL's classes):
  fastgrpo       fastgrpo.GRPOTrainer + GRPOConfig, the built-in engine, patch_model(offload_activations=True)
  fastgrpo-vllm  the same with GRPOConfig(rollout_engine="vllm") (vLLM shares the trainer's weights)
  fastgrpo-fast  the built-in engine with rollout_attention="triton" (the decode kernel) and, for LoRA / QLoRA,
                 rollout_weights="dense" (decoding multiplies a merged bf16 copy, built per rollout)
  fastgrpo-nf4   (not run by default; QLoRA) the built-in engine with rollout_weights="nf4": decoding reads the
                 4-bit base in place (a Triton W4A16 kernel), no bf16 copy
  fastgrpo-fp8   (not run by default; sm89+) the built-in engine with rollout_weights="w8a8" (an e4m3 copy of the
                 LoRA-merged or dequantized weights per rollout, activations in e4m3) and rollout_kv_cache="fp8",
                 the policy term corrected by pi_old / pi_rollout (rollout_correction="truncate", per sequence,
                 at most 3; pi_old from the loss's own forward: no old log-prob pass, where TRL runs one)
  fastgrpo-fp8train  (not run by default; sm89+) fastgrpo-fp8 with patch_model(fp8_base=True): LoRA's frozen
                 base's GEMMs (reference pass, update forward and recompute, input gradient) in e4m3 too; in full
                 fine-tuning every decoder linear's (weight gradients in bf16), the reference copy's included
  trl            TRL GRPOTrainer: use_vllm, vllm_mode="colocate", vllm_enable_sleep_mode, HF gradient checkpointing
  trl-liger      the same with use_liger_kernel=True
  unsloth        Unsloth: FastLanguageModel.from_pretrained(fast_inference=True), UNSLOTH_VLLM_STANDBY=1, its
                 patched TRL GRPOTrainer, use_gradient_checkpointing="unsloth"
  unsloth-hf     (not run by default) Unsloth with fast_inference=False: its own generation, for what vLLM refuses
The fastgrpo systems run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as `fastgrpo train` sets it
(fastgrpo.train.cuda_memory; not fastgrpo-vllm, whose vLLM pool refuses it); TRL and Unsloth with their own settings.
--recompute-layers N: the fastgrpo systems checkpoint only the first N decoder layers (patch_model's
recompute_layers; the later ones keep their activations), rows named <system>-recompute<N>.
--rollout-weights W: the fastgrpo systems decode with GRPOConfig(rollout_weights=W) instead of their own choice
(e.g. fastgrpo-fp8train with "dense": a merged bf16 copy beside the e4m3 KV cache), rows named <system>-<W>.
Shapes <model>-<mode>: qwen2.5-1.5b / llama-3.1-8b (benchmarks.e2e configs, random weights saved once to
--models-dir with a word-level tokenizer built here: token i is "t<i>", a chat template; no hub); lora: r=16,
alpha 32 on the 7 linears of every layer, bf16 base; full: bf16 weights and AdamW; qlora: NF4 base (double quant,
bf16 compute) + the same LoRA.

The same for every system: --prompts prompts of --prompt-length random tokens, --generations completions each of
exactly C tokens (EOS ignored: vLLM's ignore_eos, HF's min_new_tokens, fastgrpo's tokenizer without EOS), sampling
at temperature 1, --micro-batch sequences per forward/backward, one fused AdamW step per GRPO step (lr 1e-5 LoRA,
1e-6 full; no weight decay, clip 1.0), beta (k3 KL to the reference: the adapter disabled, or a frozen copy),
loss_type dapo, eps 0.2 / 0.28, one reward (the share of "7" in the completion text). vLLM's memory, for TRL and
Unsloth: the weights it holds + the KV cache of the whole batch + 3 GiB (capped by --max-fit's cap); fastgrpo-vllm
sizes its KV cache for the batch itself. UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE=1: in standby Unsloth would otherwise
take 0.925 x 0.95 of the card, a reservation that measures the card, not the step.

Phases, exclusive seconds per step, CUDA-synchronized at every boundary: rollout (the engine's generate with its
wake-up/sleep), sync (weights or adapter into the engine, even when it happens inside generate), logprobs (no-grad
forwards: old, where a system runs that pass, and reference), rewards, update (the rest: loss forward/backward over
micro-batches, optimizer, the trainer's bookkeeping). Medians over --steps after --warmup steps. peak_gib: the
device's used memory (NVML, sampled every 10 ms) above its level when the case's process started: what a card must
hold, vLLM's pool and the CUDA context included, over the whole case; peak_gib_<phase> per phase; torch_peak_gib:
torch's own count.

--max-fit (default shapes qwen2.5-1.5b-lora, llama-3.1-8b-qlora; one prompt x G completions): each probe is a
fresh process with torch.cuda.set_per_process_memory_fraction(cap / card) running one step, torch.cuda.mem_get_info
answering as a card of the cap would (what sizes its work by the free memory sizes it for that card; rows say
"mem_get_info": "capped"); it fits when the step ends and the NVML peak stays under the cap. C doubles from
--fit-start until a probe fails (out of memory) or passes --fit-max, then bisects to --fit-resolution. A failure
that is not out-of-memory ends the search as an error. The row is written after every probe ("complete": false
until the search ends); --continue-fit reuses the probes with a verdict from the file's row of the same system and
cap, so a search can go on in a later device call.

Results: benchmarks/results/loop_<shape>-<card>.json, common.write_results' payload (suite, card, date, versions,
config, rows); rows {"system", "kind": "step" | "max_fit", "completion", "step_s", "peak_gib", "<phase>_s", ...}
replace earlier rows of the same system, kind and completion. A case that fails leaves "error": the exception and
its last frames (the failing call), or the log's tail when the process died. Logs: --log-dir/<case>.log.
"targets": each baseline row (TRL, TRL + Liger, Unsloth) against the fastest fastgrpo row of its completion within
its peak memory, recomputed at every write (benchmarks/loop_targets.py).
A driver stopped by SIGTERM or SIGINT (a device call's `timeout`, Ctrl-C) kills the cases it runs before it exits:
each case runs in its own session, so without this one would go on holding the card and skew the next measurement.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from benchmarks import loop_targets

SYSTEMS = ("fastgrpo", "fastgrpo-vllm", "fastgrpo-fast", "trl", "trl-liger", "unsloth")
ALL_SYSTEMS = SYSTEMS + ("fastgrpo-nf4", "fastgrpo-fp8", "fastgrpo-fp8train", "unsloth-hf")
SHAPES = ("qwen2.5-1.5b-lora", "qwen2.5-1.5b-full", "llama-3.1-8b-lora", "llama-3.1-8b-qlora")
FIT_SHAPES = ("qwen2.5-1.5b-lora", "llama-3.1-8b-qlora")
DRY_SHAPES = ("tiny-qwen2-lora", "tiny-llama-qlora")
# fastgrpo.rollout.decode_weights.WEIGHTS, spelled out: that module imports torch, which this process defers
ROLLOUT_WEIGHTS = ("auto", "model", "fp8", "w8a8", "dense", "fused", "nf4")
MODES = ("lora", "full", "qlora")
PHASES = ("rollout", "sync", "logprobs", "rewards")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD, EOS, UNK = 0, 1, 2  # token ids of the built tokenizer; "t<i>" is id i for i >= 3
CHAT_TEMPLATE = ("{% for message in messages %}t3 {{ message['content'] }} t4 {% endfor %}"
                 "{% if add_generation_prompt %}t5 {% endif %}")
GIB = 1024**3
RESULTS_DIR = Path(__file__).parent / "results"
TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192)
VERSIONED = ("torch", "triton", "transformers", "peft", "accelerate", "trl", "vllm", "unsloth", "unsloth_zoo",
             "liger-kernel", "bitsandbytes", "torchao", "datasets", "fastgrpo")


@dataclasses.dataclass
class Case:
    system: str
    shape: str
    completion: int
    folder: str = ""
    prompts: int = 8
    generations: int = 8
    prompt_length: int = 256
    micro_batch: int = 8
    steps: int = 2
    warmup: int = 1
    beta: float = 0.04
    cap_gib: float | None = None
    vllm_memory_utilization: float | None = None
    device: str = "cuda"
    gpu: int = 0
    recompute_layers: int | None = None  # fastgrpo systems: patch_model's (None: every layer checkpointed)
    rollout_weights: str | None = None  # fastgrpo systems: GRPOConfig's, in place of the system's own

    @property
    def label(self) -> str:
        """The row's system: a fastgrpo system says the decode weights it was given and, where it keeps some layers'
        activations, how many it recomputes."""
        label = self.system if self.rollout_weights is None else f"{self.system}-{self.rollout_weights}"
        return label if self.recompute_layers is None else f"{label}-recompute{self.recompute_layers}"

    @property
    def model(self) -> str:
        return self.shape.rsplit("-", 1)[0]

    @property
    def mode(self) -> str:
        return self.shape.rsplit("-", 1)[1]

    @property
    def lr(self) -> float:
        return 1e-6 if self.mode == "full" else 1e-5

    @property
    def batch(self) -> int:
        return self.prompts * self.generations


# ---- model folders, tokenizer, data, reward ----
def model_fields(model: str) -> dict:
    from benchmarks.e2e import MODEL_CONFIGS

    return dict(TINY_LLAMA if model == "tiny-llama" else MODEL_CONFIGS[model])


def build_tokenizer(vocab_size: int):
    """A real fast tokenizer over the whole vocabulary: "t<i>" is id i, words split on whitespace and decoded with
    spaces between them; <pad> 0, <eos> 1, <unk> 2; a chat template for systems that look for one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", model_max_length=1 << 20, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_folder(model: str, root: Path, device: str) -> Path:
    """Random bf16 weights of `model`'s shapes (HF's initialization) and the tokenizer, saved once to root/model."""
    folder = root / model
    if (folder / "READY").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = model_fields(model)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=None, eos_token_id=EOS,
                                  pad_token_id=PAD)
    torch.manual_seed(0)
    with torch.device(device):
        weights = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    weights.generation_config.eos_token_id, weights.generation_config.pad_token_id = EOS, PAD
    weights.save_pretrained(folder)
    build_tokenizer(config.vocab_size).save_pretrained(folder)
    # transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer (a byte-level BPE that encodes "t5" to
    # nothing) whatever tokenizer_class says; an auto_map skips that override (and, without trust_remote_code,
    # loads the generic TokenizersBackend from tokenizer.json): AutoTokenizer in vLLM and Unsloth then reads ours.
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "auto_map": {"AutoTokenizer": [None, "TokenizersBackend"]}}, indent=2))
    (folder / "READY").write_text(f"{model}: random weights, {datetime.date.today()}\n")
    return folder


def dataset_rows(case: Case) -> list[dict]:
    """prompts x (warmup + steps) prompts of prompt_length random words, the same for every system (seeded)."""
    import random

    vocab = json.loads((Path(case.folder) / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    rows = case.prompts * (case.warmup + case.steps)
    return [{"prompt": " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(case.prompt_length))}
            for _ in range(rows)]


def count_sevens(prompts, completions, **kwargs) -> list[float]:
    """Share of "7" among the characters of each completion: unequal within every group of random text, so no
    system can skip a group for zero advantage."""
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [text.count("7") / max(len(text), 1) for text in texts]


def load_hf(case: Case):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if case.device == "cuda" else torch.float32
    extra = {}
    if case.mode == "qlora":
        from transformers import BitsAndBytesConfig

        extra = dict(device_map={"": case.device}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype))
    model = AutoModelForCausalLM.from_pretrained(case.folder, dtype=dtype, attn_implementation="sdpa", **extra)
    return model if extra else model.to(case.device)


def load_tokenizer(case: Case, eos: bool = True):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(case.folder)
    tokenizer.padding_side = "left"
    if not eos:
        tokenizer.eos_token = None
    return tokenizer


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def vllm_fraction(case: Case) -> float:
    """vLLM's gpu_memory_utilization for TRL and Unsloth: the weights it holds + the whole batch's KV cache + 3 GiB
    (activations, CUDA graphs, sampler); under --max-fit at most the free memory less 2 GiB, as the capped
    mem_get_info reports it (the cap less what the case holds by NVML: its CUDA context and other pools included)."""
    import torch

    if case.vllm_memory_utilization is not None:
        return case.vllm_memory_utilization
    config = json.loads((Path(case.folder) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    weights = sum(p.stat().st_size for p in Path(case.folder).glob("*.safetensors"))
    free, total = torch.cuda.mem_get_info()
    need = kv_token * case.batch * (case.prompt_length + case.completion) + 3 * GIB
    need += weights * (0.35 if case.mode == "qlora" else 1.0)  # NF4 linears, bf16 embeddings
    if case.cap_gib is not None:
        need = min(need, free - 2 * GIB)
    return round(max(need / total, 0.02), 4)


# ---- measurement ----
class PhaseTimer:
    """Exclusive seconds per phase inside each step, CUDA-synchronized at every boundary: a phase entered inside
    another (a weight sync inside the generate call) pauses it. Time in a step outside every phase is update."""

    def __init__(self, cuda: bool):
        self.cuda, self.stack, self.steps, self.t0 = cuda, [], [], None
        self.info = {}  # settings a runner chose (vLLM's memory share), merged into the row

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _charge(self) -> None:
        now = self._now()
        if self.t0 is not None and self.stack:
            self.acc[self.stack[-1]] += now - self.last
        self.last = now

    @property
    def phase(self) -> str:
        return self.stack[-1] if self.stack else ("update" if self.t0 is not None else "setup")

    def begin_step(self) -> None:
        self.acc, self.stack = dict.fromkeys(PHASES, 0.0), []
        self.t0 = self.last = self._now()

    def end_step(self, **extra) -> None:
        step = self._now() - self.t0
        record = {"step_s": step, **{f"{p}_s": s for p, s in self.acc.items()}}
        record["update_s"] = step - sum(self.acc.values())
        self.steps.append({**record, **extra})
        self.t0 = None

    def wrap(self, obj, name: str, phase: str, when=None):
        """Time obj.name (an instance attribute from now on) as `phase`; when: a predicate checked per call."""
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if when is not None and not when():
                return fn(*args, **kwargs)
            self._charge()
            self.stack.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._charge()
                self.stack.pop()

        setattr(obj, name, timed)
        return timed

    def timed_function(self, fn, phase: str):
        holder = type("Holder", (), {})()
        holder.fn = fn
        return self.wrap(holder, "fn", phase)


class DeviceMemory:
    """The device's used memory above its level at the start (NVML, every 10 ms), the peak per timer phase."""

    def __init__(self, index: int, timer: PhaseTimer):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.timer, self.peaks = pynvml, timer, {}
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.base = self._used()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _used(self) -> int:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used

    def used(self) -> int:
        """Bytes used above the level at the start."""
        return self._used() - self.base

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            used, phase = self.used() / GIB, self.timer.phase
            self.peaks[phase] = max(used, self.peaks.get(phase, 0.0))

    def stop(self) -> dict:
        self._stop.set()
        self.thread.join()
        return {"peak_gib": max(self.peaks.values(), default=None),
                **{f"peak_gib_{phase}": gib for phase, gib in sorted(self.peaks.items())}}


# ---- the systems (run inside the case's process) ----
def fastgrpo_trainer(case: Case, engine: str = "builtin", reward=count_sevens, offload: bool | None = None):
    """The fastgrpo GRPOTrainer of a case: the folder's model (+ LoRA), patch_model (activation offload on CUDA
    unless `offload` says), the benchmark's settings; engine: builtin, fast, nf4, fp8, fp8train or vllm (see the
    module doc)."""
    import fastgrpo

    model = load_hf(case)
    model.generation_config.eos_token_id = None  # EOS ignored: every completion runs to C tokens
    if case.mode != "full":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
    if offload is None:  # on the CPU (--dry-run) offload is plain checkpointing; a recompute_layers case needs it
        offload = case.device == "cuda" or case.recompute_layers is not None
    fastgrpo.patch_model(model, offload_activations=offload, recompute_layers=case.recompute_layers,
                         fp8_base=engine == "fp8train")
    fields = dict(
        model=case.folder, lora_rank=0 if case.mode == "full" else 16, load_in_4bit=case.mode == "qlora",
        batch_size=case.batch, num_generations=case.generations, max_prompt_length=case.prompt_length,
        max_completion_length=case.completion, micro_batch_size=case.micro_batch, temperature=1.0, beta=case.beta,
        loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, learning_rate=case.lr, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=case.warmup + case.steps, seed=0, device=case.device, export=False,
        progress_bar=False, output_dir=tempfile.mkdtemp(prefix="bench-loop-fastgrpo-"),
    )
    if engine == "fast":
        fields.update(rollout_attention="triton", rollout_weights="model" if case.mode == "full" else "dense")
    if engine == "nf4":
        if case.mode != "qlora":
            raise ValueError(f"fastgrpo-nf4 decodes a 4-bit base's own weights: qlora shapes only, not {case.mode}")
        fields["rollout_weights"] = "nf4"
    if engine in ("fp8", "fp8train"):
        fields.update(rollout_weights="w8a8", rollout_kv_cache="fp8", rollout_correction="truncate")
    if engine == "vllm":
        if "rollout_engine" not in {f.name for f in dataclasses.fields(fastgrpo.GRPOConfig)}:
            raise RuntimeError("fastgrpo.GRPOConfig has no rollout_engine field: this checkout has no vLLM engine")
        fields["rollout_engine"] = "vllm"
    if case.rollout_weights is not None:
        fields["rollout_weights"] = case.rollout_weights
    config = fastgrpo.GRPOConfig(**fields)
    return fastgrpo.GRPOTrainer(model, load_tokenizer(case, eos=False), reward, dataset_rows(case), config)


def run_fastgrpo(case: Case, timer: PhaseTimer, engine: str = "builtin") -> None:
    trainer = fastgrpo_trainer(case, engine, reward=timer.timed_function(count_sevens, "rewards"))
    timer.wrap(trainer.engine, "generate", "rollout")
    timer.wrap(trainer.engine, "load_weights", "sync")
    if hasattr(trainer, "_logprobs"):  # old and reference log-probs; else they count as update
        timer.wrap(trainer, "_logprobs", "logprobs")
    for _ in range(case.warmup + case.steps):
        timer.begin_step()
        metrics = trainer.train_step()
        timer.end_step(completion_tokens=metrics.get("completion_length"))


def run_trl(case: Case, timer: PhaseTimer, liger: bool = False, unsloth: bool = False,
            fast_inference: bool = True) -> None:
    import torch

    cuda = case.device == "cuda"
    use_vllm = cuda and fast_inference
    if unsloth:  # UNSLOTH_VLLM_STANDBY was set before this process imported anything
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=case.folder, max_seq_length=case.prompt_length + case.completion, dtype=torch.bfloat16,
            load_in_4bit=case.mode == "qlora", full_finetuning=case.mode == "full", fast_inference=fast_inference,
            gpu_memory_utilization=timer.info.setdefault("vllm_gpu_memory_utilization", vllm_fraction(case))
            if use_vllm else 0.5, max_lora_rank=16,
            use_exact_model_name=True,
        )
        if case.mode != "full":
            model = FastLanguageModel.get_peft_model(
                model, r=16, lora_alpha=32, lora_dropout=0, target_modules=LORA_TARGETS,
                use_gradient_checkpointing="unsloth", random_state=0)
        if hasattr(model, "load_lora"):  # Unsloth hands the adapter to vLLM through it, inside generate
            timer.wrap(model, "load_lora", "sync")
        peft_config = None
    else:
        model, tokenizer = load_hf(case), load_tokenizer(case)
        peft_config = None if case.mode == "full" else lora_config()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args = dict(
        output_dir=tempfile.mkdtemp(prefix="bench-loop-trl-"), max_steps=case.warmup + case.steps,
        per_device_train_batch_size=case.micro_batch, gradient_accumulation_steps=case.batch // case.micro_batch,
        num_generations=case.generations, max_completion_length=case.completion, temperature=1.0, top_p=1.0,
        top_k=0, beta=case.beta, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, learning_rate=case.lr,
        weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", seed=0, shuffle_dataset=False,
        optim="adamw_torch_fused" if cuda else "adamw_torch", bf16=cuda, use_cpu=not cuda, use_liger_kernel=liger,
        logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        use_vllm=use_vllm, generation_kwargs={"ignore_eos": True} if use_vllm else {"min_new_tokens": case.completion},
    )
    if not unsloth:
        args.update(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    if use_vllm:
        args.update(vllm_mode="colocate", vllm_enable_sleep_mode=True,
                    vllm_max_model_length=case.prompt_length + case.completion)
        if not unsloth:
            args["vllm_gpu_memory_utilization"] = timer.info["vllm_gpu_memory_utilization"] = vllm_fraction(case)

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.begin_step()

        def on_step_end(self, *a, **k):
            lengths = trainer._metrics["train"].get("completions/mean_length") or [None]
            timer.end_step(completion_tokens=lengths[-1])

    trainer = GRPOTrainer(
        model=model, reward_funcs=timer.timed_function(count_sevens, "rewards"), args=GRPOConfig(**args),
        train_dataset=Dataset.from_list(dataset_rows(case)), processing_class=tokenizer, peft_config=peft_config,
        callbacks=[Steps()])
    generation = getattr(trainer, "vllm_generation", None)
    if hasattr(trainer, "_generate_single_turn"):  # TRL 1.15 and Unsloth's rewrite of it: generate (+ sync)
        timer.wrap(trainer, "_generate_single_turn", "rollout")
    elif generation is not None:
        timer.wrap(generation, "generate", "rollout")
    if generation is not None:
        timer.wrap(generation, "sync_weights", "sync")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "logprobs", when=lambda: not torch.is_grad_enabled())
    trainer.train()


RUNNERS = {
    "fastgrpo": run_fastgrpo,
    "fastgrpo-vllm": functools.partial(run_fastgrpo, engine="vllm"),
    "fastgrpo-fast": functools.partial(run_fastgrpo, engine="fast"),
    "fastgrpo-nf4": functools.partial(run_fastgrpo, engine="nf4"),
    "fastgrpo-fp8": functools.partial(run_fastgrpo, engine="fp8"),
    "fastgrpo-fp8train": functools.partial(run_fastgrpo, engine="fp8train"),
    "trl": run_trl,
    "trl-liger": functools.partial(run_trl, liger=True),
    "unsloth": functools.partial(run_trl, unsloth=True),
    "unsloth-hf": functools.partial(run_trl, unsloth=True, fast_inference=False),
}


def describe(err: BaseException) -> str:
    """The exception and the last frames of its traceback: the failing call, verbatim."""
    frames = "".join(traceback.format_exception(err)[-6:])
    return (f"{type(err).__name__}: {err}"[:1500] + "\n" + frames[-2500:]).strip()


def summarize(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:] or steps
    numbers = [k for k in timed[0] if all(isinstance(s.get(k), (int, float)) for s in timed)]
    out = {k: statistics.median(s[k] for s in timed) for k in numbers}
    return {**out, "steps_timed": len(timed), "first_step_s": steps[0]["step_s"],
            "step_s_all": [round(s["step_s"], 3) for s in steps]}


def child(case: Case, out: Path) -> int:
    """One case in this process: write its row (with "error" when it fails) to `out`."""
    start = time.perf_counter()
    row = {"system": case.label, "kind": "step", "completion": case.completion, "model": case.model,
           "mode": case.mode, "prompts": case.prompts, "generations": case.generations,
           "prompt_length": case.prompt_length, "micro_batch": case.micro_batch, "cap_gib": case.cap_gib}
    cuda = case.device == "cuda"
    timer, memory = PhaseTimer(cuda), None
    try:
        if cuda:
            try:
                memory = DeviceMemory(case.gpu, timer)
            except Exception as err:  # noqa: BLE001 -- no NVML: torch's reserved peak, a lower bound
                row["peak_note"] = f"NVML unavailable ({err}); peak_gib is torch's max_memory_reserved"
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
            if case.cap_gib is not None:
                torch.cuda.set_per_process_memory_fraction(min(1.0, case.cap_gib * GIB / torch.cuda.mem_get_info()[1]))
                used = memory.used if memory else torch.cuda.memory_reserved
                torch.cuda.mem_get_info = torch.cuda.memory.mem_get_info = capped_mem_get_info(case.cap_gib, used)
                row["mem_get_info"] = "capped"
        RUNNERS[case.system](case, timer)
    except BaseException as err:  # noqa: BLE001 -- every failure becomes the row's error
        row["error"] = describe(err)
    row.update(timer.info)
    if timer.steps:
        row.update(summarize(timer.steps, case.warmup))
    if cuda:
        import torch

        row.update(memory.stop() if memory else {})
        with contextlib.suppress(Exception):  # a CUDA error may have left the context unusable
            row["torch_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            row.setdefault("peak_gib", torch.cuda.max_memory_reserved() / GIB)
    row["case_s"] = time.perf_counter() - start
    out.write_text(json.dumps([row]))
    return 0


def capped_mem_get_info(cap_gib: float, used):
    """torch.cuda.mem_get_info as a card of cap_gib would answer it: (the cap less what the case holds, the cap).

    The per-process fraction bounds torch's allocator alone; what sizes its work by the free memory would see the
    whole card: Unsloth's log-prob batches take 80% of it, vLLM checks its budget against it, fastgrpo's rollout
    weights="auto" picks a copy that fits it. `used`: bytes the case holds (NVML: its CUDA context and vLLM's pool
    included)."""
    cap = int(cap_gib * GIB)

    def mem_get_info(device=None):
        return max(cap - used(), 0), cap

    return mem_get_info


# ---- the driver ----
def card_name(gpu: int | None) -> str:
    """The card's name as torch reports it (NVML gives the same string), without a CUDA context here."""
    if gpu is None:
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(gpu))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001 -- no NVML: name it from torch
        import torch

        return torch.cuda.get_device_name(gpu) if torch.cuda.is_available() else "cpu"


def versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


# what makes two max_fit searches the same search (besides the system and the cap)
FIT_FIELDS = ("prompts", "generations", "prompt_length", "micro_batch")


def row_key(row: dict) -> tuple:
    """Rows of one results file with the same key replace each other: a step row's system, kind and completion; a
    max_fit row's system, cap and batch (its completion is None)."""
    if row.get("kind") == "max_fit":
        return (row.get("system"), "max_fit", row.get("cap_gib"), *(row.get(f) for f in FIT_FIELDS))
    return (row.get("system"), row.get("kind"), row.get("completion"))


class Results:
    """benchmarks/results/loop_<shape>-<card>.json with write_results' payload; new rows replace the rows of the
    same row_key, the others stay (cases run in several device calls add up), and the replaced rows go to
    "replaced_rows" (oldest first), so a rerun adds to the record instead of erasing a measurement; top-level keys
    this does not write (a person's notes) stay as they are."""

    def __init__(self, directory: Path, card: str, config: dict):
        self.directory, self.card, self.config, self.lock = directory, card, config, threading.Lock()

    def path(self, shape: str) -> Path:
        return self.directory / f"loop_{shape}-{re.sub(r'[^a-z0-9]+', '-', self.card.lower()).strip('-')}.json"

    def add(self, shape: str, rows: list[dict]) -> Path:
        key = row_key
        with self.lock:
            path = self.path(shape)
            before = json.loads(path.read_text()) if path.exists() else {"rows": [], "config": {}}
            new = {key(r) for r in rows}
            # the file's notes (config keys a person added) stay; this run's settings update the rest
            payload = {"suite": f"loop_{shape}", "card": self.card,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       # rows of earlier runs used packages this process may not import (vLLM, TRL)
                       "versions": {**before.get("versions", {}), **versions()},
                       "config": {**before["config"], **self.config},
                       "rows": [r for r in before["rows"] if key(r) not in new] + rows,
                       "replaced_rows": before.get("replaced_rows", []) + [r for r in before["rows"] if key(r) in new]}
            payload["targets"] = loop_targets.targets(payload["rows"])
            # a person's notes beside the rows (a session's runs that are not rows) stay, after what this writes
            payload |= {k: v for k, v in before.items() if k not in payload}
            self.directory.mkdir(parents=True, exist_ok=True)
            # replaced whole: a driver killed mid-write leaves the old file, never a truncated one
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(payload, indent=2) + "\n")
            os.replace(partial, path)
        return path


def physical_gpus(spec: str) -> list[int]:
    """--gpus counts the GPUs the caller may use: indices into its CUDA_VISIBLE_DEVICES when that is set (so
    `CUDA_VISIBLE_DEVICES=1 ... --gpus 0` runs on card 1, as the caller meant), else nvidia-smi's indices."""
    try:
        wanted = [int(g) for g in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--gpus: expected GPU indices separated by commas (0 or 0,1), got {spec!r}") from None
    if len(set(wanted)) != len(wanted):
        raise SystemExit(f"--gpus: {spec!r} names a GPU twice; cases on one GPU already run one after another")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if min(wanted) < 0:
            raise SystemExit(f"--gpus: expected GPU indices from 0, got {spec!r}")
        return wanted
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(i.isdigit() for i in ids):
        raise SystemExit(f"--gpus: CUDA_VISIBLE_DEVICES={visible!r} is not a list of GPU indices; unset it and "
                         "pick the cards with --gpus")
    if not all(0 <= g < len(ids) for g in wanted):
        raise SystemExit(f"--gpus: {spec!r} counts the {len(ids)} GPU(s) that CUDA_VISIBLE_DEVICES={visible!r} "
                         f"leaves visible, from 0")
    return [int(ids[g]) for g in wanted]


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not given before by this process: the OS hands a freed port out again (2 calls in a row
    gave the same one 7 times in 100,000), and two cases side by side must not share one."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def child_env(system: str, gpu: int | None, dry_run: bool) -> dict:
    """The environment of a case's process; `gpu` is a physical index (nvidia-smi's, NVML's)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = "" if gpu is None else str(gpu)
    # a rendezvous port of its own: TRL 1.15 and vLLM build one-process groups on 29500 when it is free, and two
    # cases started side by side (--gpus 0,1) both find it free, then one fails to bind
    env["MASTER_PORT"] = str(free_port())
    if system.startswith("fastgrpo"):  # the allocator setting `fastgrpo train` starts with
        from fastgrpo.train.cuda_memory import allocator_env

        env.update(allocator_env("vllm" if system == "fastgrpo-vllm" else "builtin"))
    if system.startswith("unsloth"):
        env.update(UNSLOTH_VLLM_STANDBY="1", UNSLOTH_VLLM_STANDBY_UTIL_OVERRIDE="1",
                   UNSLOTH_COMPILE_LOCATION=str(Path(tempfile.gettempdir()) / "unsloth_compiled_cache"))
        if dry_run:
            env["UNSLOTH_ALLOW_CPU"] = "1"  # import it on a CPU: the install check goes as far as it can
    if dry_run:
        env["TRITON_INTERPRET"] = "1"  # TRL 1.15's fused LM head and Liger are Triton kernels
    return env


class RunningCases:
    """The process groups the driver runs now (its cases, a model folder's build), and the stop-signal handler that
    kills them."""

    def __init__(self):
        self.lock, self.groups, self.signalled = threading.Lock(), set(), None

    def run(self, cmd: list[str], timeout: float | None = None, **popen) -> int | None:
        """`cmd` in its own session, killed with its group by a stop signal or after `timeout` s; its exit status,
        or None where it timed out."""
        with self.lock:  # a stop signal between Popen and add would miss this process
            proc = subprocess.Popen(cmd, start_new_session=True, **popen)
            self.groups.add(proc.pid)
        self._stop_if_signalled()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        finally:
            with self.lock:
                self.groups.discard(proc.pid)
            self._stop_if_signalled()

    def stop(self, signum, frame) -> None:
        """The stop signals' handler: kill every running group, then exit at once (the pool's threads would start the
        next cases). Results files are replaced whole (Results.add), so exiting mid-run leaves each one as it was or
        as it became. Where the lock is held, its holder does this as it lets go: the handler runs on the main
        thread, which may be the holder itself (a model build), and waiting for the lock there never ended."""
        self.signalled = signum
        self._stop_if_signalled()

    def _stop_if_signalled(self) -> None:
        if self.signalled is None or not self.lock.acquire(blocking=False):
            return
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        print(f"stopped by signal {self.signalled}: killed {len(self.groups)} running case(s) or build(s)",
              file=sys.stderr, flush=True)
        os._exit(128 + self.signalled)


RUNNING_CASES = RunningCases()


def run_case(case: Case, log_dir: Path, timeout: float, dry_run: bool) -> dict:
    """The case in a fresh process (killed with its group after `timeout` s); its row, or an error row."""
    name = f"{case.shape}-{case.label}-{case.completion}" + (f"-cap{case.cap_gib:g}" if case.cap_gib else "")
    log, out = log_dir / f"{name}.log", Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "benchmarks.bench_loop", "--child", json.dumps(dataclasses.asdict(case)),
           "--out", str(out)]
    gpu = None if case.device == "cpu" else case.gpu
    print(f"--- {name} (gpu {gpu}) ...", flush=True)
    with open(log, "w") as stream:
        status = RUNNING_CASES.run(cmd, timeout, stdout=stream, stderr=subprocess.STDOUT,
                                   env=child_env(case.system, gpu, dry_run), cwd=Path(__file__).parent.parent)
    error = None if status == 0 else f"timed out after {timeout:g} s" if status is None else \
        f"the process exited with {status}"
    rows = json.loads(out.read_text()) if out.stat().st_size else []
    out.unlink()
    if not rows:
        rows = [{"system": case.label, "kind": "step", "completion": case.completion, "model": case.model,
                 "mode": case.mode, "error": f"{error}; log tail:\n{log.read_text()[-2500:]}"}]
    row = rows[0]
    row["log"] = log.name
    status = f"error: {row['error'].splitlines()[0][:160]}" if "error" in row else \
        f"step {row.get('step_s', 0):.2f} s, peak {row.get('peak_gib') or 0:.1f} GiB"
    print(f"    {name}: {status}", flush=True)
    return row


# what torch, CUDA (bitsandbytes) and vLLM say when memory runs out; not a bare "out of memory", which other errors
# use to say what they are not (Unsloth's vLLM profiling race: "This is a transient race ..., NOT an out of memory
# error")
OUT_OF_MEMORY_ERRORS = ("outofmemoryerror", "cuda out of memory", "cuda error: out of memory",
                        "no available memory for the cache blocks", "free memory on device")


def out_of_memory(row: dict) -> bool:
    if row.get("peak_gib") is not None and row.get("cap_gib") and row["peak_gib"] > row["cap_gib"]:
        return True
    text = row.get("error", "").lower()
    return any(s in text for s in OUT_OF_MEMORY_ERRORS)


def fit_search(case: Case, args, run, known: dict[int, dict] | None = None, report=lambda row: None) -> dict:
    """Longest completion whose whole step fits the cap: doubling, then bisection to --fit-resolution.

    known: completion -> a probe of an earlier search of this case (--continue-fit), whose verdict is reused instead
    of running the probe again. report(row) gets the search's row after every probe ("complete": False until it
    ends), so a search cut off by a device call's deadline keeps the probes it ran."""
    probes, lo, hi, length = [], None, None, args.fit_start
    known = known or {}

    def row(**fields) -> dict:
        return {"system": case.label, "kind": "max_fit", "completion": None, "cap_gib": case.cap_gib,
                "prompts": case.prompts, "generations": case.generations, "prompt_length": case.prompt_length,
                "micro_batch": case.micro_batch, "max_completion": lo, "first_failure": hi, "probes": probes,
                "complete": False, **fields}

    def probe(c: int) -> bool | None:
        """Run (or reuse) the probe at c, move the bounds by its verdict: True fits, False out of memory, None an
        error that ends the search."""
        nonlocal lo, hi
        if c in known:
            found = dict(known[c], reused=True)
        else:
            result = run(dataclasses.replace(case, completion=c))
            found = {k: result.get(k) for k in ("completion", "step_s", "rollout_s", "update_s", "peak_gib",
                                                 "peak_gib_rollout", "peak_gib_update", "error", "log")}
            found.update(out_of_memory=out_of_memory(result),
                         fits="error" not in result and not out_of_memory(result))
        probes.append(found)
        verdict = True if found["fits"] else (False if found["out_of_memory"] else None)
        if verdict:
            lo = c
        elif verdict is False:
            hi = c
        report(row())
        return verdict

    while length <= args.fit_max:
        verdict = probe(length)
        if verdict is None:
            return row(error=probes[-1]["error"], complete=True)
        if not verdict:
            break
        length *= 2
    while hi is not None and hi - (lo or 0) > args.fit_resolution:
        mid = ((lo or 0) + hi) // 2 // args.fit_resolution * args.fit_resolution
        if mid <= (lo or 0):
            break
        if probe(mid) is None:
            return row(error=probes[-1]["error"], complete=True)
    return row(searched_to=args.fit_max, complete=True)


def earlier_probes(path: Path, case: Case) -> dict[int, dict]:
    """completion -> probe with a verdict (fits, or out of memory) of the results file's max_fit row of the same
    search as `case` (row_key: system, cap, batch) (--continue-fit); errors are run again. Each reused verdict is
    printed: one from older code may no longer hold (say, an out-of-memory that a fix removed)."""
    if not path.exists():
        return {}
    want = row_key({"system": case.label, "kind": "max_fit", "cap_gib": case.cap_gib,
                    **{f: getattr(case, f) for f in FIT_FIELDS}})
    found = {}
    for row in json.loads(path.read_text())["rows"]:
        if row_key(row) == want:
            found.update({p["completion"]: p for p in row.get("probes", [])
                          if p.get("fits") or p.get("out_of_memory")})
    for c, p in sorted(found.items()):
        print(f"    reusing {case.label} at {c}: {'fits' if p['fits'] else 'out of memory'} ({path.name})", flush=True)
    return found


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Details: the module docstring.")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--shapes", nargs="+", help=f"default {SHAPES}; --max-fit: {FIT_SHAPES}; --dry-run: {DRY_SHAPES}")
    p.add_argument("--completions", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--prompts", type=int, help="prompts per step (default 8; --max-fit 1)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--steps", type=int, default=2, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--vllm-memory-utilization", type=float,
                   help="gpu_memory_utilization of TRL's and Unsloth's vLLM (default: weights it holds + the batch's "
                        "KV cache + 3 GiB, as a share of the card)")
    p.add_argument("--recompute-layers", type=int,
                   help="fastgrpo systems: patch_model(recompute_layers=N), only the first N decoder layers "
                        "checkpointed; rows named <system>-recompute<N> (default: every layer)")
    p.add_argument("--rollout-weights", choices=ROLLOUT_WEIGHTS,
                   help="fastgrpo systems: GRPOConfig(rollout_weights=W) in place of the system's own; rows named "
                        "<system>-<W>")
    p.add_argument("--max-fit", action="store_true", help="search the longest completion in --cap-gib")
    p.add_argument("--cap-gib", type=float, default=24.0)
    p.add_argument("--fit-start", type=int, default=2048)
    p.add_argument("--fit-max", type=int, default=32768)
    p.add_argument("--fit-resolution", type=int, default=2048)
    p.add_argument("--continue-fit", action="store_true",
                   help="reuse the probes (fits / out of memory) of the results file's max_fit row of the same cap")
    p.add_argument("--gpus", default="0", help="comma-separated GPU indices (into CUDA_VISIBLE_DEVICES when set); "
                                               "cases run concurrently, one per GPU")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case process")
    p.add_argument("--models-dir", type=Path, default=Path(os.environ.get("BENCH_LOOP_MODELS", "/tmp/bench-loop-models")))
    p.add_argument("--results-dir", type=Path, help="default benchmarks/results (--dry-run: a temporary folder)")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-loop-logs")
    p.add_argument("--dry-run", action="store_true", help="CPU check: tiny models, 16 + 16 tokens, every system")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--build", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(Case(**json.loads(args.child)), args.out)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the row is written: skip vLLM's and NCCL's teardown, which can hang a process at exit
    if args.build:
        print(build_folder(args.build, args.models_dir, "cuda"))
        return 0
    dry = args.dry_run
    import torch  # here, as elsewhere in this file: its cases run in child processes

    if not dry and not torch.cuda.is_available():  # else every case's model folder fails to build, one line each
        raise SystemExit("needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run checks its code on the CPU")
    with stop_signals_handled():
        return drive(args)


@contextlib.contextmanager
def stop_signals_handled():
    """RUNNING_CASES.stop on SIGTERM and SIGINT while main drives its cases, the caller's handlers back after: main
    called from Python (as the tests call it) leaves its process as it found it."""
    previous = {signum: signal.signal(signum, RUNNING_CASES.stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def drive(args) -> int:
    """Build the model folders, run every case (one at a time per GPU), write the rows and print their table."""
    dry = args.dry_run
    gpus = [None] if dry else physical_gpus(args.gpus)
    shapes = args.shapes or list(DRY_SHAPES if dry else FIT_SHAPES if args.max_fit else SHAPES)
    for shape in shapes:
        if shape.rsplit("-", 1)[-1] not in MODES:
            raise SystemExit(f"--shapes: {shape!r} is not <model>-<{'|'.join(MODES)}>")
        if dry and not shape.startswith("tiny-"):  # a real model's folder would be built on the CPU (16 GB for 8B)
            raise SystemExit(f"--shapes: --dry-run runs tiny shapes ({', '.join(DRY_SHAPES)}), not {shape!r}")
    if dry:
        args.models_dir = Path(tempfile.mkdtemp(prefix="bench-loop-models-"))
        args.completions, args.prompt_length, args.micro_batch, args.steps = [16], 16, 4, 1
        args.generations, args.prompts = 4, args.prompts or 2
        args.fit_start, args.fit_max, args.fit_resolution = 8, 32, 8
    prompts = args.prompts or (1 if args.max_fit else 8)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="bench-loop-results-")) if dry else RESULTS_DIR)

    folders = {}
    for model in dict.fromkeys(s.rsplit("-", 1)[0] for s in shapes):
        if dry:
            folders[model] = build_folder(model, args.models_dir, "cpu")
            continue
        status = RUNNING_CASES.run([sys.executable, "-m", "benchmarks.bench_loop", "--build", model, "--models-dir",
                                    str(args.models_dir)], env=child_env("build", gpus[0], False),
                                   cwd=Path(__file__).parent.parent)
        if status != 0:
            raise SystemExit(f"--build {model}: the process exited with {status}")
        folders[model] = args.models_dir / model

    common = {"beta": args.beta, "lr": "1e-5 LoRA/QLoRA, 1e-6 full",
              "loss": "dapo, eps 0.2/0.28, AdamW fused, clip 1.0", "lora": "r16 alpha32 q,k,v,o,gate,up,down",
              "qlora": "nf4, double quant, bf16 compute", "sampling": "temperature 1, EOS ignored",
              "reward": "share of '7' in the text",
              "vllm_memory": args.vllm_memory_utilization or "weights held + batch KV + 3 GiB (TRL, Unsloth)",
              "dry_run": dry}
    batch = {"prompts": prompts, "generations": args.generations, "prompt_length": args.prompt_length,
             "micro_batch": args.micro_batch}
    # a file holds step rows and max_fit rows: the search's settings go under "max_fit", not over the steps' own
    config = common | ({"max_fit": {"cap_gib": args.cap_gib, **batch, "fit_start": args.fit_start,
                                    "fit_max": args.fit_max, "fit_resolution": args.fit_resolution}}
                       if args.max_fit else {**batch, "steps": args.steps, "warmup": args.warmup})
    results = Results(results_dir, card_name(gpus[0]), config)
    free = queue.Queue()
    for gpu in gpus:
        free.put(gpu)

    def run(case: Case) -> dict:
        gpu = free.get()
        try:
            return run_case(dataclasses.replace(case, gpu=gpu or 0), args.log_dir, args.timeout, dry)
        finally:
            free.put(gpu)

    def job(system: str, shape: str, completion: int | None) -> tuple[str, dict]:
        case = Case(system=system, shape=shape, completion=completion or args.fit_start,
                    folder=str(folders[shape.rsplit("-", 1)[0]]), prompts=prompts, generations=args.generations,
                    prompt_length=args.prompt_length, micro_batch=min(args.micro_batch, prompts * args.generations),
                    steps=1 if args.max_fit else args.steps, warmup=0 if args.max_fit else args.warmup,
                    beta=args.beta, cap_gib=args.cap_gib if args.max_fit else None,
                    vllm_memory_utilization=args.vllm_memory_utilization, device="cpu" if dry else "cuda",
                    recompute_layers=args.recompute_layers if system.startswith("fastgrpo") else None,
                    rollout_weights=args.rollout_weights if system.startswith("fastgrpo") else None)
        if args.max_fit:
            known = earlier_probes(results.path(shape), case) if args.continue_fit else {}
            row = fit_search(case, args, run, known, report=lambda partial: results.add(shape, [partial]))
        else:
            row = run(case)
        results.add(shape, [row])
        return shape, row

    specs = [(system, shape, None if args.max_fit else c) for shape in shapes
             for c in ([None] if args.max_fit else args.completions) for system in args.systems]
    # serial per GPU: one case at a time on a card; --gpus 0,1 runs two cases side by side
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        done = [f.result() for f in [pool.submit(job, *spec) for spec in specs]]

    from benchmarks.common import print_table

    table = [{"shape": shape, **row, "error": row["error"].splitlines()[0][:70] if row.get("error") else None}
             for shape, row in done]
    columns = (["shape", "system", "max_completion", "first_failure", "error"] if args.max_fit else
               ["shape", "system", "completion", "step_s", "rollout_s", "sync_s", "logprobs_s", "rewards_s",
                "update_s", "peak_gib", "completion_tokens", "error"])
    print()
    print_table(table, columns)
    print(f"results: {sorted({str(results.path(s)) for s in shapes})}; logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
