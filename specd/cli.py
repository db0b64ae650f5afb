"""The `specd` command line.

    specd serve      draft + verifier + gateway as three local processes (the demo)
    specd draft      the draft service alone        (one per pod on Kubernetes)
    specd verifier   the verifier service alone
    specd gateway    the gateway alone
    specd generate   send a prompt to a gateway; print the text and acceptance figures
    specd bench      compare γ policies and target-only decoding against a running gateway
    specd distill    train a draft to agree with its target (KL to the target's outputs)
    specd trace      collect spans over OTLP into a file; show a request's steps (specd.tracecli)

Settings objects (`specd.config`) are built here from the flags, once, and passed in.
Tracing is configured by the standard OTEL_* variables only (`specd.telemetry`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specd.config import (DEMO_DRAFT, DEMO_TARGET, DraftSettings, GatewaySettings, ModelSettings,
                          ServerSettings, VerifierSettings)
from specd.supervisor import Supervisor
from specd.supervisor import stop_all as _stop_all  # noqa: F401 - tests stop their processes with it

DEFAULT_GATEWAY_PORT, DEFAULT_DRAFT_PORT, DEFAULT_VERIFIER_PORT = 50051, 50052, 50053


# -- the three services ---------------------------------------------------------------------

def _server_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=port, help=f"port to listen on (default {port})")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to drain on SIGTERM")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-sessions", type=int, default=64, help="KV caches kept (LRU beyond)")
    parser.add_argument("--device", default="cpu", help="torch device of the model(s): cpu, cuda, cuda:1")


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(args.host, args.port, args.grace)


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    return ModelSettings(args.dtype, args.threads, args.max_sessions, args.device)


def _parse_drafts(values: list[str]) -> dict[str, Path]:
    """`NAME=DIR` or `DIR` (named after the directory) → {name: dir}, in order."""
    drafts: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).name, value
        drafts[name] = Path(path)
    return drafts


async def _run_service(create, settings, what: str) -> None:
    from specd.serving import serve_until_signalled

    running = await create(settings)
    print(f"specd {what} listening on {settings.server.host}:{running.port}", flush=True)
    await serve_until_signalled(running, settings.server.grace_s)


def _set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def cmd_draft(args: argparse.Namespace) -> int:
    from draft_service.server import create_server
    from specd.telemetry import setup_tracing

    setup_tracing("specd-draft")

    _set_threads(args.threads)
    settings = DraftSettings(_server_settings(args), _parse_drafts(args.draft or [str(DEMO_DRAFT)]),
                             _model_settings(args))
    asyncio.run(_run_service(create_server, settings, "draft"))
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:
    from specd.telemetry import setup_tracing
    from verifier_service.server import create_server

    setup_tracing("specd-verifier")

    _set_threads(args.threads)
    settings = VerifierSettings(_server_settings(args), Path(args.target), _model_settings(args))
    asyncio.run(_run_service(create_server, settings, "verifier"))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.auth import KeyFileError
    from gateway.backend import IncompatibleDraft
    from gateway.server import create_server
    from specd.telemetry import setup_tracing

    setup_tracing("specd-gateway")
    settings = GatewaySettings(
        _server_settings(args), verifier_address=args.verifier_address,
        draft_address=args.draft_address, verifier_service=args.verifier_service,
        draft_service=args.draft_service, namespace=args.namespace, default_draft_length=args.draft_length,
        max_draft_length=args.max_draft_length, default_max_new_tokens=args.max_new_tokens,
        worker_timeout_s=args.worker_timeout, auto_policy=args.policy,
        task_drafts=dict(v.split("=", 1) for v in args.task_draft or []),
        metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        max_concurrent_requests=args.max_concurrent_requests,
        api_keys_file=Path(args.api_keys) if args.api_keys else None,
        protect_reflection=args.protect_reflection, key_max_in_flight=args.key_max_in_flight,
        max_request_bytes=args.max_request_bytes, max_prompt_bytes=args.max_prompt_bytes,
        max_new_tokens_cap=args.max_new_tokens_cap, max_streams_per_connection=args.max_streams_per_connection)
    try:
        asyncio.run(_run_service(create_server, settings, "gateway"))
    except (IncompatibleDraft, ConnectionError, KeyFileError) as exc:
        print(f"specd gateway: {exc}", file=sys.stderr)
        return 2
    return 0


# -- serve: the three together --------------------------------------------------------------

def _wait_healthy(address: str, procs: list[subprocess.Popen], timeout_s: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                return False
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                time.sleep(0.2)
    return False


def _edge_flags(args: argparse.Namespace) -> list[str]:
    """serve's API-key flags, passed on to its gateway."""
    flags = ["--api-keys", args.api_keys] if args.api_keys else []
    if args.protect_reflection:
        flags.append("--protect-reflection")
    return flags + ["--key-max-in-flight", str(args.key_max_in_flight)]


