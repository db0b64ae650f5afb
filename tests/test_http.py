"""The OpenAI-compatible HTTP front end, driven by the official `openai` client against a
real gateway (uvicorn in the gateway's event loop) over real workers on loopback."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LoopThread, request, start_stack
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from gateway.validation import parse_request
from specd.config import ServerSettings
from specd.v1 import gateway_pb2_grpc
from tcpproxy import TcpProxy

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def http_stack(model_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    running = start_stack(model_dirs, http_port=0, chat_template=template)
    yield running
    running.close()


def base_url(stack) -> str:
    return f"http://127.0.0.1:{stack.gateway.servicer.http.port}/v1"


@pytest.fixture(scope="module")
def client(http_stack):
    return openai.OpenAI(base_url=base_url(http_stack), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def keyed(http_stack, tmp_path_factory):
    """A second gateway on the same workers, with API keys (one tenant may hold 1 request)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("alpha alpha-key\nbeta beta-key\n")
    loop = LoopThread()
    gateway_settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                                       verifier_address=f"127.0.0.1:{http_stack.verifier.port}",
                                       draft_address=f"127.0.0.1:{http_stack.draft.port}",
                                       api_keys_file=keys, key_max_in_flight=1, http_port=0)
    server = loop.run(create_gateway(gateway_settings))
    yield f"http://127.0.0.1:{server.servicer.http.port}/v1"
    loop.run(server.stop(0))
    loop.close()


def test_models_names_the_target(client, http_stack):
    assert [m.id for m in client.models.list()] == [http_stack.gateway.servicer.core.backend.target.name]


def test_greedy_completion_equals_grpc_generate(client, http_stack):
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    grpc_text = http_stack.stub.Generate(request(PROMPT, max_new_tokens=24, mode="AUTO")).text
    assert completion.choices[0].text == grpc_text
    assert completion.choices[0].finish_reason in ("length", "stop")
    usage = completion.usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    figures = usage.model_extra["speculation"]
    assert len(figures["drafted_per_step"]) == len(figures["accepted_per_step"]) > 0
    assert figures["num_accepted_tokens"] == sum(figures["accepted_per_step"])


def test_prompt_as_token_ids(client, http_stack, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    model = client.models.list().data[0].id
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stream_joins_to_the_same_text_with_usage(client):
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    parts, usage = [], None
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        parts.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == 20
    assert usage.model_extra["speculation"]["mean_acceptance_length"] >= 1.0


def test_chat_returns_an_assistant_message(client):
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "write a loop"}],
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 12
    streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "write a loop"}],
                                              max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply.choices[0].message.content


def test_errors_raise_the_clients_matching_exceptions(client, keyed):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=model, prompt=PROMPT, best_of=2)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=model, prompt=PROMPT, logit_bias={"one": 5})
    with pytest.raises(openai.BadRequestError, match=r"logprobs must be in \[0, 20\]"):
        client.completions.create(model=model, prompt=PROMPT, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "xml"})
    with pytest.raises(openai.BadRequestError, match="needs a 'name'"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"description": "f"}}])
    wrong = openai.OpenAI(base_url=keyed, api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        wrong.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    right = openai.OpenAI(base_url=keyed, api_key="alpha-key", max_retries=0)
    assert right.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens
    # An application's end-user id, with keys: accepted, and the key still decides the segment.
    assert right.completions.create(model=model, prompt=PROMPT, max_tokens=2, user="end-user-42").usage


def test_the_extensions_reach_the_core(client, http_stack):
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"top_k": 5, "speculation": {"mode": "fixed", "draft_length": 3, "draft_model": "close"}})
    figures = completion.usage.model_extra["speculation"]
    assert figures["draft_model"] == "close" and set(figures["drafted_per_step"][:-1]) <= {3}
    with pytest.raises(openai.BadRequestError, match="unknown speculation fields"):
        client.completions.create(model=model, prompt=PROMPT, extra_body={"speculation": {"gamma": 3}})


