"""Detokenization, stop strings, chat formatting and sampling."""

from __future__ import annotations

import functools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.presets import resolve_model
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.text import Detokenizer, StopMatcher, chat_prompt_ids, encode_prompt


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from kvtier.engine.hf import load_tokenizer

    return load_tokenizer(resolve_model("tiny-llama"))


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_streamed_text_equals_decoding_everything_at_once(text):
    tok = _tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=True)


def test_partial_multibyte_character_waits_for_its_last_byte():
    tok = _tokenizer()
    ids = tok("€", add_special_tokens=False)["input_ids"]  # byte-level: several tokens
    detok = Detokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert pieces[-1] == "€" and all(p == "" for p in pieces[:-1])


def _cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab\n", max_size=4), max_size=12),
       st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_matcher_cuts_at_the_first_stop_string_whatever_the_chunking(chunks, stops):
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(c) for c in chunks) + matcher.flush()
    text = "".join(chunks)
    assert out == _cut(text, stops)
    assert matcher.stopped == any(s in text for s in stops)


def test_a_stop_that_starts_earlier_wins_even_when_a_later_one_completes_first():
    matcher = StopMatcher(["b", "\nbb"])
    assert [matcher.feed(c) for c in ("\n", "b")] == ["", ""]  # "\nbb" may still come
    assert not matcher.stopped
    assert matcher.feed("b") == "" and matcher.stopped
    other = StopMatcher(["b", "\nbb"])
    assert other.feed("\n") + other.feed("b") + other.feed("a") == "\n" and other.stopped
    ended = StopMatcher(["b", "\nbb"])
    assert ended.feed("\nb") == "" and not ended.stopped
    assert ended.flush() == "\n" and ended.stopped  # the stream ended: "b" was the stop


def test_chat_prompt_uses_the_tokenizers_template_and_ends_at_the_answer():
    tok = _tokenizer()
    ids = chat_prompt_ids(tok, [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello"}])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_completion_prompt_starts_with_bos():
    tok = _tokenizer()
    assert encode_prompt(tok, "hi")[0] == tok.bos_token_id


def test_greedy_is_argmax_and_seeded_sampling_repeats():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    assert Sampler(SamplingParams())(logits) == int(torch.argmax(logits))
    params = SamplingParams(temperature=1.0, seed=7)
    first = [Sampler(params)(logits) for _ in range(3)]
    sampler_a, sampler_b = Sampler(params), Sampler(params)
    assert [sampler_a(logits) for _ in range(20)] == [sampler_b(logits) for _ in range(20)]
    assert len(set(first)) == 1


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([5.0, 4.9, -10.0, -10.0, -10.0])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=1))
    assert {sampler(logits) for _ in range(50)} == {0}
