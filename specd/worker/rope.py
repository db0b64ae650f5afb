"""Rotary scalings that make a token's rotation depend on the forward it is in.

Most rotary embeddings rotate a token by its position alone, so a session's logits do not
depend on what shares its batched forward. Two of transformers' scalings do not:
- "longrope" (Phi-3 and Phi-3.5 with long contexts, Phi-4-mini) picks long or short
  frequencies for a whole forward from the forward's last position: once any row of a
  forward reaches past the model's original context, every row rotates with the long
  ones. A worker therefore batches only rows on the same side of that length (`regime`,
  `specd.worker.batching`), and each session's logits are those of its rows alone.
- "dynamic" (NTK scaling) recomputes its frequencies from the longest sequence the rotary
  module has seen since it last fell back below the original context: a state shared by
  every session of the worker, so a session's logits would depend on the others' history.
  A worker refuses such a model at load (`problem`).

Past the original context, longrope also makes a session's logits depend on how its own
tokens are cut into forwards (a prefill in chunks, γ + 1 tokens verified at once), as
transformers' own `generate` and its assisted generation differ from each other there;
docs/models.md says so.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from torch import nn


def _scalings(model: nn.Module) -> list[tuple[str, int | None]]:
    """Each rotary scaling of the model's rotary modules (one per layer kind where they
    differ), with the original context a longrope scaling switches at (None otherwise)."""
    found: list[tuple[str, int | None]] = []
    for module in model.modules():
        kinds: Any = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "config"):
            continue
        config: Any = module.config  # transformers' config, untyped here
        parameters: dict[str, Any] = config.rope_parameters or {}
        by_layer = kinds.items() if isinstance(kinds, dict) else [(None, kinds)]
        for layer_type, kind in by_layer:
            own = parameters if layer_type is None else parameters.get(layer_type, {})
            found.append((kind, own.get("original_max_position_embeddings") if kind == "longrope" else None))
    return found


def problem(model: nn.Module) -> str | None:
    """Why a worker cannot serve `model` with one session's logits independent of the
    others' (None: it can)."""
    if any("dynamic" in kind for kind, _ in _scalings(model)):
        return ("its rotary scaling is 'dynamic', whose frequencies follow the longest sequence the model has seen, "
                "so one session's output would depend on other sessions; serve it with a static scaling ('linear', "
                "'yarn' or 'llama3' in its config's rope_parameters)")
    return None


def regime(model: nn.Module) -> Callable[[int], Hashable] | None:
    """What rows may share a forward: rows whose sessions hold `end` positions after it
    must give the same key (None: any rows may)."""
    switches = sorted({switch for kind, switch in _scalings(model) if kind == "longrope" and switch is not None})
    if not switches:
        return None
    return lambda end: tuple(end > switch for switch in switches)
