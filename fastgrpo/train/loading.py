"""Build what a command's config names: reward functions, dataset rows, the model and its tokenizer.

Shared by `fastgrpo train`, `sft`, `ei` and `eval`: the model loader reads only the model-loading fields (model,
dtype, device, lora_*, load_in_4bit, gradient_checkpointing, patch, offload_*), which every config has under the
same names.
"""
from __future__ import annotations

import types
import warnings
from pathlib import Path

import torch

from fastgrpo.hf.models import hf_checkpointing_only_first, loading_attention
from fastgrpo.offload import ActivationOffloader, HostBufferPool
from fastgrpo.patching import patch_model
from fastgrpo.rewards import REGISTRY
from fastgrpo.train import default_task
from fastgrpo.train.base_fingerprint import check_base_unchanged
from fastgrpo.train.checkpoint import STATE_FILE, latest_checkpoint, load_checkpoint, read_run_config
from fastgrpo.train.dataset_rows import DatasetReads, load_rows
from fastgrpo.train.evaluate import build_eval_task, first_rows
from fastgrpo.train.input_checks import check_reward_rows, positions_before_load
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import check_prompt, check_prompt_format
from fastgrpo.train.sft_data import COMPLETION_COLUMN, TEXT_COLUMN, sft_eval_rows, sft_pairs
from fastgrpo.train.sources import import_function, naming_the_model, resolved_dtype


def resolve_reward(name: str):
    """A name of fastgrpo.rewards.REGISTRY, or a user's reward function: "module:function" (a module.py in the
    current folder too) or "path/to/file.py:function" (fastgrpo.train.sources.import_function)."""
    if name in REGISTRY:
        return REGISTRY[name]
    if "," in name and ":" not in name:  # --reward-funcs length,ifeval
        raise ValueError(f"reward_funcs: unknown reward {name!r}; names are separated by spaces, not commas "
                         f"(--reward-funcs {name.replace(',', ' ')}; in YAML, a list: [{name.replace(',', ', ')}])")
    if ":" not in name:
        raise ValueError(f"reward_funcs: unknown reward {name!r}; expected one of {sorted(REGISTRY)}, "
                         "'module:function' or 'path/to/file.py:function'")
    return import_function(name, "reward_funcs")


def load_run_datasets(config, tokenizer, builtin=None):
    """(rows, evaluation rows) of a run that trains: load_dataset's and load_eval_dataset's (tokenizer, builtin: as
    theirs), a data source that both name read once (dataset_rows.DatasetReads), each split taken from what was read."""
    reads = DatasetReads()
    evaluated = load_eval_dataset(config, tokenizer, reads)  # first: of two bad settings, the one said before
    return load_dataset(config, builtin, tokenizer, reads), evaluated


def load_dataset(config, builtin=None, tokenizer=None, reads: DatasetReads | None = None):
    """The rows of config.dataset, or when it is None the built-in rows builtin() makes (default: the GRPO task's).
    Their prompts (and sft's responses) are checked here, before the model loads: tokenizing them would find a
    mistake after it. tokenizer: the run's, which a command loads once and hands on (tokenizer_before_load; eval's:
    the evaluated model's); None: config.model's, loaded here. reads: the run's (load_run_datasets). A run's
    evaluation rows: load_eval_dataset."""
    if tokenizer is None:
        tokenizer = tokenizer_before_load(config.model)
    return _checked_rows(config, builtin, tokenizer, reads)


def _checked_rows(config, builtin, tokenizer, reads: DatasetReads | None):
    """load_dataset's rows, their prompts (and sft's responses) checked."""
    if config.dataset is None:
        if config.dataset_config is not None:
            raise ValueError("dataset_config: names a config of dataset; the built-in task (no dataset) has none")
        if config.dataset_split != default_of(config, "dataset_split"):  # ignored, it took every built-in row
            raise ValueError(f"dataset_split: {config.dataset_split!r} names a split of dataset; the built-in task "
                             "(no dataset) has none")
        return builtin() if builtin is not None else default_task.build_dataset(seed=config.seed)
    rows = load_rows(config.dataset, config.dataset_split, config_name=config.dataset_config,
                     default_split=default_of(config, "dataset_split"), text_columns=text_columns(config), reads=reads)
    if hasattr(config, "response_column"):  # sft's: its columns (TRL's too) and every row's values
        pairs = sft_pairs(rows, config.prompt_column, config.response_column)
        prompts = [(i, prompt) for i, (prompt, _) in enumerate(pairs) if prompt is not None]  # text rows: none
    else:  # an evaluation reads only its first max_examples rows (0: all)
        prompts = prompt_values(rows, config.prompt_column, getattr(config, "max_examples", 0))
    check_prompt_formats(prompts, config, tokenizer)
    default_task.warn_unknown_characters(rows, config)
    return rows