def test_a_speculation_field_left_out_is_the_default_and_an_explicit_zero_is_kept(client, http_stack):
    """JSON tells a field left out from a 0, as proto3 cannot. Over HTTP, draft_length 0 under
    FIXED decodes plainly, and a γ bound of 0 is refused by name; over gRPC a 0 is unset, so
    the gateway's --draft-length drafts."""
    model = client.models.list().data[0].id
    plain = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"speculation": {"mode": "fixed", "draft_length": 0, "draft_model": "close"}})
    assert plain.usage.model_extra["speculation"]["num_draft_tokens"] == 0
    for bound in ("min_draft_length", "max_draft_length"):
        with pytest.raises(openai.BadRequestError, match=bound):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"speculation": {bound: 0}})
    unset = http_stack.stub.Generate(request(PROMPT, max_new_tokens=8, draft_length=0, draft_model="close"))
    assert unset.stats.draft_lengths[0] == 4  # the gateway's --draft-length


def test_vllms_text_fields_reach_the_text(client):
    """include_stop_str_in_output keeps the stop string; chat_template_kwargs reaches the
    template, but never for what the gateway sets itself."""
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:][:2]  # two characters the greedy output holds
    assert len(stop) == 2 and stop.strip(), whole
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and whole.startswith(kept.choices[0].text)
    messages = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices
    with pytest.raises(openai.BadRequestError, match="may not set \\['tools'\\]"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens(client, tokenizer):
    model = client.models.list().data[0].id
    ids = tokenizer(PROMPT)["input_ids"]
    truncated = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 3})
    tail = client.completions.create(model=model, prompt=ids[-3:], max_tokens=8, temperature=0)
    assert truncated.usage.prompt_tokens == 3 and truncated.choices[0].text == tail.choices[0].text
    with pytest.raises(openai.BadRequestError, match="'truncate_prompt_tokens' must be at least 1"):
        client.completions.create(model=model, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0})


def test_a_list_of_prompts_gets_each_its_choices_in_openais_order(client, tokenizer):
    model = client.models.list().data[0].id
    prompts = [PROMPT, "class Cache:"]
    with pytest.raises(openai.BadRequestError, match="a list of either"):  # text and ids mixed
        client.completions.create(model=model, prompt=[PROMPT, [1, 2]])
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    alone = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == alone


def test_chat_without_a_template_says_how_to_give_one(model_dirs, http_stack):
    loop = LoopThread()
    settings_ = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                                verifier_address=f"127.0.0.1:{http_stack.verifier.port}", draft_address="",
                                http_port=0)
    server = loop.run(create_gateway(settings_))
    try:
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{server.servicer.http.port}/v1", api_key="x",
                              max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--chat-template"):
            plain.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}])
    finally:
        loop.run(server.stop(0))
        loop.close()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """The status and JSON reply of a raw POST (an event stream's reply is read and left out)."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            content = response.read()
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            return response.status, {} if streamed else json.loads(content)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_an_oversized_body_is_413_and_bad_json_400(http_stack):
    url = base_url(http_stack) + "/completions"
    status, body = post(url, b'{"prompt": "' + b"x" * (1024 * 1024 + 10) + b'"}')
    assert status == 413 and "limit" in body["error"]["message"]
    status, body = post(url, b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def _refused_upload(port: int, announced: int, first: int) -> socket.socket:
    """A raw connection that announces a body of `announced` bytes and sends `first` of them."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=30)
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {announced}\r\n\r\n".encode() + b"x" * first)
    return conn


def _status(conn: socket.socket) -> int:
    reply = b""
    while b"\r\n" not in reply:
        piece = conn.recv(4096)
        assert piece, f"closed before a status line: {reply!r}"
        reply += piece
    return int(reply.split(b" ", 2)[1])


def test_a_refused_body_sent_whole_gets_its_413(http_stack):
    """A client that sends all of a too-large body before reading gets the 413, not a reset:
    the gateway reads the body on and drops it (up to `DRAIN_BYTES`). Answered and closed
    mid-upload, the client's sends fail and the reset discards the answer."""
    size = 8 << 20  # past the 1 MiB limit and any socket buffer, within DRAIN_BYTES
    conn = _refused_upload(http_stack.gateway.servicer.http.port, size, size)
    with conn:
        assert _status(conn) == 413


