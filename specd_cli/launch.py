"""`specd draft`, `specd verifier` and `specd gateway`: one service in this process.

Each builds its settings object (`specd.worker.settings`, `gateway.settings`) from its
flags, once, and passes it in; `specd serve` starts each of the three this way, as a
process of its own. Tracing is configured by the standard OTEL_* variables only
(`specd.telemetry`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from gateway.settings import GatewaySettings
from specd.config import (
    DEFAULT_DRAFT_PORT,
    DEFAULT_GATEWAY_PORT,
    DEFAULT_VERIFIER_PORT,
    ClientTLS,
    DemoPairNotFound,
    ServerSettings,
    demo_pair,
)
from specd.flags import from_flags
from specd.tls import check_client_tls, check_server_tls
from specd.worker.hub import ModelNotFound, model_name, resolve
from specd.worker.identity import weight_files
from specd.worker.settings import DraftSettings, ModelSettings, VerifierSettings

# Every settings flag is declared once, on its settings field (`specd.flags`); the
# defaults below are the objects the flags are read from (each service its own port).
MODEL = ModelSettings()
DRAFT = DraftSettings(ServerSettings(port=DEFAULT_DRAFT_PORT))
VERIFIER = VerifierSettings(ServerSettings(port=DEFAULT_VERIFIER_PORT))
GATEWAY = GatewaySettings(ServerSettings(port=DEFAULT_GATEWAY_PORT))


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


def parse_drafts(values: list[str]) -> dict[str, str]:
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
            if port and port_taken(host, port):
                raise PortInUse(f"{host}:{port}", kind)
        asyncio.run(_run_service(create, settings, what, port_file))
    except PortInUse as exc:
        print(f"specd {what}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


def port_taken(host: str, port: int) -> bool:
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


def default_threads(model: Path, device: str) -> int:
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
    from specd.worker import sharing

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
                  parse_drafts(args.draft or [str(demo_pair()[1])]).items()}
        # The target is resolved (on a hub id, fetched) only for a draft that reads from it.
        shares = any(sharing.is_shared_draft(path) for path in drafts.values())
        base = resolve(args.draft_base, args.revision) if args.draft_base and shares else None
    except (ModelNotFound, DemoPairNotFound) as exc:
        print(f"specd draft: {exc}", file=sys.stderr)
        return 2
    _set_threads(args.threads or min(default_threads(path, args.device) for path in drafts.values()), args.cpus)
    settings = _settings(DRAFT, args, drafts=drafts, draft_base=base)
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
    _set_threads(args.threads or default_threads(target, args.device), args.cpus)
    settings = _settings(VERIFIER, args, target=target, target_name=model_name(spec))
    return _serve(_then_single_threaded(create_server), settings, "verifier", args.port_file)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_server
    from gateway.edge.auth import KeyFileError
    from gateway.workers.backend import IncompatibleDraft
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
