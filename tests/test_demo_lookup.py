"""Where a service with no model flags finds the demo pair (specd.config.demo_pair), as an
installed, non-editable specd runs: the packages copied to a directory of their own, as
into site-packages, with no models/ beside them (the wheel does not carry the pair)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specd.config import DEMO_MODELS_ENV

CHECKOUT = Path(__file__).resolve().parents[1]
# The top-level packages the wheel installs (pyproject.toml's packages.find).
PACKAGES = sorted({pattern.split(".")[0].rstrip("*") for pattern in
                   tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
                   ["include"]})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The packages copied outside the checkout: a stand-in for site-packages."""
    assert {"specd", "specd_cli", "gateway"} <= set(PACKAGES), PACKAGES
    site = tmp_path_factory.mktemp("site-packages")
    for package in PACKAGES:
        shutil.copytree(CHECKOUT / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    return site


def run(site: Path, cwd: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` with the installed copy first on the path, in `cwd`, without DEMO_MODELS_ENV
    unless `env` gives it."""
    environ = {k: v for k, v in os.environ.items() if k != DEMO_MODELS_ENV}
    environ.update(PYTHONPATH=str(site), **env)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=120)


def lookup(site: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    code = ("import specd, specd_cli, specd.config as c; print(specd.__file__, specd_cli.__file__); "
            "print(*c.demo_pair())")
    return run(site, cwd, ["-c", code], **env)


def fake_pair(directory: Path) -> Path:
    """A directory laid out as models/demo (the lookup reads no more than config.json)."""
    for name in ("target", "draft-distilled"):
        (directory / name).mkdir(parents=True)
        (directory / name / "config.json").write_text("{}")
    return directory


def test_serve_from_an_installed_copy_without_the_pair_says_how_to_point_at_it(installed, tmp_path):
    result = run(installed, tmp_path, ["-m", "specd_cli", "serve", "--port", "0"])
    assert result.returncode == 2, result.stderr
    # Every place looked at, and both ways to point at a pair.
    for text in (str(installed / "models" / "demo"), str(tmp_path / "models" / "demo"), DEMO_MODELS_ENV,
                 "--target", "--draft"):
        assert text in result.stderr, (text, result.stderr)


def test_the_env_var_points_an_installed_copy_at_the_pair(installed, tmp_path):
    pair = fake_pair(tmp_path / "pair")
    # `specd serve` takes it: past the lookup, it stops at the next check (a port taken).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = run(installed, tmp_path, ["-m", "specd_cli", "serve", "--port", str(port)],
                     **{DEMO_MODELS_ENV: str(pair)})
    assert served.returncode == 2 and f"port {port} on 127.0.0.1 is taken" in served.stderr, served.stderr
    result = lookup(installed, tmp_path, **{DEMO_MODELS_ENV: str(pair)})
    assert result.returncode == 0, result.stderr
    imported, found = result.stdout.splitlines()
    assert [Path(path).parent.parent for path in imported.split()] == [installed] * 2  # the copy, not the checkout
    assert found.split() == [str(pair / "target"), str(pair / "draft-distilled")]


def test_a_wrong_env_var_is_an_error_naming_it_not_a_fallback(installed, tmp_path):
    fake_pair(tmp_path / "models" / "demo")  # would be found in the current directory
    result = lookup(installed, tmp_path, **{DEMO_MODELS_ENV: str(tmp_path / "nowhere")})
    assert result.returncode != 0
    assert f"{DEMO_MODELS_ENV}={tmp_path / 'nowhere'}" in result.stderr and "DemoPairNotFound" in result.stderr


def test_an_installed_copy_finds_the_pair_in_the_current_directory(installed, tmp_path):
    pair = fake_pair(tmp_path / "models" / "demo")
    result = lookup(installed, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split() == [str(pair / "target"), str(pair / "draft-distilled")]


def test_a_checkout_finds_its_own_pair_first(tmp_path, monkeypatch):
    from specd import config

    checkout, elsewhere = fake_pair(tmp_path / "checkout" / "models" / "demo"), fake_pair(tmp_path / "models" / "demo")
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path / "checkout")
    assert config.demo_pair({}, cwd=tmp_path) == (checkout / "target", checkout / "draft-distilled")
    assert config.demo_pair({DEMO_MODELS_ENV: str(elsewhere)}, cwd=tmp_path)[0] == elsewhere / "target"
