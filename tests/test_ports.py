"""Every server holds its port alone: a second server on a taken port is a start-up error
that names the port, never a silent share (gRPC's default SO_REUSEPORT allowed that)."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from conftest import LoopThread
from specd.config import ServerSettings
from specd.grpcserver import PortInUse, start_server


def specd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd.cli", *args], capture_output=True, text=True, timeout=180)


def test_a_second_grpc_server_on_a_taken_port_fails_naming_it():
    loop = LoopThread()
    first = loop.run(start_server(ServerSettings("127.0.0.1", 0), lambda server: None, []))
    try:
        with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{first.port}: the port is taken"):
            loop.run(start_server(ServerSettings("127.0.0.1", first.port), lambda server: None, []))
    finally:
        loop.run(first.stop(0))
        loop.close()


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_serve_on_a_taken_port_says_which(model_dirs, taken_port):
    result = specd("serve", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["close"]),
                   "--port", str(taken_port))
    assert result.returncode == 2
    assert f"port {taken_port} on 127.0.0.1 is taken" in result.stderr and "--port" in result.stderr


@pytest.mark.parametrize("service", ["verifier", "draft", "gateway"])
def test_a_service_on_a_taken_port_exits_naming_it(model_dirs, taken_port, service):
    # The gateway's workers do not exist: the port is refused before anything is waited for.
    models = {"verifier": ["--target", str(model_dirs["target"])], "draft": ["--draft", str(model_dirs["close"])],
              "gateway": ["--verifier-address", "127.0.0.1:9", "--draft-address", ""]}[service]
    result = specd(service, *models, "--port", str(taken_port))
    assert result.returncode == 2
    assert f"specd {service}: cannot listen on 127.0.0.1:{taken_port}: the port is taken" in result.stderr
