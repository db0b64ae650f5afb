"""Several completions of one prompt (n > 1), for every transport.

Each completion is a request of its own through `gateway.core.GatewayCore`, seeded with
the request's seed plus its index, so the same request reproduces every one of them, and
any one can be asked for alone with its seed. Their chunks are merged as they come, each
with its index. The HTTP front end and the gRPC servicer share this.

The first completion runs alone until its first step is done; the others start then. By
that time both workers have cached the prompt's full blocks (specd.worker.kvstore's
prefix caching), so the others prefill only the prompt's last partial block, where
starting all at once would prefill the whole prompt n times in one batch. The others'
first tokens come one step later, as in an engine that forks n sequences after one
prefill.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator
from dataclasses import replace

from gateway.core import Chunk
from gateway.errors import InvalidRequest
from gateway.request import ClientRequest

# The most completions one request may ask for (OpenAI allows 128; each is a request in flight).
MAX_CHOICES = 16


def choice_requests(request: ClientRequest, n: int) -> list[ClientRequest]:
    """The request of each of n completions. Choice i is seeded with the request's seed
    plus i (a random seed when the request gives none), so the same request reproduces
    every choice, and a gRPC caller can ask for any one of them with that seed."""
    if n > MAX_CHOICES:
        raise InvalidRequest(f"n may be at most {MAX_CHOICES}, got {n}")
    if n == 1:
        return [request]
    base = request.seed if request.seed is not None else secrets.randbelow(2 ** 63)
    return [replace(request, seed=(base + i) % 2 ** 63) for i in range(n)]


async def merged(streams: list[AsyncGenerator[Chunk, None]]) -> AsyncGenerator[tuple[int, Chunk], None]:
    """The chunks of one or more generations as they come, each with its choice index.
    A failure of one is raised here; closing this closes them all (their worker sessions)."""
    if len(streams) == 1:  # the common case: no tasks, no queue
        async with contextlib.aclosing(streams[0]) as only:
            async for chunk in only:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()
    prefilled = asyncio.Event()  # the first completion's first step is done, or it ended

    async def pump(index: int, stream: AsyncGenerator[Chunk, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                if index:
                    await prefilled.wait()
                async for chunk in stream:
                    prefilled.set()
                    queue.put_nowait((index, chunk))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))
        finally:
            prefilled.set()
            queue.put_nowait((index, None))

    pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                try:
                    raise item
                finally:
                    # Its traceback holds this frame: holding it back would make a cycle that
                    # keeps the whole request alive until a full garbage collection.
                    del item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