def eval_rows(config, reads: DatasetReads | None = None):
    """The rows a run evaluates on every eval_steps (fastgrpo.train.periodic_eval): eval_dataset's (an HF dataset or
    a folder: its eval_dataset_split; for sft, TRL's conversational rows too: sft_data.sft_eval_rows), or for a run
    on the built-in task held-out rows of it; a run on its own data needs eval_dataset. Its CSV columns are read as
    text where the run's dataset's are (text_columns: sft's response too, the reference its rewards get as trained
    on), so a file both settings name is parsed once. reads: the run's (load_run_datasets)."""
    if config.eval_dataset is not None:
        rows = load_rows(config.eval_dataset, config.eval_dataset_split, field="eval_dataset",
                         config_name=eval_dataset_config(config),
                         default_split=default_of(config, "eval_dataset_split"), text_columns=text_columns(config),
                         reads=reads)
        if hasattr(config, "response_column"):  # sft's: TRL's conversations too, as its dataset
            return sft_eval_rows(rows, config.prompt_column, config.eval_max_examples)
        return rows
    if config.eval_dataset_config is not None:
        raise ValueError("eval_dataset_config: names a config of eval_dataset; the built-in task (no eval_dataset) "
                         "has none")
    if config.dataset is None:
        # none of the training rows' prompts; the built-in SFT rows carry the GRPO task's columns too
        return default_task.build_held_out_dataset(num_rows=config.eval_max_examples, seed=config.seed)
    raise ValueError("eval_dataset: eval_steps > 0 on your own dataset needs rows to evaluate on; pass "
                     f"{setting('eval_dataset')} (a .jsonl, .json, .parquet or .csv file, a folder of them or an HF "
                     "dataset name)")


def text_columns(config) -> tuple[str, ...]:
    """The columns a run reads as text: the prompt's, and sft's response (TRL's completion and text columns too)."""
    if not hasattr(config, "response_column"):
        return (config.prompt_column,)
    return config.prompt_column, config.response_column, COMPLETION_COLUMN, TEXT_COLUMN


def default_of(config, name: str):
    """The default of config's field `name` (eval's dataset_split is "test", train's "train")."""
    return type(config).__dataclass_fields__[name].default


def eval_dataset_config(config) -> str | None:
    """eval_dataset's config: eval_dataset_config, else the run's dataset_config where eval_dataset is the run's
    dataset (its test split, as TRL's scripts read one dataset_config for both splits)."""
    if config.eval_dataset_config is None and config.eval_dataset == config.dataset:
        return config.dataset_config
    return config.eval_dataset_config


def load_eval_dataset(config, tokenizer, reads: DatasetReads | None = None):
    """The rows a run evaluates on every eval_steps (eval_rows), read once, before the model loads, and checked as its
    training rows are (with its tokenizer): read inside the trainer, a wrong path, column or prompt length stopped the
    run after the model had loaded. The trainer takes them (its eval_rows) rather than read them (and ask the Hub for
    a Hub dataset) again. None where the run does not evaluate. reads: the run's (load_run_datasets)."""
    if not getattr(config, "eval_steps", 0):
        return None
    rows = eval_rows(config, reads)
    if config.eval_dataset is None and config.dataset is None:
        return rows  # the built-in task's held-out rows
    checked = first_rows(rows, config.eval_max_examples)
    names = getattr(config, "eval_reward_funcs", None) or config.reward_funcs  # sft's own, else the run's
    reward_funcs = [resolve_reward(name) for name in names]
    check_reward_rows(checked, config.prompt_column, reward_funcs, "eval_dataset")
    check_prompt_formats(prompt_values(checked, config.prompt_column, field="eval_dataset"), config, tokenizer,
                         "eval_dataset")
    # each prompt with the new tokens within the model's positions (its config.json; the built-in model's: once built)
    new_tokens = "eval_max_new_tokens" if hasattr(config, "eval_max_new_tokens") else "max_completion_length"
    build_eval_task(checked, tokenizer, prompt_column=config.prompt_column,
                    prompt_format=config.prompt_format, reward_funcs=reward_funcs,
                    max_positions=positions_before_load(config.model), max_new_tokens=getattr(config, new_tokens),
                    new_tokens_field=new_tokens)
    return rows


