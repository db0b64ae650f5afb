"""The measuring half of scripts/gpu_check.sh: the machine, the model pair, and what one
forward costs on the device.

    python scripts/gpu_check.py env
    python scripts/gpu_check.py make-pair DIR [--shape 8b|tiny] [--device cuda]
    python scripts/gpu_check.py forwards DIR [--device cuda] [--dtype bfloat16] [--fraction 0.4] [--out FILE.json]
    python scripts/gpu_check.py served DIR [--device cuda] [--fraction 0.85] [--concurrency 1,32]

`make-pair` writes DIR/target and DIR/draft, random Llama weights in 8B shapes (`SHAPES`:
hidden 4,096, 32 query and 8 KV heads, a 128,256-token vocabulary, a few layers) with the
demo tokenizer, built on the device (no download: a lent machine reaches nothing). The pair
has real acceptance by construction: the target's layers after the first add nothing to the
residual stream (their output projections are zero, which costs the same products), and the
draft is the target's embedding, first layer, norm and head, so the draft's greedy token is
the target's up to the rounding of differently shaped products. Vocabulary rows past the
tokenizer's score 0 in the head: a random row's best logit is far above 0, so greedy never
emits a token the tokenizer lacks, while the head still multiplies all 128,256 rows.

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

`served` runs `specd serve` on the pair (with --gpu-memory-fraction, split between the two
workers, the draft started once the verifier serves), then `specd bench --configs fixed:4
--concurrency ...` against it: target-only and fixed γ=4 ÷ target-only at each level.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

SHAPES = {  # layers of the target and of the draft; the rest is the 8B's
    "8b": dict(vocab=128256, hidden=4096, intermediate=14336, heads=32, kv_heads=8, target_layers=6,
               draft_layers=1, context=8192),
    "tiny": dict(vocab=8192, hidden=64, intermediate=128, heads=4, kv_heads=2, target_layers=3, draft_layers=1,
                 context=1024),
}
# What the services import beyond torch and transformers (scripts/gpu_wheels.sh carries them).
SERVING_MODULES = ("grpc", "grpc_health.v1", "grpc_reflection.v1alpha", "google.protobuf", "opentelemetry.sdk",
                   "opentelemetry.exporter.otlp.proto.grpc", "llguidance", "starlette", "uvicorn", "cryptography",
                   "prometheus_client")


def cmd_env(args: argparse.Namespace) -> int:
    """The machine and the software, one `key: value` a line; `serving: ok` when the services can run."""
    import torch
    import transformers

    print(f"python: {platform.python_version()} ({sys.executable})")
    print(f"torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}")
    print(f"transformers: {transformers.__version__}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
              f"{props.major}.{props.minor}, {props.multi_processor_count} SMs")
        print(f"sdpa enabled: flash {torch.backends.cuda.flash_sdp_enabled()}, memory-efficient "
              f"{torch.backends.cuda.mem_efficient_sdp_enabled()}, cuDNN {torch.backends.cuda.cudnn_sdp_enabled()}, "
              f"math {torch.backends.cuda.math_sdp_enabled()}")
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
    """DIR/target and DIR/draft (kept if both are there already)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specd.config import DEMO_TARGET

    root = Path(args.dir)
    if (root / "target" / "config.json").is_file() and (root / "draft" / "config.json").is_file():
        print(f"{root}: the pair is there already")
        return 0
    shape = SHAPES[args.shape]
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    device = torch.device(args.device)
    began = time.perf_counter()

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                           intermediate_size=shape["intermediate"], num_hidden_layers=layers,
                           num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                           max_position_embeddings=shape["context"], rope_theta=500000.0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                           tie_word_embeddings=False, dtype="bfloat16")

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: seconds, not minutes
    try:
        with device:
            target = LlamaForCausalLM(config(shape["target_layers"]))
            draft = LlamaForCausalLM(config(shape["draft_layers"]))
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in target.model.layers[shape["draft_layers"]:]:  # they add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.lm_head.weight[len(tokenizer):] = 0  # ids the tokenizer lacks never win
        # The draft: the target's embedding, first layers, norm and head.
        missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
        assert not missing and all(".layers." in key for key in unexpected), (missing, unexpected)
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.bfloat16).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
              f"{model.config.num_hidden_layers} layers of {shape['hidden']}, vocabulary {shape['vocab']}")
    print(f"made in {time.perf_counter() - began:.0f} s on {device}")
    return 0


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
            lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval())
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
    replayed = "graphs" if forwards.static_steps(model.model) else backends
    print(f"   {batch:>8} {width:>6} {len(kernels):>7} {len(copies):>6} {result['syncs']:>5} {event} "
          f"{result['wall_ms']:7.3f} {result['issue_ms']:8.3f} {busy_ms:7.3f}  {replayed}", flush=True)
    return result


def use_graphs(model: Loaded) -> str:
    """From now on, run `model`'s forwards as CUDA graphs (`--cuda-graphs`; on a CPU, the
    same static steps run eagerly); what `graphs.problem` says where it cannot."""
    from specd.worker import forwards, graphs, rope

    decoder = forwards.stand_in(model.model)
    problem = graphs.problem(model.model, decoder, rope.regime(model.model) is not None)
    if problem is not None or decoder is None:
        return f"no graphs: {problem}"
    steps = graphs.StaticSteps(decoder, model.pool, model.device, 32, capture=model.device.type == "cuda")
    forwards.use_static_steps(model.model, steps)
    return "on"


