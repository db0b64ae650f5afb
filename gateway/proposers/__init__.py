"""Who proposes a step's draft tokens: the draft model through the draft service, or a
model-free proposer in the gateway (prompt lookup, suffix matching, the corpus of the
target's own answers), and the per-step
choice between them. Every proposer answers one protocol (`gateway.proposers.base`)."""
