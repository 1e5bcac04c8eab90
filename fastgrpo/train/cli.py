"""`fastgrpo train [--config X.yaml] [--field value ...]`: build the model, data and rewards a config names; train.

With neither --model nor --dataset it runs the built-in default (fastgrpo.train.default_task) on the CPU; either one
alone swaps in the user's model or data.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from fastgrpo.offload import ActivationOffloader, HostBufferPool, OffloadMemoryError
from fastgrpo.patching import patch_model
from fastgrpo.rewards import REGISTRY
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig, add_config_arguments, read_yaml
from fastgrpo.train.trainer import GRPOTrainer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastgrpo", description="Memory-lean GRPO post-training.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="run GRPO training", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Every GRPOConfig field is a flag; flags override the YAML file given with --config. Without "
                    "--model, the built-in tiny model's settings (fastgrpo.train.default_task.PRESET) replace some defaults; "
                    "without --dataset, the built-in task and its reward are used.",
    )
    train.add_argument("--config", type=Path, help="YAML file of GRPOConfig fields")
    add_config_arguments(train)
    return parser


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """defaults < built-in presets (no --model: the tiny model's settings; no --dataset: its reward) < YAML < flags."""
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    from_yaml = read_yaml(args.config) if args.config is not None else {}
    merged = {**from_yaml, **flags}
    preset = dict(default_task.PRESET) if merged.get("model") is None else {}
    if merged.get("dataset") is None:
        preset["reward_funcs"] = list(default_task.REWARD_FUNCS)
    return GRPOConfig.from_dict({**preset, **merged})


def resolve_reward(name: str):
    """A name of fastgrpo.rewards.REGISTRY, or "package.module:function" for a user's reward function."""
    if name in REGISTRY:
        return REGISTRY[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"reward_funcs: unknown reward {name!r}; expected one of {sorted(REGISTRY)} "
                         f"or 'module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward_funcs: cannot import {name!r}: {err}") from None


def load_dataset(config: GRPOConfig):
    """Rows of a local .jsonl / .json file, a Hugging Face dataset (needs `datasets`), or the built-in task."""
    if config.dataset is None:
        return default_task.build_dataset(seed=config.seed)
    path = Path(config.dataset)
    if path.suffix in (".jsonl", ".json") and not path.is_file():
        raise ValueError(f"dataset: no such file {path}")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"dataset: expected a JSON list of row objects in {path}")
        return rows
    try:
        import datasets
    except ImportError:
        raise ValueError(f"dataset: {config.dataset!r} is not a .jsonl/.json file; loading a Hugging Face dataset "
                         "needs `pip install datasets`") from None
    return datasets.load_dataset(config.dataset, split=config.dataset_split)


def load_model_and_tokenizer(config: GRPOConfig):
    """The model (LoRA-wrapped, patched, checkpointed as configured) on its device, and its tokenizer."""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = config.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    dtype = getattr(torch, dtype_name)
    if config.model is None:
        tokenizer = default_task.build_tokenizer()
        model = default_task.build_model(tokenizer, seed=config.seed).to(device=device, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        extra = {}
        if config.load_in_4bit:
            from transformers import BitsAndBytesConfig

            extra["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
            extra["device_map"] = {"": device}
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation="sdpa", **extra)
        if not config.load_in_4bit:
            model.to(device)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        targets = config.lora_target_modules
        model = get_peft_model(model, LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM",
        ))
    if config.patch:
        patch_model(model, offload_activations=_offload_setting(config, device))
    return model, tokenizer


def _offload_setting(config: GRPOConfig, device: str):
    """patch_model's offload_activations: a bool, or an offloader whose host pool is bounded as configured (on the
    CPU too, where it copies to pageable buffers: the same code path, so the bound is tested without a GPU)."""
    if config.offload_host_memory_gib is None:
        return config.offload_activations
    device = torch.device(device)
    pool = HostBufferPool(max_bytes=int(config.offload_host_memory_gib * 2**30), pin_memory=device.type == "cuda")
    return ActivationOffloader(device, pool=pool)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        reward_funcs = [resolve_reward(name) for name in config.reward_funcs]
        dataset = load_dataset(config)
    except ValueError as err:
        parser.error(str(err))
    torch.manual_seed(config.seed)  # LoRA's initialization
    model, tokenizer = load_model_and_tokenizer(config)
    try:
        trainer = GRPOTrainer(model, tokenizer, reward_funcs, dataset, config)
    except ValueError as err:
        parser.error(str(err))
    try:
        history = trainer.train()
    except OffloadMemoryError as err:  # the pool's max_bytes is this run's offload_host_memory_gib
        parser.exit(1, f"fastgrpo train: error: {err} [max_bytes: --offload-host-memory-gib]\n")
    first, last = history[0] if history else None, history[-1] if history else None
    if first and last:
        print(f"reward {first['reward']:.3f} (step {first['step']}) -> {last['reward']:.3f} (step {last['step']}); "
              f"metrics in {Path(config.output_dir) / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
