"""The command line as a newcomer uses it: `specd serve` (three processes) and `specd generate`."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def specd(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd_cli", *args], capture_output=True, text=True,
                          timeout=180, **kwargs)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux: /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def process_environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(entry.partition("=")[::2] for entry in entries if entry)


def test_serve_without_models_says_what_to_pass(tmp_path):
    result = specd("serve", "--target", str(tmp_path / "nothing"), "--port", str(free_port()))
    assert result.returncode == 2
    assert "no target model" in result.stderr and "is not a model directory" in result.stderr
    assert "--target and --draft as model directories or hub ids" in result.stderr


def test_serve_generate_and_stop_together(model_dirs):
    ports = [free_port()]
    serve = subprocess.Popen(
        [sys.executable, "-m", "specd_cli", "serve", "--target", str(model_dirs["target"]),
         "--draft", f"close={model_dirs['close']}", "--draft", f"unrelated={model_dirs['unrelated']}",
         "--port", str(ports[0])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")})
    try:
        result = specd("generate", "def fibonacci(n):", "--gateway", f"127.0.0.1:{ports[0]}",
                       "--max-new-tokens", "16", "--mode", "fixed", "--wait", "120")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("def fibonacci(n):")
        assert "acceptance rate" in result.stderr and "16 tokens" in result.stderr
        assert "draft close" in result.stderr
        bad = specd("generate", "x", "--gateway", f"127.0.0.1:{ports[0]}", "--temperature", "-1")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr
        # Its processes' OpenMP threads spin briefly, then sleep (specd_cli.serve.SPIN_TURNS).
        environments = [process_environment(child) for child in children(serve.pid)]
        assert len(environments) == 3
        for environment in environments:
            assert environment["OMP_WAIT_POLICY"] == "PASSIVE" and environment["GOMP_SPINCOUNT"] == "20000"
    finally:
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=60)
    assert serve.returncode == 0, output
    for port in ports:  # every child is gone: nothing listens any more
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("command", ["serve", "draft", "verifier", "gateway", "generate", "bench", "distill",
                                     "trace", "certs"])
def test_every_command_has_help(command):
    result = specd(command, "--help")
    assert result.returncode == 0 and "usage: specd" in result.stdout


def test_two_serves_side_by_side_answer_with_their_own_models(model_dirs, tmp_path):
    """Workers on free ports by default: neither instance reaches the other's models. One
    runs with --tls (mutual TLS inside, TLS to clients)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_pipeline import reference_greedy

    certs = tmp_path / "certs"
    assert specd("certs", str(certs)).returncode == 0
    pairs = {"a": ("target", "close", ["--tls", str(certs)]), "b": ("unrelated", "padded", [])}
    ports = {name: free_port() for name in pairs}
    serves = {name: subprocess.Popen(
        [sys.executable, "-m", "specd_cli", "serve", "--target", str(model_dirs[target]),
         "--draft", f"{draft}={model_dirs[draft]}", "--port", str(ports[name]), "--startup-timeout", "300", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name, (target, draft, extra) in pairs.items()}
    prompt = "def fibonacci(n):"
    try:
        for name, (target, draft, _) in pairs.items():
            client_tls = ["--ca", str(certs / "ca.pem")] if name == "a" else []
            result = specd("generate", prompt, "--gateway", f"127.0.0.1:{ports[name]}", "--max-new-tokens", "16",
                           "--mode", "fixed", "--wait", "170", *client_tls)
            assert result.returncode == 0, result.stderr
            tokenizer = AutoTokenizer.from_pretrained(model_dirs[target])
            model = AutoModelForCausalLM.from_pretrained(model_dirs[target]).eval()
            expected = tokenizer.decode(reference_greedy(model, tokenizer, prompt, 16), skip_special_tokens=True)
            assert result.stdout == prompt + expected, name
            assert f"draft {draft}," in result.stderr
        plaintext = specd("generate", prompt, "--gateway", f"127.0.0.1:{ports['a']}", "--max-new-tokens", "4")
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr  # a TLS gateway only speaks TLS
    finally:
        for serve in serves.values():
            serve.send_signal(signal.SIGTERM)
        outputs = {name: serve.communicate(timeout=60)[0] for name, serve in serves.items()}
    for name, serve in serves.items():
        assert serve.returncode == 0, outputs[name]


def test_serve_tls_without_certificates_says_how_to_make_them(model_dirs, tmp_path):
    result = specd("serve", "--target", str(model_dirs["target"]), "--draft", str(model_dirs["close"]),
                   "--port", str(free_port()), "--tls", str(tmp_path))
    assert result.returncode == 2
    assert "missing ca.pem, server.pem" in result.stderr and f"specd certs {tmp_path}" in result.stderr


@pytest.mark.parametrize("command", ["generate", "bench", "doctor"])
def test_a_missing_api_key_variable_is_named(command):
    args = ["x"] if command == "generate" else []
    result = specd(command, *args, "--gateway", "127.0.0.1:1", "--api-key-env", "SPECD_TEST_NO_SUCH_KEY")
    assert result.returncode == 2
    assert "SPECD_TEST_NO_SUCH_KEY is unset or empty" in result.stderr


def test_threads_default_to_one_for_a_small_model_on_a_cpu(model_dirs, tmp_path):
    """A model under 32 MiB of weights runs on one torch thread unless --threads says
    otherwise; a larger one, or one on a GPU, keeps torch's default (0)."""
    from specd_cli.launch import SMALL_MODEL_BYTES, default_threads

    assert default_threads(model_dirs["target"], "cpu") == 1
    assert default_threads(model_dirs["target"], "cuda") == 0
    large = tmp_path / "large"
    large.mkdir()
    (large / "config.json").write_text("{}")
    with open(large / "model.safetensors", "wb") as weights:  # sparse: its size, not its bytes
        weights.truncate(SMALL_MODEL_BYTES + 1)
    assert default_threads(large, "cpu") == 0


def _options(parser, command: str) -> set[str]:
    """The option strings of one `specd` subcommand."""
    subcommands = next(a for a in parser._actions if a.dest == "command")
    return set(subcommands.choices[command]._option_string_actions)


def test_serve_takes_every_setting_a_service_takes():
    """A setting is declared once (`specd.flags`): `specd serve` has every flag of the three
    services but those declared serve=False (where a process listens, how the gateway finds
    its workers) and a few it puts otherwise (its own TLS, --draft-cpus for --cpus, its
    --target for --draft-base)."""
    from specd.flags import _flagged
    from specd_cli.launch import DRAFT, GATEWAY, VERIFIER
    from specd_cli.parser import build_parser

    parser = build_parser()
    serve = _options(parser, "serve")
    for command, defaults in (("draft", DRAFT), ("verifier", VERIFIER), ("gateway", GATEWAY)):
        not_serves = {field.metadata["flag"] for field, _ in _flagged(defaults) if not field.metadata["serve"]}
        otherwise = {"--port-file", "--cpus", "--worker-ca", "--worker-cert", "--worker-key", "--worker-server-name",
                     "--draft-base", "-h", "--help"}
        missing = _options(parser, command) - serve - not_serves - otherwise
        assert not missing, f"specd serve lacks {sorted(missing)} of specd {command}"
        assert {"--port", "--socket", "--tls-cert"} <= not_serves  # read from the declarations


def test_serve_hands_each_setting_to_the_process_that_owns_it():
    """What `specd serve` is given reaches each worker and the gateway as their own flags,
    and their settings objects read the same values back."""
    from pathlib import Path

    from gateway.settings import CLI_MODEL_FREE
    from specd.config import ServerSettings
    from specd.flags import forward_flags, from_flags
    from specd_cli.launch import DRAFT, GATEWAY, MODEL
    from specd_cli.parser import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--device", "cuda:1", "--max-sessions", "7", "--batch-wait-ms", "0",
                              "--pre-draft-branches", "all", "--overlap", "--model-free", "", "--task-draft",
                              "code=small", "--task-draft", "chat=tiny", "--drift-min-drop", "0.2",
                              "--http-port", "0", "--api-keys", "keys.txt", "--max-prompt-bytes", "99",
                              "--corpus", "answers.safetensors"])
    for role in ("draft", "verifier"):
        worker = parser.parse_args([role, *forward_flags(MODEL, args),
                                    *(forward_flags(DRAFT, args, nested=False) if role == "draft" else [])])
        model = from_flags(MODEL, worker)
        assert (model.device, model.max_sessions, model.batching.max_wait_ms) == ("cuda:1", 7, 0.0)
        if role == "draft":
            assert from_flags(DRAFT, worker).pre_draft_branches == "all"
    gateway = from_flags(GATEWAY, parser.parse_args(["gateway", *forward_flags(GATEWAY, args)]),
                         server=ServerSettings())
    assert gateway.overlap and gateway.model_free == () and gateway.http_port == 0
    assert gateway.task_drafts == {"code": "small", "chat": "tiny"} and gateway.drift.min_drop == 0.2
    assert (gateway.api_keys_file, gateway.max_prompt_bytes) == (Path("keys.txt"), 99)
    assert gateway.corpus == Path("answers.safetensors")
    # An empty file flag (from an empty variable in a manifest) is unset, not the current directory.
    assert from_flags(GATEWAY, parser.parse_args(["gateway", "--api-keys="])).api_keys_file is None
    # ...and what it was not given, the gateway's command line defaults (not the object's).
    assert gateway.draft_selection == "goodput" and from_flags(
        GATEWAY, parser.parse_args(["gateway", *forward_flags(GATEWAY, parser.parse_args(["serve"]))])
    ).model_free == CLI_MODEL_FREE


