"""The gateway's worker pools: connections to the replicas, and the models' facts.

Who owns what in the gateway: `gateway.workers.router` decides which replica serves a session;
this module owns the channels to the replicas and what the workers said about their
models at start-up; `gateway.workers.links` holds one request's links (streams) over them.

Each worker service (draft, verifier) is a `WorkerPool`: a `gateway.workers.router.Router` that
places sessions on the service's endpoints — a static address list, or the EndpointSlices
of a Kubernetes Service watched live — and one channel per endpoint. At start-up the
gateway asks each service for its models, sets aside a draft whose tokenizer differs from
the target's (and refuses to start when no draft fits), and builds the target's
tokenizer from the files the verifier ships, so the gateway never mounts or loads a
model. The identities it validated there (name,
weights digest, tokenizer fingerprint) open every worker session afterwards, so a worker
swapped behind an address refuses the session instead of answering for another model.
Channels are TLS (mutual with a client certificate) when `GatewaySettings.worker_tls` is.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import llguidance
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.grammar import tokenizer_for
from gateway.settings import GatewaySettings
from gateway.workers.budgets import BudgetSettings, SlowMark, StepBudget
from gateway.workers.endpointslices import EndpointSliceWatcher
from gateway.workers.router import NoEndpoint, Router, parse_addresses
from gateway.workers.streams import StepFailed, WorkerStream
from specd.config import ClientTLS
from specd.grpcserver import CHANNEL_OPTIONS
from specd.steps import ModelInfo
from specd.tls import TLSConfigError, aio_channel, files_stamp
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.wire import WORKER_PROTOCOL, model_info_from_pb

log = logging.getLogger(__name__)

WAITING_LOG_INTERVAL_S = 30.0  # how often a gateway waiting for its workers says so


class IncompatibleDraft(RuntimeError):
    """A draft model cannot speculate for the target (different tokenizer)."""


class WorkerPool:
    """One worker service: its router and a channel to each of its endpoints."""

    def __init__(self, name: str, router: Router, stub_class: Callable, budget: BudgetSettings,
                 watcher: EndpointSliceWatcher | None = None, tls: ClientTLS = ClientTLS(),
                 server_name: str = "") -> None:
        self.name = name
        self.router = router
        # How long a step may take (learned from this service's steps), and whether the
        # service is left alone for being slow (gateway.workers.budgets; the draft's links use it).
        self.budget = StepBudget(budget)
        self.slow = SlowMark()
        self.watcher = watcher
        self.tls = tls
        # The name the endpoints' certificates are checked against when dialled by IP
        # (pods of a Kubernetes Service); empty: the dialled host.
        self.server_name = server_name
        self._stub_class = stub_class
        self._channels: dict[str, tuple[grpc.aio.Channel, object]] = {}
        # The client certificate files' stamp each channel was made with: a stream opened
        # after they were renewed gets a new channel (`_renewed`).
        self._tls_paths = [p for p in (tls.ca, tls.cert, tls.key) if p is not None]
        self._stamps: dict[str, tuple] = {}
        self._streams: dict[tuple[str, str], WorkerStream] = {}  # (address, rpc) → its stream

    def stub(self, address: str):
        """The stub for an endpoint (its channel is made on first use and kept while listed)."""
        if address not in self._channels:
            self._close_unlisted()
            self._stamps[address] = self._tls_stamp()
            channel = aio_channel(address, self.tls, CHANNEL_OPTIONS, self.server_name)
            self._channels[address] = (channel, self._stub_class(channel))
        return self._channels[address][1]

    def _tls_stamp(self) -> tuple:
        try:
            return files_stamp(self._tls_paths)
        except OSError:  # a file between two versions: taken as unchanged, checked again next time
            return ()

    def _renew(self, address: str) -> None:
        """Drop the endpoint's channel when the client certificate files changed since it
        was made (cert-manager renewed the Secret): the new stream about to open, and
        every one after, handshake with the new certificate. Streams that still work keep
        their connection: a renewal never interrupts a request."""
        if address not in self._channels or not self._tls_paths:
            return
        stamp = self._tls_stamp()
        if stamp in ((), self._stamps[address]):
            return
        log.info("the %s client certificate files changed: new connections to %s use them", self.name, address)
        self._drop(address)

    def _drop(self, address: str) -> None:
        channel, _ = self._channels.pop(address)
        self._stamps.pop(address, None)
        for key in [k for k in self._streams if k[0] == address]:
            self._streams.pop(key).close()
        asyncio.get_running_loop().create_task(channel.close())

    def stream(self, session_id: str, rpc: str, moved: bool, prefix: Sequence[bytes] = ()) -> WorkerStream:
        """The stream to the endpoint the router picks for a session (shared by every
        session there; a new one when the last one failed).

        moved=True: the session's endpoint failed it (dead or unreachable), so the router
        moves it to another endpoint when there is one; otherwise the session stays put.
        prefix: a new session's prompt keys (`specd.prefixkeys.prompt_keys`), which the
        router follows to the endpoint likely to hold them in its prefix cache.
        """
        try:
            address = self.router.fail_over(session_id) if moved else self.router.place(session_id, prefix)
            stream = self._streams.get((address, rpc))
            if stream is None or stream.failure is not None:
                self._renew(address)
            # A channel to a new endpoint reads the client certificate files then; caught
            # mid-renewal they may not load, and the step is retried like any lost worker.
            stub = self.stub(address)
        except (NoEndpoint, TLSConfigError) as exc:
            raise StepFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        stream = self._streams.get((address, rpc))
        if stream is None or stream.failure is not None:
            # wait_for_ready: a restarted pod that keeps its address is waited for instead
            # of failing at once (a step on a stream still connecting waits its budget plus
            # the link's connect timeout, then the stream is closed).
            stream = WorkerStream(getattr(stub, rpc)(wait_for_ready=True), rpc, self._channels[address][0])
            self._streams[(address, rpc)] = stream
        return stream

    def _close_unlisted(self) -> None:
        """Close the channels of endpoints that left the service (pods come and go)."""
        listed = {state.address for state in self.router.snapshot()}
        for address in [a for a in self._channels if a not in listed]:
            self._drop(address)

    async def serving(self, address: str, timeout_s: float) -> bool:
        """Whether the endpoint answers its grpc.health.v1 check with SERVING within timeout_s."""
        self._renew(address)
        self.stub(address)  # the channel the endpoint's requests use
        channel = self._channels[address][0]
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                    timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def model_infos(self, timeout_s: float) -> list[worker_pb2.ModelInfo]:
        """Ask one ready endpoint which models the service hosts (as it answers: `connect`
        keeps `specd.steps.ModelInfo`s, the verifier's tokenizer files aside).

        Waits for an endpoint to be ready and to answer, up to timeout_s (0: without
        limit): on Kubernetes the workers may load for minutes after the gateway is up, and
        a gateway that exits meanwhile only restarts into a back-off."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s else math.inf
        probe = f"model-info-{id(self)}"
        said = -math.inf
        while True:
            try:
                address = self.router.place(probe)
                self.router.release(probe)
                break
            except NoEndpoint as exc:
                if loop.time() >= deadline:
                    raise ConnectionError(f"{exc} within {timeout_s:g} s") from exc
                if loop.time() - said >= WAITING_LOG_INTERVAL_S:
                    said = loop.time()
                    log.warning("waiting for a ready %s endpoint: %s", self.name, exc)
                await asyncio.sleep(0.5)
        stub = self.stub(address)
        channel = self._channels[address][0]
        try:
            remaining = None if deadline == math.inf else max(deadline - loop.time(), 0.1)
            await asyncio.wait_for(channel.channel_ready(), remaining)
            response = await stub.GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=remaining or 60)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            hint = ""
            if self.tls.enabled:  # a failed handshake looks the same as no answer at all
                hint = (" over TLS: check that --worker-ca signed the worker's certificate, that it names "
                        f"{self.server_name or address.rpartition(':')[0]!r}, and that the worker's "
                        f"--tls-client-ca signed --worker-cert")
            raise ConnectionError(f"no {self.name} answered at {address} within {timeout_s} s{hint}") from exc
        if response.protocol != WORKER_PROTOCOL:
            raise ConnectionError(
                f"the {self.name} at {address} speaks worker protocol {response.protocol or 'before 3'}, this "
                f"gateway {WORKER_PROTOCOL}: run workers and gateways of one release (upgrade the workers first)")
        return list(response.models)

    async def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        for stream in self._streams.values():
            stream.close()
        for channel, _ in self._channels.values():
            await channel.close()


