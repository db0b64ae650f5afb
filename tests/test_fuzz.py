"""Fuzzing the public API and the worker protocol (hypothesis, derandomized and bounded).

Every case must end in a status a client can act on: never UNKNOWN or INTERNAL (a bug),
never UNAVAILABLE or a hang (a crash). The services keep serving, and once the streams
end the workers hold no session: each test checks both after its cases, in the same test,
and fails if no case ran. The module prints how many cases ran, of each kind.
"""
from __future__ import annotations

import struct

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import request, start_stack
from specd.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc
from workerstream import WorkerSteps, result_code

# Derandomized: the same cases every run, so a failure reproduces; bounded in count.
FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
          grpc.StatusCode.DEADLINE_EXCEEDED}
VOCAB = 320  # the tiny models' vocabulary (tests/conftest.py)
CALL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def fuzzed(model_dirs):
    """Its own stack, with generations kept short so valid random requests stay cheap."""
    stack = start_stack(model_dirs, default_max_new_tokens=6, max_new_tokens_cap=32)
    stack.cases, stack.codes = {}, {}
    yield stack
    print(f"\nfuzz cases run: {stack.cases} (total {sum(stack.cases.values())}); statuses: {stack.codes}")
    stack.close()


def still_serving(stack) -> None:
    assert len(stack.stub.Generate(request("def fibonacci(n):", max_new_tokens=4)).token_ids) == 4


def fuzz_then_check(stack, name: str, cases) -> None:
    """Run `cases` (a hypothesis test of no arguments, which counts each case under `name`),
    then check in the same test that they ran and left the services serving with no session
    held: a check that runs after no case proves nothing, so it fails instead."""
    before = stack.cases.get(name, 0)
    cases()
    assert stack.cases.get(name, 0) > before, f"no {name!r} case ran"
    still_serving(stack)
    assert stack.wait_no_sessions() == 0


def count(stack, name: str, *codes: grpc.StatusCode) -> None:
    """Count a case, and the status codes it ended with."""
    stack.cases[name] = stack.cases.get(name, 0) + 1
    for code in codes:
        stack.codes[code.name] = stack.codes.get(code.name, 0) + 1


