"""Stop strings with a SentencePiece (Metaspace) tokenizer: matched where vLLM and HF generate match them.

Such a tokenizer drops the leading space of the first token it decodes ("▁hello" alone reads "hello"). The engine
looked for stop strings in a completion decoded alone, so a string that starts with a space never matched at a
completion's first token, where vLLM (its incremental detokenizer reads the completion after the prompt's last
tokens) and HF's StopStringCriteria ("▁" read as a space) both stop. The tokenizers here are built locally: a Unigram
model with Metaspace pre-tokenizer and decoder (Mistral style) or with Llama-2's normalizer and decoder (Replace,
ByteFallback, Fuse, Strip). The reference for vLLM's text is the `tokenizers` DecodeStream that vLLM's v1
FastIncrementalDetokenizer runs, primed with the prompt's last 4 tokens (vLLM takes more when those 4 decode to a
broken character; not met here). Not run against vLLM itself here (CPU only).
"""
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from fastgrpo.rollout import generate
from fastgrpo.rollout.stops import StopStrings
from tests.test_rollout import SIZES, completions

PAD, EOS, UNK, BOS = 0, 1, 2, 3
WORDS = "abcdefghijklmnop"  # "▁a".."▁p" start words; "a".."h" continue them
PROMPTS = ["say hello", "a b c", "hello world abc"]


def sentencepiece_tokenizer(style: str):
    """A Unigram tokenizer whose pieces mark a word's start with "▁"; <pad> 0, <eos> 1, <unk> 2, <s> 3 (special).

    style "metaspace": Metaspace pre-tokenizer and decoder (prepend_scheme "first"); "llama2": Llama-2's
    tokenizer.json (a normalizer prepends "▁" and turns spaces into it; the decoder strips one leading space)."""
    pieces = [("<pad>", 0.0), ("<eos>", 0.0), ("<unk>", 0.0), ("<s>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + c, -1.0) for c in WORDS] + [(c, -2.0) for c in WORDS[:8]]
    pieces += [("▁hello", -0.5), ("▁world", -0.5)]
    backend = Tokenizer(models.Unigram(pieces, unk_id=UNK))
    if style == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(Regex(" "), "▁")])
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<s>", padding_side="left")


TOKENIZERS = {style: sentencepiece_tokenizer(style) for style in ("metaspace", "llama2")}


def tiny_llama(vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**SIZES, "vocab_size": vocab_size})).eval()


def pieces_text(tok, ids: list[int]) -> str:
    """ids read as SentencePiece pieces, "▁" a space (how HF's StopStringCriteria reads them)."""
    return "".join(tok.convert_ids_to_tokens(ids)).replace("▁", " ")


def hf_stopped(model, tok, prompt: str, stop: str, max_new_tokens: int) -> list[int]:
    """HF generate's greedy completion of one prompt with stop_strings=[stop], up to its EOS."""
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=EOS, pad_token_id=PAD, stop_strings=[stop], tokenizer=tok)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def vllm_texts(tok, prompt: list[int], ids: list[int]) -> list[str]:
    """vLLM's text of ids[:1], ids[:2], ...: a DecodeStream primed with the prompt's last 4 tokens (special tokens
    skipped), its chunks joined."""
    stream, text, texts = DecodeStream(skip_special_tokens=True), "", []
    for token in prompt[-4:]:
        stream.step(tok.backend_tokenizer, token)
    for token in ids:
        text += stream.step(tok.backend_tokenizer, token) or ""
        texts.append(text)
    return texts


def vllm_text(tok, prompt: list[int], ids: list[int]) -> str:
    return vllm_texts(tok, prompt, ids)[-1]


def vllm_cut(tok, prompt: list[int], ids: list[int], strings: list[str]) -> int | None:
    """Tokens of `ids` up to the one whose text completes a stop string in vLLM's text; None when none does."""
    return next((n for n, text in enumerate(vllm_texts(tok, prompt, ids), 1) if any(s in text for s in strings)), None)