def cmd_serve(args: argparse.Namespace) -> int:
    target = Path(args.target or DEMO_TARGET)
    drafts = _parse_drafts(args.draft or [str(DEMO_DRAFT)])
    for role, path in (("target", target), *(("draft", p) for p in drafts.values())):
        if not (path / "config.json").is_file():
            print(f"specd serve: no {role} model at {path}. Pass --target DIR and --draft DIR "
                  f"(transformers model directories sharing one tokenizer), or make the demo pair "
                  f"with `python scripts/make_demo_pair.py`.", file=sys.stderr)
            return 2
    me = [sys.executable, "-m", "specd.cli"]
    draft_threads = args.threads if args.draft_threads < 0 else args.draft_threads
    workers = {
        "verifier": me + ["verifier", "--port", str(args.verifier_port), "--target", str(target),
                          "--dtype", args.dtype, "--threads", str(args.threads)],
        "draft": me + ["draft", "--port", str(args.draft_port), *[f"--draft={n}={p}" for n, p in drafts.items()],
                       "--dtype", args.dtype, "--threads", str(draft_threads)],
    }
    # The three processes share this machine's cores and take turns (draft, then
    # verifier): OpenMP threads that spin after a forward would steal the next
    # process's CPU (measured on 2 cores: 1.10× → 1.35× for γ = 4). Let them sleep.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    supervisor = Supervisor(env)
    for name, argv in workers.items():
        supervisor.start(name, argv)  # restarted with the same command (same port) when it dies
    supervisor.start("gateway", restart=False, argv=me + [
        "gateway", "--host", args.host, "--port", str(args.port),
        "--verifier-address", f"127.0.0.1:{args.verifier_port}",
        "--draft-address", f"127.0.0.1:{args.draft_port}",
        "--draft-length", str(args.draft_length), "--max-new-tokens", str(args.max_new_tokens),
        "--policy", args.policy, "--metrics-host", args.metrics_host, "--metrics-port", str(args.metrics_port),
        *[f"--task-draft={v}" for v in args.task_draft or []], *_edge_flags(args)])
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if not _wait_healthy(f"127.0.0.1:{args.port}", supervisor.processes, args.startup_timeout):
            print("specd serve: the services did not become healthy; see the messages above",
                  file=sys.stderr)
            return 1
        print(f"specd serve: ready on {args.host}:{args.port} (target {target}, drafts {list(drafts)}); "
              f"try: specd generate \"def fibonacci(n):\"", flush=True)
        # A worker that dies is restarted (with backoff); the gateway keeps serving meanwhile.
        while not stop["now"]:
            if not supervisor.check():
                return 1
            time.sleep(0.2)
        return 0
    finally:
        supervisor.stop(grace_s=15.0)


