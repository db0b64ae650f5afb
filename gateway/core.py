"""The gateway's generation core: one request from the client's fields to chunks of text,
whatever the transport.

The gRPC servicer (`gateway.edge.servicer`) and the OpenAI-compatible HTTP app (`gateway.edge.http`)
are thin adapters over `GatewayCore`: each turns its wire format into a `ClientRequest`,
passes the caller's principal (the API key's segment) as `user_segment`, and turns
`Chunk`s and the typed errors (`InvalidRequest`, `Busy`, `WorkerError`) back into its own.
Per request: validate (`gateway.validation`, every problem named), open one session on
each worker, run `gateway.step.engine.speculate`, turn tokens into text. A finished request's
figures travel as a plain `RequestSummary`, which each adapter renders in its own format.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from gateway.errors import RETRY_PUSHBACK_MS, Busy, WorkerError
from gateway.grammar import Grammar, GrammarWork
from gateway.policy.gamma import CostPolicy, ProbeSchedule, SharedState, build_policy
from gateway.policy.selection import DraftSelector
from gateway.policy.shared import PolicyTables
from gateway.proposers.corpus import CorpusProposer, NGramTable
from gateway.proposers.hybrid import HybridChoice, ModelFreeProposer
from gateway.proposers.modelfree import MAX_PATTERN, PromptLookup, SuffixCache, SuffixProposer
from gateway.request import ClientRequest, Generation, Mode, ParsedRequest
from gateway.settings import GatewaySettings
from gateway.stats.acceptance import AcceptanceStats, Labels
from gateway.stats.paircosts import PairCosts
from gateway.step.engine import ModelBounds, TokenLogprob, speculate
from gateway.step.records import DraftLengthPolicy, Finish, RequestStats, StepObserver, StepRecord
from gateway.step.text import TextAssembler
from gateway.step.tracing import RequestTrace
from gateway.tasks import DEFAULT_PROFILES, GENERAL
from gateway.validation import parse_request
from gateway.workers.backend import Backend
from gateway.workers.links import DraftLink, LinkSettings, VerifierLink
from specd.contract import DIAGNOSTIC_SEGMENT, PROMPT_LOOKUP, SUFFIX, model_pair_label

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestSummary:
    """What speculation did for one request, reported when it ends. Field for field the
    public API's `GenerationStats` (proto/specd/v1/gateway.proto says what each means):
    `gateway.edge.servicer` renders it as that message, `gateway.edge.replies` as the JSON `usage`."""

    steps: int
    proposed_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    draft_lengths: list[int]
    accepted_lengths: list[int]
    mean_tokens_per_step: float
    prompt_tokens: int
    generated_tokens: int
    draft_ms: float
    verify_ms: float
    total_ms: float
    seed: int
    draft_model: str
    session_reopens: int
    proposed_per_position: list[int]
    accepted_per_position: list[int]
    task_type: str
    policy: str
    draft_cost_ratio: float
    verify_cost_ratio: float
    mean_verify_batch_size: float
    mean_verify_batch_tokens: float
    verify_queue_ms: float
    pre_draft_hits: int
    pre_draft_steps: int
    proposers: list[str]
    cached_tokens: int


@dataclass(frozen=True)
class Chunk:
    """Text (and its token ids) generated since the last chunk; the last one also says
    why generation ended and carries the request's summary and trace id."""

    text: str
    token_ids: list[int]
    finish: Finish | None = None
    summary: RequestSummary | None = None
    trace_id: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asks


def open_links(backend: Backend, settings: GatewaySettings, draft_model: str,
               deadline: float | None = None, cache_salt: bytes = b"") -> tuple[DraftLink | None, VerifierLink]:
    """One request's links to its workers (no draft link when it decodes plainly).

    `deadline` (time.monotonic()) is the client's: no step waits past it, and the links
    then end their sessions on the workers. `cache_salt`: the workers' prefix caches
    hit only what was cached under the same salt (`gateway.validation.cache_salt`).
    """
    session_id = uuid.uuid4().hex
    link = LinkSettings(session_id, settings.max_session_reopens, settings.worker_connect_timeout_s, deadline,
                        cache_salt)
    verifier = VerifierLink("verifier", backend.verifier, "Verify", link, backend.target)
    draft = None
    if draft_model:
        assert backend.draft is not None  # a draft model is chosen only with a draft service
        draft = DraftLink(f"draft {draft_model!r}", backend.draft, "Propose", link, backend.drafts[draft_model])
    return draft, verifier


