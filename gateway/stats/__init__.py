"""What the gateway measures, and the models it fits from the measurements: acceptance by
position and its drift, and the costs of a step (draft per token, verify per γ) that turn
acceptance into predicted goodput. Pure bookkeeping and math: no grpc, no torch."""
