"""Model runtime shared by the draft and verifier services.

Loads any transformers causal LM and its tokenizer from a local directory, keeps one
KV cache per session (`specd.worker.kvstore`; cropped to the committed length each step) and
runs the steps of all sessions through one batch scheduler per model
(`specd.worker.batching`), whose forwards run on the model's own thread, never on the event
loop. Every session's keys and values live in the model's one `KVPool`, sized when the
model loads. Session state is touched only on the event loop, or by the forward of a step
that has taken the session out of the store. No gRPC here.

What a step does with a session is its role's: proposing (`draft_service.drafter`) or
scoring (`verifier_service.scorer`). A role holds a `ModelRunner`, brings a session up to
date with `sync`, runs its job with `step`, and keeps its own per-session state, which
the runner tells it to drop when a session goes (`ModelRunner(on_session_gone=)`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from specd.devices import bf16_is_fast
from specd.errors import InvalidArgument, Overloaded, SessionNotFound, UnsupportedModel
from specd.steps import ModelInfo
from specd.worker import forwards, graphs, lean, memory, packing, pagedkernel, rope, sharing, trials
from specd.worker.attention import use_paged_attention
from specd.worker.batching import Job, Scheduler
from specd.worker.identity import weights_digest
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.settings import CPU_LINEARS, FORWARDS, BatchSettings, ModelSettings

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The forwards a worker times at load (`ModelRunner.measure_forwards`): sessions sharing the
# forward (the gateway's load buckets) by tokens each feeds (a plain step, γ = 1, 2, 4, 8).
FORWARD_COST_BATCHES = (1, 2, 4, 8, 16, 32)
FORWARD_COST_WIDTHS = (1, 2, 3, 5, 9)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's id→token map.

    Speculative decoding exchanges token ids, so draft and target agree exactly when
    every id means the same token; this hash says whether they do.
    """
    vocab = sorted((idx, tok) for tok, idx in tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids that end a generation, as vLLM takes them: the model's generation config's
    (a chat model often lists its end-of-turn token there), then the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    listed = [] if eos is None else [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]
    if tokenizer.eos_token_id is not None:
        listed.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(listed))


class SessionStore:
    """The sessions of one model, least recently used first; the only owner of them.

    Steps take a session out (`take`) and put it back when they succeed (`put`), so a
    step that fails leaves nothing stale behind (the gateway re-opens the session), and a
    second stream cannot touch a session while a step of it is in a batch.
    """

    def __init__(self, max_sessions: int, on_evict: Callable[[str], None] = lambda session_id: None) -> None:
        """on_evict(session_id): told of every session evicted (what else it holds goes too)."""
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, SessionKV] = OrderedDict()
        self._on_evict = on_evict
        self.in_use = 0  # sessions taken out by steps in progress

    def take(self, session_id: str) -> SessionKV:
        try:
            session = self._sessions.pop(session_id)
        except KeyError:
            raise SessionNotFound(session_id) from None
        self.in_use += 1
        return session

    def put(self, session_id: str, session: SessionKV) -> None:
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._on_evict(self._sessions.popitem(last=False)[0])  # evict the least recently used

    def adopt(self) -> None:
        """A step opened a new session: it counts as taken until the step ends."""
        self.in_use += 1

    def release(self) -> None:
        """A taken session's step is over (put back or dropped)."""
        self.in_use -= 1

    def evict_idle(self) -> bool:
        """Forget the least recently used idle session (its gateway re-opens it if it comes
        back); False when none is idle."""
        if not self._sessions:
            return False
        self._on_evict(self._sessions.popitem(last=False)[0])
        return True

    def holds(self, session_id: str) -> bool:
        """Whether the session is here and idle (not taken by a step)."""
        return session_id in self._sessions

    def drop(self, session_id: str) -> bool:
        """Forget a session; True when it was held (idle)."""
        return self._sessions.pop(session_id, None) is not None

    def kv_bytes(self) -> int:
        """Bytes of KV storage held by the idle sessions (steps in progress hold theirs)."""
        return sum(s.nbytes() for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions) + self.in_use


