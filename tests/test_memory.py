"""--gpu-memory-fraction: the KV pool's arithmetic, the profiling forward's shape, the device
checks, and `specd serve` starting workers that share a GPU one after the other
(specd.worker.memory, specd_cli.serve).

The arithmetic is tested with numbers here; the measurement itself (torch's CUDA allocator)
only where a CUDA device is (the last test).
"""
from __future__ import annotations

import json

import pytest
import torch

from specd.worker import memory
from specd.worker.memory import ProfileShape, kv_pool_bytes, profile_blocks, profile_shape, split_fraction
from specd.worker.runtime import ModelRunner
from specd.worker.settings import BatchSettings, ModelSettings
from specd_cli import build_parser, main
from specd_cli.serve import cmd_serve, start_groups, worker_fractions
from verifier_service.scorer import Scorer

GiB = 1 << 30
MiB = 1 << 20


def test_the_pool_takes_the_fraction_less_weights_activation_and_kept_rows():
    # An H200's 141 GiB at 0.45: 63.45 GiB, less 16 of weights, 5 of activation, 0.5 of kept rows.
    pool = kv_pool_bytes(total=141 * GiB, fraction=0.45, loaded=16 * GiB, activation=5 * GiB,
                         kept_rows=GiB // 2, free=120 * GiB)
    assert pool == int(0.45 * 141 * GiB) - 16 * GiB - 5 * GiB - GiB // 2
    assert round(pool / GiB, 2) == 41.95


def test_the_pool_never_takes_more_than_is_free_less_what_the_forwards_need():
    # Another process holds more than its share: 30 GiB free after this worker loaded.
    pool = kv_pool_bytes(total=141 * GiB, fraction=0.45, loaded=16 * GiB, activation=5 * GiB, kept_rows=0,
                         free=30 * GiB)
    assert pool == 25 * GiB
    # Nothing left: no pool, never a negative one.
    assert kv_pool_bytes(total=80 * GiB, fraction=0.2, loaded=16 * GiB, activation=5 * GiB, kept_rows=0,
                         free=60 * GiB) == 0


def test_the_profiling_forward_is_the_largest_the_scheduler_builds():
    # The defaults: 64 sessions, 1024 tokens a forward, 128-token prefill chunks, blocks of 16.
    shape = profile_shape(max_sessions=64, max_batch_tokens=1024, prefill_chunk=128, max_context=131072,
                          block_tokens=16)
    assert shape == ProfileShape(rows=64, widest=128, width=14, context=4096)
    assert shape.tokens == 128 + 63 * 14 <= 1024
    # 256 context blocks shared by every row, 8 blocks for the widest row, 1 for each other, the null block.
    assert profile_blocks(shape, 16) == 256 + 8 + 63 + 1
    # A short model context: the rows' context leaves room for the widest row, in whole blocks.
    short = profile_shape(max_sessions=64, max_batch_tokens=1024, prefill_chunk=128, max_context=1000,
                          block_tokens=16)
    assert short.context == 864 and short.context + short.widest <= 1000
    # Fewer tokens than sessions: a token a row.
    narrow = profile_shape(max_sessions=64, max_batch_tokens=24, prefill_chunk=8, max_context=256, block_tokens=16)
    assert (narrow.rows, narrow.widest, narrow.width, narrow.tokens) == (24, 1, 1, 24)


def test_serve_splits_its_fraction_by_kv_bytes_per_token(tmp_path):
    # An 8B target (32 layers, 8 KV heads of 128) and a 1B draft (16 layers, 8 KV heads of 64), bf16.
    configs = {"target": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096),
               "draft": dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                             head_dim=64)}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert memory.config_kv_bytes_per_token(tmp_path / "target") == 131072
    assert memory.config_kv_bytes_per_token(tmp_path / "draft") == 32768
    split = worker_fractions(0.9, tmp_path / "target", [tmp_path / "draft"], "bfloat16")
    assert split == pytest.approx({"verifier": 0.72, "draft": 0.18})
    # Two drafts count together; a config without the fields splits equally.
    assert worker_fractions(0.9, tmp_path / "target", [tmp_path / "draft"] * 2, "bfloat16") == \
        pytest.approx({"verifier": 0.6, "draft": 0.3})
    assert split_fraction(0.8, {"verifier": 0, "draft": 32768}) == {"verifier": 0.4, "draft": 0.4}


def test_workers_that_share_a_gpu_start_one_after_the_other():
    assert start_groups("cuda") == [("verifier",), ("draft",)]
    assert start_groups("cuda:1") == [("verifier",), ("draft",)]
    assert start_groups("cpu") == [("verifier", "draft")]


