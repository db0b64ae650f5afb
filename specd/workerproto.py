"""Conversions between the runtime's objects and the worker messages, for both workers.

Shared by draft_service and verifier_service so the two stay symmetrical.
"""
from __future__ import annotations

from specd.batching import BatchStats
from specd.interceptors import clip
from specd.runtime import ModelInfo, ModelRunner
from specd.sampling import Transform
from specd.v1 import worker_pb2


def transform_from_pb(message: worker_pb2.Transform) -> Transform:
    return Transform(message.temperature, message.top_k, message.top_p or 1.0)


def batch_to_pb(batch: BatchStats) -> worker_pb2.BatchInfo:
    return worker_pb2.BatchInfo(size=batch.size, tokens=batch.tokens, queue_ms=batch.queue_ms,
                                forwards=batch.forwards, sessions=batch.sessions)


def batch_span_attributes(batch: BatchStats) -> dict:
    """The batching attributes every worker step span carries (docs/tracing.md)."""
    return {"specd.batch.size": batch.size, "specd.batch.tokens": batch.tokens,
            "specd.batch.queue_ms": batch.queue_ms, "specd.batch.forwards": batch.forwards,
            "specd.batch.sessions": batch.sessions}


# Far above any useful γ (the gateway caps requests at --max-draft-length, 16 by default),
# low enough that a bad message cannot keep a model thread busy for long.
MAX_DRAFT_LENGTH = 128


def step_problems(info: ModelInfo, delta: worker_pb2.SequenceDelta, transform: Transform,
                  extra_positions: int) -> list[str]:
    """Why a step message cannot run (empty when it can), checked before touching the session.

    extra_positions: positions the step adds beyond the delta (γ, or the draft tokens).
    """
    problems = transform.problems()
    end = delta.start + len(delta.tokens) + extra_positions
    if end > info.max_context:
        problems.append(f"the step reaches position {end}, beyond {info.name}'s context of {info.max_context}")
    if len(delta.session_id) > 256:
        problems.append(f"session_id is {len(delta.session_id)} characters; at most 256")
    return problems


def session_lost(role: str, error: Exception) -> str:
    """The NOT_FOUND message of a lost session (the id clipped: it is the caller's value)."""
    return f"{role} session lost: {clip(str(error), 200)}"


def model_info_to_pb(runner: ModelRunner, with_tokenizer: bool) -> worker_pb2.ModelInfo:
    """Describe a hosted model; the verifier also ships its tokenizer files."""
    info = runner.info
    message = worker_pb2.ModelInfo(
        name=info.name, vocab_size=info.vocab_size, max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint, eos_token_ids=info.eos_token_ids,
        weights_digest=info.weights_digest, parameter_bytes=info.parameter_bytes, card_json=info.card_json,
        model_path=info.model_path)
    if with_tokenizer:
        for name in runner.tokenizer_files():
            message.tokenizer_files[name] = (runner.path / name).read_bytes()
    return message


def identity_mismatch(expected: worker_pb2.ModelIdentity, held: ModelInfo) -> str | None:
    """Why a stream meant for `expected` must not be served by the model `held`; None if it may.

    The message names both identities (digests shortened), for the gateway's log.
    """
    mine = (held.name, held.weights_digest, held.tokenizer_fingerprint)
    wanted = (expected.name, expected.weights_digest, expected.tokenizer_fingerprint)
    if mine == wanted:
        return None
    return (f"this worker holds {describe_identity(*mine)}, but the stream expects "
            f"{describe_identity(*wanted)}: the worker behind this address changed since the "
            f"gateway checked it; the gateway must use another worker or be restarted")


def describe_identity(name: str, weights_digest: str, tokenizer_fingerprint: str) -> str:
    """`'target' (weights 1a2b3c4d5e6f, tokenizer 9f8e7d6c5b4a)` for logs and errors."""
    return f"{name!r} (weights {weights_digest[:12] or '?'}, tokenizer {tokenizer_fingerprint[:12] or '?'})"