async def _pool(name: str, addresses: str, service: str, namespace: str, stub_class: Callable,
                timeout_s: float, tls: ClientTLS, budget: BudgetSettings) -> WorkerPool:
    """A static pool over a comma list of addresses, or one that watches a Kubernetes Service."""
    if not service:
        return WorkerPool(name, Router.static(name, parse_addresses(addresses)), stub_class, budget, tls=tls)
    router = Router(name)
    watcher = EndpointSliceWatcher(router, service, namespace or None).start()
    if not await asyncio.to_thread(watcher.wait_synced, timeout_s or None):
        watcher.stop()
        raise ConnectionError(f"could not list the EndpointSlices of Service {service!r} within {timeout_s} s")
    # Pods are dialled by IP: their certificates name the Service (`specd certs` does).
    return WorkerPool(name, router, stub_class, budget, watcher, tls, server_name=service)


@dataclass
class Backend:
    """The worker pools, the models they host, the target's tokenizer."""

    verifier: WorkerPool
    # The target as validated at start-up: every verifier stream names it.
    target: ModelInfo
    tokenizer: PreTrainedTokenizerBase
    draft: WorkerPool | None
    # name → info of the usable drafts, as validated at start-up (their streams name them);
    # the first is the default.
    drafts: dict[str, ModelInfo]
    # Drafts the draft service hosts but the gateway never uses: name → (info, why).
    unusable: dict[str, tuple[ModelInfo, str]] = field(default_factory=dict)
    # The target's own sampling defaults (`sampling_defaults`): what an HTTP request that
    # leaves one of them unset gets.
    sampling_defaults: dict[str, float] = field(default_factory=dict)

    @property
    def default_draft(self) -> str:
        return next(iter(self.drafts), "")

    @functools.cached_property
    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """The target's tokenizer as structured output's matcher reads it (built at the first
        structured request, on the gateway's one parse thread)."""
        return tokenizer_for(self.tokenizer, self.target.vocab_size, self.target.eos_token_ids)

    async def close(self) -> None:
        await self.verifier.close()
        if self.draft is not None:
            await self.draft.close()


