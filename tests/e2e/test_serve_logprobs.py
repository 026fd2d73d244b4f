"""Log-probabilities, echo and batched prompts over HTTP against the REAL engine (SmolLM2,
CPU, fp32, a ``verifypd serve`` subprocess), checked against transformers' logits: what
lm-evaluation-harness's loglikelihood requests send and read, completions and chat log-probs
streamed and not, and several prompts in one request."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))

from server_utils import (  # noqa: E402
    ServerProcess,
    bounded,
    parse_sse,
    start_server_process,
    verifypd_serve_command,
)

pytestmark = pytest.mark.slow

TOL = 1e-3
MAX_LOGPROBS = 5
TIMEOUT = aiohttp.ClientTimeout(total=120)
TEXTS = ["The capital of France is Paris", "Water boils at one hundred degrees"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = ("--model", "default", "--device", "cpu", "--max-model-len", "256",
            "--max-logprobs", str(MAX_LOGPROBS))  # fmt: skip
    with start_server_process(verifypd_serve_command(*args), timeout=240) as proc:
        yield proc
        assert proc.stop(timeout=30) == 0


@pytest.fixture(scope="module")
def tok():
    from verifypd.engine.tokenizer import load_tokenizer

    return load_tokenizer("default")


@torch.inference_mode()
def _hf_logp(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is log_softmax of transformers' logits after ids[: i + 1]."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def _hf_greedy(model, ids: list[int], num_new: int) -> list[int]:
    ids = list(ids)
    for _ in range(num_new):
        ids.append(int(_hf_logp(model, ids)[-1].argmax()))
    return ids


async def _post(server: ServerProcess, path: str, payload: dict) -> tuple[int, dict | list]:
    async with aiohttp.ClientSession(server.url, timeout=TIMEOUT) as session:
        async with session.post(path, json=payload) as resp:
            if payload.get("stream"):
                return resp.status, parse_sse(await resp.text())[:-1]
            return resp.status, await resp.json()


def _assert_same_chat_logprobs(got: list[dict], want: list[dict]) -> None:
    """Tokens and bytes identical, log-probs equal up to fp32 rounding: the second request of a
    prompt reuses its prefix-cached KV, so its prefill runs other shapes (on some CPUs the
    values then differ in the sixth digit)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a["token"], a["bytes"]) == (b["token"], b["bytes"])
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert [t["logprob"] for t in a["top_logprobs"]] == pytest.approx(
            [t["logprob"] for t in b["top_logprobs"]], abs=1e-4
        )


def _assert_completion_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, tok, first: int):
    """``lp`` scores ``ids[first:]`` (``first`` = 0: the first is a prompt's first, null)."""
    n = len(ids) - first
    assert {len(values) for values in lp.values()} == {n}
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    offset = lp["text_offset"][0]
    for k, token_id in enumerate(ids[first:], start=first):
        j = k - first
        token = tok.decode([token_id], skip_special_tokens=False)
        assert lp["tokens"][j] == token and lp["text_offset"][j] == offset
        offset += len(token)
        if k == 0:
            assert lp["token_logprobs"][j] is None and lp["top_logprobs"][j] is None
            continue
        row = ref[k - 1]
        assert abs(lp["token_logprobs"][j] - float(row[token_id])) <= TOL
        top = lp["top_logprobs"][j]
        assert top[token] == lp["token_logprobs"][j]
        # lm-eval's greedy test: the token is the argmax iff its log-prob is the top one.
        is_greedy = lp["token_logprobs"][j] == max(top.values())
        if int(row.argmax()) == token_id:
            assert is_greedy
        elif float(row.max() - row[token_id]) > TOL:
            assert not is_greedy
        assert abs(max(top.values()) - float(row.max())) <= TOL


@bounded(180)
async def test_lm_eval_loglikelihood_request(server, tok, hf_smollm) -> None:
    """Token-id prompts, echo, logprobs 1, max_tokens 0: the prompts scored, nothing generated."""
    prompts = [tok.encode(t) for t in TEXTS]
    payload = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    status, body = await _post(server, "/v1/completions", payload)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, choice in zip(prompts, body["choices"], strict=True):
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False)
        assert choice["finish_reason"] == "length"
        _assert_completion_logprobs(choice["logprobs"], ids, _hf_logp(hf_smollm, ids), tok, 0)
        assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


