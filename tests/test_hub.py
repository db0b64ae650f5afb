"""Models named by hub id (ORG/NAME[@REVISION]) are read from the Hugging Face cache.

Nothing here can reach the hub, so the cache is filled by hand in the layout
huggingface_hub keeps (models--ORG--NAME/refs/REV → commit, snapshots/COMMIT/files):
the substitute for a download. Resolution itself is huggingface_hub's real code, with
HF_HUB_OFFLINE=1, as an operator with a pre-filled cache runs it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from conftest import request
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd.worker.hub import ModelNotFound, model_name, resolve
from specd.worker.identity import weights_digest
from test_cli import free_port
from test_pipeline import reference_greedy

COMMIT = "3f2a" * 10


def fill_cache(hub_cache: Path, repo: str, model_dir: Path, commit: str = COMMIT, ref: str = "main") -> None:
    """Put `model_dir` in the cache as revision `ref` (commit `commit`) of `repo`."""
    folder = hub_cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model_dir, folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch, model_dirs) -> Path:
    from huggingface_hub import constants

    hub_cache = tmp_path / "hf" / "hub"
    fill_cache(hub_cache, "specd-test/target", model_dirs["target"])
    fill_cache(hub_cache, "specd-test/close", model_dirs["close"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf"


def test_hub_ids_resolve_from_the_offline_cache(offline_cache, model_dirs):
    path = resolve("specd-test/target")
    assert path.name == COMMIT and weights_digest(path) == weights_digest(model_dirs["target"])
    assert resolve(f"specd-test/target@{COMMIT}") == path  # a pinned commit
    assert model_name("specd-test/target@main") == "target" and model_name(str(model_dirs["close"])) == "close"
    assert resolve(model_dirs["close"]) == model_dirs["close"]  # a directory is a directory
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE=1 is set"):
        resolve("specd-test/absent")
    with pytest.raises(ModelNotFound, match="revision v2 is not in the cache"):
        resolve("specd-test/target", revision="v2")
    with pytest.raises(ModelNotFound, match="not a model directory"):
        resolve(str(offline_cache / "nowhere" / "model"))


def test_serve_by_hub_id_equals_serving_the_directory(offline_cache, model_dirs, target_model, tokenizer):
    port = free_port()
    env = {**os.environ, "HF_HOME": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "specd_cli", "serve", "--target", "specd-test/target",
                              "--draft", "specd-test/close", "--port", str(port), "--threads", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=180)
            stub = gateway_pb2_grpc.GatewayStub(channel)
            response = stub.Generate(request("def fibonacci(n):", max_new_tokens=24), wait_for_ready=True,
                                     timeout=180)
            assert list(response.token_ids) == reference_greedy(target_model, tokenizer, "def fibonacci(n):", 24)
            assert response.stats.draft_model == "close" and response.stats.proposed_tokens > 0
            info = stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
            assert info.target.name == "target"
            assert info.target.weights_digest == weights_digest(model_dirs["target"])
    finally:
        serve.terminate()
        serve.communicate(timeout=60)


def test_an_unknown_hub_id_stops_serve_at_once(offline_cache):
    env = {**os.environ, "HF_HOME": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "specd_cli", "serve", "--target", "specd-test/absent",
                             "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2 and "specd-test/absent" in result.stderr and "HF_HUB_OFFLINE" in result.stderr

