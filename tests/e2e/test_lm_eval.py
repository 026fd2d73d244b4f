"""lm-evaluation-harness end to end: its ``local-completions`` model against ``verifypd serve``
on the embedded model, offline, with ``batch_size=4`` and ``tokenized_requests=True``.

Two custom local tasks (YAML + a JSON-lines dataset written to tmp_path; no hub access): a
multiple-choice task (log-likelihoods through ``echo`` + ``logprobs``) and a generation task.
Every number lm-eval gets is checked against transformers on the same GGUF weights.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))

from server_utils import ServerProcess, start_server_process, verifypd_serve_command  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
BATCH_SIZE = 4
LOGPROB_TOLERANCE = 2e-3  # fp32 on CPU: ours vs transformers, summed over a few tokens
MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four", "ten"], "answer": 1},
    {"question": "The sky on a clear day is", "choices": ["green", "loud", "blue"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": "Q: What is 2 + 2?\nA:", "answer": " 4"},
    {"question": "Q: What color is the sky?\nA:", "answer": " Blue"},
    {"question": "Q: Name a fruit.\nA:", "answer": " Apple"},
]
MAX_GEN_TOKS = 8
MC_TASK = """task: verifypd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """task: verifypd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def offline() -> Iterator[None]:
    """No hub: lm-eval, datasets and transformers read these when first imported."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    yield
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def server(offline: None) -> Iterator[ServerProcess]:
    cmd = verifypd_serve_command(
        "--model", "default", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)
    )
    with start_server_process(cmd, timeout=180) as proc:
        yield proc
        assert proc.stop(timeout=30) == 0


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from verifypd.engine.loader import find_default_gguf
    from verifypd.engine.tokenizer import tokenizer_cache_dir

    path = tokenizer_cache_dir(find_default_gguf())
    assert (path / "tokenizer.json").is_file()  # written when the server loaded the model
    return str(path)


class RecordingLM:
    """lm-eval's LocalCompletionsAPI, recording every payload it sends."""

    @staticmethod
    def create(server: ServerProcess, tokenizer_dir: str) -> object:
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        class Recording(LocalCompletionsAPI):
            payloads: list[dict] = []

            def _create_payload(self, *args, **kwargs) -> dict:
                payload = super()._create_payload(*args, **kwargs)
                self.payloads.append(payload)
                return payload

        return Recording(
            base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=tokenizer_dir,
            tokenizer_backend="huggingface", tokenized_requests=True, batch_size=BATCH_SIZE,
            max_length=MAX_MODEL_LEN, max_retries=1,
        )  # fmt: skip


def write_task(root: Path, template: str, docs: list[dict]) -> None:
    data = root / f"{len(docs)}_{abs(hash(template))}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    name = template.split("\n", 1)[0].removeprefix("task: ")
    text = template.format(data=data, max_gen_toks=MAX_GEN_TOKS)
    (root / f"{name}.yaml").write_text(text)


def run_task(
    server: ServerProcess, tokenizer_dir: str, root: Path, template: str, docs: list[dict]
) -> tuple[object, dict, list[dict]]:
    """Write the task, evaluate it; returns the LM, the results and the samples by doc."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    write_task(root, template, docs)
    task = template.split("\n", 1)[0].removeprefix("task: ")
    lm = RecordingLM.create(server, tokenizer_dir)
    manager = TaskManager(include_path=str(root))
    results = simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return lm, results["results"][task], samples


def assert_batched(payloads: list[dict]) -> None:
    """lm-eval sent several token-id prompts per request (batch_size=4, tokenized)."""
    assert max(len(p["prompt"]) for p in payloads) == BATCH_SIZE
    for payload in payloads:
        assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                   for ids in payload["prompt"])  # fmt: skip


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = logprobs[len(context) - 1 : -1]
    return float(rows[torch.arange(len(continuation)), torch.tensor(continuation)].sum())


def test_multiple_choice_task(server, tokenizer_dir, hf_smollm, tmp_path: Path) -> None:
    lm, results, samples = run_task(server, tokenizer_dir, tmp_path, MC_TASK, MC_DOCS)
    num_correct = 0
    for doc, sample in zip(MC_DOCS, samples, strict=True):
        expected = []
        for (context, continuation), [(ll, _)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            assert continuation == " " + doc["choices"][len(expected)]
            expected.append(hf_loglikelihood(hf_smollm, *lm._encode_pair(context, continuation)))
            assert ll == pytest.approx(expected[-1], abs=LOGPROB_TOLERANCE)
        num_correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert results["acc,none"] == num_correct / len(MC_DOCS)
    assert_batched(lm.payloads)
    assert all(p["echo"] and p["logprobs"] == 1 for p in lm.payloads)


def test_generation_task(server, tokenizer_dir, hf_smollm, tmp_path: Path) -> None:
    lm, results, samples = run_task(server, tokenizer_dir, tmp_path, GEN_TASK, GEN_DOCS)
    num_exact = 0
    for doc, sample in zip(GEN_DOCS, samples, strict=True):
        [[text]] = sample["resps"]
        ids = lm.tok_encode(doc["question"], add_special_tokens=False)
        with torch.no_grad():
            out = hf_smollm.generate(
                torch.tensor([ids]), max_new_tokens=MAX_GEN_TOKS, do_sample=False
            )
        expected = lm.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert text == expected.split("\n")[0], (doc, text, expected)
        num_exact += text.strip() == doc["answer"].strip()
    assert results["exact_match,none"] == num_exact / len(GEN_DOCS)
    assert_batched(lm.payloads)


def test_remote_tokenizer_backend(server, tokenizer_dir) -> None:
    """lm-eval's ``remote`` backend (vLLM's /tokenizer_info, /tokenize, /detokenize) agrees
    with the local tokenizer files."""
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    from transformers import AutoTokenizer

    assert check_remote_tokenizer_support(server.url)
    remote, local = RemoteTokenizer(server.url), AutoTokenizer.from_pretrained(tokenizer_dir)
    text = "Hello, world! Ünïcödé and numbers 12345."
    ids = remote.encode(text)
    assert ids == local.encode(text, add_special_tokens=False)
    assert remote.decode(ids) == text
    assert remote.eos_token_id == local.eos_token_id
    assert remote.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        local.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    )


NONZERO_AFTER_REQUESTS = """vllm:prompt_tokens_total vllm:generation_tokens_total
vllm:time_to_first_token_seconds_count vllm:e2e_request_latency_seconds_count
vllm:inter_token_latency_seconds_count vllm:request_queue_time_seconds_count
vllm:prefix_cache_queries_total vllm:request_prompt_tokens_count""".split()


def test_vllm_metrics_on_the_real_engine(server) -> None:
    """vLLM's dashboard series, fed by the real engine (this module's requests and one more)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    assert requests.post(f"{server.url}/v1/completions", json=payload, timeout=60).ok
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    model = (("model_name", MODEL),)
    for name in NONZERO_AFTER_REQUESTS:
        assert samples[(name, model)] > 0, name
    length = (("finished_reason", "length"), ("model_name", MODEL))
    assert samples[("vllm:request_success_total", length)] >= 1
    assert (
        samples[("vllm:generation_tokens_total", model)]
        == samples[("verifypd_generation_tokens_total", (("model", MODEL),))]
    )
    assert ("vllm:kv_cache_usage_perc", model) in samples
