"""What the KV store can serve, found when a model loads, by trying it: the shape of what
its layers cache (`kv_shape`) and whether its batched forward agrees with its own
(`batching_problem`). A model the store cannot serve exactly is refused there with the
reason, never at a request. The same trial batches check a forward that would stand in
for the model's own (`trial_logits`; specd.worker.lean).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from specd.errors import UnsupportedModel
from specd.worker import forwards
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchInputs, BatchRow, prepare

# Attention layers the store serves: full causal attention, and a sliding window over it.
LAYER_TYPES = {"full_attention", "sliding_attention"}


@torch.inference_mode()
def kv_shape(model: PreTrainedModel, device: torch.device) -> tuple[int, int, int, int]:
    """(layers, KV heads, key dim, value dim) of a decoder, read from the cache of a
    two-token forward rather than guessed from its config: families name these fields
    differently, and what a layer caches need not be its keys and values (multi-head
    latent attention caches one head of compressed latent and one of rotary key, of
    different sizes).
    UnsupportedModel for layers the store cannot hold, or layers of different shapes."""
    config = model.config
    other = sorted(set(getattr(config, "layer_types", None) or ()) - LAYER_TYPES)
    if other:
        raise UnsupportedModel(f"{config.model_type}: layers of type {other} keep no key/value cache the batched "
                               f"store can hold (it serves {sorted(LAYER_TYPES)})")
    cache = DynamicCache(config=config)
    try:
        model(input_ids=torch.tensor([[1, 2]], device=device), cache=cache, use_cache=True)
        shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in cache.layers}
    except Exception as exc:  # whatever the model's code raises is the reason it cannot be served
        raise UnsupportedModel(f"{config.model_type}: a forward with transformers' own cache fails or keeps no "
                               f"keys and values: {type(exc).__name__}: {exc}") from exc
    if len(shapes) != 1:
        raise UnsupportedModel(f"{config.model_type}: its layers cache keys and values of different shapes "
                               f"{sorted(shapes)}; the store keeps one shape for all layers")
    (heads, key_dim, value_dim), = shapes
    return len(cache.layers), heads, key_dim, value_dim


# How far a batched forward's logits may stray from the plain forward's, as a share of the
# largest logit: float32 differs in rounding only; half precision in more than that.
_AGREEMENT = {torch.float32: 1e-3, torch.float64: 1e-6}
_HALF_AGREEMENT = 3e-2


def _trial_sequences(vocab_size: int) -> list[list[int]]:
    """The two sessions of the load trials, of different lengths."""
    return [[(7 * i + 3) % vocab_size for i in range(1, 21)], [(11 * i + 5) % vocab_size for i in range(1, 14)]]


class NoRoomForTrial(Exception):
    """The KV pool cannot hold the load trials' two sessions."""


def trial_batches(pool: KVPool, vocab_size: int) -> Iterator[list[BatchRow]]:
    """The rows of the load trials' three batched forwards, in order: both sessions of
    `_trial_sequences` prefill, then take a verification-sized step of 5 tokens, then a
    decoding step of 1, as serving runs them. NoRoomForTrial when the pool cannot hold them."""
    sessions = []
    for tokens in _trial_sequences(vocab_size):
        session = SessionKV(pool)
        if not session.reserve(len(tokens)):
            raise NoRoomForTrial("the KV pool has no room for a two-session trial forward")
        session.tokens = tokens
        sessions.append(session)
    for phase in range(3):
        rows = []
        for session in sessions:
            cuts = (0, len(session.tokens) - 6, len(session.tokens) - 1, len(session.tokens))  # 5 tokens | 1 token
            rows.append(BatchRow(session, session.tokens[cuts[phase]:cuts[phase + 1]], cuts[phase + 1] - cuts[phase]))
        yield rows


@torch.inference_mode()
def trial_logits(stand_in: Callable[[BatchInputs], torch.Tensor], pool: KVPool, vocab_size: int,
                 device: torch.device, paged_kernel: bool = False) -> list[torch.Tensor] | str:
    """The kept logits of each of `trial_batches`' forwards run through `stand_in` (a
    forward as `forwards.use_forward` takes, for a model that attends through
    `attention.paged_attention`; with `paged_kernel`, reading the pool through it); the
    reason instead when the pool has no room."""
    logits = []
    try:
        for rows in trial_batches(pool, vocab_size):
            logits.append(stand_in(prepare(rows, device, paged_kernel=paged_kernel)))
            for row in rows:
                row.session.length += len(row.tokens)
    except NoRoomForTrial as exc:
        return str(exc)
    return logits


@torch.inference_mode()
def batching_problem(model: PreTrainedModel, pool: KVPool, vocab_size: int, device: torch.device) -> str | None:
    """Why the store cannot serve `model` exactly (None: it can), found by trying it at load.

    Two sessions of different lengths go through three batched forwards together
    (`trial_batches`). Every logit must match the model's own eager forward over the same
    sequences. An exception (a cache method the model needs and `BatchCache` lacks, keys
    and values of shapes the pool cannot hold) or a disagreement (a model that reads
    positions or masks some other way) is the reason; a model refused here never fails at
    a request instead.
    """
    batched: list[list[torch.Tensor]] = [[], []]
    attends_itself = False  # the first forward never reached paged_attention
    try:
        for rows in trial_batches(pool, vocab_size):
            logits, kept, attended = forwards.forward_attended(model, rows, device)
            if not attended and not forwards.attends_itself(model):
                attends_itself = True
                break
            for row, rows_kept in enumerate(kept):
                batched[row].append(logits[rows_kept])
    except NoRoomForTrial as exc:
        return str(exc)
    except Exception as exc:  # whatever the model's code raises is the reason it cannot be served
        return f"a batched forward fails: {type(exc).__name__}: {exc}"
    if attends_itself:
        del rows  # the last of the trial's sessions: their blocks go back to the pool
        return _trial_handing_whole_contexts(model, pool, vocab_size, device)
    # The reference: the model's own eager attention over each whole sequence.
    try:
        model.set_attn_implementation("eager")
        plains = [model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0].float()
                  for tokens in _trial_sequences(vocab_size)]
    except Exception as exc:  # a model whose own forward fails cannot be checked, so is not served
        return f"its own forward fails: {type(exc).__name__}: {exc}"
    finally:
        use_paged_attention(model)
    for row, plain in enumerate(plains):
        got, want = torch.cat(batched[row]), plain
        scale = want.abs().max().item() or 1.0
        error = (got - want).abs().max().item() / scale
        if not error <= _AGREEMENT.get(pool.keys.dtype, _HALF_AGREEMENT):
            return (f"its batched forward disagrees with its plain forward (largest difference "
                    f"{error:.2g} of the largest logit): it reads positions or masks in a way the store "
                    f"does not reproduce")
    return None


def _trial_handing_whole_contexts(model: PreTrainedModel, pool: KVPool, vocab_size: int,
                                  device: torch.device) -> str | None:
    """`batching_problem` for a model that attends on its own: the mask as its
    `attention_mask`, else handed to each layer; the reason when neither is exact."""
    forwards.hand_whole_contexts(model, forwards.MODEL_MASK)
    problem = batching_problem(model, pool, vocab_size, device)
    if problem is not None:
        forwards.hand_whole_contexts(model, forwards.LAYER_MASK)
        problem = batching_problem(model, pool, vocab_size, device)
    return problem

