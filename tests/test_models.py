"""Bringing one's own model: a GGUF file converted once into a model directory, served with
no draft (the model-free proposers alone), its chat template and its whole context."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_file import CHAT_TEMPLATE, write_gguf
from specd.worker.hub import ModelNotFound, resolve
from test_cli import free_port
from test_http import post


@pytest.fixture(scope="module")
def gguf_target(model_dirs, tmp_path_factory) -> Path:
    return write_gguf(model_dirs["target"], tmp_path_factory.mktemp("gguf") / "tiny-target.gguf")


def test_a_gguf_file_is_converted_once_into_a_model_directory(gguf_target, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    converted = resolve(str(gguf_target))
    assert converted.name == "tiny-target" and converted.is_relative_to(tmp_path)
    assert (converted / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    ours, theirs = AutoTokenizer.from_pretrained(converted), AutoTokenizer.from_pretrained(model_dirs["target"])
    assert ours("def fibonacci(n):")["input_ids"] == theirs("def fibonacci(n):")["input_ids"]
    # The weights as transformers reads the file, in float32.
    direct = AutoModelForCausalLM.from_pretrained(gguf_target.parent, gguf_file=gguf_target.name,
                                                  dtype=torch.float32)
    saved = AutoModelForCausalLM.from_pretrained(converted)
    for (name, tensor), (_, other) in zip(direct.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(tensor, other), name
    # Found in the cache the second time: nothing is read from the file again.
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)
    assert resolve(str(gguf_target)) == converted


def test_a_file_transformers_cannot_read_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelNotFound, match="transformers cannot load this GGUF file"):
        resolve(str(bad))
    with pytest.raises(ModelNotFound, match="no such GGUF file"):
        resolve(str(tmp_path / "missing.gguf"))


def test_serve_a_gguf_target_with_no_draft_chats_as_generate_does(gguf_target, tmp_path):
    """`specd serve --target FILE.gguf` and nothing else: no draft worker, the model's own
    chat template, and a chat with no max_tokens runs to the end of the context, token for
    token what transformers' `generate` gives on the same file."""
    port, http_port = free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "specd_cli", "serve", "--target", str(gguf_target), "--port", str(port),
         "--http-port", str(http_port), "--startup-timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "SPECD_CACHE": str(tmp_path)})
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    try:
        url = f"http://127.0.0.1:{http_port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            (model,) = json.loads(response.read())["data"]
        status, reply = post(f"{url}/v1/chat/completions", json.dumps(
            {"model": model["id"], "messages": messages, "temperature": 0}).encode())
    finally:
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=60)
    assert status == 200, reply
    assert "drafts none: model-free proposers only" in output and " draft --socket" not in output
    tokenizer = AutoTokenizer.from_pretrained(gguf_target.parent, gguf_file=gguf_target.name)
    reference = AutoModelForCausalLM.from_pretrained(gguf_target.parent, gguf_file=gguf_target.name,
                                                     dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    room = model["max_model_len"] - ids.shape[1]
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=room)
    new = expected[0, ids.shape[1]:].tolist()
    if new[-1] == tokenizer.eos_token_id:  # the EOS ends the chat's content without a trace
        new = new[:-1]
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(new, skip_special_tokens=True)
    assert reply["usage"]["completion_tokens"] > 128  # not cut at a fixed default


def test_a_request_that_leaves_a_sampling_field_unset_takes_the_models_default():
    """generation_config.json's sampling fields, as vLLM's --generation-config auto applies
    them: what the request sets wins, then the model's, then OpenAI's."""
    from gateway.edge.fields import read_sampling
    from gateway.workers.backend import sampling_defaults

    files = {"generation_config.json": json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True,
                                                   "eos_token_id": [2, 7]}).encode()}
    model = sampling_defaults(files)
    assert model == {"temperature": 0.6, "top_p": 0.9}
    unset = read_sampling({}, None, model)
    assert (unset["temperature"], unset["top_p"], unset["top_k"]) == (0.6, 0.9, 0)
    assert read_sampling({"temperature": 0, "top_p": 1}, None, model)["temperature"] == 0
    assert read_sampling({}, None, {})["temperature"] == 1.0
    assert sampling_defaults({}) == {} and sampling_defaults({"generation_config.json": b"not json"}) == {}


def test_the_end_of_a_turn_ends_the_output_as_the_tokenizers_eos_does(model_dirs):
    """A chat model's generation config names its end-of-turn token; the tokenizer's EOS
    ends the output too (vLLM takes both)."""
    from specd.worker.runtime import eos_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    model.generation_config.eos_token_id = [5, tokenizer.eos_token_id]
    assert eos_ids(model, tokenizer) == (5, tokenizer.eos_token_id)
    model.generation_config.eos_token_id = None
    assert eos_ids(model, tokenizer) == (tokenizer.eos_token_id,)
