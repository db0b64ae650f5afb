"""What clients reach: the gRPC servicer, the OpenAI-compatible HTTP app and its connection
limits, API keys and tenant quotas, the health that follows the verifiers, and metrics."""