@pytest.mark.parametrize("style", ["metaspace", "llama2"])
@pytest.mark.parametrize("row, k", [(0, 0), (2, 3)], ids=["first-token", "later-token"])
def test_a_stop_string_with_a_leading_space_stops_where_hf_generate_stops(style, row, k):
    """Tokens k, k+1 of a row's greedy completion, both starting a word, read as pieces (" world p"): every row stops
    where HF generate(stop_strings=...) stops. At the first token (k = 0) the engine found nothing (the completion
    decoded alone starts "world p") and ran on; at a later one it stopped already."""
    tok = sentencepiece_tokenizer(style)
    model = tiny_llama(len(tok))
    free = completions(generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0))
    pieces = tok.convert_ids_to_tokens(free[row][k:k + 2])
    assert all(p.startswith("▁") for p in pieces), pieces
    stop = pieces_text(tok, free[row][k:k + 2])
    assert k > 0 or stop not in tok.decode(free[row][:2], skip_special_tokens=True)
    got = generate(model, tok, PROMPTS, max_new_tokens=12, temperature=0, stop=stop)
    assert completions(got)[row] == free[row][:k + 2] and got.finish_reasons[row] == "stop", (stop, completions(got))
    for r, prompt in enumerate(PROMPTS):
        assert completions(got)[r] == hf_stopped(model, tok, prompt, stop, 12), (r, stop)
    # the returned text is the kept ids' decode: at the first token it lacks the space the search saw
    assert got.texts[row] == tok.decode(free[row][:k + 2], skip_special_tokens=True)


def test_the_text_searched_is_the_completion_after_its_prompt():
    """StopStrings' text for ids after a context is vLLM's DecodeStream text: for a SentencePiece tokenizer the
    leading space kept after a prompt of text, dropped after special tokens alone (they decode to nothing); for a
    byte-level one the ids decoded alone, as before."""
    from fastgrpo.train.default_task import build_tokenizer

    for style, tok in [*TOKENIZERS.items(), ("byte-level", build_tokenizer())]:
        stops = StopStrings(tok, [" "], check_every=4, prompts=[], num_generations=1)
        prompt = tok("say hello", add_special_tokens=False)["input_ids"]
        ids = tok(" a b hello", add_special_tokens=False)["input_ids"]
        alone = tok.decode(ids, skip_special_tokens=True)
        for context in (prompt, [EOS], [EOS] * 5 + prompt[-1:]):  # <eos>: special in all three
            text = stops.text_after(context, ids)
            assert text == vllm_text(tok, context, ids), (style, context)
            spoken = context != [EOS]  # a context of text
            assert text == (" " + alone if spoken and style != "byte-level" else alone), (style, context, text)


