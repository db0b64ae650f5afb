"""Static forwards for CUDA graphs (`specd.worker.graphs`, `--cuda-graphs`), on this CPU.

A CPU build of torch cannot capture a CUDA graph, so these tests check what a capture
needs, with the same code a capture would run (`StaticSteps(capture=False)` runs each
bucket's step eagerly):
- each real row gets the eager forward's logits, and padding writes nowhere but the null
  block;
- the step has no host sync (no `.item()`, no output whose shape follows values, as a
  mixture of experts' eager routing has) and runs the same operators on the same shapes
  whatever rows fill it, and torch's graph tracer takes it whole;
- served through real services, greedy output equals transformers' `generate`;
- on a machine without CUDA, `--cuda-graphs` is refused in words a person can act on.
Where a GPU is present, one more test captures a graph and replays it. What graphs gain
is `scripts/gpu_check.sh`'s to measure.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, MixtralConfig, MixtralForCausalLM

from conftest import request, start_stack
from specd.worker import forwards, graphs, lean, memory
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import NULL_BLOCK, KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.settings import BatchSettings, ModelSettings
from test_batching import PROMPTS, _model, _per_row, _pool, in_flight
from test_cli import free_port, specd
from test_pipeline import reference_greedy

MiB = 1 << 20
# Operators a CUDA graph cannot hold: each waits for the device (a scalar read back, an
# output whose size is a value).
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten.unique_consecutive.default", "aten._unique2.default", "aten.item.default"}


class _Operators(TorchDispatchMode):
    """Every operator run, with its arguments' shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        self.calls.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def _sessions(model, pool: KVPool, lengths: list[int]) -> list[SessionKV]:
    """Sessions holding `lengths` cached positions of random tokens, prefilled eagerly."""
    sessions = []
    for n in lengths:
        session = SessionKV(pool)
        assert session.reserve(n + 8)
        session.tokens = torch.randint(1, model.config.vocab_size, (n,)).tolist()
        forwards.forward(model, [BatchRow(session, session.tokens, 1)], model.device)
        sessions.append(session)
    return sessions


def _buckets(model, pool: KVPool, max_sessions: int) -> list[graphs.Bucket]:
    """The buckets a worker of `max_sessions` with `pool` builds at load."""
    context = min(model.config.max_position_embeddings, (pool.blocks - 1) * pool.block_tokens)
    return graphs.buckets(max_sessions=max_sessions, batching=BatchSettings(block_tokens=pool.block_tokens),
                          max_context=context)


def _static(model, pool: KVPool, max_sessions: int = 8) -> graphs.StaticSteps:
    decoder = lean.decoder_of(model)
    assert decoder is not None, "the lean forward was not installed"
    return graphs.StaticSteps(decoder, pool, model.device, _buckets(model, pool, max_sessions), capture=False)


