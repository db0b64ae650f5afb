"""Typed settings, one object per service, built once in the entrypoint and passed in.

Nothing here reads the environment at import time; `specd.cli` fills these from flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.tasks import DEFAULT_PROFILES, TaskProfile

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFT = REPO_ROOT / "models" / "demo" / "draft-distilled"


@dataclass(frozen=True)
class ServerSettings:
    """Where a service listens and how it shuts down."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port (tests)
    grace_s: float = 10.0  # how long in-flight requests may finish after SIGTERM

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ModelSettings:
    """How a worker runs its model(s)."""

    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    max_sessions: int = 64  # KV caches kept; the least recently used is evicted beyond
    device: str = "cpu"  # "cuda", "cuda:1", ...


@dataclass(frozen=True)
class DraftSettings:
    server: ServerSettings
    # name → model directory; the first is the default draft.
    drafts: dict[str, Path] = field(default_factory=dict)
    model: ModelSettings = ModelSettings()


@dataclass(frozen=True)
class VerifierSettings:
    server: ServerSettings
    target: Path = DEMO_TARGET
    model: ModelSettings = ModelSettings()


@dataclass(frozen=True)
class GatewaySettings:
    server: ServerSettings
    # Workers by address: one or a comma list of host:port (sessions are spread over them).
    verifier_address: str = "127.0.0.1:50053"
    draft_address: str = "127.0.0.1:50052"  # empty (and no draft_service): every request decodes plainly
    # Or by Kubernetes Service: watch its EndpointSlices (overrides the address).
    verifier_service: str = ""
    draft_service: str = ""
    namespace: str = ""  # empty: the pod's own namespace
    default_draft_length: int = 4  # γ for FIXED/AUTO when the request gives none
    max_draft_length: int = 16  # requests asking for more are refused
    default_max_new_tokens: int = 128
    worker_timeout_s: float = 30.0  # how long to wait for a worker (start-up, reconnect)
    max_session_reopens: int = 3  # failed re-opens in a row per worker before UNAVAILABLE
    worker_connect_timeout_s: float = 5.0  # a new worker stream must be accepted within this
    max_concurrent_requests: int = 64  # beyond: RESOURCE_EXHAUSTED (keep ≤ the workers' --max-sessions)
    auto_policy: str = "cost"  # the γ policy of SPECULATION_MODE_AUTO
    default_min_confidence: float = 0.5  # for the confidence policy
    # task type → prior acceptance and γ bounds (the seed's table by default)
    task_profiles: dict[str, TaskProfile] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    # task type (or agent role) → draft model name; others use the default draft
    task_drafts: dict[str, str] = field(default_factory=dict)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    window_steps: int = 2000  # steps in the acceptance sliding window
    # The edge (docs/reliability.md): who may call, and how much one call may ask.
    api_keys_file: Path | None = None  # `SEGMENT KEY` / `SEGMENT sha256:HEX` lines; None: no keys needed
    protect_reflection: bool = False  # with keys: reflection needs a key too (health never does)
    key_max_in_flight: int = 0  # requests in flight per API key; 0: no per-key limit
    max_request_bytes: int = 1024 * 1024  # largest request message the public API receives
    max_prompt_bytes: int = 256 * 1024  # checked before tokenizing
    max_new_tokens_cap: int = 4096  # largest max_new_tokens a request may ask
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # per stop string
    max_label_bytes: int = 64  # task_type, draft_model and policy names
    max_streams_per_connection: int = 100  # HTTP/2 concurrent streams one client connection may open
    min_client_ping_interval_s: float = 10.0  # client keepalive pings closer than this are strikes
