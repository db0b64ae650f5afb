"""Validation: a client's request checked against the models and the settings, and turned
into what the core runs (`gateway.request`: from `ClientRequest` to `ParsedRequest`).

Every problem is named, all of them in one `InvalidRequest`, so a client fixes its
request in one round. Sizes are checked before any costly work: a prompt over
--max-prompt-bytes is not tokenized at all. This is the one place that computes a
request's bounds (its length, its γ bounds, its proposers, its prefix cache salt); the
run loop (`gateway.core`) never checks them again.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from gateway.errors import InvalidRequest
from gateway.grammar import structure_grammar
from gateway.policy.gamma import POLICIES
from gateway.request import ClientRequest, Generation, Mode, ParsedRequest, Stopping
from gateway.settings import GatewaySettings
from gateway.tasks import DEFAULT_PROFILES, GENERAL, TaskProfile, classify
from gateway.workers.backend import Backend
from specd.contract import MODEL_FREE
from specd.errors import clip
from specd.sampling import MAX_LOGPROBS, Transform

T = TypeVar("T")


def parse_request(request: ClientRequest, backend: Backend, settings: GatewaySettings,
                  choose: Callable[[str, str], str] | None = None) -> ParsedRequest:
    """Validate a public request against the models and settings; collect every problem.

    Values echoed back are clipped (`specd.errors.clip`).
    choose(task type, user segment): picks the draft of a request that names none
    (`gateway.policy.selection`); None: the task map, else the default draft.
    """
    transform = Transform.from_fields(request.temperature, request.top_k, request.top_p, request.presence_penalty,
                                      request.frequency_penalty, request.repetition_penalty, request.logit_bias,
                                      min_p=request.min_p, min_tokens=request.min_tokens)
    problems = transform.problems() + _size_problems(request, settings)
    grammar = _output_problems(request, backend, settings, problems)
    prompt_ids, prompt_text = _prompt(request, backend, settings, problems)
    if request.truncate_prompt_tokens:  # vLLM's: the last k tokens of the prompt, the start dropped
        prompt_ids = prompt_ids[-request.truncate_prompt_tokens:]
    max_new = _max_new_tokens(request, settings, len(prompt_ids), backend.target.max_context, problems)
    mode, policy = _speculation(request, settings, problems)
    task_type = request.task_type or classify(prompt_text)
    forced = request.draft_model if request.draft_model in settings.hosted_model_free else ""
    draft_model = (request.draft_model or settings.task_drafts.get(task_type, "")
                   or backend.default_draft)
    problems += _draft_problems(request, backend, settings, mode, forced)
    if problems:
        raise InvalidRequest("; ".join(problems))
    assert mode is not None  # an unknown mode is one of the problems

    if mode is Mode.OFF or not backend.drafts or forced:
        draft_model = ""
    selected = False
    if mode is not Mode.OFF and backend.drafts and not request.draft_model and choose is not None:
        draft_model, selected = choose(task_type, request.user_segment), True
    # Model-free proposers beside the draft model under AUTO; a named proposer (model-free
    # or not) alone; none when OFF, nor under FIXED with a draft model (which proposes
    # draft_length tokens every step).
    if mode is Mode.OFF or (request.draft_model and not forced):
        model_free: tuple[str, ...] = ()
    else:
        model_free = (forced,) if forced else settings.hosted_model_free if mode is Mode.AUTO else ()
    draft_length, profile, model_free_max = _draft_lengths(request, settings, task_type, mode)
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    overlap = settings.overlap if request.overlap is None else request.overlap
    # The confidence policy's threshold is carried out by the draft, inside each step.
    min_confidence = (_given(request.min_draft_confidence, settings.default_min_confidence)
                      if policy == "confidence" and draft_model else 0.0)
    # Penalties count output tokens from where the prompt ends; until min_tokens, no token
    # that would end the output may be chosen (EOS even with ignore_eos, as vLLM does).
    eos, stops = frozenset(backend.target.eos_token_ids), frozenset(request.stop_token_ids)
    transform = replace(transform, output_start=len(prompt_ids), suppressed=tuple(sorted(eos | stops)))
    stopping = Stopping(max_new, stops, request.ignore_eos, tuple(request.stop), request.include_stop)
    generation = Generation(list(prompt_ids), transform, seed, stopping, draft_model, overlap, min_confidence,
                            request.logprobs, grammar)
    return ParsedRequest(
        generation, mode, policy, draft_length, profile, task_type, request.user_segment,
        selected, model_free, forced, model_free_max, cache_salt(settings, request.user_segment, request.cache_salt),
        request.skip_special_tokens)


def _draft_lengths(request: ClientRequest, settings: GatewaySettings, task_type: str,
                   mode: Mode) -> tuple[int, TaskProfile, int]:
    """Every bound on the request's γ, in one place: (γ of FIXED and EMA's first, the task
    profile whose [min, max] the adaptive policies choose in, the longest model-free proposal).

    Each is within `--max-draft-length` (`_speculation` refused a request past it), and so
    within the wire's `MAX_DRAFT_LENGTH` (the gateway refuses to start past it). A request's
    own bound wins over its task's. A model-free proposal is bounded by the request or the
    gateway, not by the task: the task's bound prices a model draft's tokens, while a
    confident match costs nothing to draft, only to verify, and the hybrid cuts it where
    that pays (`gateway.proposers.hybrid`). Per step, the engine bounds γ further by the tokens left
    and the context, and AUTO by the load cap (`gateway.step.engine`, `gateway.policy.loadcap`).
    """
    draft_length = _given(request.draft_length, settings.default_draft_length)
    prior = settings.task_profiles.get(task_type) or settings.task_profiles.get(GENERAL, DEFAULT_PROFILES[GENERAL])
    max_draft_length = min(_given(request.max_draft_length, prior.max_draft_length), settings.max_draft_length)
    min_draft_length = min(_given(request.min_draft_length, prior.min_draft_length), max_draft_length)
    profile = TaskProfile(prior.prior_alpha, max(min_draft_length, 1), max(max_draft_length, 1))
    model_free_max = (_given(request.max_draft_length, settings.max_draft_length) if mode is Mode.AUTO
                      else draft_length)
    return draft_length, profile, model_free_max


def _given(value: T | None, default: T) -> T:
    """A request's value, or the default where the client left it unset (None)."""
    return default if value is None else value


