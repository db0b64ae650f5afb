"""One public request once validated: what the gateway's servicer hands to the engine and
the γ policy (`gateway.server.parse_request` builds it, `gateway.policy.build_policy`
reads it). A module of its own so that the policy module need not import the servicer.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.engine import GenerationRequest
from gateway.policy import Mode
from specd.tasks import TaskProfile


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its generation, its speculation settings, its labels."""

    generation: GenerationRequest
    mode: Mode
    policy: str  # one of gateway.policy.POLICIES
    draft_length: int  # γ for "fixed", the starting γ for "ema"
    profile: TaskProfile  # prior acceptance and γ bounds (request bounds applied)
    task_type: str
    user_segment: str
    stop: list[str]
    selected: bool = False  # the draft was chosen by goodput selection (the request named none)
    # The model-free proposers the request's steps may use (gateway.proposers): all the
    # gateway hosts under AUTO, the one named in draft_model, none under OFF or FIXED.
    model_free: tuple[str, ...] = ()
    forced: str = ""  # the model-free proposer the request named (it alone proposes)
    # The longest model-free proposal: FIXED's γ; under AUTO the request's max_draft_length,
    # else the gateway's (not the task's, which prices a model draft's tokens: a confident
    # match costs nothing to draft, only to verify, and the hybrid cuts it where that pays).
    model_free_max: int = 0
