"""The `specd` command line.

    specd serve      draft + verifier + gateway as three local processes (the demo)
    specd draft      the draft service alone        (one per pod on Kubernetes)
    specd verifier   the verifier service alone
    specd gateway    the gateway alone
    specd generate   send a prompt to a gateway; print the text and acceptance figures
    specd bench      compare γ policies and target-only decoding against a running gateway
    specd distill    train a draft to agree with its target (KL to the target's outputs)
    specd trace      collect spans over OTLP into a file; show a request's steps (specd_cli.trace)
    specd certs      write a development CA and server/client certificates (specd_cli.certs)

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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.settings import GatewaySettings
from specd.config import (
    DEFAULT_DRAFT_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_VERIFIER_PORT,
    DEMO_MODELS_ENV,
    ClientTLS,
    DemoPairNotFound,
    ServerSettings,
    demo_pair,
)
from specd.flags import add_flags, forward_flags, from_flags
from specd.tls import TLSConfigError, add_client_arguments, check_client_tls, check_server_tls, client_tls_from_args
from specd.worker.hub import ModelNotFound, model_name, resolve
from specd.worker.identity import weight_files
from specd.worker.settings import DraftSettings, ModelSettings, VerifierSettings
from specd_cli.clientauth import MissingApiKey, add_api_key_argument

# Every settings flag is declared once, on its settings field (`specd.flags`); the
# defaults below are the objects the flags are read from (each service its own port).
MODEL = ModelSettings()
DRAFT = DraftSettings(ServerSettings(port=DEFAULT_DRAFT_PORT))
VERIFIER = VerifierSettings(ServerSettings(port=DEFAULT_VERIFIER_PORT))
GATEWAY = GatewaySettings(ServerSettings(port=DEFAULT_GATEWAY_PORT))
# Where a service without model flags finds the demo pair (specd.config.demo_pair).
DEMO_HELP = f"${DEMO_MODELS_ENV}, else models/demo of the source checkout, else of the current directory"


# -- the three services ---------------------------------------------------------------------

def _service_args(parser: argparse.ArgumentParser,
                  defaults: DraftSettings | VerifierSettings | GatewaySettings) -> None:
    """A service's settings flags, and --port-file."""
    add_flags(parser, defaults)
    parser.add_argument("--port-file", type=Path, metavar="FILE",
                        help="write the port listened on to this file once serving (with --port 0)")


def _worker_process_args(parser: argparse.ArgumentParser) -> None:
    """How a worker process uses this machine's CPUs (not settings of the service)."""
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: one for a model under 32 MiB of weights on a CPU, "
                             "else torch's default)")
    parser.add_argument("--cpus", default="", metavar="LIST",
                        help="pin the worker to these CPUs (e.g. 0 or 2-3), as it would own a GPU; torch threads "
                             "default to one per CPU")


def _settings(defaults, args: argparse.Namespace, **given):
    """The settings object of a service from its flags; exits with the reason on a bad value."""
    settings = from_flags(defaults, args, **given)
    check_server_tls(settings.server.tls)
    problems = settings.model.problems() if hasattr(settings, "model") else []
    if problems:
        raise SystemExit(f"specd: {'; '.join(problems)}")
    return settings


def _then_single_threaded(create):
    """A worker's create_server that then leaves torch's threads to the models' threads
    (`specd.worker.runtime.event_loop_single_threaded`)."""
    async def created(settings):
        from specd.worker.runtime import event_loop_single_threaded

        running = await create(settings)
        event_loop_single_threaded()
        return running
    return created


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
        listeners = [(server.host, 0 if server.socket else server.port, "port"),
                     (server.host, server.health_port, "health port"),
                     (settings.metrics_host, settings.metrics_port, "metrics port"),
                     (server.host, getattr(settings, "http_port", None), "HTTP port")]
        for host, port, kind in listeners:
            if port and _port_taken(host, port):
                raise PortInUse(f"{host}:{port}", kind)
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
# and the demo target (61 MB) was faster with torch's default (docs/serving-path.md,
# "Torch threads").
SMALL_MODEL_BYTES = 32 * 1024 * 1024


