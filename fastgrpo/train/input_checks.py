"""Input checks before any compute: the number fields the configs share (each a ValueError naming the field), a
sampling loop's reward functions, dataset and tokenizer (GRPO and expert iteration), and whether a trainer's model
shows the config's model-loading fields."""
from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Sequence

from fastgrpo.hf.models import is_peft_model, unwrap_peft
from fastgrpo.hf.peft import peft_type_name
from fastgrpo.rewards.scoring import check_column_values, required_columns, reward_name
from fastgrpo.train.naming import setting

logger = logging.getLogger(__name__)


def check_at_least(config, names: Sequence[str], low: float) -> None:
    """Each named field >= low, a float one also finite (inf passes `>= low` and would reach the optimizer or the
    loss; nan fails it)."""
    for name in names:
        value = getattr(config, name)
        if not low <= value < math.inf:
            kind = "a finite number " if isinstance(value, float) else ""
            raise ValueError(f"{name}: expected {kind}>= {low:g}, got {value}")


def check_save_minutes(config) -> None:
    if not config.save_minutes >= 0:  # inf passes: never by time, as 0
        raise ValueError(f"save_minutes: expected >= 0, got {config.save_minutes}")


def check_lora_options(config) -> None:
    check_at_least(config, ("lora_rank",), 0)
    check_lora_target_modules(config.lora_target_modules)
    if not 0 < config.lora_alpha < math.inf:  # the adapters' scale alpha / r: 0 would leave them without effect
        raise ValueError(f"lora_alpha: expected a finite number > 0, got {config.lora_alpha}")
    if not 0 <= config.lora_dropout < 1:  # PEFT takes 1 too, where the adapter sees only zeros and never learns
        raise ValueError(f"lora_dropout: expected a number in [0, 1), got {config.lora_dropout}")


def check_lora_target_modules(targets: list[str]) -> None:
    """One or more module names, none with a comma (a module's name has none: `q_proj,v_proj` is two names run
    together, which PEFT's load would refuse as no module of the model)."""
    if not targets:
        raise ValueError("lora_target_modules: expected one or more module names (all-linear: every linear layer), "
                         "got []")
    joined = next((target for target in targets if "," in target), None)
    if joined is not None:
        spaced = " ".join(name.strip() for name in joined.split(",") if name.strip())
        raise ValueError(f"lora_target_modules: {joined!r} is no module name; names are separated by spaces, not "
                         f"commas (--lora-target-modules {spaced}; in YAML, a list: [{spaced.replace(' ', ', ')}])")


def check_adamw_options(config) -> None:
    """learning_rate, weight_decay, adam_beta1/2, adam_epsilon and max_grad_norm in the ranges torch's AdamW takes,
    finite; max_grad_norm may be inf (no clipping: clip_grad_norm_ scales by min(1, inf / norm))."""
    check_at_least(config, ("learning_rate", "weight_decay", "adam_epsilon"), 0)
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            raise ValueError(f"{name}: expected a number in [0, 1), got {getattr(config, name)}")
    if not config.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm: expected > 0 (inf: no clipping), got {config.max_grad_norm}")


def greedy_copies(config) -> str | None:
    """'temperature: 0 samples greedily: with --num-generations 8 the completions of a prompt are identical' where
    temperature 0 (greedy decoding) meets num_generations > 1; None otherwise."""
    if config.temperature != 0 or config.num_generations < 2:
        return None
    return (f"temperature: 0 samples greedily: with {setting('num_generations', config.num_generations)} the "
            "completions of a prompt are identical")


def check_reward_names(names: Sequence[str], field: str = "reward_funcs") -> None:
    """A config's reward functions, named: at least one, none blank (an empty list failed only once the data had
    loaded, at the names' resolution)."""
    if not names or not all(name.strip() for name in names):
        raise ValueError(f"{field}: expected one or more reward names (fastgrpo.rewards.REGISTRY's, module:function "
                         f"or path/to/file.py:function), got {names!r}")


