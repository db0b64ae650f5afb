"""The worker protocol's conversions: core objects ↔ `specd.v1` worker messages, both ways.

One module for both ends of the gateway ↔ worker streams, so what one side packs the
other unpacks by the same hand: the workers (draft_service, verifier_service) turn
requests into a `Transform` and their results into responses; the gateway's links
(`gateway.workers.links`) build requests and turn responses back into `specd.steps` types.
One contract, one module. Light: protobuf and torch, no transformers.

Distributions travel as raw little-endian bytes read with torch.frombuffer, not as a
`repeated float` of vocabulary size, which is slow to build and parse in Python
(docs/design.md §9); with top-k/top-p only the support travels.
"""
from __future__ import annotations

import grpc
import numpy as np
import torch

from specd.rejection import Draws, TargetVerdict
from specd.sampling import MAX_LOGPROBS, Transform, allowed_from_words
from specd.steps import BatchStats, DraftRequest, ModelInfo, PositionLogprobs, Recovery
from specd.v1 import worker_pb2

# The worker protocol this code speaks (proto/specd/v1/worker.proto); workers report it
# in ModelInfoResponse.protocol and the gateway refuses a worker of another.
WORKER_PROTOCOL = 7


# -- distributions ------------------------------------------------------------------------

def pack_distributions(probs: torch.Tensor, sparse: bool) -> worker_pb2.Distributions:
    """Pack probabilities [n, V] as dense float32 bytes, or their non-zero support when sparse.
    The rows are on the host already: they leave a model's device on its thread, so the
    event loop, which packs them, never waits on a device."""
    if probs.device.type != "cpu":
        raise ValueError(f"rows to pack must be on the host, not {probs.device}: copy them on the model's thread")
    probs = probs.float().contiguous()
    n, vocab = probs.shape
    if not sparse:
        return worker_pb2.Distributions(positions=n, vocab_size=vocab, probs=probs.numpy().tobytes())
    rows, cols = probs.nonzero(as_tuple=True)
    offsets = torch.zeros(n + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    return worker_pb2.Distributions(
        positions=n,
        vocab_size=vocab,
        probs=probs[rows, cols].numpy().tobytes(),
        token_ids=cols.to(torch.int32).numpy().tobytes(),
        support_offsets=offsets.numpy().tobytes(),
    )


def unpack_distributions(message: worker_pb2.Distributions) -> torch.Tensor:
    """Dense float32 probabilities [positions, vocab_size] from a packed message."""
    n, vocab = message.positions, message.vocab_size
    values = torch.from_numpy(np.frombuffer(message.probs, dtype=np.float32).copy())
    if not message.token_ids:
        return values.view(n, vocab)
    token_ids = torch.from_numpy(np.frombuffer(message.token_ids, dtype=np.int32).astype(np.int64))
    offsets = np.frombuffer(message.support_offsets, dtype=np.int32)
    rows = torch.from_numpy(np.repeat(np.arange(n), np.diff(offsets)))
    dense = torch.zeros(n, vocab, dtype=torch.float32)
    dense[rows, token_ids] = values
    return dense


# -- the small messages, both ways ----------------------------------------------------------

def transform_to_pb(transform: Transform) -> worker_pb2.Transform:
    return worker_pb2.Transform(temperature=transform.temperature, top_k=transform.top_k,
                                top_p=transform.top_p, presence_penalty=transform.presence_penalty,
                                frequency_penalty=transform.frequency_penalty,
                                repetition_penalty=transform.repetition_penalty,
                                logit_bias=dict(transform.logit_bias), output_start=transform.output_start,
                                min_p=transform.min_p, min_tokens=transform.min_tokens,
                                suppressed_tokens=transform.suppressed)


def draft_request_fields(request: DraftRequest) -> dict:
    """A `DraftRequest` as the fields of a ProposeRequest (the gateway's side)."""
    return dict(draft_length=request.draft_length, transform=transform_to_pb(request.transform), seed=request.seed,
                min_confidence=request.min_confidence, vocab_limit=request.vocab_limit, grammar=request.grammar)


def draft_request_from_pb(message: worker_pb2.ProposeRequest, transform: Transform) -> DraftRequest:
    """A ProposeRequest's `DraftRequest` (the draft's side), its transform already read."""
    return DraftRequest(message.draft_length, transform, message.seed, message.min_confidence, message.vocab_limit,
                        message.grammar)


def recovery_to_pb(recovery: Recovery, sparse: bool) -> worker_pb2.Recovery:
    """A `Recovery` as the ProposeRequest field; with top-k/top-p (`sparse`) only p's support
    travels, as it came from the verifier."""
    return worker_pb2.Recovery(target_row=pack_distributions(recovery.target_row.unsqueeze(0), sparse),
                               uniform=recovery.uniform)


def _row_problem(row: worker_pb2.Distributions) -> str | None:
    """Why a Distributions message is not one row of probabilities (None: it is)."""
    shape = ("recovery.target_row must be one row of float32 probabilities, dense (vocab_size values) or "
             "sparse (token_ids with support_offsets [0, n])")
    if row.positions != 1 or not row.vocab_size or len(row.probs) % 4:
        return shape
    values = np.frombuffer(row.probs, dtype="<f4")
    if row.token_ids:
        if len(row.token_ids) != len(row.probs) or len(row.support_offsets) != 8:
            return shape
        ids = np.frombuffer(row.token_ids, dtype="<i4")
        if list(np.frombuffer(row.support_offsets, dtype="<i4")) != [0, len(ids)] or \
                not ((ids >= 0) & (ids < row.vocab_size)).all():
            return shape
    elif len(values) != row.vocab_size or row.support_offsets:
        return shape
    if not (np.isfinite(values).all() and (values >= 0).all() and values.sum() > 0):
        return "recovery.target_row must hold finite, non-negative probabilities, not all 0"
    return None


def recovery_problems(request: worker_pb2.ProposeRequest, transform: Transform) -> list[str]:
    """Why a ProposeRequest's recovery cannot be used (empty when it can, or when there is none)."""
    if not request.HasField("recovery"):
        return [] if request.draft_length >= 1 else ["draft_length must be >= 1 (0 only with a recovery)"]
    recovery = request.recovery
    row_problem = _row_problem(recovery.target_row)
    problems = [row_problem] if row_problem else []
    if not 0.0 <= recovery.uniform < 1.0:
        problems.append(f"recovery.uniform must be in [0, 1), got {recovery.uniform}")
    if transform.greedy:
        problems.append("a recovery belongs to a sampled step; this one is greedy (temperature 0)")
    return problems


def recovery_from_pb(request: worker_pb2.ProposeRequest) -> Recovery | None:
    """A ProposeRequest's recovery (None when it has none). p's row stays on the host: the
    draw moves it to q's device, on the model's thread."""
    if not request.HasField("recovery"):
        return None
    return Recovery(unpack_distributions(request.recovery.target_row)[0], request.recovery.uniform)


def draws_from_pb(request: worker_pb2.VerifyRequest) -> Draws | None:
    """The gateway's draws of a sampled verify step (None when it sent none)."""
    if not request.uniforms:
        return None
    *accept, final = request.uniforms
    return Draws(tuple(accept), final)


def ahead_draws_from_pb(request: worker_pb2.VerifyRequest) -> list[Draws]:
    """The draws of the plain steps after this one, sent early for the verifier to run ahead."""
    return [Draws((), u) for u in request.ahead_uniforms]


def logprobs_from_request(request: worker_pb2.VerifyRequest) -> int | None:
    """How many alternatives a verify step asks with its log-probabilities (None: none asked)."""
    if not request.HasField("logprobs"):
        return None
    if request.logprobs > MAX_LOGPROBS:
        raise ValueError(f"logprobs is {request.logprobs}; at most {MAX_LOGPROBS} alternatives")
    return request.logprobs


def allowed_to_bytes(words: torch.Tensor) -> bytes:
    """A grammar's bitmask rows, int32 [n, ceil(V / 32)], as VerifyRequest.allowed_tokens."""
    return words.to(torch.int32).cpu().contiguous().numpy().astype("<i4").tobytes()


def allowed_from_request(request: worker_pb2.VerifyRequest, vocab: int) -> torch.Tensor | None:
    """The tokens a grammar allows at each scored position, bool [γ+1, vocab] (None: all).
    ValueError when the bitmask is not γ+1 rows of ceil(vocab / 32) words."""
    if not request.allowed_tokens:
        return None
    width = (vocab + 31) // 32
    rows = len(request.draft_tokens) + 1
    if len(request.allowed_tokens) != rows * width * 4:
        raise ValueError(f"allowed_tokens is {len(request.allowed_tokens)} bytes; {rows} positions of a "
                         f"{vocab}-token vocabulary take {rows * width * 4}")
    words = torch.from_numpy(np.frombuffer(request.allowed_tokens, dtype="<i4").astype(np.int32)).view(rows, width)
    return allowed_from_words(words, vocab)


def logprobs_to_pb(positions: tuple[PositionLogprobs, ...]) -> list[worker_pb2.PositionLogprobs]:
    messages = []
    for position in positions:
        message = worker_pb2.PositionLogprobs(top_ids=[t for t, _ in position.top],
                                              top_logprobs=[v for _, v in position.top])
        if position.token is not None:
            message.token = position.token
        else:
            assert position.row is not None  # a rejected position carries its row, on the host (verifier_service.jobs)
            message.row = position.row.float().contiguous().numpy().astype("<f4").tobytes()
        messages.append(message)
    return messages


def logprobs_from_pb(messages) -> tuple[PositionLogprobs, ...]:
    """The positions' log-probabilities as the verifier sent them."""
    return tuple(PositionLogprobs(tuple(zip(m.top_ids, m.top_logprobs)),
                                  m.token if m.HasField("token") else None,
                                  None if m.HasField("token") else
                                  torch.from_numpy(np.frombuffer(m.row, dtype="<f4").astype(np.float32)))
                 for m in messages)


def verdict_problem(response: worker_pb2.VerifyResponse, gamma: int) -> str | None:
    """Why a sampled step's answer is not a protocol-2 verdict on γ draft tokens (None: it is).

    A verdict is the bonus token with every token accepted, or a rejection before the
    end with exactly one row; a verifier of protocol 1 sent γ+1 rows and no verdict.
    """
    if response.HasField("bonus_token"):
        return None if response.accepted == gamma else f"a bonus token after {response.accepted} of {gamma} accepted"
    if response.accepted >= gamma or response.target_probs.positions != 1:
        return (f"no verdict on {gamma} draft tokens ({response.accepted} accepted, "
                f"{response.target_probs.positions} rows): does the verifier speak worker protocol {WORKER_PROTOCOL}?")
    return None


def verdict_from_pb(response: worker_pb2.VerifyResponse) -> TargetVerdict:
    """The verifier's verdict on a sampled step: the bonus token, or the rejected position's row."""
    if response.HasField("bonus_token"):
        return TargetVerdict(response.accepted, response.bonus_token, None)
    return TargetVerdict(response.accepted, None, unpack_distributions(response.target_probs)[0])


def transform_from_pb(message: worker_pb2.Transform) -> Transform:
    return Transform.from_fields(message.temperature, message.top_k, message.top_p, message.presence_penalty,
                                 message.frequency_penalty, message.repetition_penalty, dict(message.logit_bias),
                                 message.output_start, message.min_p, message.min_tokens,
                                 list(message.suppressed_tokens))


def batch_to_pb(batch: BatchStats) -> worker_pb2.BatchInfo:
    return worker_pb2.BatchInfo(size=batch.size, tokens=batch.tokens, queue_ms=batch.queue_ms,
                                forwards=batch.forwards, sessions=batch.sessions, cached_tokens=batch.cached)


def batch_from_pb(message: worker_pb2.BatchInfo) -> BatchStats:
    return BatchStats(message.size, message.tokens, message.queue_ms, message.forwards, message.sessions,
                      message.cached_tokens)


def model_info_to_pb(info: ModelInfo, tokenizer_files: dict[str, bytes] | None = None) -> worker_pb2.ModelInfo:
    """Describe a hosted model; the verifier also ships its tokenizer files."""
    return worker_pb2.ModelInfo(
        name=info.name, vocab_size=info.vocab_size, max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint, eos_token_ids=info.eos_token_ids,
        weights_digest=info.weights_digest, parameter_bytes=info.parameter_bytes, card_json=info.card_json,
        model_path=info.model_path, tokenizer_files=tokenizer_files or {},
        forward_costs=[worker_pb2.ForwardCost(batch=b, width=w, ms=ms) for b, w, ms in info.forward_costs])


def model_info_from_pb(message: worker_pb2.ModelInfo) -> ModelInfo:
    """A hosted model's facts as the gateway keeps them (the tokenizer files aside)."""
    return ModelInfo(message.name, message.vocab_size, message.max_context, message.tokenizer_fingerprint,
                     tuple(message.eos_token_ids), message.weights_digest, message.parameter_bytes,
                     message.card_json, message.model_path,
                     tuple((c.batch, c.width, c.ms) for c in message.forward_costs))


def identity_to_pb(info: ModelInfo) -> worker_pb2.ModelIdentity:
    """The identity a worker stream expects, from what the worker reported at start-up."""
    return worker_pb2.ModelIdentity(name=info.name, weights_digest=info.weights_digest,
                                    tokenizer_fingerprint=info.tokenizer_fingerprint)


# -- what a worker checks in a step message -------------------------------------------------

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


def identity_mismatch(expected: worker_pb2.ModelIdentity, held: ModelInfo) -> str | None:
    """Why a session meant for `expected` must not be served by the model `held`; None if it may.

    The message names both identities (digests shortened), for the gateway's log.
    """
    mine = (held.name, held.weights_digest, held.tokenizer_fingerprint)
    wanted = (expected.name, expected.weights_digest, expected.tokenizer_fingerprint)
    if mine == wanted:
        return None
    return (f"this worker holds {describe_identity(*mine)}, but the session expects "
            f"{describe_identity(*wanted)}: the worker behind this address changed since the "
            f"gateway checked it; the gateway must use another worker or be restarted")


def describe_identity(name: str, weights_digest: str, tokenizer_fingerprint: str) -> str:
    """`'target' (weights 1a2b3c4d5e6f, tokenizer 9f8e7d6c5b4a)` for logs and errors."""
    return f"{name!r} (weights {weights_digest[:12] or '?'}, tokenizer {tokenizer_fingerprint[:12] or '?'})"


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_to_pb(code: grpc.StatusCode, message: str) -> worker_pb2.StepStatus:
    """A step's status as its result carries it."""
    return worker_pb2.StepStatus(code=code.value[0], message=message)


def status_from_pb(status: worker_pb2.StepStatus) -> grpc.StatusCode:
    """The gRPC status code a step's result carries (UNKNOWN for a number no release knows)."""
    return _STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN)

