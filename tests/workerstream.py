"""A multiplexed worker stream (since worker protocol 3) driven from a test, one message at a time."""
from __future__ import annotations

import itertools
import queue

import grpc

from gateway.workers.streams import STEP_TYPES
from specd.v1 import worker_pb2_grpc
from specd.wire import status_from_pb


class StepError(grpc.RpcError):
    """A step's result carried a status: `code()` and `details()`, as an RpcError has."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def result_code(result) -> grpc.StatusCode:
    """The status of one step's result."""
    return status_from_pb(result.status)


class WorkerSteps:
    """One stream of a worker stub (`stub.Propose` or `stub.Verify`), fed from a queue so
    that a test decides when each message goes out."""

    def __init__(self, stub, timeout: float | None = None) -> None:
        self.kind = "Propose" if isinstance(stub, worker_pb2_grpc.DraftStub) else "Verify"
        self._steps_type, self._step_type = STEP_TYPES[self.kind]
        self._outbox: queue.Queue = queue.Queue()
        self.call = getattr(stub, self.kind)(iter(self._outbox.get, None), timeout=timeout)
        self._step_ids = itertools.count(1)

    def post(self, *requests, ended: tuple[str, ...] = ()) -> list[int]:
        """Send `requests` as the steps of one message (with `ended` sessions), without
        reading their results; their step ids."""
        ids = [next(self._step_ids) for _ in requests]
        self._outbox.put(self._steps_type(steps=[self._step_type(step_id=i, request=r) for i, r in zip(ids, requests)],
                                          ended_sessions=ended))
        return ids

    def send(self, *requests, ended: tuple[str, ...] = ()) -> list:
        """Send `requests` as the steps of one message (with `ended` sessions); their
        results, in the order of the requests. A stream that fails raises its RpcError."""
        ids = self.post(*requests, ended=ended)
        results: dict[int, object] = {}
        while len(results) < len(ids):
            for result in next(self.call).results:
                results[result.step_id] = result
        return [results[i] for i in ids]

    def step(self, request):
        """One step's response; StepError when its result carries a status."""
        (result,) = self.send(request)
        if result.status.code:
            raise StepError(result_code(result), result.status.message)
        return result.response

    def end(self, *session_ids: str) -> None:
        """Name sessions ended (a message with no steps, which gets no answer)."""
        self.post(ended=session_ids)

    def close(self) -> None:
        """Stop sending: the worker answers what runs, then ends the stream (and its sessions)."""
        self._outbox.put(None)