def check_reward_weights(weights: Sequence[float] | None) -> None:
    if weights is not None and not all(math.isfinite(w) for w in weights):  # a nan / inf weight makes nan rewards
        raise ValueError(f"reward_weights: expected finite numbers, got {weights}")


def check_reward_count(config) -> None:
    """A command's reward_weights against its reward_funcs, as its config is built: each name resolves to one
    function, so another count was refused only once the data had loaded (check_reward_setup). Not a config's own
    check: a trainer built in Python takes its reward functions as objects, whatever config.reward_funcs names."""
    weights = getattr(config, "reward_weights", None)  # sft has none
    if weights is not None and len(weights) != len(config.reward_funcs):
        raise ValueError(f"reward_weights: expected one weight per name in reward_funcs ({len(config.reward_funcs)}), "
                         f"got {len(weights)}")


def check_eval_split(config) -> None:
    """eval_dataset_split and eval_dataset_config of a run that evaluates (eval_steps) on the built-in task's
    held-out rows (neither eval_dataset nor dataset): they have neither, and a split named was ignored (a config
    named was refused by the trainer, once the model had loaded)."""
    if not config.eval_steps or config.eval_dataset is not None or config.dataset is not None:
        return
    if config.eval_dataset_split != type(config).__dataclass_fields__["eval_dataset_split"].default:
        raise ValueError(f"eval_dataset_split: {config.eval_dataset_split!r} names a split of eval_dataset; the "
                         "built-in task (no eval_dataset) has none")
    if config.eval_dataset_config is not None:
        raise ValueError(f"eval_dataset_config: {config.eval_dataset_config!r} names a config of eval_dataset; the "
                         "built-in task (no eval_dataset) has none")


