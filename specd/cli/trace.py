"""`specd trace`: look at speculation traces without a tracing backend.

    specd trace collect --port 4317 --out traces.jsonl
        an OTLP/gRPC trace receiver; every span it receives becomes one JSON line.
        Point the services at it with OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317.
    specd trace show [TRACE_ID] --file traces.jsonl
        one request's step table (γ, accepted, first rejection, time and bytes of each
        hop) and where its acceptance and its time went; the latest request by default.

A span line holds: trace_id, span_id, parent_span_id (hex), name, kind, service,
start_ns, end_ns, duration_ms, attributes (plain JSON values), status. Span names and
attributes are those of docs/tracing.md.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.proposers import MODEL_FREE

DEFAULT_FILE = "specd-traces.jsonl"


# -- collect ---------------------------------------------------------------------------------

def any_value(value) -> Any:
    """An OTLP AnyValue as a plain JSON value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def span_records(request) -> Iterable[dict]:
    """One JSON-ready dict per span of an ExportTraceServiceRequest."""
    from opentelemetry.proto.trace.v1 import trace_pb2

    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        service = resource.get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield {
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_").lower(),
                    "service": service,
                    "scope": scope_spans.scope.name,
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "duration_ms": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
                    "attributes": {kv.key: any_value(kv.value) for kv in span.attributes},
                    "status": {"code": trace_pb2.Status.StatusCode.Name(span.status.code)
                               .removeprefix("STATUS_CODE_").lower(),
                               "message": span.status.message},
                }


def start_collector(out: Path, port: int = 0, host: str = "127.0.0.1"):
    """Start an OTLP/gRPC trace receiver appending spans to `out`; return (server, port)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    lock = threading.Lock()

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            lines = "".join(json.dumps(record) + "\n" for record in span_records(request))
            with lock, out.open("a", encoding="utf-8") as sink:  # whole batches, in order
                sink.write(lines)
            return trace_service_pb2.ExportTraceServiceResponse()

    # Exclusive port, as every specd server (specd.grpcserver.SERVER_OPTIONS says why).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's "Failed to bind to address ..."
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}: the port is taken; choose another")
    server.start()
    return server, bound


def cmd_collect(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        server, port = start_collector(out, args.port, args.host)
    except OSError as exc:
        print(f"specd trace collect: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"specd trace collect: OTLP/gRPC on {args.host}:{port}, appending spans to {out}; "
          f"export with OTEL_EXPORTER_OTLP_ENDPOINT=http://{args.host}:{port}", flush=True)
    stop.wait()
    server.stop(grace=2).wait()
    return 0


# -- show ------------------------------------------------------------------------------------

def load_spans(path: Path) -> list[dict]:
    """Every span of a `collect` file; a line cut short by a crash is skipped."""
    spans = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


def pick_trace(spans: list[dict], trace_id: str | None) -> list[dict]:
    """The spans of `trace_id` (a unique prefix will do), or of the latest request's trace."""
    if trace_id:
        ids = {s["trace_id"] for s in spans if s["trace_id"].startswith(trace_id.lower())}
        if len(ids) != 1:
            raise LookupError(f"{len(ids)} traces match {trace_id!r}" + (": give more digits" if ids else ""))
        (chosen,) = ids
    else:
        requests = [s for s in spans if s["name"] == "specd.generate"]
        if not requests:
            raise LookupError("no specd.generate span in the file yet")
        chosen = max(requests, key=lambda s: s["end_ns"])["trace_id"]
    return [s for s in spans if s["trace_id"] == chosen]


@dataclass
class StepRow:
    """One `specd.step` span with its draft and verifier children."""

    step: dict
    draft: dict | None
    verify: dict | None
    pre_draft: dict | None = None  # overlap: the draft's pre-drafting of the next step

    @property
    def overlap_ms(self) -> float | None:
        """How long the draft pre-drafted the next step while the target verified this one."""
        if self.pre_draft is None or self.verify is None:
            return None
        return max(0.0, (min(self.pre_draft["end_ns"], self.verify["end_ns"]) - self.pre_draft["start_ns"]) / 1e6)

    def attr(self, key: str, default: Any = 0) -> Any:
        return self.step["attributes"].get(key, default)

    @property
    def verify_forward_ms(self) -> float | None:
        """The target's forward time for this step: its verifier span's, or, for a step the
        verifier answered unasked (no span of its own), what the answer reported."""
        if self.attr("specd.ran_ahead", False):
            return self.attr("specd.verify.forward_ms", None)
        return _forward(self.verify)

    @property
    def model_free(self) -> bool:
        """The step's proposal was made in the gateway, with no draft hop (gateway.proposers)."""
        return self.attr("specd.proposer", "") in MODEL_FREE

    @property
    def gateway_ms(self) -> float:
        """The step's time outside its hops: rejection sampling and bookkeeping. A proposal in
        hand was drafted in the last step's span (its recovery hop), not in this one."""
        draft_ms = 0.0 if self.attr("specd.draft.in_hand", False) else self.attr("specd.draft.hop_ms")
        return (self.step["duration_ms"] - draft_ms - self.attr("specd.verify.hop_ms")
                - self.attr("specd.draft.recovery_ms"))


