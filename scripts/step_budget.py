"""Where a speculative step's time goes, from the spans `specd trace collect` wrote: per hop,
the model's forward, the rest of the worker's step, and the transport around it; and the
gateway's own time between the hops.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4399 specd serve &
    specd trace collect --port 4399 --out spans.jsonl &
    python scripts/closed_loop.py --mode fixed --seconds 10
    python scripts/step_budget.py spans.jsonl

Each `specd.step` span (the gateway's) is joined with its children, the workers' step spans,
as `specd trace show` joins them (`specd_cli.trace.step_rows`). Only the steps whose draft
model proposed in their own hop count: a model-free proposal has no draft hop, and a
proposal drafted in the last step's recovery hop (`specd.draft.in_hand`) has its hop in
that step. For each hop: `hop` is the gateway's wait for the worker (`specd.draft.hop_ms`,
`specd.verify.hop_ms`), `forward` the worker's forwards (`specd.forward_ms`), `handler`
the worker's span less its forwards, and `transport` the hop less the worker's span: gRPC
both ways, each side's poller thread and event loop, the stream's reader and writer. The
gateway's own time is the step's span less its hops, a recovery hop included. Medians;
tracing's own cost is in every figure (docs/tracing.md).
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from specd_cli.trace import StepRow, load_spans, step_rows

ROWS = ("step", "draft hop", "  draft forward", "  draft handler", "  draft transport", "verify hop",
        "  verify forward", "  verify handler", "  verify transport", "gateway's own")


def budget(rows: list[StepRow]) -> dict[str, list[float]]:
    """Each figure of the table, one value per step that had both hops of its own."""
    figures: defaultdict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.draft is None or row.verify is None or row.attr("specd.draft.in_hand", False):
            continue
        for hop, worker in (("draft", row.draft), ("verify", row.verify)):
            waited, forward = row.attr(f"specd.{hop}.hop_ms"), worker["attributes"]["specd.forward_ms"]
            figures[f"{hop} hop"].append(waited)
            figures[f"  {hop} forward"].append(forward)
            figures[f"  {hop} handler"].append(worker["duration_ms"] - forward)
            figures[f"  {hop} transport"].append(waited - worker["duration_ms"])
        figures["step"].append(row.step["duration_ms"])
        figures["gateway's own"].append(row.gateway_ms)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spans", type=Path, help="a JSONL file of spans from `specd trace collect`")
    args = parser.parse_args()
    by_trace: defaultdict[str, list[dict]] = defaultdict(list)
    for span in load_spans(args.spans):
        by_trace[span["trace_id"]].append(span)
    figures = budget([row for spans in by_trace.values() for row in step_rows(spans)])
    if not figures:
        raise SystemExit(f"{args.spans}: no step with a draft hop and a verify hop of its own")
    print(f"{len(figures['step'])} speculative steps, median ms:")
    for name in ROWS:
        print(f"  {name:<22} {statistics.median(figures[name]):7.2f}")


if __name__ == "__main__":
    main()
