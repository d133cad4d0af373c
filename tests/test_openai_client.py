"""kvtier serve driven by the official ``openai`` Python client, streaming included."""

from __future__ import annotations

import openai
import pytest

from test_engine_support import make_config, running_server

SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite nothing, and keep the "
          "tone plain. " * 3)


@pytest.fixture(scope="module")
def client():
    with running_server(make_config()) as (service, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), service


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_models_list_names_the_served_model(client):
    api, _ = client
    assert [m.id for m in api.models.list()] == ["tiny-llama"]


def test_completion_repeated_prefix_reports_cached_tokens_and_same_text(client):
    api, _ = client
    prompt = SYSTEM + "Question one?"
    first = api.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0)
    second = api.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    by_tier = second.usage.model_extra["kvtier"]["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == cached


def test_chat_streaming_matches_non_streaming(client):
    api, _ = client
    messages = _chat("What is a page?")
    plain = api.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8,
                                        temperature=0)
    stream = api.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same chat, cached now


def test_completion_streaming_yields_text_pieces(client):
    api, _ = client
    stream = api.completions.create(model="tiny-llama", prompt="Once", max_tokens=5,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) >= 2 and "".join(pieces)


def test_cache_salt_isolates_tenants(client):
    api, _ = client
    messages = _chat("Which tenant am I?")
    api.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                temperature=0, extra_body={"cache_salt": "tenant-a"})
    same = api.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                       temperature=0, extra_body={"cache_salt": "tenant-a"})
    other = api.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2,
                                        temperature=0, extra_body={"cache_salt": "tenant-b"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_client_errors_surface_as_openai_exceptions(client):
    api, _ = client
    with pytest.raises(openai.NotFoundError, match="not served here"):
        api.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        api.chat.completions.create(model="tiny-llama", messages=_chat("x"), n=2)


def test_seeded_sampling_repeats_through_the_api(client):
    api, _ = client
    args = {"model": "tiny-llama", "prompt": "Say", "max_tokens": 6, "temperature": 0.9,
            "seed": 1234}
    first = api.completions.create(**args).choices[0].text
    assert api.completions.create(**args).choices[0].text == first
