"""The workers' settings: how a worker runs and batches its model(s), one object per service.

Built once in the entrypoint (`specd.cli`) from the flags and passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specd.config import DEMO_TARGET, ServerSettings

DTYPES = ("float32", "bfloat16", "float16")  # of a worker's model(s); specd.worker.runtime maps them to torch


@dataclass(frozen=True)
class BatchSettings:
    """How a worker batches its model's forwards."""

    max_batch_tokens: int = 1024  # tokens in one forward (a job's chunk always fits)
    prefill_chunk: int = 128  # a long feed goes in pieces of at most this many tokens
    max_queue: int = 256  # steps waiting for the model; beyond: Overloaded
    block_tokens: int = 16  # positions per block of the KV pool (specd.worker.kvstore; 16 measured best on a CPU)
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
    # Overlapped speculation: which verdicts to pre-draft for (specd.worker.predraft): "all"
    # accepted lengths, only "bonus" (everything accepted), or the K the draft finds
    # most likely (fewer branches: fewer draft forwards competing with the gateway).
    pre_draft_branches: str = "3"


@dataclass(frozen=True)
class VerifierSettings:
    server: ServerSettings
    target: Path = DEMO_TARGET  # the model directory (a hub id resolved: specd.worker.hub)
    model: ModelSettings = ModelSettings()
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus /metrics (sessions, queue, KV bytes); 0: off
    target_name: str = ""  # the target's name; empty: its directory's name
