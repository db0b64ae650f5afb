"""The HTTP edge as an attacker and a careless operator meet it: silent sockets, floods of
chat messages, text that is not Unicode, a full KV pool, keys, and shutdown mid-stream.
Real gateways on loopback over real workers; the silent-socket test runs `specd gateway`
as its own process with a file limit of 512."""
from __future__ import annotations

import gc
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import LoopThread, request, start_stack
from gateway.app import create_server as create_gateway
from gateway.edge.bodies import LARGE_BODY_BYTES
from gateway.errors import InvalidRequest
from gateway.settings import GatewaySettings
from specd.config import ServerSettings
from specd.v1 import gateway_pb2_grpc
from specd.worker.settings import BatchSettings
from tcpproxy import TcpProxy
from test_cli import free_port
from test_http import PROMPT, TEMPLATE, post

SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, which json.loads turns back into a lone surrogate


@pytest.fixture(scope="module")
def edge(model_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    running = start_stack(model_dirs, http_port=0, chat_template=template, max_chat_messages=64)
    yield running
    running.close()


def url(stack, path: str) -> str:
    return f"http://127.0.0.1:{stack.gateway.servicer.http.port}{path}"


def model_name(stack) -> str:
    return stack.gateway.servicer.core.backend.target.name


# -- text that is not Unicode -------------------------------------------------------------------

def surrogate_bodies(model: str) -> list[tuple[str, dict]]:
    """A lone surrogate in each place a client can put text, for both endpoints."""
    completion = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("/v1/completions", {**completion, "prompt": f"def f{SURROGATE}():"}),
        ("/v1/completions", {**completion, "stop": [f"x{SURROGATE}"]}),
        ("/v1/completions", {**completion, "user": SURROGATE}),
        ("/v1/completions", {**completion, f"field{SURROGATE}": 1}),
        ("/v1/completions", {**completion, "speculation": {"policy": SURROGATE}}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": f"hi {SURROGATE}"}]}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": SURROGATE, "content": "hi"}]}),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": SURROGATE}]}]}),
        ("/v1/chat/completions", {**chat, "stop": SURROGATE}),
        ("/v1/chat/completions", {**chat, "user": f"a{SURROGATE}b"}),
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_anywhere_is_400_with_an_error_object(edge, stream):
    for path, body in surrogate_bodies(model_name(edge)):
        raw = json.dumps({**body, "stream": stream}).encode()
        assert b"\\ud800" in raw
        status, reply = post(url(edge, path), raw)
        assert status == 400, (path, body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and "surrogate" in reply["error"]["message"]
    status, _ = post(url(edge, "/v1/completions"), json.dumps({"model": model_name(edge), "prompt": "ok 😀",
                                                               "max_tokens": 2, "temperature": 0}).encode())
    assert status == 200  # a character outside the BMP, sent as a surrogate pair, is text


# -- chat bodies: a cap, and work off the event loop -------------------------------------------

def test_a_chat_over_the_message_cap_is_refused_before_rendering(edge):
    messages = [{"role": "user", "content": ""}] * 34_000  # just under 1 MiB, as the flood sent
    status, reply = post(url(edge, "/v1/chat/completions"),
                         json.dumps({"model": model_name(edge), "messages": messages}, separators=(",", ":")).encode())
    assert status == 400 and "34000 messages" in reply["error"]["message"]
    assert "--max-chat-messages" in reply["error"]["message"]


def test_bodies_are_parsed_and_chats_rendered_off_the_event_loop(edge, monkeypatch):
    app = edge.gateway.servicer.http.app
    threads = []
    render = app._render

    def recording(*args):
        threads.append(threading.current_thread().name)
        return render(*args)

    monkeypatch.setattr(app, "_render", recording)
    status, reply = post(url(edge, "/v1/chat/completions"), json.dumps({
        "model": model_name(edge), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "temperature": 0}).encode())
    assert status == 200, reply
    assert threads and all(name.startswith("specd-http-body") for name in threads), threads


# -- refused bodies: memory stays flat ---------------------------------------------------------

def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set from /proc")
def test_a_flood_of_refused_bodies_leaves_memory_flat(edge):
    """Three clients send 15 bodies of 889 KB each, a 90,000-entry logit_bias, every one
    refused: this process (gateway and workers) grows by under 200 MB. Each once kept about
    26 MB until a full garbage collection: the body was built, converted and sorted before
    it was counted, and the request's task and its exception held each other."""
    raw = json.dumps({"model": model_name(edge), "max_tokens": 4, "prompt": PROMPT,
                      "logit_bias": {str(i): 1 for i in range(90_000)}}, separators=(",", ":")).encode()
    assert len(raw) > 880_000

    def refused(_: int) -> None:
        status, reply = post(url(edge, "/v1/completions"), raw)
        assert status == 400 and "an object of 90000 entries" in reply["error"]["message"], reply

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(refused, range(3)))  # the body thread and the arenas it needs, before the baseline
        before = resident_bytes()
        list(pool.map(refused, range(45)))
    grown = resident_bytes() - before
    assert grown < 200 * 1024 * 1024, f"45 refused bodies grew the process by {grown / 2 ** 20:.0f} MB"


