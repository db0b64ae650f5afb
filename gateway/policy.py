"""Draft-length (γ) policies: how many tokens the draft proposes at each step."""
from __future__ import annotations

import enum


class Mode(enum.Enum):
    """Speculation mode of a request (mirrors specd.v1.SpeculationMode)."""

    AUTO = "auto"
    FIXED = "fixed"
    OFF = "off"


class FixedPolicy:
    """Propose the same γ every step (γ = 0: plain decoding by the target)."""

    def __init__(self, draft_length: int) -> None:
        self.draft_length = draft_length

    def next_draft_length(self) -> int:
        return self.draft_length

    def observe(self, record) -> None:
        """Fixed: what the target accepted does not change γ."""
