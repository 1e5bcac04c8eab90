"""ExportConfig: every setting of `fastgrpo export`, loadable from YAML, each field a flag."""
from __future__ import annotations

import dataclasses

from fastgrpo._checks import check_choice
from fastgrpo.train.coercion import coerce_fields
from fastgrpo.train.config import DTYPES, option
from fastgrpo.train.config_file import ConfigFile
from fastgrpo.train.options import inherited


@dataclasses.dataclass
class ExportConfig(ConfigFile):
    COMMAND = "export"
    checkpoint: str | None = option(None, "required: a run's checkpoint-<step>/ folder, or its output_dir (the newest "
                                          "checkpoint); the model that run trained, with the checkpoint's weights")
    model: str | None = option(None, "the base model's new path, where it moved since the run, or another base to "
                                     "merge into (a warning names both); none: the one the run recorded")
    dtype: str | None = option(None, f"one of {DTYPES}: the exported weights' (a LoRA adapter merges into its base "
                                     "in it; a 4-bit base dequantizes to it); none or auto: the dtype the run trained "
                                     "in, as its final/ holds it (a GPU run's auto: bfloat16, on a CPU too)")
    device: str = inherited("device")
    output_dir: str | None = option(None, "required: the model folder to write (config.json, weights, tokenizer, "
                                          "run_config.json, export.json, as a run's final/); a new or empty folder")
    overwrite_output_dir: bool = option(False, "replace the model an export wrote in output_dir (files no export "
                                               "wrote there are refused)")

    def __post_init__(self):
        coerce_fields(self)
        if self.dtype is not None:
            check_choice("dtype", self.dtype, DTYPES)
        if self.output_dir is not None and not self.output_dir.strip():  # Path("") is the current folder
            raise ValueError(f"output_dir: expected a folder path, got {self.output_dir!r}")
