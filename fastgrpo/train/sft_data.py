"""SFT examples (prompt ids + response ids; a plain text row: its first token + the rest), the length-sorted
micro-batches of an optimizer step, and padding.

Micro-batches are length-aware by SORTING, not packing: each optimizer step takes `batch_size` rows of a seeded
shuffle of the data (so a step's contents are not biased by length), sorts them by length and cuts them into
micro-batches of neighbours, each right-padded only to its own longest row. Packing would need block-diagonal
attention (position ids per packed row), which not every attention implementation or patched forward honours;
sorting leaves a little padding (reported as `padding_frac`) and works with all of them. The loss is normalised by
the step's response tokens, so how a step is cut into micro-batches does not change its gradient.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from fastgrpo.train.input_checks import check_rows_have, close_match, dataset_columns
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import check_prompt, check_response, prompt_ids, response_ids

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SFTExample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


# TRL's SFT dataset columns, which stand in where the rows lack the default response column ("response",
# SFTConfig's): prompt / `completion` rows, conversational rows of `messages` (split_conversation) or ShareGPT's
# `conversations` (chatml), or language modelling rows of `text` (SFTTrainer's dataset_text_field), trained on every
# token
DEFAULT_RESPONSE_COLUMN = "response"
COMPLETION_COLUMN = "completion"
MESSAGES_COLUMN = "messages"
CONVERSATIONS_COLUMN = "conversations"
TEXT_COLUMN = "text"


def sft_columns(columns: list[str], prompt_column: str, response_column: str) -> tuple[str, ...]:
    """The columns that rows with `columns` are read from: (prompt, response), or one of TRL's single columns
    (messages: a conversation; text: plain text). TRL's names are taken only for the default response column, which
    the rows lack."""
    if response_column == DEFAULT_RESPONSE_COLUMN and response_column not in columns:
        if COMPLETION_COLUMN in columns and prompt_column in columns:
            return prompt_column, COMPLETION_COLUMN
        conversation = _conversation_column(columns)
        if conversation is not None:
            return (conversation,)
        if TEXT_COLUMN in columns and prompt_column not in columns:  # with a prompt, which is the response is unsaid
            return (TEXT_COLUMN,)
    for name, column in (("prompt_column", prompt_column), ("response_column", response_column)):
        if column not in columns:
            raise ValueError(f"dataset: no column {column!r} ({name}); columns: {columns}"
                             f"{close_match([column], columns)}")
    return prompt_column, response_column


def _conversation_column(columns: list[str]) -> str | None:
    """The column of TRL's conversational rows: messages, else ShareGPT's conversations; None for neither."""
    return next((c for c in (MESSAGES_COLUMN, CONVERSATIONS_COLUMN) if c in columns), None)


def chatml(messages):
    """ShareGPT's turns {"from", "value"} as chat messages {"role", "content"}, as TRL's maybe_convert_to_chatml
    renames them; other values as they are."""
    if not isinstance(messages, (list, tuple)):
        return messages
    renamed = {"from": "role", "value": "content"}
    return [{renamed.get(k, k): v for k, v in m.items()} if isinstance(m, dict) else m for m in messages]


def split_conversation(messages) -> tuple[list, object]:
    """A conversation as (prompt, response), as TRL trains on its completion: the turns before the last, and the
    content of the last, which must be the assistant's."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"messages: expected a list of chat messages {{'role': ..., 'content': ...}}, got "
                         f"{type(messages).__name__}")
    if not messages or messages[-1]["role"] != "assistant":
        got = f"a {messages[-1]['role']!r} turn" if messages else "no turns"
        raise ValueError(f"messages: expected the last turn to be the assistant's (the response trained on), got {got}")
    if len(messages) == 1:
        raise ValueError("messages: expected turns before the last assistant turn (the prompt), got only the "
                         "assistant's")
    return list(messages[:-1]), messages[-1].get("content")