def test_a_body_announced_past_the_drain_bound_is_refused_unread(http_stack):
    """A body announced over `DRAIN_BYTES` is answered at once and the connection closed:
    the rest is never read, so a client cannot make the gateway take in 64 MiB (or hold a
    connection open while it sends them). The gateway serves on."""
    from gateway.edge.http import DRAIN_BYTES

    announced = 4 * DRAIN_BYTES
    conn = _refused_upload(http_stack.gateway.servicer.http.port, announced, 1 << 20)
    with conn:
        assert _status(conn) == 413  # after 1 MiB of 64: the rest was not waited for
        sent = 1 << 20
        with pytest.raises(OSError):  # a broken pipe or a reset, once the close arrives
            while sent < announced:
                sent += conn.send(b"x" * (1 << 20))
        assert sent < announced
    with urllib.request.urlopen(base_url(http_stack).removesuffix("/v1") + "/health", timeout=30) as health:
        assert health.status == 200


@pytest.mark.parametrize("field,value,message", [
    ("top_k", 2 ** 31, "top_k must be at most"), ("temperature", 1e39, "temperature must be finite and at most"),
    ("top_p", 0, "'top_p' must be in"), ("seed", -1, "'seed' must be at least 0"),
])
def test_values_the_wire_cannot_carry_are_400(http_stack, field, value, message):
    body = {"model": http_stack.gateway.servicer.core.backend.target.name, "prompt": PROMPT, "max_tokens": 2,
            field: value}
    status, reply = post(base_url(http_stack) + "/completions", json.dumps(body).encode())
    assert status == 400 and message in reply["error"]["message"], reply


def test_a_body_nested_too_deep_is_400(http_stack):
    status, reply = post(base_url(http_stack) + "/completions", b"[" * 100_000)
    assert status == 400 and "nests too deep" in reply["error"]["message"]


def test_a_stream_in_flight_finishes_while_the_gateway_drains(http_stack):
    """Stopping the gateway gives an HTTP stream the whole grace period, as gRPC calls
    get: the verifier is held (a paused proxy) past the HTTP server's own 2 s shutdown
    timeout, and the stream still ends whole."""
    import threading

    loop = LoopThread()
    proxy = loop.run(TcpProxy(http_stack.verifier.port).start())
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=10), verifier_address=f"127.0.0.1:{proxy.port}",
        draft_address="", http_port=0)))
    port = gateway.servicer.http.port
    client_ = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client_.completions.create(model="target", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)
    loop.loop.call_soon_threadsafe(proxy.pause)
    stopping = threading.Thread(target=loop.run, args=(gateway.stop(10),))
    stopping.start()
    time.sleep(3)
    with pytest.raises(urllib.error.URLError):  # draining: no new connections
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    loop.loop.call_soon_threadsafe(proxy.resume)
    usage = [c.usage for c in chunks if c.usage is not None]
    stopping.join(30)
    loop.run(proxy.close())
    loop.close()
    assert usage and usage[0].completion_tokens == 60


def test_a_tenant_over_its_share_gets_429_with_retry_after(keyed, client):
    model = client.models.list().data[0].id
    alpha = openai.OpenAI(base_url=keyed, api_key="alpha-key", max_retries=0)
    with alpha.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0, stream=True) as held:
        next(iter(held))  # alpha's one request is in flight
        status, body = post(keyed + "/completions", json.dumps({"model": model, "prompt": PROMPT}).encode(),
                            {"Authorization": "Bearer alpha-key"})
        assert status == 429 and "share" in body["error"]["message"]
        beta = openai.OpenAI(base_url=keyed, api_key="beta-key", max_retries=0)
        served = beta.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
        assert served.usage.completion_tokens == 2


