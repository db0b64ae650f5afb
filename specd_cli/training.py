"""Training a causal LM for a wall-clock budget: the loop `specd distill` and
scripts/make_demo_pair.py share.

Each step sets the learning rate from the elapsed time (warm-up, then cosine decay to a
tenth of the peak), asks the caller for the loss of a fresh batch, and takes one AdamW
step with the gradient norm clipped to 1. The state (elapsed seconds, steps, whatever the
caller records) is checkpointed with the model and the optimizer, atomically, so an
interrupted run resumes where it stopped and still ends its schedule exactly when the
budget runs out, however fast the machine and however often it was resumed.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

BAR_FORMAT = "{l_bar}{bar}| {n:.0f}/{total}s [{elapsed}<{remaining}{postfix}]"


def lr_scale(elapsed: float, budget: float, warmup_share: float, floor: float = 0.0) -> float:
    """The learning rate's share of its peak after `elapsed` of `budget` seconds: linear
    warm-up over `warmup_share` of the budget (never below `floor`), then cosine decay
    from 1 to 0.1."""
    warm = warmup_share * budget
    if elapsed < warm:
        return max(elapsed / warm, floor)
    frac = min((elapsed - warm) / max(budget - warm, 1e-9), 1.0)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save through a temporary file, so a run killed mid-save keeps the previous one."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
           check: Callable[[dict], None] | None = None) -> dict | None:
    """Load `model` and `opt` from the checkpoint at `path` and return its training state;
    None when there is no checkpoint. `check(state)` may refuse it (raise) first."""
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=False)
    if check is not None:
        check(saved["state"])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return saved["state"]


def train_for_budget(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, *, budget: float,
                     peak_lr: float, warmup_share: float, batch_loss: Callable[[], torch.Tensor],
                     checkpoint: Path, save_every_s: float, desc: str, warmup_floor: float = 0.0,
                     on_step: Callable[[dict, tqdm], None] | None = None,
                     on_save: Callable[[], None] | None = None, mininterval: float = 0.1) -> None:
    """Train `model` in place until `state["elapsed"]` reaches `budget` seconds.

    `state` holds at least "elapsed" and "step" and is updated in place. `batch_loss()`
    draws the next batch and returns the loss to minimise (it may record figures of its
    own in `state`). After each step `on_step(state, bar)` may report progress; the
    checkpoint ({"model", "opt", "state"}) is written every `save_every_s` seconds and at
    the end, each time followed by `on_save()`.
    """
    model.train()
    last_save = time.monotonic()
    total = int(budget)
    bar = tqdm(total=total, initial=int(state["elapsed"]), desc=desc, unit="s",
               mininterval=mininterval, bar_format=BAR_FORMAT)
    while state["elapsed"] < budget:
        t0 = time.monotonic()
        for group in opt.param_groups:
            group["lr"] = peak_lr * lr_scale(state["elapsed"], budget, warmup_share, warmup_floor)
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.monotonic() - t0
        state["elapsed"] += dt
        state["step"] += 1
        bar.update(min(dt, total - bar.n))
        if on_step is not None:
            on_step(state, bar)
        if time.monotonic() - last_save > save_every_s or state["elapsed"] >= budget:
            save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, checkpoint)
            last_save = time.monotonic()
            if on_save is not None:
                on_save()
    bar.close()