def graph_agreement(model: Loaded, batch: int, width: int, context: int) -> str:
    """The same rows through the eager forward and through a static step (captured on a
    GPU): the largest logit difference and how many greedy tokens agree."""
    from specd.worker import forwards

    rows = _rows(model, batch, width, context)
    steps = forwards.static_steps(model.model)
    forwards.use_static_steps(model.model, None)
    eager, _ = model.forward(rows())
    forwards.use_static_steps(model.model, steps)
    static, _ = model.forward(rows())
    agree = (eager.argmax(-1) == static.argmax(-1)).float().mean().item()
    return f"max |eager − graph| {(eager - static).abs().max().item():.3g}, greedy tokens agree {agree:.0%}"


def cmd_forwards(args: argparse.Namespace) -> int:
    import torch

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
              f"{'wall ms':>7} {'issue ms':>8} {'busy ms':>7}  SDPA (or graphs: the same replayed)")
        results = [measure(model, batch, width, context, repeats) for batch, width in shapes]
        graphs = use_graphs(model)
        print(f"   --cuda-graphs: {graphs}" + ("" if cuda else " (a CPU cannot capture: the static steps run eagerly)"))
        if graphs == "on":
            results += [{**measure(model, batch, width, context, repeats), "graphs": True} for batch, width in shapes]
            batch, width = shapes[-1]
            print(f"   {batch} sessions × {width} tokens: {graph_agreement(model, batch, width, context)}", flush=True)
        peak = torch.cuda.max_memory_allocated(device) if cuda else 0
        if cuda:
            print(f"   peak torch.cuda.max_memory_allocated: {peak / 2**20:,.0f} MiB")
        report["models"][name] = {"weights": model.weights, "load_s": model.load_s, "lean": model.lean,
                                  "plan": plan, "peak": peak, "forwards": results}
        del model
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def cmd_served(args: argparse.Namespace) -> int:
    """`specd serve` on the pair, then `specd bench` against it; serve is stopped however this
    ends (a SIGTERM from the stage's time limit included), so it never keeps the device."""
    import os
    import signal
    import subprocess

    log_path = Path(args.log)
    command = [sys.executable, "-m", "specd_cli", "serve", "--target", f"{args.dir}/target", "--draft",
               f"{args.dir}/draft", "--device", args.device, "--dtype", args.dtype, "--port", str(args.port),
               "--startup-timeout", str(args.startup_timeout)]
    if args.fraction:
        command += ["--gpu-memory-fraction", str(args.fraction)]
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
    try:
        while "ready on" not in log_path.read_text() and serve.poll() is None:
            if time.monotonic() - began > args.startup_timeout + 10:
                break
            time.sleep(0.5)
        text = log_path.read_text()
        if "ready on" not in text:
            print(f"specd serve did not become ready in {time.monotonic() - began:.0f} s:\n" + text[-3000:])
            return 1
        print(f"specd serve ready in {time.monotonic() - began:.0f} s", flush=True)
        bench = [sys.executable, "-m", "specd_cli", "bench", "--gateway", f"127.0.0.1:{args.port}", "--configs",
                 "fixed:4", "--concurrency", args.concurrency, "--requests-per-level", str(args.requests),
                 "--max-new-tokens", str(args.max_new_tokens), "--out", args.bench_out]
        return subprocess.run(bench).returncode
    finally:
        stop()
        lines = [line for line in log_path.read_text().splitlines()
                 if any(word in line for word in ("KV pool", "memory", "Error:", "error:", "ready on"))]
        print("\n".join(lines[-12:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env").set_defaults(func=cmd_env)
    pair = sub.add_parser("make-pair")
    pair.add_argument("dir")
    pair.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    pair.add_argument("--device", default="cuda")
    pair.set_defaults(func=cmd_make_pair)
    forwards = sub.add_parser("forwards")
    forwards.add_argument("dir")
    forwards.add_argument("--device", default="cuda")
    forwards.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    forwards.add_argument("--fraction", type=float, default=0.85,
                          help="the specd serve --gpu-memory-fraction to plan each model's pool for")
    forwards.add_argument("--small", action="store_true", help="batches of 8, short contexts (the dry run)")
    forwards.add_argument("--out", help="write the figures to this JSON file")
    forwards.set_defaults(func=cmd_forwards)
    served = sub.add_parser("served")
    served.add_argument("dir")
    served.add_argument("--device", default="cuda")
    served.add_argument("--dtype", default="bfloat16")
    served.add_argument("--fraction", type=float, default=0.0, help="specd serve --gpu-memory-fraction (0: none)")
    served.add_argument("--port", type=int, default=50161)
    served.add_argument("--startup-timeout", type=float, default=100.0)
    served.add_argument("--concurrency", default="1,32")
    served.add_argument("--requests", type=int, default=32, help="requests per configuration and level")
    served.add_argument("--max-new-tokens", type=int, default=32)
    served.add_argument("--log", default="serve.log", help="specd serve's output")
    served.add_argument("--bench-out", default="bench-out/gpu/bench")
    served.set_defaults(func=cmd_served)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
