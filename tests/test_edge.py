"""The public edge: API keys, small limits, deadlines, and errors that fit in a status."""
from __future__ import annotations

import collections
import hashlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import request, start_stack
from gateway.edge.auth import KeyFileError, KeyRing
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from tcpproxy import proxy_front

KEYS = {"alpha": "alpha-key-0123456789", "beta": "beta-key-9876543210"}
# A request held in flight by pausing a worker's proxy after its first chunk: long enough
# that it is still decoding when the pause comes (at 60 tokens a fast run could finish first).
HELD_TOKENS = 200


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def key_file(tmp_path, protect: bool = False):
    hashed = hashlib.sha256(KEYS["beta"].encode()).hexdigest()
    path = tmp_path / "keys.txt"
    path.write_text(f"# tenants\n\nalpha {KEYS['alpha']}\nbeta sha256:{hashed}\n")
    return path


# -- the key file ---------------------------------------------------------------------------

def test_key_file_lines_clear_and_hashed(tmp_path):
    ring = KeyRing.load(key_file(tmp_path))
    assert ring.find(KEYS["alpha"]).segment == "alpha"
    assert ring.find(KEYS["beta"]).segment == "beta"  # listed only as its sha256
    assert ring.find("alpha-key-012345678") is None and ring.find("") is None


@pytest.mark.parametrize("text, message", [
    ("alpha key1\nbeta\n", "line 2: expected 'SEGMENT KEY' or 'SEGMENT sha256:HEX' (two fields), found 1"),
    ("alpha key1 extra-secret\n", "line 1: expected"),
    ("alpha sha256:abc\n", "line 1: a hashed key is 'sha256:' and 64 hex digits"),
    ("# c\nal/pha key1\n", "line 2: segment must be"),
    ("alpha key1\nbeta key1\n", "line 2: the same key is already listed on line 1"),
    ("# nothing\n\n", "no keys in it"),
])
def test_malformed_key_file_names_the_line_not_the_key(text, message):
    with pytest.raises(KeyFileError) as err:
        KeyRing.parse(text, "keys.txt")
    assert message in str(err.value)
    assert "key1" not in str(err.value) and "extra-secret" not in str(err.value)


