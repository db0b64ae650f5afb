"""Task types: a rule-based prompt classifier and per-task priors for the γ policies.

Acceptance depends on the task: constrained outputs such as translation or
summarization are easy to predict; code and agentic planning less so.
The classifier is deliberately simple and measured (tests/test_tasks.py); a request's
explicit `task_type` always wins over it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

CODE, QA, SUMMARIZATION, TRANSLATION, AGENTIC, GENERAL = (
    "code", "qa", "summarization", "translation", "agentic", "general")
TASK_TYPES = (CODE, QA, SUMMARIZATION, TRANSLATION, AGENTIC, GENERAL)


@dataclass(frozen=True)
class TaskProfile:
    """What the γ policies assume about a task before measuring: prior α and γ bounds."""

    prior_alpha: float
    min_draft_length: int
    max_draft_length: int


# Typical acceptance and useful γ per task type as one production deployment reported
# them: priors only; the policies replace them with measured acceptance within a few steps.
DEFAULT_PROFILES = {
    QA: TaskProfile(0.92, 4, 16),
    SUMMARIZATION: TaskProfile(0.88, 4, 14),
    TRANSLATION: TaskProfile(0.85, 4, 12),
    CODE: TaskProfile(0.75, 2, 8),
    AGENTIC: TaskProfile(0.50, 1, 5),
    GENERAL: TaskProfile(0.70, 1, 8),
}

_RULES: list[tuple[str, re.Pattern[str]]] = [
    (TRANSLATION, re.compile(r"\btranslat(e|ion)\b|\binto (french|german|spanish|english|italian|"
                             r"japanese|chinese)\b|\bin (french|german|spanish)\b", re.I)),
    (SUMMARIZATION, re.compile(r"\bsummari[sz]e|\bsummary\b|\btl;?dr\b|\bin (a few|one|two) "
                               r"(sentences?|words)\b|\bkey points\b", re.I)),
    (AGENTIC, re.compile(r"\b(plan|steps? to|tools?|agent|subtasks?|action:|thought:|next action|"
                         r"break (it|this) down)\b", re.I)),
    (CODE, re.compile(r"^\s*(def |class |import |from \S+ import|#include|function |@|for .* in .*:)|"
                      r"[{};]\s*$|\bdef \w+\(|\breturn\b|\b\w+\(.*\)\s*:|```|\bself\.", re.I | re.M)),
    (QA, re.compile(r"\?\s*$|^\s*(what|why|how|when|where|who|which|is|are|does|do|can)\b", re.I | re.M)),
]


# The rules look at a prompt's head and tail only: the instruction is at one end or the
# other ("Summarize the text below:" / a long document, then "Summarize the above."), and
# some rules backtrack quadratically (a 256 KiB run of letters took minutes, on the
# gateway's event loop; 2 KiB takes milliseconds).
CLASSIFIED_CHARS = 1024


def classify(prompt: str) -> str:
    """The task type of a prompt by the first matching rule; "general" when none does."""
    if len(prompt) > 2 * CLASSIFIED_CHARS:
        prompt = f"{prompt[:CLASSIFIED_CHARS]}\n{prompt[-CLASSIFIED_CHARS:]}"
    for task, pattern in _RULES:
        if pattern.search(prompt):
            return task
    return GENERAL
