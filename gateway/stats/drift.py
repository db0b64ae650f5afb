"""Acceptance drift: has a segment's recent acceptance dropped below its reference?

A segment is (model pair, task type, user segment). Its reference is either its own
acceptance outside the sliding window (lifetime minus window, so the two samples are
independent) or a pinned baseline per (model pair, task type), written by `specd doctor
--write-baseline` and loaded with the gateway's `--acceptance-baseline FILE`.

Acceptance here is the conditional acceptance α = accepted / draft positions reached (a
position after a rejection is never judged, so it is not counted), what the model cards
and the geometric model mean. Unlike accepted / proposed it does not move when the policy
changes γ: a longer draft lowers accepted / proposed at the same α, and γ follows the load
(`gateway.policy.loadcap.LoadCap`), so counting proposals raised drift flags when traffic fell.

A flag needs both a drop of at least `min_drop` (acceptance points, 0..1) and
significance: a one-sided two-proportion z-test (one-sample against a pinned baseline)
with z ≥ `min_z`. Draft tokens inside one step are not independent — a draft tends to get
a run right or miss at once — so the test counts drafts (steps), not tokens, as its
samples: fewer samples, a wider band, fewer false alarms on noise. No gRPC here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from specd.flags import setting


@dataclass(frozen=True)
class DriftSettings:
    """When a drop counts as drift."""

    min_drop: float = setting(0.10, flag="--drift-min-drop", metavar="POINTS",
                              help="acceptance drop (0..1) of the sliding window below its reference that "
                                   "raises the drift flag when significant")
    min_z: float = 3.0  # one-sided z of the drop
    min_drafts: int = 100  # steps with a draft in the window before it may be judged

    def problems(self) -> list[str]:
        found = []
        if not 0.0 < self.min_drop < 1.0:
            found.append(f"drift min drop must be in (0, 1) acceptance points, got {self.min_drop}")
        if self.min_z <= 0:
            found.append(f"drift min z must be > 0, got {self.min_z}")
        if self.min_drafts < 1:
            found.append(f"drift min drafts must be >= 1, got {self.min_drafts}")
        return found


@dataclass(frozen=True)
class Sample:
    """Acceptance counts of one side of the comparison."""

    drafts: int  # steps with a draft
    reached: int  # draft positions reached with every earlier one accepted
    accepted_tokens: int

    @property
    def alpha(self) -> float:
        """Conditional acceptance α: accepted ÷ draft positions reached."""
        return self.accepted_tokens / self.reached if self.reached else 0.0


@dataclass(frozen=True)
class Drift:
    """The verdict on one segment."""

    window_alpha: float
    reference_alpha: float
    reference: str  # "lifetime" or "baseline"
    drop: float  # reference − window, acceptance points (negative: it rose)
    z: float
    flagged: bool


def judge(window: Sample, reference: Sample | float, settings: DriftSettings) -> Drift | None:
    """Compare a window with its reference (counts, or a pinned rate); None until judgeable.

    None while the window has fewer than `min_drafts` drafts or a counted reference has
    none: no verdict, rather than a verdict on noise.
    """
    if window.drafts < settings.min_drafts or window.reached == 0:
        return None
    if isinstance(reference, Sample):
        if reference.drafts < settings.min_drafts or reference.reached == 0:
            return None
        p_ref, kind = reference.alpha, "lifetime"
        pooled = ((window.accepted_tokens + reference.accepted_tokens)
                  / (window.reached + reference.reached))
        variance = pooled * (1 - pooled) * (1 / window.drafts + 1 / reference.drafts)
    else:
        p_ref, kind = float(reference), "baseline"
        variance = p_ref * (1 - p_ref) / window.drafts
    drop = p_ref - window.alpha
    # A reference of exactly 0 or 1 has no spread: any drop of min_drop is then significant.
    z = drop / math.sqrt(variance) if variance > 0 else (math.inf if drop > 0 else 0.0)
    return Drift(window.alpha, p_ref, kind, drop, z, drop >= settings.min_drop and z >= settings.min_z)


def load_baseline(path: Path) -> dict[tuple[str, str], float]:
    """Read a baseline file: {"baselines": [{"model_pair", "task_type", "alpha"}, ...]}
    (α: conditional acceptance).

    Raises ValueError naming what is wrong, so the gateway refuses to start on a bad file.
    """
    expected = ('expected {"baselines": [{"model_pair": ..., "task_type": ..., "alpha": ...}]} '
                "as `specd doctor --write-baseline` writes it")
    try:
        entries = json.loads(Path(path).read_text())["baselines"]
        # Files from before α pinned accepted / proposed, which is not comparable with it.
        older = any(isinstance(e, dict) and "alpha" not in e and "acceptance_rate" in e for e in entries)
        table = {} if older else {(str(e["model_pair"]), str(e["task_type"])): float(e["alpha"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"acceptance baseline {path}: {exc!r}; {expected}") from exc
    if older:
        raise ValueError(f'acceptance baseline {path} pins accepted/proposed ("acceptance_rate"), which moves '
                         f"with γ; write it again with `specd doctor --write-baseline`")
    bad = {key: rate for key, rate in table.items() if not 0.0 <= rate <= 1.0}
    if bad:
        raise ValueError(f"acceptance baseline {path}: α must be in [0, 1], got {bad}")
    return table