class _GatewayCounts:
    """Feeds one request's steps into the gateway's shared statistics: acceptance and step
    costs, the verifier's load, pre-draft hits, drift. (Not for the doctor's requests.)

    A step a model-free proposer drafted counts under that proposer's model pair
    ("suffix->target"), acceptance and costs alike; its verify hop also teaches the
    request's own pair what verifying that many tokens costs."""

    def __init__(self, servicer: GatewayCore, labels: Labels, model_pair: str, request_trace: RequestTrace) -> None:
        self.servicer, self.labels, self.model_pair, self.request_trace = servicer, labels, model_pair, request_trace

    def observe(self, record: StepRecord) -> None:
        stats, costs = self.servicer.stats, self.servicer.costs
        # The pair of the step's proposer and the target: the request's own for its draft
        # model's proposal and for a plain step, "suffix->target" for a suffix match.
        pair = self.servicer._model_pair(record.proposer) if record.proposer else self.model_pair
        own = pair == self.model_pair
        labels = self.labels if own else replace(self.labels, model_pair=pair)
        stats.record(labels, record.draft_length, record.accepted, len(record.emitted), record.generated)
        batch = record.verify_batch
        if record.index > 0:  # the first step also prefills the prompt: its time is not a step's cost
            # Another proposer's step says nothing of the draft's pre-drafting: neither a hit nor a miss.
            costs.observe(self.model_pair, record.draft_length, record.draft_ms, record.rest_ms, batch.size,
                          record.pre_draft_asked and own, record.pre_drafted, verify_only=not own)
            if not own:
                costs.observe(pair, record.draft_length, record.draft_ms, record.rest_ms, batch.size)
        costs.record_load(self.model_pair, batch.size, batch.tokens, batch.queue_ms)
        self.servicer.policies.observe(record)
        if record.pre_draft_asked and record.draft_model_tokens:
            stats.record_pre_draft(labels, record.pre_drafted)
        if record.draft_length:
            self.servicer.check_drift(labels, self.request_trace)


