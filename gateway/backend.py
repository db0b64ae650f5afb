"""The gateway's connections to its workers and what it learned from them at start-up.

At start-up the gateway asks both workers for their models, refuses a draft whose
tokenizer differs from the target's, and builds the target's tokenizer from the files
the verifier ships, so the gateway never mounts or loads a model.
"""
from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specd.config import GatewaySettings
from specd.serving import CHANNEL_OPTIONS
from specd.v1 import worker_pb2, worker_pb2_grpc


class IncompatibleDraft(RuntimeError):
    """A draft model cannot speculate for the target (different tokenizer)."""


@dataclass
class Backend:
    """Channels and stubs to the workers, the models they host, the target's tokenizer."""

    verifier_channel: grpc.aio.Channel
    verifier: worker_pb2_grpc.VerifierStub
    target: worker_pb2.ModelInfo
    tokenizer: PreTrainedTokenizerBase
    draft_channel: grpc.aio.Channel | None
    draft: worker_pb2_grpc.DraftStub | None
    drafts: dict[str, worker_pb2.ModelInfo]  # name → info; the first is the default

    @property
    def default_draft(self) -> str:
        return next(iter(self.drafts), "")

    async def close(self) -> None:
        await self.verifier_channel.close()
        if self.draft_channel is not None:
            await self.draft_channel.close()


async def _model_infos(channel: grpc.aio.Channel, stub, address: str, timeout_s: float):
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        response = await stub.GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=timeout_s)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
        raise ConnectionError(f"no worker answered at {address} within {timeout_s} s") from exc
    return list(response.models)


def _tokenizer_from_files(files: dict[str, bytes]) -> PreTrainedTokenizerBase:
    with tempfile.TemporaryDirectory(prefix="specd-tokenizer-") as tmp:
        for name, content in files.items():
            (Path(tmp) / Path(name).name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)


def check_drafts(target: worker_pb2.ModelInfo, drafts: list[worker_pb2.ModelInfo]) -> None:
    """Raise IncompatibleDraft naming every draft whose vocabulary differs from the target's."""
    bad = [d for d in drafts if d.tokenizer_fingerprint != target.tokenizer_fingerprint]
    if bad:
        names = ", ".join(f"{d.name!r} (vocab {d.vocab_size})" for d in bad)
        raise IncompatibleDraft(
            f"draft {names} does not share the target {target.name!r}'s tokenizer "
            f"(vocab {target.vocab_size}): speculative decoding exchanges token ids, so the draft "
            f"must use exactly the target's tokenizer. Train or pick a draft with the same tokenizer.")


async def connect(settings: GatewaySettings) -> Backend:
    """Reach the workers, fetch their models, check them, build the tokenizer."""
    verifier_channel = grpc.aio.insecure_channel(settings.verifier_address, options=CHANNEL_OPTIONS)
    verifier = worker_pb2_grpc.VerifierStub(verifier_channel)
    (target,) = await _model_infos(verifier_channel, verifier, settings.verifier_address,
                                   settings.worker_timeout_s)
    draft_channel = draft = None
    drafts: list[worker_pb2.ModelInfo] = []
    if settings.draft_address:
        draft_channel = grpc.aio.insecure_channel(settings.draft_address, options=CHANNEL_OPTIONS)
        draft = worker_pb2_grpc.DraftStub(draft_channel)
        drafts = await _model_infos(draft_channel, draft, settings.draft_address, settings.worker_timeout_s)
        check_drafts(target, drafts)
    tokenizer = _tokenizer_from_files(dict(target.tokenizer_files))
    return Backend(verifier_channel, verifier, target, tokenizer, draft_channel, draft,
                   {d.name: d for d in drafts})