def test_a_static_step_gives_each_row_the_eager_forwards_logits(model_dirs, device):
    """Three rows (a bucket of 4) feeding 1, 3 and 2 tokens (a bucket of 4 tokens), over
    contexts of 5 to 30 positions (a bucket of 8 blocks): each row's kept logits are the eager forward's, and
    the padding wrote into the null block alone."""
    torch.manual_seed(0)
    model = _model(model_dirs["target"], device)
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    steps = _static(model, pool)
    with torch.inference_mode():
        sessions = _sessions(model, pool, [5, 30, 12])
        feeds = [[7], [8, 9, 10], [11, 12]]
        rows = [BatchRow(s, feed, len(feed)) for s, feed in zip(sessions, feeds)]
        assert steps.bucket(rows) == (4, 4, 8)  # 33 positions: 5 blocks of 8
        eager = _per_row(forwards.forward(model, rows, model.device))
        for session, feed in zip(sessions, feeds):
            session.crop(session.length - len(feed))
        before = pool.keys.clone(), pool.values.clone()
        static = steps.forward(rows)
        assert static is not None and steps.replays == 1
        # What a graph would keep between replays: hidden states, H wide, not V-wide logits.
        assert steps._steps[(4, 4, 8)].run().shape == (1, 4 * 4, model.config.hidden_size)
    for got, expected in zip(_per_row(static), eager):
        torch.testing.assert_close(got.float(), expected)
    size = pool.block_tokens
    written = {slot for s, feed in zip(sessions, feeds) for slot in s.slots(s.length, s.length + len(feed))}
    written |= set(range(NULL_BLOCK * size, (NULL_BLOCK + 1) * size))
    # Blocks never handed out hold whatever memory the pool was given, NaN bit patterns among
    # them: a NaN left as it was is unchanged.
    changed = torch.zeros(pool.keys.shape[1], dtype=torch.bool, device=pool.keys.device)
    for now, then in zip((pool.keys, pool.values), before):
        changed |= (~((now == then) | (now.isnan() & then.isnan()))).flatten(2).any(-1).any(0)
    assert set(changed.nonzero().flatten().tolist()) <= written
    used = [NULL_BLOCK] + [block for s in sessions for block in s.blocks]
    slots = torch.tensor([b * size + i for b in used for i in range(size)], device=pool.keys.device)
    assert torch.isfinite(pool.keys[:, slots]).all() and torch.isfinite(pool.values[:, slots]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph: needs a CUDA device")
def test_a_captured_graph_replays_the_eager_logits_for_each_fill(model_dirs):
    """On a GPU: one bucket captured once, then replayed for two different sets of rows,
    gives each the eager forward's logits (float32): the graph reads its buffers at every
    replay, not the values it was captured with."""
    torch.manual_seed(0)
    model = _model(model_dirs["target"], "cuda")
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    decoder = lean.decoder_of(model)
    assert decoder is not None
    buckets = [(4, 2, 4), (1, 1, 1)]  # the rows below: 3 rows of 1 or 2 tokens over at most 22 positions
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    steps = graphs.StaticSteps(decoder, pool, model.device, buckets, capture=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as the worker measures: the warm-up runs' freed blocks go back
    took = free - torch.cuda.mem_get_info()[0]
    planned = (graphs.graph_bytes(buckets, model.config.hidden_size, 4)
               + graphs.transient_bytes(decoder, pool, buckets, model.device))
    # What the captures took, beside what the memory plan would keep: within the allocator's
    # segments (2 MiB for small blocks, 20 for large), of which a private pool takes its own.
    assert took <= planned + 2 * 20 * MiB, (took, planned)
    assert steps.captured == 2
    with torch.inference_mode():
        sessions = _sessions(model, pool, [5, 20, 12])
        for feeds in ([[7], [8, 9], [10, 11]], [[3, 4], [5], [6]]):
            rows = [BatchRow(s, feed, len(feed)) for s, feed in zip(sessions, feeds)]
            eager = _per_row(forwards.forward(model, rows, model.device))
            for session, feed in zip(sessions, feeds):
                session.crop(session.length - len(feed))
            static = steps.forward(rows)
            assert static is not None
            for got, expected in zip(_per_row(static), eager):
                torch.testing.assert_close(got.float(), expected)
    assert steps.replays == 2


def test_rows_that_fit_no_bucket_run_the_eager_forward(model_dirs):
    model = _model(model_dirs["target"], "cpu")
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    steps = _static(model, pool, max_sessions=2)
    forwards.use_static_steps(model, steps)
    sessions = [SessionKV(pool) for _ in range(3)]
    for session in sessions:
        assert session.reserve(40)
    assert steps.bucket([BatchRow(sessions[0], [1], 1)] * 3) is None  # more rows than the worker's sessions
    prefill = list(range(1, 18))  # 17 tokens: more than a bucket feeds
    assert steps.bucket([BatchRow(sessions[0], prefill, 1)]) is None
    with torch.inference_mode():
        logits, _ = forwards.forward(model, [BatchRow(sessions[0], prefill, 1)], model.device)
        assert steps.replays == 0  # the eager forward ran it
        forwards.forward(model, [BatchRow(sessions[1], [5], 1)], model.device)
        assert steps.replays == 1
    torch.testing.assert_close(logits, model(input_ids=torch.tensor([prefill])).logits[0, -1:])


def test_rows_outside_the_buckets_built_at_load_run_eagerly_and_build_nothing(model_dirs):
    """Nothing is built (or, on a GPU, captured) on a request's path: a forward whose
    bucket the worker did not build at load, here a context longer than the set covers,
    runs the eager forward, exactly, and the set is as it was."""
    model = _model(model_dirs["target"], "cpu")
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    decoder = lean.decoder_of(model)
    assert decoder is not None
    steps = graphs.StaticSteps(decoder, pool, model.device, [(2, 1, 4), (2, 1, 2)], capture=False)
    forwards.use_static_steps(model, steps)
    short, long = _sessions(model, pool, [20, 40])  # 3 and 6 blocks of 8, with the token fed
    with torch.inference_mode():
        assert steps.bucket([BatchRow(long, [5], 1)]) is None  # a bucket of 8 blocks: not built
        logits, _ = forwards.forward(model, [BatchRow(long, [5], 1)], model.device)
        assert steps.replays == 0
        forwards.forward(model, [BatchRow(short, [5], 1)], model.device)
        assert steps.replays == 1
    assert steps.built == [(2, 1, 4), (2, 1, 2)]
    expected = model(input_ids=torch.tensor([long.tokens[:40] + [5]])).logits[0, -1:]
    torch.testing.assert_close(logits, expected)


def test_the_buckets_built_at_load_are_bounded():
    """Every bucket feeds at most GRAPH_POSITIONS positions and gathers at most the keys the
    profiling forward gathered, so no capture outgrows the activation the memory plan
    measured; within that, one session decodes in a graph up to the model's whole context,
    and every batch up to the worker's sessions at a short one. Largest first, for the
    captures' shared pool."""
    batching = BatchSettings()
    for sessions, context in ((64, 131072), (256, 8192), (1, 4096), (5, 1000)):
        found = graphs.buckets(max_sessions=sessions, batching=batching, max_context=context)
        keys = memory.profile_shape(max_sessions=sessions, max_batch_tokens=batching.max_batch_tokens,
                                    prefill_chunk=batching.prefill_chunk, max_context=context,
                                    block_tokens=batching.block_tokens).keys
        assert len(set(found)) == len(found) < 512
        assert all(b * f <= graphs.GRAPH_POSITIONS and b * w * batching.block_tokens <= keys for b, f, w in found)
        whole = -(-context // batching.block_tokens)
        alone = max(w for b, f, w in found if b == 1 and f == 1)
        assert alone >= whole or 2 * alone * batching.block_tokens > keys, (sessions, context, alone)
        batches = {b for b, f, w in found if f == 1 and w == 1}
        assert max(batches) >= sessions and {b for b in graphs.BATCH_BUCKETS if b < sessions} <= batches
        sizes = [b * w for b, f, w in found]
        assert sizes == sorted(sizes, reverse=True)


def test_what_the_built_buckets_keep_is_what_the_memory_plan_counts(model_dirs):
    """`graph_bytes` is each built step's buffer and the output a capture keeps, to the
    byte; the intermediates' peak (`transient_bytes`) runs the largest buckets, and is
    measured only by a CUDA allocator (0 here)."""
    model = _model(model_dirs["target"], "cpu")
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    steps = _static(model, pool, max_sessions=4)
    with torch.inference_mode():
        kept = sum(step.buffer.nbytes + step.run().nbytes for step in steps._steps.values())
        assert graphs.transient_bytes(steps.decoder, pool, steps.built, model.device) == 0
    assert graphs.graph_bytes(steps.built, model.config.hidden_size, 4) == kept


def _tiny(kind: str):
    """A tiny model of a family: Gemma 2 (sliding windows, soft caps) or Mixtral (routed experts)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    if kind == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=16, sliding_window=8))
    else:
        model = MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2))
    return model.eval()


def _operators_of(steps: graphs.StaticSteps, rows: list[BatchRow]) -> list[tuple[str, tuple]]:
    key = steps.bucket(rows)
    assert key is not None
    step = graphs.StaticStep(steps.decoder, steps.pool, *key, steps.device)
    step.fill(rows)
    with torch.inference_mode(), _Operators() as recorded:
        step.run()
    return recorded.calls


def _capturable(model) -> tuple[list[str], bool]:
    """The syncing operators a static step of `model` ran, and whether it ran the same
    operators on the same shapes for two different fills of one bucket."""
    use_paged_attention(model)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, head_dim, torch.float32,
                  torch.device("cpu"), 8, 64)
    forwards.use_forward(model, lean.LeanDecoder(model))
    steps = _static(model, pool)
    with torch.inference_mode():
        a, b, c = _sessions(model, pool, [3, 14, 9])
    one = [BatchRow(a, [5, 6], 2), BatchRow(b, [7], 1), BatchRow(c, [8, 9], 1)]
    other = [BatchRow(c, [1], 1), BatchRow(b, [2, 3], 2), BatchRow(a, [4], 1)]  # other lengths, keeps, order
    assert steps.bucket(one) == steps.bucket(other) == (4, 2, 2)
    first, second = _operators_of(steps, one), _operators_of(steps, other)
    return sorted({name for name, _ in first + second if name in SYNCING}), first == second


def test_a_static_step_neither_syncs_nor_follows_its_rows(model_dirs):
    """What a capture needs, on a Llama and on Gemma 2 (sliding windows, soft-capped
    scores): no operator that waits for the device, the same operators on the same shapes
    for rows of other lengths and contexts in the same bucket, and no Python branch on
    a tensor's value (torch's graph tracer takes the step as one graph)."""
    for model in (_model(model_dirs["target"], "cpu"), _tiny("gemma2")):
        syncing, same = _capturable(model)
        assert syncing == [] and same, type(model).__name__
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, head_dim, torch.float32,
                      torch.device("cpu"), 8, 16)
        step = graphs.StaticStep(forwards.stand_in(model), pool, 2, 4, 2, torch.device("cpu"))
        with torch.inference_mode():
            explained = torch._dynamo.explain(step.run)()
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_a_mixture_of_experts_is_captured_only_with_grouped_experts():
    """Mixtral's experts as transformers runs them by default, grouped products with offsets
    on the device, pass the check above. Its eager experts read back which experts were
    hit: the check finds it, and a worker leaves that model's forwards eager, saying why."""
    grouped = _tiny("mixtral")
    assert _capturable(grouped) == ([], True)
    assert graphs.problem(grouped, forwards.stand_in(grouped), longrope=False) is None
    looped = _tiny("mixtral")
    looped.set_experts_implementation("eager")
    syncing, _ = _capturable(looped)
    assert "aten.nonzero.default" in syncing
    problem = graphs.problem(looped, forwards.stand_in(looped), longrope=False)
    assert problem is not None and "grouped_mm" in problem


def test_static_steps_serve_greedy_exactly(model_dirs, target_model, tokenizer):
    """Draft and verifier both run their decode and verify forwards as static steps (eagerly,
    on this CPU): greedy output with 8 in flight equals transformers' `generate`, at fixed
    γ and decoding plainly, and the steps ran in buckets of several rows and tokens."""
    stack = start_stack(model_dirs, drafts=("close",))
    try:
        draft, verifier = stack.draft.servicer, stack.verifier.servicer
        runners = [draft.drafts["close"].runner, verifier.scorer.runner]
        installed = []
        for runner in runners:
            steps = _static(runner.model, runner.pool, max_sessions=64)
            forwards.use_static_steps(runner.model, steps)
            installed.append(steps)
        for mode in ("FIXED", "OFF"):
            responses = in_flight(stack.stub, [request(p, max_new_tokens=24, mode=mode, draft_model="close")
                                               for p in PROMPTS])
            for prompt, response in zip(PROMPTS, responses):
                assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 24), (mode, prompt)
        for steps in installed:
            buckets = set(steps._steps)
            assert steps.replays > 0
            assert any(batch > 1 for batch, _, _ in buckets), buckets
        assert any(feed > 1 for _, feed, _ in set(installed[1]._steps)), "the verifier verified no proposal"
    finally:
        stack.close()


def test_cuda_graphs_are_refused_without_a_cuda_device(model_dirs):
    problems = ModelSettings(cuda_graphs=True).problems()
    assert problems and "--cuda-graphs" in problems[0] and "--device cuda" in problems[0]
    result = specd("serve", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["close"]),
                   "--port", str(free_port()), "--cuda-graphs")
    assert result.returncode == 2
    assert "--cuda-graphs captures forwards on a CUDA device" in result.stderr