def prompt_values(rows, column: str, max_examples: int = 0, field: str = "dataset") -> list[tuple[int, object]]:
    """(row, prompt) of the first max_examples rows (0: all), each prompt checked (prompts.check_prompt: a null or a
    number is refused naming the row). Rows without the column are left to the commands' column checks."""
    count = len(rows) if not max_examples else min(max_examples, len(rows))
    names = getattr(rows, "column_names", None)
    if names is not None:  # a datasets.Dataset: a column is read at once, a row at a time is slow
        values = list(enumerate(rows[column][:count] if column in names else []))
    else:
        values = [(i, rows[i][column]) for i in range(count) if isinstance(rows[i], dict) and column in rows[i]]
    for i, value in values:
        try:
            check_prompt(value)
        except ValueError as err:
            raise ValueError(f"{field}: row {i}: {err}") from None
    return values


def check_prompt_formats(prompts: list[tuple[int, object]], config, tokenizer, field: str = "dataset") -> None:
    """Each (row, prompt) in config.prompt_format against the chat template of `tokenizer`, the one it will meet
    (prompts.check_prompt_format)."""
    has_template = bool(tokenizer.chat_template)
    for i, prompt in prompts:
        try:
            check_prompt_format(prompt, config.prompt_format, has_template)
        except ValueError as err:
            raise ValueError(f"{field}: row {i}: {err}") from None


def resolve_device_dtype(config) -> tuple[str, torch.dtype]:
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return device, getattr(torch, resolved_dtype(config.dtype, device))


def load_model_and_tokenizer(config, tokenizer=None):
    """The model (LoRA-wrapped, patched, checkpointed as configured) on its device, and its tokenizer: `tokenizer`
    where the caller loaded it already (tokenizer_before_load: the commands, before the model), else loaded here."""
    device, dtype = resolve_device_dtype(config)
    if tokenizer is None:
        tokenizer = tokenizer_before_load(config.model)
    if config.model is None:
        model = default_task.build_model(tokenizer, seed=config.seed).to(device=device, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        extra = {}
        if config.load_in_4bit:
            from transformers import BitsAndBytesConfig

            extra["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
            )
            extra["device_map"] = {"": device}
        attention = loading_attention(config.model)
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation=attention, **extra)
        if not config.load_in_4bit:
            model.to(device)
    if config.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its new name; the old one warns there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if config.lora_rank > 0:
        model = _with_lora(model, config)
    if config.patch:
        offload = _offload_setting(config, device)
        patch_model(model, offload_activations=offload,
                    recompute_layers=config.recompute_layers if offload is not False else None,
                    fp8_base=config.fp8_base)
    if config.gradient_checkpointing and config.recompute_layers is not None:
        hf_checkpointing_only_first(model, config.recompute_layers)
    return model, tokenizer


def tokenizer_before_load(model: str | None):
    """The tokenizer of `model` (None: the built-in model's), loaded alone (in seconds, where the model can take
    minutes) to check a run's rows before the model loads. A command loads it once and hands it to each check, the
    model's load and the trainer (a 151K-token vocabulary: ~2 s a load)."""
    if model is None:
        return default_task.build_tokenizer()
    with naming_the_model(model):
        return load_tokenizer(model)


# What a tokenizer is read from (save_pretrained's files, a sentencepiece or tiktoken model, a BPE vocabulary)
_TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")


def load_tokenizer(model: str):
    """The tokenizer of a model folder or Hub name, with a pad token; its padding_side as shipped (fastgrpo pads its
    own batches, and an export saves the tokenizer as loaded). A folder without tokenizer files is refused:
    transformers builds an empty tokenizer for some (a qwen2 config.json alone), whose prompts have no tokens, and a
    multi-line error for others."""
    from transformers import AutoTokenizer

    folder = Path(model)
    if folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in _TOKENIZER_FILES):
        raise ValueError(f"model: cannot load {model!r} from the local folder: it has no tokenizer files "
                         "(tokenizer.json, tokenizer_config.json); save the model's tokenizer there "
                         "(tokenizer.save_pretrained)")
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _with_lora(model, config):
    """The model wrapped in LoRA adapters of config's lora_* fields."""
    try:
        return lora_model(model, config)
    except ValueError as err:
        problem = lora_target_problem(model, config.lora_target_modules)
        if problem is None:
            raise
        raise ValueError(f"lora_target_modules: {problem}") from err