def outcome(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() not in BROKEN, (exc.code(), exc.details())
        assert len(exc.details() or "") < 2000  # an echoed value never swells a status
        return exc.code()
    return grpc.StatusCode.OK


# -- the public API -------------------------------------------------------------------------

def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` five times in six, `wild` otherwise: most cases get deep, many break one field."""
    return st.integers(0, 5).flatmap(lambda n: wild if n == 0 else valid)


# Any float32, and the ones that break arithmetic: the smallest subnormal (1.4e-45 as a
# temperature overflowed logits to inf), -0, NaN, the infinities, the largest finite.
nasty_floats = st.sampled_from([1.4e-45, 1e-38, 1e-7, -0.0, -1.0, float("nan"), float("inf"), float("-inf"),
                                3.4e38])
floats32 = st.one_of(nasty_floats, nasty_floats, st.floats(width=32, allow_nan=True, allow_infinity=True))
int32 = st.integers(-2 ** 31, 2 ** 31 - 1)
uint32 = st.integers(0, 2 ** 32 - 1)
names = st.one_of(st.sampled_from(["", "close", "unrelated", "padded", "fixed", "ema", "cost", "confidence"]),
                  st.text(max_size=100))

requests = st.builds(
    gateway_pb2.GenerateRequest,
    prompt=mostly(st.sampled_from(["def fibonacci(n):", "class Cache:", "é ü 字 🙂"]), st.text(max_size=80)),
    sampling=st.builds(
        gateway_pb2.SamplingParams,
        temperature=mostly(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.5]), floats32),
        top_k=mostly(st.integers(0, 50), int32), top_p=mostly(st.sampled_from([0.0, 0.5, 0.9, 1.0]), floats32),
        seed=st.integers(0, 2 ** 64 - 1), max_new_tokens=mostly(st.integers(0, 12), uint32),
        stop=mostly(st.lists(st.sampled_from(["\n", "def", ":", "a"]), max_size=2),
                    st.lists(st.text(max_size=8), max_size=20))),
    speculation=st.builds(
        gateway_pb2.SpeculationParams, mode=mostly(st.integers(0, 2), st.integers(-3, 9)),
        draft_length=mostly(st.integers(0, 8), uint32), min_draft_length=mostly(st.integers(0, 3), uint32),
        max_draft_length=mostly(st.integers(0, 8), uint32),
        draft_model=mostly(st.sampled_from(["", "close", "unrelated", "padded"]), names),
        policy=mostly(st.sampled_from(["", "fixed"]), names),
        min_draft_confidence=mostly(st.sampled_from([0.0, 0.3]), floats32)),
    task_type=mostly(st.sampled_from(["", "code", "chat"]), st.text(max_size=80)),
    user_segment=mostly(st.sampled_from(["", "free", "pro"]), st.text(max_size=80)))


# Each test runs its cases, then checks that they ran and that the gateway still serves
# (`fuzz_then_check`): run alone, or after no case, it cannot pass without having fuzzed.

def test_random_field_values(fuzzed):
    @settings(FUZZ, max_examples=300)
    @given(req=requests, streamed=st.booleans())
    def cases(req, streamed):
        call = (lambda: list(fuzzed.stub.GenerateStream(req, timeout=CALL_TIMEOUT_S))) if streamed else \
            (lambda: fuzzed.stub.Generate(req, timeout=CALL_TIMEOUT_S))
        code = outcome(call)
        assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
        count(fuzzed, "public: field values", code)

    fuzz_then_check(fuzzed, "public: field values", cases)


def test_random_bytes_as_a_request(fuzzed):
    @settings(FUZZ, max_examples=200)
    @given(body=st.one_of(st.binary(max_size=300),
                          # a valid request with bytes spliced in: field tags that parse, values that do not
                          st.tuples(st.binary(max_size=8), st.binary(max_size=40)).map(
                              lambda p: b"\x0a" + bytes([len(p[1])]) + p[1] + p[0])),
           method=st.sampled_from(["Generate", "GenerateStream", "GetAcceptanceStats"]))
    def cases(body, method):
        if method == "GenerateStream":
            raw = fuzzed.channel.unary_stream(f"/specd.v1.Gateway/{method}")
            call = lambda: list(raw(body, timeout=CALL_TIMEOUT_S))  # noqa: E731
        else:
            raw = fuzzed.channel.unary_unary(f"/specd.v1.Gateway/{method}")
            call = lambda: raw(body, timeout=CALL_TIMEOUT_S)  # noqa: E731
        code = outcome(call)
        assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
        count(fuzzed, "public: random bytes", code)

    fuzz_then_check(fuzzed, "public: random bytes", cases)


def test_huge_repeated_fields(fuzzed):
    @settings(FUZZ, max_examples=12)
    @given(entries=st.integers(0, 400_000), size=st.integers(0, 40))
    def cases(entries, size):
        req = request("def f():", max_new_tokens=2, stop=["s" * size] * entries)
        code = outcome(lambda: fuzzed.stub.Generate(req, timeout=CALL_TIMEOUT_S))
        if req.ByteSize() > 1024 * 1024:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the gateway's 1 MiB receive limit
        elif entries > 16 or size > 256:
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        else:
            assert code == grpc.StatusCode.OK
        count(fuzzed, "public: huge repeated fields", code)

    fuzz_then_check(fuzzed, "public: huge repeated fields", cases)


# -- the worker protocol --------------------------------------------------------------------

class Stream:
    """One multiplexed worker stream whose messages are sent when the test says."""

    def __init__(self, stub) -> None:
        self.steps = WorkerSteps(stub, timeout=CALL_TIMEOUT_S)
        self.codes: list[grpc.StatusCode] = []  # each step's status, then the stream's if it failed
        self.ended = False

    def send(self, messages: list, ended: list[str]) -> None:
        """Send one message of steps (and sessions named ended); read their results (or the stream's end)."""
        if self.ended:
            return
        try:
            for result in self.steps.send(*messages, ended=tuple(ended)):
                self.codes.append(result_code(result))
                assert len(result.status.message) < 2000  # an echoed value never swells a status
        except grpc.RpcError as exc:
            self.codes.append(exc.code())
            self.ended = True
        except StopIteration:
            self.codes.append(grpc.StatusCode.UNKNOWN)  # ended without a status: never acceptable
            self.ended = True

    def finish(self, drop: bool) -> None:
        """End the stream: drop it (cancel, as a gateway that goes away) or close it cleanly."""
        if drop:
            self.steps.call.cancel()
            return
        self.steps.close()
        if not self.ended:
            try:
                for _ in self.steps.call:
                    pass
            except grpc.RpcError as exc:
                self.codes.append(exc.code())


token_ids = mostly(st.integers(0, VOCAB - 1), int32)
deltas = st.builds(worker_pb2.SequenceDelta,
                   session_id=mostly(st.sampled_from(["s1", "s2"]), st.text(max_size=300)),
                   start=mostly(st.sampled_from([0, 0, 0, 1, 2, 3, 5, 8]), uint32),
                   tokens=st.lists(token_ids, max_size=10))
transforms = st.builds(worker_pb2.Transform, temperature=mostly(st.sampled_from([0.0, 1.0]), floats32),
                       top_k=mostly(st.integers(0, 20), int32), top_p=mostly(st.sampled_from([0.0, 0.9]), floats32))

def _row(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


# p's row after a rejection: mostly one plausible row of the vocabulary, else anything.
target_rows = st.one_of(
    st.integers(1, VOCAB + 64).map(lambda n: worker_pb2.Distributions(positions=1, vocab_size=n,
                                                                      probs=_row([1.0 / n] * n))),
    st.builds(worker_pb2.Distributions, positions=mostly(st.just(1), uint32), vocab_size=mostly(st.just(4), uint32),
              probs=st.one_of(st.lists(floats32, min_size=4, max_size=4).map(_row), st.binary(max_size=40)),
              token_ids=st.one_of(st.just(b""), st.binary(max_size=8))))
recoveries = st.one_of(st.none(), st.builds(worker_pb2.Recovery, target_row=target_rows,
                                            uniform=mostly(st.sampled_from([0.0, 0.5, 0.999]), nasty_floats)))
proposals = st.builds(worker_pb2.ProposeRequest, delta=deltas, draft_length=mostly(st.integers(0, 6), uint32),
                      transform=transforms, seed=st.integers(0, 2 ** 64 - 1),
                      draft_model=mostly(st.sampled_from(["", "close", "padded"]), st.text(max_size=100)),
                      min_confidence=mostly(st.just(0.0), floats32),
                      vocab_limit=mostly(st.sampled_from([0, VOCAB]), uint32), recovery=recoveries)
verifications = st.builds(worker_pb2.VerifyRequest, delta=deltas, draft_tokens=st.lists(token_ids, max_size=8),
                          transform=transforms)


def run_streams(stub, plan, drops) -> list[Stream]:
    """Open one stream per entry of drops, send plan's (stream, steps, ended sessions)
    messages in order, end them."""
    streams = [Stream(stub) for _ in drops]
    for index, messages, ended in plan:
        streams[index % len(streams)].send(messages, ended)
    for stream, drop in zip(streams, drops):
        stream.finish(drop)
    return streams


@pytest.mark.parametrize("worker", ["draft", "verifier"])
def test_worker_protocol(fuzzed, worker):
    channel = grpc.insecure_channel(f"127.0.0.1:{getattr(fuzzed, worker).port}")
    stub = worker_pb2_grpc.DraftStub(channel) if worker == "draft" else worker_pb2_grpc.VerifierStub(channel)
    messages = proposals if worker == "draft" else verifications

    # Up to three streams at once on sessions "s1"/"s2": a second stream for a live
    # session, two steps of one session in one message, steps out of order, sessions
    # named ended, and streams dropped (cancelled) mid-way.
    @settings(FUZZ, max_examples=250)
    @given(plan=st.lists(st.tuples(st.integers(0, 2), st.lists(messages, min_size=1, max_size=3),
                                   st.lists(st.sampled_from(["s1", "s2"]), max_size=2)), min_size=1, max_size=6),
           drops=st.lists(st.booleans(), min_size=1, max_size=3))
    def fuzz(plan, drops):
        streams = run_streams(stub, plan, drops)
        codes = [code for s in streams for code in s.codes]
        for code in codes:
            assert code not in BROKEN, code
        assert fuzzed.wait_no_sessions() == 0
        count(fuzzed, f"{worker} protocol", *codes)

    try:
        fuzz_then_check(fuzzed, f"{worker} protocol", fuzz)
    finally:
        channel.close()


def test_worker_streams_dropped_mid_step_leak_nothing(fuzzed):
    """A gateway that goes away while a step runs, or names its session ended: the worker
    forgets the session."""
    channel = grpc.insecure_channel(f"127.0.0.1:{fuzzed.verifier.port}")
    try:
        stub = worker_pb2_grpc.VerifierStub(channel)
        kept = WorkerSteps(stub, timeout=CALL_TIMEOUT_S)
        for n in range(20):
            opening = worker_pb2.VerifyRequest(delta=worker_pb2.SequenceDelta(
                session_id=f"drop-{n}", start=0, tokens=list(range(1, 120))), draft_tokens=[5] * 8)
            dropped = WorkerSteps(stub, timeout=CALL_TIMEOUT_S)
            dropped.post(opening)
            dropped.call.cancel()  # before the answer: the forward may be running
            # The same on a stream that lives on: the session is named ended mid-step...
            kept.post(opening)
            kept.end(f"drop-{n}")
            # ...or in the very message that carries its step.
            kept.post(worker_pb2.VerifyRequest(delta=worker_pb2.SequenceDelta(
                session_id=f"late-{n}", start=0, tokens=list(range(1, 120)))), ended=(f"late-{n}",))
        assert fuzzed.wait_no_sessions() == 0
        kept.close()
    finally:
        channel.close()
    still_serving(fuzzed)


def test_a_stream_ends_when_its_last_step_expires(fuzzed):
    """A client that stopped sending while a step runs, whose deadline then passes: the
    step is answered, its session forgotten, and the stream ends."""
    channel = grpc.insecure_channel(f"127.0.0.1:{fuzzed.verifier.port}")
    try:
        steps = WorkerSteps(worker_pb2_grpc.VerifierStub(channel), timeout=CALL_TIMEOUT_S)
        steps.post(worker_pb2.VerifyRequest(delta=worker_pb2.SequenceDelta(
            session_id="expiring", start=0, tokens=list(range(1, 200)), expires_in_ms=1)))
        steps.close()
        (result,) = [result for message in steps.call for result in message.results]
        assert result.step_id == 1  # answered: by its response, or CANCELLED if it expired first
        assert fuzzed.wait_no_sessions() == 0
    finally:
        channel.close()
