"""What each model pair's steps cost, measured from every step the gateway runs.

One `StepCosts` per model pair (the cost model's state: hop times per γ and load level,
overlap hits; `gateway.stats.costmodel`), and how that pair's verify steps were batched
(`LoadCounts`). The cost policy reads a pair's `StepCosts`; the Prometheus exporter,
the GetAcceptanceStats RPC and each response's cost ratios read `cost_table` and
`load_snapshot`. Acceptance counters live apart, in `gateway.stats.acceptance`. No gRPC here.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from gateway.stats.costmodel import StepCosts, predicted_speedup


@dataclass(frozen=True)
class CostSummary:
    """Measured costs of one model pair: ms, and ratios to one plain target step."""

    model_pair: str
    target_step_ms: float
    draft_ms_per_token: float
    draft_cost_ratio: float  # c
    verify_cost_ratio: dict[int, float]  # γ → v(γ)


@dataclass
class LoadCounts:
    """How one model pair's verify steps were batched: sums, so means are rates of two counters."""

    steps: int = 0
    batch_size: int = 0  # Σ sessions sharing each step's verify forward
    batch_tokens: int = 0  # Σ tokens in that forward
    queue_ms: float = 0.0  # Σ time each step waited in the verifier's queue


class PairCosts:
    """Step costs and batching counters by model pair.

    Written from the gateway's event loop, read from the metrics thread: one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: dict[str, StepCosts] = {}
        self._load: dict[str, LoadCounts] = {}

    def costs(self, model_pair: str) -> StepCosts:
        """The measured step costs of a model pair (created on first use)."""
        with self._lock:
            return self._costs.setdefault(model_pair, StepCosts())

    def observe(self, model_pair: str, draft_length: int, draft_ms: float, verify_ms: float, batch_size: int = 1,
                pre_draft_asked: bool = False, pre_drafted: bool = False, verify_only: bool = False) -> None:
        """One step's hop times (hot path); batch_size: sessions that shared its verify
        forward (the load its costs were measured at). Not for a request's first step,
        which also prefills the prompt. verify_only: the draft was not this pair's (a
        model-free match), so only the verify hop says something about the pair."""
        with self._lock:
            costs = self._costs.setdefault(model_pair, StepCosts())
            costs.observe(draft_length, draft_ms, verify_ms, batch_size, pre_draft_asked, pre_drafted, verify_only)

    def record_load(self, model_pair: str, batch_size: int, batch_tokens: int, queue_ms: float) -> None:
        """Count how one step's verify forward was batched (hot path)."""
        with self._lock:
            load = self._load.setdefault(model_pair, LoadCounts())
            load.steps += 1
            load.batch_size += batch_size
            load.batch_tokens += batch_tokens
            load.queue_ms += queue_ms

    def predicted_speedup(self, model_pair: str, alpha: float, max_draft_length: int) -> float:
        """`costmodel.predicted_speedup` on a pair's costs, read under the lock: draft
        selection asks from the request parser's thread while the event loop writes."""
        with self._lock:
            return predicted_speedup(alpha, self._costs.setdefault(model_pair, StepCosts()), max_draft_length)

    def load_snapshot(self) -> dict[str, LoadCounts]:
        """A copy of the batching counters by model pair."""
        with self._lock:
            return {pair: LoadCounts(**asdict(load)) for pair, load in self._load.items()}

    def cost_table(self) -> list[CostSummary]:
        """The measured costs of every model pair seen, computed under the lock."""
        with self._lock:
            rows = []
            for pair, costs in sorted(self._costs.items()):
                target = costs.target_step_ms()
                if target is None:
                    continue
                c, v = costs.ratios()
                rows.append(CostSummary(pair, target, costs.draft_ms_per_token(), c, v))
            return rows