def event_loop_single_threaded() -> None:
    """From now on this thread (a worker's event loop, once its models are loaded) runs
    torch on one thread; each model's thread keeps the count it took at its first torch
    operator, when it loaded (`ModelRunner`).

    OpenMP gives every thread that starts a parallel region a team of its own, and once
    the teams' threads outnumber the CPUs it stops letting them spin between regions
    (libgomp's GOMP_SPINCOUNT), so each of a forward's small products pays a sleeping
    helper's wake-up. The event loop starts regions of its own (zeroing a KV block is one).
    On this 2-core machine the demo target's forward then took about 7 ms instead of 4.5
    (docs/serving-path.md, "One OpenMP team per worker").
    """
    torch.set_num_threads(1)


class ModelRunner:
    """One causal LM with its tokenizer, its sessions, its batch scheduler and its one thread."""

    def __init__(self, path: str | Path, settings: ModelSettings = ModelSettings(), *, name: str | None = None,
                 kept_rows_bytes: int = 0, draft_base: Path | None = None, float16_linears: bool = False,
                 on_session_gone: Callable[[str], None] = lambda session_id: None) -> None:
        """path: the model directory; name: the model's name as the worker reports it (None:
        the directory's). Both say which model; `settings` says how it runs, and is shared by
        every model of a worker.

        kept_rows_bytes: device memory its role keeps beside the KV pool (a draft's kept q
        rows), which a pool sized by --gpu-memory-fraction leaves room for.

        draft_base: the target model directory a draft that shares its target's weights
        reads them from (`specd.worker.sharing`); None for any other model.

        float16_linears: a draft's role asks for its large linear layers in float16 on a CPU
        (`specd.worker.packing`'s layout "float16"), where the model is float32, packed
        (--cpu-linear onednn) and this torch has fbgemm; a target's products stay as loaded,
        since its logits decide the output.

        on_session_gone(session_id): the role's hook, called whenever a session goes, evicted
        under memory pressure or ended (`end_session`). The runner owns the sessions and
        decides when one goes; the role (`draft_service.drafter`, `verifier_service.scorer`)
        owns what else it keeps for the session (kept q rows, pre-drafted branches, a run
        scored ahead), which must go with it. The runtime imports no role
        (tests/test_layering.py), so the role hands it this one function."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        problem = memory.device_problem(settings.device, settings.batching.gpu_memory_fraction)
        if problem is not None:  # before anything loads: a CUDA device this machine lacks is said plainly
            raise ValueError(problem)
        if settings.cpu_linear not in CPU_LINEARS:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEARS}, got {settings.cpu_linear!r}")
        if settings.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {settings.forward!r}")
        self.path = path
        self.draft_base = draft_base
        self.float16_linears = float16_linears
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device(settings.device)
        self.dtype = DTYPES[settings.dtype]
        if self.dtype == torch.bfloat16 and not bf16_is_fast(self.device):
            log.warning("serving %s in bfloat16 on a CPU without bfloat16 kernels (AVX512-BF16 or AMX): "
                        "its matmuls are emulated, tens of times slower than float32; --dtype float32 "
                        "serves faster here", path)

        # The model's operators run on its one thread from loading on (see
        # `event_loop_single_threaded`).
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{name or path.name}")
        try:
            self._executor.submit(self._load, path, name, kept_rows_bytes).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self._on_session_gone = on_session_gone
        self.sessions = SessionStore(settings.max_sessions, on_evict=on_session_gone)
        self.scheduler = Scheduler(self._forward_batch, self._executor, settings.batching, lambda: len(self.sessions),
                                   rope.regime(self.model), self.device)

    def _cpu_layout(self) -> str:
        """How packing lays out the large linear layers' weights (`packing.LAYOUTS`)."""
        if not self.float16_linears:
            return "onednn"
        layout = packing.draft_layout(self.dtype)
        if layout != "float16" and self.dtype == torch.float32:
            log.info("%s: this torch has no fbgemm (an x86 build's), so the draft's weights stay float32", self.path)
        return layout

    def _load(self, path: Path, name: str | None, kept_rows_bytes: int) -> None:
        """On the model's thread: load the model, pack it, size its KV pool, try it, and
        give it the lean forward where that is exact. With --gpu-memory-fraction the trials
        run on a small pool first, then a profiling forward, and the pool is sized after
        (`specd.worker.memory`)."""
        def load() -> PreTrainedModel:
            if sharing.is_shared_draft(path):
                return sharing.load(path, self.dtype, self.draft_base).to(self.device)
            return AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()

        batching, max_sessions = self.settings.batching, self.settings.max_sessions
        fraction = batching.gpu_memory_fraction  # only on a CUDA device (checked in __init__)
        allocated_before = torch.cuda.memory_allocated(self.device) if fraction else 0
        # On a CPU, large linear layers packed for oneDNN, or a draft's in float16 (a GPU's
        # model is left as it is); for the lean forward, sibling projections packed as one product.
        joined = lean.joinable if self.settings.forward == "lean" else None
        self.model = (packing.packed_model(load, joined, self._cpu_layout())
                      if self.settings.cpu_linear == "onednn" else load())
        config = self.model.config
        self.info = ModelInfo(
            name=name or path.name,
            vocab_size=int(config.vocab_size),
            max_context=int(getattr(config, "max_position_embeddings", 0) or 2048),
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
            eos_token_ids=eos_ids(self.model, self.tokenizer),
            weights_digest=weights_digest(path),
            parameter_bytes=packing.weight_bytes(self.model),
            card_json=(path / "card.json").read_text() if (path / "card.json").is_file() else "",
            model_path=str(path.resolve()),
        )
        # What the store can hold, and whether it serves the model exactly, is found by
        # trying the model at load: a model refused here never fails at a request.
        self._kv_shape = trials.kv_shape(self.model, self.device)
        use_paged_attention(self.model)
        self.memory_plan: memory.MemoryPlan | None = None
        profile, loaded = None, 0
        if fraction:  # a pool for the trials and the profiling forward; the real one is sized after
            loaded = torch.cuda.memory_allocated(self.device) - allocated_before
            profile = memory.profile_shape(max_sessions=max_sessions, max_batch_tokens=batching.max_batch_tokens,
                                           prefill_chunk=batching.prefill_chunk, max_context=self.info.max_context,
                                           block_tokens=batching.block_tokens)
            self.pool = KVPool(*self._kv_shape, self.dtype, self.device, batching.block_tokens,
                               memory.profile_blocks(profile, batching.block_tokens) + 64)
        else:
            self.pool = KVPool(*self._kv_shape, self.dtype, self.device, batching.block_tokens,
                               self._pool_blocks(batching, max_sessions),
                               prefix_caching=not batching.no_prefix_caching)
        try:
            problem = rope.problem(self.model) or trials.batching_problem(self.model, self.pool,
                                                                          self.info.vocab_size, self.device)
        except Exception as exc:  # anything the trial meets is a refusal naming the family, never a crash
            problem = f"the load-time trial fails: {type(exc).__name__}: {exc}"
        if problem is not None:
            raise UnsupportedModel(f"{path} ({config.model_type}) cannot be served: {problem}")
        self.lean_forward = False
        if self.settings.forward == "lean":
            unmirrored = lean.install(self.model, self.pool, self.info.vocab_size, self.device)
            self.lean_forward = unmirrored is None
            if unmirrored is not None:
                # A family the lean forward mirrors that still keeps transformers' (a trial that
                # differs on this device or dtype) is a surprise, and a slower forward: said loudly.
                level = logging.WARNING if lean.of_a_family(self.model) else logging.INFO
                log.log(level, "%s keeps transformers' forward: %s", self.info.name, unmirrored)
        if self.settings.attention_kernel == "triton":  # before the profile: it gathers nothing
            self._use_paged_kernel()
        decoder = self._graph_decoder() if self.settings.cuda_graphs else None
        if profile is not None:
            self.pool = self._sized_pool(batching, max_sessions, profile, loaded, kept_rows_bytes, decoder)
        # The context a request may use: the model's, as far as the pool holds one session of it.
        held = (self.pool.blocks - 1) * batching.block_tokens  # all but the null block
        if held < self.info.max_context:
            self.info = replace(self.info, max_context=held)
        self.static_steps: graphs.StaticSteps | None = None
        if decoder is not None:  # after the pool is final: a graph holds its tensors' addresses
            self._use_graphs(decoder, batching, max_sessions)
        # What a forward costs at each load, for the gateways' priors: timed once, here, with
        # the forward the requests will get.
        costs = self._measure_forwards(FORWARD_COST_BATCHES, FORWARD_COST_WIDTHS, 64, 3)
        self.info = replace(self.info, forward_costs=tuple((b, w, ms) for (b, w), ms in sorted(costs.items())))

    def _use_paged_kernel(self) -> None:
        """Read the pool through the paged kernel (`specd.worker.pagedkernel`) where it serves
        this model and its logits on the load-time trial forwards agree with the gather's (to
        the rounding of another order of sums); else say why, and keep the gather."""
        problem = pagedkernel.problem(self.model, self.device, interpret=pagedkernel.interpreted())
        if problem is None:
            forward = forwards.stand_in(self.model) or functools.partial(forwards.own_forward, self.model)
            try:
                gathered = trials.trial_logits(forward, self.pool, self.info.vocab_size, self.device)
                paged = trials.trial_logits(forward, self.pool, self.info.vocab_size, self.device, paged_kernel=True)
                problem = gathered if isinstance(gathered, str) else paged if isinstance(paged, str) else \
                    pagedkernel.disagreement(gathered, paged, self.dtype)
            except Exception as exc:  # noqa: BLE001 — whatever it raises, the model keeps the gather
                problem = f"the kernel fails its trial: {type(exc).__name__}: {exc}"
        if problem is not None:
            log.warning("%s keeps the gather for attention: %s", self.info.name, problem)
            return
        forwards.use_paged_kernel(self.model)
        log.info("%s reads the KV pool through the paged kernel", self.info.name)

    def _graph_decoder(self) -> graphs.Decoder | None:
        """The lean forward to capture as CUDA graphs (`specd.worker.graphs`), where this model
        can be captured; else None, having said why (it keeps the eager forwards)."""
        decoder = lean.decoder_of(self.model)
        problem = graphs.problem(self.model, decoder, rope.regime(self.model) is not None)
        if problem is not None:
            log.warning("%s runs without CUDA graphs: %s", self.info.name, problem)
            return None
        return decoder

    def _use_graphs(self, decoder: graphs.Decoder, batching: BatchSettings, max_sessions: int) -> None:
        """Capture this model's decode and verify forwards as CUDA graphs, now, at load; say
        what they took beside what the memory plan kept for them. A capture that fails leaves
        the eager forwards, said loudly: a worker that serves slower beats one that does not."""
        buckets = graphs.buckets(max_sessions=max_sessions, batching=batching, max_context=self.info.max_context)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # so that what the captures take is what the device has free less
        free_before, _ = torch.cuda.mem_get_info(self.device)
        began = time.perf_counter()
        try:
            self.static_steps = graphs.StaticSteps(decoder, self.pool, self.device, buckets, capture=True,
                                                   paged_kernel=forwards.paged_kernel(self.model))
        except Exception as exc:  # noqa: BLE001 — the worker still serves, eagerly
            log.error("%s: capturing its CUDA graphs failed, it runs eagerly: %s: %s", self.info.name,
                      type(exc).__name__, exc)
            torch.cuda.empty_cache()
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up runs' freed blocks: the eager forwards' activation, not the graphs'
        took = free_before - torch.cuda.mem_get_info(self.device)[0]
        planned = self.memory_plan.graphs if self.memory_plan is not None else None
        log.info("%s: %d CUDA graphs captured in %.1f s, taking %.0f MiB%s", self.info.name, len(buckets),
                 time.perf_counter() - began, took / memory.MiB,
                 "" if planned is None else f" (the memory plan kept {planned / memory.MiB:.0f} MiB)")
        if planned is not None and took > planned:
            log.warning("%s: its CUDA graphs took %.0f MiB, more than the %.0f MiB the memory plan kept for "
                        "them: lower --gpu-memory-fraction if the device runs short", self.info.name,
                        took / memory.MiB, planned / memory.MiB)
        forwards.use_static_steps(self.model, self.static_steps)

    async def close(self) -> None:
        await self.scheduler.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def end_session(self, session_id: str) -> None:
        """Forget a session, and what its role keeps for it: the gateway named it ended, its
        request's deadline passed, or the stream that opened it ended."""
        self._on_session_gone(session_id)  # first: a run scored ahead holds the session taken
        self.sessions.drop(session_id)

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files of the model directory the gateway reads, by name: the tokenizer's, the
        chat template wherever transformers keeps it (transformers 5 saves it apart, in
        chat_template.jinja), and the model's generation defaults."""
        names = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "generation_config.json"}
        return {p.name: p.read_bytes() for p in sorted(self.path.iterdir()) if p.name in names}

    def _measure_forwards(self, batches: Sequence[int], widths: Sequence[int], context: int,
                          repeats: int) -> dict[tuple[int, int], float]:
        """Milliseconds of one batched forward of `batch` sessions feeding `width` tokens each
        (a plain step is width 1, a verification of γ tokens width γ+1), each session holding
        `context` cached positions: the median of `repeats`, by (batch, width). On the
        model's thread, at load; what a gateway prices γ with at every load from its first
        request (`gateway.policy.priors`). Batches the pool cannot hold are left out."""
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1, self.info.vocab_size, (max(batches), context + max(widths)), generator=generator)
        sessions: list[SessionKV] = []
        for row in ids.tolist():
            session = SessionKV(self.pool)
            if not session.reserve(context + max(widths)):
                break
            session.tokens = row
            sessions.append(session)
        for start in range(0, len(sessions), 8):  # prefill the contexts, a few sessions per forward
            forwards.forward(self.model, [BatchRow(s, s.tokens[:context], 1) for s in sessions[start:start + 8]],
                             self.device)
        costs = {}
        for batch in (b for b in batches if b <= len(sessions)):
            for width in widths:
                times = []
                for _ in range(repeats + 1):  # the first, a warm-up for this shape, is not counted
                    rows = [BatchRow(s, s.tokens[context:context + width], width) for s in sessions[:batch]]
                    began = time.perf_counter()
                    logits, _ = forwards.forward(self.model, rows, self.device)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    times.append((time.perf_counter() - began) * 1e3)
                    del logits
                    for session in sessions[:batch]:
                        session.crop(context)
                costs[(batch, width)] = statistics.median(times[1:])
        return costs

    def kv_bytes_per_token(self) -> int:
        """The arithmetic: layers × KV heads × (key dim + value dim) × bytes per element."""
        layers, heads, key_dim, value_dim = self._kv_shape
        return layers * heads * (key_dim + value_dim) * torch.finfo(self.dtype).bits // 8

    def _pool_blocks(self, batching: BatchSettings, max_sessions: int) -> int:
        """Blocks of the KV pool: --kv-cache-tokens, else room at full context for every
        session the store keeps plus 64 more in steps (a session taken by a step is not
        counted against max_sessions), within half of the memory free when the model
        loads (the GPU's, or the host's): the other half is for activations, the gather
        buffers and the models loaded after this one. On a CPU, pages nobody writes cost
        no memory, but the allocation must still fit. (With --gpu-memory-fraction,
        `_sized_pool` sizes it instead.)"""
        block_bytes = self.kv_bytes_per_token() * batching.block_tokens
        tokens = batching.kv_cache_tokens or (max_sessions + 64) * self.info.max_context
        blocks = -(-tokens // batching.block_tokens) + 1  # + the null block
        if not batching.kv_cache_tokens:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
            else:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            blocks = min(blocks, free // 2 // block_bytes)
        return max(blocks, 2)

    def _sized_pool(self, batching: BatchSettings, max_sessions: int, profile: memory.ProfileShape,
                    loaded: int, kept_rows_bytes: int, decoder: graphs.Decoder | None) -> KVPool:
        """The KV pool --gpu-memory-fraction leaves room for, after the profiling forward on the
        trials' pool (`self.pool`, let go here) and, to be captured (`decoder`), the CUDA graphs'
        bytes: `memory.kv_pool_bytes`, in whole blocks, at most what `_pool_blocks` would want at
        full context. ValueError when it leaves no room."""
        activation = memory.profile_activation(lambda rows: forwards.forward(self.model, rows, self.device),
                                               self.pool, profile, self.info.vocab_size, self.device)
        buckets: list[graphs.Bucket] = []
        graph_bytes = 0
        if decoder is not None:
            buckets = graphs.buckets(max_sessions=max_sessions, batching=batching, max_context=self.info.max_context)
            hidden = self.model.config.get_text_config().hidden_size
            graph_bytes = (graphs.graph_bytes(buckets, hidden, torch.finfo(self.dtype).bits // 8)
                           + graphs.transient_bytes(decoder, self.pool, buckets, self.device,
                                                    forwards.paged_kernel(self.model)))
        del self.pool
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = batching.gpu_memory_fraction
        pool_bytes = memory.kv_pool_bytes(total=total, fraction=fraction, loaded=loaded, activation=activation,
                                          kept_rows=kept_rows_bytes, free=free, graphs=graph_bytes)
        block_bytes = self.kv_bytes_per_token() * batching.block_tokens
        wanted = -(-(max_sessions + 64) * self.info.max_context // batching.block_tokens) + 1
        blocks = min(wanted, pool_bytes // block_bytes)
        self.memory_plan = memory.MemoryPlan(total, fraction, loaded, activation, kept_rows_bytes, free,
                                             blocks * block_bytes, profile, graph_bytes, len(buckets))
        if blocks < 2:
            raise ValueError(f"{self.info.name}: --gpu-memory-fraction {fraction} leaves no room for a KV pool: "
                             f"{self.memory_plan.describe()}; raise the fraction, or lower --max-sessions or "
                             f"--max-batch-tokens (the profiling forward's batch)")
        log.info("%s: KV pool of %d blocks (%d positions): %s", self.info.name, blocks,
                 blocks * batching.block_tokens, self.memory_plan.describe())
        if blocks * batching.block_tokens < self.info.max_context:
            log.warning("%s: the KV pool holds %d positions, under one session at the model's full context (%d)",
                        self.info.name, blocks * batching.block_tokens, self.info.max_context)
        return KVPool(*self._kv_shape, self.dtype, self.device, batching.block_tokens, blocks,
                      prefix_caching=not batching.no_prefix_caching)

    def reserve(self, session: SessionKV, needed: int) -> None:
        """Room in the pool for `needed` positions of a taken session and its copies on
        write (`SessionKV.reserve`), evicting idle sessions (least recently used first) while
        it is full; Overloaded if that is not enough, with the session given back."""
        while not session.reserve(needed):
            if not self.sessions.evict_idle():
                self.sessions.release()
                raise Overloaded(f"{self.info.name}'s KV cache is full ({self.pool.blocks} blocks of "
                                 f"{self.pool.block_tokens} tokens, all held by steps in progress); raise "
                                 f"--kv-cache-tokens or retry shortly", self.scheduler.recent_forward_ms)

    # -- session bookkeeping (on the event loop) ----------------------------------------

    def sync(self, session_id: str, start: int, tokens: list[int], extra: int,
              salt: bytes = b"") -> tuple[SessionKV, list[int]]:
        """Take the session, crop it to `start` known tokens, and return what to feed next,
        with room in the pool for the feed and `extra` positions after it.

        start == 0 (re)opens the session from `tokens`, taking the blocks of its longest
        cached prefix under `salt` (prefix caching): the feed is the rest. Otherwise it is
        the known tokens the cache lacks up to `start`, then `tokens`. The session is then
        taken: the caller runs a job on it with `step`, or gives it back
        (`sessions.put`, `sessions.release`).
        """
        bad = [t for t in tokens if not 0 <= t < self.info.vocab_size]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside {self.info.name}'s vocabulary of "
                                  f"{self.info.vocab_size}")
        if start == 0:
            self.sessions.drop(session_id)
            session = SessionKV(self.pool)
            self.sessions.adopt()
            session.tokens = list(tokens)
            session.hit = session.take_prefix(session.tokens, salt)
            feed = session.tokens[session.length:]
        else:
            session = self.sessions.take(session_id)
            if start > len(session.tokens):
                self.sessions.release()
                raise SessionNotFound(
                    f"{session_id}: asked to keep {start} tokens but only {len(session.tokens)} are known")
            session.crop(start)
            feed = session.tokens[session.length:start] + list(tokens)
            session.tokens = session.tokens[:start] + list(tokens)
        self.reserve(session, session.length + len(feed) + extra)
        return session, feed

    async def step(self, session_id: str, session: SessionKV, job: Job):
        """Run a job through the scheduler; put the session back only if it succeeded."""
        job.cached, session.hit = session.hit, 0
        try:
            result = await self.scheduler.submit(job)
        finally:
            self.sessions.release()
        self.sessions.put(session_id, session)
        return result

    def _forward_batch(self, rows: Sequence[BatchRow]) -> tuple[torch.Tensor, list[slice]]:
        """One forward over every row (on the model's thread): the kept logits [Σ keep, V]
        and each row's slice of them."""
        return forwards.forward(self.model, rows, self.device)
