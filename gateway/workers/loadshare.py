"""Load caps shared between the gateways of one target, through its verifiers.

A gateway's load cap (`gateway.policy.loadcap.LoadCap`) learns by trials, and trials cost goodput.
Every few seconds each gateway sends the levels its trials moved beyond the prior to every
verifier endpoint (`Verifier.ShareLoadCaps`) and takes back the table all gateways sent
(`verifier_service.loadcaps`): a new replica starts, from its first request under load,
where the older ones have got to. A verifier that does not answer (one older than this
RPC, or restarting) only means no sharing this round.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.policy.loadcap import SharedLevel
from gateway.policy.shared import PolicyTables
from gateway.workers.backend import WorkerPool
from specd.v1 import worker_pb2

log = logging.getLogger(__name__)

SHARE_TIMEOUT_S = 2.0


def to_table(learned: dict[str, dict[int, SharedLevel]]) -> worker_pb2.LoadCapTable:
    """model pair → load → level, as the verifier keeps it."""
    return worker_pb2.LoadCapTable(levels=[
        worker_pb2.LoadCapLevel(model_pair=pair, load=load, cap=level.cap, verdicts=[
            worker_pb2.LoadCapVerdict(lower=low, higher=high, mean_log_ratio=mean, trials=trials)
            for (low, high), (mean, trials) in sorted(level.verdicts.items())])
        for pair, levels in sorted(learned.items()) for load, level in sorted(levels.items())])


def from_tables(tables: list[worker_pb2.LoadCapTable]) -> dict[str, dict[int, SharedLevel]]:
    """Several verifiers' tables as one: per pair and load, the level with the most evidence."""
    merged: dict[str, dict[int, SharedLevel]] = {}
    for table in tables:
        for level in table.levels:
            shared = SharedLevel(level.cap, {(v.lower, v.higher): (v.mean_log_ratio, v.trials)
                                             for v in level.verdicts})
            levels = merged.setdefault(level.model_pair, {})
            kept = levels.get(level.load)
            if kept is None or shared.evidence() > kept.evidence():
                levels[level.load] = shared
    return merged


async def share_once(policies: PolicyTables, pool: WorkerPool) -> None:
    """Send this gateway's learned levels to every ready verifier of `pool` at once (a slow
    one delays the round by `SHARE_TIMEOUT_S` at most); adopt what they keep."""
    sent = to_table(policies.learned_caps())

    async def share(address: str) -> worker_pb2.LoadCapTable | None:
        try:
            return await pool.stub(address).ShareLoadCaps(sent, timeout=SHARE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            # UNIMPLEMENTED: a verifier older than this RPC. Anything else: it is restarting
            # or busy; the next round tries again. Either way sharing only saves time.
            log.debug("no load caps shared with %s: %s", address, exc.code().name)
            return None

    answers = await asyncio.gather(*(share(e.address) for e in pool.router.snapshot() if e.ready))
    tables = [table for table in answers if table is not None]
    if tables:
        policies.adopt_caps(from_tables(tables))


async def keep_sharing(policies: PolicyTables, pool: WorkerPool, interval_s: float) -> None:
    """Share every `interval_s` seconds while the gateway runs (cancelled at stop)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await share_once(policies, pool)
        except Exception:  # noqa: BLE001 - sharing is a hint; a failed round must not end the loop
            log.warning("sharing the load caps failed this round", exc_info=True)
