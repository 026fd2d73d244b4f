"""The real ``openai`` client against the server (FakeEngine): shapes parse, errors map."""

from __future__ import annotations

import openai
import pytest
from fake_engine import TEXT
from server_utils import Harness, bounded


def make_client(harness: Harness) -> openai.AsyncOpenAI:
    base_url = str(harness.client.make_url("/v1"))
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10)


@bounded(20)
async def test_openai_client_round_trips(harness: Harness) -> None:
    client = make_client(harness)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]

    completion = await client.completions.create(
        model="fake-model", prompt="abc", max_tokens=5, temperature=0
    )
    assert completion.choices[0].text == TEXT[:5] and completion.usage.completion_tokens == 5

    chat = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        temperature=0,
    )  # fmt: skip
    assert [c.message.content for c in chat.choices] == [TEXT[:4], TEXT[:4]]
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8

    stream = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TEXT[:6] and chunks[-1].usage.total_tokens > 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    stream = await client.completions.create(
        model="fake-model", prompt="abc", max_tokens=7, temperature=0, stream=True, stop=["fox"]
    )
    assert "".join([c.choices[0].text async for c in stream]) == TEXT[:7]
    await client.close()


@bounded(20)
async def test_openai_client_errors(harness: Harness) -> None:
    client = make_client(harness)
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="fake-model", prompt="x", temperature=5)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.completions.create(model="nope", prompt="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "a" * 600}]
        )
    assert too_long.value.param == "messages" and "max_model_len" in too_long.value.message
    await client.close()