def step_rows(spans: list[dict]) -> list[StepRow]:
    """The trace's steps in order, each joined to its children by parent span id. A step whose
    proposal came in hand (`specd.draft.in_hand`) gets the last step's `specd.draft.recover`
    span as its draft span: that hop drafted it."""
    children: dict[tuple[str, str], dict] = {(s["parent_span_id"], s["name"]): s for s in spans}
    steps = sorted((s for s in spans if s["name"] == "specd.step"),
                   key=lambda s: s["attributes"].get("specd.step.index", 0))
    rows = []
    for before, step in zip([None, *steps], steps):
        draft = children.get((step["span_id"], "specd.draft.propose"))
        if before is not None and step["attributes"].get("specd.draft.in_hand"):
            draft = children.get((before["span_id"], "specd.draft.recover"))
        rows.append(StepRow(step, draft, children.get((step["span_id"], "specd.verifier.verify")),
                            children.get((step["span_id"], "specd.draft.pre_draft"))))
    return rows


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _forward(span: dict | None) -> float | None:
    return None if span is None else span["attributes"].get("specd.forward_ms")


def render(spans: list[dict]) -> str:
    """The text `specd trace show` prints for one trace's spans."""
    request = next((s for s in spans if s["name"] == "specd.generate"), None)
    rows = step_rows(spans)
    trace_id = spans[0]["trace_id"]
    services = sorted({s["service"] for s in spans})
    out = [f"trace {trace_id}  ({len(spans)} spans from {', '.join(services)})"]
    if request is not None:
        a = request["attributes"]
        out.append(
            f"request: {request['duration_ms']:.1f} ms · model pair {a.get('specd.model_pair', '?')} · "
            f"task {a.get('specd.task_type') or '-'} · segment {a.get('specd.user_segment') or '-'} · "
            f"temperature {a.get('gen_ai.request.temperature', 0):g} · seed {a.get('gen_ai.request.seed', '?')}")
        out.append(
            f"tokens: prompt {a.get('gen_ai.usage.input_tokens', '?')}, generated "
            f"{a.get('gen_ai.usage.output_tokens', '?')} "
            f"({', '.join(a.get('gen_ai.response.finish_reasons', [])) or 'unfinished'}); "
            f"{a.get('specd.steps', len(rows))} steps, {a.get('specd.accepted_tokens', '?')}/"
            f"{a.get('specd.proposed_tokens', '?')} draft tokens accepted "
            f"(acceptance rate {a.get('specd.acceptance_rate', 0):.2f}), "
            f"{a.get('specd.mean_tokens_per_step', 0):.2f} tokens per step")
        if request["status"]["code"] == "error":
            out.append(f"FAILED: {request['status']['message']}")
    if not rows:
        out.append("no specd.step spans in this trace")
        return "\n".join(out)

    out.append("")
    overlapped = any(row.pre_draft is not None or row.attr("specd.pre_drafted", False) for row in rows)
    # Who proposed, when a model-free proposer or more than one proposer did.
    proposers = {row.attr("specd.proposer", "") for row in rows} - {""}
    by = len(proposers) > 1 or any(row.model_free for row in rows)
    header = (f"{'step':>4} {'γ':>3} {'acc':>4} {'rej':>4} {'token':>9} {'draft ms':>9} {'(fwd)':>7} "
              f"{'verify ms':>10} {'(fwd)':>7} {'gateway ms':>11} {'bytes':>9}") + (f" {'by':>15}" if by else "")
    if overlapped:
        # "hit": this step's proposal was pre-drafted; "‖ N ms": the next step was being
        # drafted for N ms while the target verified this one.
        header += f" {'overlap':>14}"
    out += [header, "-" * len(header)]
    for row in rows:
        rejected = row.attr("specd.first_rejected", None)
        drafted = row.attr("specd.draft_length") > 0 and not row.model_free
        out.append(
            f"{row.attr('specd.step.index'):>4} {row.attr('specd.draft_length'):>3} {row.attr('specd.accepted'):>4} "
            f"{'-' if rejected is None else rejected:>4} {row.attr('specd.token.kind', '?'):>9} "
            f"{_ms(row.attr('specd.draft.hop_ms')):>9} {_ms(_forward(row.draft)) if drafted else '-':>7} "
            f"{_ms(row.attr('specd.verify.hop_ms')):>10} {_ms(row.verify_forward_ms):>7} "
            f"{_ms(row.gateway_ms):>11} {row.attr('specd.draft.bytes') + row.attr('specd.verify.bytes'):>9,}"
            + (f" {row.attr('specd.proposer', '-')[:15]:>15}" if by else "")
            + (f" {_overlap_cell(row):>14}" if overlapped else ""))
    out += ["", *summary(rows, request)]
    return "\n".join(out)


