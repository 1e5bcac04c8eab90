"""`fastgrpo eval`'s settings: each wrong value is one line naming its flag, before anything loads or is written."""
import pytest

from fastgrpo.train.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "seed: expected an int in [0, 2**32), got -1"),
    (["--seed", str(2**32)], f"seed: expected an int in [0, 2**32), got {2**32}"),
    (["--dtype", "float64"], "dtype: expected one of ['auto', 'float32', 'bfloat16', 'float16'], got 'float64'"),
])
def test_a_value_train_refuses_is_refused_by_eval_too(tmp_path, capsys, flags, message):
    """eval took a seed outside the help's [0, 2**32) (and a dtype outside its list) that train refuses."""
    out = tmp_path / "out"
    assert main(["eval", *flags, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"fastgrpo eval: error: {message}\n", err
    assert not out.exists()


def test_an_empty_output_dir_is_refused_not_the_current_folder(tmp_path, capsys, monkeypatch):
    """--output-dir '' wrote results.jsonl and summary.json among the files of the current folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--output-dir", "", "--max-examples", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "fastgrpo eval: error: output_dir: expected a folder path, got ''\n", err
    assert list(tmp_path.iterdir()) == []
