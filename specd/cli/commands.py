"""The `specd` command line.

    specd serve      draft + verifier + gateway as three local processes (the demo)
    specd draft      the draft service alone        (one per pod on Kubernetes)
    specd verifier   the verifier service alone
    specd gateway    the gateway alone
    specd generate   send a prompt to a gateway; print the text and acceptance figures
    specd bench      compare γ policies and target-only decoding against a running gateway
    specd distill    train a draft to agree with its target (KL to the target's outputs)
    specd trace      collect spans over OTLP into a file; show a request's steps (specd.cli.trace)
    specd certs      write a development CA and server/client certificates (specd.cli.certs)

Settings objects (`specd.config`, `specd.worker.settings`, `gateway.settings`) are built
here from the flags, once, and passed in.
Tracing is configured by the standard OTEL_* variables only (`specd.telemetry`).
TLS: every service takes --tls-cert/--tls-key (and --tls-client-ca for mutual TLS), the
gateway --worker-ca/--worker-cert/--worker-key, clients --ca (docs/tls.md).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.drift import DriftSettings
from gateway.proposers import MODEL_FREE
from gateway.settings import CLI_DRAFT_SELECTION, DRAFT_SELECTIONS, GatewaySettings
from specd.cli.clientauth import MissingApiKey, add_api_key_argument
from specd.config import (
    DEFAULT_DRAFT_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_VERIFIER_PORT,
    DEMO_DRAFT,
    DEMO_TARGET,
    ClientTLS,
    ServerSettings,
    ServerTLS,
)
from specd.tls import TLSConfigError, add_client_arguments, check_client_tls, check_server_tls, client_tls_from_args
from specd.worker.hub import ModelNotFound, model_name, resolve
from specd.worker.identity import weight_files
from specd.worker.settings import DTYPES, BatchSettings, DraftSettings, ModelSettings, VerifierSettings

# Flag defaults come from the settings objects (specd.config), never from literals here.
SERVER = ServerSettings()
MODEL = ModelSettings()
DRAFT = DraftSettings(SERVER)
VERIFIER = VerifierSettings(SERVER)
GATEWAY = GatewaySettings(SERVER)


# -- the three services ---------------------------------------------------------------------

def _server_args(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default=SERVER.host, help="interface to bind (0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=port, help=f"port to listen on (default {port})")
    parser.add_argument("--grace", type=float, default=SERVER.grace_s, help="seconds to drain on SIGTERM")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the certificate's private key (PEM)")
    parser.add_argument("--tls-client-ca", type=Path, metavar="FILE",
                        help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument("--health-port", type=int, default=SERVER.health_port,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for Kubernetes "
                             "probes, which cannot speak TLS); 0: off")
    parser.add_argument("--port-file", type=Path, metavar="FILE",
                        help="write the port listened on to this file once serving (with --port 0)")
    parser.add_argument("--socket", type=Path, metavar="PATH",
                        help="listen on this Unix domain socket instead of --host/--port: only processes "
                             "that may enter its directory can connect (how specd serve links its workers)")


def _model_args(parser: argparse.ArgumentParser, defaults: DraftSettings | VerifierSettings) -> None:
    parser.add_argument("--dtype", default=defaults.model.dtype, choices=DTYPES)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: one for a model under 32 MiB of weights on a CPU, "
                             "else torch's default)")
    parser.add_argument("--max-sessions", type=int, default=defaults.model.max_sessions,
                        help="KV caches kept (LRU beyond)")
    parser.add_argument("--device", default=defaults.model.device,
                        help="torch device of the model(s): cpu, cuda, cuda:1")
    parser.add_argument("--cpus", default="", metavar="LIST",
                        help="pin the worker to these CPUs (e.g. 0 or 2-3), as it would own a GPU; torch threads "
                             "default to one per CPU")
    _batch_args(parser)
    parser.add_argument("--metrics-host", default=defaults.metrics_host, help="interface of the /metrics endpoint")
    parser.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                        help="serve Prometheus metrics (sessions held, steps queued, KV bytes) at "
                             "http://HOST:PORT/metrics (0: off)")


def _batch_args(parser: argparse.ArgumentParser) -> None:
    """How a worker batches the steps of all its sessions (specd.worker.batching); defaults from BatchSettings."""
    d = BatchSettings()
    parser.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                        help=f"tokens in one batched forward, all sessions together (default {d.max_batch_tokens})")
    parser.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                        help=f"feed a long prompt this many tokens per forward, so it does not hold up "
                             f"other sessions' steps (default {d.prefill_chunk})")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help=f"steps waiting for the model; beyond, RESOURCE_EXHAUSTED (default {d.max_queue})")
    parser.add_argument("--kv-cache-tokens", type=int, default=d.kv_cache_tokens,
                        help="positions the KV pool holds, all sessions together (default 0: every session "
                             "at full context, within half the memory free at load, the GPU's or the host's)")
    parser.add_argument("--batch-wait-ms", type=float, default=d.max_wait_ms,
                        help=f"how long a forward may wait for other open sessions' steps to share it, at most "
                             f"a quarter of a forward (default {d.max_wait_ms}; 0: start at once)")


def _server_settings(args: argparse.Namespace) -> ServerSettings:
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    check_server_tls(tls)
    return ServerSettings(args.host, args.port, args.grace, tls, args.health_port, args.socket)


def _batch_settings(args: argparse.Namespace) -> BatchSettings:
    settings = BatchSettings(args.max_batch_tokens, args.prefill_chunk, args.max_queue,
                             kv_cache_tokens=args.kv_cache_tokens, max_wait_ms=args.batch_wait_ms)
    if settings.problems():
        raise SystemExit(f"specd: {'; '.join(settings.problems())}")
    return settings


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    return ModelSettings(args.dtype, args.max_sessions, args.device, _batch_settings(args))


def _worker_flags(args: argparse.Namespace) -> list[str]:
    """The model and batching flags of `specd serve`, passed on to both workers."""
    return ["--device", args.device, "--max-sessions", str(args.max_sessions),
            "--max-batch-tokens", str(args.max_batch_tokens), "--prefill-chunk", str(args.prefill_chunk),
            "--max-queue", str(args.max_queue), "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--batch-wait-ms", str(args.batch_wait_ms)]


def _parse_drafts(values: list[str]) -> dict[str, str]:
    """`NAME=MODEL` or `MODEL` (named after its directory, or NAME of ORG/NAME) → {name:
    model}, in order; a model is a directory or a hub id (`specd.worker.hub`)."""
    drafts: dict[str, str] = {}
    for value in values:
        name, sep, model = value.partition("=")
        if not sep:
            name, model = model_name(value), value
        drafts[name] = model
    return drafts


async def _run_service(create, settings, what: str, port_file: Path | None) -> None:
    from specd.grpcserver import serve_until_signalled

    running = await create(settings)
    scheme = "TLS" if settings.server.tls.enabled else "plaintext"
    where = settings.server.address if settings.server.socket else f"{settings.server.host}:{running.port}"
    print(f"specd {what} listening on {where} ({scheme})", flush=True)
    if port_file is not None:
        # Whole or absent: a supervisor polling the file never reads half a number.
        partial = port_file.with_name(port_file.name + ".partial")
        partial.write_text(str(running.port))
        partial.replace(port_file)
    await serve_until_signalled(running, settings.server.grace_s)


def _serve(create, settings, what: str, port_file: Path | None) -> int:
    """Run a service until signalled; exit status 2 with the reason if its port is taken.

    Checked first, before a model loads or a worker is waited for (minutes, for a large
    model); the server's exclusive bind is what makes it certain.
    """
    from specd.grpcserver import PortInUse

    server = settings.server
    try:
        for port, kind in (((0 if server.socket else server.port), "port"), (server.health_port, "health port")):
            if _port_taken(server.host, port):
                raise PortInUse(f"{server.host}:{port}", kind)
        asyncio.run(_run_service(create, settings, what, port_file))
    except PortInUse as exc:
        print(f"specd {what}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


def _set_threads(threads: int, cpus: str = "") -> None:
    """Pin the process to `cpus` (e.g. "0" or "2-3,6"), as a model owns its GPU; torch threads
    default to one per pinned CPU."""
    if cpus:
        pinned = _parse_cpus(cpus)
        os.sched_setaffinity(0, pinned)
        threads = threads or len(pinned)
    if threads:
        import torch

        torch.set_num_threads(threads)


# Below this much weight, a model's matrices are too small to split across torch threads
# on a CPU: one thread ran the near-free target (6 MB) 2.3× faster at 1 request in flight,
# and the demo target (61 MB) was faster with torch's default (docs/performance.md).
SMALL_MODEL_BYTES = 32 * 1024 * 1024


def _default_threads(model: Path, device: str) -> int:
    """Torch threads for a worker when --threads is 0: one for a small model on a CPU,
    else 0 (torch's default). A draft service takes the default of its largest draft."""
    if device != "cpu" or not model.is_dir():
        return 0
    return 1 if sum(f.stat().st_size for f in weight_files(model)) < SMALL_MODEL_BYTES else 0


def _parse_cpus(value: str) -> set[int]:
    """"0,2-3" → {0, 2, 3}; a CPU this machine lacks is a clear error."""
    cpus: set[int] = set()
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise SystemExit(f"specd: --cpus {value!r}: use CPU numbers and ranges like 0,2-3")
        cpus.update(range(int(first), int(last or first) + 1))
    unknown = cpus - os.sched_getaffinity(0)
    if unknown:
        raise SystemExit(f"specd: --cpus {value!r}: CPUs {sorted(unknown)} are not available here "
                         f"(available: {sorted(os.sched_getaffinity(0))})")
    return cpus


def cmd_draft(args: argparse.Namespace) -> int:
    from draft_service.server import create_server
    from specd.telemetry import setup_tracing
    from specd.worker.predraft import check_branches

    setup_tracing("specd-draft")

    try:
        check_branches(args.pre_draft_branches)
    except ValueError as exc:
        print(f"specd draft: --pre-draft-branches: {exc}", file=sys.stderr)
        return 2
    try:
        drafts = {name: resolve(model, args.revision) for name, model in
                  _parse_drafts(args.draft or [str(DEMO_DRAFT)]).items()}
    except ModelNotFound as exc:
        print(f"specd draft: {exc}", file=sys.stderr)
        return 2
    _set_threads(args.threads or min(_default_threads(path, args.device) for path in drafts.values()), args.cpus)
    settings = DraftSettings(_server_settings(args), drafts, _model_settings(args), args.metrics_host,
                             args.metrics_port, args.pre_draft_branches)
    return _serve(create_server, settings, "draft", args.port_file)


def cmd_verifier(args: argparse.Namespace) -> int:
    from specd.telemetry import setup_tracing
    from verifier_service.server import create_server

    setup_tracing("specd-verifier")

    try:
        target = resolve(args.target, args.revision)
    except ModelNotFound as exc:
        print(f"specd verifier: {exc}", file=sys.stderr)
        return 2
    _set_threads(args.threads or _default_threads(target, args.device), args.cpus)
    settings = VerifierSettings(_server_settings(args), target, _model_settings(args), args.metrics_host,
                                args.metrics_port, target_name=model_name(args.target))
    return _serve(create_server, settings, "verifier", args.port_file)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.auth import KeyFileError
    from gateway.backend import IncompatibleDraft
    from gateway.server import create_server
    from specd.telemetry import setup_tracing

    setup_tracing("specd-gateway")
    worker_tls = ClientTLS(args.worker_ca, args.worker_cert, args.worker_key, args.worker_server_name)
    check_client_tls(worker_tls, "--worker-ca", "--worker-cert", "--worker-key")
    settings = GatewaySettings(
        _server_settings(args), verifier_address=args.verifier_address, worker_tls=worker_tls,
        draft_address=args.draft_address, verifier_service=args.verifier_service,
        draft_service=args.draft_service, namespace=args.namespace, default_draft_length=args.draft_length,
        max_draft_length=args.max_draft_length, default_max_new_tokens=args.max_new_tokens,
        worker_timeout_s=args.worker_timeout, draft_step_floor_s=args.draft_step_floor,
        verifier_step_floor_s=args.verifier_step_floor, step_budget_factor=args.step_budget_factor,
        auto_policy=args.policy, overlap=args.overlap,
        task_drafts=dict(v.split("=", 1) for v in args.task_draft or []),
        metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        max_concurrent_requests=args.max_concurrent_requests,
        api_keys_file=Path(args.api_keys) if args.api_keys else None,
        protect_reflection=args.protect_reflection, key_max_in_flight=args.key_max_in_flight,
        max_request_bytes=args.max_request_bytes, max_prompt_bytes=args.max_prompt_bytes,
        max_new_tokens_cap=args.max_new_tokens_cap, max_streams_per_connection=args.max_streams_per_connection,
        draft_selection=args.draft_selection, drift=DriftSettings(min_drop=args.drift_min_drop),
        acceptance_baseline=args.acceptance_baseline,
        model_free=tuple(name for name in args.model_free.split(",") if name),
        suffix_cache_tokens=args.suffix_cache_tokens, prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max, http_port=args.http_port, chat_template=args.chat_template)
    try:
        return _serve(create_server, settings, "gateway", args.port_file)
    except (IncompatibleDraft, ConnectionError, KeyFileError, ValueError) as exc:
        print(f"specd gateway: {exc}", file=sys.stderr)
        return 2


# -- serve: the three together --------------------------------------------------------------

def wait_healthy(address: str, procs: list[subprocess.Popen], timeout_s: float,
                 tls: ClientTLS = ClientTLS()) -> bool:
    """Whether the server at `address` reports SERVING (grpc.health.v1) within timeout_s;
    False as soon as one of `procs` has exited."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specd.tls import client_channel

    deadline = time.monotonic() + timeout_s
    with client_channel(address, tls) as channel:
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


def _port_taken(host: str, port: int) -> bool:
    """Whether something already listens on (or holds) host:port. Port 0 is never taken."""
    if not port:
        return False
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As gRPC does: a port left in TIME_WAIT by a stopped server is free, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _tls_dir(directory: Path) -> dict[str, Path]:
    """The files of `specd certs DIR`; TLSConfigError naming the missing ones."""
    from specd.cli.certs import FILES

    paths = {name: directory / name for name in FILES}
    missing = [name for name, path in paths.items() if not path.is_file()]
    if missing:
        raise TLSConfigError(f"--tls {directory}: missing {', '.join(missing)}; make them with "
                             f"`specd certs {directory}`")
    return paths


def _edge_flags(args: argparse.Namespace) -> list[str]:
    """serve's API-key flags, passed on to its gateway."""
    flags = ["--api-keys", args.api_keys] if args.api_keys else []
    if args.protect_reflection:
        flags.append("--protect-reflection")
    return flags + ["--key-max-in-flight", str(args.key_max_in_flight)]


def cmd_serve(args: argparse.Namespace) -> int:
    target = args.target or str(DEMO_TARGET)
    drafts = _parse_drafts(args.draft or [str(DEMO_DRAFT)])
    for role, model in (("target", target), *(("draft", m) for m in drafts.values())):
        try:  # resolved here (fetched into the cache once) so that a wrong name stops serve at once
            resolve(model, args.revision)
        except ModelNotFound as exc:
            print(f"specd serve: no {role} model: {exc}. Pass --target and --draft as model directories "
                  f"or hub ids ORG/NAME sharing one tokenizer, or make the demo pair with "
                  f"`python scripts/make_demo_pair.py`.", file=sys.stderr)
            return 2
    # Checked before anything loads; the server's exclusive bind makes it certain.
    if _port_taken(args.host, args.port):
        print(f"specd serve: port {args.port} on {args.host} is taken (another specd serve?); pass --port "
              f"with a free port", file=sys.stderr)
        return 2
    worker_tls: list[str] = []
    gateway_tls: list[str] = []
    client_tls = ClientTLS()
    link_tls = ClientTLS()  # how serve itself checks that a worker is up
    if args.tls:
        # TLS without client certificates at the edge; mutual TLS on the workers' sockets.
        files = {name: str(path) for name, path in _tls_dir(Path(args.tls)).items()}
        server = ["--tls-cert", files["server.pem"], "--tls-key", files["server-key.pem"]]
        worker_tls = [*server, "--tls-client-ca", files["ca.pem"]]
        gateway_tls = [*server, "--worker-ca", files["ca.pem"], "--worker-cert", files["client.pem"],
                       "--worker-key", files["client-key.pem"]]
        client_tls = ClientTLS(ca=Path(files["ca.pem"]))
        link_tls = ClientTLS(Path(files["ca.pem"]), Path(files["client.pem"]), Path(files["client-key.pem"]))
    me = [sys.executable, "-m", "specd.cli"]
    draft_threads = args.threads if args.draft_threads < 0 else args.draft_threads
    # The three processes share this machine's cores and take turns (draft, then
    # verifier): OpenMP threads that spin after a forward would steal the next
    # process's CPU (the figures: README, Benchmarks). Let them sleep.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from specd.cli.supervisor import Supervisor

    supervisor = Supervisor(env)
    # The workers listen on Unix domain sockets in a directory only this user may enter
    # (mkdtemp makes it 0700): no other local user, and no other host, reaches them. A
    # restarted worker binds the same path, which the gateway keeps dialling.
    with tempfile.TemporaryDirectory(prefix="specd-serve-") as run_dir:
        sockets = {"verifier": Path(run_dir) / "verifier.sock", "draft": Path(run_dir) / "draft.sock"}
        workers = {
            "verifier": me + ["verifier", "--socket", str(sockets["verifier"]),
                              "--target", target, "--revision", args.revision, "--dtype", args.dtype,
                              "--threads", str(args.threads),
                              *worker_tls, *_worker_flags(args),
                              *(["--cpus", args.verifier_cpus] if args.verifier_cpus else [])],
            "draft": me + ["draft", "--socket", str(sockets["draft"]), "--revision", args.revision,
                           *[f"--draft={n}={p}" for n, p in drafts.items()],
                           "--dtype", args.dtype, "--threads", str(draft_threads), *worker_tls, *_worker_flags(args),
                           "--pre-draft-branches", args.pre_draft_branches,
                           *(["--cpus", args.draft_cpus] if args.draft_cpus else [])],
        }
        try:
            for name, argv in workers.items():
                supervisor.start(name, argv)
            for name, path in sockets.items():
                if not wait_healthy(f"unix:{path}", supervisor.processes, args.startup_timeout, link_tls):
                    print(f"specd serve: the {name} worker did not start; see the messages above", file=sys.stderr)
                    return 1
            supervisor.start("gateway", restart=False, argv=me + [
                "gateway", "--host", args.host, "--port", str(args.port),
                "--verifier-address", f"unix:{sockets['verifier']}",
                "--draft-address", f"unix:{sockets['draft']}", *gateway_tls,
                "--draft-length", str(args.draft_length), "--max-new-tokens", str(args.max_new_tokens),
                "--policy", args.policy, *(["--overlap"] if args.overlap else []),
                "--metrics-host", args.metrics_host, "--metrics-port", str(args.metrics_port),
                "--draft-selection", args.draft_selection, "--drift-min-drop", str(args.drift_min_drop),
                *(["--acceptance-baseline", str(args.acceptance_baseline)] if args.acceptance_baseline else []),
                *[f"--task-draft={v}" for v in args.task_draft or []], *_edge_flags(args),
                *_proposer_and_http_flags(args),
                "--step-budget-factor", str(args.step_budget_factor),
                "--draft-step-floor", str(args.draft_step_floor),
                "--verifier-step-floor", str(args.verifier_step_floor)])
            if not wait_healthy(f"127.0.0.1:{args.port}", supervisor.processes, args.startup_timeout, client_tls):
                print("specd serve: the services did not become healthy; see the messages above",
                      file=sys.stderr)
                return 1
            print(f"specd serve: ready on {args.host}:{args.port}{' (TLS)' if args.tls else ''} "
                  f"(target {target}, drafts {list(drafts)}; workers on private sockets "
                  f"unix:{sockets['verifier']}, unix:{sockets['draft']})"
                  f"{f'; OpenAI-compatible HTTP on port {args.http_port}' if args.http_port is not None else ''}"
                  f"; try: specd generate "
                  f"{'--ca ' + str(Path(args.tls) / 'ca.pem') + ' ' if args.tls else ''}\"def fibonacci(n):\"",
                  flush=True)
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

    from specd.tls import client_channel
    from specd.v1 import gateway_pb2, gateway_pb2_grpc

    mode = {"auto": gateway_pb2.SPECULATION_MODE_AUTO, "fixed": gateway_pb2.SPECULATION_MODE_FIXED,
            "off": gateway_pb2.SPECULATION_MODE_OFF}[args.mode]
    request = gateway_pb2.GenerateRequest(
        prompt=args.prompt,
        sampling=gateway_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                            top_p=args.top_p, seed=args.seed,
                                            max_new_tokens=args.max_new_tokens or None, stop=args.stop or []),
        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_length=args.draft_length,
                                                  draft_model=args.draft_model, policy=args.policy),
        task_type=args.task_type, user_segment=args.user_segment)
    from specd.cli.clientauth import with_api_key

    with client_channel(args.gateway, client_tls_from_args(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
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
    assert stats is not None  # the gateway's last chunk carries them
    tokens_per_s = stats.generated_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    print(f"\n\n--- {stats.generated_tokens} tokens in {stats.total_ms:.0f} ms ({tokens_per_s:.1f} tokens/s), "
          f"{finish.removeprefix('FINISH_REASON_').lower()}\n"
          f"acceptance rate {stats.acceptance_rate:.2f} ({stats.accepted_tokens}/{stats.proposed_tokens} "
          f"draft tokens accepted), {stats.mean_tokens_per_step:.2f} tokens per step over {stats.steps} steps, "
          f"draft {stats.draft_model or 'none'}, policy {stats.policy}, task {stats.task_type}, "
          f"γ per step {list(stats.draft_lengths)}, seed {stats.seed}", file=sys.stderr)
    drafted = collections.Counter(p for p in stats.proposers if p)
    if set(drafted) - {stats.draft_model}:  # model-free proposers drafted some steps: say which
        print("steps drafted by " + ", ".join(f"{name} ×{n}" for name, n in drafted.most_common()), file=sys.stderr)
    return 0


# -- the parser -----------------------------------------------------------------------------

def _step_budget_args(parser: argparse.ArgumentParser) -> None:
    """How long a worker step may take before the gateway stops waiting (gateway and serve)."""
    parser.add_argument("--step-budget-factor", type=float, default=GATEWAY.step_budget_factor,
                        help="a worker step may take this many times the service's measured p99 step time "
                             "(per 128 tokens fed), and never less than its floor (docs/reliability.md)")
    parser.add_argument("--draft-step-floor", type=float, default=GATEWAY.draft_step_floor_s, metavar="SECONDS",
                        help="shortest draft step budget; a draft step past its budget is skipped and the "
                             f"draft probed later (default {GATEWAY.draft_step_floor_s})")
    parser.add_argument("--verifier-step-floor", type=float, default=GATEWAY.verifier_step_floor_s,
                        metavar="SECONDS",
                        help="shortest verifier step budget; past it the session moves to another verifier, "
                             f"or the request ends UNAVAILABLE (default {GATEWAY.verifier_step_floor_s})")


def _gateway_policy_args(parser: argparse.ArgumentParser) -> None:
    from gateway.policy import POLICIES

    parser.add_argument("--policy", choices=POLICIES, default=GATEWAY.auto_policy,
                        help=f"γ policy of SPECULATION_MODE_AUTO (default: {GATEWAY.auto_policy})")
    parser.add_argument("--task-draft", action="append", metavar="TASK=DRAFT",
                        help="use this draft model for requests of this task type (repeatable)")
    parser.add_argument("--overlap", action="store_true",
                        help="overlapped speculation by default: the draft pre-drafts the next step while "
                             "the target verifies (requests may still set speculation.overlap)")
    parser.add_argument("--metrics-host", default=GATEWAY.metrics_host, help="interface of the /metrics endpoint")
    parser.add_argument("--metrics-port", type=int, default=GATEWAY.metrics_port,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")
    parser.add_argument("--draft-selection", choices=DRAFT_SELECTIONS, default=CLI_DRAFT_SELECTION,
                        help="draft of a request that names none: goodput (the best measured tokens/ms per "
                             "task type and user segment, starting from --task-draft) or task-map")
    parser.add_argument("--drift-min-drop", type=float, default=GATEWAY.drift.min_drop, metavar="POINTS",
                        help="acceptance drop (0..1) of the sliding window below its reference that raises "
                             "the drift flag when significant (default %(default)s)")
    parser.add_argument("--acceptance-baseline", type=Path, metavar="FILE",
                        help="judge drift against this pinned acceptance per model pair and task type "
                             "(`specd doctor --write-baseline FILE` writes one) instead of lifetime acceptance")
    parser.add_argument("--model-free", default=",".join(MODEL_FREE), metavar="LIST",
                        help="model-free proposers the gateway hosts, comma-separated (suffix, prompt-lookup; "
                             "empty: none): they draft from tokens already seen, beside the draft model "
                             "(default %(default)s)")
    parser.add_argument("--suffix-cache-tokens", type=int, default=GATEWAY.suffix_cache_tokens, metavar="N",
                        help="tokens of previous responses the suffix proposer keeps, over every tenant; the "
                             "oldest leave first (default %(default)s)")
    parser.add_argument("--prompt-lookup-min", type=int, default=GATEWAY.prompt_lookup_min, metavar="N",
                        help="shortest n-gram prompt lookup matches (default %(default)s)")
    parser.add_argument("--prompt-lookup-max", type=int, default=GATEWAY.prompt_lookup_max, metavar="N",
                        help="longest n-gram prompt lookup matches (default %(default)s)")
    parser.add_argument("--http-port", type=int, default=None, metavar="N",
                        help="also serve OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /v1/models, "
                             "/health) on this port of the gateway's host (default: off)")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's own)")


def _proposer_and_http_flags(args: argparse.Namespace) -> list[str]:
    """The model-free proposer and HTTP front end flags, as `serve` hands them to its gateway."""
    return ["--model-free", args.model_free, "--suffix-cache-tokens", str(args.suffix_cache_tokens),
            "--prompt-lookup-min", str(args.prompt_lookup_min), "--prompt-lookup-max", str(args.prompt_lookup_max),
            *(["--http-port", str(args.http_port)] if args.http_port is not None else []),
            *(["--chat-template", str(args.chat_template)] if args.chat_template else [])]


def _revision_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", default="",
                        help="branch, tag or commit of the hub ids that name none (default: main); HF_HOME is the "
                             "cache, HF_HUB_OFFLINE=1 reads only the cache, HF_TOKEN opens gated models")


def _gateway_default_args(parser: argparse.ArgumentParser) -> None:
    """What a request gets when it does not say (gateway and serve)."""
    parser.add_argument("--draft-length", type=int, default=GATEWAY.default_draft_length, help="default γ")
    parser.add_argument("--max-new-tokens", type=int, default=GATEWAY.default_max_new_tokens,
                        help="default generation length")


def _gateway_edge_args(parser: argparse.ArgumentParser) -> None:
    """API keys (gateway and serve): see docs/reliability.md."""
    parser.add_argument("--api-keys", metavar="FILE",
                        help="require API keys: one 'SEGMENT KEY' or 'SEGMENT sha256:HEX' a line; the key "
                             "decides the request's user segment")
    parser.add_argument("--protect-reflection", action="store_true",
                        help="with --api-keys, server reflection needs a key too (health checks never do)")
    parser.add_argument("--key-max-in-flight", type=int, default=GATEWAY.key_max_in_flight,
                        help="requests in flight per tenant (segment of the key file); more get RESOURCE_EXHAUSTED "
                             "(0: three quarters of --max-concurrent-requests when the file names several tenants)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run draft, verifier and gateway locally (the demo)")
    serve.add_argument("--target", help=f"target model: a directory or a hub id ORG/NAME[@REVISION] (default: the "
                                        f"demo target, {DEMO_TARGET})")
    _revision_arg(serve)
    serve.add_argument("--draft", action="append", metavar="[NAME=]MODEL",
                       help=f"draft model: a directory or a hub id ORG/NAME[@REVISION]; repeat to host several, the "
                            f"first is the default (default: the demo draft, {DEMO_DRAFT})")
    serve.add_argument("--host", default=SERVER.host, help="interface the gateway binds")
    serve.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port")
    serve.add_argument("--tls", metavar="DIR",
                       help="a `specd certs` directory: TLS (no client certificates) for clients of the "
                            "gateway, and mutual TLS on the workers' private sockets as well")
    _gateway_default_args(serve)
    serve.add_argument("--dtype", default=MODEL.dtype, choices=DTYPES)
    serve.add_argument("--device", default=MODEL.device,
                       help="torch device of both workers' models: cpu, cuda, cuda:1 (default %(default)s)")
    serve.add_argument("--max-sessions", type=int, default=MODEL.max_sessions,
                       help="KV caches each worker keeps, LRU beyond (default %(default)s)")
    serve.add_argument("--threads", type=int, default=0,
                       help="torch threads of the verifier (0: one for a target under 32 MiB of weights on a CPU, "
                            "else torch's default)")
    # One thread: a small draft's matrices are too small to split, and with all three
    # processes on the same cores a second thread only adds wake-ups (the figures: README,
    # Benchmarks). -1: as --threads.
    serve.add_argument("--draft-threads", type=int, default=1,
                       help="torch threads of the draft worker (default 1; -1: as --threads)")
    serve.add_argument("--startup-timeout", type=float, default=120.0)
    serve.add_argument("--draft-cpus", default="", metavar="LIST",
                       help="pin the draft worker to these CPUs (e.g. 0), as if it owned a GPU")
    serve.add_argument("--verifier-cpus", default="", metavar="LIST",
                       help="pin the verifier worker to these CPUs (e.g. 1)")
    serve.add_argument("--pre-draft-branches", default=DRAFT.pre_draft_branches, metavar="all|bonus|K",
                       help="with --overlap: which verdicts the draft pre-drafts for (see specd draft --help)")
    _batch_args(serve)
    _gateway_policy_args(serve)
    _gateway_edge_args(serve)
    _step_budget_args(serve)
    serve.set_defaults(func=cmd_serve)

    draft = sub.add_parser("draft", help="run the draft service")
    _server_args(draft, DEFAULT_DRAFT_PORT)
    draft.add_argument("--draft", action="append", metavar="[NAME=]MODEL",
                       help="a draft model: a directory or a hub id ORG/NAME[@REVISION]; repeat to host several "
                            "(the first is the default)")
    _revision_arg(draft)
    _model_args(draft, DRAFT)
    draft.add_argument("--pre-draft-branches", default=DRAFT.pre_draft_branches, metavar="all|bonus|K",
                       help="overlapped speculation: pre-draft for every accepted length (all), only for everything "
                            "accepted (bonus), or for the K verdicts the draft finds most likely (default "
                            f"{DRAFT.pre_draft_branches})")
    draft.set_defaults(func=cmd_draft)

    verifier = sub.add_parser("verifier", help="run the verifier service")
    _server_args(verifier, DEFAULT_VERIFIER_PORT)
    verifier.add_argument("--target", default=str(VERIFIER.target),
                          help="target model: a directory or a hub id ORG/NAME[@REVISION]")
    _revision_arg(verifier)
    _model_args(verifier, VERIFIER)
    verifier.set_defaults(func=cmd_verifier)

    gateway = sub.add_parser("gateway", help="run the gateway (the public API)")
    _server_args(gateway, DEFAULT_GATEWAY_PORT)
    gateway.add_argument("--verifier-address", default=GATEWAY.verifier_address,
                         help="host:port of the verifier, or a comma list (sessions spread over them)")
    gateway.add_argument("--verifier-service", default="",
                         help="Kubernetes Service of the verifiers: watch its EndpointSlices instead")
    gateway.add_argument("--draft-service", default="",
                         help="Kubernetes Service of the drafts: watch its EndpointSlices instead")
    gateway.add_argument("--namespace", default=GATEWAY.namespace,
                         help="namespace of those Services (default: the pod's)")
    gateway.add_argument("--draft-address", default=GATEWAY.draft_address,
                         help="empty: no draft service, every request decodes plainly")
    _gateway_default_args(gateway)
    gateway.add_argument("--max-concurrent-requests", type=int, default=GATEWAY.max_concurrent_requests,
                         help="requests served at once; more get RESOURCE_EXHAUSTED (keep ≤ --max-sessions)")
    gateway.add_argument("--max-draft-length", type=int, default=GATEWAY.max_draft_length,
                         help="largest γ a request may ask")
    gateway.add_argument("--worker-timeout", type=float, default=GATEWAY.worker_timeout_s,
                         help="seconds to wait for the workers at start-up")
    _step_budget_args(gateway)
    gateway.add_argument("--worker-ca", type=Path, metavar="FILE",
                         help="reach the workers over TLS, trusting certificates signed by this CA")
    gateway.add_argument("--worker-cert", type=Path, metavar="FILE",
                         help="client certificate presented to the workers (mutual TLS)")
    gateway.add_argument("--worker-key", type=Path, metavar="FILE", help="the client certificate's private key")
    gateway.add_argument("--worker-server-name", default=GATEWAY.worker_tls.server_name,
                         help="name to check in the workers' certificates (default: the dialled host, "
                              "or the Service name with --verifier-service/--draft-service)")
    _gateway_policy_args(gateway)
    _gateway_edge_args(gateway)
    gateway.add_argument("--max-request-bytes", type=int, default=GATEWAY.max_request_bytes,
                         help=f"largest request message accepted (default {GATEWAY.max_request_bytes})")
    gateway.add_argument("--max-prompt-bytes", type=int, default=GATEWAY.max_prompt_bytes,
                         help=f"largest prompt in UTF-8 bytes, checked before tokenizing "
                              f"(default {GATEWAY.max_prompt_bytes})")
    gateway.add_argument("--max-new-tokens-cap", type=int, default=GATEWAY.max_new_tokens_cap,
                         help=f"largest max_new_tokens a request may ask (default {GATEWAY.max_new_tokens_cap})")
    gateway.add_argument("--max-streams-per-connection", type=int, default=GATEWAY.max_streams_per_connection,
                         help=f"concurrent requests one client connection may carry "
                              f"(default {GATEWAY.max_streams_per_connection})")
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
    add_client_arguments(generate)
    add_api_key_argument(generate)
    generate.set_defaults(func=cmd_generate)

    from specd.cli.trace import add_parser as add_trace_parser

    add_trace_parser(sub)

    from specd.cli import bench as bench_module
    from specd.cli import distill as distill_module

    bench = sub.add_parser("bench", help="compare γ policies and target-only against a running gateway")
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run)

    from specd.cli import doctor as doctor_module

    doctor = sub.add_parser("doctor", help="run the acceptance checklist against a running gateway "
                                           "(exit 0 healthy, 1 warnings, 2 speculation hurting)")
    doctor_module.add_arguments(doctor)
    doctor.set_defaults(func=doctor_module.run)

    distill = sub.add_parser("distill", help="train a draft to agree with its target")
    distill_module.add_arguments(distill)
    distill.set_defaults(func=distill_module.run)

    from specd.cli import certs as certs_module

    certs = sub.add_parser("certs", help="write a development CA and server/client certificates")
    certs_module.add_arguments(certs)
    certs.set_defaults(func=certs_module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TLSConfigError, MissingApiKey) as exc:  # a client or server set up wrongly: say which flag
        print(f"specd {args.command}: {exc}", file=sys.stderr)
        return 2