# How long an idle OpenMP thread of a `specd serve` worker spins before it sleeps
# (libgomp's GOMP_SPINCOUNT). The demo pair at 1 in flight, target-only: 179-194 tokens/s
# with 20,000, 168-184 with 100,000, 112-130 with none (docs/serving-path.md, "One OpenMP
# team per worker"); the shorter spin holds a core for less time after a forward, while
# the draft's turn runs.
SPIN_TURNS = 20_000


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
    from draft_service.predraft import check_branches
    from draft_service.server import create_server
    from specd.telemetry import setup_tracing

    setup_tracing("specd-draft")

    try:
        check_branches(args.pre_draft_branches)
    except ValueError as exc:
        print(f"specd draft: --pre-draft-branches: {exc}", file=sys.stderr)
        return 2
    if args.kept_rows_mib < 0:
        print(f"specd draft: --kept-rows-mib must be >= 0 (0: keep none), got {args.kept_rows_mib}", file=sys.stderr)
        return 2
    try:
        drafts = {name: resolve(model, args.revision) for name, model in
                  _parse_drafts(args.draft or [str(demo_pair()[1])]).items()}
    except (ModelNotFound, DemoPairNotFound) as exc:
        print(f"specd draft: {exc}", file=sys.stderr)
        return 2
    _set_threads(args.threads or min(_default_threads(path, args.device) for path in drafts.values()), args.cpus)
    settings = _settings(DRAFT, args, drafts=drafts)
    return _serve(_then_single_threaded(create_server), settings, "draft", args.port_file)


def cmd_verifier(args: argparse.Namespace) -> int:
    from specd.telemetry import setup_tracing
    from verifier_service.server import create_server

    setup_tracing("specd-verifier")

    try:
        spec = args.target or str(demo_pair()[0])
        target = resolve(spec, args.revision)
    except (ModelNotFound, DemoPairNotFound) as exc:
        print(f"specd verifier: {exc}", file=sys.stderr)
        return 2
    _set_threads(args.threads or _default_threads(target, args.device), args.cpus)
    settings = _settings(VERIFIER, args, target=target, target_name=model_name(spec))
    return _serve(_then_single_threaded(create_server), settings, "verifier", args.port_file)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.auth import KeyFileError
    from gateway.backend import IncompatibleDraft
    from gateway.server import create_server
    from specd.telemetry import setup_tracing

    setup_tracing("specd-gateway")
    worker_tls = ClientTLS(args.worker_ca, args.worker_cert, args.worker_key, args.worker_server_name)
    check_client_tls(worker_tls, "--worker-ca", "--worker-cert", "--worker-key")
    settings = _settings(GATEWAY, args, worker_tls=worker_tls)
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


def specd_command() -> str:
    """How to run `specd` from the user's shell: bare when the PATH finds this one, else its
    path (a .venv not activated), so that a printed hint runs as it is."""
    here = Path(sys.executable).with_name("specd")
    found = shutil.which("specd")
    if not here.exists() or found is not None and Path(found).resolve() == here.resolve():
        return "specd"
    return str(here)


def _tls_dir(directory: Path) -> dict[str, Path]:
    """The files of `specd certs DIR`; TLSConfigError naming the missing ones."""
    from specd_cli.certs import FILES

    paths = {name: directory / name for name in FILES}
    missing = [name for name, path in paths.items() if not path.is_file()]
    if missing:
        raise TLSConfigError(f"--tls {directory}: missing {', '.join(missing)}; make them with "
                             f"`specd certs {directory}`")
    return paths


def start_groups(device: str) -> list[tuple[str, ...]]:
    """The workers `specd serve` starts together, group after group, each group serving before
    the next starts. On a CUDA device both workers share its memory, and each sizes its KV pool
    from what it finds when it loads (`specd.worker.memory`): the verifier first, then the draft.
    Elsewhere (a CPU's memory is the host's, and the pools take untouched pages) both load at
    once, which is faster."""
    if device.split(":")[0] == "cuda":
        return [("verifier",), ("draft",)]
    return [("verifier", "draft")]


def worker_fractions(fraction: float, target: Path, drafts: list[Path], dtype: str) -> dict[str, float]:
    """`specd serve --gpu-memory-fraction`: the share of the one device each worker takes, split
    in proportion to the models' KV bytes per token (`specd.worker.memory.split_fraction`)."""
    from specd.worker.memory import config_kv_bytes_per_token, split_fraction

    width = 4 if dtype == "float32" else 2
    costs = {"verifier": config_kv_bytes_per_token(target, width),
             "draft": sum(config_kv_bytes_per_token(draft, width) for draft in drafts) if drafts else 0}
    return split_fraction(fraction, costs)