def test_streams_closed_by_the_client_free_their_sessions(client, http_stack):
    model = client.models.list().data[0].id
    streams = [client.completions.create(model=model, prompt=f"{PROMPT} # {i}", max_tokens=200, temperature=0,
                                         stream=True) for i in range(8)]
    for stream in streams:
        next(iter(stream))
    for stream in streams:
        stream.close()
    assert http_stack.wait_no_sessions(within_s=10) == 0
    # Greedy: a sampled request (OpenAI's default temperature is 1) may draw EOS before its 4th token.
    served = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert served.usage.completion_tokens == 4


def test_health(http_stack):
    with urllib.request.urlopen(f"http://127.0.0.1:{http_stack.gateway.servicer.http.port}/health") as response:
        assert response.status == 200


# Text with lone UTF-16 surrogates too (hypothesis leaves them out by default): JSON's \\ud800
# escapes decode to them, and no UTF-8 encoder downstream takes them.
SURROGATES = st.builds("".join, st.lists(st.sampled_from(["a", "\ud800", "\udfff", "é"]), max_size=4))


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | SURROGATES, inner, max_size=3)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-2, 3) | st.text(max_size=12)
                    | SURROGATES, _containers, max_leaves=8)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n",
          "speculation", "stream_options", "logprobs", "echo", "user", "messages", "extra", "top_logprobs",
          "response_format", "structured_outputs"]
# Fields a served request takes, with values of the right kinds (a chat's logprobs is made
# a flag): added to a valid request, they make bodies that reach the workers in many
# shapes, each opening sessions there.
SERVED = {"max_tokens": st.integers(1, 8), "temperature": st.sampled_from([0, 0.7, 1.5]),
          "top_p": st.floats(0.1, 1), "top_k": st.integers(0, 20), "seed": st.integers(0, 2**31 - 1),
          "stop": st.sampled_from(["\n", ["(", ":"], []]), "stream": st.booleans(), "n": st.integers(1, 3),
          "logprobs": st.integers(0, 2), "min_tokens": st.integers(0, 4),
          "presence_penalty": st.floats(-1, 1), "ignore_eos": st.booleans(),
          "speculation": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["auto", "fixed", "off"]),
                                                             "draft_length": st.integers(1, 4)}),
          "structured_outputs": st.just({"choice": ["yes", "no"]})}


@dataclass
class Fuzzed:
    statuses: Counter[int]  # how many bodies got each status
    generated: int  # of them served with tokens generated: requests that opened sessions on the workers
    failure: BaseException | None  # Hypothesis' error with the smallest failing body, if any


@pytest.fixture(scope="module")
def fuzzed(http_stack) -> Fuzzed:
    """Fuzzed bodies sent to both routes, once per module: any JSON in the known fields, or a
    valid request with served fields added. The tests below check what the search found
    and what it left behind, run together or alone."""
    statuses: Counter[int] = Counter()
    generated = 0
    name = http_stack.gateway.servicer.core.backend.target.name

    @settings(max_examples=80, deadline=None)
    @given(body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), chat=st.booleans(),
           model=st.booleans(), valid=st.booleans(), served=st.fixed_dictionaries({}, optional=SERVED))
    def send(body, chat, model, valid, served):
        nonlocal generated
        if valid:  # a served request instead of `body`
            prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
            body = {"model": name, "max_tokens": 4, **prompt, **served}
            if chat and "logprobs" in body:
                body["logprobs"] = body["logprobs"] > 0
        elif model:
            body["model"] = name
        if isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 8)
        url = base_url(http_stack) + ("/chat/completions" if chat else "/completions")
        status, reply = post(url, json.dumps(body).encode())
        statuses[status] += 1
        generated += status == 200 and (not reply or reply["usage"]["completion_tokens"] > 0)  # {}: streamed
        assert status < 500, reply
        assert status == 200 or reply["error"]["message"]

    try:
        send()
    except Exception as failure:  # raised by the test it concerns
        return Fuzzed(statuses, generated, failure)
    return Fuzzed(statuses, generated, None)


