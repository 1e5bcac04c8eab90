"""A cheap fingerprint of a run's base model folder, kept in the run's record (ConfigFile.to_dict: FINGERPRINT_KEY), so
that a run's weights are not put on other base weights than they were trained on: the base path alone named another
run's final/ exported again since (`sft --resume` with more steps, `--overwrite-output-dir`), and a resumed LoRA run
or `eval --checkpoint` put the adapter on it without a word, mixing two runs.

Cheap: no hash of gigabytes of weights. Per file a model folder loads from (weights, their index, config.json, a
fastgrpo export's export.json), a hash of its size and of samples of it: for a .safetensors file its header (names,
shapes, offsets) and the first and last 4 KiB of every tensor, since a fine-tune changes each tensor it trains, which
the first, middle and last MB of the file can all miss (a LoRA of q_proj alone); for another file its first, middle
and last MiB (all of a small one). Names are relative and no time is read, so moving or copying the folder keeps its
fingerprint. A Hub name (no local folder) has none.

Where the check applies: wherever the run's weights are put on the base's. A LoRA run's adapter always is (resume and
eval); a fully fine-tuned GRPO run resumed with beta > 0 rebuilds its KL reference from the base. A full run's
checkpoint otherwise holds every weight, the base's replaced: neither its eval nor its resume is checked.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from fastgrpo.train.naming import setting

logger = logging.getLogger(__name__)
FINGERPRINT_KEY = "model_fingerprint"  # in a run's record, beside "model"
# the files of a model folder whose bytes make the model, weights first (a difference names them first)
_MODEL_FILES = ("*.safetensors", "pytorch_model*.bin", "*.index.json", "config.json", "export.json")
_TENSOR_EDGE = 4096  # bytes sampled at each end of a tensor in a .safetensors file
_WINDOW = 1 << 20  # bytes sampled at the start, middle and end of another file


def fingerprint(model: str | None) -> dict[str, str] | None:
    """{file name: hash of its size and samples} of the model folder `model`; None for a Hub name or the built-in
    model (None)."""
    if model is None or not Path(model).is_dir():
        return None
    folder = Path(model)
    names = dict.fromkeys(p.name for pattern in _MODEL_FILES for p in sorted(folder.glob(pattern)) if p.is_file())
    return {name: _file_digest(folder / name) for name in names}


def _file_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        digest.update(str(size).encode())
        if not (file.suffix == ".safetensors" and _digest_tensors(handle, size, digest)):
            _digest_windows(handle, size, digest)
    return digest.hexdigest()[:16]


def _digest_tensors(handle, size: int, digest) -> bool:
    """Hash a .safetensors file's header and each tensor's first and last _TENSOR_EDGE bytes; False where the header
    does not read (a damaged file, sampled as any other: its fingerprint then differs, which the check says)."""
    length = int.from_bytes(handle.read(8), "little")
    if not 0 < length <= size - 8:
        return False
    header = handle.read(length)
    try:
        tensors = json.loads(header)
        spans = sorted(entry["data_offsets"] for name, entry in tensors.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    digest.update(header)
    for start, end in spans:
        for offset in dict.fromkeys((start, max(start, end - _TENSOR_EDGE))):  # one read for a small tensor
            handle.seek(8 + length + offset)
            digest.update(handle.read(min(_TENSOR_EDGE, end - offset)))
    return True


def _digest_windows(handle, size: int, digest) -> None:
    """Hash the first, middle and last _WINDOW bytes of a file (all of one up to three windows long)."""
    if size <= 3 * _WINDOW:
        handle.seek(0)
        digest.update(handle.read())
        return
    for offset in (0, (size - _WINDOW) // 2, size - _WINDOW):
        handle.seek(offset)
        digest.update(handle.read(_WINDOW))


def recorded_fingerprint(config) -> dict[str, str] | None:
    """config.model's fingerprint as the run's record keeps it: taken at its first record (a trainer's construction,
    the model loaded) and kept for the config's life, so every checkpoint names the base the run loaded, not one
    replaced while it trained."""
    model = getattr(config, "model", None)
    taken = config.__dict__.get("_model_fingerprint")
    if taken is None or taken[0] != model:
        taken = config.__dict__["_model_fingerprint"] = (model, fingerprint(model))
    return taken[1]


def same_base(record: dict, model: str | None) -> bool:
    """Whether `model` holds the very base model the run of `record` fingerprinted (moved or copied, say)."""
    recorded = record.get(FINGERPRINT_KEY)
    return recorded is not None and fingerprint(model) == recorded


def base_change(record: dict, model: str | None, resuming: bool, say: bool = True) -> str | None:
    """What differs between the base the run of `record` (its config) trained on and the model folder `model` its
    weights are to be put on now ("model.safetensors differs"); None where nothing does, where either has no
    fingerprint (a Hub name; a run recorded before fingerprints, which is said unless `say` is off), or where the
    run's weights do not sit on the base's (a full fine-tune, but for a GRPO run's KL reference when resuming)."""
    reads_base = record.get("lora_rank", 0) > 0 or (resuming and record.get("beta", 0) > 0)
    now = fingerprint(model) if reads_base else None
    if now is None:
        return None
    recorded = record.get(FINGERPRINT_KEY)
    if recorded is None:
        if say:
            logger.info("model: the run recorded no fingerprint of its base model (it predates them, or named a Hub "
                        "model): %s is not checked", model)
        return None
    return _differences(recorded, now)


def check_base_unchanged(run: dict, checkpoint: Path, model: str | None, warn: bool = True) -> None:
    """The base model the weights of `checkpoint` (its run's record: `run`) load over is the one its run trained on
    (base_change): a LoRA adapter put on another run's weights mixes the two. The folder the run recorded, changed
    since (another run's final/ exported again there), is refused; another folder named as `model` (--model) is the
    user's choice, as PEFT puts an adapter on any base (the base re-saved in another dtype, a quantized copy): a
    warning names both folders (warn: said here)."""
    base = model if model is not None else run.get("model")
    change = base_change(run, base, resuming=False)
    if change is None:
        return
    recorded = run.get("model")
    if model is None or recorded is None or Path(model).resolve() == Path(recorded).resolve():
        raise ValueError(f"model: {base} is not the base model the run of {checkpoint} trained on (its files changed "
                         f"since: {change}); pass that base (or a copy of it) as {setting('model')}")
    if warn:
        logger.warning("model: putting the weights of %s on %s as --model asks, not on the base its run trained on, "
                       "%s (%s)", checkpoint, model, recorded, change)


def _differences(recorded: dict[str, str], now: dict[str, str]) -> str | None:
    """The files of two fingerprints that differ, went or came, in words; None where none does."""
    changed = [name for name in recorded if name in now and now[name] != recorded[name]]
    gone = [name for name in recorded if name not in now]
    added = [name for name in now if name not in recorded]
    said = [f"{', '.join(names)} {verb[len(names) > 1]}" for names, verb in
            ((changed, ("differs", "differ")), (gone, ("is gone", "are gone")), (added, ("is new", "are new")))
            if names]
    return ", ".join(said) or None