# The generation_config.json fields that are sampling parameters of the OpenAI API, as
# vLLM's --generation-config auto reads them.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(files: dict[str, bytes]) -> dict[str, float]:
    """The sampling parameters the model's generation_config.json sets (a model card's
    recommended temperature, say); {} when it sets none or the file is missing or unreadable."""
    try:
        config = json.loads(files.get("generation_config.json", b"{}"))
    except ValueError:
        return {}
    return {name: config[name] for name in SAMPLING_DEFAULTS
            if isinstance(config.get(name), (int, float)) and not isinstance(config.get(name), bool)}


def _tokenizer_from_files(files: dict[str, bytes]) -> PreTrainedTokenizerBase:
    with tempfile.TemporaryDirectory(prefix="specd-tokenizer-") as tmp:
        for name, content in files.items():
            (Path(tmp) / Path(name).name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)


def tokenizer_problem(target: ModelInfo, draft: ModelInfo) -> str | None:
    """Why a draft cannot speculate for the target (a different tokenizer); None if it can."""
    if draft.tokenizer_fingerprint == target.tokenizer_fingerprint:
        return None
    return (f"draft {draft.name!r} (vocab {draft.vocab_size}, tokenizer {draft.tokenizer_fingerprint[:12]}) "
            f"does not share the target {target.name!r}'s tokenizer (vocab {target.vocab_size}, tokenizer "
            f"{target.tokenizer_fingerprint[:12]}): speculative decoding exchanges token ids, so the draft "
            f"must use exactly the target's tokenizer. Train or pick a draft with the same tokenizer.")


def check_drafts(target: ModelInfo, drafts: list[ModelInfo],
                 task_drafts: dict[str, str] | None = None) -> dict[str, str]:
    """The drafts set aside (name → why), because their tokenizer differs from the target's.

    A draft service hosting several drafts, one of them wrong, still serves with the
    others: the wrong one is never used and `GetGatewayInfo` (so `specd doctor`) reports
    it. Raises IncompatibleDraft when no hosted draft fits, or --task-draft names one that
    does not: then nothing sensible can be served as configured.
    """
    problems = {d.name: p for d in drafts if (p := tokenizer_problem(target, d)) is not None}
    named = {task: name for task, name in (task_drafts or {}).items() if name in problems}
    if problems and (len(problems) == len(drafts) or named):
        raise IncompatibleDraft("; ".join(problems.values()) + (f" (named by --task-draft {named})" if named else ""))
    return problems


async def connect(settings: GatewaySettings) -> Backend:
    """Reach the workers, fetch their models, check them, build the tokenizer."""
    timeout = settings.worker_timeout_s
    verifier = await _pool("verifier", settings.verifier_address, settings.verifier_service,
                           settings.namespace, worker_pb2_grpc.VerifierStub, timeout, settings.worker_tls,
                           BudgetSettings(settings.verifier_step_floor_s, settings.step_budget_factor))
    draft = None
    try:
        (target_pb,) = await verifier.model_infos(timeout)
        target = model_info_from_pb(target_pb)
        drafts: list[ModelInfo] = []
        problems: dict[str, str] = {}
        if settings.draft_address or settings.draft_service:
            draft = await _pool("draft", settings.draft_address, settings.draft_service, settings.namespace,
                                worker_pb2_grpc.DraftStub, timeout, settings.worker_tls,
                                BudgetSettings(settings.draft_step_floor_s, settings.step_budget_factor))
            drafts = [model_info_from_pb(info) for info in await draft.model_infos(timeout)]
            problems = check_drafts(target, drafts, settings.task_drafts)
            for problem in problems.values():
                log.error("%s This draft is never used.", problem)
        unknown = {task: name for task, name in settings.task_drafts.items()
                   if name not in {d.name for d in drafts}}
        if unknown:
            raise IncompatibleDraft(f"--task-draft names drafts the draft service does not host: {unknown}; "
                                    f"it hosts {[d.name for d in drafts]}")
        files = dict(target_pb.tokenizer_files)
        tokenizer = _tokenizer_from_files(files)
    except BaseException:
        await verifier.close()
        if draft is not None:
            await draft.close()
        raise
    return Backend(verifier, target, tokenizer, draft, {d.name: d for d in drafts if d.name not in problems},
                   {d.name: (d, problems[d.name]) for d in drafts if d.name in problems}, sampling_defaults(files))