def test_a_large_body_is_parsed_apart_and_answered_as_a_small_one(edge):
    """A body over LARGE_BODY_BYTES is parsed in the edge's body process: a valid one is
    served, and a refusal there comes back whole (status, message, param)."""
    padding = " " * (LARGE_BODY_BYTES + 1)  # JSON whitespace: the request is the same, the body large
    served = f'{{"model": {json.dumps(model_name(edge))},{padding}"prompt": {json.dumps(PROMPT)}, "max_tokens": 3}}'
    status, reply = post(url(edge, "/v1/completions"), served.encode())
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply
    stops = json.dumps(["x"] * 17)
    refused = f'{{"model": {json.dumps(model_name(edge))},{padding}"prompt": "x", "stop": {stops}}}'
    status, reply = post(url(edge, "/v1/completions"), refused.encode())
    assert status == 400 and reply["error"]["param"] == "stop" and "'stop' holds 17" in reply["error"]["message"]


def test_a_request_the_core_refuses_is_freed_when_it_ends(edge):
    """No reference cycle keeps a refused request (its body, its parsed fields) alive until
    the next full garbage collection, which a busy gateway may not run for minutes."""
    body = json.dumps({"model": model_name(edge), "max_tokens": 4, "prompt": [10_000]}).encode()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        status, reply = post(url(edge, "/v1/completions"), body)
        time.sleep(0.2)  # the handler's task ends just after the reply is sent
        gc.collect()
        kept = [item for item in gc.garbage if isinstance(item, InvalidRequest)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert status == 400 and "outside the target's vocabulary" in reply["error"]["message"], reply
    assert not kept, "the refused request was left in a reference cycle"


# -- keys before bodies ---------------------------------------------------------------------------

def test_the_key_is_checked_before_the_body_is_read(edge, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alpha alpha-key\n")
    loop = LoopThread()
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=0.5), verifier_address=f"127.0.0.1:{edge.verifier.port}",
        draft_address="", api_keys_file=keys, http_port=0)))
    try:
        port = gateway.servicer.http.port
        base = f"http://127.0.0.1:{port}/v1/completions"
        # Without a key, a body over the limit (413) is not read: the answer comes with the
        # headers and the first kilobyte of 2 MiB sent. (A client sending all of it can meet
        # the closed connection mid-body, a broken pipe, as it did here once.)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n{" % (2 * 1024 * 1024) + b" " * 1023)
            answer = b""
            while b"authentication_error" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401") and b"authentication_error" in answer, answer
        # Nor is one that is not JSON (400).
        status, reply = post(base, b"{not json")
        assert status == 401 and reply["error"]["type"] == "authentication_error", reply
        status, reply = post(base, b"{not json", {"Authorization": "Bearer alpha-key"})
        assert status == 400
    finally:
        loop.run(gateway.stop(0))
        loop.close()


# -- a full KV pool ------------------------------------------------------------------------------

def test_a_full_kv_pool_is_429_with_retry_after_and_the_next_request_is_served(model_dirs, tokenizer):
    """12 prompts of ~200 tokens at once against 2,048-token KV pools: every answer is 200
    or 429 of type rate_limit_error with Retry-After; then a request is served."""
    stack = start_stack(model_dirs, batching=BatchSettings(kv_cache_tokens=2048), http_port=0)
    try:
        words = "the acceptance rate of a draft model decides whether speculation pays " * 40
        model = model_name(stack)

        def one(i: int) -> tuple[int, dict, str | None]:
            ids = tokenizer(f"{i} {words}")["input_ids"][:200]
            body = json.dumps({"model": model, "prompt": ids, "max_tokens": 40, "temperature": 0}).encode()
            req = urllib.request.Request(url(stack, "/v1/completions"), data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as response:
                    return response.status, json.loads(response.read()), None
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read()), exc.headers.get("Retry-After")

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(one, range(12)))
        for status, reply, retry_after in answers:
            assert status in (200, 429), reply
            if status == 429:
                assert reply["error"]["type"] == "rate_limit_error" and retry_after and int(retry_after) >= 1
        assert stack.wait_no_sessions(within_s=10) == 0
        status, reply, _ = one(99)
        assert status == 200, reply
    finally:
        stack.close()


# -- shutdown with streams in flight --------------------------------------------------------------