def conversation_prompt(messages) -> list:
    """What a conversation is evaluated on: the turns before the last where that is the assistant's (the reference,
    as split_conversation takes it for training), else all of them."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[-1], dict) \
            and messages[-1].get("role") != "assistant":
        check_prompt(list(messages))
        return list(messages)
    return split_conversation(messages)[0]


def sft_eval_rows(rows, prompt_column: str, max_examples: int):
    """An sft run's eval rows as its dataset takes them: TRL's conversational rows (a messages or conversations
    column, no prompt column) get prompt_column, their conversation_prompt; the first max_examples (0: all) are the
    ones evaluated. Other rows are returned as they are."""
    if rows is None or len(rows) == 0:
        return rows
    columns = dataset_columns(rows)
    conversation = _conversation_column(columns)
    if prompt_column in columns or conversation is None:
        return rows
    count = min(len(rows), max_examples) if max_examples else len(rows)
    evaluated = []
    for i in range(count):
        row = dict(rows[i])
        try:
            evaluated.append({**row, prompt_column: conversation_prompt(chatml(row.get(conversation)))})
        except ValueError as err:
            raise ValueError(f"eval_dataset: row {i}: {err}") from None
    return evaluated


def completion_text(response):
    """A response as text: TRL's conversational completion, one assistant message, gives its content."""
    if isinstance(response, (list, tuple)) and len(response) == 1 and isinstance(response[0], dict) \
            and response[0].get("role") == "assistant":
        return response[0].get("content")
    return response


def sft_pairs(rows, prompt_column: str, response_column: str) -> list[tuple]:
    """Each row's (prompt, response), from the columns sft_columns picks, checked as text or chat messages (prompt)
    and text (response) without a tokenizer: the commands call this before the model loads. A text row (TRL's
    language modelling) is (None, text): no prompt, trained on all of it. A row's mistake is a ValueError naming it."""
    if rows is None or len(rows) == 0:
        raise ValueError("dataset: expected at least one row, got an empty dataset")
    needed = sft_columns(dataset_columns(rows), prompt_column, response_column)
    why = f"its {needed[0]}" if len(needed) == 1 else "the prompt and response columns"
    check_rows_have(rows, needed, "dataset", why)
    pairs = []
    for i, values in enumerate(zip(*(_column(rows, column) for column in needed))):
        try:
            pairs.append(_row_pair(values, needed))
        except ValueError as err:
            raise ValueError(f"dataset: row {i}: {err}") from None
    return pairs


def _row_pair(values: tuple, columns: tuple[str, ...]) -> tuple:
    """A row's (prompt, response) from its values of `columns` (sft_columns), checked."""
    if columns == (TEXT_COLUMN,):
        if not isinstance(values[0], str):
            raise ValueError(f"text: expected a string, got {type(values[0]).__name__}")
        return None, values[0]
    prompt, response = values if len(columns) == 2 else split_conversation(chatml(values[0]))
    response = completion_text(response)
    check_prompt(prompt)
    check_response(response)
    return prompt, response


def _column(rows, column: str):
    """A column's values: a datasets.Dataset's read at once (a row at a time is slow), a list's row by row."""
    return rows[column] if getattr(rows, "column_names", None) is not None else (row[column] for row in rows)


def tokenize_rows(rows, tokenizer, *, prompt_column: str, response_column: str, prompt_format: str,
                  max_seq_length: int, truncate: bool, warn: bool = True) -> list[SFTExample]:
    """One SFTExample per row (sft_pairs: TRL's completion and messages rows too). A row longer than max_seq_length
    is an error naming it, unless `truncate`: then its response loses its end (with a warning, when `warn`); a row
    left without response tokens is an error either way."""
    examples, cut = [], []
    for i, (prompt, response) in enumerate(sft_pairs(rows, prompt_column, response_column)):
        try:
            p, r = text_ids(tokenizer, response) if prompt is None else \
                (prompt_ids(tokenizer, prompt, prompt_format), response_ids(tokenizer, prompt, response, prompt_format))
        except ValueError as err:
            raise ValueError(f"dataset: row {i}: {err}") from None
        if len(p) + len(r) > max_seq_length:
            if not truncate:
                raise ValueError(f"dataset: row {i} has {len(p) + len(r)} tokens, over max_seq_length "
                                 f"({max_seq_length}); raise {setting('max_seq_length')} or pass "
                                 f"{setting('truncate_sequences', True)}")
            cut.append(i)
            r = r[: max(0, max_seq_length - len(p))]
        if not r:
            raise ValueError(f"dataset: row {i} has no response tokens (a {len(p)}-token prompt, "
                             f"max_seq_length {max_seq_length})")
        examples.append(SFTExample(tuple(p), tuple(r)))
    if cut and warn:  # one line for the dataset, not one per row
        logger.warning(truncation_note(cut, len(examples), max_seq_length))
    return examples


