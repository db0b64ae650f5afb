"""Where AUTO's load cap starts: γ priced from measured costs before the first request.

A load cap (`gateway.policy.loadcap.LoadCap`) learned by trials alone is learned by losing: a
level starting at the longest draft costs a CPU 10–20% of throughput under load until its
trials bring it down, in every new replica. The information needed is not secret, so it
is measured up front:

- each worker times its batched forward at load, for the batch sizes and widths it will
  serve (`ModelInfo.forward_costs`): T(B, w), B sessions feeding w tokens each;
- the gateway times, at start-up, one plain and one speculative request alone
  (`measure_overheads`, excluded from every statistic): what a step costs beyond the
  forwards (hops, serialization, the gateway's own work), per session.

At load B, γ's goodput per session is then priced as

    E[tokens per step](α, γ) / (T_target(B, γ+1) + γ·T_draft(B, 1) + B·overhead_spec)

against plain decoding's 1 / (T_target(B, 1) + B·overhead_plain), with α the general
task's prior acceptance. The overheads are counted per session, since each session's hop
costs the shared CPUs its own work. A level's cap starts at the best of those
(`prior_caps`), and the load cap's trials move it from there as before, with the
predicted goodput ratios weighed in as two trials' worth of evidence (`LoadCap`): one
noisy trial does not overturn what the costs say, a few agreeing ones do. The prior is
the same for every gateway that reads the same workers, so a new replica starts where the
others did, not from the longest draft. Pure Python; no gRPC.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import context, trace

from gateway.request import ClientRequest
from gateway.stats.costmodel import LOAD_BUCKETS, expected_tokens
from specd.steps import ModelInfo

log = logging.getLogger(__name__)


class ForwardTable:
    """A worker's measured forward times, T(batch, width), read piecewise linearly in both
    (and extended linearly past the largest measured).

    A forward of more sessions, or of more tokens each, never costs less; a noisy
    measurement at load can say it does (a machine busy while the smaller batch was timed),
    and read linearly past the table it would then fall, to nothing at some load, where
    the prices divide by it. So each figure is raised to the largest at a smaller batch or
    width. A table that is not a whole grid of positive times (from a worker that measured
    nothing, or wrongly) is no table: the caps then learn by trials alone."""

    def __init__(self, costs: Sequence[tuple[int, int, float]]) -> None:
        self.batches = sorted({b for b, _, _ in costs})
        self.widths = sorted({w for _, w, _ in costs})
        measured = {(b, w): ms for b, w, ms in costs}
        self._ms: dict[tuple[int, int], float] = {}
        if len(measured) != len(self.batches) * len(self.widths) or not all(ms > 0 for ms in measured.values()):
            if costs:
                log.warning("forward costs that are not a grid of positive times: no prior from them")
            self.batches, self.widths = [], []
            return
        for i, b in enumerate(self.batches):
            for j, w in enumerate(self.widths):
                below = [self._ms[(self.batches[i - 1], w)]] if i else []
                below += [self._ms[(b, self.widths[j - 1])]] if j else []
                self._ms[(b, w)] = max([measured[(b, w)], *below])

    def __bool__(self) -> bool:
        return bool(self._ms)

    @staticmethod
    def _between(points: list[int], x: float) -> tuple[int, int, float]:
        """The two measured points x lies between (or the last two, past the end), and x's
        place between them (0 at the first)."""
        if len(points) == 1:
            return points[0], points[0], 0.0
        i = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
        low, high = points[i - 1], points[i]
        return low, high, (x - low) / (high - low)

    def _at_width(self, batch: int, width: float) -> float:
        low, high, t = self._between(self.widths, width)
        return self._ms[(batch, low)] + t * (self._ms[(batch, high)] - self._ms[(batch, low)])

    def ms(self, batch: float, width: float) -> float:
        low, high, t = self._between(self.batches, batch)
        at_low = self._at_width(low, width)
        # Past the widest measured, each batch's line runs on at its own slope, and a larger
        # batch's may run below a smaller one's; more sessions never cost less, so the larger
        # batch is read at least at the smaller's (else, read on past the largest batch, the
        # price could fall to nothing and the priors would divide by it).
        at_high = max(self._at_width(high, width), at_low)
        return at_low + t * (at_high - at_low)


@dataclass(frozen=True)
class Overheads:
    """What one session's step costs beyond the forwards, in ms: a plain step (the verifier
    may run ahead), and a speculative one (a draft hop and a verify hop)."""

    plain_ms: float
    spec_ms: float


def prior_rates(target: ForwardTable, draft: ForwardTable | None, alpha: float, max_draft_length: int,
                overheads: Overheads, loads: Sequence[int] = LOAD_BUCKETS) -> dict[int, list[float]]:
    """The goodput the measured costs predict at each load level for each γ from 0 (plain
    decoding) to `max_draft_length`, in tokens per ms per forward."""
    rates = {}
    for load in loads:
        at_load = [1.0 / (target.ms(load, 1) + load * overheads.plain_ms)]
        for gamma in range(1, max_draft_length + 1):
            drafting = gamma * draft.ms(load, 1) if draft else 0.0
            at_load.append(expected_tokens(alpha, gamma)
                           / (target.ms(load, gamma + 1) + drafting + load * overheads.spec_ms))
        rates[load] = at_load
    return rates


def best_caps(rates: dict[int, list[float]]) -> dict[int, int]:
    """The γ each load level's predicted goodput favours (0: plain decoding)."""
    return {load: max(range(len(at_load)), key=at_load.__getitem__) for load, at_load in rates.items()}


