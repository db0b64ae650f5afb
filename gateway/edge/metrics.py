"""Prometheus exposition of the gateway's acceptance statistics.

Counters sum across gateway replicas. Names follow vLLM's speculative-decoding metrics
where they exist (`vllm:spec_decode_num_drafts` → `specd_spec_decode_num_drafts`; no colon,
which Prometheus reserves for recording rules and promtool rejects), with our labels:
model_pair, task_type, user_segment, prompt_bucket. PromQL:

    acceptance rate     sum(rate(specd_spec_decode_num_accepted_tokens_total[5m]))
                      / sum(rate(specd_spec_decode_num_draft_tokens_total[5m]))
    mean accept length  1 + sum(rate(specd_spec_decode_num_accepted_tokens_total[5m]))
                          / sum(rate(specd_spec_decode_num_drafts_total[5m]))
    α (conditional)     sum(rate(specd_spec_decode_num_accepted_tokens_total[5m]))
                      / sum(rate(specd_spec_decode_num_reached_tokens_total[5m]))

The acceptance rate falls when the policy lengthens drafts at the same agreement; α does
not, so alerts (k8s/prometheus/specd-rules.yaml) and drift use α.

Drift (`gateway.stats.drift`), per model_pair, task_type, user_segment and reference
("lifetime" or "baseline"): `specd_spec_decode_acceptance_drift` is the drop in
α points (reference − window; negative when it rose) and
`specd_spec_decode_acceptance_drift_flagged` is 1 while the drop is large and
significant (k8s/prometheus/specd-rules.yaml alerts on it). Draft selection by goodput:
`specd_draft_selected_total{task_type,user_segment,draft_model}` counts each draft's
requests, so each draft's share is

    sum by (draft_model) (rate(specd_draft_selected_total[5m]))
      / ignoring(draft_model) group_left sum(rate(specd_draft_selected_total[5m]))

Metric names stay as released; their help says which of the two quantities each is.

Under load, `specd_spec_decode_load_cap{model_pair,load}` is the γ cap AUTO requests share
at each load level (`gateway.policy.loadcap.LoadCap`; 0: plain decoding there), and
`specd_spec_decode_load_cap_goodput{model_pair,load,cap}` what each cap tried measured;
`specd_spec_decode_load_cap_trial_switch_seconds_total{model_pair,load}` is what its lost
trials' switches cost (the price of trying a cap, which the trial schedule budgets).
AUTO's floor (`gateway.policy.floor`): `specd_plain_goodput_tokens_per_ms{load}` is plain
decoding's measured goodput, and `specd_spec_decode_floor_speedup{model_pair,task_type,sampling}`
every request's recent speculative steps over it: below 1, new AUTO requests of that kind
start plain.

The collector reads snapshots of `AcceptanceStats` (and the draft selector) at scrape
time; it never writes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from gateway.policy.floor import FloorRow
from gateway.policy.loadcap import LoadCap
from gateway.policy.selection import DraftSelector
from gateway.proposers.modelfree import SuffixCache
from gateway.stats.acceptance import LABEL_NAMES, AcceptanceStats
from gateway.stats.paircosts import PairCosts

PREFIX = "specd_spec_decode_"


def _proposed_and_accepted(per: str, where: str, labels: list[str]) -> dict[str, CounterMetricFamily]:
    """The two counters of draft tokens proposed and accepted, broken down `per` something."""
    return {
        "proposed": CounterMetricFamily(PREFIX + f"num_draft_tokens_per_{per}", f"Draft tokens proposed {where}.",
                                        labels=labels),
        "accepted": CounterMetricFamily(PREFIX + f"num_accepted_tokens_per_{per}", f"Draft tokens accepted {where}.",
                                        labels=labels),
    }


class AcceptanceCollector(Collector):
    """Turns the lifetime acceptance counters and measured costs into Prometheus metrics."""

    def __init__(self, stats: AcceptanceStats, costs: PairCosts | None = None,
                 selector: DraftSelector | None = None, suffix_cache: SuffixCache | None = None,
                 load_caps: Callable[[], dict[str, LoadCap]] | None = None,
                 floors: Callable[[], tuple[dict[int, float], list[FloorRow]]] | None = None) -> None:
        self.stats = stats
        self.floors = floors
        self.costs = costs or PairCosts()
        self.selector = selector
        self.suffix_cache = suffix_cache
        self.load_caps = load_caps

    def collect(self):
        labels = list(LABEL_NAMES)
        families = {
            "steps": CounterMetricFamily(PREFIX + "num_steps", "Decoding steps, plain ones included.", labels=labels),
            "drafts": CounterMetricFamily(PREFIX + "num_drafts", "Steps that proposed draft tokens.", labels=labels),
            "draft_tokens": CounterMetricFamily(PREFIX + "num_draft_tokens", "Draft tokens proposed.", labels=labels),
            "accepted_tokens": CounterMetricFamily(PREFIX + "num_accepted_tokens", "Draft tokens accepted.",
                                                   labels=labels),
            "reached_tokens": CounterMetricFamily(PREFIX + "num_reached_tokens",
                                                  "Draft positions reached with every earlier one accepted "
                                                  "(conditional acceptance = accepted / reached).", labels=labels),
            "emitted_tokens": CounterMetricFamily(PREFIX + "num_emitted_tokens",
                                                  "Tokens committed by speculative steps.", labels=labels),
        }
        per_pos = _proposed_and_accepted("pos", "at each draft position", labels + ["position"])
        per_gen = _proposed_and_accepted("generation_bucket", "by position inside the generation",
                                         labels + ["generation_bucket"])
        for key, counts in self.stats.snapshot().items():
            values = list(astuple(key))
            for name, family in families.items():
                family.add_metric(values, getattr(counts, name))
            for i, (proposed, accepted) in enumerate(zip(counts.proposed_per_position,
                                                         counts.accepted_per_position)):
                per_pos["proposed"].add_metric(values + [str(i + 1)], proposed)
                per_pos["accepted"].add_metric(values + [str(i + 1)], accepted)
            for gen_bucket, (proposed, accepted) in counts.by_generation_bucket.items():
                per_gen["proposed"].add_metric(values + [gen_bucket], proposed)
                per_gen["accepted"].add_metric(values + [gen_bucket], accepted)
        yield from families.values()
        yield from per_pos.values()
        yield from per_gen.values()
        yield from self._costs()
        yield from self._load()
        yield from self._pre_drafts()
        yield from self._drift()
        yield from self._selection()
        yield from self._suffix_cache()
        yield from self._load_caps()
        yield from self._floors()

    def _floors(self):
        """AUTO's floor: plain decoding's goodput, and whether speculating measured faster."""
        if self.floors is None:
            return []
        plain = GaugeMetricFamily("specd_plain_goodput_tokens_per_ms",
                                  "Plain decoding's measured goodput on the target at this load (sessions in the "
                                  "verifier's forward, bucketed): tokens per ms between a request's commits.",
                                  labels=["load"])
        labels = ["model_pair", "task_type", "sampling"]
        speedup = GaugeMetricFamily(PREFIX + "floor_speedup",
                                    "AUTO's floor: every request's recent speculative steps at one session, their "
                                    "goodput over plain decoding's. Below 1, new AUTO requests of this kind start "
                                    "decoding plainly, with a burst of speculation every floor_burst_interval plain "
                                    "steps.", labels=labels)
        interval = GaugeMetricFamily(PREFIX + "floor_burst_interval",
                                     "Plain steps between the floor's bursts of speculation (doubles while they lose).",
                                     labels=labels)
        rates, rows = self.floors()
        for load, rate in rates.items():
            plain.add_metric([str(load)], rate)
        for row in rows:
            values = [row.model_pair, row.task_type, row.sampling]
            if row.speedup is not None:
                speedup.add_metric(values, row.speedup)
            interval.add_metric(values, row.interval)
        return [plain, speedup, interval]

    def _load_caps(self):
        """The γ cap AUTO requests share at each load level, and the goodput measured under
        each cap tried there: why AUTO speculates less, or not at all, under load."""
        if self.load_caps is None:
            return []
        labels = ["model_pair", "load"]
        cap = GaugeMetricFamily(PREFIX + "load_cap",
                                "Largest γ an AUTO request may propose at this load (sessions in the verifier's "
                                "forward, bucketed); 0: plain decoding.", labels=labels)
        goodput = GaugeMetricFamily(PREFIX + "load_cap_goodput",
                                    "Goodput measured under each cap tried at this load (tokens per ms per session), "
                                    "over the steps taken away from prompts' prefills where there were enough of them: "
                                    "a trial's from its turns beside the cap in force, the cap in force's from those "
                                    "turns and its epochs since.",
                                    labels=labels + ["cap"])
        prior = GaugeMetricFamily(PREFIX + "load_cap_prior",
                                  "The cap the workers' measured forward costs favour at this load, priced at the "
                                  "pair's measured acceptance once known (gateway/policy/priors.py): where the load "
                                  "cap starts; trials move it from there.",
                                  labels=labels)
        origin = GaugeMetricFamily(PREFIX + "load_cap_learned",
                                   "1 when a trial on this gateway decided the cap in force at this load, 0 while it "
                                   "is the prior's or the one other gateways learned (load_cap_shared).",
                                   labels=labels)
        shared = GaugeMetricFamily(PREFIX + "load_cap_shared",
                                   "1 when the cap in force at this load is the one other gateways of the target "
                                   "learned (kept by the verifiers), and no trial here has moved it since.",
                                   labels=labels)
        switches = CounterMetricFamily(PREFIX + "load_cap_trial_switch_seconds",
                                       "What lost trials' switches to their cap cost at this load beyond the cap in "
                                       "force's goodput (session-seconds: each session's draft catching up on its "
                                       "context after plain steps), summed; the next trial waits until its last one's "
                                       "is 1% of the level's time since.", labels=labels)
        for pair, load_cap in sorted(self.load_caps().items()):
            for load, ms in load_cap.switch_ms().items():
                switches.add_metric([pair, str(load)], ms / 1e3)
            for load, best in load_cap.caps().items():
                cap.add_metric([pair, str(load)], best)
            for load, gamma in sorted(load_cap.prior_caps.items()):
                prior.add_metric([pair, str(load)], gamma)
            for load, how in load_cap.origins().items():
                origin.add_metric([pair, str(load)], float(how == "learned"))
                shared.add_metric([pair, str(load)], float(how == "shared"))
            for load, rates in load_cap.rates().items():
                for arm, rate in sorted(rates.items()):
                    goodput.add_metric([pair, str(load), str(arm)], rate)
        return [cap, goodput, prior, origin, shared, switches]

    def _suffix_cache(self):
        """How full the suffix proposer's cache of previous responses is."""
        if self.suffix_cache is None:
            return []
        held = GaugeMetricFamily("specd_suffix_cache_tokens", "Tokens of previous responses the suffix proposer "
                                 "holds, over every tenant.")
        held.add_metric([], self.suffix_cache.tokens)
        limit = GaugeMetricFamily("specd_suffix_cache_max_tokens", "The suffix cache's budget (--suffix-cache-tokens).")
        limit.add_metric([], self.suffix_cache.max_tokens)
        return [held, limit]

    def _pre_drafts(self):
        """Overlapped speculation: hit rate = rate(…hits_total) / rate(…steps_total)."""
        steps = CounterMetricFamily(PREFIX + "num_pre_draft_steps",
                                    "Speculative steps whose proposal the draft pre-drafted for (overlap).",
                                    labels=list(LABEL_NAMES))
        hits = CounterMetricFamily(PREFIX + "num_pre_draft_hits",
                                   "Of those, steps answered from a pre-drafted branch.", labels=list(LABEL_NAMES))
        for key, (n, hit) in self.stats.pre_draft_snapshot().items():
            steps.add_metric(list(astuple(key)), n)
            hits.add_metric(list(astuple(key)), hit)
        return [steps, hits]

    def _drift(self):
        labels = ["model_pair", "task_type", "user_segment", "reference"]
        drop = GaugeMetricFamily(PREFIX + "acceptance_drift",
                                 "α points lost (α: accepted ÷ draft positions reached): reference (lifetime "
                                 "or pinned baseline) minus the sliding window.", labels=labels)
        flagged = GaugeMetricFamily(PREFIX + "acceptance_drift_flagged",
                                    "1 while the drop is at least the configured points and significant.",
                                    labels=labels)
        for key, verdict in self.stats.drift_table():
            values = [*key, verdict.reference]
            drop.add_metric(values, verdict.drop)
            flagged.add_metric(values, float(verdict.flagged))
        return [drop, flagged]

    def _selection(self):
        if self.selector is None:
            return []
        labels = ["task_type", "user_segment", "draft_model"]
        chosen = CounterMetricFamily("specd_draft_selected", "Requests given each draft by goodput selection.",
                                     labels=labels)
        goodput = GaugeMetricFamily("specd_draft_goodput_tokens_per_ms",
                                    "Measured goodput of each draft (tokens per ms of step time).", labels=labels)
        alpha = GaugeMetricFamily("specd_draft_selection_acceptance",
                                  "Mean α (accepted ÷ draft positions reached) of each draft's selected requests "
                                  "(what selection chooses by, with the pair's costs).", labels=labels)
        for key, arm in sorted(self.selector.snapshot().items()):
            chosen.add_metric(list(key), arm.pulls)
            if arm.n:
                goodput.add_metric(list(key), arm.goodput)
                alpha.add_metric(list(key), arm.alpha)
        return [chosen, goodput, alpha]

    def _load(self):
        """How the verifier batched this gateway's steps; mean = rate(_sum) / rate(_count)."""
        families = (
            ("batch_size", "Sessions sharing each step's verify forward.", 1.0),
            ("batch_tokens", "Tokens in each step's verify forward.", 1.0),
            ("queue_seconds", "Time each step waited in the verifier's queue.", 1e-3),
        )
        loads = self.costs.load_snapshot()
        for name, doc, scale in families:
            family = SummaryMetricFamily(PREFIX + "verify_" + name, doc, labels=["model_pair"])
            for pair, load in sorted(loads.items()):
                value = {"batch_size": load.batch_size, "batch_tokens": load.batch_tokens,
                         "queue_seconds": load.queue_ms}[name]
                family.add_metric([pair], count_value=load.steps, sum_value=value * scale)
            yield family

    def _costs(self):
        target = GaugeMetricFamily(PREFIX + "target_step_seconds", "Measured plain target step.",
                                   labels=["model_pair"])
        draft = GaugeMetricFamily(PREFIX + "draft_cost_ratio",
                                  "c: draft cost per token relative to one target step.", labels=["model_pair"])
        verify = GaugeMetricFamily(PREFIX + "verify_cost_ratio",
                                   "v(γ): verify step relative to one target step.",
                                   labels=["model_pair", "draft_length"])
        for row in self.costs.cost_table():
            target.add_metric([row.model_pair], row.target_step_ms / 1e3)
            draft.add_metric([row.model_pair], row.draft_cost_ratio)
            for gamma, ratio in row.verify_cost_ratio.items():
                verify.add_metric([row.model_pair, str(gamma)], ratio)
        return [target, draft, verify]


def start_metrics_server(stats: AcceptanceStats, costs: PairCosts, host: str, port: int,
                         selector: DraftSelector | None = None, suffix_cache: SuffixCache | None = None,
                         load_caps: Callable[[], dict[str, LoadCap]] | None = None,
                         floors: Callable[[], tuple[dict[int, float], list[FloorRow]]] | None = None):
    """Serve /metrics on host:port from a background thread; returns (server, thread)."""
    registry = CollectorRegistry()
    registry.register(AcceptanceCollector(stats, costs, selector, suffix_cache, load_caps, floors))
    return start_http_server(port, addr=host, registry=registry)
