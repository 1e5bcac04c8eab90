"""The dtype an export writes is the one the run trained in, as its final/ holds it: a GPU run's dtype "auto"
(bfloat16 there) was resolved again by `fastgrpo export` on the CPU, which wrote float32 (twice the size, unlike
final/); a 4-bit base's merged weights were bfloat16 whatever the run's compute dtype. --dtype picks another."""
import dataclasses
import json
import types

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen2Config

from fastgrpo.train.checkpoint import CONFIG_FILE
from fastgrpo.train.final_export import export_model
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.config_file import DTYPE_KEY
from fastgrpo.train.loading import load_model_and_tokenizer
from tests.test_rollout import SIZES, char_tokenizer

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
RUNS = {"full": [], "lora": ["--lora-rank", "4"]}


def _weights_dtypes(folder) -> set[str]:
    """The dtypes of the tensors in folder's model.safetensors, as its header names them ("BF16", "F32")."""
    with safe_open(folder / "model.safetensors", "pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}


def _config_dtype(folder) -> str:
    config = json.loads((folder / "config.json").read_text())
    return config.get("dtype", config.get("torch_dtype"))


@pytest.fixture(scope="module", params=sorted(RUNS))
def gpu_like_run(request, tmp_path_factory):
    """A built-in run trained in bfloat16, its checkpoint's record as a GPU run's with dtype auto reads: "auto",
    resolved there to bfloat16."""
    folder = tmp_path_factory.mktemp(request.param) / "run"
    assert main(["train", *RUNS[request.param], "--dtype", "bfloat16", "--max-steps", "1",
                 "--output-dir", str(folder), *QUIET]) == 0
    record_file = folder / "checkpoint-1" / CONFIG_FILE
    record = json.loads(record_file.read_text())
    assert record[DTYPE_KEY] == "bfloat16"  # what the run loaded its model in
    record_file.write_text(json.dumps({**record, "dtype": "auto"}))
    assert _weights_dtypes(folder / "final") == {"BF16"}
    return folder


@pytest.mark.parametrize("flags", [[], ["--dtype", "auto"]], ids=["default", "auto"])
def test_an_export_on_the_cpu_is_in_the_dtype_the_run_trained_in(gpu_like_run, tmp_path, flags):
    out = tmp_path / "model"
    assert main(["export", "--checkpoint", str(gpu_like_run / "checkpoint-1"), "--output-dir", str(out), *flags]) == 0
    assert _weights_dtypes(out) == {"BF16"}
    assert _config_dtype(out) == _config_dtype(gpu_like_run / "final") == "bfloat16"


def test_dtype_exports_in_another(gpu_like_run, tmp_path):
    out = tmp_path / "model"
    assert main(["export", "--checkpoint", str(gpu_like_run), "--output-dir", str(out), "--dtype", "float16"]) == 0
    assert _weights_dtypes(out) == {"F16"}
    assert _config_dtype(out) == "float16"


@pytest.mark.parametrize(("dtype", "device", "resolved"), [("auto", "cpu", "float32"), ("float16", "auto", "float16"),
                                                          ("bfloat16", "cpu", "bfloat16")])
def test_a_record_keeps_the_dtype_its_model_loads_in_and_reads_back(tmp_path, dtype, device, resolved):
    record = GRPOConfig(dtype=dtype, device=device).to_dict()
    assert record[DTYPE_KEY] == resolved
    assert GRPOConfig.from_dict(record).dtype == dtype  # no setting of its own
    (tmp_path / CONFIG_FILE).write_text(json.dumps(record))
    assert GRPOConfig.from_yaml(tmp_path / CONFIG_FILE).dtype == dtype


def test_a_4bit_base_merges_into_the_runs_compute_dtype(tmp_path):
    """A QLoRA run in float32 (as fastgrpo loads it: load_in_4bit, compute dtype the run's) exported bfloat16."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**SIZES)).save_pretrained(tmp_path / "base")
    setup = types.SimpleNamespace(model=str(tmp_path / "base"), dtype="float32", device="cpu", load_in_4bit=True,
                                  lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj"],
                                  gradient_checkpointing=False, patch=False, seed=0)
    model, _ = load_model_and_tokenizer(setup, char_tokenizer())
    assert type(model.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    out = export_model(model, None, tmp_path / "final")
    assert _weights_dtypes(out) == {"F32"}
    assert _config_dtype(out) == "float32"


def test_the_export_flag_says_final_holds_the_runs_dtype(tmp_path):
    """--export's help said "LoRA merged into a bf16 base"; a float32 LoRA run's final/ is float32 (merged_dtype)."""
    folder = tmp_path / "run"
    assert main(["train", "--lora-rank", "4", "--max-steps", "1", "--output-dir", str(folder), *QUIET]) == 0
    assert _weights_dtypes(folder / "final") == {"F32"}
    help_text = {field.name: field.metadata["help"] for field in dataclasses.fields(GRPOConfig)}["export"]
    assert "bf16" not in help_text and "the dtype the run trained in" in help_text, help_text
