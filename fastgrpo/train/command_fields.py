"""Which command a setting belongs to, for the one-line error of a YAML key or flag given to another command:
`max_steps` under `fastgrpo ei` is 'a `fastgrpo train` / `fastgrpo sft` setting; ei counts rounds with ei_steps'
(a close match would name save_steps).

It sits above every command's config: GRPOConfig.from_dict cannot import the configs built on its fields (a cycle),
so the CLI checks a --config file's keys here; from Python, from_dict names the nearest field only.
"""
from __future__ import annotations

import dataclasses
import functools

from fastgrpo._checks import check_known_fields
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.config_file import read_yaml
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.naming import flag
from fastgrpo.train.sft_config import SFTConfig

CONFIGS = {"train": GRPOConfig, "sft": SFTConfig, "ei": EIConfig, "eval": EvalConfig}

# One setting under each command's own name(s): {command: (what the command does, with the fields)}. A key that is
# another command's field of a row is answered with this command's entry of the first such row.
_STEPS = ("counts optimizer steps with", ("max_steps",))
_LENGTHS = ("bounds a sequence with", ("max_prompt_length", "max_completion_length"))
_NEW_TOKENS = ("caps generated tokens with", ("max_completion_length",))
_EVAL_ROWS = ("evaluates the first N rows with", ("eval_max_examples",))
_EVAL_DATA = ("evaluates on", ("eval_dataset",))
COUNTERPARTS = (
    {"train": _STEPS, "sft": _STEPS, "ei": ("counts rounds with", ("ei_steps",))},
    {"sft": ("counts passes over the data with", ("num_epochs",)),
     "ei": ("counts passes over each round's completions with", ("sft_epochs",))},
    {"train": _LENGTHS, "ei": _LENGTHS, "sft": ("bounds prompt + response with", ("max_seq_length",))},
    {"train": _NEW_TOKENS, "ei": _NEW_TOKENS, "eval": ("caps generated tokens with", ("max_new_tokens",)),
     "sft": ("caps its evaluation's generated tokens with", ("eval_max_new_tokens",))},
    {"train": ("left-truncates long prompts with", ("truncate_prompts",)),
     "sft": ("truncates long rows with", ("truncate_sequences",))},
    {"train": _EVAL_ROWS, "sft": _EVAL_ROWS, "ei": _EVAL_ROWS, "eval": ("evaluates the first N rows with",
                                                                      ("max_examples",))},
    {"train": ("samples at", ("temperature",)), "ei": ("samples at", ("temperature",)),
     "eval": ("samples at", ("temperature",)), "sft": ("samples its evaluation at", ("eval_temperature",))},
    {"train": ("scores with", ("reward_funcs",)), "ei": ("scores with", ("reward_funcs",)),
     "eval": ("scores with", ("reward_funcs",)), "sft": ("scores its evaluation with", ("eval_reward_funcs",))},
    {"train": _EVAL_DATA, "sft": _EVAL_DATA, "ei": _EVAL_DATA, "eval": ("evaluates on", ("dataset",))},
    {"ei": ("sets the questions per rollout call with", ("generation_batch_size",)),
     "eval": ("sets the prompts per rollout call with", ("batch_size",))},
)


@functools.cache
def fields(command: str) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(CONFIGS[command]))


def elsewhere(name: str, command: str, as_flag: bool = False) -> str | None:
    """For a field `name` that `command`'s config lacks and others have: 'a `fastgrpo train` setting; ei counts
    rounds with ei_steps' (as_flag: 'a `fastgrpo train` flag; ei counts rounds with --ei-steps'); None otherwise."""
    owners = [other for other in CONFIGS if other != command and name in fields(other)]
    if name in fields(command) or not owners:
        return None
    note = f"a {' / '.join(f'`fastgrpo {owner}`' for owner in owners)} {'flag' if as_flag else 'setting'}"
    for row in COUNTERPARTS:
        if command in row and any(name in names for _, names in row.values()):
            does, names = row[command]
            return f"{note}; {command} {does} {' and '.join(flag(n) if as_flag else n for n in names)}"
    return note


def config_file_settings(command: str, path: str | None) -> dict:
    """The settings of a --config file (none: {}); a key that is no field of `command`'s config is an error, naming
    the command it belongs to where it is another's."""
    data = read_yaml(path) if path is not None else {}
    notes = {key: note for key in data if (note := elsewhere(key, command)) is not None}
    check_known_fields(data, CONFIGS[command], command, notes)
    return data
