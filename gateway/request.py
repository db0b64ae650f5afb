"""The gateway's request types, one per stage (docs/design.md §11):

- `ClientRequest`: a request as its client sent it, out of any transport's wire format
  (the gRPC `GenerateRequest`, an HTTP body); not yet validated;
- `ParsedRequest`: the request validated (`gateway.validation.parse_request`): its
  speculation settings and labels, which the core and the γ policy read;
- `Generation`: inside it, what the engine generates (`gateway.step.engine.speculate`): the
  prompt in token ids and how to sample, stop and speculate.

Plain records: importing this loads neither grpc nor torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.tasks import TaskProfile

if TYPE_CHECKING:
    from gateway.grammar import StructureSpec
    from specd.sampling import Transform


class Mode(enum.Enum):
    """Speculation mode of a request (mirrors specd.v1.SpeculationMode)."""

    AUTO = "auto"
    FIXED = "fixed"
    OFF = "off"


@dataclass(frozen=True)
class ClientRequest:
    """A request as its client sent it, whatever the transport: the fields of the public
    API's GenerateRequest, with None for "not given"."""

    prompt: str = ""
    prompt_ids: list[int] | None = None  # token ids instead of text (no tokenizing)
    add_special_tokens: bool = True  # how `prompt` is tokenized (False: already templated)
    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens are read (None: all)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None  # None: the gateway picks one (reported in the statistics); 0 is a seed
    max_new_tokens: int | None = None  # None: the gateway's default
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False  # the text keeps the stop string that ended it (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool = True  # special tokens left out of the text, as the tokenizer's decode
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0: unset (1.0, off), as proto3 reads it
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; else how many alternatives beside each token's own
    structure: StructureSpec | None = None  # what the output must match
    cache_salt: str = ""  # vLLM's: prefix cache hits only among requests with the same salt
    mode: str = Mode.AUTO.value  # a `Mode` value
    draft_length: int | None = None  # None: the gateway's --draft-length (γ of FIXED, EMA's first)
    min_draft_length: int | None = None  # None: the task's bound
    max_draft_length: int | None = None  # None: the task's bound (a model-free proposal's: --max-draft-length)
    draft_model: str = ""
    policy: str = ""
    min_draft_confidence: float | None = None  # None: the gateway's --min-draft-confidence
    overlap: bool | None = None  # None: the gateway's --overlap
    task_type: str = ""
    user_segment: str = ""  # the caller's principal when the gateway has API keys


@dataclass(frozen=True)
class Stopping:
    """When a generation ends, apart from how its tokens are sampled (TGI's StoppingCriteria
    beside its NextTokenChooser): the engine ends it on a count or a token, the text on a
    stop string (`gateway.step.text.TextAssembler`)."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # these end the request too (finish STOP)
    ignore_eos: bool = False  # EOS does not end the request
    stop: tuple[str, ...] = ()  # stop strings: the text ends at the first one it holds
    include_stop: bool = False  # the text keeps the stop string that ended it (vLLM's include_stop_str_in_output)


@dataclass(frozen=True)
class Generation:
    """What the engine generates for a validated request, in token ids: the prompt, how each
    token is sampled (`transform`, `seed`), when generation stops (`stopping`), and how the
    draft speculates."""

    prompt_ids: list[int]
    transform: Transform
    seed: int
    stopping: Stopping
    draft_model: str  # empty: no draft (plain decoding)
    overlap: bool = False  # pre-draft the next step while the target verifies (draft_service.predraft)
    # > 0: the draft stops proposing inside a step once its top probability falls below
    # this (the confidence policy's setting, carried out by the draft).
    min_confidence: float = 0.0
    logprobs: int | None = None  # report the target's raw log-probabilities, with this many alternatives
    grammar: str = ""  # the grammar text the output must match (`gateway.grammar`); empty: none


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its generation, its speculation settings, its labels."""

    generation: Generation
    mode: Mode
    policy: str  # one of gateway.policy.gamma.POLICIES
    # The γ bounds, all set in `gateway.validation._draft_lengths`:
    draft_length: int  # γ for "fixed", the starting γ for "ema"
    profile: TaskProfile  # prior acceptance and γ bounds (request bounds applied)
    task_type: str
    user_segment: str
    selected: bool = False  # the draft was chosen by goodput selection (the request named none)
    # The model-free proposers the request's steps may use (gateway.proposers.modelfree): all the
    # gateway hosts under AUTO, the one named in draft_model, none under OFF or FIXED.
    model_free: tuple[str, ...] = ()
    forced: str = ""  # the model-free proposer the request named (it alone proposes)
    model_free_max: int = 0  # the longest model-free proposal (`gateway.validation._draft_lengths`: why)
    cache_salt: bytes = b""  # the salt of its prefix cache keys on the workers (`gateway.validation.cache_salt`)
    skip_special_tokens: bool = True  # ClientRequest's: how the text is made (`gateway.step.text.TextAssembler`)
