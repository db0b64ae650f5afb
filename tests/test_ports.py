"""Every server holds its port alone: a second server on a taken port is a start-up error
that names the port, never a silent share (gRPC's default SO_REUSEPORT allowed that)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import LoopThread
from specd.config import ServerSettings
from specd.grpcserver import PortInUse, start_server


def specd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd_cli", *args], capture_output=True, text=True, timeout=180)


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


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_serve_on_a_taken_http_or_metrics_port_says_which_before_loading(model_dirs, taken_port, flag):
    result = specd("serve", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["close"]),
                   "--port", "0", flag, str(taken_port))
    assert result.returncode == 2
    assert f"port {taken_port} on 127.0.0.1 is taken" in result.stderr and flag in result.stderr
    assert "running as pid" not in result.stdout  # refused before any model process started


def test_a_gateway_on_a_taken_http_port_exits_naming_it(taken_port):
    result = specd("gateway", "--verifier-address", "127.0.0.1:9", "--draft-address", "", "--port", "0",
                   "--http-port", str(taken_port))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{taken_port}: the HTTP port is taken" in result.stderr


def test_a_worker_whose_socket_directory_is_gone_says_so(model_dirs, tmp_path):
    result = specd("draft", "--draft", str(model_dirs["close"]), "--socket", str(tmp_path / "gone" / "draft.sock"))
    assert result.returncode == 2
    assert "directory" in result.stderr and "does not exist" in result.stderr and "taken" not in result.stderr


def _descendants(pid: int) -> set[int]:
    """Every live process whose parent chain reaches `pid` (read from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP])
def test_serve_killed_leaves_no_process_and_frees_its_ports(model_dirs, signum):
    """`kill -9` (or SIGHUP) of `specd serve`: within 5 s its verifier, draft and gateway
    are gone and the gateway's gRPC and HTTP ports can be bound again."""
    from test_cli import free_port

    grpc_port, http_port = free_port(), free_port()
    serve = subprocess.Popen([sys.executable, "-m", "specd_cli", "serve", "--target", str(model_dirs["target"]),
                              "--draft", str(model_dirs["close"]), "--port", str(grpc_port),
                              "--http-port", str(http_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        for line in serve.stdout:
            if "specd serve: ready" in line:
                break
        else:
            pytest.fail("specd serve never became ready")
        children = _descendants(serve.pid)
        assert len(children) >= 3
        serve.send_signal(signum)
        serve.wait(30)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)], "children of serve outlived it by 5 s"
        for port in (grpc_port, http_port):
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
    finally:
        for pid in _descendants(serve.pid) if serve.poll() is None else ():
            os.kill(pid, signal.SIGKILL)
        if serve.poll() is None:
            serve.kill()
