"""Which tokens `fastgrpo sft` trains on, with a real byte-level BPE tokenizer (trained here on a few lines) and
Qwen- / Llama-3-style chat templates: the prompt is tokenized alone, as generation sees it, so a BPE merge across the
prompt/response boundary never moves the boundary (TRL tokenizes the joined text and cuts where the two diverge); the
loss covers the response and one end token: the template's end-of-turn, or the tokenizer's EOS, never two."""
from __future__ import annotations

import logging

import pytest

from fastgrpo.train.prompts import prompt_ids, response_ids
from fastgrpo.train.sft_data import collate, tokenize_rows

QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
KWARGS = dict(prompt_column="prompt", response_column="response", max_seq_length=64)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE (GPT-2 / Qwen / Llama-3 style) trained on text where " there" is one token; its pad token is
    its EOS, as Qwen's: the EOS still gets the loss (the response mask comes from the lengths, not the pad id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the answer is there, here and where: 42 4242 what is 2+2? Answer: 4"] * 50,
                                  trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|begin_of_text|>")


def _tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(list(ids))


def _trained(tokenizer, rows, prompt_format):
    """The tokens each row's loss covers (the labels where response_mask is 1), as strings."""
    examples = tokenize_rows(rows, tokenizer, prompt_format=prompt_format, truncate=False, **KWARGS)
    batch = collate(examples, tokenizer.pad_token_id, "cpu")
    return [_tokens(tokenizer, ids[mask.bool()]) for ids, mask in zip(batch["input_ids"], batch["response_mask"])]


def test_a_merge_across_the_boundary_leaves_the_prompt_as_generation_sees_it(bpe):
    prompt, response = "the answer is t", "here"
    assert bpe(prompt + response)["input_ids"][-1] == bpe.convert_tokens_to_ids("Ġthere")  # joined: one token
    assert _trained(bpe, [{"prompt": prompt, "response": response}], "raw") == [["here", "<|endoftext|>"]]
    example, = tokenize_rows([{"prompt": prompt, "response": response}], bpe, prompt_format="raw", truncate=False,
                             **KWARGS)
    assert list(example.prompt_ids) == prompt_ids(bpe, prompt, "raw") == bpe(prompt)["input_ids"]


def test_a_response_ending_with_eos_gets_it_once(bpe):
    # the EOS was appended after the one the text ends with: the model learned to say EOS twice
    assert _tokens(bpe, response_ids(bpe, "what is 2+2?", " 4<|endoftext|>", "raw")) == ["Ġ4", "<|endoftext|>"]
    assert _tokens(bpe, response_ids(bpe, "what is 2+2?", " 4", "raw")) == ["Ġ4", "<|endoftext|>"]


@pytest.mark.parametrize("template, header, trained", [
    (QWEN_TEMPLATE, "<|im_start|>assistant\n", ["<|im_end|>", "Ċ"]),
    (LLAMA3_TEMPLATE, "<|start_header_id|>assistant<|end_header_id|>\n\n", ["<|eot_id|>"]),
])
def test_a_chat_template_trains_the_assistant_content_and_its_end_of_turn(bpe, template, header, trained):
    bpe.chat_template = template
    try:
        rows = [{"prompt": "what is 2+2?", "response": "4"}]
        assert _trained(bpe, rows, "chat") == [["4", *trained]]  # not the assistant header, not a second EOS
        assert bpe.decode(prompt_ids(bpe, "what is 2+2?", "chat")).endswith(header)
    finally:
        bpe.chat_template = None


def test_truncated_rows_are_counted_in_one_warning_and_lose_their_response_end(bpe, caplog):
    # each cut row logged a line of its own: 10,000 long rows, 10,000 lines
    rows = [{"prompt": "what is 2+2?", "response": " 4" * n} for n in (1, 30, 30, 40, 30, 30, 30)]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.sft_data"):
        examples = tokenize_rows(rows, bpe, prompt_format="raw", truncate=True, **{**KWARGS, "max_seq_length": 20})
    assert [r.getMessage() for r in caplog.records] == [
        "dataset: 6 of 7 rows over max_seq_length (20) lost their response's end (truncate_sequences=True; those "
        "responses end without EOS): rows 1, 2, 3, 4, 5, ..."]
    assert [len(e) for e in examples] == [len(examples[0])] + [20] * 6
    assert examples[1].prompt_ids == examples[0].prompt_ids  # the prompt stays whole: the response's end goes
    assert examples[0].response_ids[-1] == bpe.eos_token_id != examples[1].response_ids[-1]


@pytest.mark.parametrize("eos_token, warns", [("<|endoftext|>", True), ("<|im_end|>", False)])
def test_a_template_whose_end_of_turn_generation_does_not_stop_at_is_said(bpe, tmp_path, caplog, eos_token, warns):
    # a base model's tokenizer (EOS <|endoftext|>) with a Qwen-style template: the responses trained <|im_end|>,
    # which generation does not stop at, and the run said nothing: eval then ran every answer to max_new_tokens
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.train.sft import SFTTrainer
    from fastgrpo.train.sft_config import SFTConfig

    tokenizer = bpe.__class__(tokenizer_object=bpe.backend_tokenizer, eos_token=eos_token, pad_token="<|endoftext|>",
                              chat_template=QWEN_TEMPLATE)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id))
    config = SFTConfig(prompt_format="chat", max_seq_length=64, batch_size=1, micro_batch_size=1,
                       output_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.sft"):
        SFTTrainer(model, tokenizer, [{"prompt": "what is 2+2?", "response": "4"}], config)
    expected = ("dataset: no response holds a token generation stops at ('<|endoftext|>': the tokenizer's eos_token "
                "and generation_config.json's eos_token_id), so the model will not learn to stop; where the chat "
                "template ends a turn with another token, add its id to the model folder's generation_config.json "
                "eos_token_id")
    assert [r.getMessage() for r in caplog.records if r.name == "fastgrpo.train.sft"] == ([expected] if warns else [])
