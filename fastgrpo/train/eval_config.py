"""EvalConfig: every setting of `fastgrpo eval`, loadable from YAML, each field a flag."""
from __future__ import annotations

import dataclasses

from fastgrpo._checks import check_choice
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.train.coercion import coerce_fields
from fastgrpo.train.config import DTYPES, MAX_SEED, check_ddp_timeout, option
from fastgrpo.train.config_file import ConfigFile
from fastgrpo.train.input_checks import check_at_least, greedy_copies
from fastgrpo.train.options import check_scoring_options, inherited
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import PROMPT_FORMATS, stop_strings


@dataclasses.dataclass
class EvalConfig(ConfigFile):
    COMMAND = "eval"
    model: str | None = inherited("model", help="HF model path or hub name (e.g. a run's final/); none: the "
                                                "built-in tiny model; with --checkpoint: the base model's new path, "
                                                "or another base to put its weights on (a warning names both)")
    checkpoint: str | None = option(None, "a run's checkpoint-<step>/ folder, or its output_dir (the newest "
                                          "checkpoint): the model that run trained, with the checkpoint's weights")
    dataset: str | None = option(None, "a .jsonl / .json file of rows, a folder of data files or an HF dataset "
                                       "name; none: the built-in task's held-out rows (left out, a model whose run "
                                       "trained on rows of its own is refused, naming them)")
    dataset_split: str = option("test", "split of an HF dataset or a folder; a file (or a save_to_disk folder of "
                                        "one Dataset) is read whole, under 'test' or 'train', or sliced: "
                                        "'test[:100]'")
    dataset_config: str | None = inherited("dataset_config")
    prompt_column: str = option("prompt", "column with the question: text, or chat messages")
    prompt_format: str = option("r1_zero", f"one of {PROMPT_FORMATS} (fastgrpo.train.prompts); with --checkpoint "
                                           "or a run's final/: the run's")
    reward_funcs: list[str] = option(["r1_zero_math"], "names in fastgrpo.rewards.REGISTRY, module:function or "
                                                       "path/to/file.py:function; r1_zero_math alone also fills "
                                                       "format_reward / answer_reward")
    reward_weights: list[float] | None = inherited("reward_weights")
    correct_threshold: float = option(1.0, "a completion is correct when its (weighted) reward is >= this")
    reward_errors: str = inherited("reward_errors")
    max_examples: int = option(0, "evaluate on the first N rows; 0: all")
    num_generations: int = option(1, "completions per prompt")
    max_new_tokens: int = option(1024, "tokens generated per completion at most")
    temperature: float = option(1.0, "sampling temperature; 0: greedy")
    top_p: float = inherited("top_p")
    stop: list[str] | None = option(None, "stop strings (EOS always stops); none: </answer> under the r1_zero "
                                          "prompt format or reward; with --checkpoint or a run's final/: "
                                          "the run's")
    batch_size: int = option(64, "prompts per rollout call")
    dtype: str = inherited("dtype")
    device: str = inherited("device")
    ddp_timeout: int = inherited("ddp_timeout")
    seed: int = inherited("seed")
    output_dir: str = option("fastgrpo_eval_output", "results.jsonl (one line per completion) and summary.json "
                                                     "go here")
    overwrite_output_dir: bool = option(False, "write into an output_dir that holds another evaluation's files "
                                               "(replaced once the new results are complete)")
    log_generations: int = option(3, "generations printed to the log")

    def __post_init__(self):
        coerce_fields(self)
        check_at_least(self, ("num_generations", "max_new_tokens", "batch_size"), 1)
        check_at_least(self, ("max_examples", "log_generations"), 0)
        check_scoring_options(self)
        check_choice("dtype", self.dtype, DTYPES)
        check_ddp_timeout(self)
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed: expected an int in [0, 2**32), got {self.seed}")
        if not self.output_dir.strip():  # Path("") is the current folder: the results would land among its files
            raise ValueError(f"output_dir: expected a folder path, got {self.output_dir!r}")
        if greedy_copies(self) is not None:  # vLLM refuses n > 1 with greedy sampling too
            raise ValueError(f"{greedy_copies(self)} (pass@{self.num_generations} would be pass@1); for greedy "
                             f"pass {setting('num_generations', 1)}, or a temperature > 0")
        self.sampling()

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

    @property
    def stop_strings(self) -> list[str] | None:
        return stop_strings(self.stop, self.prompt_format, self.reward_funcs)
