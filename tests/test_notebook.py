"""notebooks/quickstart.ipynb is saved with its outputs, ending with samples of a policy that solves the task, and
executes top to bottom on the CPU to the same kind of result."""
import os
import re
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs)


def _held_out_reward(nb) -> float:
    found = re.findall(r"held-out reward ([0-9.]+)", _text(nb.cells[-1]))
    assert found, _text(nb.cells[-1])
    return float(found[0])


def test_saved_notebook_shows_its_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code), "every code cell has saved outputs"
    assert any("image/png" in o.get("data", {}) for cell in code for o in cell.outputs)  # the reward curve
    assert _held_out_reward(nb) >= 0.9


def test_quickstart_notebook_runs(monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # A user's CPU session has no Triton interpreter: patched ops take their torch fallback, as here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # One torch thread in the kernel, as `fastgrpo train` takes for this model (default_task.use_one_cpu_thread): with
    # two, whenever another process held a core of the 2, they waited for each other (12 s alone; past the training
    # cell's 300 s with one busy process beside, 13 s with one thread)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    paths = [str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    lines = [line for cell in nb.cells if cell.cell_type == "code" for line in _text(cell).splitlines()]
    assert sum(line.startswith("step ") for line in lines) == 15  # one line every 10 of the 150 steps
    assert _held_out_reward(nb) >= 0.8
