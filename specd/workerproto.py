"""Conversions between the runtime's objects and the worker messages, for both workers.

Shared by draft_service and verifier_service so the two stay symmetrical.
"""
from __future__ import annotations

from specd.runtime import ModelRunner
from specd.sampling import Transform
from specd.v1 import worker_pb2


def transform_from_pb(message: worker_pb2.Transform) -> Transform:
    return Transform(message.temperature, message.top_k, message.top_p or 1.0)


def model_info_to_pb(runner: ModelRunner, with_tokenizer: bool) -> worker_pb2.ModelInfo:
    """Describe a hosted model; the verifier also ships its tokenizer files."""
    info = runner.info
    message = worker_pb2.ModelInfo(
        name=info.name, vocab_size=info.vocab_size, max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint, eos_token_ids=info.eos_token_ids)
    if with_tokenizer:
        for name in runner.tokenizer_files():
            message.tokenizer_files[name] = (runner.path / name).read_bytes()
    return message