def _overlap_cell(row: StepRow) -> str:
    hit = "hit" if row.attr("specd.pre_drafted", False) else ""
    during = row.overlap_ms
    return f"{hit} ‖ {during:.1f} ms".strip() if during is not None else hit


def summary(rows: list[StepRow], request: dict | None) -> list[str]:
    """Acceptance by position inside the draft, and the time of each hop."""
    lines = []
    reached: dict[int, int] = {}
    kept: dict[int, int] = {}
    for row in rows:
        for position in range(1, row.attr("specd.draft_length") + 1):
            reached[position] = reached.get(position, 0) + 1
            kept[position] = kept.get(position, 0) + (position <= row.attr("specd.accepted"))
    if reached:
        lines.append("acceptance by draft position: " + "  ".join(
            f"{p}: {kept[p]}/{reached[p]} ({kept[p] / reached[p]:.2f})" for p in sorted(reached)))
    lines.append("time per hop, summed over steps (ms):")
    for hop in ("draft", "verify"):
        # Plain target steps (γ = 0) have no draft hop, hence no draft span; nor do steps a
        # model-free proposer drafted in the gateway. Steps the verifier answered unasked
        # (run-ahead) have no verifier span: their forward time is the step's own attribute.
        if hop == "draft":
            hopped = [r for r in rows if r.attr("specd.draft_length") and not r.model_free]
            forward_ms = sum(_forward(r.draft) or 0.0 for r in hopped)
        else:
            hopped = [r for r in rows if not r.attr("specd.ran_ahead", False)]
            forward_ms = sum(r.verify_forward_ms or 0.0 for r in rows)
        hop_ms = sum(r.attr(f"specd.{hop}.hop_ms") for r in rows)
        workers = [getattr(r, hop) for r in hopped]
        missing = sum(w is None for w in workers)
        note = f"; {missing} worker spans missing" if missing else ""
        lines.append(f"  {hop:<8} {hop_ms:9.1f}  (model forward {forward_ms:.1f}, wire and queue "
                     f"{hop_ms - forward_ms:.1f}; {sum(r.attr(f'specd.{hop}.bytes') for r in rows):,} bytes{note})")
    gateway_ms = sum(r.gateway_ms for r in rows)
    lines.append(f"  {'gateway':<8} {gateway_ms:9.1f}  (acceptance decisions and bookkeeping inside steps)")
    if request is not None:
        inside = sum(r.step["duration_ms"] for r in rows)
        lines.append(f"  {'other':<8} {request['duration_ms'] - inside:9.1f}  "
                     f"(outside steps: tokenizing, streaming to the client)")
    return lines


def cmd_show(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        print(f"specd trace show: no span file at {path}; run `specd trace collect --out {path}` "
              f"and send requests with OTEL_EXPORTER_OTLP_ENDPOINT pointing at it", file=sys.stderr)
        return 1
    try:
        spans = pick_trace(load_spans(path), args.trace_id)
    except LookupError as exc:
        print(f"specd trace show: {exc} in {path}", file=sys.stderr)
        return 1
    print(render(spans))
    return 0


def add_parser(sub) -> None:
    """Add `trace collect` and `trace show` to the `specd` command's subparsers."""
    trace = sub.add_parser("trace", help="collect and inspect speculation traces (no tracing backend needed)")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    collect = commands.add_parser("collect", help="receive OTLP/gRPC spans into a JSONL file")
    collect.add_argument("--host", default="127.0.0.1", help="interface to bind")
    collect.add_argument("--port", type=int, default=4317, help="port to listen on (0: any free port)")
    collect.add_argument("--out", default=DEFAULT_FILE, help=f"file to append spans to (default {DEFAULT_FILE})")
    collect.set_defaults(func=cmd_collect)
    show = commands.add_parser("show", help="print a request's steps, acceptance and time per hop")
    show.add_argument("trace_id", nargs="?", help="trace id or a unique prefix (default: the latest request)")
    show.add_argument("--file", default=DEFAULT_FILE, help=f"spans written by `collect` (default {DEFAULT_FILE})")
    show.set_defaults(func=cmd_show)
