"""One batched forward over any number of sessions (`forward`): the model's own, or a
forward that stands in for it (`use_forward`: the lean forward, `specd.worker.lean`).

The rows are laid out over the KV pool by `specd.worker.layout`, and the model's attention
reads them through `specd.worker.attention`. A model that computes attention itself on
what `cache.update` returns (Falcon, BLOOM) is found at load (`specd.worker.trials`); its
update then returns every session's whole context, concatenated, and it gets a mask that
keeps each session's queries to their own keys: more memory traffic per forward, but
exact.
"""
from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from specd.worker.graphs import StaticSteps
from specd.worker.layout import BatchCache, BatchInputs, BatchRow, prepare

# Models that attend on their own, never through the attention interface (Falcon, BLOOM):
# found at load (`specd.worker.trials.batching_problem`). Their cache update hands back
# every session's whole context, concatenated, and they get the mask that keeps each
# session to its own, in one of two ways, whichever the trial finds exact: as the model's
# `attention_mask` (MODEL_MASK: most take a prepared 4-D mask as it is), or handed to each
# layer (LAYER_MASK: BLOOM, whose ALiBi needs the model called without one).
MODEL_MASK, LAYER_MASK = "model", "layer"
_ATTENDS_ITSELF: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def hand_whole_contexts(model: torch.nn.Module, mask: str) -> None:
    """From now on, hand `model` (one that attends on its own) every session's whole
    context, with the mask as `mask` says: MODEL_MASK or LAYER_MASK."""
    _ATTENDS_ITSELF[model] = mask
    if mask == LAYER_MASK:
        _hand_masks(model)


def attends_itself(model: torch.nn.Module) -> bool:
    """Whether `model` is handed whole contexts (`hand_whole_contexts`)."""
    return model in _ATTENDS_ITSELF


_CACHE_ARGUMENTS = ("layer_past", "cache", "past_key_values", "past_key_value")


def _hand_masks(model: torch.nn.Module) -> None:
    """Give every layer of a model that attends on its own the batch's mask: each
    submodule called with a cache and an `attention_mask` gets `BatchCache.dense_mask`
    in place of the mask the model made (which knows nothing of the sessions). The model
    itself is called without a mask, so what it derives from the key length (BLOOM's
    ALiBi) covers the whole concatenated context."""
    def hand_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if name in kwargs), None)
        if isinstance(cache, BatchCache) and cache.dense_mask is not None and "attention_mask" in kwargs:
            kwargs["attention_mask"] = cache.dense_mask
        return args, kwargs

    for module in model.modules():
        if module is model or isinstance(module, PreTrainedModel):
            continue
        parameters = inspect.signature(module.forward).parameters
        if "attention_mask" in parameters and any(name in parameters for name in _CACHE_ARGUMENTS):
            module.register_forward_pre_hook(hand_mask, with_kwargs=True)


# Forwards that stand in for a model's own (`use_forward`; specd.worker.lean), by model. A
# registry rather than an argument: every batched forward of a model goes through
# `forward(model, ...)` (the runner's steps, the forward costs it times at load, the memory
# profile, the scripts), and each finds here the forward the model was given when it loaded.
# Weak keys: a model let go takes its entry with it.
_FORWARDS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[BatchInputs], torch.Tensor]] = \
    weakref.WeakKeyDictionary()


def use_forward(model: torch.nn.Module, forward: Callable[[BatchInputs], torch.Tensor]) -> None:
    """Run `model`'s batched forwards through `forward` (kept logits [1, Σ keep, V] from
    `BatchInputs`, as `own_forward` gives) from now on."""
    _FORWARDS[model] = forward


# Static forwards (`specd.worker.graphs`, --cuda-graphs) by model: where a forward's rows fit
# one of their buckets, it replays that bucket's graph instead of running the forward above.
_STATIC: weakref.WeakKeyDictionary[torch.nn.Module, StaticSteps] = weakref.WeakKeyDictionary()


# Models whose attention reads the pool through the paged kernel (--attention-kernel triton,
# `specd.worker.pagedkernel`): their forwards are laid out with the rows' ends, not a mask.
_PAGED_KERNEL: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def use_paged_kernel(model: torch.nn.Module, on: bool = True) -> None:
    """Read the pool through the paged kernel in `model`'s forwards from now on (on=False: gather)."""
    if on:
        _PAGED_KERNEL.add(model)
    else:
        _PAGED_KERNEL.discard(model)


def paged_kernel(model: torch.nn.Module) -> bool:
    """Whether `model`'s forwards read the pool through the paged kernel."""
    return model in _PAGED_KERNEL


def stand_in(model: torch.nn.Module) -> Callable[[BatchInputs], torch.Tensor] | None:
    """The forward `model` was given in place of its own (`use_forward`; None: its own)."""
    return _FORWARDS.get(model)


def use_static_steps(model: torch.nn.Module, steps: StaticSteps | None) -> None:
    """Run `model`'s forwards whose rows fit a bucket of `steps` through them from now on
    (None: none)."""
    if steps is None:
        _STATIC.pop(model, None)
    else:
        _STATIC[model] = steps


def static_steps(model: torch.nn.Module) -> StaticSteps | None:
    """The static steps `model`'s forwards run through (None: none)."""
    return _STATIC.get(model)


def own_forward(model: torch.nn.Module, inputs: BatchInputs) -> torch.Tensor:
    """The kept logits [1, Σ keep, V] of the model's own forward over `inputs`."""
    mask = {"attention_mask": inputs.cache.dense_mask} if _ATTENDS_ITSELF.get(model) == MODEL_MASK else {}
    return model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, cache=inputs.cache, use_cache=True,
                 logits_to_keep=inputs.logits_to_keep, batch_cache=inputs.cache, **mask).logits


@torch.inference_mode()
def forward(model: torch.nn.Module, rows: Sequence[BatchRow], device: torch.device) -> tuple[torch.Tensor, list[slice]]:
    """One batched forward of `rows` (a model set up by `attention.use_paged_attention`):
    the kept logits [Σ keep, V] in float32 on the model's device, and each row's slice of
    them."""
    logits, kept, _ = forward_attended(model, rows, device)
    return logits, kept


@torch.inference_mode()
def forward_attended(model: torch.nn.Module, rows: Sequence[BatchRow],
                     device: torch.device) -> tuple[torch.Tensor, list[slice], bool]:
    """`forward`, and whether the model's attention read through `paged_attention`."""
    caching = rows[0].session.pool.prefix_caching
    for row in rows:  # no session writes into a block another holds (a fork, a prefix hit), or the index does
        row.session.own_from(row.session.length)
    static = _STATIC.get(model)
    ran = None if static is None else static.forward(rows)
    if ran is not None:
        logits, kept, attended = ran[0], ran[1], True
    else:
        inputs = prepare(rows, device, model in _ATTENDS_ITSELF, model in _PAGED_KERNEL)
        replacement = stand_in(model)
        logits = (own_forward(model, inputs) if replacement is None else replacement(inputs))[0]
        kept, attended = inputs.kept, inputs.cache.attended
    for row in rows:  # every session now caches the tokens it fed
        row.session.length += len(row.tokens)
        if caching:
            row.session.publish()
    # The math after the forward runs where the logits are (the roles' jobs: draft_service.jobs,
    # verifier_service.jobs): only token ids, a few probabilities and the rows a sampled step
    # needs ever reach the host.
    return logits.float(), kept, attended

