"""Every ```python block of README.md runs as written, top to bottom in one namespace (the CPU is enough)."""
import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert blocks, "README.md has no ```python block"
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands here
    # A user's CPU session has no Triton interpreter: patched ops take their torch fallback (read per call).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    namespace = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "step 2: reward " in out, out  # the own-loop snippet ran its three steps