def test_log_level_reaches_the_services_loggers_and_the_workers_serve_starts(monkeypatch):
    """--log-level info shows the services' own info lines (the load cap's trials), not other
    libraries'; serve's workers, started with serve's environment, take the same level."""
    import logging

    from specd_cli.parser import LOG_LEVEL_ENV, SPECD_LOGGERS, build_parser, configure_logging

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert build_parser().parse_args(["draft"]).log_level == "warning"
    levels = {name: logging.getLogger(name).level for name in SPECD_LOGGERS}
    try:
        configure_logging(build_parser().parse_args(["serve", "--log-level", "info"]).log_level)
        assert logging.getLogger("gateway.policy.loadcap").isEnabledFor(logging.INFO)
        assert not logging.getLogger("gateway.policy.loadcap").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("urllib3").isEnabledFor(logging.INFO)
        assert build_parser().parse_args(["draft"]).log_level == "info"  # as a worker of serve parses it
    finally:
        monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_a_log_level_from_the_environment_that_is_none_is_refused(monkeypatch, capsys):
    from specd_cli.parser import LOG_LEVEL_ENV, main

    monkeypatch.setenv(LOG_LEVEL_ENV, "verbose")
    assert main(["gateway"]) == 2
    assert "SPECD_LOG_LEVEL is 'verbose'" in capsys.readouterr().err
