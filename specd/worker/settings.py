"""The workers' settings: how a worker runs and batches its model(s), one object per service.

Built once in the entrypoint (`specd_cli`) from the flags and passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.config import DEMO_TARGET, ServerSettings
from specd.flags import setting
from specd.prefixkeys import BLOCK_TOKENS

DTYPES = ("float32", "bfloat16", "float16")  # of a worker's model(s); specd.worker.runtime maps them to torch
CPU_LINEARS = ("onednn", "torch")  # how a CPU multiplies a large linear layer (specd.worker.packing)
DRAFT_CPU_WEIGHTS = ("float16", "as-loaded")  # a draft's large linear layers on a CPU (specd.worker.packing)
FORWARDS = ("lean", "transformers")  # whose code runs a Llama model's forward (specd.worker.lean)
ATTENTION_KERNELS = ("gather", "triton")  # how a batched forward reads the pool (specd.worker.pagedkernel)


@dataclass(frozen=True)
class BatchSettings:
    """How a worker batches its model's forwards (`specd.worker.batching`)."""

    max_batch_tokens: int = setting(1024, flag="--max-batch-tokens",
                                    help="tokens in one batched forward, all sessions together")
    prefill_chunk: int = setting(128, flag="--prefill-chunk",
                                 help="feed a long prompt this many tokens per forward, so it does not hold up "
                                      "other sessions' steps")
    max_queue: int = setting(256, flag="--max-queue", help="steps waiting for the model; beyond, RESOURCE_EXHAUSTED")
    # positions per block of the KV pool (specd.worker.kvstore; 16 measured best on a CPU), the
    # gateway's router's prefix blocks too (specd.prefixkeys)
    block_tokens: int = BLOCK_TOKENS
    kv_cache_tokens: int = setting(0, flag="--kv-cache-tokens",
                                   help="positions the KV pool holds, all sessions together (0: every session at "
                                        "full context, within half the memory free at load, the GPU's or the host's)")
    gpu_memory_fraction: float = setting(0.0, flag="--gpu-memory-fraction", metavar="F",
                                         help="on a CUDA device, the share of its total memory this worker may use "
                                              "(0 < F <= 1, as vLLM's --gpu-memory-utilization): the KV pool takes "
                                              "what the weights and a profiling forward at the largest batch leave "
                                              "of it (specd.worker.memory). 0: half of the memory free at load. "
                                              "specd serve splits its F between its two workers")
    no_prefix_caching: bool = setting(False, flag="--no-prefix-caching",
                                      help="do not keep the KV of prompts' shared prefixes for later sessions "
                                           "(specd.worker.kvstore: prefix caching, on by default)")
    max_wait_ms: float = setting(3.0, flag="--batch-wait-ms",
                                 help="how long a forward may wait for other open sessions' steps to share it, at "
                                      "most a quarter of a forward; the sessions it just answered, up to a quarter "
                                      "whatever this says (0: start at once, waiting for none)")

    def problems(self) -> list[str]:
        found = []
        for name in ("max_batch_tokens", "prefill_chunk", "max_queue", "block_tokens"):
            if getattr(self, name) < 1:
                found.append(f"{name} must be >= 1")
        if self.kv_cache_tokens < 0:
            found.append(f"kv_cache_tokens must be >= 0, got {self.kv_cache_tokens}")
        if not 0 <= self.gpu_memory_fraction <= 1:
            found.append(f"gpu_memory_fraction must be in (0, 1] (0: unset), got {self.gpu_memory_fraction}")
        elif self.gpu_memory_fraction and self.kv_cache_tokens:
            found.append("--kv-cache-tokens and --gpu-memory-fraction both size the KV pool: pass one")
        if not self.max_wait_ms >= 0:
            found.append(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        return found


@dataclass(frozen=True)
class ModelSettings:
    """How a worker runs its model(s): what `specd.worker.runtime.ModelRunner` takes, one
    object for every model of a worker (which model, its directory and name, is the
    runner's own argument)."""

    dtype: str = setting("float32", flag="--dtype", choices=DTYPES, help="the weights' dtype")
    max_sessions: int = setting(64, flag="--max-sessions", help="KV caches kept; the least recently used is "
                                                                "evicted beyond")
    device: str = setting("cpu", flag="--device", help="torch device of the model(s): cpu, cuda, cuda:1")
    cpu_linear: str = setting("onednn", flag="--cpu-linear", choices=CPU_LINEARS,
                              help="on a CPU, the products of the large linear layers: oneDNN's, with the weights "
                                   "packed once at load (a few rows cost about what one does), or torch's own")
    forward: str = setting("lean", flag="--model-forward", choices=FORWARDS,
                           help="a Llama-architecture model's forward: specd's lean one, the same operators "
                                "without transformers' per-call Python (used only where a trial at load gives "
                                "the same logits to the bit), or transformers' own")
    cuda_graphs: bool = setting(False, flag="--cuda-graphs",
                                help="on a CUDA device, replay decode and verify forwards of up to 16 tokens a "
                                     "session as CUDA graphs, one per bucket of sessions, tokens and context, "
                                     "captured at load and counted in --gpu-memory-fraction's plan "
                                     "(specd.worker.graphs); other forwards, and models it cannot capture, run "
                                     "eagerly")
    attention_kernel: str = setting("gather", flag="--attention-kernel", choices=ATTENTION_KERNELS,
                                    help="how attention reads the KV pool: gather each row's blocks and run one "
                                         "SDPA, or (CUDA only) a Triton kernel that reads them through the block "
                                         "tables (specd.worker.pagedkernel); a model it cannot serve, or one "
                                         "whose trial at load differs, keeps the gather")
    batching: BatchSettings = BatchSettings()

    def problems(self) -> list[str]:
        """What is wrong with these settings, in words a person can act on: the batching's, and a
        device this machine lacks or a memory fraction for a device it does not size
        (`specd.worker.memory.device_problem`, which imports torch)."""
        found = self.batching.problems()
        if found:
            return found
        from specd.worker.memory import device_problem

        problem = device_problem(self.device, self.batching.gpu_memory_fraction)
        if problem is None and self.cuda_graphs and not self.device.startswith("cuda"):
            problem = (f"--cuda-graphs captures forwards on a CUDA device, and this worker runs on {self.device}: "
                       f"leave it out, or pass --device cuda")
        if problem is None and self.attention_kernel == "triton" and not self.device.startswith("cuda"):
            problem = (f"--attention-kernel triton runs on a CUDA device, and this worker runs on {self.device}: "
                       f"leave it out (the gather), or pass --device cuda")
        return [problem] if problem else []


# A worker's Prometheus endpoint: each worker of `specd serve` would need a port of its own.
_METRICS_HOST: dict[str, Any] = dict(flag="--metrics-host", serve=False, help="interface of the /metrics endpoint")
_METRICS_PORT: dict[str, Any] = dict(flag="--metrics-port", serve=False,
                     help="serve Prometheus metrics (sessions held, steps queued, KV bytes) at "
                          "http://HOST:PORT/metrics (0: off)")


@dataclass(frozen=True)
class DraftSettings:
    server: ServerSettings
    # name → model directory; the first is the default draft.
    drafts: dict[str, Path] = field(default_factory=dict)
    model: ModelSettings = ModelSettings()
    metrics_host: str = setting("127.0.0.1", **_METRICS_HOST)
    metrics_port: int = setting(0, **_METRICS_PORT)
    # Fewer branches: fewer draft forwards competing with the gateway.
    pre_draft_branches: str = setting("3", flag="--pre-draft-branches", metavar="all|bonus|K",
                                      help="overlapped speculation (draft_service.predraft): pre-draft for every "
                                           "accepted length (all), only for everything accepted (bonus), or for "
                                           "the K verdicts the draft finds most likely")
    kept_rows_mib: int = setting(512, flag="--kept-rows-mib",
                                 help="memory for the q rows each session's last sampled proposal keeps for the "
                                      "next recovered token, all sessions together; past it the oldest go, and "
                                      "their session rebuilds q with one forward")

    cpu_weights: str = setting("float16", flag="--draft-cpu-weights", choices=DRAFT_CPU_WEIGHTS,
                               help="on a CPU, with --cpu-linear onednn and --dtype float32: the draft's large linear "
                                    "layers hold float16 weights, multiplied by fbgemm in float32 arithmetic (half "
                                    "the bytes a token reads; its proposals move a little, the output never, since "
                                    "the target verifies each), or the weights as loaded")
    grammar_mask_budget_ms: float = setting(20.0, flag="--grammar-mask-budget-ms", metavar="MS",
                                            help="a session whose grammar mask takes longer drafts unguided by its "
                                                 "grammar from then on (its masks run between every session's "
                                                 "forwards); the gateway's grammar still decides the output")
    # A draft made from its target alone reads the embedding it shares from here
    # (specd.worker.sharing); `specd serve` passes its --target, resolved.
    draft_base: Path | None = None

@dataclass(frozen=True)
class VerifierSettings:
    server: ServerSettings
    target: Path = DEMO_TARGET  # the model directory (a hub id resolved: specd.worker.hub)
    model: ModelSettings = ModelSettings()
    metrics_host: str = setting("127.0.0.1", **_METRICS_HOST)
    metrics_port: int = setting(0, **_METRICS_PORT)
    target_name: str = ""  # the target's name; empty: its directory's name
