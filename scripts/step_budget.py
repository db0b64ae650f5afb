"""Where a speculative step's time goes, from the spans `specd trace collect` wrote: per hop,
the model's forward, the rest of the worker's step, and the transport around it; and the
gateway's own time between the hops.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4399 specd serve &
    specd trace collect --port 4399 --out spans.jsonl &
    python scripts/closed_loop.py --mode fixed --seconds 10
    python scripts/step_budget.py spans.jsonl

Each `specd.step` span (the gateway's) is joined with its children, the workers' step spans
(`specd.draft.propose`, `specd.draft.recover`, `specd.verifier.verify`). For each hop:
`hop` is the gateway's wait for the worker (`specd.draft.hop_ms`, `specd.verify.hop_ms`),
`forward` the worker's forwards (`specd.forward_ms`), `handler` the worker's span less its
forwards, and `transport` the hop less the worker's span: gRPC both ways, each side's
poller thread and event loop, the stream's reader and writer. Medians over the steps
that have both hops; tracing's own cost is in every figure (docs/tracing.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

WORKER_SPANS = {"specd.draft.propose": "draft", "specd.draft.recover": "draft", "specd.verifier.verify": "verify"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spans", help="a JSONL file of spans from `specd trace collect`")
    args = parser.parse_args()
    steps: dict[str, dict] = {}
    hops: defaultdict[str, dict[str, dict]] = defaultdict(dict)  # a step span's id → its workers' spans by hop
    with open(args.spans) as lines:
        for line in lines:
            span = json.loads(line)
            if span["name"] == "specd.step":
                steps[span["span_id"]] = span
            elif span["name"] in WORKER_SPANS:
                hops[span["parent_span_id"]][WORKER_SPANS[span["name"]]] = span
    rows: defaultdict[str, list[float]] = defaultdict(list)
    for span_id, step in steps.items():
        workers = hops.get(span_id, {})
        if set(workers) != {"draft", "verify"}:
            continue  # a plain step, or one whose spans did not all arrive
        attributes = step["attributes"]
        gateway_own = step["duration_ms"]
        for hop, worker in workers.items():
            waited, forward = attributes[f"specd.{hop}.hop_ms"], worker["attributes"]["specd.forward_ms"]
            rows[f"{hop} hop"].append(waited)
            rows[f"  {hop} forward"].append(forward)
            rows[f"  {hop} handler"].append(worker["duration_ms"] - forward)
            rows[f"  {hop} transport"].append(waited - worker["duration_ms"])
            gateway_own -= waited
        rows["step"].append(step["duration_ms"])
        rows["gateway's own"].append(gateway_own)
    if not rows:
        raise SystemExit(f"{args.spans}: no step with both a draft and a verify span")
    print(f"{len(rows['step'])} speculative steps, median ms:")
    for name in ("step", "draft hop", "  draft forward", "  draft handler", "  draft transport", "verify hop",
                 "  verify forward", "  verify handler", "  verify transport", "gateway's own"):
        print(f"  {name:<22} {statistics.median(rows[name]):7.2f}")


if __name__ == "__main__":
    main()
