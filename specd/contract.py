"""What the gateway and its clients agree on beyond the proto's messages: the names and
formats `specd doctor`, `specd bench` and `specd trace` read and write as the gateway does.

Kept in the core so a client tool needs none of the gateway's modules to speak them.
"""
from __future__ import annotations

# The user segment of diagnostic requests (`specd doctor`): served like any other, never
# counted in the gateway's statistics, so a diagnosis does not skew production
# statistics, costs or drift.
DIAGNOSTIC_SEGMENT = "specd-doctor"

# The model-free proposers, by the names a request's draft_model gives them, in the order
# a tie goes.
PROMPT_LOOKUP = "prompt-lookup"
SUFFIX = "suffix"
CORPUS = "corpus"  # hosted only with a corpus file (the gateway's --corpus)
MODEL_FREE = (PROMPT_LOOKUP, SUFFIX, CORPUS)

# The longest proposal a step may carry (γ), on the wire and so for every bound above it
# (`--max-draft-length`, a request's, a load cap): far above any useful γ, low enough that
# a bad message cannot keep a model thread busy for long.
MAX_DRAFT_LENGTH = 128

PLAIN = "none"  # the draft half of a model pair's label when a request decodes plainly


def model_pair_label(draft_model: str, target_model: str) -> str:
    """The label of a model pair: "draft->target" ("none->target" when decoding plainly)."""
    return f"{draft_model or PLAIN}->{target_model}"


def decodes_plainly(model_pair: str) -> bool:
    """Whether a model pair's label is plain decoding's (no draft)."""
    return model_pair.startswith(PLAIN + "->")


def baseline_document(rows: list[tuple[str, str, float, int]]) -> dict:
    """The JSON document of an acceptance baseline file (`specd doctor --write-baseline`,
    read by the gateway's --acceptance-baseline) from (model pair, task type, α, positions
    reached)."""
    return {"baselines": [{"model_pair": pair, "task_type": task, "alpha": round(alpha, 4),
                           "reached": reached} for pair, task, alpha, reached in rows]}
