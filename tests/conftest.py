"""Shared fixtures: tiny real models made here, and the three services on loopback.

Acceptance does not matter for these models, exactness does: a tokenizer trained in a
second on a few paragraphs, a small Llama target, a draft close to it (the target's
weights plus noise) and an unrelated draft (another random Llama, same tokenizer).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import torch

# Where no GPU compiles Triton's kernels, its CPU interpreter runs them (the paged attention
# kernel's tests, tests/test_pagedkernel.py). Triton reads this when it is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draft_service.server import DraftServicer
from draft_service.server import create_server as create_draft
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from specd.config import ServerSettings
from specd.grpcserver import RunningServer
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd.worker.settings import BatchSettings, DraftSettings, ModelSettings, VerifierSettings
from verifier_service.server import VerifierServicer
from verifier_service.server import create_server as create_verifier

# Where the services' models run in the stack fixtures: CPU float32 here; scripts/gpu_check.sh
# runs the exactness tests with SPECD_TEST_DEVICE=cuda SPECD_TEST_DTYPE=float32 (bfloat16 works
# too, for the tests that allow half precision's rounding).
TEST_DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("SPECD_TEST_DTYPE", "float32")
# The devices of a test that takes the `device` fixture: this CPU always, and CUDA where torch
# sees a device (skipped, with the reason, where it does not).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"))]

CORPUS = """\
Speculative decoding lets a small draft model propose several tokens that a large
target model verifies in a single forward pass. The gateway accepts a prefix of the
proposal and samples one more token, so the output keeps the target's distribution.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
The acceptance rate is the share of draft tokens the target keeps. When it is high,
each step emits several tokens for the price of one target forward.
class Cache:
    def __init__(self, size):
        self.size = size
        self.items = {}
"""


def make_tokenizer(directory: Path, vocab_size: int = 320, extra_text: str = "") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS, saved as a transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS + extra_text] * 4, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    wrapped.save_pretrained(directory)
    return wrapped


def make_model(directory: Path, tokenizer, *, seed: int, layers: int = 2, hidden: int = 64,
               noise_from: Path | None = None, noise: float = 0.0, context: int = 256,
               extra_vocab: int = 0) -> None:
    """A random Llama saved to `directory` with the tokenizer; or a noisy copy of another."""
    torch.manual_seed(seed)
    if noise_from is not None:
        model = AutoModelForCausalLM.from_pretrained(noise_from)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * param.std() * torch.randn_like(param))
    else:
        config = LlamaConfig(vocab_size=len(tokenizer) + extra_vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=context, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id, bos_token_id=None,
                             initializer_range=0.1, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Directories of: target, close (draft), unrelated (draft), padded (a draft whose
    embedding has 64 more rows than the tokenizer has tokens), alien (other tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tokenizer(root / "tokenizer")
    dirs = {name: root / name for name in ("target", "close", "unrelated", "padded", "alien")}
    make_model(dirs["target"], tokenizer, seed=1, layers=2, hidden=64)
    make_model(dirs["close"], tokenizer, seed=2, noise_from=dirs["target"], noise=0.05)
    make_model(dirs["unrelated"], tokenizer, seed=3, layers=1, hidden=32)
    make_model(dirs["padded"], tokenizer, seed=5, layers=1, hidden=32, extra_vocab=64)
    alien_tokenizer = make_tokenizer(root / "alien-tokenizer", vocab_size=300, extra_text="zebra quokka")
    make_model(dirs["alien"], alien_tokenizer, seed=4, layers=1, hidden=32)
    return dirs


class LoopThread:
    """An asyncio loop on a background thread, hosting the servers under test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Stack:
    """Draft, verifier and gateway servers on loopback, and a client stub for the gateway."""

    loop: LoopThread
    draft_settings: DraftSettings
    verifier_settings: VerifierSettings
    draft: RunningServer
    verifier: RunningServer
    gateway: RunningServer
    channel: grpc.Channel
    stub: gateway_pb2_grpc.GatewayStub

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def restart_draft(self) -> None:
        """Stop the draft service and start a fresh one on the same port (sessions lost)."""
        self.loop.run(self.draft.stop(0))
        settings = replace(self.draft_settings, server=replace(self.draft_settings.server, port=self.draft.port))
        self.draft = self.loop.run(create_draft(settings))

    def restart_verifier(self) -> None:
        self.loop.run(self.verifier.stop(0))
        settings = replace(self.verifier_settings,
                           server=replace(self.verifier_settings.server, port=self.verifier.port))
        self.verifier = self.loop.run(create_verifier(settings))

    def open_sessions(self) -> int:
        """KV-cache sessions the draft and verifier hold right now."""
        draft, verifier = self.draft.servicer, self.verifier.servicer
        assert isinstance(draft, DraftServicer) and isinstance(verifier, VerifierServicer)
        runners = [*(drafter.runner for drafter in draft.drafts.values()), verifier.scorer.runner]
        return sum(len(runner.sessions) for runner in runners)

    def wait_no_sessions(self, within_s: float = 20.0) -> int:
        """Sessions left once the workers have had `within_s` to drop those of ended streams."""
        deadline = time.monotonic() + within_s
        while self.open_sessions() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.open_sessions()

    def close(self) -> None:
        self.channel.close()
        for server in (self.gateway, self.draft, self.verifier):
            self.loop.run(server.stop(0))
        self.loop.close()


# A draft step past its budget (0.5 s at least) is skipped: the step decodes plainly, and a
# seeded output takes other proposals and other draws. A loaded test machine can take a
# tiny draft's step that long, so a stack whose tests compare seeded outputs gives its draft
# a budget longer than any step. (A stack whose draft is stopped for good keeps the short
# one: each of its steps would wait the whole budget on the dead draft.)
SEEDED_DRAFT_FLOOR_S = 120.0


