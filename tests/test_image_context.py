"""What the image's build context and git may hold: an allow list, and no secrets.

No Docker runs here; this reads `.dockerignore` as Docker does (the last matching pattern
wins, `!` re-includes, a pattern matches a path or any of its parents) and checks what a
checkout with the files the docs have one make (`specd certs certs/`, `keys.txt`) would
send."""
from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ignored_by_docker(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def docker_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_build_context_is_an_allow_list():
    patterns = docker_patterns()
    assert patterns[0] == "*"
    for secret in ("certs/server-key.pem", "certs/ca.pem", "keys.txt", "my-model/model.safetensors", ".env",
                   "models/other/model.safetensors", "tests/conftest.py"):
        assert ignored_by_docker(secret, patterns), secret
    for needed in ("pyproject.toml", "README.md", "specd_cli/parser.py", "gateway/edge/http.py",
                   "draft_service/server.py", "verifier_service/server.py", "models/demo/target/config.json"):
        assert not ignored_by_docker(needed, patterns), needed


def test_git_ignores_the_secrets_the_docs_make():
    for secret in ("certs/server-key.pem", "certs/ca.pem", "keys.txt", "client-key.pem"):
        result = subprocess.run(["git", "check-ignore", "-q", secret], cwd=ROOT)
        assert result.returncode == 0, f"git would track {secret}"
