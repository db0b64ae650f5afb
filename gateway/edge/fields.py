"""An OpenAI request body read into the gateway's fields: what each endpoint accepts (any
other field is refused by name, never ignored), each field's type and bounds checked with
a message that names it, and OpenAI's and vLLM's shapes turned into the gateway's
(`structured_outputs` into a `StructureSpec`, `logit_bias` into token ids, prompts given
as text or as token ids). Pure: it reads a parsed JSON object and raises `HttpError`."""
from __future__ import annotations

import json
import math
from typing import Any

from gateway.edge.bodies import HttpError
from gateway.grammar import StructureSpec
from gateway.request import Mode

# What each endpoint accepts. Anything else is refused by name (never ignored).
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k",
             "speculation", "n", "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
             "min_p", "min_tokens", "stop_token_ids", "ignore_eos", "response_format", "structured_outputs",
             "cache_salt", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens"}
COMPLETIONS_FIELDS = _SAMPLING | {"prompt", "echo", "logprobs", "best_of"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "chat_template_kwargs"}
_SPECULATION = {"mode", "draft_length", "min_draft_length", "max_draft_length", "draft_model", "policy",
                "min_draft_confidence", "overlap"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


def read_typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise HttpError(400, f"'{name}' must be {what}, got {json.dumps(value)[:60]}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = float(read_typed(body, name, (int, float), default, "a number"))
    if not math.isfinite(value):
        raise HttpError(400, f"'{name}' must be finite", param=name)
    return value


def _optional_number(body: dict[str, Any], name: str) -> float | None:
    """A number the body may leave out (None: the gateway's default)."""
    return None if body.get(name) is None else _number(body, name, 0.0)


def read_integer(body: dict[str, Any], name: str, default: int | None, low: int = 0) -> int | None:
    value = read_typed(body, name, (int,), default, "an integer")
    if value is not None and value < low:
        raise HttpError(400, f"'{name}' must be at least {low}, got {value}", param=name)
    return value


def refuse_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse every field specd does not know, and every known one asked for a feature it lacks."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HttpError(400, f"unsupported parameters {unknown}: specd does not implement them (it never ignores "
                             f"a parameter); remove them", param=unknown[0])
    lacking = []
    if body.get("best_of") not in (None, 1):
        lacking.append("best_of > 1")
    if body.get("echo") not in (None, False):
        lacking.append("echo")
    if lacking:
        raise HttpError(400, f"specd does not support {', '.join(lacking)}; leave them unset")


def read_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to report beside each token's log-probability (None: none asked).
    Chat: `logprobs: true` with `top_logprobs` (OpenAI's); completions: `logprobs: N`."""
    if not chat:
        return read_integer(body, "logprobs", None)
    wanted = read_typed(body, "logprobs", (bool,), False, "true or false")
    top = read_integer(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


# vLLM's structured_outputs kinds → gateway.grammar's.
_STRUCTURES = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}


def _structure(body: dict[str, Any]) -> StructureSpec | None:
    """OpenAI's response_format, or vLLM's structured_outputs (one of them, one kind)."""
    response_format, extension = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and extension is not None:
        raise HttpError(400, "give 'response_format' or 'structured_outputs', not both", param="response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructureSpec("json_object", "")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise HttpError(400, "'response_format' json_schema needs {json_schema: {name, schema: {...}}}",
                                param="response_format")
            return StructureSpec("json", json.dumps(schema))
        raise HttpError(400, "'response_format' is {type: text | json_object | json_schema}",
                        param="response_format")
    if extension is None:
        return None
    given = {k: v for k, v in extension.items() if v is not None} if isinstance(extension, dict) else {}
    if len(given) != 1 or next(iter(given)) not in _STRUCTURES:
        raise HttpError(400, f"'structured_outputs' takes exactly one of {sorted(_STRUCTURES)}",
                        param="structured_outputs")
    (kind, value), = given.items()
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise HttpError(400, "'structured_outputs.json' is a JSON Schema (an object or its text)",
                            param="structured_outputs")
        return StructureSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise HttpError(400, "'structured_outputs.json_object' is true", param="structured_outputs")
        return StructureSpec("json_object", "")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise HttpError(400, "'structured_outputs.choice' is a list of strings", param="structured_outputs")
        return StructureSpec("choice", json.dumps(value))
    if not isinstance(value, str):
        raise HttpError(400, f"'structured_outputs.{kind}' is a string", param="structured_outputs")
    return StructureSpec(_STRUCTURES[kind], value)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise HttpError(400, "'stop' must be a string or a list of strings", param="stop")


def _speculation(body: dict[str, Any]) -> dict[str, Any]:
    """The `speculation` extension as ClientRequest fields."""
    spec = body.get("speculation")
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise HttpError(400, "'speculation' must be an object with the gRPC API's fields "
                             f"{sorted(_SPECULATION)}", param="speculation")
    unknown = sorted(set(spec) - _SPECULATION)
    if unknown:
        raise HttpError(400, f"unknown speculation fields {unknown}; known: {sorted(_SPECULATION)}",
                        param="speculation")
    mode = read_typed(spec, "mode", (str,), Mode.AUTO.value, "a string").lower()
    # JSON tells a field left out from a 0, as proto3 cannot: left out is the gateway's
    # default; draft_length 0 under FIXED decodes plainly, and a bound of 0 would bound
    # nothing a person means, so the bounds start at 1.
    return {"mode": mode, "draft_length": read_integer(spec, "draft_length", None),
            "min_draft_length": read_integer(spec, "min_draft_length", None, low=1),
            "max_draft_length": read_integer(spec, "max_draft_length", None, low=1),
            "draft_model": read_typed(spec, "draft_model", (str,), "", "a string"),
            "policy": read_typed(spec, "policy", (str,), "", "a string"),
            "min_draft_confidence": _optional_number(spec, "min_draft_confidence"),
            "overlap": read_typed(spec, "overlap", (bool,), None, "true or false")}


def read_sampling(body: dict[str, Any], max_tokens: int | None, model: dict[str, float]) -> dict[str, Any]:
    """The sampling fields shared by both endpoints. One left unset takes the model's own
    default (`model`: its generation_config.json's, as vLLM's --generation-config auto),
    else OpenAI's (temperature 1)."""
    seed = read_integer(body, "seed", None)  # 0 is a seed, as in OpenAI's API; unset: the gateway picks one
    if seed is not None and seed >= 2 ** 63:
        raise HttpError(400, "'seed' must be below 2**63", param="seed")
    top_p = _number(body, "top_p", model.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:  # checked here: the core reads 0 as "unset", as proto3 does
        raise HttpError(400, f"'top_p' must be in (0, 1] (1 = disabled), got {top_p:g}", param="top_p")
    repetition = _number(body, "repetition_penalty", model.get("repetition_penalty", 1.0))
    if repetition <= 0:  # checked here: the core reads 0 as "unset", as proto3 does
        raise HttpError(400, f"'repetition_penalty' must be in (0, 100] (1 = off), got {repetition:g}",
                        param="repetition_penalty")
    return {"temperature": _number(body, "temperature", model.get("temperature", 1.0)), "top_p": top_p,
            "top_k": read_integer(body, "top_k", int(model.get("top_k", 0))),
            "seed": seed, "max_new_tokens": max_tokens, "stop": _stop(body),
            "presence_penalty": _number(body, "presence_penalty", 0.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0), "repetition_penalty": repetition,
            "logit_bias": _logit_bias(body), "min_p": _number(body, "min_p", model.get("min_p", 0.0)),
            "min_tokens": read_integer(body, "min_tokens", 0), "stop_token_ids": _token_ids(body, "stop_token_ids"),
            "ignore_eos": read_typed(body, "ignore_eos", (bool,), False, "true or false"),
            "structure": _structure(body), "cache_salt": read_typed(body, "cache_salt", (str,), "", "a string"),
            "include_stop": read_typed(body, "include_stop_str_in_output", (bool,), False, "true or false"),
            "truncate_prompt_tokens": read_integer(body, "truncate_prompt_tokens", None, low=1),
            "skip_special_tokens": read_typed(body, "skip_special_tokens", (bool,), True, "true or false"),
            **_speculation(body)}


# The arguments of apply_chat_template that the gateway sets itself.
_TEMPLATE_OWN = {"conversation", "chat_template", "tokenize", "add_generation_prompt", "tools", "return_dict",
                 "return_tensors", "continue_final_message", "documents"}


def read_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: variables for the chat template (`enable_thinking`, say),
    never the arguments the gateway sets."""
    extra = read_typed(body, "chat_template_kwargs", (dict,), {}, "an object of template variables")
    taken = sorted(set(extra) & _TEMPLATE_OWN)
    if taken:
        raise HttpError(400, f"'chat_template_kwargs' may not set {taken}: the gateway sets them",
                        param="chat_template_kwargs")
    return extra


# The most prompts one completions request may list (OpenAI's batch of prompts; each of
# their choices weighs on the tenant's share).
MAX_PROMPTS = 32


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def read_prompts(prompt: Any) -> list[dict[str, Any]]:
    """A completions request's prompts, as OpenAI takes them: a string, a list of token ids,
    or a list of either (one completion each)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if _is_ids(prompt):
        return [{"prompt_ids": prompt}]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_ids(p) for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise HttpError(400, f"'prompt' lists {len(prompt)} prompts; at most {MAX_PROMPTS} in one request",
                            param="prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_ids": p} for p in prompt]
    raise HttpError(400, "'prompt' must be a string, a list of token ids, or a list of either", param="prompt")


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HttpError(400, f"'{name}' must be a list of token ids", param=name)
    return ids


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) → a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise HttpError(400, "'logit_bias' must be an object of token id → bias", param="logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise HttpError(400, f"'logit_bias' keys are token ids (digits), got {json.dumps(key)[:40]}",
                            param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HttpError(400, f"'logit_bias' values are numbers in [-100, 100], got {json.dumps(value)[:40]}",
                            param="logit_bias")
        parsed[int(key)] = float(value)
    return parsed


