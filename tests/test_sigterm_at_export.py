"""A SIGTERM as a run writes its final/ (the last step already saved): the export finishes and the run ends as it
would have, and the warning says so. It said "finishing the current step, then saving a checkpoint", a step that
had ended and a checkpoint that was written already."""
import pytest

from tests.test_eval_export_signals import _child, _signal_in
from tests.test_interrupt_eval_export import QUIET
from tests.test_sigterm_before_loop import SHORT


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_sigterm_as_final_is_written_lets_it_finish_and_says_so(tmp_path, command):
    out = tmp_path / "run"
    # _write_export_record: the export's last file, looked up in final_export's globals as export_model calls it
    done = _child([command, "--output-dir", str(out), *SHORT[command], *QUIET],
                  _signal_in("final_export", "_write_export_record"))
    unit = "round" if command == "ei" else "step"
    warned = [line for line in done.stderr.splitlines() if "SIGTERM" in line]
    assert done.returncode == 0 and warned == [
        f"fastgrpo {command}: warning: SIGTERM: finishing final/ (the last {unit} is saved), then stopping (another "
        "SIGTERM stops at once)"], done.stderr
    assert (out / "final" / "export.json").is_file()
