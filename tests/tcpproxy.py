"""A TCP proxy for fault tests: put it between the gateway and a worker, then stall or cut.

`pause()` stops forwarding in both directions (a partition: nothing arrives, nothing
fails); `resume()` lets it flow again; `cut()` closes every proxied connection at once
(new connections are still accepted, as after a network blip). `latency_s` holds back
every reply that long (a worker in another zone).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable


class TcpProxy:
    """Forwards 127.0.0.1:port to a target port, on the caller's event loop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0  # accepted so far
        self.latency_s = 0.0  # added before each chunk forwarded from the target back
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, upstream_writer}
        await asyncio.gather(self._pump(client_reader, upstream_writer),
                             self._pump(upstream_reader, client_writer, reply=True), return_exceptions=True)
        for writer in (client_writer, upstream_writer):
            self._writers.discard(writer)
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bool = False) -> None:
        try:
            while data := await reader.read(65536):
                if reply and self.latency_s:
                    await asyncio.sleep(self.latency_s)
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def pause(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Close every proxied socket now (both sides see the connection drop)."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def proxy_front(role: str) -> tuple[Callable, dict[str, TcpProxy]]:
    """A `start_stack` front that puts a TcpProxy before the `role` worker ("draft" or
    "verifier"); the dict gets the proxy once the stack starts."""
    proxies: dict[str, TcpProxy] = {}

    def front(loop, worker: str, port: int) -> int:
        if worker != role:
            return port
        proxies[worker] = loop.run(TcpProxy(port).start())
        return proxies[worker].port

    return front, proxies
