"""One speculative step and what it leaves behind: the engine that proposes, verifies and
commits, the step records every observer reads, the trace spans, and the output text."""
