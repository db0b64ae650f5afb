"""The measuring half of scripts/gpu_check.sh (scripts/gpu_figures.py is the reporting half):
the machine, a model pair priced as an 8B/1B pair is, what one forward of each costs, the
models alone, transformers' greedy tokens, and the served stack.

    python scripts/gpu_check.py env
    python scripts/gpu_check.py make-pair DIR [--shape 8b|tiny] [--device cuda]
    python scripts/gpu_check.py forwards DIR [--device cuda] [--dtype bfloat16] [--fraction 0.85] [--out FILE]
    python scripts/gpu_check.py ceiling DIR [--device cuda] [--gamma 4] [--max-new-tokens 32] [--rounds 2] [--out FILE]
    python scripts/gpu_check.py reference DIR [--device cuda] [--prompts 8] [--max-new-tokens 32] [--out FILE]
    python scripts/gpu_check.py served DIR [--cuda-graphs] [--fraction 0.85] [--concurrency 1,32] [--requests 32]
        [--reference FILE] [--out FILE]

`make-pair` writes DIR/target, DIR/draft (random Llama weights with the demo tokenizer, built
on the device: a lent machine reaches nothing) and DIR/pair.json. The target has an 8B's
layers and vocabulary (`SHAPES`), the draft a 1B's, each cut short so that the draft reads
about the share of the target's weights a 1B reads of an 8B's (`LLAMA_1B_8B_READ`): its
forwards are priced as a real draft's, which a copy of the target's first layer is not.
Their greedy tokens agree as a real pair's do, neither always nor never: both heads score a
bigram they share (a random permutation of the tokenizer's ordinary ids; the row of x's
follower is x's own embedding), and each model's layers pull away from it. The calibration
scales each model's embeddings (every layer reads its input through an RMS norm, so the scale
sets the layers' share of the last hidden state and nothing of the cost) until, over 32
greedy tokens after each demo prompt, the target leaves the bigram at `TARGET_DEPARTURE` of
positions (its tokens follow the context, so the attention and KV cache are exercised) and
the draft's token is the target's at `DRAFT_AGREEMENT` of them. Special ids and ids past the
tokenizer's score 0 in both heads, far below a real row's best, so greedy decoding never
stops early and every configuration decodes the same number of tokens; the heads still
multiply every row.

`forwards` loads each model as a worker does (the paged KV store, the lean forward where its
trial agrees) and reports, for batches of 1 and 32 sessions feeding 1 and 5 tokens each,
eagerly and then replayed as CUDA graphs (`--cuda-graphs`, `specd.worker.graphs`): the
kernels, copies and host synchronisations of one step (the forward, then its tokens' one copy
to the host), counted with torch.profiler; the SDPA backend that ran (the aten operator's
name); the forward's time between two CUDA events, the host's time to issue it, and the
kernels' busy time; the peak of torch.cuda.max_memory_allocated; and the KV pool that
--gpu-memory-fraction would give (`specd.worker.memory`, the functions a worker uses); and
how far the graphs' logits are from the eager forward's on the same rows. It
imports only torch, transformers and specd's model code, so it runs where the serving stack's
packages are missing. On a CPU (the dry run) it runs the same code: times are wall times, and
the CUDA counts are 0.

`ceiling` runs scripts/bench_ceiling.py's target-only and fixed-γ loops on the pair, eagerly
and then with both models' forwards as CUDA graphs (on a CPU the same static steps, run
eagerly): tokens/s each way after a warm-up pass, tokens per step, and each model's ms per
forward after the prompt's (to the host's copy of its tokens): the draft's, the target's of
one token and of a verification's γ + 1; c = draft ÷ target and v = verification ÷ one token.

`reference` runs transformers' own greedy `generate` of the target, prompt by prompt, and
`served` runs `specd serve` on the pair (--gpu-memory-fraction split between the two workers;
--cuda-graphs where asked, left out on a CPU; no model-free proposers), serves the
reference's prompts greedily with target-only and fixed γ decoding and compares the tokens,
then runs `specd bench --configs fixed:γ,cost --concurrency ...` once to warm up and once
measured: target-only, fixed γ and AUTO at each level.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # The target has an 8B's layers (Llama 3.1 8B: hidden 4,096, 32/8 heads), 12 of its 32; the
    # draft a 1B's (Llama 3.2 1B: hidden 2,048, 32/8 heads), 2 of its 16. A forward of the
    # draft reads 0.12 of the target's weights, a little under a 1B's 0.165 of an 8B's, since
    # a shallow model's forward pays more than its weights' share in kernel launches; its
    # ms per forward as measured is what the report's c and projection use.
    "8b": {"vocab": 128256, "context": 8192,
           "target": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=12),
           "draft": dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, layers=2)},
    "tiny": {"vocab": 8192, "context": 1024,
             "target": dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=3),
             "draft": dict(hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1)},
}
# Parameters a forward reads, Llama 3.2 1B (1.24B, its head tied to its embedding) ÷ Llama
# 3.1 8B (7.50B: 8.03B less the embedding, which a forward gathers a row of).
LLAMA_1B_8B_READ = 1.24 / 7.50
# The calibration's goals (`make-pair`): the target's greedy token leaves the bigram both
# models share at this share of positions, so that its output follows the context (its
# attention and KV cache), and the draft's greedy token is the target's at this share (the
# acceptance per position, α: a real pair's depends on its task, so the report projects
# others beside it).
TARGET_DEPARTURE = 0.2
DRAFT_AGREEMENT = 0.7
CALIBRATION_TOKENS = 32  # greedy tokens after each demo prompt that the calibration scores
# What the services import beyond torch and transformers (scripts/gpu_wheels.sh carries them).
SERVING_MODULES = ("grpc", "grpc_health.v1", "grpc_reflection.v1alpha", "google.protobuf", "opentelemetry.sdk",
                   "opentelemetry.exporter.otlp.proto.grpc", "llguidance", "starlette", "uvicorn", "cryptography",
                   "prometheus_client")


def _masked_kernel() -> str:
    """The first SDPA kernel, in torch's order of preference, that takes the paged attention's
    CUDA call for an 8B-shaped verification (32 query heads folded onto 8 KV heads, 5 tokens
    a row, 4 rows, 1,000 keys, bfloat16, a boolean mask): the kernel a worker runs."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specd.worker.attention import grouped_sdpa

    query = torch.randn(4, 32, 5, 128, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(4, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(4, 1, 5, 1000, device="cuda", dtype=torch.bool).tril(995)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([backend]):
                grouped_sdpa(query, keys, values, mask, None)
            torch.cuda.synchronize()
        except RuntimeError:
            continue
        if name == "cudnn" and not torch.backends.cuda.cudnn_sdp_enabled():
            continue  # runs, but a worker has it switched off
        return name
    return "none"


def cmd_env(args: argparse.Namespace) -> int:
    """The machine and the software, one `key: value` a line; `serving: ok` when the services can run."""
    import torch
    import transformers

    from specd.worker.attention import pin_sdpa_backends, sdpa_backends

    print(f"python: {platform.python_version()} ({sys.executable})")
    print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
    print(f"transformers: {transformers.__version__}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
              f"{props.major}.{props.minor}, {props.multi_processor_count} SMs")
        print(f"sdpa by default: {sdpa_backends()}")
        pin_sdpa_backends(torch.device("cuda"))
        print(f"sdpa a worker allows: {sdpa_backends()}")
        print(f"sdpa kernel of a masked grouped-query verification: {_masked_kernel()}")
    else:
        print("device: none (CPU only)")
    missing = []
    for name in SERVING_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing package or one too old to import
            missing.append(f"{name} ({type(exc).__name__})")
    if not missing:
        try:
            importlib.import_module("specd_cli.parser")
        except Exception as exc:
            missing.append(f"specd_cli.parser ({type(exc).__name__}: {exc})")
    print("serving: ok" if not missing else f"serving: missing {', '.join(missing)}")
    return 0


def cmd_make_pair(args: argparse.Namespace) -> int:
    """DIR/target, DIR/draft and DIR/pair.json (what was made, and the calibration's outcome)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specd.config import DEMO_TARGET

    root = Path(args.dir)
    shape = SHAPES[args.shape]
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    device = torch.device(args.device)
    if device.type == "cpu":
        # The dry run's tiny pair: products too small to split across threads, which on a
        # shared CPU only wait for one another (specd serve gives such a model one thread too).
        torch.set_num_threads(1)
    began = time.perf_counter()

    def config(part: dict) -> LlamaConfig:
        return LlamaConfig(vocab_size=shape["vocab"], hidden_size=part["hidden"],
                           intermediate_size=part["intermediate"], num_hidden_layers=part["layers"],
                           num_attention_heads=part["heads"], num_key_value_heads=part["kv_heads"],
                           max_position_embeddings=shape["context"], rope_theta=500000.0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                           tie_word_embeddings=False, dtype="bfloat16")

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: seconds, not minutes
    try:
        with device:
            target = LlamaForCausalLM(config(shape["target"])).eval()
            draft = LlamaForCausalLM(config(shape["draft"])).eval()
    finally:
        torch.set_default_dtype(default)
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    follower = torch.arange(shape["vocab"])  # the bigram both models share: ordinary id → ordinary id
    follower[ordinary] = ordinary[torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        for model in (target, draft):
            # Each model's head scores the bigram's follower of x with x's own embedding, and
            # nothing else it knows (special ids, ids past the tokenizer's) ever wins: greedy
            # generation never stops early, so every configuration decodes the same count.
            head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
            head.zero_()
            head[follower[ordinary].to(device)] = embedding[ordinary.to(device)]
    contexts, mask = (tensor.to(device) for tensor in _prompts(tokenizer))
    follows = follower.to(device)

    def departure() -> float:  # the target's greedy tokens that are not the bigram's follower of the last
        tokens = _generate(target, contexts, mask, CALIBRATION_TOKENS)
        return (tokens[:, 1:] != follows[tokens[:, :-1]]).float().mean().item()

    target_scale, departed = _embedding_scale(target, departure, TARGET_DEPARTURE)
    tokens = _generate(target, contexts, mask, CALIBRATION_TOKENS)
    sequences = torch.cat([contexts, tokens[:, 1:]], dim=1)
    attended = torch.cat([mask, torch.ones_like(tokens[:, 1:])], dim=1)

    def disagreement() -> float:  # the draft's greedy tokens over the target's continuation that are not the target's
        with torch.no_grad():
            logits = draft(input_ids=sequences, attention_mask=attended).logits
        return (logits[:, -tokens.shape[1]:-1].argmax(dim=-1) != tokens[:, 1:]).float().mean().item()

    draft_scale, disagreed = _embedding_scale(draft, disagreement, 1 - DRAFT_AGREEMENT)
    recipe: dict = {"shape": args.shape, "made_on": str(device), "target_scale": target_scale,
                    "draft_scale": draft_scale, "departure": departed, "agreement": 1 - disagreed,
                    "llama_read_ratio": LLAMA_1B_8B_READ}
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        parameters = sum(p.numel() for p in model.parameters())
        read = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        recipe[name] = {"layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                        "parameters": parameters, "read_parameters": read}
        print(f"{name}: {parameters / 1e9:.3f}B parameters, {read / 1e9:.3f}B read per forward (the embedding "
              f"is gathered), {model.config.num_hidden_layers} layer(s) of {model.config.hidden_size}, "
              f"embeddings × {recipe[f'{name}_scale']:.3g}")
    recipe["read_ratio"] = recipe["draft"]["read_parameters"] / recipe["target"]["read_parameters"]
    recipe["seconds"] = time.perf_counter() - began
    (root / "pair.json").write_text(json.dumps(recipe, indent=2))
    print(f"the draft reads {recipe['read_ratio']:.3f} of the target's weights a forward (Llama 3.2 1B of "
          f"Llama 3.1 8B's: {LLAMA_1B_8B_READ:.3f})")
    print(f"over {CALIBRATION_TOKENS} greedy tokens of the target after each demo prompt: the target leaves the "
          f"bigram at {departed:.3f} of positions (goal {TARGET_DEPARTURE}); the draft's greedy token, given the "
          f"target's before it, is the target's at {1 - disagreed:.3f} (goal {DRAFT_AGREEMENT})")
    print(f"made in {recipe['seconds']:.0f} s on {device}")
    return 0


def _prompts(tokenizer):
    """The demo prompts' ids, padded on the left to one length, and their attention mask."""
    from specd_cli.bench import DEMO_WORKLOAD

    batch = tokenizer([p for ps in DEMO_WORKLOAD.values() for p in ps], padding=True, padding_side="left",
                      return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


def _generate(model, contexts, mask, count: int):
    """Each context's last token, then `count` greedy tokens of `model` after it [prompts, 1 + count]."""
    import torch

    with torch.no_grad():
        out = model.generate(contexts, attention_mask=mask, do_sample=False, max_new_tokens=count,
                             min_new_tokens=count, pad_token_id=model.config.pad_token_id)
    return out[:, contexts.shape[1] - 1:]


def _embedding_scale(model, measure: Callable[[], float], goal: float) -> tuple[float, float]:
    """Scale `model`'s token embeddings by the factor that brings `measure()` nearest `goal`
    (bisection on the factor's logarithm: `measure` falls as the embedding, which carries
    the bigram, outweighs what the layers add to the residual stream); the factor and its
    measure. Every layer reads its input through an RMS norm, so the factor changes the
    layers' share of the last hidden state, not what a forward costs."""
    import torch

    weight = model.model.embed_tokens.weight
    base = weight.detach().clone()
    low, high = -12.0, 12.0  # log2 of the factor
    tried: dict[float, float] = {}
    with torch.no_grad():
        for _ in range(12):
            middle = (low + high) / 2
            weight.copy_(base * 2**middle)
            tried[middle] = measure()
            low, high = (middle, high) if tried[middle] > goal else (low, middle)
        best = min(tried, key=lambda power: abs(tried[power] - goal))
        weight.copy_(base * 2**best)
    return 2**best, tried[best]


class Loaded:
    """One model as a worker loads it: packed on a CPU, the paged KV store, the lean forward."""

    def __init__(self, path: Path, device, dtype) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from specd.worker import lean, packing, trials
        from specd.worker.attention import use_paged_attention
        from specd.worker.kvstore import KVPool

        cuda = device.type == "cuda"
        before = torch.cuda.memory_allocated(device) if cuda else 0
        began = time.perf_counter()
        self.model = packing.packed_model(
            lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), lean.joinable)
        self.weights = (torch.cuda.memory_allocated(device) - before) if cuda else packing.weight_bytes(self.model)
        self.shape = trials.kv_shape(self.model, device)
        use_paged_attention(self.model)
        self.pool = KVPool(*self.shape, dtype, device, 16, 32 * 20 + 64)  # 32 sessions of up to 320 positions
        unmirrored = lean.install(self.model, self.pool, self.model.config.vocab_size, device)
        self.lean = unmirrored or "on"
        self.load_s = time.perf_counter() - began
        self.device = device
        self.vocab = self.model.config.vocab_size

    def forward(self, rows):
        from specd.worker import forwards

        return forwards.forward(self.model, rows, self.device)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_plan(model: Loaded, fraction: float, dtype) -> str:
    """What --gpu-memory-fraction would give this model in a worker with the default batching
    (`ModelRunner._sized_pool`'s arithmetic, on a pool of its own for the profile)."""
    import torch

    from specd.worker import memory
    from specd.worker.kvstore import KVPool
    from specd.worker.settings import BatchSettings

    batching = BatchSettings()
    context = int(getattr(model.model.config, "max_position_embeddings", 2048))
    shape = memory.profile_shape(max_sessions=64, max_batch_tokens=batching.max_batch_tokens,
                                 prefill_chunk=batching.prefill_chunk, max_context=context,
                                 block_tokens=batching.block_tokens)
    pool = KVPool(*model.shape, dtype, model.device, batching.block_tokens,
                  memory.profile_blocks(shape, batching.block_tokens) + 8)
    activation = memory.profile_activation(model.forward, pool, shape, model.vocab, model.device)
    del pool
    if model.device.type != "cuda":
        return f"(no plan on {model.device.type}: the profiling forward of {shape.rows} rows ran)"
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(model.device)
    pool_bytes = memory.kv_pool_bytes(total=total, fraction=fraction, loaded=model.weights, activation=activation,
                                      kept_rows=0, free=free)
    return memory.MemoryPlan(total, fraction, model.weights, activation, 0, free, pool_bytes, shape).describe()


def _rows(model: Loaded, batch: int, width: int, context: int):
    """`batch` sessions holding `context` cached positions; a function that rolls them back
    there and gives their rows feeding `width` tokens each (the same every call)."""
    import torch

    from specd.worker.kvstore import SessionKV
    from specd.worker.layout import BatchRow

    generator = torch.Generator().manual_seed(batch * 100 + width)
    sessions = []
    for _ in range(batch):
        session = SessionKV(model.pool)
        assert session.reserve(context + width), "the measuring pool is too small"
        session.tokens = torch.randint(1, model.vocab, (context + width,), generator=generator).tolist()
        sessions.append(session)
    for start in range(0, batch, 8):  # the contexts
        model.forward([BatchRow(s, s.tokens[:context], 1) for s in sessions[start:start + 8]])

    def rows():
        for session in sessions:
            session.crop(context)
        return [BatchRow(s, s.tokens[context:], width) for s in sessions]

    return rows


def measure(model: Loaded, batch: int, width: int, context: int, repeats: int) -> dict:
    """One (batch, width) forward of `model`: profiler counts, SDPA backend, times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specd.worker import forwards

    device, cuda = model.device, model.device.type == "cuda"
    rows = _rows(model, batch, width, context)

    def step(these):  # a greedy verification's step: the forward, then its tokens' one copy to the host
        logits, _ = model.forward(these)
        return logits.argmax(dim=-1).tolist()

    for _ in range(3):  # warm-up: this shape's kernels, the gather's scratch
        step(rows())
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    these = rows()
    with profile(activities=activities) as prof:
        step(these)  # ends in its copy to the host, which waits for the stream: no sync of ours is counted
    events = prof.events()
    on_device = [e for e in events if e.device_type.name == "CUDA"]
    copies = [e for e in on_device if "memcpy" in e.name.lower() or "memset" in e.name.lower()]
    kernels = [e for e in on_device if e not in copies]
    syncs = [e for e in events if e.device_type.name == "CPU" and "Synchronize" in e.name]
    blocking = [e for e in events if e.device_type.name == "CPU" and e.name in ("cudaMemcpy", "cudaMemcpy2D")]
    sdpa = sorted({e.name for e in events if "scaled_dot_product" in e.name and e.name.startswith("aten::_")})
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    event_ms, wall_ms, issue_ms = [], [], []
    for _ in range(repeats):
        these = rows()
        _sync(device)
        if cuda:
            opened, closed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            opened.record()
        began = time.perf_counter()
        logits, _ = model.forward(these)
        issued = time.perf_counter()
        if cuda:
            closed.record()
        _sync(device)
        done = time.perf_counter()
        if cuda:
            event_ms.append(opened.elapsed_time(closed))
        wall_ms.append((done - began) * 1e3)
        issue_ms.append((issued - began) * 1e3)
        del logits
    result = {"batch": batch, "width": width, "context": context, "kernels": len(kernels), "copies": len(copies),
              "syncs": len(syncs) + len(blocking), "sdpa": sdpa or ["(none: no SDPA call)"],
              "event_ms": statistics.median(event_ms) if event_ms else None, "wall_ms": statistics.median(wall_ms),
              "issue_ms": statistics.median(issue_ms), "busy_ms": busy_ms}
    event = f"{result['event_ms']:8.3f}" if result["event_ms"] is not None else f"{'—':>8}"
    backends = " ".join(name.removeprefix("aten::") for name in result["sdpa"])
    replayed = ("graphs" if forwards.static_steps(model.model)
                else "paged kernel" if forwards.paged_kernel(model.model) else backends)
    print(f"   {batch:>8} {width:>6} {len(kernels):>7} {len(copies):>6} {result['syncs']:>5} {event} "
          f"{result['wall_ms']:7.3f} {result['issue_ms']:8.3f} {busy_ms:7.3f}  {replayed}", flush=True)
    return result


def use_graphs(model, sessions: int, context: int) -> str:
    """From now on, run the forwards of `model` (a `Loaded` or a `bench_ceiling.Model`) as
    CUDA graphs for up to `sessions` rows of up to `context` positions, the buckets a worker
    with default batching captures at load (`--cuda-graphs`; on a CPU, the same static steps
    run eagerly), with how many and how long they took; what `graphs.problem` says where it
    cannot."""
    from specd.worker import forwards, graphs, lean, rope
    from specd.worker.settings import BatchSettings

    decoder = lean.decoder_of(model.model)
    problem = graphs.problem(model.model, decoder, rope.regime(model.model) is not None)
    if problem is not None or decoder is None:
        return f"no graphs: {problem}"
    buckets = graphs.buckets(max_sessions=sessions, batching=BatchSettings(block_tokens=model.pool.block_tokens),
                             max_context=context)
    began = time.perf_counter()
    steps = graphs.StaticSteps(decoder, model.pool, model.device, buckets, capture=model.device.type == "cuda")
    forwards.use_static_steps(model.model, steps)
    return f"on, {len(buckets)} buckets built in {time.perf_counter() - began:.1f} s"


def agreement(model: Loaded, batch: int, width: int, context: int, switch, name: str) -> str:
    """The same rows through the eager forward and with `switch(True)` (static steps, the
    paged kernel; `switch(False)` undoes it): the largest logit difference and how many
    greedy tokens agree."""
    rows = _rows(model, batch, width, context)
    switch(False)
    eager, _ = model.forward(rows())
    switch(True)
    other, _ = model.forward(rows())
    agree = (eager.argmax(-1) == other.argmax(-1)).float().mean().item()
    return f"max |eager − {name}| {(eager - other).abs().max().item():.3g}, greedy tokens agree {agree:.0%}"


def use_kernel(model) -> str:
    """From now on, read the pool through the paged kernel (`--attention-kernel triton`) in
    the forwards of `model`, without static steps; what `pagedkernel.problem` says where
    it cannot."""
    from specd.worker import forwards, pagedkernel

    problem = pagedkernel.problem(model.model, model.device, interpret=pagedkernel.interpreted())
    if problem is not None:
        return f"no kernel: {problem}"
    forwards.use_static_steps(model.model, None)
    forwards.use_paged_kernel(model.model)
    return "on"


def cmd_forwards(args: argparse.Namespace) -> int:
    import torch

    from specd.worker import forwards

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    small = args.small or not cuda
    shapes = [(1, 1), (1, 5), (32, 1), (32, 5)] if not small else [(1, 1), (1, 5), (8, 1), (8, 5)]
    context, repeats = (256, 20) if not small else (32, 3)
    report: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": args.dtype,
                    "torch": torch.__version__, "cuda": torch.version.cuda, "models": {}}
    from specd.worker.memory import config_kv_bytes_per_token, split_fraction

    # Each model's share of --fraction as `specd serve` splits it between its two workers.
    shares = split_fraction(args.fraction, {name: config_kv_bytes_per_token(Path(args.dir) / name)
                                            for name in ("target", "draft")})
    for name in ("target", "draft"):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model = Loaded(Path(args.dir) / name, device, dtype)
        print(f"== {name}: {model.weights / 2**20:,.0f} MiB of weights on {device} in {model.load_s:.1f} s, "
              f"KV {model.shape}, lean forward: {model.lean}", flush=True)
        plan = memory_plan(model, shares[name], dtype)
        print(f"   its share of --gpu-memory-fraction {args.fraction} under specd serve, {shares[name]:.3f}: {plan}",
              flush=True)
        results = []
        print(f"   {'sessions':>8} {'tokens':>6} {'kernels':>7} {'copies':>6} {'syncs':>5} {'event ms':>8} "
              f"{'wall ms':>7} {'issue ms':>8} {'busy ms':>7}  SDPA, or what replaced it")
        results = [measure(model, batch, width, context, repeats) for batch, width in shapes]
        graphs = use_graphs(model, 32, context + max(width for _, width in shapes))
        print(f"   --cuda-graphs: {graphs}" + ("" if cuda else " (a CPU cannot capture: the static steps run eagerly)"))
        if graphs.startswith("on"):
            results += [{**measure(model, batch, width, context, repeats), "graphs": True} for batch, width in shapes]
            batch, width = shapes[-1]
            steps = forwards.static_steps(model.model)
            graphed = agreement(model, batch, width, context,
                                lambda on, m=model.model, s=steps: forwards.use_static_steps(m, s if on else None),
                                "graph")
            print(f"   {batch} sessions × {width} tokens: {graphed}", flush=True)
        kernel = use_kernel(model)
        print(f"   --attention-kernel triton: {kernel}" + ("" if cuda else " (Triton's CPU interpreter)"))
        if kernel == "on":
            results += [{**measure(model, batch, width, context, repeats), "kernel": True} for batch, width in shapes]
            batch, width = shapes[-1]
            paged = agreement(model, batch, width, context,
                              lambda on, m=model.model: forwards.use_paged_kernel(m, on), "kernel")
            print(f"   {batch} sessions × {width} tokens: {paged}", flush=True)
            forwards.use_paged_kernel(model.model, False)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        if cuda:
            print(f"   peak torch.cuda.max_memory_allocated: {peak / 2**20:,.0f} MiB")
        report["models"][name] = {"weights": model.weights, "load_s": model.load_s, "lean": model.lean,
                                  "plan": plan, "peak": peak, "forwards": results}
        del model
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def cmd_ceiling(args: argparse.Namespace) -> int:
    """The models alone (`scripts/bench_ceiling.py`'s loops, no serving path), eagerly and
    then as CUDA graphs: target-only and fixed γ tokens/s over the demo prompts, tokens per
    step, each model's ms per forward, c and v; to ceiling.json."""
    import bench_ceiling
    import torch
    from transformers import AutoTokenizer

    from specd.worker import forwards, packing
    from specd.worker.kvstore import SessionKV
    from specd.worker.runtime import eos_ids
    from specd_cli.bench import DEMO_WORKLOAD
    from specd_cli.launch import default_threads

    class Timed(bench_ceiling.Model):
        """A model of bench_ceiling whose forwards after a session's first (its prompt) are
        timed, by the tokens they feed, up to the host's copy of their tokens."""

        def __init__(self, path: str, threads: int, device: torch.device, dtype: torch.dtype,
                     layout: str = "onednn") -> None:
            super().__init__(path, threads, device, dtype, layout)
            self.ms: dict[int, list[float]] = {}

        def forward(self, session: SessionKV, tokens: list[int], keep: int) -> torch.Tensor:
            prompt = session.length == 0
            began = time.perf_counter()
            argmax = super().forward(session, tokens, keep).cpu()  # the copy waits for the device
            if not prompt:
                self.ms.setdefault(len(tokens), []).append((time.perf_counter() - began) * 1e3)
            return argmax

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(f"{args.dir}/target")
    # The target first: torch's thread count is process-wide, taken by each thread at its
    # first parallel operator (bench_ceiling's main says why). Its threads are those specd
    # serve gives it (on a CPU, one for the dry run's tiny target), so that served ÷ the
    # models alone compares like with like.
    threads = default_threads(Path(args.dir) / "target", device.type)
    target = Timed(f"{args.dir}/target", threads, device, dtype)
    draft = Timed(f"{args.dir}/draft", 1, device, dtype, packing.draft_layout(dtype))  # as a draft worker
    eos = set(eos_ids(target.model, tokenizer))
    prompts = [tokenizer(p)["input_ids"] for ps in DEMO_WORKLOAD.values() for p in ps]
    gamma, report = args.gamma, {"device": device.type, "dtype": args.dtype, "gamma": args.gamma,
                                 "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                                 "prompts": len(prompts), "modes": {}}
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            # Each model's graphs for one session over its whole pool, as a worker of one session's.
            states = [use_graphs(model, 1, (model.pool.blocks - 1) * model.pool.block_tokens)
                      for model in (target, draft)]
            if any(not state.startswith("on") for state in states):
                report["modes"][mode] = {"skipped": "; ".join(states)}
                print(f"--cuda-graphs: {'; '.join(states)}")
                Path(args.out).write_text(json.dumps(report, indent=2))
                continue
            print(f"--cuda-graphs: target {states[0]}; draft {states[1]}" + (
                "" if device.type == "cuda" else " (a CPU cannot capture: the static steps run eagerly)"))
        for prompt in prompts:  # warm-up: each shape's kernels and plans, and (graphs) every bucket's capture
            bench_ceiling.target_only(target, prompt, args.max_new_tokens, eos)
            bench_ceiling.speculative(target, draft, gamma, prompt, args.max_new_tokens, eos)
        for model in (target, draft):
            model.ms.clear()
        seconds = {"target-only": 0.0, "fixed": 0.0}
        tokens = {"target-only": 0, "fixed": 0}
        steps = same = 0
        for _ in range(args.rounds):
            for prompt in prompts:
                began = time.perf_counter()
                plain = bench_ceiling.target_only(target, prompt, args.max_new_tokens, eos)
                seconds["target-only"] += time.perf_counter() - began
                began = time.perf_counter()
                fast, taken = bench_ceiling.speculative(target, draft, gamma, prompt, args.max_new_tokens, eos)
                seconds["fixed"] += time.perf_counter() - began
                tokens["target-only"] += len(plain)
                tokens["fixed"] += len(fast)
                steps += taken
                same += fast == plain
        rates = {name: tokens[name] / seconds[name] for name in seconds}
        decode, verify = statistics.median(target.ms[1]), statistics.median(target.ms[gamma + 1])
        drafting = statistics.median(draft.ms.get(1, []) + draft.ms.get(2, []))
        result = {"target_only_tokens": tokens["target-only"], "fixed_tokens": tokens["fixed"],
                  "target_only_tokens_per_s": rates["target-only"], "fixed_tokens_per_s": rates["fixed"],
                  "ratio": rates["fixed"] / rates["target-only"],
                  # The prompt's forward gives each prompt its first token; the steps give the rest.
                  "tokens_per_step": (tokens["fixed"] - len(prompts) * args.rounds) / max(steps, 1),
                  "same_output": same, "runs": len(prompts) * args.rounds,
                  "draft_ms": drafting, "target_ms": decode, "verify_ms": verify,
                  "c": drafting / decode, "v": verify / decode,
                  "captured": {name: static.captured if (static := forwards.static_steps(model.model)) else 0
                               for name, model in (("target", target), ("draft", draft))}}
        report["modes"][mode] = result
        print(f"{mode}: target-only {rates['target-only']:.1f} tokens/s, fixed γ={gamma} {rates['fixed']:.1f} "
              f"tokens/s ({result['ratio']:.2f}×), {result['tokens_per_step']:.2f} tokens a step, same output "
              f"{same}/{result['runs']}, {tokens['target-only']} and {tokens['fixed']} tokens")
        print(f"{mode}: ms per forward: draft {drafting:.3f}, target {decode:.3f} (1 token), {verify:.3f} "
              f"({gamma + 1} tokens); c {result['c']:.3f}, v {result['v']:.3f}; E[tokens]/(γc+v) "
              f"{result['tokens_per_step'] / (gamma * result['c'] + result['v']):.2f}; graphs captured "
              f"{result['captured']}")
        Path(args.out).write_text(json.dumps(report, indent=2))  # the eager figures stay if capture fails
    return 0


def agreement_prompts(count: int) -> list[tuple[str, str]]:
    """(task, prompt) of the greedy agreement: the demo workload's, its tasks in turn."""
    from specd_cli.bench import DEMO_WORKLOAD

    columns = [[(task, prompt) for prompt in prompts] for task, prompts in DEMO_WORKLOAD.items()]
    return [pair for row in zip(*columns) for pair in row][:count]


def cmd_reference(args: argparse.Namespace) -> int:
    """transformers' own greedy `generate` of the target on the device, prompt by prompt (no
    padding, which would change the products), to reference.json: what the served stages'
    tokens are compared with."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(f"{args.dir}/target")
    model = AutoModelForCausalLM.from_pretrained(f"{args.dir}/target", dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    loaded = time.perf_counter() - began
    prompts = agreement_prompts(args.prompts)
    outputs = []
    began = time.perf_counter()
    for _, prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
        outputs.append(out[0, ids.shape[1]:].tolist())
    seconds = time.perf_counter() - began
    attention = model.config._attn_implementation
    Path(args.out).write_text(json.dumps({
        "device": device.type, "dtype": args.dtype, "transformers": transformers.__version__,
        "torch": torch.__version__, "attention": attention, "max_new_tokens": args.max_new_tokens,
        "prompts": prompts, "tokens": outputs}, indent=2))
    print(f"transformers {transformers.__version__} ({attention} attention), {args.dtype} on {device}: "
          f"loaded in {loaded:.1f} s, {len(prompts)} prompts × {args.max_new_tokens} greedy tokens in {seconds:.1f} s")
    for (task, prompt), tokens in zip(prompts, outputs):
        print(f"  {task:<8} {prompt[:40]!r:<44} → {tokens[:8]}…")
    return 0


def served_agreement(gateway: str, reference: dict, gamma: int) -> dict:
    """The reference's prompts served greedily by target-only and fixed γ decoding: how many
    give transformers' tokens, token for token, and where each other one first parts."""
    import grpc

    from specd.v1 import gateway_pb2_grpc
    from specd_cli.bench import build_request, parse_configs

    results = []
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for config in parse_configs(f"fixed:{gamma}"):
            parted: list[int | None] = []
            for index, ((task, prompt), expected) in enumerate(zip(reference["prompts"], reference["tokens"])):
                request = build_request(prompt, task, config, temperature=0.0,
                                        max_new_tokens=reference["max_new_tokens"], seed=1,
                                        user_segment=f"agreement-{config.segment}",
                                        cache_salt=f"agreement-{config.segment}-{index}")
                tokens = list(stub.Generate(request, timeout=120).token_ids)
                first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                             None if len(tokens) == len(expected) else min(len(tokens), len(expected)))
                parted.append(first)
            results.append({"label": config.label, "prompts": len(parted),
                            "same": sum(first is None for first in parted), "first_divergence": parted})
            print(f"greedy agreement with transformers ({reference['dtype']} on {reference['device']}), "
                  f"{config.label}: {results[-1]['same']}/{len(parted)} prompts token for token; first divergence "
                  f"by prompt: {parted}", flush=True)
    return {"dtype": reference["dtype"], "device": reference["device"], "configs": results}


def run_bench(gateway: str, argv: list[str], quiet: bool) -> list[dict]:
    """`specd bench --concurrency ...` against `gateway`, in this process; the rows of its load.json."""
    import contextlib
    import io

    from specd_cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    options = parser.parse_args(["--gateway", gateway, *argv])
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        bench.run(options)
    return json.loads((Path(options.out) / "load.json").read_text())["rows"]


def cmd_served(args: argparse.Namespace) -> int:
    """`specd serve` on the pair (with --cuda-graphs where asked and the device can capture);
    the reference's prompts served greedily and compared with transformers' tokens; then
    `specd bench` at the largest level once to warm up (graphs captured, the cost policy's
    first measurements), and once measured. Serve is stopped however this ends (a SIGTERM
    from the stage's time limit included), so it never keeps the device."""
    import os
    import signal
    import subprocess

    log_path = Path(args.log)
    command = [sys.executable, "-m", "specd_cli", "serve", "--target", f"{args.dir}/target", "--draft",
               f"{args.dir}/draft", "--device", args.device, "--dtype", args.dtype, "--port", str(args.port),
               "--startup-timeout", str(args.startup_timeout),
               # The random pair repeats itself (a bigram's cycles), which the model-free proposers
               # would draft for free: AUTO is to be measured on what the draft model proposes.
               "--model-free", "",
               # info: each worker's memory plan and what its CUDA graphs took at load, for the report.
               "--log-level", "info"]
    if args.fraction:
        command += ["--gpu-memory-fraction", str(args.fraction)]
    graphs = "off"
    if args.cuda_graphs:
        cuda = args.device.startswith("cuda")
        graphs = "on" if cuda else "n/a (CPU)"
        command += ["--cuda-graphs"] if cuda else []
        if not cuda:
            print("--cuda-graphs left out: the worker refuses it off CUDA; the rest of this stage runs as on a GPU")
    print(" ".join(command[1:]), flush=True)
    with log_path.open("w") as log:
        serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(*_: object) -> None:  # serve and its workers (its process group), within the stage's last seconds
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(3)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(serve.pid, signal.SIGKILL)  # a worker still stopping
        except ProcessLookupError:
            pass

    def stopped(*_: object) -> None:  # the stage's time limit: serve goes too
        stop()
        sys.exit(124)

    signal.signal(signal.SIGTERM, stopped)
    began = time.monotonic()
    gateway = f"127.0.0.1:{args.port}"
    result: dict = {"device": args.device.split(":")[0], "dtype": args.dtype, "graphs": graphs}
    try:
        while "ready on" not in log_path.read_text() and serve.poll() is None:
            if time.monotonic() - began > args.startup_timeout + 10:
                break
            time.sleep(0.5)
        text = log_path.read_text()
        if "ready on" not in text:
            print(f"specd serve did not become ready in {time.monotonic() - began:.0f} s:\n" + text[-3000:])
            return 1
        result["startup_s"] = time.monotonic() - began
        print(f"specd serve ready in {result['startup_s']:.0f} s", flush=True)
        reference = Path(args.reference)
        if reference.is_file():
            result["agreement"] = served_agreement(gateway, json.loads(reference.read_text()), args.gamma)
        else:
            print(f"no {reference}: no greedy agreement (the reference stage writes it)")
        common = ["--configs", f"fixed:{args.gamma},cost", "--max-new-tokens", str(args.max_new_tokens)]
        top = max(int(n) for n in args.concurrency.split(","))
        began = time.monotonic()
        run_bench(gateway, [*common, "--concurrency", str(top), "--requests-per-level", str(top),
                            "--out", f"{args.bench_out}-warm-up"], quiet=True)
        print(f"warm-up: every configuration at {top} in flight, {time.monotonic() - began:.0f} s", flush=True)
        result["rows"] = run_bench(gateway, [*common, "--concurrency", args.concurrency, "--requests-per-level",
                                             str(args.requests), "--out", args.bench_out], quiet=False)
        return 0
    finally:
        stop()
        Path(args.out).write_text(json.dumps(result, indent=2))
        lines = [line for line in log_path.read_text().splitlines()
                 if any(word in line for word in ("KV pool", "memory", "graph", "Error:", "error:", "ready on"))]
        print("\n".join(lines[-12:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env").set_defaults(func=cmd_env)

    def command(name: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        one = sub.add_parser(name)
        one.add_argument("dir", help="the pair's folder (make-pair's)")
        one.add_argument("--device", default="cuda")
        one.set_defaults(func=func)
        return one

    pair = command("make-pair", cmd_make_pair)
    pair.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    forwards = command("forwards", cmd_forwards)
    forwards.add_argument("--fraction", type=float, default=0.85,
                          help="the specd serve --gpu-memory-fraction to plan each model's pool for")
    forwards.add_argument("--small", action="store_true", help="batches of 8, short contexts (the dry run)")
    ceiling = command("ceiling", cmd_ceiling)
    ceiling.add_argument("--rounds", type=int, default=2, help="timed passes over the demo prompts, each way")
    reference = command("reference", cmd_reference)
    reference.add_argument("--prompts", type=int, default=8)
    served = command("served", cmd_served)
    served.add_argument("--cuda-graphs", action="store_true",
                        help="serve with --cuda-graphs (left out on a CPU, which cannot capture)")
    served.add_argument("--fraction", type=float, default=0.0, help="specd serve --gpu-memory-fraction (0: none)")
    served.add_argument("--port", type=int, default=50161)
    served.add_argument("--startup-timeout", type=float, default=100.0)
    served.add_argument("--concurrency", default="1,32")
    served.add_argument("--requests", type=int, default=32, help="requests per configuration and level")
    served.add_argument("--reference", default="reference.json", help="the reference stage's tokens")
    served.add_argument("--log", default="serve.log", help="specd serve's output")
    served.add_argument("--bench-out", default="bench-out/gpu/bench")
    for one, default in ((forwards, None), (ceiling, "ceiling.json"), (reference, "reference.json"),
                         (served, "served.json")):
        one.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
        one.add_argument("--out", default=default, help="write the figures to this JSON file")
    for one in (ceiling, reference, served):
        one.add_argument("--max-new-tokens", type=int, default=32)
    for one in (ceiling, served):
        one.add_argument("--gamma", type=int, default=4, help="the fixed draft length")
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