def test_bad_fractions_are_named():
    assert "gpu_memory_fraction must be in (0, 1]" in " ".join(BatchSettings(gpu_memory_fraction=1.5).problems())
    assert "gpu_memory_fraction must be in (0, 1]" in " ".join(BatchSettings(gpu_memory_fraction=-0.1).problems())
    assert "pass one" in " ".join(BatchSettings(gpu_memory_fraction=0.5, kv_cache_tokens=4096).problems())
    assert BatchSettings(gpu_memory_fraction=0.5).problems() == []


def test_a_fraction_on_a_cpu_is_refused_with_what_to_do_instead():
    problems = ModelSettings(device="cpu", batching=BatchSettings(gpu_memory_fraction=0.5)).problems()
    assert len(problems) == 1 and "--kv-cache-tokens" in problems[0]
    assert ModelSettings(device="cpu").problems() == []


def test_a_cuda_device_this_machine_lacks_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    problem = memory.device_problem("cuda", 0.5)
    assert problem is not None and "built without CUDA" in problem and "--device cpu" in problem
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    problem = memory.device_problem("cuda:0")
    assert problem is not None and "no CUDA device is visible" in problem and "nvidia-smi" in problem
    assert "not a torch device" in (memory.device_problem("cuda:x") or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: nothing to refuse")
def test_a_worker_asked_for_cuda_on_a_cpu_build_refuses_before_loading(model_dirs):
    with pytest.raises(ValueError, match="--device cuda: this torch .* is built without CUDA"):
        ModelRunner(model_dirs["target"], ModelSettings(device="cuda"))
    with pytest.raises(ValueError, match="--gpu-memory-fraction sizes the KV pool"):
        ModelRunner(model_dirs["target"], ModelSettings(batching=BatchSettings(gpu_memory_fraction=0.5)))
    # The CLI says the same and exits before any model loads.
    with pytest.raises(SystemExit, match="--device cuda: this torch .* is built without CUDA"):
        main(["verifier", "--target", str(model_dirs["target"]), "--device", "cuda"])


def test_serve_starts_the_draft_once_the_verifier_serves_on_a_gpu(model_dirs, monkeypatch):
    """The order `specd serve` starts its processes in, and the fraction each worker is given,
    with the processes and health checks replaced by a log of them."""
    log: list[str] = []

    class Supervisor:
        def __init__(self, env):
            self.processes: list = []

        def start(self, name, argv, restart=True):
            fractions = [a.split("=")[1] for a in argv if a.startswith("--gpu-memory-fraction=")]
            given = fractions and float(fractions[-1])  # the last wins; 0 is none
            log.append(f"start {name}" + (f" {fractions[-1]}" if given else ""))

        def stop(self, grace_s):
            pass

    def healthy(address, processes, timeout_s, tls=None):
        log.append(f"healthy {address.rsplit('/', 1)[-1]}")
        return not address.startswith("127.0.0.1")  # the gateway is not: serve stops there

    monkeypatch.setattr("specd_cli.supervisor.Supervisor", Supervisor)
    monkeypatch.setattr("specd_cli.serve.wait_healthy", healthy)
    monkeypatch.setattr(ModelSettings, "problems", lambda self: [])  # a GPU, as far as serve can tell

    def serve(*flags: str) -> list[str]:
        log.clear()
        args = build_parser().parse_args(["serve", "--target", str(model_dirs["target"]), "--draft",
                                          str(model_dirs["close"]), "--port", "0", *flags])
        assert cmd_serve(args) == 1
        return log[:-2]  # the gateway's start and check

    assert serve("--device", "cuda", "--gpu-memory-fraction", "0.8") == [
        "start verifier 0.4000", "healthy verifier.sock", "start draft 0.4000", "healthy draft.sock"]
    assert serve("--device", "cpu") == ["start verifier", "start draft", "healthy verifier.sock",
                                        "healthy draft.sock"]


def _device_memory_as_numbers(monkeypatch) -> None:
    """A worker's load path on this CPU as on a CUDA device of 16 MiB, 10 of them free, where
    loading the model allocates 1 MiB: torch's CUDA memory figures replaced by those numbers."""
    allocated = iter([0, MiB])  # before loading, after
    monkeypatch.setattr(memory, "device_problem", lambda device, fraction=0.0: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * MiB, 16 * MiB))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_a_worker_sizes_its_pool_from_the_fraction_s_arithmetic(model_dirs, monkeypatch):
    """The load path of --gpu-memory-fraction, on this CPU with torch's CUDA memory figures
    replaced by numbers: 16 MiB in all, 10 free, 1 MiB allocated by loading the model; the
    pool is 0.5 × 16 − 1 = 7 MiB, in whole blocks, and the worker then serves."""
    import asyncio

    from specd.sampling import Transform

    _device_memory_as_numbers(monkeypatch)
    scorer = Scorer(model_dirs["target"], ModelSettings(batching=BatchSettings(gpu_memory_fraction=0.5)))
    runner = scorer.runner
    plan = runner.memory_plan
    assert plan is not None and (plan.total, plan.loaded, plan.free, plan.activation) == (16 * MiB, MiB, 10 * MiB, 0)
    block_bytes = runner.kv_bytes_per_token() * runner.pool.block_tokens
    assert runner.pool.blocks == 7 * MiB // block_bytes == plan.pool // block_bytes
    async def step() -> None:
        scores = await scorer.score("s", 0, [5, 6, 7], [], Transform())
        assert scores.argmax is not None and len(scores.argmax) == 1
        await runner.close()

    asyncio.run(step())