def test_gateway_refuses_to_start_with_a_malformed_key_file(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "keys.txt"
    bad.write_text("alpha k1\noops\n")
    result = subprocess.run([sys.executable, "-m", "specd_cli", "gateway", "--api-keys", str(bad), "--port", "0",
                             "--verifier-address", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "line 2" in result.stderr and "k1" not in result.stderr


# -- keys on a running gateway --------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(model_dirs, tmp_path_factory):
    """A gateway with keys, one request in flight per key, and a proxy before its verifier."""
    front, proxies = proxy_front("verifier")

    stack = start_stack(model_dirs, front=front, api_keys_file=key_file(tmp_path_factory.mktemp("keys")),
                        key_max_in_flight=1)
    stack.verifier_proxy = proxies["verifier"]
    yield stack
    stack.loop.run(stack.verifier_proxy.close())
    stack.close()


@pytest.mark.parametrize("metadata, says", [
    ([], "an API key is required"),
    (bearer("not-a-key"), "not valid"),
    ([("authorization", KEYS["alpha"])], "an API key is required"),  # no "Bearer"
    (bearer(KEYS["alpha"]) + bearer(KEYS["beta"]), "send exactly one"),  # which one decides? neither
])
def test_missing_or_wrong_key_is_unauthenticated(keyed, metadata, says):
    for call in (keyed.stub.Generate, lambda r, metadata: list(keyed.stub.GenerateStream(r, metadata=metadata)),
                 lambda r, metadata: keyed.stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest(),
                                                                   metadata=metadata)):
        with pytest.raises(grpc.RpcError) as err:
            call(request("def f():", max_new_tokens=2), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and says in err.value.details()
        assert "not-a-key" not in err.value.details()


def test_unauthenticated_bad_body_is_still_unauthenticated(keyed):
    raw = keyed.channel.unary_unary("/specd.v1.Gateway/Generate")
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\x0a\x02\xff\xfe")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open(keyed):
    health = health_pb2_grpc.HealthStub(keyed.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(keyed.channel)
    replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "specd.v1.Gateway" in {s.name for s in replies[0].list_services_response.service}


def test_the_load_bench_sends_the_key_on_every_stream(keyed, monkeypatch):
    """`specd bench --concurrency` with --api-key-env: its clients (grpc.aio streams, one
    event loop) send the key with every request; without it every stream is refused."""
    from specd.tls import ClientTLS
    from specd_cli import loadbench
    from specd_cli.clientauth import api_key_metadata

    monkeypatch.setenv("SPECD_TEST_BENCH_KEY", KEYS["alpha"])
    requests = [request("def f():", max_new_tokens=3) for _ in range(2)]
    sent = loadbench.run_level(keyed.gateway_address, ClientTLS(), api_key_metadata("SPECD_TEST_BENCH_KEY"),
                               requests, "target-only", 1)
    assert (sent.failures, sent.tokens, len(sent.latencies)) == (0, 6, 2)
    bare = loadbench.run_level(keyed.gateway_address, ClientTLS(), (), requests, "target-only", 1)
    assert (bare.failures, bare.tokens) == (2, 0)


def test_the_key_decides_the_segment(keyed):
    claimed = request("def fibonacci(n):", max_new_tokens=4)
    claimed.user_segment = "beta"  # alpha's key, claiming to be beta
    assert len(keyed.stub.Generate(claimed, metadata=bearer(KEYS["alpha"])).token_ids) == 4
    stats = keyed.stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest(group_by=["user_segment"]),
                                          metadata=bearer(KEYS["beta"]))
    assert [dict(row.labels) for row in stats.rows] == []  # beta sees only its own rows: none yet
    segments = {labels["user_segment"] for labels, _ in keyed.gateway.servicer.core.stats.query(["user_segment"], {})}
    assert segments == {"alpha"}


def test_tenants_see_model_names_not_host_paths(keyed, stack):
    info = keyed.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest(), metadata=bearer(KEYS["alpha"]))
    assert info.target.name == "target" and info.target.weights_digest
    assert [m.model_path for m in (info.target, *info.drafts)] == [""] * (1 + len(info.drafts))
    # A gateway without keys is its operator's own: the paths tell `specd doctor` what to distill.
    assert stack.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest()).target.model_path.endswith("target")


def test_per_key_in_flight_quota(keyed):
    held = keyed.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=HELD_TOKENS),
                                     metadata=bearer(KEYS["alpha"]))
    next(held)
    keyed.verifier_proxy.pause()  # alpha's request now waits on the verifier: still in flight
    try:
        with pytest.raises(grpc.RpcError) as err:
            keyed.stub.Generate(request("x", max_new_tokens=2), metadata=bearer(KEYS["alpha"]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "alpha" in err.value.details()
    finally:
        keyed.verifier_proxy.resume()
    assert list(held)[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert len(keyed.stub.Generate(request("x", max_new_tokens=2), metadata=bearer(KEYS["alpha"])).token_ids) == 2


def test_protected_reflection_needs_a_key(model_dirs, tmp_path):
    stack = start_stack(model_dirs, api_keys_file=key_file(tmp_path), protect_reflection=True)
    try:
        reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(reflection.ServerReflectionInfo(iter([ask])))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert list(reflection.ServerReflectionInfo(iter([ask]), metadata=bearer(KEYS["beta"])))
        health = health_pb2_grpc.HealthStub(stack.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stack.close()


# -- limits ---------------------------------------------------------------------------------

def test_message_over_the_public_limit_is_refused_by_grpc(stack):
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(request("x" * (2 * 1024 * 1024)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(stack.stub.Generate(request("def f():", max_new_tokens=2)).token_ids) == 2


def test_prompt_bytes_are_checked_before_tokenizing(stack):
    backend = stack.gateway.servicer.core.backend
    tokenizer, calls = backend.tokenizer, []

    def counting(text, *args, **kwargs):
        calls.append(len(text))
        return tokenizer(text, *args, **kwargs)

    backend.tokenizer = counting
    try:
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(request("é" * (150 * 1024)))  # 300 KiB in UTF-8, under the message limit
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt is 307200 bytes, over this gateway's limit of 262144" in err.value.details()
        assert calls == []
    finally:
        backend.tokenizer = tokenizer


def test_a_prompt_at_the_byte_limit_is_answered_promptly(stack):
    # 256 KiB of one letter: the task classifier used to backtrack on it for minutes,
    # blocking the gateway's event loop; the deadline here is generous, not a benchmark.
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(request("a" * (256 * 1024)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context window" in err.value.details()


def test_a_long_prompt_is_classified_by_its_ends():
    from gateway.tasks import classify

    assert classify("The meeting notes. " * 2000 + "Summarize the above in a few sentences.") == "summarization"
    assert classify("Translate into French: " + "the cat sat on the mat. " * 2000) == "translation"


@pytest.mark.parametrize("mutate, says", [
    (lambda r: setattr(r.sampling, "max_new_tokens", 5000), "exceeds this gateway's cap of 4096"),
    (lambda r: r.sampling.stop.extend(["s"] * 17), "17 stop strings; at most 16"),
    (lambda r: r.sampling.stop.append("s" * 300), "a stop string is 300 bytes; at most 256"),
    (lambda r: setattr(r.sampling, "temperature", 1.4e-45), "temperature must be 0 (greedy) or at least 0.001"),
    (lambda r: setattr(r.sampling, "temperature", float("inf")), "temperature must be finite"),
    (lambda r: setattr(r, "task_type", "t" * 100), "task_type is 100 bytes; at most 64"),
])
def test_limits_are_invalid_argument(stack, mutate, says):
    bad = request("def f():", max_new_tokens=4)
    mutate(bad)
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


def test_a_huge_invalid_value_is_not_echoed_whole(stack):
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(request("def f():", draft_model="d" * 10_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not "metadata size exceeds soft limit"
    assert "unknown draft model 'dddd" in err.value.details() and "(10000 characters)" in err.value.details()
    assert len(err.value.details()) < 600


def test_bad_utf8_is_invalid_argument(stack):
    raw = stack.channel.unary_unary("/specd.v1.Gateway/Generate")
    raw_stream = stack.channel.unary_stream("/specd.v1.Gateway/GenerateStream")
    body = b"\x0a\x03\xff\xfe\xfd"  # field 1 (prompt), 3 bytes that are not UTF-8
    for call in (raw, lambda b: list(raw_stream(b))):
        with pytest.raises(grpc.RpcError) as err:
            call(body)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    assert len(stack.stub.Generate(request("def f():", max_new_tokens=2)).token_ids) == 2


def test_no_tenant_takes_all_the_capacity_by_default(model_dirs, tmp_path):
    """No --key-max-in-flight: with two tenants, each may hold three quarters of the gateway."""
    front, proxies = proxy_front("draft")

    # The draft's step budget outlasts the test: alpha's speculative requests wait on it.
    stack = start_stack(model_dirs, front=front, api_keys_file=key_file(tmp_path), max_concurrent_requests=4,
                        draft_step_floor_s=120.0)
    proxy = proxies["draft"]
    held = []
    try:
        for _ in range(3):
            held.append(stack.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=HELD_TOKENS),
                                                  metadata=bearer(KEYS["alpha"])))
            next(held[-1])
        proxy.pause()  # alpha's three requests wait on the draft: still in flight
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(request("x", max_new_tokens=2), metadata=bearer(KEYS["alpha"]), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in err.value.details()
        # beta is served from the quarter alpha cannot take (plain decoding: the draft is stalled).
        served = stack.stub.Generate(request("x", max_new_tokens=2, mode="OFF"), metadata=bearer(KEYS["beta"]),
                                     timeout=30)
        assert len(served.token_ids) == 2
    finally:
        proxy.resume()
        for stream in held:
            assert list(stream)[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        stack.loop.run(proxy.close())
        stack.close()


# -- deadlines and streams per connection ---------------------------------------------------

@pytest.fixture()
def stalled(model_dirs):
    """A stack whose gateway reaches the draft through a proxy the test can stall."""
    front, proxies = proxy_front("draft")

    # A draft step budget longer than any test: the stalled draft holds its requests.
    stack = start_stack(model_dirs, front=front, max_streams_per_connection=2, draft_step_floor_s=120.0)
    stack.draft_proxy = proxies["draft"]
    yield stack
    stack.draft_proxy.resume()
    stack.loop.run(stack.draft_proxy.close())
    stack.close()


def test_deadline_travels_to_the_workers_and_frees_their_sessions(stalled):
    stream = stalled.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=200), timeout=3.0)
    next(stream)
    stalled.draft_proxy.pause()  # the draft hears nothing more, not even the gateway's cancel
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Still stalled: the draft drops its session because its steps carried the deadline.
    assert stalled.wait_no_sessions() == 0
    stalled.draft_proxy.resume()
    assert len(stalled.stub.Generate(request("def f():", max_new_tokens=4)).token_ids) == 4


def test_requests_that_end_anyhow_leave_the_load_cap_as_they_found_it(stalled):
    """Every request of a pair counts at the pair's load cap while it runs, and its prompt
    as prefilling until its first step (`LoadCap` in gateway/policy/loadcap.py). Requests of each
    mode, and one whose first step never came back, leave nothing counted: a prompt left
    counted would keep every later step from being measured as quiet."""
    for mode in ("FIXED", "AUTO", "OFF"):
        assert len(stalled.stub.Generate(request("def f():", max_new_tokens=4, mode=mode)).token_ids) == 4
    stalled.draft_proxy.pause()  # a fixed-γ request's first step waits on the draft, past its deadline
    with pytest.raises(grpc.RpcError) as err:
        stalled.stub.Generate(request("def g():", max_new_tokens=4), timeout=2.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    caps = stalled.gateway.servicer.core.policies.load_caps()
    deadline = time.monotonic() + 10.0  # the gateway's handler ends a moment after the client gave up
    while any(cap.requests for cap in caps.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert caps and [(cap.requests, cap._prefilling) for cap in caps.values()] == [(0, 0)] * len(caps)


def test_streams_per_connection_are_capped(stalled):
    held = [stalled.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=200)) for _ in range(2)]
    for stream in held:
        next(stream)
    stalled.draft_proxy.pause()  # both requests wait on the draft, their streams open
    try:
        with pytest.raises(grpc.RpcError) as err:  # a third stream on the same connection waits its turn
            stalled.stub.Generate(request("x", max_new_tokens=2), timeout=2.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stalled.gateway.servicer.core._in_flight == 2  # it never reached the gateway's handler
        # Another connection (its own subchannel, not the shared one) is served meanwhile.
        with grpc.insecure_channel(stalled.gateway_address, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
            assert gateway_pb2_grpc.GatewayStub(other).Generate(
                request("x", max_new_tokens=2, mode="OFF"), timeout=60).token_ids
    finally:
        stalled.draft_proxy.resume()
    for stream in held:
        assert list(stream)[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


def test_bursts_are_refused_by_admission_not_by_http2(stack):
    """Two bursts of 600 streams over 4 connections (150 each, over the old stream limit of
    100): every stream is served or refused RESOURCE_EXHAUSTED with retry advice, never
    UNAVAILABLE (an HTTP/2 REFUSED_STREAM), which clients retry at once."""
    for _ in range(2):
        channels = [grpc.insecure_channel(stack.gateway_address, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(4)]
        try:
            stubs = [gateway_pb2_grpc.GatewayStub(channel) for channel in channels]
            calls = [stubs[n % 4].Generate.future(request("def f():", max_new_tokens=4), timeout=120)
                     for n in range(600)]
            codes = collections.Counter()
            for call in calls:
                codes[call.code().name] += 1
                if call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "retry after" in call.details()
                    assert ("grpc-retry-pushback-ms", "250") in call.trailing_metadata()
        finally:
            for channel in channels:
                channel.close()
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] >= 64, codes


def test_free_text_task_types_do_not_grow_the_gateway_without_bound(stack):
    servicer = stack.gateway.servicer.core
    for n in range(60):
        req = request("def f():", max_new_tokens=1, mode="AUTO", draft_length=0)
        req.task_type = f"made-up-{n}"
        stack.stub.Generate(req)
    task_types = {labels["task_type"] for labels, _ in servicer.stats.query(["task_type"], {})}
    assert len(task_types) <= servicer.stats.max_task_types + 1 and "other" in task_types
    assert len({task for _, task in servicer.policies._probes}) <= servicer.stats.max_task_types + 1  # per model pair
