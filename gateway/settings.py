"""The gateway's settings, one object, built once in the entrypoint (`specd.cli`) and passed in."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.drift import DriftSettings
from gateway.tasks import DEFAULT_PROFILES, TaskProfile
from specd.config import DEFAULT_DRAFT_PORT, DEFAULT_VERIFIER_PORT, ClientTLS, ServerSettings

DRAFT_SELECTIONS = ("task-map", "goodput")
# The draft selection of `specd gateway` and `specd serve` (--draft-selection). The
# settings object keeps "task-map" by default so code that embeds the gateway opts in.
CLI_DRAFT_SELECTION = "goodput"


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
    overlap: bool = False  # overlapped speculation unless a request says otherwise (specd.worker.predraft)
    default_min_confidence: float = 0.5  # for the confidence policy
    # task type → prior acceptance and γ bounds (gateway.tasks.DEFAULT_PROFILES by default)
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
    # default draft) or "goodput" (gateway.selection: the best measured tokens/ms per task
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
