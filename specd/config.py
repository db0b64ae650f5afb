"""The settings every service shares: where it listens, its TLS, the default ports and the
demo models. Each service's own settings build on these (`specd.worker.settings`,
`gateway.settings`).

Nothing here reads the environment at import time; `specd_cli` fills these from flags.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specd.flags import comma_list, optional_path, setting

# The source checkout holding this package (in an installed, non-editable specd: the
# site-packages directory, which has no models/).
REPO_ROOT = Path(__file__).resolve().parents[1]
# The demo pair of the source checkout, where the scripts and tests read it. A service
# that defaults to the demo pair finds it with `demo_pair()`, which also looks elsewhere.
DEMO_TARGET = REPO_ROOT / "models" / "demo" / "target"
DEMO_DRAFT = REPO_ROOT / "models" / "demo" / "draft-distilled"
# A directory holding the demo pair as models/demo does (target/ and draft-distilled/):
# for a specd installed without its source checkout (the wheel does not carry the models).
DEMO_MODELS_ENV = "SPECD_DEMO_MODELS"


class DemoPairNotFound(FileNotFoundError):
    """No demo pair where `demo_pair` looks; the message names the places and how to point at one."""


def demo_pair(environ: Mapping[str, str] = os.environ, cwd: Path | None = None) -> tuple[Path, Path]:
    """The demo pair's (target, draft) directories: in $SPECD_DEMO_MODELS when it is set
    (only there: a wrong setting is an error, not a fallback), else models/demo of the
    source checkout holding this package, else models/demo of the current directory.
    DemoPairNotFound naming the places looked at and how to point at the pair otherwise."""
    explicit = environ.get(DEMO_MODELS_ENV, "")
    if explicit:
        places = [Path(explicit)]
    else:
        places = [REPO_ROOT / "models" / "demo", (cwd or Path.cwd()) / "models" / "demo"]
    for place in places:
        target, draft = place / "target", place / "draft-distilled"
        if (target / "config.json").is_file() and (draft / "config.json").is_file():
            return target, draft
    looked = (f"{DEMO_MODELS_ENV}={explicit}" if explicit else
              f"{places[0]} (next to the package), {places[1]} (the current directory)")
    raise DemoPairNotFound(
        f"no demo pair (target/ and draft-distilled/, each with config.json) in {looked}. Pass --target and "
        f"--draft (model directories or hub ids ORG/NAME), or set {DEMO_MODELS_ENV} to the directory holding "
        f"the pair (models/demo of a specd source checkout; the installed package does not carry it)")


# Where each service listens unless told otherwise (`specd gateway|draft|verifier --port`).
DEFAULT_GATEWAY_PORT, DEFAULT_DRAFT_PORT, DEFAULT_VERIFIER_PORT = 50051, 50052, 50053


@dataclass(frozen=True)
class ServerTLS:
    """The certificate a server presents, and whose clients it accepts (PEM files).

    No cert: plaintext. With client_ca: mutual TLS, clients must present a certificate
    signed by that CA (how the workers accept only their gateways).
    """

    cert: Path | None = setting(flag="--tls-cert", parse=optional_path, metavar="FILE", serve=False,
                                help="serve TLS with this certificate (PEM)")
    key: Path | None = setting(flag="--tls-key", parse=optional_path, metavar="FILE", serve=False,
                               help="the certificate's private key (PEM)")
    client_ca: Path | None = setting(flag="--tls-client-ca", parse=optional_path, metavar="FILE", serve=False,
                                     help="require client certificates signed by this CA (mutual TLS)")
    client_names: tuple[str, ...] = setting((), flag="--tls-client-names", parse=comma_list, cli_default="",
                                            metavar="LIST", serve=False,
                                            help="with --tls-client-ca, serve only clients whose certificate names "
                                                 "one of these (DNS name or common name; comma-separated), e.g. "
                                                 "specd-gateway")

    @property
    def enabled(self) -> bool:
        return self.cert is not None


@dataclass(frozen=True)
class ClientTLS:
    """How a client (the gateway towards its workers, `specd generate`) trusts a server.

    No CA and no cert: plaintext. ca: trust servers signed by it (None: the system's
    roots); cert/key: present this client certificate (mutual TLS). server_name: the
    name checked in the server's certificate instead of the dialled host, for endpoints
    dialled by IP (pods found through EndpointSlices present their Service's name).
    """

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return self.ca is not None or self.cert is not None


@dataclass(frozen=True)
class ServerSettings:
    """Where a service listens, how it shuts down, and its TLS."""

    host: str = setting("127.0.0.1", flag="--host", serve=False,
                        help="interface to bind (0.0.0.0 in a container)")
    port: int = setting(0, flag="--port", serve=False, help="port to listen on (0: a free one)")
    grace_s: float = setting(10.0, flag="--grace", serve=False,
                             help="seconds in-flight requests may take to finish after SIGTERM")
    tls: ServerTLS = ServerTLS()
    # Kubernetes' gRPC probes cannot speak TLS, so a TLS server needs a plaintext door.
    health_port: int = setting(0, flag="--health-port", serve=False,
                               help="also serve grpc.health.v1 alone, in plaintext, on this port (for "
                                    "Kubernetes probes, which cannot speak TLS); 0: off")
    socket: Path | None = setting(flag="--socket", parse=optional_path, metavar="PATH", serve=False,
                                  help="listen on this Unix domain socket instead of --host/--port: only "
                                       "processes that may enter its directory can connect (how specd serve "
                                       "links its workers)")

    @property
    def address(self) -> str:
        return f"unix:{self.socket}" if self.socket is not None else f"{self.host}:{self.port}"
