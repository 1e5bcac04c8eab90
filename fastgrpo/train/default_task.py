"""The built-in run of `fastgrpo train` with no arguments: a tiny model, a local tokenizer, a verifiable task.

Task "repeat the letter": a prompt such as "417 say c" asks for the letter c (one of a-d, the prompt's last
character); a completion scores the fraction of its characters that are that letter. A random model scores
~1/40 (its vocabulary is ~40 characters). GRPO first lifts the mean reward to ~0.25, the score of writing only
the letters a-d (~30 steps), then teaches it to repeat the prompt's letter: 0.69-0.97 at step 100 (seeds 0-2,
torch 2.13 on a CPU; the mean of the last 10 steps 0.74-0.78).
All of it is built here from code (no download): the tokenizer from a vocabulary, the model from a config.
"""
from __future__ import annotations

import collections
import logging
import os
import random
import string

import torch

logger = logging.getLogger(__name__)

LETTERS = "abcd"
CHARACTERS = string.ascii_lowercase + string.digits + " :"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
_KNOWN = frozenset(CHARACTERS)
# the config fields naming the columns a command tokenizes (warn_unknown_characters)
TOKENIZED_COLUMNS = ("prompt_column", "response_column")

# Config fields for the built-in model instead of GRPOConfig's defaults (which suit real models); a YAML file
# or command-line flags still override them. The reward climbs from ~0.02 to ~0.75 in the 100 steps (the module
# docstring; timings: benchmarks/NOTES.md).
PRESET = dict(
    batch_size=64,
    num_generations=8,
    micro_batch_size=32,
    max_prompt_length=16,
    max_completion_length=8,
    learning_rate=3e-3,
    max_steps=100,
    loss_type="dapo",
    dtype="float32",
    device="cpu",
    # The fused kernels are for GPUs; on the CPU their torch fallback runs this 64-wide model slower with identical
    # rewards (benchmarks/NOTES.md). `--patch` turns them on.
    patch=False,
)
# The reward of the built-in dataset, used when no --dataset is given.
REWARD_FUNCS = ["fastgrpo.train.default_task:repeat_letter_reward"]
# The built-in SFT answer: the letter SFT_REPEATS times ("417 say c" -> "cccc"), then EOS.
SFT_REPEATS = 4
# `fastgrpo sft` with no --model: SFTConfig fields for the tiny model, as PRESET is for `fastgrpo train`: three
# epochs over the 512 rows, in which the loss falls to near 0 (measured: benchmarks/NOTES.md).
SFT_PRESET = dict(
    batch_size=32,
    micro_batch_size=8,
    max_seq_length=16,
    learning_rate=3e-3,
    num_epochs=3,
    dtype="float32",
    device="cpu",
    patch=False,
    eval_max_new_tokens=8,
    eval_max_examples=64,
)
# `fastgrpo ei` with no --model. A completion is 2 characters, correct (reward 1.0) when both are the letter: the
# random model gets a few right (its tied embeddings lean to repeating the prompt's last character) and each
# round's SFT on those lifts the next round's share. With 4 characters the first rounds keep too few to learn from
# (benchmarks/NOTES.md).
EI_PRESET = dict(
    ei_steps=8,
    questions_per_step=64,
    num_generations=16,  # with 8 a letter that the first rounds miss can stay unlearned (benchmarks/NOTES.md)
    max_prompt_length=16,
    max_completion_length=2,
    sft_epochs=2,
    batch_size=32,
    micro_batch_size=32,
    learning_rate=3e-3,
    eval_max_examples=64,
    dtype="float32",
    device="cpu",
    patch=False,
)
# `fastgrpo eval` of the tiny model (no --model, or a checkpoint of a run on it).
EVAL_PRESET = dict(max_new_tokens=8, dtype="float32", device="cpu")
# What a command uses on the built-in rows (no --dataset), as REWARD_FUNCS for `fastgrpo train`.
BUILTIN_DATA = {
    "train": dict(reward_funcs=REWARD_FUNCS),
    "sft": dict(eval_reward_funcs=REWARD_FUNCS),
    "ei": dict(reward_funcs=REWARD_FUNCS, prompt_format="raw"),
    "eval": dict(reward_funcs=REWARD_FUNCS, prompt_format="raw"),
}


# how --help describes a preset's micro-batch (fit_micro_batch)
MICRO_BATCH_NOTE = "{} for the built-in model, or the largest divisor of a smaller batch"