# A session's stack serves its tests on one channel for half an hour. The gateway's connection
# age (GOAWAY after 300 s by default) would close that channel under whichever test runs at
# that moment, and a call refused mid-upload (an oversized message) then ends UNAVAILABLE
# instead of with its own status. The age is a deployment setting with its own test
# (test_gateway_health), so stacks leave it off.
STACK_GATEWAY_DEFAULTS = {"max_connection_age_s": 0.0}


def start_stack(model_dirs: dict[str, Path], max_sessions: int = 64, batching: BatchSettings = BatchSettings(),
                verifier_metrics_port: int = 0, draft_metrics_port: int = 0, pre_draft_branches: str = "3",
                drafts: tuple[str, ...] = ("close", "unrelated", "padded"), front=None,
                device: str = TEST_DEVICE, dtype: str = TEST_DTYPE, draft_grammar_mask_budget_ms: float = 20.0,
                draft_base: Path | None = None, **gateway_options) -> Stack:
    """The three services on loopback, their models on `device` in `dtype`; `drafts` names the
    model_dirs the draft service hosts (the first is the default draft). front(loop, role,
    port) -> port: what the gateway dials for a worker ("draft", "verifier") instead of its
    port (a proxy, in fault tests). draft_grammar_mask_budget_ms: 0 leaves the draft's q
    unguided by a request's grammar. draft_base: where a draft that shares its target's
    weights reads them (`specd.worker.sharing`)."""
    loop = LoopThread()
    server = ServerSettings("127.0.0.1", 0, grace_s=1.0)
    model = ModelSettings(dtype=dtype, max_sessions=max_sessions, device=device, batching=batching)
    draft_settings = DraftSettings(server, {name: model_dirs[name] for name in drafts}, model,
                                   metrics_port=draft_metrics_port, pre_draft_branches=pre_draft_branches,
                                   grammar_mask_budget_ms=draft_grammar_mask_budget_ms, draft_base=draft_base)
    verifier_settings = VerifierSettings(server, model_dirs["target"], model, metrics_port=verifier_metrics_port)
    draft = loop.run(create_draft(draft_settings))
    verifier = loop.run(create_verifier(verifier_settings))
    front = front or (lambda loop, role, port: port)
    gateway_settings = GatewaySettings(server, verifier_address=f"127.0.0.1:{front(loop, 'verifier', verifier.port)}",
                                       draft_address=f"127.0.0.1:{front(loop, 'draft', draft.port)}",
                                       **{"worker_timeout_s": 30.0, **STACK_GATEWAY_DEFAULTS, **gateway_options})
    gateway = loop.run(create_gateway(gateway_settings))
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    return Stack(loop, draft_settings, verifier_settings, draft, verifier, gateway, channel,
                 gateway_pb2_grpc.GatewayStub(channel))


@pytest.fixture(scope="session")
def stack(model_dirs) -> Iterator[Stack]:
    running = start_stack(model_dirs, draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    yield running
    running.close()


@pytest.fixture(scope="session")
def target_model(model_dirs):
    """The target for transformers' reference decoding, on the services' device and dtype."""
    return AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=getattr(torch, TEST_DTYPE)).to(
        TEST_DEVICE).eval()


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """The device a test runs its models on: "cpu", then "cuda" where there is one. Such a test
    runs in float32 on either: its exactness bars compare with the reference to the bit, or
    nearly, which half precision's rounding does not keep (SPECD_TEST_DTYPE is for the others)."""
    return request.param


@pytest.fixture(scope="session")
def device_stack(request, model_dirs, device) -> Iterator[Stack]:
    """The three services with their models on `device` in float32: the session's `stack`
    where that is what it runs, else a stack of their own."""
    if device == TEST_DEVICE and TEST_DTYPE == "float32":
        yield request.getfixturevalue("stack")
        return
    running = start_stack(model_dirs, device=device, dtype="float32", draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    yield running
    running.close()


@pytest.fixture(scope="session")
def device_target(model_dirs, device):
    """The target for transformers' reference decoding on `device`, in float32."""
    return AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32).to(device).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dirs):
    return AutoTokenizer.from_pretrained(model_dirs["target"])


def request(prompt: str, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, seed: int = 0,
            max_new_tokens: int = 24, mode: str = "FIXED", draft_length: int = 4, draft_model: str = "",
            stop: list[str] | None = None) -> gateway_pb2.GenerateRequest:
    """Build a GenerateRequest with the test suite's defaults."""
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        sampling=gateway_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                            max_new_tokens=max_new_tokens, stop=stop or []),
        speculation=gateway_pb2.SpeculationParams(mode=getattr(gateway_pb2, f"SPECULATION_MODE_{mode}"),
                                                  draft_length=draft_length, draft_model=draft_model))


def assert_follows(counts: dict, joint: dict, trials: int) -> None:
    """A chi-square test that sampled outcomes (`counts` over `trials`) follow the law
    `joint` (outcome → probability), with every outcome inside its support. Cells expected
    under 5 times are pooled into one, as the test needs."""
    from scipy.stats import chisquare

    assert set(counts) <= set(joint), set(counts) - set(joint)
    cells = sorted(joint)
    expected = [joint[c] * trials for c in cells]
    big = [i for i, e in enumerate(expected) if e >= 5]
    observed = [counts.get(cells[i], 0) for i in big] + [sum(counts.get(cells[i], 0) for i in range(len(cells))
                                                            if i not in big)]
    wanted = [expected[i] for i in big] + [sum(e for i, e in enumerate(expected) if i not in big)]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    wanted = [w * trials / sum(wanted) for w in wanted]  # the law sums to 1 up to float rounding
    assert chisquare(observed, wanted).pvalue > 1e-3, list(zip(observed, wanted))
