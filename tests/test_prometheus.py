"""The gateway's /metrics endpoint as Prometheus itself sees it: `promtool check metrics`
accepts it, and a real Prometheus on loopback scrapes it and answers the README's PromQL
with the same acceptance figures the GetAcceptanceStats RPC gives.

Needs Debian's `prometheus` package (.ci/run installs it); skipped where it is absent."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest

from conftest import LoopThread, request
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from gateway.stats.acceptance import Counts
from specd.config import ServerSettings
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from test_cli import free_port

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                reason="Debian's prometheus package is not installed")

ACCEPTANCE_RATE = ("sum(specd_spec_decode_num_accepted_tokens_total) / "
                   "sum(specd_spec_decode_num_draft_tokens_total)")
ALPHA = ("sum(specd_spec_decode_num_accepted_tokens_total) / "
         "sum(specd_spec_decode_num_reached_tokens_total)")
MEAN_ACCEPTANCE_LENGTH = ("1 + sum(specd_spec_decode_num_accepted_tokens_total) / "
                          "sum(specd_spec_decode_num_drafts_total)")


@pytest.fixture
def metered_gateway(stack):
    """A second gateway on the test stack's workers, with /metrics on a free port."""
    loop = LoopThread()
    port = free_port()
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                               verifier_address=f"127.0.0.1:{stack.verifier.port}",
                               draft_address=f"127.0.0.1:{stack.draft.port}", metrics_port=port)
    server = loop.run(create_gateway(settings))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield gateway_pb2_grpc.GatewayStub(channel), port
    channel.close()
    loop.run(server.stop(0))
    loop.close()


def query(prometheus: str, promql: str) -> float | None:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    result = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_real_prometheus_scrapes_and_answers_the_readme_promql(metered_gateway, tmp_path):
    stub, metrics_port = metered_gateway
    for prompt in ("def fibonacci(n):", "The acceptance rate is"):
        req = request(prompt, max_new_tokens=24, draft_model="close")
        req.task_type = "code"
        stub.Generate(req)
    exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr

    config = tmp_path / "prometheus.yml"
    config.write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: specd\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    web = free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{web}"
        rate = None
        deadline = time.monotonic() + 60
        while rate is None and time.monotonic() < deadline:
            time.sleep(1)
            try:
                rate = query(base, ACCEPTANCE_RATE)
            except OSError:
                continue
        assert rate is not None, "Prometheus never scraped the gateway"
        reply = stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest())
        (row,) = reply.rows
        assert rate == pytest.approx(row.acceptance_rate, abs=1e-6)
        assert query(base, MEAN_ACCEPTANCE_LENGTH) == pytest.approx(row.mean_acceptance_length, abs=1e-6)
        per_position = Counts(proposed_per_position=list(row.proposed_per_position),
                              accepted_per_position=list(row.accepted_per_position))
        assert query(base, ALPHA) == pytest.approx(per_position.alpha, abs=1e-6)
        by_position = query(base, 'sum(specd_spec_decode_num_accepted_tokens_per_pos_total{position="1"})')
        assert by_position == row.accepted_per_position[0]
    finally:
        prometheus.terminate()
        prometheus.wait(10)
