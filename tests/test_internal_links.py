"""The links between the gateway and its workers are private: a session belongs to the
worker stream that opened it."""
from __future__ import annotations

import queue

import grpc
import pytest

from specd.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [5, 17, 23, 42, 8, 99]


class VerifyStream:
    """One Verify stream driven a step at a time, on a connection of its own."""

    def __init__(self, port: int) -> None:
        # A local subchannel pool: this stream's connection is shared with no other channel.
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        self._steps: queue.Queue = queue.Queue()
        self._answers = worker_pb2_grpc.VerifierStub(self.channel).Verify(iter(self._steps.get, None))

    def step(self, session_id: str, start: int, tokens: list[int]) -> list[int]:
        """A plain greedy step: the target's argmax after the sequence."""
        self._steps.put(worker_pb2.VerifyRequest(
            delta=worker_pb2.SequenceDelta(session_id=session_id, start=start, tokens=tokens)))
        return list(next(self._answers).target_argmax)

    def close(self) -> None:
        self._steps.put(None)
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