def read_events(port: int, model: str, i: int, events: list[list[str]], started: threading.Barrier) -> None:
    """One stream's `data:` lines, read to the end of the body, whatever ends it."""
    lines: list[str] = []
    events.append(lines)
    body = json.dumps({"model": model, "prompt": f"{PROMPT} # {i}", "max_tokens": 200, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            for raw in response:
                if raw.startswith(b"data: "):
                    lines.append(raw[6:].decode().strip())
                    if len(lines) == 1:
                        started.wait(30)
    except Exception as exc:  # a body cut mid-way: http.client.IncompleteRead, a reset
        lines.append(f"CUT {type(exc).__name__}")


def test_streams_still_running_at_shutdown_end_with_an_error_event_and_done(edge):
    """Six streams held (their verifier behind a paused proxy) while the gateway stops with
    a 2 s grace: each ends with an error event and [DONE], never a cut body, and every
    tenant slot and worker session is given back."""
    loop = LoopThread()
    proxy = loop.run(TcpProxy(edge.verifier.port).start())
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=2), verifier_address=f"127.0.0.1:{proxy.port}",
        draft_address="", http_port=0)))
    port, model = gateway.servicer.http.port, model_name(edge)
    events: list[list[str]] = []
    started = threading.Barrier(7)
    readers = [threading.Thread(target=read_events, args=(port, model, i, events, started)) for i in range(6)]
    for reader in readers:
        reader.start()
    started.wait(60)  # every stream has its first event
    loop.loop.call_soon_threadsafe(proxy.pause)
    stopping = threading.Thread(target=loop.run, args=(gateway.stop(2), 30))
    stopping.start()
    for reader in readers:
        reader.join(30)
    loop.loop.call_soon_threadsafe(proxy.resume)
    stopping.join(30)
    loop.run(proxy.close())
    loop.close()
    assert len(events) == 6
    for lines in events:
        assert lines[-1] == "[DONE]", lines[-3:]
    ended_by_shutdown = [json.loads(lines[-2]) for lines in events if "error" in json.loads(lines[-2])]
    assert ended_by_shutdown, "no stream was still running at shutdown; the test proves nothing"
    assert all("shutting down" in last["error"]["message"] for last in ended_by_shutdown), ended_by_shutdown


# -- silent sockets ------------------------------------------------------------------------------

def test_silent_sockets_do_not_take_the_gateway_down(stack, tmp_path):
    """`specd gateway` with a file limit of 512 meets 600 sockets that never send a byte:
    gRPC and HTTP /health still answer within 40 s, the server closes the silent sockets,
    and its log grows by under 5 MB."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"this process may open only {hard} files; the test needs 1,024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1024) if hard == resource.RLIM_INFINITY
                                                else min(hard, max(soft, 1024)), hard))
    http_port, port_file, log_path = free_port(), tmp_path / "port", tmp_path / "gateway.log"

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    with open(log_path, "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "specd_cli", "gateway", "--port", "0", "--port-file", str(port_file),
             "--http-port", str(http_port), "--http-header-timeout", "2",
             "--verifier-address", f"127.0.0.1:{stack.verifier.port}",
             "--draft-address", f"127.0.0.1:{stack.draft.port}"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=limited)
    silent: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert gateway.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as response:
            assert response.status == 200
        before = log_path.stat().st_size
        for _ in range(600):
            sock = socket.create_connection(("127.0.0.1", http_port), timeout=5)
            silent.append(sock)
        began = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(request(PROMPT, max_new_tokens=4), timeout=40)
        assert len(reply.token_ids) == 4
        health = None
        while health is None and time.monotonic() - began < 40:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as response:
                    health = response.status
            except OSError:
                time.sleep(0.5)
        assert health == 200, "HTTP /health did not answer within 40 s"
        for sock in silent:  # every silent socket is closed by the server: EOF or a reset
            sock.settimeout(max(1.0, 40 - (time.monotonic() - began)))
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        assert gateway.poll() is None
        grown = log_path.stat().st_size - before
        assert grown < 5 * 1024 * 1024, f"the log grew by {grown} bytes"
    finally:
        for sock in silent:
            sock.close()
        gateway.terminate()
        gateway.wait(30)


def test_accept_errors_are_logged_once_per_interval(caplog):
    """What asyncio reports for each failed accept() (out of descriptors) becomes one line
    per interval, with a count; anything else reaches the loop's handler as before."""
    import asyncio

    from gateway.edge.connections import quiet_accept_errors

    loop = asyncio.new_event_loop()
    seen = []
    loop.set_exception_handler(lambda loop, context: seen.append(context["message"]))
    quiet_accept_errors(loop)
    caplog.set_level("ERROR", logger="gateway.edge.connections")
    for _ in range(500):
        loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                     "exception": OSError(24, "Too many open files")})
    loop.call_exception_handler({"message": "something else"})
    loop.close()
    lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(lines) == 1 and seen == ["something else"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_of_serve_exits_when_serve_is_already_gone():
    """The race the parent-death signal leaves: a child whose serve died before it asked
    exits at once instead of running on."""
    env = {**os.environ, "SPECD_SUPERVISOR_PID": "1"}  # not this child's parent
    done = subprocess.run([sys.executable, "-m", "specd_cli", "--help"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "already exited" in done.stderr
