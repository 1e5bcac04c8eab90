"""The model `fastgrpo eval` loads (a model folder, the built-in model, or a checkpoint: of a run that may still be
training and pruning its checkpoints), and what its summary calls it."""
from __future__ import annotations

import logging
from pathlib import Path

from fastgrpo.train.checkpoint import STATE_FILE, TornCheckpoint, read_run_config
from fastgrpo.train.loading import find_checkpoint, load_inference_model

logger = logging.getLogger(__name__)


def load_evaluated_model(config, checkpoint: Path | None, tokenizer, *, attempts: int = 3):
    """(model, source) for `fastgrpo eval` (loading.load_inference_model; tokenizer: the evaluated model's, which the
    command loaded before the model, tokenizer_before_load); source: the summary's "model"
    (evaluated_model) and "checkpoint" (the one loaded), read as it loads. A run still training deletes its older
    checkpoints as it saves new ones (--save-total-limit): when the one being loaded goes, the run's newest is taken
    instead, with a warning, if --checkpoint named the run's folder; if it named that checkpoint, a one-line
    ValueError says so (so does a damaged one)."""
    for attempt in range(attempts):
        try:
            source = {"model": evaluated_model(config.model, checkpoint),
                      "checkpoint": str(checkpoint) if checkpoint else None}
            # the commands checked the base before loading (check_checkpoint_base), and warned of another once
            model, _ = load_inference_model(model=config.model, dtype=config.dtype, device=config.device,
                                            seed=config.seed, checkpoint=checkpoint, tokenizer=tokenizer,
                                            warn_base=False)
            return model, source
        except TornCheckpoint as err:
            if (checkpoint / STATE_FILE).exists():
                raise ValueError(f"checkpoint: cannot read {err}") from None
        except FileNotFoundError:  # the checkpoint's config, read first, was gone
            if checkpoint is None or (checkpoint / STATE_FILE).exists():
                raise
        gone = f"checkpoint: {checkpoint} was deleted while it loaded (its run, still training, prunes older " \
               "checkpoints as it saves: --save-total-limit)"
        newest = find_checkpoint(config.checkpoint) if Path(config.checkpoint) != checkpoint else None
        if newest is None or attempt == attempts - 1:
            raise ValueError(f"{gone}; pass a newer one")
        logger.warning("%s; evaluating the run's newest, %s, instead", gone, newest.name)
        checkpoint = newest


def evaluated_model(model: str | None, checkpoint: Path | None) -> str | None:
    """The model an evaluation ran: `model`, else the base model of the checkpoint's run (None: the built-in one)."""
    if model is not None or checkpoint is None:
        return model
    return read_run_config(checkpoint).get("model")