def fit_micro_batch(preset: dict, chosen: dict, processes: int = 1) -> dict:
    """`preset` with its micro_batch_size (a memory setting for the preset's own batch) lowered to the largest divisor
    of the minibatch that `chosen` (YAML and flags) makes, of one process's share of it under torchrun (`processes`),
    unless `chosen` sets a micro-batch itself: a user's `--batch-size 16` must not fail on a micro-batch of 32 they
    never set."""
    if "micro_batch_size" in chosen or "micro_batch_size" not in preset:
        return preset
    settings = {**preset, **chosen}
    batch, minibatches = settings.get("batch_size"), settings.get("num_minibatches", 1)
    if not (isinstance(batch, int) and isinstance(minibatches, int) and 1 <= minibatches * processes <= batch):
        return preset  # the config's own checks name what is wrong
    minibatch = batch // minibatches // processes
    micro = max(d for d in range(1, min(preset["micro_batch_size"], minibatch) + 1) if minibatch % d == 0)
    return {**preset, "micro_batch_size": micro}


def build_tokenizer(characters: str = CHARACTERS):
    """A character-level tokenizer, left padding: <pad>=0, <eos>=1, <unk>=2, then one id per character (ASCII).

    A Qwen2Tokenizer (byte-level BPE, here without merges): AutoTokenizer (transformers 5) loads the tokenizer of
    any qwen2 model folder as one, whatever tokenizer_config.json names, rebuilding its byte-level pre-tokenizer
    around the saved vocabulary; so only this class reloads from an exported final/ with the ids the run trained on
    (a generic tokenizer there lost its spaces). The vocabulary holds the characters' byte-level symbols (a space is
    U+0120). A character outside `characters` has no token and is dropped, in training and after a reload alike:
    Qwen2Tokenizer's BPE has no unknown token."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    odd = [c for c in characters if not c.isascii()]
    if odd:
        raise ValueError(f"characters: expected ASCII characters (one byte-level token each), got {odd[:5]}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = tuple(byte_level.pre_tokenize_str(c)[0][0] for c in characters)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + symbols)}
    return Qwen2Tokenizer(vocab=vocab, merges=[], pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                          padding_side="left")


def warn_unknown_characters(rows, config) -> None:
    """With --dataset and no --model (nor an eval's --checkpoint) the tiny model reads the rows' prompts (and SFT's
    responses) through the built-in tokenizer, which knows CHARACTERS only: a warning naming the others, which it
    drops (build_tokenizer)."""
    if config.model is not None or getattr(config, "checkpoint", None) is not None:
        return
    columns = [getattr(config, field) for field in TOKENIZED_COLUMNS if hasattr(config, field)]
    unknown = collections.Counter()
    for row in rows:
        for column in columns:
            for text in _strings(row.get(column)):
                unknown.update(c for c in text if c not in _KNOWN)
    if unknown:
        shown = "".join(c for c, _ in unknown.most_common(10))
        logger.warning(f"no --model: the built-in tiny model's tokenizer knows only a-z, 0-9, ' ' and ':'; the "
                       f"dataset's {unknown.total()} other characters (most often {shown!r}) are dropped. Pass "
                       f"--model for a real model and its tokenizer.")


def _strings(value):
    """The strings in a row's values, inside lists and mappings too (chat messages)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def use_one_cpu_thread(device: str) -> None:
    """One torch thread for the tiny model on the CPU (`device` "auto" without a GPU too), unless OMP_NUM_THREADS
    sets the count: its 64-wide matmuls gain nothing from more, and while other processes keep the cores busy the
    threads wait for each other (benchmarks/NOTES.md). torchrun sets OMP_NUM_THREADS=1 itself."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def build_model(tokenizer, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2-architecture model (~0.1M parameters) with random weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def build_dataset(num_rows: int = 512, seed: int = 0) -> list[dict]:
    """Rows {"prompt": "417 say c", "letter": "c"}; the digits only make prompts differ."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        letter = rng.choice(LETTERS)
        noise = "".join(rng.choice(string.digits) for _ in range(3))
        rows.append({"prompt": f"{noise} say {letter}", "letter": letter})
    return rows


def repeat_letter_reward(prompts: list, completions: list[str], letter: list[str], **kwargs) -> list[float]:
    """The fraction of the completion's characters equal to the row's letter (0.0 for an empty completion)."""
    return [text.count(c) / len(text) if text else 0.0 for text, c in zip(completions, letter)]


def build_sft_dataset(num_rows: int = 512, seed: int = 0) -> list[dict]:
    """build_dataset's rows with a "response" column: the letter SFT_REPEATS times ("417 say c" -> "cccc")."""
    return [_with_response(row) for row in build_dataset(num_rows, seed)]


def build_held_out_dataset(num_rows: int = 64, seed: int = 0) -> list[dict]:
    """build_sft_dataset's columns, drawn with another seed than the training rows of `seed` (build_dataset's 512)
    and none of their prompts: another seed alone repeats ~1 in 8 of them (512 of the 4,000 prompts)."""
    trained = {row["prompt"] for row in build_dataset(seed=seed)}
    draws = random.Random(seed + 1)
    rows = []
    while len(rows) < num_rows:
        row = build_dataset(1, draws.getrandbits(64))[0]
        if row["prompt"] not in trained:
            rows.append(_with_response(row))
    return rows


def _with_response(row: dict) -> dict:
    return {**row, "response": row["letter"] * SFT_REPEATS}