# -- generate: the client -------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from specd.v1 import gateway_pb2, gateway_pb2_grpc

    mode = {"auto": gateway_pb2.SPECULATION_MODE_AUTO, "fixed": gateway_pb2.SPECULATION_MODE_FIXED,
            "off": gateway_pb2.SPECULATION_MODE_OFF}[args.mode]
    request = gateway_pb2.GenerateRequest(
        prompt=args.prompt,
        sampling=gateway_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                            top_p=args.top_p, seed=args.seed,
                                            max_new_tokens=args.max_new_tokens, stop=args.stop or []),
        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_length=args.draft_length,
                                                  draft_model=args.draft_model, policy=args.policy),
        task_type=args.task_type, user_segment=args.user_segment)
    from specd.clientauth import MissingApiKey, with_api_key

    with grpc.insecure_channel(args.gateway) as channel:
        try:
            stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        except MissingApiKey as exc:
            print(f"specd generate: {exc}", file=sys.stderr)
            return 2
        if args.wait:
            try:
                grpc.channel_ready_future(channel).result(timeout=args.wait)
            except grpc.FutureTimeoutError:
                print(f"specd generate: no gateway at {args.gateway} after {args.wait} s", file=sys.stderr)
                return 1
        try:
            stats = None
            sys.stdout.write(args.prompt)
            for chunk in stub.GenerateStream(request, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.HasField("stats"):
                    stats, finish = chunk.stats, gateway_pb2.FinishReason.Name(chunk.finish_reason)
        except grpc.RpcError as exc:
            print(f"\nspecd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    tokens_per_s = stats.generated_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    print(f"\n\n--- {stats.generated_tokens} tokens in {stats.total_ms:.0f} ms ({tokens_per_s:.1f} tokens/s), "
          f"{finish.removeprefix('FINISH_REASON_').lower()}\n"
          f"acceptance rate {stats.acceptance_rate:.2f} ({stats.accepted_tokens}/{stats.proposed_tokens} "
          f"draft tokens accepted), {stats.mean_tokens_per_step:.2f} tokens per step over {stats.steps} steps, "
          f"draft {stats.draft_model or 'none'}, policy {stats.policy}, task {stats.task_type}, "
          f"γ per step {list(stats.draft_lengths)}, seed {stats.seed}", file=sys.stderr)
    return 0


# -- the parser -----------------------------------------------------------------------------

def _gateway_policy_args(parser: argparse.ArgumentParser) -> None:
    from gateway.policy import POLICIES

    parser.add_argument("--policy", choices=POLICIES, default="cost",
                        help="γ policy of SPECULATION_MODE_AUTO (default: cost)")
    parser.add_argument("--task-draft", action="append", metavar="TASK=DRAFT",
                        help="use this draft model for requests of this task type (repeatable)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="interface of the /metrics endpoint")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")


def _gateway_edge_args(parser: argparse.ArgumentParser) -> None:
    """API keys (gateway and serve): see docs/reliability.md."""
    parser.add_argument("--api-keys", metavar="FILE",
                        help="require API keys: one 'SEGMENT KEY' or 'SEGMENT sha256:HEX' a line; the key "
                             "decides the request's user segment")
    parser.add_argument("--protect-reflection", action="store_true",
                        help="with --api-keys, server reflection needs a key too (health checks never do)")
    parser.add_argument("--key-max-in-flight", type=int, default=0,
                        help="requests in flight per API key; more get RESOURCE_EXHAUSTED (0: no limit)")


def _api_key_env_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key-env", metavar="VAR", default="",
                        help="send the API key held in this environment variable (authorization: Bearer)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run draft, verifier and gateway locally (the demo)")
    serve.add_argument("--target", help=f"target model directory (default: the demo target, {DEMO_TARGET})")
    serve.add_argument("--draft", action="append", metavar="[NAME=]DIR",
                       help=f"draft model directory; repeat to host several, the first is the default "
                            f"(default: the demo draft, {DEMO_DRAFT})")
    serve.add_argument("--host", default="127.0.0.1", help="interface the gateway binds")
    serve.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port")
    serve.add_argument("--draft-port", type=int, default=DEFAULT_DRAFT_PORT)
    serve.add_argument("--verifier-port", type=int, default=DEFAULT_VERIFIER_PORT)
    serve.add_argument("--draft-length", type=int, default=4, help="default γ")
    serve.add_argument("--max-new-tokens", type=int, default=128, help="default generation length")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    # One thread: a small draft's matrices are too small to split, and with all three
    # processes on the same cores a second thread only adds wake-ups (measured on 2
    # cores with the demo pair: c 0.27 -> 0.21, γ=4 1.25x -> 1.28-1.32x). -1: as --threads.
    serve.add_argument("--draft-threads", type=int, default=1,
                       help="torch threads of the draft worker (default 1; -1: as --threads)")
    serve.add_argument("--startup-timeout", type=float, default=120.0)
    _gateway_policy_args(serve)
    _gateway_edge_args(serve)
    serve.set_defaults(func=cmd_serve)

    draft = sub.add_parser("draft", help="run the draft service")
    _server_args(draft, DEFAULT_DRAFT_PORT)
    draft.add_argument("--draft", action="append", metavar="[NAME=]DIR",
                       help="a draft model directory; repeat to host several (the first is the default)")
    _model_args(draft)
    draft.set_defaults(func=cmd_draft)

    verifier = sub.add_parser("verifier", help="run the verifier service")
    _server_args(verifier, DEFAULT_VERIFIER_PORT)
    verifier.add_argument("--target", default=str(DEMO_TARGET), help="target model directory")
    _model_args(verifier)
    verifier.set_defaults(func=cmd_verifier)

    gateway = sub.add_parser("gateway", help="run the gateway (the public API)")
    _server_args(gateway, DEFAULT_GATEWAY_PORT)
    gateway.add_argument("--verifier-address", default=f"127.0.0.1:{DEFAULT_VERIFIER_PORT}",
                         help="host:port of the verifier, or a comma list (sessions spread over them)")
    gateway.add_argument("--verifier-service", default="",
                         help="Kubernetes Service of the verifiers: watch its EndpointSlices instead")
    gateway.add_argument("--draft-service", default="",
                         help="Kubernetes Service of the drafts: watch its EndpointSlices instead")
    gateway.add_argument("--namespace", default="", help="namespace of those Services (default: the pod's)")
    gateway.add_argument("--draft-address", default=f"127.0.0.1:{DEFAULT_DRAFT_PORT}",
                         help="empty: no draft service, every request decodes plainly")
    gateway.add_argument("--draft-length", type=int, default=4, help="default γ")
    gateway.add_argument("--max-concurrent-requests", type=int, default=64,
                         help="requests served at once; more get RESOURCE_EXHAUSTED (keep ≤ --max-sessions)")
    gateway.add_argument("--max-draft-length", type=int, default=16, help="largest γ a request may ask")
    gateway.add_argument("--max-new-tokens", type=int, default=128, help="default generation length")
    gateway.add_argument("--worker-timeout", type=float, default=60.0,
                         help="seconds to wait for a worker at start-up and for each step")
    _gateway_policy_args(gateway)
    _gateway_edge_args(gateway)
    defaults = GatewaySettings(ServerSettings())
    gateway.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes,
                         help=f"largest request message accepted (default {defaults.max_request_bytes})")
    gateway.add_argument("--max-prompt-bytes", type=int, default=defaults.max_prompt_bytes,
                         help=f"largest prompt in UTF-8 bytes, checked before tokenizing "
                              f"(default {defaults.max_prompt_bytes})")
    gateway.add_argument("--max-new-tokens-cap", type=int, default=defaults.max_new_tokens_cap,
                         help=f"largest max_new_tokens a request may ask (default {defaults.max_new_tokens_cap})")
    gateway.add_argument("--max-streams-per-connection", type=int, default=defaults.max_streams_per_connection,
                         help=f"concurrent requests one client connection may carry "
                              f"(default {defaults.max_streams_per_connection})")
    gateway.set_defaults(func=cmd_gateway)

    generate = sub.add_parser("generate", help="generate from a running gateway")
    generate.add_argument("prompt")
    generate.add_argument("--gateway", default=f"127.0.0.1:{DEFAULT_GATEWAY_PORT}", metavar="HOST:PORT")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--max-new-tokens", type=int, default=0, help="0: the gateway's default")
    generate.add_argument("--stop", action="append")
    generate.add_argument("--mode", choices=["auto", "fixed", "off"], default="auto")
    generate.add_argument("--draft-length", type=int, default=0)
    generate.add_argument("--draft-model", default="")
    generate.add_argument("--policy", default="", help="fixed, ema, cost or confidence (default: the gateway's)")
    generate.add_argument("--task-type", default="")
    generate.add_argument("--user-segment", default="")
    generate.add_argument("--timeout", type=float, default=300.0, help="deadline of the request, seconds")
    generate.add_argument("--wait", type=float, default=0.0,
                          help="seconds to wait for the gateway to come up (e.g. right after specd serve)")
    _api_key_env_arg(generate)
    generate.set_defaults(func=cmd_generate)

    from specd.tracecli import add_parser as add_trace_parser

    add_trace_parser(sub)

    from specd import bench as bench_module
    from specd import distill as distill_module

    bench = sub.add_parser("bench", help="compare γ policies and target-only against a running gateway")
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run)

    distill = sub.add_parser("distill", help="train a draft to agree with its target")
    distill_module.add_arguments(distill)
    distill.set_defaults(func=distill_module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
