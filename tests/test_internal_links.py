"""The links between the gateway and its workers are private: a session belongs to the
worker stream that opened it, and `specd serve`'s workers are reachable by its own user only."""
from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.v1 import worker_pb2, worker_pb2_grpc
from workerstream import WorkerSteps

PROMPT = [5, 17, 23, 42, 8, 99]


class VerifyStream:
    """One Verify stream driven a step at a time, on a connection of its own."""

    def __init__(self, port: int) -> None:
        # A local subchannel pool: this stream's connection is shared with no other channel.
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        self._steps = WorkerSteps(worker_pb2_grpc.VerifierStub(self.channel))

    def step(self, session_id: str, start: int, tokens: list[int]) -> list[int]:
        """A plain greedy step: the target's argmax after the sequence."""
        return list(self._steps.step(worker_pb2.VerifyRequest(
            delta=worker_pb2.SequenceDelta(session_id=session_id, start=start, tokens=tokens))).target_argmax)

    def close(self) -> None:
        self._steps.close()
        self.channel.close()


def decode(stream: VerifyStream, session_id: str, steps: int) -> list[int]:
    """`steps` greedy tokens after PROMPT, one step each."""
    tokens = [stream.step(session_id, 0, PROMPT)[0]]
    for _ in range(steps - 1):
        tokens += stream.step(session_id, len(PROMPT) + len(tokens) - 1, tokens[-1:])
    return tokens


def test_a_foreign_stream_cannot_touch_a_session(stack):
    """Another connection naming a live session id neither reads, crops nor ends it."""
    reference = VerifyStream(stack.verifier.port)
    expected = decode(reference, "reference", 6)
    reference.close()

    victim = VerifyStream(stack.verifier.port)
    attacker = VerifyStream(stack.verifier.port)
    try:
        got = decode(victim, "s", 3)
        # Cropping the victim's session to the prompt and refilling it: the session id
        # means nothing on another stream, so there is nothing to crop.
        with pytest.raises(grpc.RpcError) as err:
            attacker.step("s", len(PROMPT), [7])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # Re-opening the id from scratch opens the attacker's own session...
        other = VerifyStream(stack.verifier.port)
        other.step("s", 0, [9, 9, 9])
        other.close()  # ...which ends with its stream, leaving the victim's alone.
        for _ in range(3):
            got += victim.step("s", len(PROMPT) + len(got) - 1, got[-1:])
        assert got == expected
    finally:
        victim.close()
        attacker.close()
    assert stack.wait_no_sessions() == 0


# -- specd serve's workers are reachable by its gateway alone --------------------------------

def connect_as(uid: int, path: Path) -> str:
    """Connect to a Unix domain socket from a forked child running as `uid` (needs root):
    "connected", "denied", or what else went wrong."""
    child = os.fork()
    if child == 0:  # the child does nothing but this, and leaves without cleaning up
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    return {0: "connected", 13: "denied"}.get(os.waitstatus_to_exitcode(status), f"status {status}")


def tcp_listeners(pid: int) -> list[str]:
    """The TCP sockets process `pid` listens on (from /proc), as 'local address' hex strings."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def test_serve_workers_listen_on_private_sockets_only(model_dirs):
    from test_faults import Serve

    serve = Serve(model_dirs)
    try:
        ready = serve.wait_for(r"private sockets unix:(\S+), unix:(\S+)\)")
        sockets = [Path(ready.group(1)), Path(ready.group(2))]
        directory = sockets[0].parent
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and directory.stat().st_uid == os.getuid()
        for worker in ("verifier", "draft"):
            assert tcp_listeners(serve.pid(worker)) == [], f"the {worker} listens on TCP"
        for path in sockets:  # the serving user (the gateway's) reaches them
            with grpc.insecure_channel(f"unix:{path}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        if os.getuid() != 0:
            pytest.skip("switching to another user needs root; the directory's mode and owner were checked")
        for path in sockets:  # another local user (nobody) is refused at the directory; the owner is not
            assert connect_as(65534, path) == "denied"
            assert connect_as(0, path) == "connected"
    finally:
        serve.close()