def test_fuzzed_bodies_never_get_a_500(fuzzed):
    if fuzzed.failure is not None:
        raise fuzzed.failure
    # Both kinds were sent: bodies refused, and bodies served.
    assert fuzzed.generated > 0 and any(400 <= status < 500 for status in fuzzed.statuses), fuzzed.statuses


def test_fuzzing_left_no_sessions(http_stack, fuzzed):
    # The fuzzing opened sessions, run alone too: the fixture fuzzes.
    assert fuzzed.generated > 0, fuzzed.statuses
    assert http_stack.wait_no_sessions(within_s=10) == 0


def test_specd_serve_with_http_keys_and_a_chat_template(model_dirs, tmp_path):
    """The issue's setting end to end: `specd serve --http-port N --chat-template FILE
    --api-keys FILE`, called with the official client and over gRPC with the same key."""
    import signal
    import subprocess
    import sys

    import grpc

    from specd.v1 import gateway_pb2_grpc
    from test_cli import free_port

    template, keys = tmp_path / "chat.jinja", tmp_path / "keys.txt"
    template.write_text(TEMPLATE)
    keys.write_text("team team-key\n")
    grpc_port, http_port = free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "specd_cli", "serve", "--target", str(model_dirs["target"]), "--draft",
         f"close={model_dirs['close']}", "--port", str(grpc_port), "--http-port", str(http_port),
         "--chat-template", str(template), "--api-keys", str(keys)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        deadline = time.monotonic() + 120
        client_ = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="team-key", max_retries=0)
        while True:  # the gateway answers gRPC a moment before its HTTP port is up
            try:
                models = [m.id for m in client_.models.list()]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the HTTP port never came up"
                time.sleep(0.5)
        assert models == ["target"]
        completion = client_.completions.create(model="target", prompt=PROMPT, max_tokens=16, temperature=0)
        by_grpc = stub.Generate(request(PROMPT, max_new_tokens=16, mode="AUTO"),
                                metadata=[("authorization", "Bearer team-key")], timeout=120)
        assert completion.choices[0].text == by_grpc.text
        chat = client_.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="wrong",
                          max_retries=0).models.list()
        channel.close()
    finally:
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0, output


def test_penalties_and_logit_bias_over_http_equal_grpc(client, http_stack):
    """The OpenAI names carry the same rule as the gRPC fields (tests/test_penalties.py
    checks the rule itself against transformers)."""
    from test_penalties import penalized_request

    model = client.models.list().data[0].id
    rule = dict(presence_penalty=0.9, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={12: 3.0})
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, presence_penalty=0.9, frequency_penalty=0.4,
        logit_bias={"12": 3.0}, extra_body={"repetition_penalty": 1.3})
    by_grpc = http_stack.stub.Generate(penalized_request(PROMPT, rule, max_new_tokens=24, mode="AUTO"))
    assert completion.choices[0].text == by_grpc.text
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert plain.choices[0].text != completion.choices[0].text
    # vLLM's extra parameters: EOS held back, then not ending the output; a stop token id.
    # FIXED γ: under AUTO's cost policy a seed fixes the law of the output, not the sample.
    request = penalized_request(PROMPT, {}, max_new_tokens=24, mode="FIXED", draft_length=3, temperature=0.8, seed=7)
    request.sampling.min_p, request.sampling.min_tokens, request.sampling.ignore_eos = 0.2, 3, True
    request.sampling.stop_token_ids.append(12)
    by_grpc = http_stack.stub.Generate(request)
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0.8, seed=7,
        extra_body={"min_p": 0.2, "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [12],
                    "speculation": {"mode": "fixed", "draft_length": 3}})
    assert completion.choices[0].text == by_grpc.text
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(model=model, prompt=PROMPT, extra_body={"stop_token_ids": ["x"]})


def test_a_seed_of_0_is_a_seed(client):
    """OpenAI's seed 0 reproduces its sample like any other seed (it once meant "pick one");
    no seed still draws a fresh one each time."""
    model = client.models.list().data[0].id
    fixed = {"speculation": {"mode": "fixed", "draft_length": 3}}  # a seed fixes the sample under FIXED γ

    def text(**seed) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                         extra_body=fixed, **seed).choices[0].text

    assert text(seed=0) == text(seed=0)
    assert len({text() for _ in range(4)}) > 1


