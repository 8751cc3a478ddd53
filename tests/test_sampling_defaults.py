"""The model maker's sampling defaults (generation_config.json's temperature, top_p,
top_k, min_p, repetition_penalty): a request that leaves a field out gets the model's
value, one that sets it keeps its own; `--sampling-defaults openai` turns them off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest
from worker_proc.demo_model import ensure_demo_model

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
               "repetition_penalty": 1.05, "max_new_tokens": 256}


@pytest.fixture(scope="module")
def tuned_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo-tiny whose generation_config.json recommends sampling (as Qwen's do), one
    value out of range and the do_sample flag (not read)."""
    src = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    out = tmp_path_factory.mktemp("tuned") / "demo-tiny-tuned"
    shutil.copytree(src, out)
    config = json.loads((out / "generation_config.json").read_text())
    config.update(RECOMMENDED, do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def _sampling(preparer: RequestPreparer, **body: object):
    return preparer.completion(CompletionRequest(prompt="hi", max_tokens=2, **body),
                               "r0").sampling


def test_a_request_gets_the_models_sampling_where_it_sets_none(tuned_model):
    preparer = RequestPreparer.load("tuned", str(tuned_model))
    assert preparer.sampling_defaults == RECOMMENDED
    got = _sampling(preparer)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (
        0.6, 0.95, 20, 0.0, 1.05)
    own = _sampling(preparer, temperature=0.0, top_k=-1, repetition_penalty=1.0)
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (
        0.0, 0.95, 0, 1.0)
    chat = preparer.chat(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], max_tokens=2), "r1").sampling
    assert (chat.temperature, chat.top_k, chat.max_new_tokens) == (0.6, 20, 2)
    # A chat turn without max_tokens: the model's own length (a completion keeps 16).
    turn = preparer.chat(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}]), "r2").sampling
    assert turn.max_new_tokens == 256 and _sampling(preparer).max_new_tokens == 2
    # The ZMQ client's fields left out are defaults too.
    from ipc.messages.client import GenerateRequest

    zmq = preparer.generate(GenerateRequest(request_id="z", prompt="hi", max_tokens=2),
                            "r3").sampling
    assert (zmq.temperature, zmq.top_p, zmq.top_k, zmq.repetition_penalty) == (
        0.6, 0.95, 20, 1.05)


def test_openai_defaults_leave_the_models_aside(tuned_model):
    preparer = RequestPreparer.load("tuned", str(tuned_model), model_sampling=False)
    got = _sampling(preparer)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_a_value_out_of_range_is_not_used(tuned_model, tmp_path, caplog):
    bad = tmp_path / "bad"
    shutil.copytree(tuned_model, bad)
    config = json.loads((bad / "generation_config.json").read_text())
    config.update(top_p=1.5, top_k=20.5, temperature=True)  # a flag is no temperature
    (bad / "generation_config.json").write_text(json.dumps(config))
    preparer = RequestPreparer.load("bad", str(bad))
    assert preparer.sampling_defaults == {"min_p": 0.0, "repetition_penalty": 1.05,
                                          "max_new_tokens": 256}
    assert "top_p 1.5 is not used" in caplog.text and "top_k 20.5 is not used" in caplog.text


def test_a_response_object_shows_the_sampling_it_used(tuned_model):
    """Responses repeats temperature and top_p as sampled: the model's where the request
    left them out (as vLLM reports them)."""
    from tokenizer_proc.responses_api import ResponsesRequest, request_echo

    preparer = RequestPreparer.load("tuned", str(tuned_model))
    used = _sampling(preparer)
    echo = request_echo(ResponsesRequest(input="hi"), "tuned", used)
    assert (echo["temperature"], echo["top_p"]) == (0.6, 0.95)


def test_the_servers_overrides_win_over_the_models(tuned_model):
    """--override-generation-config: the operator's values over the model's (and alone
    under --sampling-defaults openai); a request's own still win; a bad one stops the
    launcher naming it."""
    import subprocess
    import sys

    from tokenizer_proc.prepare import generation_overrides

    overrides = generation_overrides('{"temperature": 0.3, "max_new_tokens": 64}')
    preparer = RequestPreparer.load("tuned", str(tuned_model), sampling_overrides=overrides)
    assert preparer.sampling_defaults == {**RECOMMENDED, "temperature": 0.3,
                                          "max_new_tokens": 64}
    assert (_sampling(preparer).temperature, _sampling(preparer, temperature=1.0).temperature) \
        == (0.3, 1.0)
    alone = RequestPreparer.load("tuned", str(tuned_model), model_sampling=False,
                                 sampling_overrides=overrides)
    assert alone.sampling_defaults == {"temperature": 0.3, "max_new_tokens": 64}
    for bad, why in (("[1]", "must be a JSON object"), ('{"seed": 1}', "not a sampling field"),
                     ('{"top_p": 2}', "'top_p' must be in"), ('{"top_k": 1.5}', "an integer")):
        with pytest.raises(ValueError, match=why):
            generation_overrides(bad)
    run = subprocess.run([sys.executable, "launch.py", "--model", str(tuned_model),
                          "--override-generation-config", '{"temperature": -1}'],
                         capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode != 0
    last = (run.stdout + run.stderr).rstrip().splitlines()[-1]
    assert last.startswith("error: --override-generation-config: 'temperature' must be"), last
