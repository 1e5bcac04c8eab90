"""FastGRPOTrainer's own keywords are checked before TRL loads the model: a typo in offload_activations or
recompute_layers must not cost a model load (minutes for a large checkpoint) before its one-line error. The model
path below does not exist, so a check that ran only after loading would surface TRL's loading error instead."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload_activations="yes"), "offload_activations: expected a bool or a fastgrpo.offload.ActivationOffloader, "
                                      "got str"),
    (dict(offload_activations=True, recompute_layers=-1), r"recompute_layers: expected an int >= 0 or None, got -1"),
    (dict(offload_activations=True, recompute_layers="2"), r"recompute_layers: expected an int >= 0 or None, got '2'"),
    (dict(offload_activations=True, recompute_layers=True), r"recompute_layers: expected an int >= 0 or None, got True"),
])
def test_offload_keywords_are_checked_before_the_model_loads(tmp_path, kwargs, match):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                      num_generations=4)
    with pytest.raises(ValueError, match=f"^FastGRPOTrainer cannot honour: {match}$"):
        FastGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda completions, **_: [0.0],
                        args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), **kwargs)


def test_a_triton_backend_without_a_gpu_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    # Unrefused, it surfaced at the first loss, after the model had loaded and the first completions were generated.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                      num_generations=4)
    match = r"^FastGRPOTrainer cannot honour: backend: 'triton' needs CUDA tensors .*got device cpu; use backend='torch'"
    with pytest.raises(ValueError, match=match):
        FastGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lambda completions, **_: [0.0],
                        args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), backend="triton")