def test_n_choices_each_reproduce_from_the_seed(client, http_stack):
    """n=3 with a seed: three indexed choices, the same again for the same request, choice
    i equal to a gRPC request seeded seed + i, streamed or not; usage counts them all."""
    model = client.models.list().data[0].id
    fixed = {"speculation": {"mode": "fixed", "draft_length": 3}}  # a seed fixes the sample under FIXED γ

    def ask(**extra):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=11,
                                         extra_body=fixed, **extra)

    first, again = ask(), ask()
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # three samples, not one thrice
    generated = 0
    for i, text in enumerate(texts):
        by_grpc = http_stack.stub.Generate(request(PROMPT, temperature=1.0, seed=11 + i, max_new_tokens=12,
                                                   mode="FIXED", draft_length=3))
        assert by_grpc.text == text
        generated += by_grpc.stats.generated_tokens
    figures = first.usage.model_extra["speculation"]
    assert first.usage.completion_tokens == generated and len(figures["choices"]) == 3
    assert figures["num_accepted_tokens"] == sum(c["num_accepted_tokens"] for c in figures["choices"])
    streamed = ["", "", ""]
    for chunk in ask(stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    with pytest.raises(openai.BadRequestError, match="n may be at most 16"):
        client.completions.create(model=model, prompt=PROMPT, n=100)


def test_a_request_heavier_than_a_whole_share_is_400(keyed, client):
    """Against a share of 1 slot, n=2, log-probabilities and 2,000 tokens each weigh 2: no
    wait could let them in, so each is a 400 that says what to ask for, not a 429; the
    tenant's next request is served."""
    model = client.models.list().data[0].id
    alpha = openai.OpenAI(base_url=keyed, api_key="alpha-key", max_retries=0)
    # 2,000 tokens is past this model's context as well; the weight is checked first.
    for heavy in ({"n": 2}, {"logprobs": 0}, {"max_tokens": 2000}):
        with pytest.raises(openai.BadRequestError, match="weighs 2 slots, more than a tenant's whole share of 1"):
            alpha.completions.create(model=model, prompt=PROMPT, **{"max_tokens": 2, "temperature": 0, **heavy})
    assert alpha.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens


def test_invalid_requests_hold_no_slot_of_their_tenants_share(keyed, client, monkeypatch):
    """Four requests with 17 stop strings (16 is the limit) arrive while the core's
    validation would hold them: each is refused before it takes a slot of its tenant's
    share of 1, so the tenant's valid request that follows is served, not refused 429."""
    model = client.models.list().data[0].id
    reached_the_core, release = threading.Event(), threading.Event()

    def held(asked, *args):
        if len(asked.stop) > 16:  # an invalid request that got this far waits here, as behind a long queue
            reached_the_core.set()
            release.wait(30)
        return parse_request(asked, *args)

    monkeypatch.setattr("gateway.core.parse_request", held)
    alpha = {"Authorization": "Bearer alpha-key"}
    invalid = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2,
                          "stop": [f"s{i}" for i in range(17)]}).encode()
    valid = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    with ThreadPoolExecutor(4) as pool:
        try:
            refused = [pool.submit(post, keyed + "/completions", invalid, alpha) for _ in range(4)]
            deadline = time.monotonic() + 30
            while not (reached_the_core.is_set() or all(f.done() for f in refused)) and time.monotonic() < deadline:
                time.sleep(0.02)
            status, reply = post(keyed + "/completions", valid, alpha)
        finally:
            release.set()
        answers = [f.result() for f in refused]
    assert status == 200, reply
    assert all(code == 400 and "17 stop strings" in body["error"]["message"] for code, body in answers), answers


