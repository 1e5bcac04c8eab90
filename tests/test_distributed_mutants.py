"""Mutation audit of the multi-process pieces (ranks, distributed, process_agreement) on 2 forked gloo processes:
each check here failed on a small realistic bug that the rest of the suite let through. One fork serves them all
(joining a gloo group costs more than the checks)."""
import dataclasses
import json
import logging
import os
import time
import types
from pathlib import Path

import torch

from fastgrpo.train import default_task, ranks
from fastgrpo.train.checkpoint import read_checkpoint
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.final_export import EXPORT_FILE, export_at_end, export_model
from fastgrpo.train.interrupts import InterruptGuard
from fastgrpo.train.process_agreement import check_same_settings
from fastgrpo.train.ranks import process_count, process_rank, reported_by_rank_0
from tests.forked_gloo import WORLD, run_forked


@dataclasses.dataclass
class _Settings:
    output_dir: str
    seed: int = 0


def _checks(rank: int, tmp: Path) -> dict:
    group = Distributed.current()
    found = {"rank": process_rank(), "count": process_count(), "shard": group.shard(list(range(10, 18))),
             "own_rows": group.own_rows(torch.arange(8)).tolist()}
    try:
        group.check_final_exportable(tmp / "run")
        found["exportable"] = "passed"
    except ValueError as err:
        found["exportable"] = str(err)
    # a setting each process resolved otherwise: an error every process raises, which rank 0 prints at once (under
    # torchrun another process waits for rank 0's end only for bad input that rank 0 may not have met)
    os.environ["TORCHELASTIC_RUN_ID"] = "forked"
    ranks.RANK_0_GRACE_S = 0.1
    try:
        check_same_settings(group, _Settings(output_dir=f"run-{rank}"))
    except ValueError as err:
        found["settings"] = (str(err), reported_by_rank_0(err))
    # a checkpoint of a run that keeps whole weights on every process (one process, DDP): rank 0 writes it
    group.save_checkpoint(tmp / "checkpoint-1", torch.nn.Linear(2, 2), None, {"step": 1})
    exported, warned = [], []
    loop = types.SimpleNamespace(config=types.SimpleNamespace(export=True), dist=group, output_dir=tmp / f"run-{rank}")
    export_at_end(loop, 2, False, exported.append, InterruptGuard())
    found["exported"] = [str(path) for path in exported]
    # export off, final/ of an earlier step: the warning, once
    logging.getLogger("fastgrpo.train.final_export").addHandler(_Collect(warned))
    export_at_end(types.SimpleNamespace(config=types.SimpleNamespace(export=False), dist=group,
                                        output_dir=tmp / "run-1"), 2, True, exported.append, InterruptGuard())
    found["warned"] = len(warned)
    # rank 0 exports (slowly), and no process goes on before final/ is whole (a script reads it after train())
    tokenizer = default_task.build_tokenizer()
    group.export(_slow_export, default_task.build_model(tokenizer), tokenizer, tmp / "final", step=2)
    found["export_read_back"] = (tmp / "final" / EXPORT_FILE).is_file()
    return found


class _Collect(logging.Handler):
    def __init__(self, into: list):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _slow_export(*args, **kwargs):
    time.sleep(0.5)
    return export_model(*args, **kwargs)


def test_ranks_shares_and_the_export_check_hold_on_every_process(tmp_path, monkeypatch):
    """Processes a caller forked into one group (no torchrun environment: WORLD_SIZE unset) are counted and ranked
    by their group: `fastgrpo export` refuses to run in several (each would replace the same folder). Each rank takes
    its own equal share of a step's prompts, keyed by their positions. A setting resolved otherwise on one process
    stops every process, rank 0 saying it (the others end at once, not after a wait for rank 0). A checkpoint
    records the process count that wrote it. The files a user put in final/ that the export would delete are refused
    on every process (rank 0 alone raised, the others went on into the run's collectives), and whether the run's end
    exports is decided together (each process joins the export's collectives, or none); with export off, rank 0 alone
    warns of an earlier final/; a process returns from the export once rank 0 wrote it whole."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "notes.txt").write_text("mine")
    for rank, step in enumerate((2, 1)):  # rank 0's final/ is of the run's step 2 already, rank 1's of step 1
        other = tmp_path / f"run-{rank}" / "final"
        other.mkdir(parents=True)
        (other / EXPORT_FILE).write_text(json.dumps({"step": step, "files": [EXPORT_FILE]}))
    found = run_forked(_checks, tmp_path, deadline_s=60, group_timeout_s=30)
    assert [(f["rank"], f["count"]) for f in found] == [(rank, WORLD) for rank in range(WORLD)]
    assert [f["shard"] for f in found] == [([0, 1, 2, 3], [10, 11, 12, 13]), ([4, 5, 6, 7], [14, 15, 16, 17])]
    assert [f["own_rows"] for f in found] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    message = (f"export: {final} holds files the export did not write (notes.txt), which exporting the run's last "
               "step there would delete; move them out of it, then start the run again")
    assert [f["exportable"] for f in found] == [message, f"(on process 0) {message}"]
    message = ("output_dir: expected the same value on every process, got 'run-0' on process 0, 'run-1' on process 1; "
               "each reads the flags, config file and output folder itself: start them again on one folder they all "
               "see as it stands")
    assert [f["settings"] for f in found] == [(message, False), (message, True)]
    # a resume on another process count says so: the checkpoint records how many processes wrote it
    assert read_checkpoint(tmp_path / "checkpoint-1")["world_size"] == WORLD
    # the processes see final/ differently (a disk local to each): every one exports (its collectives), or none
    assert [f["exported"] for f in found] == [[str(tmp_path / f"run-{rank}" / "final")] for rank in range(WORLD)]
    assert [f["warned"] for f in found] == [1, 0]  # rank 0's, not one line per process
    assert [f["export_read_back"] for f in found] == [True, True]
