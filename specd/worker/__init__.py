"""The worker runtime: what the draft and verifier services run, and the gateway never loads.

One model's weights, its paged KV pool, its sessions, the scheduler that batches its steps
across sessions, and the multiplexed step stream both servicers serve. What a step does
is its role's, in the service's own package: `draft_service.drafter` proposes,
`verifier_service.scorer` scores, each over a `ModelRunner` of its own. The gateway
imports none of it (tests/test_layering.py), since it runs no model.

    runtime   a model, its sessions and their steps: `ModelRunner.sync` and `step`, the hook its role sets
    kvstore   the paged KV pool: blocks, the sessions' block tables, prefix caching
    layout    how one batched forward's rows lie over the pool: `BatchRow`, the batch's cache, `prepare`
    attention paged attention: every session's blocks read in one SDPA call
    pagedkernel  the same read through the block tables in one Triton kernel, on CUDA (--attention-kernel triton)
    forwards  one batched forward: the model's own, or the one standing in for it (lean)
    graphs    decode and verify forwards of fixed shapes, replayed as CUDA graphs (--cuda-graphs)
    trials    what the pool can serve, found by trying a model when it loads
    memory    how much of a CUDA device a KV pool takes (--gpu-memory-fraction), and device checks
    lean      the batched forward of Llama-architecture models (fourteen families) without transformers' per-call Python
    packing   on a CPU, large linear layers with their weights packed for oneDNN at load (a draft's in float16)
    rope      rotary scalings that rotate by the forward (longrope, dynamic): which rows share a forward
    batching  the scheduler that batches one model's steps across sessions, and the `Job` each step is
    service   what the draft and verifier servicers share: the multiplexed step stream
    metrics   Prometheus exposition of a worker's load
    settings  how a worker runs and batches its model(s): one settings object per worker service
    identity  which model a worker holds: a digest of its weights
    hub       where a model comes from: a directory, or a hub id resolved into the local cache
    sharing   a draft made from its target alone: the embedding it shares, read at load; its part of the vocabulary
    featuredraft  a draft that reads the target's features (EAGLE's design), unrolled for training; not served yet
"""
