"""Real evaluation frameworks against the OpenAI-compatible routes (``/evalsched/v1``), offline:
lm-evaluation-harness's ``local-completions`` (token-id prompts) on a multiple-choice task and a
generate_until task defined in this repository (tests/data/lmeval_task), checked against the
model itself and against lm-eval's own ``hf`` backend on the same model directory; and an Inspect eval through its ``openai-api``
provider. The server is a real Jupyter server with the tiny causal LM in its model host; the
frameworks run in a thread (the server runs on the test's event loop)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import lm_eval
import pytest
import torch
import transformers
import yaml

from jupyter_evalsched.shared_models.tiny_lm import build_tiny_gpt2

TASK_DIR = Path(__file__).resolve().parent / "data" / "lmeval_task"
TASK = "evalsched_tiny_mc"  # multiple choice: loglikelihood requests
GEN_TASK = "evalsched_tiny_gen"  # the same questions, generate_until

# Real lm-eval and Inspect runs, a minute and a half in all: CI runs them with -m slow.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, and every cache and log the frameworks write inside this test's directory."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setenv("INSPECT_LOG_DIR", str(tmp_path / "inspect-logs"))
    # Inspect's own data and cache directories (platformdirs: XDG on Linux)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    # lm-eval's datasets cache is read when the module loads: point it here too.
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.getbasetemp() / "models" / "tiny-gpt2")


@pytest.fixture
def evalsched_config(tiny_lm_dir):
    return {
        "models": [
            {
                "name": "tiny-lm",
                "loader": "jupyter_evalsched.shared_models.loaders:causal_lm",
                "model": tiny_lm_dir,
                "max_batch_size": 64,
                "cpu_threads": 1,
            }
        ]
    }


@pytest.fixture
def base_url(jp_http_port, jp_base_url, jp_fetch, evalsched):  # jp_fetch: the server listens
    return f"http://127.0.0.1:{jp_http_port}{jp_base_url}evalsched/v1"


@pytest.fixture
def token(jp_serverapp):
    return jp_serverapp.identity_provider.token


# -- lm-evaluation-harness ---------------------------------------------------------------------


def task_config(name: str) -> dict:
    """A task's YAML with its data file made absolute (the datasets library reads a relative
    path from the working directory, not from the YAML's)."""
    config = yaml.safe_load((TASK_DIR / name).read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(TASK_DIR / "items.json")
    return config


def evaluate(model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config("tiny_mc.yaml"), task_config("tiny_gen.yaml")],
        task_manager=TaskManager(include_defaults=False),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def through_the_api(base_url: str, model_dir: str) -> dict:
    return evaluate(
        "local-completions",
        {
            "base_url": f"{base_url}/completions",
            "model": "tiny-lm",
            # lm-eval tokenizes itself and sends token ids (lists of lists of ints, 4 prompts a request)
            "tokenizer": model_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": 4,
            "max_retries": 1,
        },
    )


def per_sample(results: dict) -> dict[int, list[tuple[tuple[str, str], float, bool]]]:
    """``{doc_id: [((context, continuation), loglikelihood, is_greedy) per choice]}``."""
    samples = results["samples"][TASK]
    return {
        s["doc_id"]: [(tuple(args), float(resp[0][0]), bool(resp[0][1])) for args, resp in zip(s["arguments"], s["resps"], strict=True)]
        for s in samples
    }  # fmt: skip


def generations(results: dict) -> dict[int, tuple[str, str]]:
    """``{doc_id: (context, generated text)}`` of the generate_until task."""
    return {s["doc_id"]: (s["arguments"][0][0], s["resps"][0][0]) for s in results["samples"][GEN_TASK]}


def direct_generation(model, tokenizer, context: str, until: list[str], max_tokens: int) -> str:
    """The model's own greedy continuation, cut before the first stop string."""
    encoded = tokenizer(context, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    return text[: min((text.find(stop) for stop in until if stop in text), default=len(text))]


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The continuation's log-probability given the context, from the model's own logits, with
    lm-eval's split of the text into tokens (trailing spaces of the context go with the
    continuation; the continuation's tokens are the whole text's beyond the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    ids = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(context_ids)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(logprobs[i - 1, ids[i]]) for i in range(start, len(ids)))


async def test_lm_eval_through_the_api_scores_what_the_model_computes(base_url, token, tiny_lm_dir, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", token)  # where local-completions reads its key
    results = await asyncio.to_thread(through_the_api, base_url, tiny_lm_dir)

    samples = per_sample(results)
    assert sorted(samples) == list(range(12)) and all(len(choices) == 3 for choices in samples.values())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    correct = 0
    for doc_id, choices in samples.items():
        for (context, continuation), got, _ in choices:
            want = direct_loglikelihood(model, tokenizer, context, continuation)
            assert abs(got - want) < 1e-4, (doc_id, continuation, got, want)
        doc = results["samples"][TASK][[s["doc_id"] for s in results["samples"][TASK]].index(doc_id)]["doc"]
        correct += max(range(3), key=lambda i: choices[i][1]) == doc["answer"]
    accuracy = results["results"][TASK]["acc,none"]
    assert math.isclose(accuracy, correct / 12), (accuracy, correct)

    # generate_until: six stop strings (the task's five and the end of text), greedy, 8 tokens.
    generation = task_config("tiny_gen.yaml")["generation_kwargs"]
    generated = generations(results)
    assert sorted(generated) == list(range(12))
    for doc_id, (context, text) in generated.items():
        want = direct_generation(model, tokenizer, context, generation["until"], generation["max_gen_toks"])
        assert text == want, (doc_id, context, text, want)
    assert any(text for _, text in generated.values())


async def test_lm_eval_through_the_api_equals_its_own_hf_backend(base_url, token, tiny_lm_dir, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", token)
    api = await asyncio.to_thread(through_the_api, base_url, tiny_lm_dir)
    hf = await asyncio.to_thread(evaluate, "hf", {"pretrained": tiny_lm_dir, "device": "cpu", "batch_size": 4})

    assert api["results"][TASK]["acc,none"] == hf["results"][TASK]["acc,none"]
    api_samples, hf_samples = per_sample(api), per_sample(hf)
    assert sorted(api_samples) == sorted(hf_samples) == list(range(12))
    for doc_id in api_samples:
        for (args, got, greedy), (hf_args, want, hf_greedy) in zip(
            api_samples[doc_id], hf_samples[doc_id], strict=True
        ):
            assert args == hf_args
            assert abs(got - want) < 1e-4, (doc_id, args, got, want)
            assert greedy == hf_greedy, (doc_id, args)
    assert api["results"][GEN_TASK]["exact_match,none"] == hf["results"][GEN_TASK]["exact_match,none"]
    assert generations(api) == generations(hf)


# -- Inspect -----------------------------------------------------------------------------------

QUESTIONS = ["Where did the cat sit?", "Who ate the pasta?", "What fell sharply today?"]


def inspect_eval(base_url: str, api_key: str, log_dir: str):
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import get_model
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate

    task = Task(
        dataset=[Sample(input=question, target="mat") for question in QUESTIONS],
        solver=generate(),
        scorer=includes(),
    )
    # openai-api/<service>/<model>: the service only names the provider's variables
    # (EVALSCHED_BASE_URL, EVALSCHED_API_KEY); base_url and api_key given here take their place.
    model = get_model("openai-api/evalsched/tiny-lm", base_url=base_url, api_key=api_key)
    (log,) = eval(
        task,
        model=model,
        log_dir=log_dir,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        display="none",
        max_retries=0,
        fail_on_error=True,
    )
    return log


async def test_an_inspect_eval_through_the_api(base_url, token, tiny_lm_dir, tmp_path):
    log_dir = tmp_path / "inspect-logs"
    log = await asyncio.to_thread(inspect_eval, base_url, token, str(log_dir))

    assert log.status == "success", log.error
    assert log.eval.model == "openai-api/evalsched/tiny-lm"
    assert [s.scores for s in log.samples] and all(s.scores for s in log.samples)
    assert any(log_dir.iterdir())  # its log, written here
    # Each sample's output is the model's own greedy completion of the chat prompt, with the
    # model's own log-probabilities (this random model completes every question alike: the
    # log-probabilities tell the prompts apart).
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    outputs = {s.input: s.output.choices[0] for s in log.samples}
    assert sorted(outputs) == sorted(QUESTIONS)
    for question, choice in outputs.items():
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        start = encoded["input_ids"].shape[1]
        out = model.generate(**encoded, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert choice.message.text == tokenizer.decode(out[0, start:], skip_special_tokens=True)
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(out).logits[0].float(), dim=-1)
        expected = [float(logprobs[i - 1, out[0, i]]) for i in range(start, out.shape[1])]
        got = [entry.logprob for entry in choice.logprobs.content]
        assert len(got) == len(expected) and all(abs(a - b) < 1e-4 for a, b in zip(got, expected, strict=True))
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