def model_positions(model) -> int | None:
    """The longest sequence the model's config allows (max_position_embeddings), None where it names none."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_lengths_before_load(config) -> None:
    """check_lengths_fit against config.model's positions as its config.json gives them (positions_before_load), so
    that a run the model cannot take stops before its weights load; the trainers check the loaded model again. The
    built-in model (none), a config.json that cannot be read (the load says why) and a command without such lengths
    (eval: a row's length is known once it is tokenized) pass."""
    if not hasattr(config, "max_seq_length") and not hasattr(config, "max_prompt_length"):
        return
    check_lengths_fit(config, positions_before_load(config.model))


def positions_before_load(model: str | None) -> int | None:
    """The max_position_embeddings of model's config.json (transformers.AutoConfig: no weights); None for the
    built-in model (none), a config that names none, or one that cannot be read (loading the model says why)."""
    if model is None:
        return None
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(model)
    except Exception:  # noqa: BLE001 - whatever it is, loading the model reports it
        return None
    return getattr(model_config, "max_position_embeddings", None)


def check_lengths_fit(config, positions: int | None) -> None:
    """The longest sequence `config` makes, within a model's `positions` (None: no bound): sft's max_seq_length, or
    max_prompt_length + max_completion_length; a ValueError naming the settings otherwise."""
    if positions is None:
        return
    if hasattr(config, "max_seq_length"):
        if config.max_seq_length > positions:
            raise ValueError(f"max_seq_length: {config.max_seq_length} exceeds the model's max_position_embeddings "
                             f"({positions})")
        return
    prompt, completion = config.max_prompt_length, config.max_completion_length
    if prompt + completion > positions:
        over = prompt + completion - positions  # name only the settings whose lowering alone makes them fit
        fixes = [f"{name} to {value - over} or less" for name, value in (("max_completion_length", completion),
                                                                          ("max_prompt_length", prompt))
                 if value > over]
        raise ValueError(f"max_prompt_length + max_completion_length ({prompt} + {completion}) exceeds the model's "
                         f"max_position_embeddings ({positions}): lower {' or '.join(fixes) or 'both'}")


def dataset_columns(dataset) -> list[str]:
    """A datasets.Dataset's columns, or those of the first row of a list of dict rows (ValueError for other data)."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if isinstance(dataset, dict) or not isinstance(dataset[0], dict):  # columns as lists, or bare prompts
        shown = type(dataset).__name__ if isinstance(dataset, dict) else f"rows such as {dataset[0]!r:.40}"
        raise ValueError(f"dataset: expected a list of dict rows ({{'prompt': ...}}) or a datasets.Dataset, got "
                         f"{shown}")
    return list(dataset[0])


def reward_list(reward_funcs) -> list:
    """A trainer's reward_funcs argument as a list: one callable or a list / tuple of them (a name is the
    commands')."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        if isinstance(func, str):
            raise ValueError(f"reward_funcs: expected a callable or a list of callables, got the name {func!r} (a name "
                             "is for the commands' --reward-funcs; fastgrpo.train.loading.resolve_reward gives its "
                             "function)")
        if not callable(func):  # None, a dict of functions (its keys would be taken), a number
            raise ValueError(f"reward_funcs: expected a callable or a list of callables, got "
                             f"{type(func).__name__}")
    return funcs


def close_match(names: Sequence[str], columns: Sequence[str]) -> str:
    """For an error about columns the rows lack: "; did you mean 'x'?" naming the column closest to the first of
    `names` (a typo, or another spelling: 'promt', 'answers'), "" when none is close."""
    matches = difflib.get_close_matches(names[0], columns, n=1) if names else []
    return f"; did you mean {matches[0]!r}?" if matches else ""


def check_rows_have(rows, needed: Sequence[str], field: str, why: str) -> None:
    """Rows given as a list (a JSONL file's) may differ from one another, a datasets.Dataset's may not: the first
    list row lacking one of `needed` is a ValueError naming it, the column and `why` every row needs it."""
    if getattr(rows, "column_names", None) is not None:
        return
    for i in range(len(rows)):
        missing = [c for c in needed if c not in rows[i]]
        if missing:
            raise ValueError(f"{field}: row {i} has no column {missing[0]!r}; row 0 has {list(rows[0])}, and every "
                             f"row needs {why}")


def check_reward_callables(reward_funcs: Sequence[Callable]) -> None:
    """Refuse what a run would call wrongly: a class (it would be constructed with the completions, failing after
    the model loaded and sampled)."""
    for func in reward_funcs:
        if isinstance(func, type):
            raise ValueError(f"reward_funcs: {func.__name__} is a class; expected a reward function or an instance "
                             f"({func.__name__}()) of a class with __call__")


def check_reward_rows(rows, prompt_column: str, reward_funcs: Sequence[Callable], field: str) -> None:
    """The reward functions (check_reward_callables) and the rows a rollout samples and scores: at least one, the
    prompt column and the columns each reward function reads in every row, and a value in every row where a reward
    needs one (the math rewards' answer): one ValueError naming `field`, the row and the column. The commands check
    this before the model loads; the trainers and build_eval_task check it again for rows given from Python."""
    if rows is None or len(rows) == 0:
        raise ValueError(f"{field}: expected at least one row, got an empty dataset")
    columns = dataset_columns(rows)
    if prompt_column not in columns:
        raise ValueError(f"{field}: no prompt column {prompt_column!r} (prompt_column); columns: {columns}"
                         f"{close_match([prompt_column], columns)}")
    check_reward_callables(reward_funcs)
    for func in reward_funcs:
        missing = [c for c in required_columns(func) if c not in columns]
        if missing:
            raise ValueError(f"{field}: reward function {reward_name(func)} needs columns {missing}, which the "
                             f"dataset lacks (columns: {columns}){close_match(missing, columns)}")
    needed = [prompt_column, *dict.fromkeys(c for func in reward_funcs for c in required_columns(func))]
    check_rows_have(rows, needed, field, "the prompt column and those the reward functions read")
    check_column_values(reward_funcs, rows, field)


def check_reward_setup(reward_funcs: Sequence[Callable], reward_weights: Sequence[float] | None) -> None:
    """One or more callables, and a weight for each where weights are given."""
    if not reward_funcs or not all(callable(f) for f in reward_funcs):
        raise ValueError(f"reward_funcs: expected one or more callables, got {reward_funcs!r}")
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(f"reward_weights: expected {len(reward_funcs)} weights (one per reward function), "
                         f"got {len(reward_weights)}")


def check_same_columns(dataset) -> None:
    """Every row of a list of dicts with row 0's columns (a datasets.Dataset's rows have them): a step's reward
    functions get each column for every completion."""
    if getattr(dataset, "column_names", None) is None:
        columns = dataset_columns(dataset)
        for i in range(len(dataset)):
            if set(dataset[i]) != set(columns):
                raise ValueError(f"dataset: row {i} has columns {sorted(dataset[i])}, row 0 has "
                                 f"{sorted(columns)}; every row needs the same columns")


def check_sampling_inputs(config, model, tokenizer, reward_funcs: Sequence[Callable], dataset) -> None:
    """Reward functions and weights, the dataset's rows and columns (the prompt column and what each reward reads,
    with the values a reward needs in every row: the math rewards' answer), the tokenizer's pad token, and prompt +
    completion lengths against the model's positions: one ValueError naming the argument. `config` has
    reward_weights, prompt_column, max_prompt_length and max_completion_length."""
    check_reward_setup(reward_funcs, config.reward_weights)
    check_reward_rows(dataset, config.prompt_column, reward_funcs, "dataset")
    check_same_columns(dataset)
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: needs a pad token (set tokenizer.pad_token)")
    check_lengths_fit(config, model_positions(model))


def warn_unapplied_model_fields(model, config) -> None:
    """The config's model-loading fields act where fastgrpo loads the model (the commands, through
    fastgrpo.train.loading.load_model_and_tokenizer); a trainer trains the model it is given as it is. A warning
    names each such field that model does not show, so that a Python caller does not take it for applied."""
    import torch

    from fastgrpo.patching.patch import SUMMARY_ATTR

    unapplied = []
    if getattr(config, "lora_rank", 0) > 0 and not is_peft_model(model):
        unapplied.append(f"lora_rank={config.lora_rank} (the model has no PEFT adapters)")
    if getattr(config, "patch", False) and getattr(unwrap_peft(model), SUMMARY_ATTR, None) is None:
        unapplied.append("patch=True (the model is not patch_model'd)")
    if getattr(config, "load_in_4bit", False) and not getattr(unwrap_peft(model), "is_loaded_in_4bit", False):
        unapplied.append("load_in_4bit=True (the model is not 4-bit)")
    dtype, weights = getattr(config, "dtype", "auto"), model.get_input_embeddings().weight.dtype
    if dtype != "auto" and weights != getattr(torch, dtype):
        unapplied.append(f"dtype={dtype!r} (the model's weights are {weights})")
    if unapplied:
        logger.warning("config: %s: these fields act where fastgrpo loads the model "
                       "(fastgrpo.train.loading.load_model_and_tokenizer, as the commands do); the trainer trains the "
                       "model it is given as it is", "; ".join(unapplied))


def warn_adapter_schedules(model) -> None:
    """A warning for an AdaLoRA adapter: its rank allocation (update_and_allocate, called by the user's loop after
    each backward) and its orthogonal regularization (added by AdaLoraModel's forward to a labels= loss) are not run by
    fastgrpo's trainers, whose losses are computed from the hidden states. It trains at its initial ranks."""
    for name, config in getattr(model, "peft_config", {}).items():
        if peft_type_name(config) == "ADALORA":
            logger.warning("model: adapter %r is AdaLoRA, whose rank allocation (update_and_allocate) and orthogonal "
                           "regularization (orth_reg_weight) fastgrpo's trainers do not run: it trains at its initial "
                           "ranks (init_r=%s), as an SVD-form LoRA", name, config.init_r)
