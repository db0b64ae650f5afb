"""`specd trace show` and `collect` on hostile input: span text that would drive the
terminal, malformed and oversized lines, counts that would cost gigabytes, and OTLP
requests that expand or carry enum values the receiver does not know."""
from __future__ import annotations

import json
import subprocess
import sys

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from specd_cli import trace as trace_cli

TRACE = "ab" * 16


def span(name: str, span_id: str, parent: str = "", **attributes) -> dict:
    return {"trace_id": TRACE, "span_id": span_id, "parent_span_id": parent, "name": name, "kind": "internal",
            "service": "specd-gateway", "scope": "specd", "start_ns": 1_000, "end_ns": 2_000_000, "duration_ms": 2.0,
            "attributes": attributes, "status": {"code": "unset", "message": ""}}


def show(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd_cli", "trace", "show", "--file", str(path)],
                          capture_output=True, timeout=60)


def test_show_prints_no_control_characters_and_skips_malformed_lines(tmp_path):
    escapes = "\x1b[2J\x1b]0;owned\x07\x1b]52;c;ZXZpbA==\x07\u202e"
    request = span("specd.generate", "01", **{"specd.task_type": f"code{escapes}", "specd.user_segment": escapes,
                                              "specd.model_pair": f"a{escapes}->b"})
    request["status"] = {"code": "error", "message": f"failed {escapes}"}
    step = span("specd.step", "02", "01", **{"specd.step.index": 0, "specd.draft_length": 2, "specd.accepted": 1,
                                             "specd.proposer": escapes, "specd.token.kind": escapes})
    lines = [json.dumps(request), json.dumps(step),
             "[" * 100_000,  # nests too deep to parse
             "{not json", json.dumps([1, 2]), json.dumps({"trace_id": 5}),
             json.dumps({**span("specd.step", "03", "01"), "attributes": {"specd.draft_length": 10 ** 8}}),
             json.dumps({**span("specd.step", "04", "01"), "attributes": {"specd.accepted": "many"}}),
             json.dumps({**span("specd.step", "05", "01"), "duration_ms": "slow"}),
             "x" * (trace_cli.MAX_LINE_BYTES + 10),
             ""]
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = show(path)
    assert result.returncode == 0, result.stderr
    assert b"\x1b" not in result.stdout and b"\x07" not in result.stdout and "\u202e".encode() not in result.stdout
    assert b"Traceback" not in result.stderr
    text = result.stdout.decode()
    assert "FAILED: failed" in text and "\ufffd" in text
    assert "skipped 8 lines" in result.stderr.decode()


def test_show_says_when_nothing_in_the_file_is_a_request(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text("{broken\n" + json.dumps(span("specd.step", "02", "01")) + "\n")
    result = show(path)
    assert result.returncode == 1 and b"no specd.generate span" in result.stderr and b"Traceback" not in result.stderr


def request_of(spans: int, attribute_bytes: int, kind: int = 1) -> trace_service_pb2.ExportTraceServiceRequest:
    export = trace_service_pb2.ExportTraceServiceRequest()
    scope = export.resource_spans.add().scope_spans.add()
    for i in range(spans):
        s = scope.spans.add(trace_id=bytes(16), span_id=i.to_bytes(8, "big"), name="x", kind=kind)
        s.attributes.add(key="big").value.string_value = "y" * attribute_bytes
    return export


def test_collect_caps_what_one_request_adds_and_keeps_unknown_enums():
    lines, dropped = trace_cli.export_lines(request_of(40, 1 << 20))  # each span's line over the line cap
    assert lines == [] and dropped == 40
    lines, dropped = trace_cli.export_lines(request_of(200, 200_000))  # 40 MB of JSON from one request
    assert sum(map(len, lines)) <= trace_cli.MAX_EXPORT_BYTES and dropped > 0 and lines
    lines, dropped = trace_cli.export_lines(request_of(1, 10, kind=99))  # a SpanKind this receiver predates
    assert dropped == 0 and json.loads(lines[0])["kind"] == "99"


def test_collect_rotates_the_file_past_its_cap(tmp_path):
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    out = tmp_path / "spans.jsonl"
    server, port = trace_cli.start_collector(out, 0, max_file_bytes=300_000)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            export = trace_service_pb2_grpc.TraceServiceStub(channel).Export
            for _ in range(4):
                export(request_of(1, 100_000), timeout=10)
    finally:
        server.stop(0)
    older = tmp_path / "spans.jsonl.1"
    assert older.exists() and out.stat().st_size <= 300_000 and older.stat().st_size <= 300_000
    assert len(trace_cli.load_spans(out)) + len(trace_cli.load_spans(older)) == 4  # rotated once, nothing lost
