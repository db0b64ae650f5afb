"""Tracing per hop (docs/design.md §8): spans, their links across processes, and `specd trace`.

Two levels: the three services in this process with the SDK's in-memory exporter (fast,
every attribute checked), and the three services as separate processes exporting over
OTLP to `specd trace collect` on loopback (what a deployment does).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from conftest import request, start_stack
from gateway.request import Generation, Stopping
from gateway.stats.drift import DriftSettings
from gateway.step.records import NoTracer
from gateway.step.tracing import RequestTrace
from specd.contract import MODEL_FREE, baseline_document
from specd.sampling import Transform
from specd.telemetry import tracing_configured, tracing_enabled, worker_step_span
from specd_cli.serve import wait_healthy
from specd_cli.supervisor import stop_all
from specd_cli.trace import load_spans, pick_trace, render, step_rows

REPO = Path(__file__).resolve().parents[1]


def _reset_global_tracer_provider() -> None:
    """Back to OpenTelemetry's no-op provider, as OpenTelemetry's own test utilities do.

    The API lets a process set its provider once; tests that install one must undo it so
    the rest of the suite runs with tracing off.
    """
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@pytest.fixture(scope="module")
def memory_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    _reset_global_tracer_provider()


@pytest.fixture(scope="module")
def traced_stack(model_dirs, memory_spans):
    """A stack started after the provider, so its servers get the gRPC interceptor."""
    stack = start_stack(model_dirs, model_free=("suffix", "prompt-lookup"))
    yield stack
    stack.close()


def check_trace(spans: list[dict], response) -> None:
    """The properties every traced request must have, on spans as `specd trace` stores them."""
    stats = response.stats
    assert {s["trace_id"] for s in spans} == {response.trace_id}
    (generate,) = [s for s in spans if s["name"] == "specd.generate"]
    steps = [s for s in spans if s["name"] == "specd.step"]
    assert len(steps) == stats.steps
    assert all(s["parent_span_id"] == generate["span_id"] for s in steps)
    rows = step_rows(spans)
    for row in rows:
        # A step the verifier answered unasked (run-ahead) has no verifier span of its own.
        assert (row.verify is None) == row.attr("specd.ran_ahead", False), "every asked step has its verifier span"
        if row.model_free:  # drafted in the gateway: no draft hop, no draft span
            assert row.draft is None and row.attr("specd.draft.hop_ms") < 5.0
        elif row.attr("specd.draft_length"):
            # Its draft span; in hand, the last step's recovery hop's, which drafted it.
            assert row.draft is not None, "every drafting step has its draft span"
            proposed = row.draft["attributes"]["specd.proposed"]
            in_hand = row.attr("specd.draft.in_hand", False)  # a smaller γ takes a prefix of it
            assert proposed >= row.attr("specd.draft_length") if in_hand else proposed == row.attr("specd.draft_length")
        if row.attr("specd.draft.recovery_ms", None) is not None:  # sampled: the draft drew the recovered token
            assert row.attr("specd.token.kind") == "recovered" and row.attr("specd.proposer") not in MODEL_FREE
        if row.verify is not None:
            assert row.verify["attributes"]["specd.positions_scored"] == row.attr("specd.draft_length") + 1
        assert row.gateway_ms > -0.5, "a step's hops were spent inside its span"
    assert sum(r.attr("specd.draft_length") for r in rows) == stats.proposed_tokens
    assert sum(r.attr("specd.accepted") for r in rows) == stats.accepted_tokens
    assert sum(r.attr("specd.emitted") for r in rows) == stats.generated_tokens
    assert [r.attr("specd.draft_length") for r in rows] == list(stats.draft_lengths)
    attributes = generate["attributes"]
    assert attributes["specd.steps"] == stats.steps
    assert attributes["specd.proposed_tokens"] == stats.proposed_tokens
    assert attributes["specd.accepted_tokens"] == stats.accepted_tokens
    assert attributes["specd.acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert attributes["gen_ai.usage.output_tokens"] == stats.generated_tokens
    assert not [s for s in spans if "grpc.health" in s["name"]], "health checks are not traced"


def as_records(spans) -> list[dict]:
    """SDK spans in the JSON form `specd trace collect` writes."""
    service = lambda s: s.resource.attributes.get("service.name", "")  # noqa: E731
    return [{
        "trace_id": format(s.context.trace_id, "032x"), "span_id": format(s.context.span_id, "016x"),
        "parent_span_id": format(s.parent.span_id, "016x") if s.parent else "", "name": s.name,
        "kind": s.kind.name.lower(), "service": service(s), "start_ns": s.start_time, "end_ns": s.end_time,
        "duration_ms": (s.end_time - s.start_time) / 1e6, "attributes": dict(s.attributes),
        "status": {"code": s.status.status_code.name.lower(), "message": s.status.description or ""},
    } for s in spans]


# -- tracing off -----------------------------------------------------------------------------

def test_off_unless_an_endpoint_is_configured():
    assert not tracing_configured({})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"})


def test_tracing_off_builds_nothing_per_step():
    # Runs before the in-process tests install a provider (module order).
    assert not tracing_enabled()
    generation = Generation([1, 2, 3], Transform(0.0, 0, 1.0), seed=1, stopping=Stopping(4), draft_model="d")
    request_trace = RequestTrace.start(generation, target_model="t", model_pair="d->t", task_type="",
                                       user_segment="", mode="FIXED", policy="fixed")
    assert isinstance(request_trace.step_tracer, NoTracer)
    assert request_trace.trace_id == ""
    with worker_step_span(trace.get_tracer("test"), "specd.draft.propose", {}) as span:
        assert span is None
    request_trace.end()


# -- in process ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_trace_per_request_with_a_span_per_step_and_hop(traced_stack, memory_spans, temperature):
    memory_spans.clear()
    response = traced_stack.stub.Generate(request("def fibonacci(n):", temperature=temperature, seed=7,
                                                  max_new_tokens=20, draft_length=4))
    assert len(response.trace_id) == 32
    spans = [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] == response.trace_id]
    check_trace(spans, response)
    # The gRPC instrumentation's span of the public call joins the trace; it ends just after
    # the response is sent. The worker streams outlive requests and have no span.
    deadline = time.monotonic() + 10
    while "/specd.v1.Gateway/Generate" not in {s.name for s in memory_spans.get_finished_spans()} \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    spans = [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] == response.trace_id]
    assert "/specd.v1.Gateway/Generate" in {s["name"] for s in spans}
    (generate,) = [s for s in spans if s["name"] == "specd.generate"]
    assert generate["attributes"]["gen_ai.request.model"] == "target"
    assert generate["attributes"]["specd.model_pair"] == "close->target"
    for row in step_rows(spans):
        probs = row.draft["attributes"]["specd.draft.token_probs"]
        assert len(probs) == row.attr("specd.draft_length") and all(0.0 < p <= 1.0 for p in probs)
        assert row.draft["attributes"]["specd.draft.token_prob.min"] == min(probs)
        kind = row.attr("specd.token.kind")
        assert (kind == "bonus") == (row.attr("specd.accepted") == row.attr("specd.draft_length"))
        assert ("specd.first_rejected" in row.step["attributes"]) == (kind == "recovered")
    assert not [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] != response.trace_id
                and s["name"].startswith("specd.")], "no span of this request lands in another trace"


def test_plain_decoding_traces_verifier_hops_only(traced_stack, memory_spans):
    memory_spans.clear()
    response = traced_stack.stub.Generate(request("class Cache:", max_new_tokens=6, mode="OFF"))
    spans = [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] == response.trace_id]
    check_trace(spans, response)
    assert not [s for s in spans if s["name"] == "specd.draft.propose"]
    rows = step_rows(spans)
    assert {r.attr("specd.token.kind") for r in rows} == {"target"}
    # The first step let the verifier score the rest unasked: one verifier span in all.
    assert [r.attr("specd.ran_ahead", False) for r in rows] == [False] + [True] * (len(rows) - 1)
    assert rows[0].verify["attributes"]["specd.run_ahead_steps"] == 5


def test_show_renders_the_step_table(traced_stack, memory_spans):
    memory_spans.clear()
    response = traced_stack.stub.Generate(request("The acceptance rate is", max_new_tokens=12))
    spans = pick_trace(as_records(memory_spans.get_finished_spans()), response.trace_id[:8])
    text = render(spans)
    assert response.trace_id in text
    assert f"{response.stats.accepted_tokens}/{response.stats.proposed_tokens} draft tokens accepted" in text
    lines = text.splitlines()
    below_header = lines[next(i for i, line in enumerate(lines) if set(line) == {"-"}) + 1:]
    table = below_header[:below_header.index("")]
    assert len(table) == response.stats.steps
    assert "acceptance by draft position: 1:" in text and "worker spans missing" not in text


def test_model_free_steps_are_traced_and_shown(traced_stack, memory_spans):
    """A repeated request under AUTO is drafted by the suffix proposer: its steps carry
    `specd.proposer`, have no draft span, and `specd trace show` says who proposed."""
    req = request("class Cache:\n    def __init__(self, size):", max_new_tokens=40, mode="AUTO")
    req.user_segment = "traced-repeat"
    traced_stack.stub.Generate(req)
    memory_spans.clear()
    response = traced_stack.stub.Generate(req)
    assert "suffix" in response.stats.proposers
    spans = [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] == response.trace_id]
    check_trace(spans, response)
    rows = step_rows(spans)
    assert [r.attr("specd.proposer", "") for r in rows] == list(response.stats.proposers)
    text = render(spans)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "verify ms" in line)
    # The first step's proposer, or "-" where AUTO decoded it plainly (its costs say so at times).
    assert lines[at].split()[-1] == "by" and lines[at + 2].split()[-1] == (response.stats.proposers[0] or "-")
    assert "worker spans missing" not in text


def test_overlap_shows_the_next_draft_during_verification(traced_stack, memory_spans):
    memory_spans.clear()
    req = request("def fibonacci(n):", max_new_tokens=32, draft_model="close")
    req.speculation.overlap = True
    response = traced_stack.stub.Generate(req)
    assert response.stats.pre_draft_hits > 0
    # The pre-draft spans end when their branches settle, after the response: wait for them.
    for _ in range(100):
        records = [s for s in as_records(memory_spans.get_finished_spans()) if s["trace_id"] == response.trace_id]
        rows = step_rows(records)
        if sum(r.pre_draft is not None for r in rows) == response.stats.pre_draft_steps + 1:
            break
        time.sleep(0.05)
    check_trace(records, response)
    # Step k+1 was being drafted while the target verified step k.
    assert any(r.overlap_ms and r.overlap_ms > 0 for r in rows)
    assert sum(r.attr("specd.pre_drafted", False) for r in rows) == response.stats.pre_draft_hits
    text = render(records)
    assert "overlap" in text and " hit" in text


# -- three processes over OTLP ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_drift_is_an_event_on_the_step_span_that_raised_it(model_dirs, memory_spans, tmp_path):
    # A baseline the close draft cannot meet: the first step after enough drafts raises the flag.
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(baseline_document([("close->target", "code", 0.99, 1000)])))
    stack = start_stack(model_dirs, drafts=("close",), acceptance_baseline=baseline,
                        drift=DriftSettings(min_drafts=10))
    try:
        memory_spans.clear()
        req = request("def fibonacci(n):", max_new_tokens=48, draft_model="close")
        req.task_type = "code"
        response = stack.stub.Generate(req, timeout=60)
    finally:
        stack.close()
    steps = [s for s in memory_spans.get_finished_spans()
             if s.name == "specd.step" and format(s.context.trace_id, "032x") == response.trace_id]
    events = [(s.attributes["specd.step.index"], e) for s in steps for e in s.events
              if e.name == "specd.acceptance_drift"]
    assert len(events) == 1, "raised once, on the step that crossed the threshold"
    index, event = events[0]
    assert index >= 9  # not before min_drafts drafts were seen
    assert event.attributes["gateway.drift.reference"] == "baseline"
    assert event.attributes["gateway.drift.reference_alpha"] == pytest.approx(0.99)
    assert event.attributes["gateway.drift.drop"] >= 0.1


def test_three_processes_export_one_trace_to_the_collector(model_dirs, tmp_path):
    out = tmp_path / "spans.jsonl"
    me = [sys.executable, "-m", "specd_cli"]
    collector = subprocess.Popen(me + ["trace", "collect", "--port", "0", "--out", str(out)],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO)
    procs: list[subprocess.Popen] = []
    try:
        port = int(collector.stdout.readline().split(" on 127.0.0.1:")[1].split(",")[0])
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_BSP_SCHEDULE_DELAY="100")
        draft_port, verifier_port, gateway_port = _free_port(), _free_port(), _free_port()
        common = ["--threads", "1", "--grace", "2"]
        procs = [
            subprocess.Popen(me + ["draft", "--port", str(draft_port), "--draft",
                                   f"close={model_dirs['close']}", *common], env=env, cwd=REPO),
            subprocess.Popen(me + ["verifier", "--port", str(verifier_port), "--target",
                                   str(model_dirs["target"]), *common], env=env, cwd=REPO),
            subprocess.Popen(me + ["gateway", "--port", str(gateway_port), "--grace", "2",
                                   "--draft-address", f"127.0.0.1:{draft_port}",
                                   "--verifier-address", f"127.0.0.1:{verifier_port}"], env=env, cwd=REPO),
        ]
        assert wait_healthy(f"127.0.0.1:{gateway_port}", procs, timeout_s=120), "services did not start"
        import grpc

        from specd.v1 import gateway_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{gateway_port}") as channel:
            response = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request("def fibonacci(n):", temperature=1.0, seed=3, max_new_tokens=16), timeout=60)
        stop_all(procs, grace_s=20)  # SIGTERM: each provider flushes its batch on exit
        assert [p.returncode for p in procs] == [0, 0, 0]
    finally:
        stop_all(procs, grace_s=5)
        stop_all([collector], grace_s=5)

    spans = pick_trace(load_spans(out), None)
    assert spans[0]["trace_id"] == response.trace_id, "the latest trace is this request's"
    check_trace(spans, response)
    assert {s["service"] for s in spans} == {"specd-gateway", "specd-draft", "specd-verifier"}
    by_service = {(s["service"], s["name"]) for s in spans}
    assert ("specd-draft", "specd.draft.propose") in by_service
    assert ("specd-verifier", "specd.verifier.verify") in by_service
    json.dumps(spans)  # the file holds plain JSON values only

    shown = subprocess.run(me + ["trace", "show", "--file", str(out)], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert response.trace_id in shown.stdout and "worker spans missing" not in shown.stdout

    # The step budget joins each step span with its two workers' spans, across the processes.
    budget = subprocess.run([sys.executable, "scripts/step_budget.py", str(out)], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert budget.returncode == 0, budget.stderr
    # Counted: the steps whose draft model proposed in a hop of their own (not model-free
    # ones, nor one whose proposal came with the last step's recovered token).
    counted = int(budget.stdout.split(" speculative steps")[0])
    assert 1 <= counted <= sum(1 for s in spans if s["name"] == "specd.step" and s["attributes"]["specd.draft_length"])
    rows = {name.strip(): float(ms) for name, ms in (line.rsplit(None, 1) for line in budget.stdout.splitlines()[1:])}
    assert 0 < rows["draft forward"] < rows["draft hop"] and 0 < rows["verify forward"] < rows["verify hop"]