def assert_found_where_vllm_finds(tok, prompt: list[int], ids: list[int], stop: str, check_every: int) -> None:
    """cut() returns the token where vLLM's text (ids read after prompt) first holds `stop`, and running_hits at the
    engine's syncs (every check_every tokens) first reports the row at the first sync at or after it."""
    stops = StopStrings(tok, [stop], check_every, [prompt], num_generations=1)
    want = vllm_cut(tok, prompt, ids, [stop])
    assert want is not None and stops.cut(ids, 0) == want, (stop, ids)
    tokens = torch.tensor([ids])
    syncs = range(check_every, len(ids) + check_every, check_every)
    hit = next(s for s in syncs if stops.running_hits(tokens[:, :s], [0], [0]))
    assert hit == -(-want // check_every) * check_every, (stop, ids, hit, want)


def test_a_byte_level_tokenizers_stops_are_unchanged():
    """The built-in task's byte-level tokenizer reads a completion alike alone and after its prompt: cut() finds
    the string where a search in the decode alone (the engine's rule before) finds it."""
    from fastgrpo.train.default_task import build_tokenizer

    tok = build_tokenizer()
    prompt = tok("say hello", add_special_tokens=False)["input_ids"]
    ids = tok(" a b hello world", add_special_tokens=False)["input_ids"]
    for stop in (" a", "b h", " world", "lo w"):
        stops = StopStrings(tok, [stop], check_every=4, prompts=[prompt], num_generations=1)
        alone = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
        assert stops.cut(ids, 0) == alone, stop


@given(style=st.sampled_from(list(TOKENIZERS)), after_text=st.booleans(),
       ids=st.lists(st.integers(0, len(TOKENIZERS["llama2"]) - 1), min_size=1, max_size=40),
       check_every=st.integers(1, 8), start=st.integers(0, 200), length=st.integers(1, 6))
def test_the_engines_checks_find_a_string_at_the_first_sync_after_vllm_would(style, after_text, ids, check_every,
                                                                            start, length):
    """running_hits at the engine's syncs (every check_every tokens, each seeing a window of the recent tokens read
    after the few before it) first reports a row at the first sync at or after the token where vLLM's text holds the
    string, whether it starts at the first token or later (special tokens among the ids, skipped); cut() returns
    that token."""
    tok = TOKENIZERS[style]
    prompt = tok("say hello", add_special_tokens=False)["input_ids"] if after_text else [BOS]
    text = vllm_text(tok, prompt, ids)
    assume(text)  # e.g. special tokens alone
    assert_found_where_vllm_finds(tok, prompt, ids, text[start % len(text):][:length], check_every)


def byte_tokenizer():
    """A byte-level BPE without merges: every UTF-8 byte its own token (<eos> 0, special), so "é" is 2 tokens and
    "😀" 4; a window or a context may end inside a character."""
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")


def test_a_character_split_between_the_context_and_the_ids_belongs_to_the_ids_text():
    """A context ending inside a character decodes to U+FFFD there; the whole character is the ids' text (as vLLM's
    DecodeStream gives it), neither the context's text nor a character short."""
    tok = byte_tokenizer()
    ids = tok("abcd\u00e9wxyz\U0001F600ef", add_special_tokens=False)["input_ids"]  # é: ids 4-5, 😀: 10-13
    stops = StopStrings(tok, ["a"], check_every=1, prompts=[], num_generations=1)
    for split in (5, 11, 12, 13):  # inside é; 1, 2, 3 bytes into 😀 (the last 4 tokens, vLLM's, start a character)
        context, rest = ids[:split], ids[split:]
        text = stops.text_after(context, rest)
        assert text == vllm_text(tok, context, rest), (split, text)
        assert text == tok.decode(ids)[len(tok.decode(ids[:split]).rstrip("\ufffd")):], (split, text)


@pytest.mark.parametrize("style", list(TOKENIZERS))
@pytest.mark.parametrize("specials", [1, 3, 4, 6])
def test_the_context_is_the_prompts_last_4_tokens_special_ones_too(style, specials):
    """A prompt of text then special tokens (a chat template's turn markers): vLLM reads the completion after the
    prompt's last 4 tokens, so a string with a leading space matches at the first token while text is among them
    (1 or 3 specials) and not once they are all special (4 or 6): cut() and the engine's check agree with it."""
    tok = TOKENIZERS[style]
    prompt = tok("say hello", add_special_tokens=False)["input_ids"] + [EOS] * specials
    ids = tok.convert_tokens_to_ids(["▁world", "▁a", "▁b"])
    want = vllm_cut(tok, prompt, ids, [" world"])
    assert want == (1 if specials < 4 else None), want
    stops = StopStrings(tok, [" world"], check_every=4, prompts=[prompt], num_generations=1)
    assert stops.cut(ids, 0) == want
    assert stops.running_hits(torch.tensor([ids]), [0], [0]) == ([0] if want else [])


@given(text=st.text(alphabet="ab \u00e9\U0001F600", min_size=1, max_size=12), check_every=st.integers(1, 4),
       start=st.integers(0, 100), length=st.integers(1, 3))
def test_a_string_of_multibyte_characters_is_found_at_the_first_sync_after_vllm_would(text, check_every, start,
                                                                                       length):
    """Byte tokens: a character spans up to 4 tokens, so a window must reach 4 tokens a character back for the string
    completed since the last sync, and a window may start inside a character (read after the context's bytes)."""
    tok = byte_tokenizer()
    prompt, ids = tok("x", add_special_tokens=False)["input_ids"], tok(text, add_special_tokens=False)["input_ids"]
    assert_found_where_vllm_finds(tok, prompt, ids, text[start % len(text):][:length], check_every)
