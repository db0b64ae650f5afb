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
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.contract import MODEL_FREE

DEFAULT_FILE = "specd-traces.jsonl"
# The longest span line: `collect` drops longer ones, `show` skips them unread.
MAX_LINE_BYTES = 1 << 20


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
                    "kind": _enum_name(trace_pb2.Span.SpanKind, span.kind, "SPAN_KIND_"),
                    "service": service,
                    "scope": scope_spans.scope.name,
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "duration_ms": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
                    "attributes": {kv.key: any_value(kv.value) for kv in span.attributes},
                    "status": {"code": _enum_name(trace_pb2.Status.StatusCode, span.status.code, "STATUS_CODE_"),
                               "message": span.status.message},
                }


def _enum_name(enum, value: int, prefix: str) -> str:
    """An OTLP enum's name in lower case; an unknown value (a newer sender) as its number."""
    try:
        return enum.Name(value).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


# What one export request may add to the file: a few KB of compressed OTLP can expand to
# hundreds of MB of JSON. Spans past the cap, and lines `show` would skip, are dropped.
MAX_EXPORT_BYTES = 16 << 20
DEFAULT_MAX_FILE_BYTES = 256 << 20


def export_lines(request) -> tuple[list[str], int]:
    """The JSON lines of an export request's spans within the caps, and how many were dropped."""
    lines: list[str] = []
    size = dropped = 0
    for record in span_records(request):
        line = json.dumps(record) + "\n"
        if len(line) > MAX_LINE_BYTES or size + len(line) > MAX_EXPORT_BYTES:
            dropped += 1
            continue
        lines.append(line)
        size += len(line)
    return lines, dropped


