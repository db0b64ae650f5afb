"""The gateway: owns each request (committed tokens, RNG, rejection sampling, γ policy,
acceptance statistics) and serves the public `specd.v1.Gateway` API. Never loads a model."""
