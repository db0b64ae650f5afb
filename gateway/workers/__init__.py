"""The gateway's side of the draft and verifier workers: a link per request and worker, the
multiplexed streams, the pools of endpoints (routing, EndpointSlices, step budgets), and
the load caps shared with the other gateways through the verifiers."""
