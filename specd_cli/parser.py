"""The `specd` command line.

    specd serve      draft + verifier + gateway as three local processes (the demo)
    specd draft      the draft service alone        (one per pod on Kubernetes)
    specd verifier   the verifier service alone
    specd gateway    the gateway alone
    specd generate   send a prompt to a gateway; print the text and acceptance figures
    specd bench      compare γ policies and target-only decoding against a running gateway
    specd doctor     the acceptance checklist against a running gateway
    specd distill    train a draft to agree with its target (KL to the target's outputs)
    specd corpus     the target's own answers, for the gateway's corpus proposer
    specd trace      collect spans over OTLP into a file; show a request's steps
    specd certs      write a development CA and server/client certificates

Each command runs in the module named after it (`specd_cli.serve`, `specd_cli.generate`,
`specd_cli.bench`, ...); draft, verifier and gateway share `specd_cli.launch`. The flags
of serve, of the three services and of generate are declared here, the other commands'
in their own modules.
TLS: every service takes --tls-cert/--tls-key (and --tls-client-ca for mutual TLS), the
gateway --worker-ca/--worker-cert/--worker-key, clients --ca (docs/tls.md).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gateway.settings import GatewaySettings
from specd.config import DEFAULT_GATEWAY_PORT, DEMO_MODELS_ENV
from specd.flags import add_flags
from specd.tls import TLSConfigError, add_client_arguments
from specd.worker.settings import DraftSettings, VerifierSettings
from specd_cli.clientauth import MissingApiKey, add_api_key_argument
from specd_cli.generate import cmd_generate
from specd_cli.launch import DRAFT, GATEWAY, MODEL, VERIFIER, cmd_draft, cmd_gateway, cmd_verifier
from specd_cli.serve import cmd_serve

# Where a service without model flags finds the demo pair (specd.config.demo_pair).
DEMO_HELP = f"${DEMO_MODELS_ENV}, else models/demo of the source checkout, else of the current directory"


def _service_args(parser: argparse.ArgumentParser,
                  defaults: DraftSettings | VerifierSettings | GatewaySettings) -> None:
    """A service's settings flags, and --port-file."""
    add_flags(parser, defaults)
    parser.add_argument("--port-file", type=Path, metavar="FILE",
                        help="write the port listened on to this file once serving (with --port 0)")
    _log_level_arg(parser)


def _worker_process_args(parser: argparse.ArgumentParser) -> None:
    """How a worker process uses this machine's CPUs (not settings of the service)."""
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: one for a model under 32 MiB of weights on a CPU, "
                             "else torch's default)")
    parser.add_argument("--cpus", default="", metavar="LIST",
                        help="pin the worker to these CPUs (e.g. 0 or 2-3), as it would own a GPU; torch threads "
                             "default to one per CPU")


# The services' own loggers; other libraries' stay at warning whatever --log-level says.
SPECD_LOGGERS = ("specd", "specd_cli", "gateway", "draft_service", "verifier_service")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "SPECD_LOG_LEVEL"


def _log_level_arg(parser: argparse.ArgumentParser) -> None:
    # type applies to the default from the environment too (choices do not: main checks it).
    parser.add_argument("--log-level", choices=LOG_LEVELS, type=str.lower,
                        default=os.environ.get(LOG_LEVEL_ENV, "warning"),
                        help="the least severe of the service's messages written to stderr: info adds the load "
                             "cap's trials and their verdicts and each draft step skipped, debug why each trial "
                             f"began (default: ${LOG_LEVEL_ENV}, else warning; serve passes it to its workers)")


def configure_logging(level: str) -> None:
    """Messages to stderr, with time, level and logger: the services' own from `level` up,
    other libraries' from warning up. The level goes into the environment too, so the
    workers `specd serve` starts log at the same level."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in SPECD_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())
    os.environ[LOG_LEVEL_ENV] = level


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
    _log_level_arg(serve)
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
    draft.add_argument("--draft-base", metavar="TARGET",
                       help="the target model a draft made by `specd distill` from the target alone reads the "
                            "weights it shares from (a directory, a .gguf file or a hub id); specd serve passes "
                            "its --target")
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

    from specd_cli import corpus as corpus_module

    corpus = sub.add_parser("corpus", help="write the target's own answers for the gateway's corpus proposer")
    corpus_module.add_arguments(corpus)
    corpus.set_defaults(func=corpus_module.run)

    from specd_cli import certs as certs_module

    certs = sub.add_parser("certs", help="write a development CA and server/client certificates")
    certs_module.add_arguments(certs)
    certs.set_defaults(func=certs_module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specd_cli.supervisor import die_with_supervisor

    die_with_supervisor()  # a child of `specd serve` ends when serve does, however serve ends
    args = build_parser().parse_args(argv)
    if getattr(args, "log_level", None):  # the services and serve
        if args.log_level not in LOG_LEVELS:
            print(f"specd {args.command}: ${LOG_LEVEL_ENV} is {args.log_level!r}, not a log level: use one of "
                  f"{', '.join(LOG_LEVELS)}", file=sys.stderr)
            return 2
        configure_logging(args.log_level)
    try:
        return args.func(args)
    except (TLSConfigError, MissingApiKey) as exc:  # a client or server set up wrongly: say which flag
        print(f"specd {args.command}: {exc}", file=sys.stderr)
        return 2