def cache_salt(settings: GatewaySettings, user_segment: str, own: str) -> bytes:
    """The salt of a request's prefix cache keys on the workers. With API keys, the tenant
    (the key's segment): one tenant never hits another's prefixes, so a hit's speed tells
    nothing of what others sent. Without keys, every caller shares the cache. The caller's
    own `cache_salt` (vLLM's) narrows it further."""
    tenant = user_segment if settings.api_keys_file is not None else ""
    return f"{len(tenant)}:{tenant}{own}".encode()


def _size_problems(request: ClientRequest, settings: GatewaySettings) -> list[str]:
    """What is too large in a request, apart from its prompt (labels, stop strings)."""
    problems = []
    for name, value in (("task_type", request.task_type), ("user_segment", request.user_segment),
                        ("cache_salt", request.cache_salt),
                        ("draft_model", request.draft_model), ("policy", request.policy)):
        if len(value.encode("utf-8")) > settings.max_label_bytes:
            problems.append(f"{name} is {len(value.encode('utf-8'))} bytes; at most {settings.max_label_bytes}")
    stop = request.stop
    if len(stop) > settings.max_stop_strings:
        problems.append(f"{len(stop)} stop strings; at most {settings.max_stop_strings}")
    longest = max((len(s.encode("utf-8")) for s in stop), default=0)
    if longest > settings.max_stop_bytes:
        problems.append(f"a stop string is {longest} bytes; at most {settings.max_stop_bytes} each")
    return problems


def _output_problems(request: ClientRequest, backend: Backend, settings: GatewaySettings,
                     problems: list[str]) -> str:
    """Check what shapes the output (token ids named, logprobs, the structure), appending
    to `problems`; the structure's grammar text (`gateway.grammar`), empty when none is asked."""
    vocab = backend.target.vocab_size
    for name, ids in (("logit_bias", request.logit_bias), ("stop_token_ids", request.stop_token_ids)):
        outside = sorted(t for t in ids if not 0 <= t < vocab)
        if outside:
            problems.append(f"{name} names token ids {outside[:5]} outside the target's vocabulary of {vocab}")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
        problems.append(f"logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {request.logprobs}")
    grammar = ""
    if request.structure is not None:
        try:
            grammar = structure_grammar(request.structure)
        except ValueError as exc:
            problems.append(f"structured output: {str(exc)[:600]}")
        # The structure decides where the output ends: it allows nothing but EOS then.
        if request.ignore_eos or request.min_tokens:
            problems.append("ignore_eos and min_tokens cannot be combined with structured output: the structure "
                            "decides where the output ends")
    if len(request.stop_token_ids) > settings.max_stop_strings * 4:
        problems.append(f"stop_token_ids may list at most {settings.max_stop_strings * 4} ids, got "
                        f"{len(request.stop_token_ids)}")
    return grammar


def _prompt(request: ClientRequest, backend: Backend, settings: GatewaySettings,
            problems: list[str]) -> tuple[list[int], str]:
    """The prompt's token ids and its text (for stop strings and task classification),
    appending to `problems`; no ids when the prompt cannot be served."""
    prompt_text = request.prompt
    if request.prompt_ids is not None:
        prompt_ids = list(request.prompt_ids)
        vocab = backend.target.vocab_size
        outside = [t for t in prompt_ids if not 0 <= t < vocab]
        if outside:
            problems.append(f"prompt token ids {outside[:5]} are outside the target's vocabulary of {vocab}")
            prompt_ids = []
        elif not prompt_ids:
            problems.append("prompt is an empty list of token ids; send at least one")
        # Decoded only when it can be served: a list of ids past the context window costs
        # no decoding on the one parse thread.
        fits = len(prompt_ids) < backend.target.max_context
        prompt_text = backend.tokenizer.decode(prompt_ids) if prompt_ids and fits else ""
        return prompt_ids, prompt_text
    prompt_bytes = len(request.prompt.encode("utf-8"))
    if prompt_bytes > settings.max_prompt_bytes:
        problems.append(f"prompt is {prompt_bytes} bytes, over this gateway's limit of {settings.max_prompt_bytes}; "
                        f"shorten it")
        return [], prompt_text
    prompt_ids = backend.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"]
    if not prompt_ids:
        problems.append("prompt is empty after tokenization; send some text")
    return prompt_ids, prompt_text