def cmd_serve(args: argparse.Namespace) -> int:
    try:  # the demo pair for what is not given
        target = args.target or str(demo_pair()[0])
        drafts = _parse_drafts(args.draft or [str(demo_pair()[1])])
    except DemoPairNotFound as exc:
        print(f"specd serve: {exc}", file=sys.stderr)
        return 2
    for role, model in (("target", target), *(("draft", m) for m in drafts.values())):
        try:  # resolved here (fetched into the cache once) so that a wrong name stops serve at once
            resolve(model, args.revision)
        except ModelNotFound as exc:
            print(f"specd serve: no {role} model: {exc}. Pass --target and --draft as model directories "
                  f"or hub ids ORG/NAME sharing one tokenizer, or make the demo pair with "
                  f"`python scripts/make_demo_pair.py`.", file=sys.stderr)
            return 2
    model_settings: ModelSettings = from_flags(MODEL, args)
    problems = model_settings.problems()  # before anything starts: a device this machine lacks, a bad fraction
    if problems:
        print(f"specd serve: {'; '.join(problems)}", file=sys.stderr)
        return 2
    fractions: dict[str, list[str]] = {"verifier": [], "draft": []}
    if model_settings.batching.gpu_memory_fraction:  # both workers on the one device: split between them
        split = worker_fractions(model_settings.batching.gpu_memory_fraction, resolve(target, args.revision),
                                 [resolve(model, args.revision) for model in drafts.values()], model_settings.dtype)
        fractions = {name: [f"--gpu-memory-fraction={share:.4f}"] for name, share in split.items()}
    # Every listener is checked before anything loads; the servers' exclusive binds make it certain.
    for host, port, flag in ((args.host, args.port, "--port"), (args.host, args.http_port, "--http-port"),
                             (args.metrics_host, args.metrics_port, "--metrics-port")):
        if port and _port_taken(host, port):
            print(f"specd serve: port {port} on {host} is taken (another specd serve?); pass {flag} "
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
        worker_tls = [*server, "--tls-client-ca", files["ca.pem"], "--tls-client-names", "specd-gateway"]
        gateway_tls = [*server, "--worker-ca", files["ca.pem"], "--worker-cert", files["client.pem"],
                       "--worker-key", files["client-key.pem"]]
        client_tls = ClientTLS(ca=Path(files["ca.pem"]))
        link_tls = ClientTLS(Path(files["ca.pem"]), Path(files["client.pem"]), Path(files["client-key.pem"]))
    me = [sys.executable, "-m", "specd_cli"]
    draft_threads = args.threads if args.draft_threads < 0 else args.draft_threads
    # The three processes share this machine's cores and take turns (draft, then
    # verifier): OpenMP threads that spun for long after a forward stole the next
    # process's CPU (the figures: README, Benchmarks), and threads that sleep at once
    # make each parallel region of a forward wait for a wake-up. They spin briefly
    # (20,000 turns), then sleep (docs/serving-path.md, "One OpenMP team per worker").
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", str(SPIN_TURNS))}
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    # SIGHUP too (a closed terminal, or `kill -HUP`): serve stops its children, never leaves them.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    from specd_cli.supervisor import Supervisor

    supervisor = Supervisor(env)
    # The workers listen on Unix domain sockets in a directory only this user may enter
    # (mkdtemp makes it 0700): no other local user, and no other host, reaches them. A
    # restarted worker binds the same path, which the gateway keeps dialling.
    with tempfile.TemporaryDirectory(prefix="specd-serve-") as run_dir:
        sockets = {"verifier": Path(run_dir) / "verifier.sock", "draft": Path(run_dir) / "draft.sock"}
        workers = {
            "verifier": me + ["verifier", "--socket", str(sockets["verifier"]),
                              "--target", target, "--revision", args.revision,
                              "--threads", str(args.threads), *worker_tls, *forward_flags(MODEL, args),
                              *fractions["verifier"], *(["--cpus", args.verifier_cpus] if args.verifier_cpus else [])],
            "draft": me + ["draft", "--socket", str(sockets["draft"]), "--revision", args.revision,
                           *[f"--draft={n}={p}" for n, p in drafts.items()],
                           "--threads", str(draft_threads), *worker_tls, *forward_flags(MODEL, args),
                           *forward_flags(DRAFT, args, nested=False), *fractions["draft"],
                           *(["--cpus", args.draft_cpus] if args.draft_cpus else [])],
        }
        try:
            for group in start_groups(model_settings.device):  # on one GPU, one after the other
                for name in group:
                    supervisor.start(name, workers[name])
                for name in group:
                    if not wait_healthy(f"unix:{sockets[name]}", supervisor.processes, args.startup_timeout,
                                        link_tls):
                        print(f"specd serve: the {name} worker did not start; see the messages above",
                              file=sys.stderr)
                        return 1
            supervisor.start("gateway", restart=False, argv=me + [
                "gateway", "--host", args.host, "--port", str(args.port),
                "--verifier-address", f"unix:{sockets['verifier']}",
                "--draft-address", f"unix:{sockets['draft']}", *gateway_tls,
                *forward_flags(GATEWAY, args)])
            if not wait_healthy(f"127.0.0.1:{args.port}", supervisor.processes, args.startup_timeout, client_tls):
                print("specd serve: the services did not become healthy; see the messages above",
                      file=sys.stderr)
                return 1
            print(f"specd serve: ready on {args.host}:{args.port}{' (TLS)' if args.tls else ''} "
                  f"(target {target}, drafts {list(drafts)}; workers on private sockets "
                  f"unix:{sockets['verifier']}, unix:{sockets['draft']})"
                  f"{f'; OpenAI-compatible HTTP on port {args.http_port}' if args.http_port is not None else ''}"
                  f"; try: {specd_command()} generate "
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
    sampling = gateway_pb2.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens or None, stop=args.stop or [], presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        logprobs=args.logprobs)
    if args.json_schema:
        sampling.structured.json_schema = Path(args.json_schema).read_text()
    elif args.regex:
        sampling.structured.regex = args.regex
    elif args.choice:
        sampling.structured.choice.choices.extend(args.choice)
    request = gateway_pb2.GenerateRequest(
        prompt=args.prompt, sampling=sampling,
        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_length=args.draft_length,
                                                  draft_model=args.draft_model, policy=args.policy),
        task_type=args.task_type, user_segment=args.user_segment)
    from specd_cli.clientauth import with_api_key

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
            logprobs = []
            sys.stdout.write(args.prompt)
            for chunk in stub.GenerateStream(request, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                logprobs += [entry.logprob for entry in chunk.logprobs]
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
    if logprobs:
        print("logprobs " + " ".join(f"{value:.3f}" for value in logprobs), file=sys.stderr)
    drafted = collections.Counter(p for p in stats.proposers if p)
    if set(drafted) - {stats.draft_model}:  # model-free proposers drafted some steps: say which
        print("steps drafted by " + ", ".join(f"{name} ×{n}" for name, n in drafted.most_common()), file=sys.stderr)
    return 0


# -- the parser -----------------------------------------------------------------------------

def _revision_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", default="",
                        help="branch, tag or commit of the hub ids that name none (default: main); HF_HOME is the "
                             "cache, HF_HUB_OFFLINE=1 reads only the cache, HF_TOKEN opens gated models")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run draft, verifier and gateway locally (the demo)")
    serve.add_argument("--target", help=f"target model: a directory or a hub id ORG/NAME[@REVISION] (default: the "
                                        f"demo target: {DEMO_HELP})")
    _revision_arg(serve)
    serve.add_argument("--draft", action="append", metavar="[NAME=]MODEL",
                       help=f"draft model: a directory or a hub id ORG/NAME[@REVISION]; repeat to host several, the "
                            f"first is the default (default: the demo draft: {DEMO_HELP})")
    serve.add_argument("--host", default=GATEWAY.server.host, help="interface the gateway binds")
    serve.add_argument("--port", type=int, default=GATEWAY.server.port, help="gateway port")
    serve.add_argument("--tls", metavar="DIR",
                       help="a `specd certs` directory: TLS (no client certificates) for clients of the "
                            "gateway, and mutual TLS on the workers' private sockets as well")
    serve.add_argument("--threads", type=int, default=0,
                       help="torch threads of the verifier (0: one for a target under 32 MiB of weights on a CPU, "
                            "else torch's default)")
    # One thread: a small draft's matrices are too small to split, and with all three
    # processes on the same cores a second thread only adds wake-ups (docs/serving-path.md,
    # "Torch threads").
    serve.add_argument("--draft-threads", type=int, default=1,
                       help="torch threads of the draft worker (default 1; -1: as --threads)")
    serve.add_argument("--startup-timeout", type=float, default=120.0)
    serve.add_argument("--draft-cpus", default="", metavar="LIST",
                       help="pin the draft worker to these CPUs (e.g. 0), as if it owned a GPU")
    serve.add_argument("--verifier-cpus", default="", metavar="LIST",
                       help="pin the verifier worker to these CPUs (e.g. 1)")
    # Every other setting of the three services, passed on to the process that owns it.
    add_flags(serve, MODEL, serve_only=True)
    add_flags(serve, DRAFT, serve_only=True, nested=False)
    add_flags(serve, GATEWAY, serve_only=True)
    serve.set_defaults(func=cmd_serve)

    draft = sub.add_parser("draft", help="run the draft service")
    _service_args(draft, DRAFT)
    _worker_process_args(draft)
    draft.add_argument("--draft", action="append", metavar="[NAME=]MODEL",
                       help=f"a draft model: a directory or a hub id ORG/NAME[@REVISION]; repeat to host several "
                            f"(the first is the default; default: the demo draft: {DEMO_HELP})")
    _revision_arg(draft)
    draft.set_defaults(func=cmd_draft)

    verifier = sub.add_parser("verifier", help="run the verifier service")
    _service_args(verifier, VERIFIER)
    _worker_process_args(verifier)
    verifier.add_argument("--target", help=f"target model: a directory or a hub id ORG/NAME[@REVISION] (default: "
                                           f"the demo target: {DEMO_HELP})")
    _revision_arg(verifier)
    verifier.set_defaults(func=cmd_verifier)

    gateway = sub.add_parser("gateway", help="run the gateway (the public API)")
    _service_args(gateway, GATEWAY)
    # The worker TLS settings are a ClientTLS, the type `specd generate` also fills (--ca).
    gateway.add_argument("--worker-ca", type=Path, metavar="FILE",
                         help="reach the workers over TLS, trusting certificates signed by this CA")
    gateway.add_argument("--worker-cert", type=Path, metavar="FILE",
                         help="client certificate presented to the workers (mutual TLS)")
    gateway.add_argument("--worker-key", type=Path, metavar="FILE", help="the client certificate's private key")
    gateway.add_argument("--worker-server-name", default=GATEWAY.worker_tls.server_name,
                         help="name to check in the workers' certificates (default: the dialled host, "
                              "or the Service name with --verifier-service/--draft-service)")
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
    generate.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    generate.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    generate.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, 1 = off")
    generate.add_argument("--min-p", type=float, default=0.0)
    generate.add_argument("--logprobs", type=int, default=None, metavar="N",
                          help="print each token's log-probability (N alternatives each are in the API)")
    structure = generate.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="FILE", help="the output must validate against this JSON Schema")
    structure.add_argument("--regex", help="the output must match this regular expression")
    structure.add_argument("--choice", action="append", help="the output is one of these (repeat the flag)")
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

    from specd_cli.trace import add_parser as add_trace_parser

    add_trace_parser(sub)

    from specd_cli import bench as bench_module
    from specd_cli import distill as distill_module

    bench = sub.add_parser("bench", help="compare γ policies and target-only against a running gateway")
    bench_module.add_arguments(bench)
    bench.set_defaults(func=bench_module.run)

    from specd_cli import doctor as doctor_module

    doctor = sub.add_parser("doctor", help="run the acceptance checklist against a running gateway "
                                           "(exit 0 healthy, 1 warnings, 2 speculation hurting)")
    doctor_module.add_arguments(doctor)
    doctor.set_defaults(func=doctor_module.run)

    distill = sub.add_parser("distill", help="train a draft to agree with its target")
    distill_module.add_arguments(distill)
    distill.set_defaults(func=distill_module.run)

    from specd_cli import certs as certs_module

    certs = sub.add_parser("certs", help="write a development CA and server/client certificates")
    certs_module.add_arguments(certs)
    certs.set_defaults(func=certs_module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specd_cli.supervisor import die_with_supervisor

    die_with_supervisor()  # a child of `specd serve` ends when serve does, however serve ends
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TLSConfigError, MissingApiKey) as exc:  # a client or server set up wrongly: say which flag
        print(f"specd {args.command}: {exc}", file=sys.stderr)
        return 2