def prior_caps(target: ForwardTable, draft: ForwardTable | None, alpha: float, max_draft_length: int,
               overheads: Overheads, loads: Sequence[int] = LOAD_BUCKETS) -> dict[int, int]:
    """The γ that the measured costs favour at each load level (0: plain decoding)."""
    return best_caps(prior_rates(target, draft, alpha, max_draft_length, overheads, loads))


# The start-up probes: a short prompt, and enough tokens for several steps.
PROBE_PROMPT = "def fibonacci(n):"
PROBE_TOKENS = 24
PROBE_GAMMA = 4


class _Summary(Protocol):
    @property
    def steps(self) -> int: ...


class _Chunk(Protocol):
    @property
    def summary(self) -> _Summary | None: ...


async def measure_overheads(target_info: ModelInfo, draft_info: ModelInfo | None,
                            generate: Callable[[ClientRequest], AsyncIterator[_Chunk]]) -> Overheads | None:
    """Time one plain and one speculative request alone through `generate` (the core's, with
    the doctor's segment: left out of every statistic) and take from each step's time what
    the workers' forwards cost; None when there is no draft, no forward costs, or a probe
    fails."""
    from specd.contract import DIAGNOSTIC_SEGMENT

    target = ForwardTable(target_info.forward_costs)
    draft = ForwardTable(draft_info.forward_costs if draft_info is not None else ())
    if not target or not draft or draft_info is None:
        return None
    per_step = {}
    # Under a parent span that is not sampled, so the probes leave no trace in the
    # collector (the workers read the flag from the step's carrier too).
    unsampled = trace.NonRecordingSpan(trace.SpanContext(1, 1, is_remote=False, trace_flags=trace.TraceFlags(0)))
    token = context.attach(trace.set_span_in_context(unsampled))
    try:
        # The first request through a fresh gateway also pays for first-time set-up: a
        # warm-up, not counted.
        for mode, gamma in (("off", 0), ("off", 0), ("fixed", PROBE_GAMMA)):
            probe = ClientRequest(prompt=PROBE_PROMPT, max_new_tokens=PROBE_TOKENS, mode=mode, draft_length=gamma,
                                  draft_model=draft_info.name if gamma else "",
                                  user_segment=DIAGNOSTIC_SEGMENT, seed=1)
            began = time.perf_counter()
            summary = None
            async for chunk in generate(probe):
                summary = chunk.summary or summary
            total_ms = (time.perf_counter() - began) * 1e3
            if summary is None or not summary.steps:
                return None
            forwards = target.ms(1, gamma + 1) + gamma * draft.ms(1, 1)
            per_step[mode] = max(0.0, total_ms / summary.steps - forwards)
    except Exception as exc:  # noqa: BLE001 - a prior is a help, never a reason not to serve
        log.warning("the start-up probes failed (%s); AUTO's load cap learns from the longest draft", exc)
        return None
    finally:
        context.detach(token)
    # A speculative step does all a plain one does (a verify hop, the gateway's verdict and
    # stream) and a draft hop besides. Where the forward table prices its forwards above
    # what they took (timed on a busier machine), the remainder can fall below the plain
    # step's, even to nothing: priced so, SmolLM2's draft looked worth γ = 1 to 3 at every load.
    return Overheads(per_step["off"], max(per_step["fixed"], per_step["off"]))