def text_ids(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """A text row's tokens (the tokenizer's special tokens, EOS appended once, as TRL's add_eos) as (prompt,
    response) ids: the first token, which no token predicts, and the rest, each trained on as TRL's language
    modelling does. prompt_format does not apply: the text is taken as written."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: needs an eos_token_id (appended to each text so the model learns to stop)")
    if ids[-1:] != [tokenizer.eos_token_id]:
        ids.append(tokenizer.eos_token_id)
    if not text or len(ids) < 2:
        raise ValueError(f"text: {text!r} has no tokens to train on")
    return ids[:1], ids[1:]


def truncation_note(cut: list[int], num_rows: int, max_seq_length: int) -> str:
    """The warning for the rows `cut` (their indices) of num_rows: how many, which (the first few)."""
    shown = ", ".join(map(str, cut[:5])) + (", ..." if len(cut) > 5 else "")
    return (f"dataset: {len(cut)} of {num_rows} rows over max_seq_length ({max_seq_length}) lost their response's end "
            f"({setting('truncate_sequences', True)}; those responses end without EOS): rows {shown}")


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    return -(-num_examples // batch_size)


def step_micro_batches(lengths: list[int], step: int, *, batch_size: int, micro_batch_size: int,
                       seed: int) -> list[list[int]]:
    """Example indices of optimizer step `step` (0-based, counted over all epochs), as micro-batches.

    Epoch e is the seeded permutation torch.randperm(n, seed + e) cut into steps of batch_size (the last step of an
    epoch may be smaller); a step's rows are sorted longest first and cut into micro-batches of micro_batch_size.
    A function of `step` alone, so a resumed run sees exactly the batches of a straight one.
    """
    n = len(lengths)
    per_epoch = steps_per_epoch(n, batch_size)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    rows = order[position * batch_size:(position + 1) * batch_size]
    rows.sort(key=lambda i: -lengths[i])
    return [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]


def process_share(micro_batches: list, rank: int, world_size: int) -> tuple[list, int]:
    """(this process's micro-batches of a step, how many of them are its own) under data parallelism: every
    world_size-th of the step's micro-batches, from the rank-th on, so each is the micro-batch one process runs and
    the processes' lengths stay alike. Every process runs the same number (DDP and FSDP2 reduce the gradients in the
    backward of each process's last one): a process left one short, which an epoch's smaller last step can do,
    repeats the step's last micro-batch, which the caller weights 0."""
    own = micro_batches[rank::world_size]
    count = -(-len(micro_batches) // world_size)
    return own + micro_batches[-1:] * (count - len(own)), len(own)


def padded_tokens(micro_batches: list[list[SFTExample]]) -> int:
    """Positions of the micro-batches as collate pads them (each to its longest example)."""
    return sum(len(batch) * max(len(e) for e in batch) for batch in micro_batches)


def collate(examples: list[SFTExample], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask and response_mask [b, L] (L: the longest example)."""
    L = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), L), dtype=torch.long)
    response_mask = torch.zeros((len(examples), L), dtype=torch.long)
    for row, e in enumerate(examples):
        p, n = len(e.prompt_ids), len(e)
        input_ids[row, :n] = torch.tensor(e.prompt_ids + e.response_ids)
        attention_mask[row, :n] = 1
        response_mask[row, p:n] = 1
    return {k: v.to(device) for k, v in
            (("input_ids", input_ids), ("attention_mask", attention_mask), ("response_mask", response_mask))}