class GatewayCore:
    """Generation over the draft and verifier workers, whatever the transport: the state
    every request shares (statistics, costs, the policies' shared state, the suffix
    cache, admission) and one request's run from its client's request to chunks."""

    def __init__(self, backend: Backend, settings: GatewaySettings, stats: AcceptanceStats, costs: PairCosts,
                 selector: DraftSelector | None = None, suffix_cache: SuffixCache | None = None,
                 corpus_table: NGramTable | None = None) -> None:
        """stats, costs: what every request's steps add up to (acceptance; step costs and load);
        selector: picks the draft of requests that name none (None: the task map);
        suffix_cache: previous responses, for the suffix proposer (when hosted);
        corpus_table: the target's own answers, for the corpus proposer (when hosted)."""
        self.backend = backend
        self.settings = settings
        self.stats = stats
        self.costs = costs
        self.selector = selector
        self.suffix_cache = suffix_cache
        if settings.corpus is not None and corpus_table is None:
            raise ValueError(f"--corpus {settings.corpus} needs its table (gateway.app builds it)")
        self.corpus_table = corpus_table
        self._in_flight = 0  # requests being served (one event loop: a plain counter)
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="gateway-parse")
        target = backend.target
        self.grammars = GrammarWork(lambda: backend.grammar_tokenizer, target.vocab_size, target.eos_token_ids,
                                    threads=settings.grammar_threads, step_budget_ms=settings.grammar_step_budget_ms,
                                    compile_budget_s=settings.grammar_compile_budget_s)
        general = settings.task_profiles.get(GENERAL, DEFAULT_PROFILES[GENERAL])
        self.policies = PolicyTables(settings.max_draft_length, general.prior_alpha, target, backend.drafts)
        self._drifting: set[tuple[str, str, str]] = set()  # segments whose drift flag is up
        self.serving = True  # a verifier answers its health checks (gateway.edge.liveness says)

    def set_serving(self, serving: bool) -> None:
        self.serving = serving

    def close(self) -> None:
        """Stop the tokenizing thread (the gateway is stopping)."""
        self._parser.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def _choose(self, task_type: str, user_segment: str) -> str:
        """The draft of a request that names none, under --draft-selection goodput."""
        assert self.selector is not None  # handed out only with a selector
        if user_segment == DIAGNOSTIC_SEGMENT:  # a diagnosis must not move the bandit either
            return self.selector.start(task_type)
        return self.selector.choose(task_type, self.stats.segment(user_segment))

    def check_drift(self, labels: Labels, request_trace: RequestTrace) -> None:
        """Log and mark on the step span when a segment's drift flag goes up or down."""
        verdict = self.stats.drift(labels)
        key = (labels.model_pair, labels.task_type, labels.user_segment)
        flagged = verdict is not None and verdict.flagged
        if flagged == (key in self._drifting):
            return
        if not flagged:
            self._drifting.discard(key)
            log.info("acceptance drift cleared: pair %s, task %s, segment %r", *key)
            return
        self._drifting.add(key)
        assert verdict is not None  # flagged
        log.warning("acceptance drift: pair %s, task %s, segment %r: window acceptance %.3f vs %s %.3f "
                    "(drop %.1f points, z=%.1f); run `specd doctor --gateway ... --task %s`",
                    *key, verdict.window_alpha, verdict.reference, verdict.reference_alpha,
                    100 * verdict.drop, verdict.z, labels.task_type)
        request_trace.step_event("specd.acceptance_drift", {
            "gateway.drift.window_alpha": verdict.window_alpha,
            "gateway.drift.reference_alpha": verdict.reference_alpha,
            "gateway.drift.reference": verdict.reference, "gateway.drift.drop": verdict.drop,
            "gateway.drift.z": verdict.z})

    def _model_pair(self, draft_model: str) -> str:
        return model_pair_label(draft_model, self.backend.target.name)

    def _bounds(self, generation: Generation) -> ModelBounds:
        target = self.backend.target
        draft = self.backend.drafts.get(generation.draft_model)
        return ModelBounds(
            draft_context=draft.max_context if draft else 0,
            vocab_size=target.vocab_size,
            eos_token_ids=frozenset(target.eos_token_ids),
            target_context=target.max_context,
            stop_token_ids=generation.stopping.stop_token_ids, ignore_eos=generation.stopping.ignore_eos,
        )

    def _hybrid(self, parsed: ParsedRequest, policy: DraftLengthPolicy, model_pair: str,
                diagnostic: bool) -> HybridChoice | None:
        """The request's model-free proposers and how its steps choose between them and the draft."""
        if not parsed.model_free:
            return None
        proposers: list[ModelFreeProposer] = []
        for name in parsed.model_free:
            if name == SUFFIX:
                # The doctor's requests neither read nor fill the tenants' cache. The
                # request reads only what its tenant cached under the same salt, as the
                # prefix cache does.
                cache = None if diagnostic else self.suffix_cache
                proposers.append(SuffixProposer(cache, parsed.user_segment, parsed.cache_salt))
            elif name == PROMPT_LOOKUP:
                proposers.append(PromptLookup(self.settings.prompt_lookup_min, self.settings.prompt_lookup_max))
            elif self.corpus_table is not None:  # CORPUS, hosted only with its table (see __init__)
                proposers.append(CorpusProposer(self.corpus_table))
        fixed = parsed.draft_length if parsed.mode is Mode.FIXED else None
        # The cost policy reacts to timings anyway; the others replay a seed, so their
        # choice between a match and the draft must not depend on timings (or on other
        # requests' statistics) either: fixed priors price it.
        timed = isinstance(policy, CostPolicy)
        prior = parsed.profile.prior_alpha

        def model_alpha() -> float:
            return policy.alpha if isinstance(policy, CostPolicy) else prior

        return HybridChoice(proposers, self.costs.costs(model_pair),
                            lambda name: self.costs.costs(self._model_pair(name)), model_alpha, fixed, timed=timed)

    async def generate(self, request: ClientRequest, deadline: float | None = None) -> AsyncGenerator[Chunk, None]:
        """One request's chunks of text, the last with its statistics. `deadline`
        (time.monotonic()) is the client's: no step waits past it.

        Raises InvalidRequest (every problem named), Busy (over --max-concurrent-requests)
        and WorkerError (a worker failed the request for good)."""
        began = time.perf_counter()
        # Admission first: in a burst, a request refused costs no tokenizing.
        if self._in_flight >= self.settings.max_concurrent_requests:
            raise Busy(f"this gateway is serving its limit of {self.settings.max_concurrent_requests} "
                       f"requests; retry after {RETRY_PUSHBACK_MS} ms with backoff, or add gateway "
                       f"and worker replicas")
        self._in_flight += 1
        try:
            # Parsed off the event loop: tokenizing a prompt near --max-prompt-bytes takes a
            # while, and the other requests' steps must not wait for it. One thread: a fast
            # tokenizer is not safe to call from several threads at once.
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._parser, parse_request, request, self.backend, self.settings,
                self._choose if self.selector is not None else None)
            grammar = await self.grammars.start(parsed.generation.grammar) if parsed.generation.grammar else None
            # aclosing: a client that goes away closes the links now, not at garbage collection.
            async with contextlib.aclosing(self._generate(parsed, grammar, began, deadline)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._in_flight -= 1

    async def _generate(self, parsed: ParsedRequest, grammar: Grammar | None, began: float,
                        deadline: float | None) -> AsyncGenerator[Chunk, None]:
        generation = parsed.generation
        model_pair = self._model_pair(generation.draft_model)
        labels = self.stats.labels(model_pair, parsed.task_type, parsed.user_segment,
                                   len(generation.prompt_ids))
        diagnostic = parsed.user_segment == DIAGNOSTIC_SEGMENT
        load_cap = None
        if diagnostic:  # the doctor's requests learn on their own, so they change no serving state
            shared = SharedState(ProbeSchedule())
        else:
            shared = self.policies.for_request(model_pair, generation.draft_model, labels.task_type,
                                               generation.transform.greedy, self._in_flight)
            load_cap = shared.load_cap
        policy = build_policy(parsed, self.stats, self.costs.costs(model_pair), model_pair, shared)
        request_trace = RequestTrace.start(generation, target_model=self.backend.target.name,
                                           model_pair=model_pair, task_type=parsed.task_type,
                                           user_segment=parsed.user_segment, mode=parsed.mode.name,
                                           policy=parsed.policy)
        draft, verifier = open_links(self.backend, self.settings, generation.draft_model, deadline,
                                     parsed.cache_salt)
        stopping = generation.stopping
        text = TextAssembler(self.backend.tokenizer, list(stopping.stop), generation.transform.min_tokens,
                             stopping.include_stop, parsed.skip_special_tokens)
        stats = RequestStats()
        observers: list[StepObserver] = [stats]
        if not diagnostic:
            observers.append(_GatewayCounts(self, labels, model_pair, request_trace))
        finish = Finish.LENGTH
        in_flight = None if load_cap is None else load_cap.enter()
        if in_flight is not None:
            observers.append(in_flight)
        try:
            hybrid = self._hybrid(parsed, policy, model_pair, diagnostic)
            if hybrid is not None:  # a long prompt's indexing must not stall the other requests' steps
                await asyncio.get_running_loop().run_in_executor(self._parser, hybrid.index, generation.prompt_ids)
            steps = speculate(generation, policy, draft, verifier, self._bounds(generation), observers,
                              tracer=request_trace.step_tracer, hybrid=hybrid, max_model_free=parsed.model_free_max,
                              grammar=grammar)
            async with contextlib.aclosing(steps):
                async for output in steps:
                    delta, kept = text.add(output.tokens)
                    if text.stopped:
                        finish = Finish.STOP
                    elif output.finish is not None:
                        finish = output.finish
                    logprobs = output.logprobs[:len(kept)]
                    if output.finish is None and not text.stopped:
                        yield Chunk(delta, kept, logprobs=logprobs)
                        continue
                    # Only the selector's own choices teach it: a request that names its draft
                    # may do so for reasons goodput does not see.
                    if parsed.selected and draft is not None and not diagnostic:
                        assert self.selector is not None  # it selected the draft
                        self.selector.observe(parsed.task_type, labels.user_segment, generation.draft_model,
                                              stats.counts(model_drafts_only=True).alpha,
                                              *stats.goodput(model_drafts_only=True))
                    if self.suffix_cache is not None and not diagnostic:
                        # The prompt's end goes in before the response: the same prompt again
                        # then matches straight into it.
                        self.suffix_cache.add(parsed.user_segment, parsed.cache_salt,
                                              generation.prompt_ids[-MAX_PATTERN:] + text.token_ids)
                    summary = self._summary(stats, parsed, policy, model_pair, draft, verifier, text, began)
                    # Ended before the last chunk goes out: the trace is whole when the client has it.
                    request_trace.finish(stats, len(text.token_ids), finish.value)
                    yield Chunk(delta + text.finish(), kept, finish, summary, request_trace.trace_id, logprobs)
                    return
        except WorkerError as exc:
            request_trace.end(exc)
            raise  # the transport gives the client the worker's status
        finally:
            if in_flight is not None:
                in_flight.leave()
            request_trace.end()
            for link in (draft, verifier):
                if link is not None:
                    link.close()

    def _summary(self, stats: RequestStats, parsed: ParsedRequest, policy: DraftLengthPolicy,
                 model_pair: str, draft: DraftLink | None, verifier: VerifierLink, text: TextAssembler,
                 began: float) -> RequestSummary:
        """What speculation did for the request."""
        generation = parsed.generation
        proposed_per_position, accepted_per_position = stats.per_position()
        costs = next((row for row in self.costs.cost_table() if row.model_pair == model_pair), None)
        c, v = (costs.draft_cost_ratio, costs.verify_cost_ratio) if costs else (0.0, {})
        drafted = [g for g in stats.draft_lengths if g]
        mean_gamma = round(sum(drafted) / len(drafted)) if drafted else 0
        return RequestSummary(
            steps=stats.steps,
            proposed_tokens=stats.proposed_tokens,
            accepted_tokens=stats.accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            draft_lengths=stats.draft_lengths,
            accepted_lengths=stats.accepted_lengths,
            mean_tokens_per_step=stats.tokens_per_step(len(text.token_ids)),
            prompt_tokens=len(generation.prompt_ids),
            generated_tokens=len(text.token_ids),
            draft_ms=stats.draft_ms,
            verify_ms=stats.verify_ms,
            total_ms=(time.perf_counter() - began) * 1e3,
            seed=generation.seed,
            draft_model=generation.draft_model or parsed.forced,
            session_reopens=verifier.reopens + (draft.reopens if draft else 0),
            proposed_per_position=proposed_per_position,
            accepted_per_position=accepted_per_position,
            task_type=parsed.task_type,
            policy=policy.name,
            draft_cost_ratio=c,
            verify_cost_ratio=v.get(mean_gamma, 0.0),
            mean_verify_batch_size=stats.mean_verify_batch_size,
            mean_verify_batch_tokens=stats.mean_verify_batch_tokens,
            verify_queue_ms=stats.verify_queue_ms,
            pre_draft_hits=stats.pre_draft_hits,
            pre_draft_steps=stats.pre_draft_steps,
            proposers=[r.proposer for r in stats.records],
            cached_tokens=sum(r.verify_batch.cached for r in stats.records),
        )

