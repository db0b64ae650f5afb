"""Acceptance drift: has a segment's recent acceptance dropped below its reference?

A segment is (model pair, task type, user segment). Its reference is either its own
acceptance outside the sliding window (lifetime minus window, so the two samples are
independent) or a pinned baseline per (model pair, task type), written by `specd doctor
--write-baseline` and loaded with the gateway's `--acceptance-baseline FILE`.

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


@dataclass(frozen=True)
class DriftSettings:
    """When a drop counts as drift."""

    min_drop: float = 0.10  # acceptance points (0..1) below the reference
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

    drafts: int
    draft_tokens: int
    accepted_tokens: int

    @property
    def rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class Drift:
    """The verdict on one segment."""

    window_rate: float
    reference_rate: float
    reference: str  # "lifetime" or "baseline"
    drop: float  # reference − window, acceptance points (negative: it rose)
    z: float
    flagged: bool


def judge(window: Sample, reference: Sample | float, settings: DriftSettings) -> Drift | None:
    """Compare a window with its reference (counts, or a pinned rate); None until judgeable.

    None while the window has fewer than `min_drafts` drafts or a counted reference has
    none: no verdict, rather than a verdict on noise.
    """
    if window.drafts < settings.min_drafts or window.draft_tokens == 0:
        return None
    if isinstance(reference, Sample):
        if reference.drafts < settings.min_drafts or reference.draft_tokens == 0:
            return None
        p_ref, kind = reference.rate, "lifetime"
        pooled = ((window.accepted_tokens + reference.accepted_tokens)
                  / (window.draft_tokens + reference.draft_tokens))
        variance = pooled * (1 - pooled) * (1 / window.drafts + 1 / reference.drafts)
    else:
        p_ref, kind = float(reference), "baseline"
        variance = p_ref * (1 - p_ref) / window.drafts
    drop = p_ref - window.rate
    # A reference of exactly 0 or 1 has no spread: any drop of min_drop is then significant.
    z = drop / math.sqrt(variance) if variance > 0 else (math.inf if drop > 0 else 0.0)
    return Drift(window.rate, p_ref, kind, drop, z, drop >= settings.min_drop and z >= settings.min_z)


def load_baseline(path: Path) -> dict[tuple[str, str], float]:
    """Read a baseline file: {"baselines": [{"model_pair", "task_type", "acceptance_rate"}, ...]}.

    Raises ValueError naming what is wrong, so the gateway refuses to start on a bad file.
    """
    try:
        entries = json.loads(Path(path).read_text())["baselines"]
        table = {(str(e["model_pair"]), str(e["task_type"])): float(e["acceptance_rate"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"acceptance baseline {path}: {exc!r}; expected "
                         f'{{"baselines": [{{"model_pair": ..., "task_type": ..., "acceptance_rate": ...}}]}} '
                         f"as `specd doctor --write-baseline` writes it") from exc
    bad = {key: rate for key, rate in table.items() if not 0.0 <= rate <= 1.0}
    if bad:
        raise ValueError(f"acceptance baseline {path}: rates must be in [0, 1], got {bad}")
    return table


def baseline_document(rows: list[tuple[str, str, float, int]]) -> dict:
    """The JSON document of a baseline file from (model pair, task type, rate, draft tokens)."""
    return {"baselines": [{"model_pair": pair, "task_type": task, "acceptance_rate": round(rate, 4),
                           "draft_tokens": tokens} for pair, task, rate, tokens in rows]}
