"""The shipped demo pair decodes exactly through the three services."""
from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import LoopThread, request
from draft_service.server import create_server as create_draft
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from specd.config import DEMO_DRAFT, DEMO_TARGET, ServerSettings
from specd.v1 import gateway_pb2_grpc
from specd.worker.settings import DraftSettings, VerifierSettings
from verifier_service.server import create_server as create_verifier

pytestmark = pytest.mark.skipif(not (DEMO_TARGET / "config.json").is_file(), reason="no demo pair in models/demo")


def test_demo_pair_is_exact_and_speculates():
    loop = LoopThread()
    server = ServerSettings("127.0.0.1", 0, grace_s=0.5)
    draft = loop.run(create_draft(DraftSettings(server, {"distilled": DEMO_DRAFT})))
    verifier = loop.run(create_verifier(VerifierSettings(server, DEMO_TARGET)))
    gateway = loop.run(create_gateway(GatewaySettings(server, verifier_address=f"127.0.0.1:{verifier.port}",
                                                      draft_address=f"127.0.0.1:{draft.port}")))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            prompt = "def read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n"
            response = stub.Generate(request(prompt, max_new_tokens=48, mode="AUTO"))
        tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
        target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        expected = target.generate(ids, do_sample=False, max_new_tokens=48)[0, ids.shape[1]:].tolist()
        assert list(response.token_ids) == expected
        assert response.stats.task_type == "code" and response.stats.accepted_tokens > 0
    finally:
        for running in (gateway, draft, verifier):
            loop.run(running.stop(0))
        loop.close()
