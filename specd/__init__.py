"""specd: speculative decoding served as three gRPC services (draft, verifier, gateway).

This package is the shared core. Layering, enforced by tests/test_layering.py:

    core         specd (this package, but not specd.cli)
      ↑ imported by
    services     draft_service, verifier_service, gateway (none imports another)
      ↑ imported by
    application  specd.cli (the `specd` command and its tools; the only importer of services)

The core's modules:

    sampling      sampling transforms (temperature, top-k, top-p), the same for draft and target
    rejection     speculative sampling: accept or reject draft tokens, keeping the target's law
    costmodel     the speedup model (expected tokens per step, γ·c + v(γ)) and measured step costs
    acceptance    acceptance statistics by model pair, task type, segment and position
    paircosts     what each model pair's steps cost (the cost model's state) and how they were batched
    drift         whether a segment's recent acceptance dropped below its reference
    selection     which hosted draft serves a request that names none (measured goodput)
    tasks         task types: the prompt classifier and per-task priors for the γ policies
    runtime       model loading and the per-session runtime of the draft and verifier services
    hub           where a model comes from: a directory, or a hub id resolved into the local cache
    kvstore       the paged KV pool, one batched forward, and the trial at load of what it can serve
    batching      the scheduler that batches one model's steps across sessions
    jobs          one step of one session as the scheduler runs it: a proposal, a verification
    steps         the plain types gateway and workers exchange: ModelInfo, BatchStats, Proposal, Scores
    predraft      overlapped speculation, draft side: branches pre-drafted during verification
    identity      which model a worker holds: a digest of its weights
    wire          the worker protocol's conversions, both ways: steps, distributions, model facts
    workermetrics Prometheus exposition of a worker's load
    workerservice what the draft and verifier servicers share: the multiplexed step stream
    grpcserver    the gRPC server plumbing every service shares: health, reflection, TLS, graceful stop
    errors        the exception tree, and the gRPC status each exception leaves a server with
    interceptors  server interceptors: every failure leaves with a real status (the one place errors map)
    tls           TLS and mutual TLS credentials and channels
    telemetry     tracing set-up (OTEL_* variables) and the workers' step spans
    config        typed settings, one object per service, built in the entrypoint and passed in
    v1            generated protobuf code (proto/specd/v1; scripts/gen_proto.py)
"""
