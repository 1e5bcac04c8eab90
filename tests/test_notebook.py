"""notebooks/quickstart.ipynb executes top to bottom on the CPU (CI budget: 3 minutes)."""
import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # A user's CPU session has no Triton interpreter: patched ops take their torch fallback, as here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    paths = [str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    first, last = (float(x) for x in outputs.split("reward ")[1].split()[0:3:2])
    assert last > first, outputs
