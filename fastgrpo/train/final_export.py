"""A run's export `<output_dir>/final/`, and the line for a resumed run with nothing left to train.

export_model writes final/ (atomically) and records the step of its weights and the files it wrote (`export.json`):
a resumed run writes it again unless it is of the run's last step (export_due); an export that would delete files the
user put in it is refused, at the start of a run that will export (check_final_exportable) and at its end; so is an
adapter layout the export cannot merge.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import logging
from pathlib import Path

import torch

from fastgrpo.hf.models import is_peft_model
from fastgrpo.hf.peft import check_mergeable, merged_config, merged_state_dict
from fastgrpo.train.atomic_folder import atomic_directory
from fastgrpo.train.checkpoint import CONFIG_FILE, read_json_object, write_run_config
from fastgrpo.train.naming import setting

logger = logging.getLogger(__name__)
EXPORT_FILE = "export.json"  # in a run's final/: the step of its weights, the files the export wrote
# The names of the files a model export holds (weights, config, tokenizer): in a final/ exported before EXPORT_FILE,
# any other file is the user's.
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template.*", CONFIG_FILE)


def read_exported_run_config(folder: str | Path) -> dict | None:
    """The run config an export wrote beside its model (export_model's run_config), None where there is none."""
    file = Path(folder) / CONFIG_FILE
    if not file.is_file():
        return None
    return read_json_object(file, "model", "restore it, or delete it (it only tells `fastgrpo eval` how the run "
                                       "prompted; the model does not need it)")


def nothing_to_train(output_dir: str | Path, where: str, of: str, field: str, export_step: int | None = None) -> str:
    """The line for a resumed run at its last step already (`where`: "step 40", `of`: its limit, as the user set
    it), naming the setting to raise; the CLI prints it, the Python trainers warn it (train() returns []).
    export_step: the step of the run's weights, where export is on: a final/ not of it (export_due) is the work left,
    which the line says instead."""
    final = Path(output_dir) / "final"
    if export_step is not None and _exported_step(final) != export_step:
        left = "holds another point's weights" if final.is_dir() else "is missing"
        return f"nothing to train: the run in {output_dir} is at {where} of {of}; exporting it to {final}, which {left}"
    return (f"nothing to train: the run in {output_dir} is at {where} of {of}; pass a larger {setting(field)} to "
            "train on")


def _exported_step(final: Path) -> int | None:
    """The step of final/'s weights as its export recorded it; None where it is missing, unrecorded or damaged
    (export_due says what a damaged record stops)."""
    if not final.is_dir():
        return None
    try:
        return _export_record(final).get("step")
    except ValueError:
        return None


def export_due(output_dir: str | Path, step: int, trained: bool) -> bool:
    """Whether a run's end at `step` (export on) writes final/: not when this call trained nothing and final/ holds
    that step's weights already (a finished run resumed keeps it: the same weights, and the files the user put beside
    them); a final/ of an earlier step (the run went on with export off, or stopped before its export) is written
    again. A ValueError where that would delete files the export did not write: they are the user's to move."""
    final = Path(output_dir) / "final"
    if not final.is_dir():
        return True
    record = _export_record(final)
    if not trained and record.get("step") == step:
        return False
    _refuse_users_files(final, record, f"exporting checkpoint-{step}",
                        f"resume ({setting('resume', True)}) to export it")
    return True


def check_final_exportable(output_dir: str | Path, model: torch.nn.Module | None = None) -> None:
    """For a run with steps left to train and export on, before the first: export_due's refusal of the files the
    user put in final/, and export_model's of a PEFT model's adapter layout it cannot merge (check_mergeable; with
    `model`), said now rather than once the run is trained (files put there during the run are still refused at its
    end)."""
    if model is not None and is_peft_model(model):
        check_mergeable(model)
    final = Path(output_dir) / "final"
    if final.is_dir():
        _refuse_users_files(final, _export_record(final), "exporting the run's last step", "start the run again")


def check_final_overwritable(output_dir: str | Path) -> None:
    """For overwrite_output_dir, before it deletes the previous run: the files the user put in its final/ are refused
    as an export refuses them (the refusal of a fresh run named final/, the export, among the files it deletes)."""
    final = Path(output_dir) / "final"
    if final.is_dir():
        _refuse_users_files(final, _export_record(final), "starting afresh",
                            f"start afresh with {setting('overwrite_output_dir', True)}", field="overwrite_output_dir")


def check_export_replaceable(folder: Path, exporting: str) -> None:
    """For `fastgrpo export --overwrite-output-dir`: the files of the model folder it replaces that no export wrote
    are refused, as check_final_overwritable refuses them in a run's final/."""
    _refuse_users_files(folder, _export_record(folder), exporting,
                        f"export again with {setting('overwrite_output_dir', True)}", field="overwrite_output_dir")


def _refuse_users_files(final: Path, record: dict, exporting: str, then: str, field: str = "export") -> None:
    """A ValueError naming the files in final/ its export did not write (they are the user's to move), which
    `exporting` there would delete; `then`: what to do once they are moved; `field`: the setting that would."""
    foreign = _not_exported(final, record)
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{field}: {final} holds files the export did not write ({listed}), which {exporting} "
                         f"there would delete; move them out of it, then {then}")


