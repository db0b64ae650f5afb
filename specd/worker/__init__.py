"""The worker runtime: what the draft and verifier services run, and the gateway never loads.

One model's weights, its paged KV pool, the scheduler that batches its steps across
sessions, and the multiplexed step stream both servicers serve. `draft_service` and
`verifier_service` are thin servicers over it; the gateway imports none of it
(tests/test_layering.py), since it runs no model.

    runtime   model loading and the per-session runtime: `ModelRunner.propose` and `verify`
    kvstore   the paged KV pool, one batched forward, and the trial at load of what it can serve
    memory    how much of a CUDA device a KV pool takes (--gpu-memory-fraction), and device checks
    lean      the batched forward of Llama-architecture models (fourteen families) without transformers' per-call Python
    packing   on a CPU, large linear layers with their weights packed for oneDNN at load
    rope      rotary scalings that rotate by the forward (longrope, dynamic): which rows share a forward
    batching  the scheduler that batches one model's steps across sessions
    jobs      one step of one session as the scheduler runs it: a proposal, a verification
    predraft  overlapped speculation, draft side: branches pre-drafted during verification
    grammar   structured output, draft side: each session's grammar cursor, so the draft proposes under it
    runahead  plain steps scored before the gateway asks for them (verifier side)
    service   what the draft and verifier servicers share: the multiplexed step stream
    metrics   Prometheus exposition of a worker's load
    settings  how a worker runs and batches its model(s): one settings object per worker service
    identity  which model a worker holds: a digest of its weights
    hub       where a model comes from: a directory, or a hub id resolved into the local cache
"""