@bounded(180)
async def test_completion_logprobs_stream_and_not(server, tok, hf_smollm) -> None:
    prompt_ids = tok.encode(TEXTS[0])
    ids = _hf_greedy(hf_smollm, prompt_ids, 6)
    ref = _hf_logp(hf_smollm, ids)
    payload = {"prompt": TEXTS[0], "max_tokens": 6, "logprobs": 3, "temperature": 0}
    status, body = await _post(server, "/v1/completions", payload)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    _assert_completion_logprobs(lp, ids, ref, tok, len(prompt_ids))
    assert lp["text_offset"][0] == 0 and all(len(t) == 3 for t in lp["top_logprobs"])
    status, chunks = await _post(server, "/v1/completions", {**payload, "stream": True})
    streamed = {k: [] for k in lp}
    for chunk in chunks:
        for key, values in (chunk["choices"][0]["logprobs"] or {}).items():
            streamed[key] += values
    assert streamed == lp
    # Echo with generation: the prompt's tokens first (the very first null), then the output.
    status, echoed = await _post(server, "/v1/completions", {**payload, "echo": True})
    choice = echoed["choices"][0]
    assert choice["text"] == TEXTS[0] + body["choices"][0]["text"]
    _assert_completion_logprobs(choice["logprobs"], ids, ref, tok, 0)


@bounded(180)
async def test_chat_logprobs_stream_and_not(server, tok, hf_smollm) -> None:
    text = tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    ids = _hf_greedy(hf_smollm, prompt_ids, 5)
    ref = _hf_logp(hf_smollm, ids)
    payload = {"messages": FRANCE, "max_tokens": 5, "temperature": 0, "logprobs": True,
               "top_logprobs": 2}  # fmt: skip
    status, body = await _post(server, "/v1/chat/completions", payload)
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry, k in zip(content, range(len(prompt_ids), len(ids)), strict=True):
        row = ref[k - 1]
        assert entry["token"] == tok.decode([ids[k]], skip_special_tokens=False)
        assert entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - float(row[ids[k]])) <= TOL
        values, top_ids = row.topk(2)
        got = [t["logprob"] for t in entry["top_logprobs"]]
        assert got == pytest.approx(values.tolist(), abs=TOL)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            tok.decode([i], skip_special_tokens=False) for i in top_ids.tolist()
        ]
    status, chunks = await _post(server, "/v1/chat/completions", {**payload, "stream": True})
    streamed = []
    for chunk in chunks:
        streamed += (chunk["choices"][0]["logprobs"] or {}).get("content") or []
    _assert_same_chat_logprobs(streamed, content)
    no_logprobs = {**payload, "logprobs": False, "top_logprobs": 0}
    status, plain = await _post(server, "/v1/chat/completions", no_logprobs)
    assert plain["choices"][0]["logprobs"] is None


@bounded(180)
async def test_batched_prompts_equal_separate_requests(server) -> None:
    payload = {"prompt": TEXTS + ["1, 2, 3,"], "max_tokens": 5, "temperature": 0, "n": 2}
    status, body = await _post(server, "/v1/completions", payload)
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, prompt in enumerate(payload["prompt"]):
        _, alone = await _post(server, "/v1/completions", {**payload, "prompt": prompt})
        for c in range(2):
            assert body["choices"][2 * i + c]["text"] == alone["choices"][c]["text"]


@bounded(120)
async def test_limits_and_bad_token_ids_are_400(server, tok) -> None:
    cases = [
        ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True,
                                  "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
        ("/v1/completions", {"prompt": [[1, 2], [10**6]], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [10**6]], "echo": True, "max_tokens": 0},
         "prompt"),
    ]  # fmt: skip
    for path, payload, param in cases:
        status, body = await _post(server, path, payload)
        assert status == 400 and body["error"]["param"] == param, body
    ok = {"prompt": [[1, 2], [3]], "logprobs": MAX_LOGPROBS, "max_tokens": 1}
    status, body = await _post(server, "/v1/completions", ok)
    assert status == 200 and len(body["choices"]) == 2
