"""`specd serve`: the draft, verifier and gateway services as three local processes.

The workers listen on private Unix sockets, start in the order the device needs (one after
the other on a shared GPU), and are restarted if they die (`specd_cli.supervisor`); serve
ends them all on SIGTERM, SIGINT or SIGHUP. Each process is `python -m specd_cli` with the
flags of its own service (`specd_cli.launch`).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specd.config import ClientTLS, DemoPairNotFound, demo_pair
from specd.flags import forward_flags, from_flags
from specd.tls import TLSConfigError
from specd.worker.hub import ModelNotFound, resolve
from specd.worker.settings import ModelSettings
from specd_cli.launch import DRAFT, GATEWAY, MODEL, parse_drafts, port_taken

# How long an idle OpenMP thread of a `specd serve` worker spins before it sleeps
# (libgomp's GOMP_SPINCOUNT). The demo pair at 1 in flight, target-only: 179-194 tokens/s
# with 20,000, 168-184 with 100,000, 112-130 with none (docs/serving-path.md, "One OpenMP
# team per worker"); the shorter spin holds a core for less time after a forward, while
# the draft's turn runs.
SPIN_TURNS = 20_000


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
    costs = {"verifier": config_kv_bytes_per_token(target, width)}
    if drafts:  # no draft worker: the verifier takes the whole fraction
        costs["draft"] = sum(config_kv_bytes_per_token(draft, width) for draft in drafts)
    return split_fraction(fraction, costs)


def cmd_serve(args: argparse.Namespace) -> int:
    # Here, not at the top: every `specd` command imports this module, and certs loads cryptography.
    from specd_cli.certs import specd_command

    try:
        # No model arguments: the demo pair. A target of the user's own with no --draft: no
        # draft worker, the model-free proposers alone (the demo draft's tokenizer is not
        # the user's model's).
        target = args.target or str(demo_pair()[0])
        drafts = parse_drafts(args.draft or ([] if args.target else [str(demo_pair()[1])]))
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
        if port and port_taken(host, port):
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
                           "--draft-base", target,
                           *[f"--draft={n}={p}" for n, p in drafts.items()],
                           "--threads", str(draft_threads), *worker_tls, *forward_flags(MODEL, args),
                           *forward_flags(DRAFT, args, nested=False), *fractions.get("draft", []),
                           *(["--cpus", args.draft_cpus] if args.draft_cpus else [])],
        }
        if not drafts:
            del workers["draft"]
        try:
            for group in start_groups(model_settings.device):  # on one GPU, one after the other
                group = tuple(name for name in group if name in workers)
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
                "--draft-address", f"unix:{sockets['draft']}" if drafts else "", *gateway_tls,
                *forward_flags(GATEWAY, args)])
            if not wait_healthy(f"127.0.0.1:{args.port}", supervisor.processes, args.startup_timeout, client_tls):
                print("specd serve: the services did not become healthy; see the messages above",
                      file=sys.stderr)
                return 1
            print(f"specd serve: ready on {args.host}:{args.port}{' (TLS)' if args.tls else ''} "
                  f"(target {target}, drafts {list(drafts) or 'none: model-free proposers only'}; workers on "
                  f"private sockets {', '.join(f'unix:{sockets[name]}' for name in workers)})"
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