def start_collector(out: Path, port: int = 0, host: str = "127.0.0.1", max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
    """Start an OTLP/gRPC trace receiver appending spans to `out`; return (server, port).
    Past max_file_bytes the file moves to `out`.1 (replacing the one before) and a new one starts."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    lock = threading.Lock()
    older = out.with_name(out.name + ".1")

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            lines, dropped = export_lines(request)
            size = sum(len(line) for line in lines)
            with lock:  # whole batches, in order
                if out.exists() and out.stat().st_size + size > max_file_bytes:
                    out.replace(older)
                with out.open("a", encoding="utf-8") as sink:
                    sink.writelines(lines)
            if dropped:
                print(f"specd trace collect: dropped {dropped} spans over the per-request cap of "
                      f"{MAX_EXPORT_BYTES >> 20} MiB or the line cap of {MAX_LINE_BYTES >> 20} MiB", file=sys.stderr)
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
        server, port = start_collector(out, args.port, args.host, args.max_mib << 20)
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

# A trace of more spans than this is not shown (a request of thousands of steps has a few thousand).
MAX_TRACE_SPANS = 200_000
# Attributes the table computes with: each must be a number (or absent), and counts must be
# small enough to loop over (a draft_length of 1e8 once cost 6 GB).
_NUMBERS = ("gen_ai.request.temperature", "specd.acceptance_rate", "specd.mean_tokens_per_step",
            "specd.draft.hop_ms", "specd.verify.hop_ms", "specd.draft.recovery_ms", "specd.verify.forward_ms",
            "specd.forward_ms")
_COUNTS = ("specd.step.index", "specd.draft_length", "specd.accepted", "specd.draft.bytes", "specd.verify.bytes",
           "specd.first_rejected")
MAX_COUNT = 1 << 40
MAX_DRAFT_LENGTH = 4096
_SPAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "trace_id": str, "span_id": str, "parent_span_id": str, "name": str, "service": str, "start_ns": int,
    "end_ns": int, "duration_ms": (int, float), "attributes": dict, "status": dict}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_COUNT


def valid_span(span: Any) -> bool:
    """Whether a parsed line is a span `show` can print: its fields of their types, and the
    attributes it computes with numbers of bounded size."""
    if not isinstance(span, dict):
        return False
    for name, kind in _SPAN_FIELDS.items():
        if not isinstance(span.get(name), kind) or isinstance(span.get(name), bool):
            return False
    status, attributes = span["status"], span["attributes"]
    if not isinstance(status.get("code"), str) or not isinstance(status.get("message", ""), str):
        return False
    if not all(_is_number(attributes[k]) for k in _NUMBERS if k in attributes):
        return False
    if not all(isinstance(attributes[k], int) and _is_number(attributes[k]) for k in _COUNTS
               if attributes.get(k) is not None):
        return False
    if not 0 <= attributes.get("specd.draft_length", 0) <= MAX_DRAFT_LENGTH:
        return False
    reasons = attributes.get("gen_ai.response.finish_reasons", [])
    return isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)


def _lines(path: Path) -> Iterable[str | None]:
    """The file's lines, streamed; None for a line over MAX_LINE_BYTES (skipped unread)."""
    with path.open("rb") as source:
        while True:
            line = source.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while (rest := source.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass
                yield None
                continue
            yield line.decode("utf-8", errors="replace")


@dataclass
class SpanFile:
    """What one pass over a `collect` file found: the spans kept, and the lines skipped."""

    spans: list[dict]
    skipped: int = 0


def read_spans(path: Path, keep: Callable[[dict], bool]) -> SpanFile:
    """The valid spans of a `collect` file that `keep` accepts, streamed; every other line
    (malformed, cut short by a crash, too long, hostile) skipped and counted."""
    found = SpanFile([])
    for line in _lines(path):
        try:
            span = json.loads(line) if line is not None else None
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            span = None
        if not valid_span(span):
            found.skipped += line is None or bool(line.strip())
            continue
        assert span is not None
        if keep(span):
            if len(found.spans) >= MAX_TRACE_SPANS:
                raise LookupError(f"the trace has more than {MAX_TRACE_SPANS:,} spans")
            found.spans.append(span)
    return found


def load_spans(path: Path) -> list[dict]:
    """Every valid span of a `collect` file (scripts read whole files of their own runs)."""
    return read_spans(path, lambda span: True).spans


def load_trace(path: Path, trace_id: str | None) -> SpanFile:
    """The spans of one trace, chosen as `pick_trace` chooses, in two streamed passes: the
    first keeps one small record a trace (its latest specd.generate span, else its first
    span), the second the chosen trace's spans."""
    heads: dict[str, dict] = {}

    def note(span: dict) -> bool:
        known = heads.get(span["trace_id"])
        if known is None or span["name"] == "specd.generate" and (
                known["name"] != "specd.generate" or span["end_ns"] > known["end_ns"]):
            heads[span["trace_id"]] = {key: span[key] for key in ("trace_id", "name", "end_ns")}
        return False

    read_spans(path, note)
    chosen = pick_trace(list(heads.values()), trace_id)[0]["trace_id"]
    return read_spans(path, lambda span: span["trace_id"] == chosen)


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


# C0 and C1 controls but the newline, and the bidirectional overrides: span text is the
# caller's (prompts' task types, segments, error messages) and must not drive the terminal.
_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text with every control character but the newline shown as U+FFFD."""
    return _CONTROLS.sub("\ufffd", text)


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
        """The step's proposal was made in the gateway, with no draft hop (gateway.proposers.modelfree)."""
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
        found = load_trace(path, args.trace_id)
    except LookupError as exc:
        print(printable(f"specd trace show: {exc} in {path}"), file=sys.stderr)
        return 1
    print(printable(render(found.spans)))
    if found.skipped:
        print(f"specd trace show: skipped {found.skipped} lines of {path} that are not spans specd wrote",
              file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    """Add `trace collect` and `trace show` to the `specd` command's subparsers."""
    trace = sub.add_parser("trace", help="collect and inspect speculation traces (no tracing backend needed)")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    collect = commands.add_parser("collect", help="receive OTLP/gRPC spans into a JSONL file")
    collect.add_argument("--host", default="127.0.0.1", help="interface to bind")
    collect.add_argument("--port", type=int, default=4317, help="port to listen on (0: any free port)")
    collect.add_argument("--out", default=DEFAULT_FILE, help=f"file to append spans to (default {DEFAULT_FILE})")
    collect.add_argument("--max-mib", type=int, default=DEFAULT_MAX_FILE_BYTES >> 20,
                         help="past this many MiB the file moves to FILE.1 and a new one starts")
    collect.set_defaults(func=cmd_collect)
    show = commands.add_parser("show", help="print a request's steps, acceptance and time per hop")
    show.add_argument("trace_id", nargs="?", help="trace id or a unique prefix (default: the latest request)")
    show.add_argument("--file", default=DEFAULT_FILE, help=f"spans written by `collect` (default {DEFAULT_FILE})")
    show.set_defaults(func=cmd_show)
