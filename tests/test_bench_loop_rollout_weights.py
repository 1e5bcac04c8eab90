"""benchmarks.bench_loop's --rollout-weights: the fastgrpo systems decode with the weights it names, and their rows
say so (a row of fastgrpo-fp8train with a bf16 copy must not pass for the system's own W8A8 one)."""
import pytest

from benchmarks.bench_loop import ROLLOUT_WEIGHTS, Case, build_folder, fastgrpo_trainer, parse_args


@pytest.mark.parametrize("weights, layers, label", [
    (None, None, "fastgrpo-fp8train"),
    ("dense", None, "fastgrpo-fp8train-dense"),
    (None, 18, "fastgrpo-fp8train-recompute18"),
    ("dense", 18, "fastgrpo-fp8train-dense-recompute18"),
])
def test_a_row_names_the_decode_weights_it_was_given(weights, layers, label):
    case = Case(system="fastgrpo-fp8train", shape="qwen2.5-1.5b-lora", completion=1024, rollout_weights=weights,
                recompute_layers=layers)
    assert case.label == label


def test_the_flag_reaches_the_trainers_config_and_overrides_the_systems_choice(tmp_path):
    folder = build_folder("tiny-qwen2", tmp_path, "cpu")
    case = Case(system="fastgrpo-fp8", shape="tiny-qwen2-lora", completion=16, folder=str(folder), prompts=1,
                generations=2, prompt_length=8, micro_batch=2, device="cpu", rollout_weights="dense")
    trainer = fastgrpo_trainer(case, engine="fp8")
    assert trainer.config.rollout_weights == "dense"
    assert trainer.config.rollout_kv_cache == "fp8"  # the rest of the system's settings stay
    own = fastgrpo_trainer(Case(**{**case.__dict__, "rollout_weights": None}), engine="fp8")
    assert own.config.rollout_weights == "w8a8"


def test_its_choices_are_the_engines_and_a_typo_is_refused(capsys):
    from fastgrpo.rollout.decode_weights import WEIGHTS

    assert ROLLOUT_WEIGHTS == WEIGHTS
    assert parse_args(["--dry-run", "--rollout-weights", "dense"]).rollout_weights == "dense"
    with pytest.raises(SystemExit):
        parse_args(["--dry-run", "--rollout-weights", "dens"])
    assert "--rollout-weights: invalid choice: 'dens'" in capsys.readouterr().err


def test_only_the_fastgrpo_systems_are_given_the_weights(tmp_path, monkeypatch):
    """main hands --rollout-weights to the fastgrpo systems' cases alone: a TRL row is TRL's own decode, and says so
    (not trl-dense)."""
    import benchmarks.bench_loop as bench

    cases = []

    def run_case(case, log_dir, timeout, dry_run):  # the case as main built it, in place of its process
        cases.append(case)
        return {"system": case.label, "completion": case.completion}

    monkeypatch.setattr(bench, "run_case", run_case)
    bench.main(["--dry-run", "--shapes", "tiny-qwen2-lora", "--systems", "fastgrpo", "trl", "--rollout-weights",
                "dense", "--results-dir", str(tmp_path / "results"), "--log-dir", str(tmp_path / "logs")])
    assert {case.system: case.label for case in cases} == {"fastgrpo": "fastgrpo-dense", "trl": "trl"}