def _max_new_tokens(request: ClientRequest, settings: GatewaySettings, prompt_tokens: int, context: int,
                    problems: list[str]) -> int:
    """How many tokens the request may generate (the gateway's default when it names none),
    appending to `problems` what does not fit the context window or the cap, and a
    min_tokens it could never reach."""
    if prompt_tokens >= context:
        problems.append(f"prompt is {prompt_tokens} tokens but the target's context window is "
                        f"{context}; shorten the prompt to at most {context - 1} tokens")
    room = max(context - prompt_tokens, 0)
    if request.max_new_tokens is not None and request.max_new_tokens == 0:
        problems.append("max_new_tokens=0 asks for nothing; ask for at least 1, or leave it unset for this "
                        "gateway's default (--max-new-tokens; 0: up to the end of the context)")
    max_new = request.max_new_tokens or min(settings.default_max_new_tokens or room, settings.max_new_tokens_cap, room)
    if (request.max_new_tokens or 0) > settings.max_new_tokens_cap:
        problems.append(f"max_new_tokens={request.max_new_tokens} exceeds this gateway's cap of "
                        f"{settings.max_new_tokens_cap}")
    if prompt_tokens and request.max_new_tokens and prompt_tokens + max_new > context:
        problems.append(f"max_new_tokens={max_new} with a {prompt_tokens}-token prompt exceeds the "
                        f"target's context window of {context}; ask for at most {room}")
    if request.min_tokens > max_new:
        problems.append(f"min_tokens={request.min_tokens} asks for more than the {max_new} tokens this request "
                        f"may generate")
    return max_new


def _speculation(request: ClientRequest, settings: GatewaySettings, problems: list[str]) -> tuple[Mode | None, str]:
    """The request's speculation mode (None when unknown) and γ policy, appending to
    `problems` what is out of range or does not go together."""
    mode = next((m for m in Mode if m.value == request.mode), None)
    if mode is None:
        problems.append(f"unknown speculation mode {clip(request.mode)}; use one of {[m.value for m in Mode]}")
    for name in ("draft_length", "min_draft_length", "max_draft_length"):
        value = getattr(request, name)
        if value is not None and value > settings.max_draft_length:
            problems.append(f"{name}={value} exceeds this gateway's maximum of {settings.max_draft_length}")
    if _given(request.min_draft_length, 0) > _given(request.max_draft_length, settings.max_draft_length):
        problems.append("min_draft_length must not exceed max_draft_length")
    policy = request.policy or (settings.auto_policy if mode is Mode.AUTO else "fixed")
    if mode is Mode.FIXED and policy != "fixed":
        problems.append(f"policy {clip(policy)} chooses γ itself: use it with mode AUTO; mode FIXED proposes "
                        f"draft_length tokens every step")
    elif policy not in POLICIES:
        problems.append(f"unknown policy {clip(request.policy)}; use one of {list(POLICIES)}")
    if request.min_draft_confidence is not None and not 0.0 <= request.min_draft_confidence < 1.0:
        problems.append(f"min_draft_confidence must be in [0, 1), got {request.min_draft_confidence}")
    return mode, policy


def _draft_problems(request: ClientRequest, backend: Backend, settings: GatewaySettings, mode: Mode | None,
                    forced: str) -> list[str]:
    """What is wrong with the proposer the request names (`forced`: a model-free one), or
    with asking for FIXED where nothing can propose."""
    problems = []
    if request.draft_model in backend.unusable:
        problems.append(f"{backend.unusable[request.draft_model][1]} Use one of {sorted(backend.drafts)}")
    elif request.draft_model and not forced and request.draft_model not in backend.drafts:
        available = sorted(backend.drafts) + list(settings.hosted_model_free)
        listed = f"available: {available or 'none (no draft service configured)'}"
        if request.draft_model in MODEL_FREE:
            problems.append(f"this gateway does not host the model-free proposer {request.draft_model!r} (its "
                            f"operator hosts suffix and prompt-lookup with --model-free, corpus with --corpus "
                            f"FILE); {listed}")
        else:
            problems.append(f"unknown draft model {clip(request.draft_model)}; {listed}")
    if mode is Mode.FIXED and not backend.drafts and not forced:
        problems.append("speculation mode FIXED needs a draft service or a model-free proposer, and this "
                        "gateway has neither; use AUTO or OFF")
    return problems
