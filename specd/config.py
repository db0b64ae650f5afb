"""Typed settings, one object per service, built once in the entrypoint and passed in.

Nothing here reads the environment at import time; `specd.cli` fills these from flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.drift import DriftSettings
from specd.tasks import DEFAULT_PROFILES, TaskProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFT = REPO_ROOT / "models" / "demo" / "draft-distilled"
# Where each service listens unless told otherwise (`specd gateway|draft|verifier --port`).
DEFAULT_GATEWAY_PORT, DEFAULT_DRAFT_PORT, DEFAULT_VERIFIER_PORT = 50051, 50052, 50053


@dataclass(frozen=True)
class ServerTLS:
    """The certificate a server presents, and whose clients it accepts (PEM files).

    No cert: plaintext. With client_ca: mutual TLS, clients must present a certificate
    signed by that CA (how the workers accept only their gateways).
    """

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class ClientTLS:
    """How a client (the gateway towards its workers, `specd generate`) trusts a server.

    No CA and no cert: plaintext. ca: trust servers signed by it (None: the system's
    roots); cert/key: present this client certificate (mutual TLS). server_name: the
    name checked in the server's certificate instead of the dialled host, for endpoints
    dialled by IP (pods found through EndpointSlices present their Service's name).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None


@dataclass(frozen=True)
class ServerSettings:
    """Where a service listens, how it shuts down, and its TLS."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port (tests)
    grace_s: float = 10.0  # how long in-flight requests may finish after SIGTERM
    tls: ServerTLS = ServerTLS()
    # > 0: also serve grpc.health.v1 alone, in plaintext, on this port: Kubernetes' gRPC
    # probes cannot speak TLS, so a TLS server needs a plaintext door for its probes.
    health_port: int = 0
    # Listen on this Unix domain socket instead of host:port: only processes that may enter
    # its directory reach it (how `specd serve` keeps its workers private).
    socket: Path | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.socket}" if self.socket is not None else f"{self.host}:{self.port}"


DRAFT_SELECTIONS = ("task-map", "goodput")
# The draft selection of `specd gateway` and `specd serve` (--draft-selection). The
# settings object keeps "task-map" by default so code that embeds the gateway opts in.
CLI_DRAFT_SELECTION = "goodput"
DTYPES = ("float32", "bfloat16", "float16")  # of a worker's model(s); specd.runtime maps them to torch


@dataclass(frozen=True)
class BatchSettings:
    """How a worker batches its model's forwards."""

    max_batch_tokens: int = 1024  # tokens in one forward (a job's chunk always fits)
    prefill_chunk: int = 128  # a long feed goes in pieces of at most this many tokens
    max_queue: int = 256  # steps waiting for the model; beyond: Overloaded
    block_tokens: int = 16  # positions per block of the KV pool (specd.kvstore; 16 measured best on a CPU)
    # Positions the KV pool holds, all sessions together; 0: every session at full context,
    # within half the memory free when the model loads (the GPU's, or the host's).
    kv_cache_tokens: int = 0
    # How long a forward may wait for the steps of other open sessions to arrive, so that
    # they share it, at most a quarter of a recent forward's time; 0: start at once.
    max_wait_ms: float = 3.0

    def problems(self) -> list[str]:
        found = []
        for name in ("max_batch_tokens", "prefill_chunk", "max_queue", "block_tokens"):
            if getattr(self, name) < 1:
                found.append(f"{name} must be >= 1")
        if self.kv_cache_tokens < 0:
            found.append(f"kv_cache_tokens must be >= 0, got {self.kv_cache_tokens}")
        if not self.max_wait_ms >= 0:
            found.append(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        return found


@dataclass(frozen=True)
class ModelSettings:
    """How a worker runs its model(s)."""

    dtype: str = "float32"
    max_sessions: int = 64  # KV caches kept; the least recently used is evicted beyond
    device: str = "cpu"  # "cuda", "cuda:1", ...
    batching: BatchSettings = BatchSettings()


@dataclass(frozen=True)
class DraftSettings:
    server: ServerSettings
    # name → model directory; the first is the default draft.
    drafts: dict[str, Path] = field(default_factory=dict)
    model: ModelSettings = ModelSettings()
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus /metrics (sessions, queue, KV bytes); 0: off
    # Overlapped speculation: which verdicts to pre-draft for (specd.predraft): "all"
    # accepted lengths, only "bonus" (everything accepted), or the K the draft finds
    # most likely (fewer branches: fewer draft forwards competing with the gateway).
    pre_draft_branches: str = "3"


@dataclass(frozen=True)
class VerifierSettings:
    server: ServerSettings
    target: Path = DEMO_TARGET  # the model directory (a hub id resolved: specd.hub)
    model: ModelSettings = ModelSettings()
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus /metrics (sessions, queue, KV bytes); 0: off
    target_name: str = ""  # the target's name; empty: its directory's name


@dataclass(frozen=True)
class GatewaySettings:
    server: ServerSettings
    # Workers by address: one or a comma list of host:port (sessions are spread over them).
    verifier_address: str = f"127.0.0.1:{DEFAULT_VERIFIER_PORT}"
    # Empty (and no draft_service): every request decodes plainly.
    draft_address: str = f"127.0.0.1:{DEFAULT_DRAFT_PORT}"
    # Or by Kubernetes Service: watch its EndpointSlices (overrides the address).
    verifier_service: str = ""
    draft_service: str = ""
    namespace: str = ""  # empty: the pod's own namespace
    # TLS towards the workers (mutual with a client cert). Without a server_name, pods
    # found through a Service are checked against that Service's name.
    worker_tls: ClientTLS = ClientTLS()
    default_draft_length: int = 4  # γ for FIXED/AUTO when the request gives none
    max_draft_length: int = 16  # requests asking for more are refused
    default_max_new_tokens: int = 128
    worker_timeout_s: float = 60.0  # how long to wait for the workers at start-up
    # Step budgets (gateway.budgets): max(floor, factor × measured p99 step time) per forward.
    draft_step_floor_s: float = 0.5
    verifier_step_floor_s: float = 5.0
    step_budget_factor: float = 4.0
    max_session_reopens: int = 3  # failed re-opens in a row per worker before UNAVAILABLE
    worker_connect_timeout_s: float = 5.0  # a worker not yet connected must accept the stream within this
    max_concurrent_requests: int = 64  # beyond: RESOURCE_EXHAUSTED (keep ≤ the workers' --max-sessions)
    auto_policy: str = "cost"  # the γ policy of SPECULATION_MODE_AUTO
    overlap: bool = False  # overlapped speculation unless a request says otherwise (specd.predraft)
    default_min_confidence: float = 0.5  # for the confidence policy
    # task type → prior acceptance and γ bounds (specd.tasks.DEFAULT_PROFILES by default)
    task_profiles: dict[str, TaskProfile] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    # task type (or agent role) → draft model name; others use the default draft
    task_drafts: dict[str, str] = field(default_factory=dict)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    window_steps: int = 2000  # steps in the acceptance sliding window
    # The edge (docs/reliability.md): who may call, and how much one call may ask.
    api_keys_file: Path | None = None  # `SEGMENT KEY` / `SEGMENT sha256:HEX` lines; None: no keys needed
    protect_reflection: bool = False  # with keys: reflection needs a key too (health never does)
    # Requests in flight per tenant (segment); 0: three quarters of max_concurrent_requests
    # when the key file names several tenants, no limit for a lone one.
    key_max_in_flight: int = 0
    max_request_bytes: int = 1024 * 1024  # largest request message the public API receives
    max_prompt_bytes: int = 256 * 1024  # checked before tokenizing
    max_new_tokens_cap: int = 4096  # largest max_new_tokens a request may ask
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # per stop string
    max_label_bytes: int = 64  # task_type, draft_model and policy names
    # HTTP/2 concurrent streams one client connection may open. Far above
    # max_concurrent_requests: in a burst, admission answers RESOURCE_EXHAUSTED before
    # HTTP/2 would refuse a stream (REFUSED_STREAM, which clients see as UNAVAILABLE).
    max_streams_per_connection: int = 1024
    min_client_ping_interval_s: float = 10.0  # client keepalive pings closer than this are strikes
    # How a request that names no draft gets one: "task-map" (--task-draft, else the
    # default draft) or "goodput" (specd.selection: the best measured tokens/ms per task
    # type and user segment, starting from the task map). `specd gateway` defaults to
    # goodput (CLI_DRAFT_SELECTION); this object keeps the task map so embedding code opts in.
    draft_selection: str = "task-map"
    drift: DriftSettings = DriftSettings()  # when a drop in acceptance raises a flag
    # A pinned acceptance per (model pair, task type) to judge drift against instead of
    # lifetime acceptance (`specd doctor --write-baseline` writes one).
    acceptance_baseline: Path | None = None
    # Model-free proposers the gateway hosts (gateway.proposers: "suffix", "prompt-lookup"),
    # used beside the draft model under AUTO and by name. `specd serve` and `specd gateway`
    # host both (CLI_MODEL_FREE); this object hosts none, so embedding code opts in.
    model_free: tuple[str, ...] = ()
    suffix_cache_tokens: int = 262_144  # previous responses kept for `suffix`, over every tenant
    prompt_lookup_min: int = 2  # n-gram lengths `prompt-lookup` matches (vLLM's ngram: min/max n)
    prompt_lookup_max: int = 5
    # OpenAI-compatible HTTP (gateway.http) on the gateway's host: None off, 0 a free port.
    http_port: int | None = None
    chat_template: Path | None = None  # Jinja template for /v1/chat/completions; None: the tokenizer's
