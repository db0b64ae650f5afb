"""The γ policies' state that every request of one gateway shares.

A request's cost policy learns on its own, and also from and for the others: the probe
spacing of its model pair and task, its pair's load cap (every task's sessions share the
target's forwards), the floor's burst schedule of its pair, task and sampling kind over
plain decoding's rates on the target, and what the other gateways of the target learned
(`gateway.workers.loadshare`). `PolicyTables` owns all of it; the core hands each request
its `SharedState`, and the metrics thread and the servicer read copies.
"""
from __future__ import annotations

from collections.abc import Mapping

from gateway.policy.floor import FloorRow, FloorSchedule, PlainRates, RequestFloor, floor_snapshot
from gateway.policy.gamma import ProbeSchedule, SharedState
from gateway.policy.loadcap import LoadCap, Pricing, SharedLevel
from gateway.policy.priors import ForwardTable, Overheads, prior_rates
from gateway.stats.costmodel import load_bucket
from gateway.step.records import StepRecord
from specd.steps import ModelInfo, card_acceptance


class PolicyTables:
    """The shared state, keyed by model pair (tables keyed by task are keyed by the capped
    task label: task_type is free text, and a new one per request must not grow them)."""

    def __init__(self, max_draft_length: int, prior_alpha: float, target: ModelInfo,
                 drafts: Mapping[str, ModelInfo]) -> None:
        """prior_alpha: the general task's prior acceptance, where a load cap's prior starts
        when its draft's card measured none (`pair_alpha`);
        target, drafts: the served models, whose forward costs price the priors."""
        self.max_draft_length = max_draft_length
        self.prior_alpha = prior_alpha
        self.target, self.drafts = target, drafts
        self.plain_rates = PlainRates()
        # Per-session step costs beyond the forwards, timed at start-up (`gateway.policy.priors`):
        # with the workers' forward costs, where each pair's load cap starts.
        self.overheads: Overheads | None = None
        self._probes: dict[tuple[str, str], ProbeSchedule] = {}
        self._load_caps: dict[str, LoadCap] = {}
        self._floors: dict[tuple[str, str, bool], FloorSchedule] = {}
        # What the other gateways of the target learned: model pair → load → level.
        self._shared_caps: dict[str, dict[int, SharedLevel]] = {}

    def for_request(self, model_pair: str, draft_model: str, task_type: str, greedy: bool,
                    in_flight: int) -> SharedState:
        """What one request's policy shares: its pair's load cap (made on first use, from the
        prior and the other gateways' levels), its probes, and its floor at today's load.
        Greedy and sampled requests have floors apart: a sampled step's acceptance and its
        recovery hop make speculation pay differently."""
        probes = self._probes.setdefault((model_pair, task_type), ProbeSchedule())
        load_cap = self._load_caps.get(model_pair)
        if load_cap is None:
            load_cap = self._load_caps[model_pair] = LoadCap(self.max_draft_length, price=self.pricing(draft_model),
                                                             alpha=self.pair_alpha(draft_model),
                                                             shared=self.shared_caps(model_pair))
        schedule = self._floors.setdefault((model_pair, task_type, greedy), FloorSchedule())
        return SharedState(probes, load_cap, RequestFloor(self.plain_rates, schedule, load_bucket(in_flight)))

    def observe(self, record: StepRecord) -> None:
        """Every step of every request but the doctor's teaches plain decoding's rates."""
        self.plain_rates.observe(record)

    def pricing(self, draft_model: str) -> Pricing | None:
        """A pair's predicted goodput of each γ at each load, as a function of its acceptance
        (`gateway.policy.priors`): where its load cap starts. None before the start-up probes
        measured the overheads, or without the workers' forward costs."""
        target = ForwardTable(self.target.forward_costs)
        overheads = self.overheads
        if overheads is None or not target:
            return None
        draft = self.drafts.get(draft_model)
        draft_table = ForwardTable(draft.forward_costs) if draft and draft.forward_costs else None
        return lambda alpha: prior_rates(target, draft_table, alpha, self.max_draft_length, overheads)

    def pair_alpha(self, draft_model: str) -> float:
        """The acceptance a pair's load cap is first priced at: the mean α its draft's card
        measured against the target on held-out prompts (`specd distill` writes it), else
        the general task's prior.

        Why the card's: priced at the task default (0.7), SmolLM2's draft (α 0.34 on its
        card, 0.38 served) started at γ = 3 at 8 in flight and spent its first ~10 s there,
        until 64 draft tokens of its own acceptance repriced it (docs/loadcap.md)."""
        draft = self.drafts.get(draft_model)
        rows = card_acceptance(draft.card_json) if draft else {}
        alphas = [float(row["alpha"]) for row in rows.values() if isinstance(row.get("alpha"), (int, float))]
        return sum(alphas) / len(alphas) if alphas else self.prior_alpha

    def prior(self, draft_model: str) -> dict[int, list[float]] | None:
        """The pair's prior priced at its first acceptance (`pair_alpha`): where a pair no
        request has measured yet starts."""
        price = self.pricing(draft_model)
        return price(self.pair_alpha(draft_model)) if price else None

    def floors(self) -> tuple[dict[int, float], list[FloorRow]]:
        """Plain decoding's measured goodput by load, and each floor schedule (copies: the
        metrics thread reads them)."""
        return floor_snapshot(self.plain_rates, dict(self._floors))

    def load_caps(self) -> dict[str, LoadCap]:
        """Each model pair's load cap (a copy of the table: the metrics thread reads it)."""
        return dict(self._load_caps)

    def learned_caps(self) -> dict[str, dict[int, SharedLevel]]:
        """What this gateway's trials learned, by model pair and load, to share."""
        return {pair: learned for pair, load_cap in self._load_caps.items() if (learned := load_cap.learned())}

    def shared_caps(self, model_pair: str) -> dict[int, SharedLevel]:
        """What the other gateways learned for a pair, by load."""
        return self._shared_caps.get(model_pair, {})

    def adopt_caps(self, shared: dict[str, dict[int, SharedLevel]]) -> None:
        """The other gateways' levels: the load caps made since start from them, and each
        pair's load cap takes a level where it holds more evidence (`LoadCap.adopt`)."""
        self._shared_caps = shared
        for pair, load_cap in self._load_caps.items():
            load_cap.adopt(shared.get(pair, {}))
