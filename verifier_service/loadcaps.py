"""The load caps every gateway of this target has learned, kept for the next gateway.

Each gateway learns AUTO's γ cap per model pair and load level by trials
(`gateway.policy.loadcap.LoadCap`). Those trials cost goodput, and a new gateway replica (a
restart, a rollout, the autoscaler adding a pod) would pay them again. Every gateway of a
target already talks to its verifiers, so the verifier keeps the table: a gateway sends
the levels it has learned and gets back what all of them sent.

Per model pair and load level the entry with the most evidence (the trials behind its
verdicts) is kept; on a tie, the newer. Why not an average: two gateways that started from
the same shared entry each count its trials again, so a sum would count them twice, and
the entry with the most trials is the one that already includes the most others' work.
Nothing here is needed for correctness: a verifier that restarts starts an empty table.
"""
from __future__ import annotations

import math

from specd.contract import MAX_DRAFT_LENGTH
from specd.errors import InvalidArgument
from specd.v1 import worker_pb2

# Bounds on what one gateway may write: a table is a few pairs × about ten load buckets.
MAX_LEVELS = 512


def evidence(level: worker_pb2.LoadCapLevel) -> int:
    """The trials behind a level's verdicts."""
    return sum(verdict.trials for verdict in level.verdicts)


class LoadCapBoard:
    """The shared table: (model pair, load) → the level with the most evidence."""

    def __init__(self) -> None:
        self._levels: dict[tuple[str, int], worker_pb2.LoadCapLevel] = {}

    def share(self, table: worker_pb2.LoadCapTable) -> worker_pb2.LoadCapTable:
        """Merge what a gateway sent; return the whole table."""
        for level in table.levels:
            check(level)
        for level in table.levels:
            key = (level.model_pair, level.load)
            kept = self._levels.get(key)
            if kept is not None or len(self._levels) < MAX_LEVELS:
                if kept is None or evidence(level) >= evidence(kept):
                    self._levels[key] = level
        return worker_pb2.LoadCapTable(levels=[self._levels[key] for key in sorted(self._levels)])


def check(level: worker_pb2.LoadCapLevel) -> None:
    """Refuse a level no gateway would send, naming what is wrong."""
    where = f"load cap level ({level.model_pair!r}, load {level.load})"
    if not level.model_pair or level.load < 2:
        raise InvalidArgument(f"{where}: a level needs a model pair and a load of 2 sessions or more")
    if level.cap > MAX_DRAFT_LENGTH:
        raise InvalidArgument(f"{where}: cap {level.cap} is over {MAX_DRAFT_LENGTH}")
    for verdict in level.verdicts:
        if not verdict.lower < verdict.higher <= MAX_DRAFT_LENGTH or not math.isfinite(verdict.mean_log_ratio):
            raise InvalidArgument(f"{where}: a verdict needs lower < higher ≤ {MAX_DRAFT_LENGTH} and a finite mean, "
                                  f"got {verdict.lower}, {verdict.higher}, {verdict.mean_log_ratio}")
