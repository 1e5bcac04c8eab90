"""The metrics of a run: one JSON line per step in <output_dir>/metrics.jsonl (as `fastgrpo train` writes it), and
the same scalars to wandb / tensorboard when asked."""
from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

from fastgrpo._checks import check_choice
from fastgrpo.train.run_dir import write_whole

logger = logging.getLogger(__name__)
REPORTERS = ("wandb", "tensorboard")
_MODULES = {"wandb": "wandb", "tensorboard": "torch.utils.tensorboard"}  # what each logger imports
_EVALUATION_FILE = re.compile(r"step-(\d+)(\.jsonl|_summary\.json)")  # PeriodicEval's, in <output_dir>/eval/


def check_report_to(report_to: list[str] | None) -> None:
    """Each name is a known logger whose package imports: MetricsLog's check, also for a run that builds none (a
    resumed run with nothing left to train)."""
    for name in report_to or []:
        check_choice("report_to", name, REPORTERS)
        try:
            importlib.import_module(_MODULES[name])
        except ImportError as err:
            raise ValueError(f"report_to: {name!r} needs `pip install {name}` ({err})") from None


class MetricsLog:
    """`key` names the step counter of each line ("step" for SFT, "round" for expert iteration)."""

    def __init__(self, output_dir: str | Path, *, report_to: list[str] | None = None, run_config: dict | None = None,
                 key: str = "step"):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.key = key
        self._redone_from: int | None = None  # the first step logged again (start_at); None: a fresh log
        check_report_to(report_to)
        self._loggers: list[Callable[[int, dict], None]] = [
            _wandb(run_config or {}) if name == "wandb" else _tensorboard(self.path.parent, lambda: self._redone_from)
            for name in report_to or []
        ]

    def start_at(self, step: int) -> None:
        """Keep the log consistent with the weights a run starts from: drop the lines past `step`. A line that does
        not parse (the last one, cut short by a kill in the middle of a write) is dropped with a warning. The file
        is created by the first write: a run that fails before its first step leaves none (nor an emptied one).
        tensorboard's event files are append-only: its writer drops the steps past `step` on the reader's side. The
        periodic evaluations past `step` (eval/step-<N>*) go as their lines do, whether or not this run evaluates."""
        drop_evaluations_after(self.path.parent / "eval", step, self.key)
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        # a run resumed from step 0 (its step 1's evaluation failed: logged again, whole) has lines before it
        self._redone_from = step + 1 if step > 0 or lines else None
        kept, torn = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                torn.append(number)
                continue
            if isinstance(row, dict) and row.get(self.key, 0) <= step:
                kept.append(line + "\n")
        if torn:
            logger.warning("%s: dropped unreadable line %s (a write cut short by a kill)", self.path,
                           ", ".join(map(str, torn)))
        if not kept:
            self.path.unlink(missing_ok=True)
            return
        write_whole(self.path, "".join(kept))  # a kill during the rewrite leaves the old log, not half of it

    def write(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != self.key}
        for log in self._loggers:
            log(metrics[self.key], scalars)


def drop_evaluations_after(folder: Path, step: int, unit: str) -> None:
    """Delete the files of the periodic evaluations (--eval-steps) past `step` in `folder`: a run resumed from an
    earlier checkpoint than its last evaluation (killed between the two) replaces those steps; kept, they would stay
    beside the new run's files, from weights it threw away. `unit`: what the run calls a step ("round")."""
    replaced = sorted((int(match[1]), path.name) for path in folder.glob("step-*")
                      if (match := _EVALUATION_FILE.fullmatch(path.name)) and int(match[1]) > step)
    for _, name in replaced:
        (folder / name).unlink()
    if replaced:
        names = ", ".join(name for _, name in replaced)
        logger.info("eval: deleted %s, the evaluations of %ss this run replaces", names, unit)


def _wandb(run_config: dict) -> Callable[[int, dict], None]:
    import wandb

    run = None

    def log(step: int, scalars: dict) -> None:
        nonlocal run
        # At the first line, as metrics.jsonl (a run that logs nothing makes no wandb run), a wandb run of this log's
        # own: by default wandb.init gave a second trainer of the process the first's run back, where wandb dropped
        # its steps as "less than the current step". Where another trainer's run (or wandb.finish) ended ours since,
        # ours is taken up again (resume="allow").
        if run is None or getattr(wandb, "run", run) is not run:  # wandb.run: the process's current run
            again = {} if run is None else {"id": run.id, "resume": "allow"}
            run = wandb.init(project="fastgrpo", config=run_config, reinit="finish_previous", **again)
        run.log(scalars, step=step)

    return log


def _tensorboard(output_dir: Path, redone_from: Callable[[], int | None]) -> Callable[[int, dict], None]:
    """redone_from(): the first step this run logs again; TensorBoard drops what earlier runs logged from it on
    (purge_step), as start_at drops metrics.jsonl's lines: each step is drawn once, with this run's value."""
    from torch.utils.tensorboard import SummaryWriter

    writer = None

    def log(step: int, scalars: dict) -> None:
        nonlocal writer
        if writer is None:  # at the first line, as metrics.jsonl: a run that fails before it leaves no folder
            writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=redone_from())
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        writer.flush()

    return log
