"""The server's chat template settings: `--chat-template` (a file or inline Jinja, in
place of the model's or for a model without one) and `--chat-template-kwargs` (template
variables every request gets unless it sets them), checked at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tokenizer_proc.chat_template import default_template_kwargs, template_text
from tokenizer_proc.errors import RequestError
from tokenizer_proc.prepare import RequestPreparer
from tokenizer_proc.protocol import ChatCompletionRequest
from worker_proc.demo_model import ensure_demo_model

# Greets with a variable: what a request renders shows which value it got.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}|{{ greeting | default('none') }}]"
            "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}")


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """demo-tiny without a chat template."""
    src = ensure_demo_model("demo-tiny", cache_root=tmp_path_factory.mktemp("models"))
    out = tmp_path_factory.mktemp("bare") / "demo-tiny-bare"
    shutil.copytree(src, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _rendered(preparer: RequestPreparer, **body: object) -> str:
    request = preparer.chat(ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], **body), "r0")
    return preparer._tokenizer.decode(request.input_ids)


def test_a_model_without_a_template_serves_chat_with_the_servers(bare_model):
    without = RequestPreparer.load("bare", str(bare_model))
    with pytest.raises(RequestError, match="no chat template"):
        _rendered(without)
    served = RequestPreparer.load("bare", str(bare_model), chat_template=TEMPLATE)
    assert _rendered(served) == "[user|none]hi[bot]"


def test_server_template_variables_are_defaults_a_request_overrides(bare_model):
    preparer = RequestPreparer.load("bare", str(bare_model), chat_template=TEMPLATE,
                                    template_kwargs={"greeting": "hello"})
    assert _rendered(preparer) == "[user|hello]hi[bot]"
    assert _rendered(preparer, chat_template_kwargs={"greeting": "yo"}) == "[user|yo]hi[bot]"
    # Not the template itself: apply_chat_template would take it in the server's place.
    with pytest.raises(RequestError, match="may not set 'chat_template'"):
        _rendered(preparer, chat_template_kwargs={"chat_template": "{{ 'mine' }}"})


def test_the_template_setting_is_a_file_or_jinja_and_must_parse(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert template_text(str(path)) == TEMPLATE
    assert template_text(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        template_text(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="line 1: .*"):
        template_text("{% for m in messages %}{{ m }}")  # the loop never ends
    # Inline templates of any length (no path test on them: a long one is no valid path),
    # and transformers' own tags (`generation`, for assistant masks).
    long = TEMPLATE * 40
    assert template_text(long) == long
    tagged = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert template_text(tagged) == tagged
    assert default_template_kwargs("") == {}
    assert default_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad, why in (("[1]", "must be a JSON object"), ("{oops", "must be a JSON object"),
                     ('{"tools": []}', "may not set 'tools'"),
                     ('{"chat_template": "{{ x"}', "may not set 'chat_template'")):
        with pytest.raises(ValueError, match=why):
            default_template_kwargs(bad)


@pytest.mark.timeout(120)
def test_the_server_takes_both_flags_and_refuses_a_bad_template(bare_model, tmp_path):
    """Through every process: a chat request on the template-less model renders the
    flag's template with the flag's variables (its prompt's ids say so); a template
    that does not parse stops the launcher with the reason as its last line."""
    import subprocess
    import sys

    from tests.server import Server, free_port_pair

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    srv = Server(bare_model, "--chat-template", str(path), "--chat-template-kwargs",
                 '{"greeting": "hello"}', log_path=tmp_path / "log").wait_ready()
    try:
        reply = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200, reply.text
        preparer = RequestPreparer.load("bare", str(bare_model))
        want = preparer._tokenizer.encode("[user|hello]hi[bot]", add_special_tokens=False)
        assert reply.json()["usage"]["prompt_tokens"] == len(want)
        fed = httpx.post(srv.url + "/tokenize", timeout=60,
                         json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert fed["tokens"] == want
    finally:
        assert srv.stop() == 0, srv.log_tail()
    run = subprocess.run([sys.executable, "launch.py", "--model", str(bare_model),
                          "--port", str(free_port_pair()), "--chat-template", "{{ oops"],
                         capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode != 0
    last = (run.stdout + run.stderr).rstrip().splitlines()[-1]
    assert last.startswith("error: --chat-template: line 1: "), last
