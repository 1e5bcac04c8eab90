"""Checkpoints for exact resume, and export of the trained model as a Hugging Face directory.

A checkpoint `<output_dir>/checkpoint-<step>/` holds `trainer_state.pt` (the trainable parameters, optimizer,
LR scheduler, RNG states, step, data position, beta) and, for LoRA, the adapter in PEFT's format. Loading it
restores every tensor bit for bit, so N straight steps equal k steps + resume + N - k steps.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import torch

from fastgrpo.hf.models import is_peft_model
from fastgrpo.hf.peft import merged_state_dict

STATE_FILE = "trainer_state.pt"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


def rng_states() -> dict:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(path: str | Path, model: torch.nn.Module, state: dict) -> Path:
    """Write `state` (optimizer, scheduler, step, ...) plus the trainable parameters and RNG states to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    trainable = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({**state, "trainable": trainable, "rng": rng_states()}, path / STATE_FILE)
    if is_peft_model(model):
        model.save_pretrained(path)  # the adapter alone, loadable with PeftModel.from_pretrained
    return path


def load_checkpoint(path: str | Path, model: torch.nn.Module) -> dict:
    """Copy the saved trainable parameters into `model`, restore the RNG states; return the rest of the state."""
    state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    saved = state["trainable"]
    missing = sorted(set(saved) - set(params))
    if missing:
        raise ValueError(f"checkpoint: parameters {missing[:3]} are not in the model; was it built the same way?")
    untrained = sorted(n for n, p in params.items() if p.requires_grad and n not in saved)
    if untrained:
        raise ValueError(f"checkpoint: lacks the model's trainable parameters {untrained[:3]}; "
                         "was it built the same way?")
    # copy_ would broadcast e.g. a rank-1 LoRA A [1, H] into a rank-4 one [4, H] without a word
    shapes = [(n, tuple(v.shape), tuple(params[n].shape)) for n, v in saved.items() if v.shape != params[n].shape]
    if shapes:
        name, got, want = shapes[0]
        raise ValueError(f"checkpoint: parameter {name} has shape {got}, the model's has {want}; "
                         "was it built the same way?")
    with torch.no_grad():
        for name, value in state.pop("trainable").items():
            params[name].copy_(value)
    set_rng_states(state.pop("rng"))
    return state


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*") if (m := _CHECKPOINT.search(p.name))]
    found = [(step, p) for step, p in found if (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def export_model(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save an HF model directory (weights, config, tokenizer). A LoRA model is merged and saved in `dtype`; a
    fully fine-tuned model is saved as it is, in its own dtype."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not is_peft_model(model):
        model.save_pretrained(path)
    else:
        config = model.get_base_model().config
        config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
        fresh.load_state_dict(merged_state_dict(model, dtype), strict=False, assign=True)
        fresh.tie_weights()
        missing = [n for n, p in fresh.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"model: merged weights lack {missing[:3]}; unsupported adapter layout")
        fresh.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