def test_a_tenants_requests_hold_their_weight_of_its_share(http_stack, tmp_path):
    """With a share of 4 slots: n=16 never fits (400); a stream of n=2 with log-probabilities
    weighs 4, over HTTP as over gRPC, so while it runs the tenant's next request gets 429
    (counted as requests it held 2 slots, over gRPC 1), and once it ends that is served."""
    keys = tmp_path / "keys.txt"
    keys.write_text("alpha alpha-key\nbeta beta-key\n")
    loop = LoopThread()
    proxy = loop.run(TcpProxy(http_stack.verifier.port).start())
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=0.5), verifier_address=f"127.0.0.1:{proxy.port}", draft_address="",
        api_keys_file=keys, key_max_in_flight=4, http_port=0)))
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    base = f"http://127.0.0.1:{gateway.servicer.http.port}/v1"
    model = http_stack.gateway.servicer.core.backend.target.name
    alpha = {"Authorization": "Bearer alpha-key"}
    plain = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()

    def served_again() -> int:  # the held request's slots come back once the gateway sees it end
        deadline = time.monotonic() + 20
        while (status := post(base + "/completions", plain, alpha)[0]) == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        return status

    try:
        status, reply = post(base + "/completions", json.dumps({"model": model, "prompt": PROMPT, "n": 16}).encode(),
                             alpha)
        assert status == 400 and "weighs 16 slots" in reply["error"]["message"], reply
        over_http = openai.OpenAI(base_url=base, api_key="alpha-key", max_retries=0)
        with over_http.completions.create(model=model, prompt=PROMPT, max_tokens=200, n=2, logprobs=0,
                                          extra_body={"ignore_eos": True}, stream=True) as held:
            next(iter(held))
            loop.loop.call_soon_threadsafe(proxy.pause)  # the stream now waits on the verifier: still in flight
            status, reply = post(base + "/completions", plain, alpha)
            assert status == 429 and "holds 4 of the 4 slots" in reply["error"]["message"], reply
            loop.loop.call_soon_threadsafe(proxy.resume)
        assert served_again() == 200
        over_grpc = request(PROMPT, max_new_tokens=200, mode="OFF")
        over_grpc.n, over_grpc.sampling.logprobs, over_grpc.sampling.ignore_eos = 2, 0, True
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(over_grpc,
                                                                      metadata=[("authorization", "Bearer alpha-key")])
        next(stream)
        loop.loop.call_soon_threadsafe(proxy.pause)
        status, reply = post(base + "/completions", plain, alpha)
        assert status == 429 and "holds 4 of the 4 slots" in reply["error"]["message"], reply
        stream.cancel()
        loop.loop.call_soon_threadsafe(proxy.resume)
        assert served_again() == 200
    finally:
        loop.loop.call_soon_threadsafe(proxy.resume)
        channel.close()
        loop.run(gateway.stop(0))
        loop.run(proxy.close())
        loop.close()


def test_logprobs_in_openais_shapes(client, http_stack):
    """Chat's `logprobs: true` with `top_logprobs`, and completions' `logprobs: N`, whole and
    streamed: one entry per token, the chosen one heading its alternatives (greedy), the same
    figures as the gRPC API's."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        if "\ufffd" not in entry.token:  # a token that is part of a character has its own bytes (test_logprobs)
            assert bytes(entry.bytes).decode() == entry.token
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    grpc_reply = http_stack.stub.Generate(request(PROMPT, max_new_tokens=10, mode="AUTO"))
    legacy = completion.choices[0].logprobs
    assert "".join(legacy.tokens) == completion.choices[0].text == grpc_reply.text
    assert legacy.text_offset[0] == 0 and all(len(top) <= 2 for top in legacy.top_logprobs)
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                         stream=True)
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == legacy.tokens and values == pytest.approx(legacy.token_logprobs, abs=1e-4)  # float rounding


def test_structured_output_over_http(client):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs
    (choice, regex): every output has its structure and ends by itself."""
    model = client.models.list().data[0].id
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert json.loads(reply.choices[0].message.content) in ({"ok": True}, {"ok": False})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.speculation["num_drafts"] >= 0
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=3, n=2,
                                        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in sampled.choices)
    regex = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{2}"}})
    assert len(regex.choices[0].text) == 5 and regex.choices[0].text[2] == "-"
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