def lora_model(model, config, **peft_options):
    """get_peft_model of `model` and the LoraConfig of config's lora_* fields (peft_options: get_peft_model's)."""
    from peft import LoraConfig, get_peft_model

    targets = config.lora_target_modules
    outside = _linears_outside_the_decoder(model)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets[0] if targets == ["all-linear"] else targets, task_type="CAUSAL_LM",
                      **({"exclude_modules": outside} if outside else {}))
    with warnings.catch_warnings():
        # peft 0.21 reads transformers 5.24's deprecated is_gradient_checkpointing: a warning on every LoRA run that
        # its user cannot act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, lora, **peft_options)


def _linears_outside_the_decoder(model) -> list[str]:
    """Names of the linears a text run never trains: a multimodal checkpoint's vision tower and projector (Gemma-3
    4B+ loads as Gemma3ForConditionalGeneration), whose q/k/v_proj and fc layers "all-linear" or the projection
    names would give adapters that get no gradient yet cost optimizer state. The lm_head is left to the targets."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if decoder is None:
        return []
    inside = {id(module) for module in decoder.modules()}
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and id(module) not in inside and module is not head]


# What PEFT's LoRA wraps (its LoraModel._create_new_module); a bitsandbytes 4-bit linear is an nn.Linear
_LORA_WRAPPABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                   torch.nn.MultiheadAttention)


def lora_target_problem(model, targets: list[str]) -> str | None:
    """Why PEFT refused `targets`, which its message says without naming the setting or the model's layers (or in
    the repr of a whole module it cannot wrap): no module has such a name, or one it matches is no layer LoRA wraps;
    None for anything else. PEFT matches a name of the list as a module's name or the end of it after a dot."""
    from transformers.pytorch_utils import Conv1D

    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    matched = [(name, module) for name, module in model.named_modules()
               if any(name == target or name.endswith("." + target) for target in targets)]
    if not matched:
        return f"no module of the model is named {' or '.join(map(repr, targets))}; its linear layers: {linear}"
    for name, module in matched:
        if not isinstance(module, (*_LORA_WRAPPABLE, Conv1D)):
            return (f"{name} is a {type(module).__name__}, which LoRA does not wrap; name linear layers (the "
                    f"model's: {linear})")
    return None


def _offload_setting(config, device: str):
    """patch_model's offload_activations: a bool, or an offloader whose host pool is bounded as configured (on the
    CPU too, where it copies to pageable buffers: the same code path, so the bound is tested without a GPU)."""
    if config.offload_host_memory_gib is None:
        return config.offload_activations
    device = torch.device(device)
    pool = HostBufferPool(max_bytes=int(config.offload_host_memory_gib * 2**30), pin_memory=device.type == "cuda")
    return ActivationOffloader(device, pool=pool)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint-<step>/ folder of a run, or the latest one in a run's output_dir."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    if not path.exists():
        raise ValueError(f"checkpoint: no such folder {path}")
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        model = "; it is a model folder: pass it as --model" if (path / "config.json").is_file() else ""
        raise ValueError(f"checkpoint: {path} is neither a checkpoint-<step>/ folder (with {STATE_FILE}) nor an "
                         f"output_dir holding one{model}")
    return latest


def load_inference_model(*, model: str | None, dtype: str, device: str, seed: int = 0,
                         checkpoint: Path | None = None, tokenizer=None, warn_base: bool = True):
    """A model and tokenizer for evaluation: unpatched, without gradient checkpointing, in eval mode. With a
    checkpoint: the model its run trained (base and LoRA settings from the run's config) with its weights, `model`
    then being a new path of the base model (None: the saved one), or another base to put them on (with a warning
    unless warn_base is off: check_base_unchanged). tokenizer: as load_model_and_tokenizer's (that model's, loaded by
    the caller already; None: loaded here)."""
    fields = dict(model=None, lora_rank=0, lora_alpha=32, lora_dropout=0.0, lora_target_modules=["all-linear"],
                  load_in_4bit=False, seed=seed)
    if checkpoint is not None:
        saved = read_run_config(checkpoint)
        # a LoRA checkpoint on a base changed since would mix two runs
        check_base_unchanged(saved, checkpoint, model, warn=warn_base)
        fields.update({name: saved[name] for name in fields if name in saved})
    if model is not None:
        fields["model"] = model
    setup = types.SimpleNamespace(**fields, dtype=dtype, device=device, gradient_checkpointing=False, patch=False,
                                  offload_activations=False, offload_host_memory_gib=None, recompute_layers=None)
    built, tokenizer = load_model_and_tokenizer(setup, tokenizer)
    if checkpoint is not None:
        load_checkpoint(checkpoint, built)
    return built.eval(), tokenizer