def export_at_end(loop, done: int, trained: bool, export, guard) -> None:
    """The end of a run's train() (GRPOTrainer's, SFTTrainer's, ExpertIteration's: `loop`, with config, dist and
    output_dir): with config.export, final/ of step or round `done` written by export(folder) when it is due
    (export_due; trained: this call trained), a signal meanwhile letting it finish (the run's InterruptGuard `guard`
    says so); export off, the warning of an earlier export's final/ (rank 0)."""
    config, dist, output_dir = loop.config, loop.dist, Path(loop.output_dir)
    # every process joins the export's collectives or none: they agree on whether it is due
    if config.export and dist.agree(lambda: export_due(output_dir, done, trained)):
        guard.finishing = "final/"
        export(output_dir / "final")
    elif not config.export and dist.is_main:
        warn_stale_export(output_dir, done)


def warn_stale_export(output_dir: str | Path, step: int) -> None:
    """For a run at `step` that did not export (export off): a final/ of another step is an earlier export of the
    run it continued."""
    final = Path(output_dir) / "final"
    if final.is_dir() and _export_record(final).get("step") != step:
        logger.warning("export: %s holds the weights of an earlier point of this run, not its last step's (export is "
                       "off: %s)", final, setting("export", False))


def _write_export_record(folder: Path, step: int) -> None:
    """EXPORT_FILE in an export being filled: the run's step its weights are of, and every file in `folder` (so
    call it last), which export_due tells from files put there later."""
    record = {"step": step, "files": [*_files(folder), EXPORT_FILE]}
    (folder / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _files(folder: Path) -> list[str]:
    """Every file under `folder`, as sorted paths relative to it."""
    return sorted(file.relative_to(folder).as_posix() for file in folder.rglob("*") if file.is_file())


def _export_record(final: Path) -> dict:
    """final/'s EXPORT_FILE; {} for one exported before the record was written (its step is unknown)."""
    file = final / EXPORT_FILE
    if not file.is_file():
        return {}
    return read_json_object(file, "export", "delete it, and the next resume exports final/ again")


def _not_exported(final: Path, record: dict) -> list[str]:
    """The files in final/ its export did not write: those its record does not list, or (no record) those whose
    names a model folder does not use."""
    files = _files(final)
    if isinstance(record.get("files"), list):
        return [name for name in files if name not in record["files"]]
    return [name for name in files if not any(fnmatch.fnmatchcase(name, pattern) for pattern in _MODEL_FILES)]


def _head_apart_from_embedding(base: torch.nn.Module, merged: dict[str, torch.Tensor]) -> bool:
    """Whether the merged weights of the output head and the input embedding differ, where the trained model runs
    them as one tied weight plus what was trained on each: a LoRA on lm_head adds its delta to the head alone (tied
    again, the export dropped it), one on embed_tokens to the embedding alone, a modules_to_save copy replaces one."""
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or embedding is None:
        return False
    names = {module: name for name, module in base.named_modules()}
    head_weight, embedding_weight = merged.get(f"{names[head]}.weight"), merged.get(f"{names[embedding]}.weight")
    return head_weight is not None and embedding_weight is not None and not torch.equal(head_weight, embedding_weight)


def export_model(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype | None = None,
                 run_config: dict | None = None, step: int | None = None) -> Path:
    """Save an HF model directory (weights, config, tokenizer), atomically. A LoRA model is merged and saved in
    `dtype` (None: merged_dtype's); a fully fine-tuned model is saved as it is, in its own dtype. run_config: the
    run's config, saved beside
    (CONFIG_FILE), so that `fastgrpo eval --model` on the folder prompts as the run did; step: the run's step of the
    weights, recorded with the files written (EXPORT_FILE: export_due); transformers ignores both."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if is_peft_model(model):
        check_mergeable(model)  # the refusal a run that exports said before its first step (check_final_exportable)
    with atomic_directory(path) as tmp:
        if not is_peft_model(model):
            model.save_pretrained(tmp)
        else:
            base = model.get_base_model()
            dtype = dtype or merged_dtype(model)
            merged = merged_state_dict(model, dtype)
            # trained apart (a modules_to_save copy of one, a LoRA on one): tied, one would replace the other
            untied = {"tie_word_embeddings": False} if _head_apart_from_embedding(base, merged) else {}
            with torch.device("meta"):
                fresh = AutoModelForCausalLM.from_config(merged_config(model, **untied), dtype=dtype)
            fresh.load_state_dict(merged, strict=False, assign=True)  # every weight of fresh: check_mergeable
            fresh.tie_weights()
            # from_config derives one from config.json: the base's own (an end-of-turn EOS, sampling defaults) goes
            fresh.generation_config = copy.deepcopy(base.generation_config)
            fresh.save_pretrained(tmp)
        finish_export(tmp, tokenizer, run_config, step)
    return path


def merged_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a LoRA model's merged weights are saved in: the one its base loaded in (its embedding's, which PEFT's
    fp32 adapters do not change, and a 4-bit base leaves unquantized), as PEFT's merge_and_unload keeps it: the run's
    dtype, so an fp32 run exports fp32 and a 4-bit base's weights dequantize to its compute dtype."""
    return model.get_base_model().get_input_embeddings().weight.dtype


def finish_export(folder: Path, tokenizer, run_config: dict | None, step: int | None) -> None:
    """What an export being filled holds beside the weights: the tokenizer, the run's config (CONFIG_FILE) and, last,
    the record of the step and every file written (EXPORT_FILE)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if run_config is not None:
        write_run_config(folder, run_config)
    if step is not None:
        _write_export_record(folder, step)