def test_a_worker_with_cuda_graphs_builds_them_at_load_within_its_plan(model_dirs, monkeypatch):
    """--cuda-graphs with --gpu-memory-fraction, the load path on this CPU: the pool is the
    fraction less what loading took and what the buckets keep (`graphs.graph_bytes`), every
    bucket is built before the first request, and a request replays one. Substitutes, as a
    CPU cannot capture: torch's CUDA memory figures are numbers (16 MiB in all, 10 free, 1
    loaded), the graphs' memory pool handle is None, and a capture leaves the step to run
    eagerly (the same operators, `tests/test_graphs.py`)."""
    import asyncio

    from specd.sampling import Transform
    from specd.worker import graphs

    _device_memory_as_numbers(monkeypatch)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs.StaticSteps, "_capture", lambda self, step: None)
    batching = BatchSettings(gpu_memory_fraction=0.5)
    scorer = Scorer(model_dirs["target"], ModelSettings(cuda_graphs=True, max_sessions=8, batching=batching))
    runner = scorer.runner
    plan, steps = runner.memory_plan, runner.static_steps
    assert plan is not None and steps is not None
    buckets = graphs.buckets(max_sessions=8, batching=batching, max_context=runner.info.max_context)
    assert steps.built == buckets and plan.buckets == len(buckets)
    hidden = runner.model.config.hidden_size
    assert plan.graphs == graphs.graph_bytes(buckets, hidden, torch.finfo(runner.dtype).bits // 8) > 0
    block_bytes = runner.kv_bytes_per_token() * runner.pool.block_tokens
    assert runner.pool.blocks == (7 * MiB - plan.graphs) // block_bytes
    assert f"for {len(buckets)} CUDA graphs" in plan.describe()

    async def step() -> None:
        replays = steps.replays
        scores = await scorer.score("s", 0, [5, 6, 7], [], Transform())
        assert scores.argmax is not None and len(scores.argmax) == 1
        await scorer.score("s", 3, [scores.argmax[0]], [], Transform())  # a plain step: a built bucket
        assert steps.replays > replays and steps.built == buckets
        await runner.close()

    asyncio.run(step())


def test_the_profiling_forward_runs_on_the_worker_s_rows(model_dirs):
    """The profile's rows (a shared context forked for every row, copy on write) go through a
    real forward; on a CPU nothing is measured, which the CUDA test below does."""
    from transformers import AutoModelForCausalLM

    from specd.worker import forwards, trials
    from specd.worker.attention import use_paged_attention
    from specd.worker.kvstore import KVPool

    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32).eval()
    use_paged_attention(model)
    cpu = torch.device("cpu")
    shape = profile_shape(max_sessions=8, max_batch_tokens=64, prefill_chunk=16, max_context=256, block_tokens=8,
                          profile_context=64)
    assert shape == ProfileShape(rows=8, widest=16, width=6, context=64)
    pool = KVPool(*trials.kv_shape(model, cpu), torch.float32, cpu, 8, profile_blocks(shape, 8))
    assert memory.profile_activation(lambda rows: forwards.forward(model, rows, cpu), pool, shape,
                                     model.config.vocab_size, cpu) == 0
    assert pool.free_blocks == pool.blocks - 1  # every row's blocks went back


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_a_worker_on_a_gpu_sizes_its_pool_from_its_fraction(model_dirs):
    fraction = 0.05
    before = torch.cuda.memory_allocated()
    runner = ModelRunner(model_dirs["target"], ModelSettings(device="cuda",
                                                               batching=BatchSettings(gpu_memory_fraction=fraction)))
    plan = runner.memory_plan
    assert plan is not None and plan.fraction == fraction and plan.activation > 0 and plan.loaded > 0
    assert plan.pool == runner.pool.blocks * runner.pool.block_bytes
    assert plan.pool <= fraction * plan.total - plan.loaded - plan.activation - plan.kept_rows
    # What the worker holds once loaded (weights, pool, the load-time timing's leftovers) is within its share.
    assert torch.cuda.memory_allocated() - before <= fraction * plan.total
