"""specd: speculative decoding served as three gRPC services (draft, verifier, gateway).

This package is the shared core: what both sides of the step protocol use. Layering,
enforced by tests/test_layering.py:

    core         specd (this package, but not specd.worker)
      ↑ imported by
    worker       specd.worker: the model runtime of the two worker services (its own map)
      ↑ imported by
    services     draft_service, verifier_service (core + worker); gateway (core only): none
                 imports another
      ↑ imported by
    application  specd_cli (the `specd` command and its tools; the only importer of services)

The core's modules:

    sampling      sampling transforms (temperature, top-k, top-p), the same for draft and target
    rejection     speculative sampling: accept or reject draft tokens, keeping the target's law
    steps         the plain types gateway and workers exchange: ModelInfo, BatchStats, Proposal, Scores
    wire          the worker protocol's conversions, both ways: steps, distributions, model facts
    contract      what the gateway and its clients agree on beyond the proto: the doctor's segment,
                  model pair labels, model-free proposer names, the acceptance baseline file
    grpcserver    the gRPC server plumbing every service shares: health, reflection, TLS, graceful stop
    errors        the exception tree, and the gRPC status each exception leaves a server with
    interceptors  server interceptors: every failure leaves with a real status (the one place errors map)
    tls           TLS and mutual TLS credentials and channels
    telemetry     tracing set-up (OTEL_* variables) and the workers' step spans
    devices       small host values onto a model's device, without a wait on a GPU
    config        the settings every service shares: where it listens, TLS, default ports, demo models
    flags         settings declared once: a settings field's flag, help and default (`setting`)
    grammars      compiled grammars cached by text, and llguidance's limits: the gateway's and the draft's
    prefixkeys    the prefix-cache key chain of a sequence's blocks: the workers' KV store and the router's
    worker        the workers' model runtime (specd/worker/__init__.py maps it)
    v1            generated protobuf code (proto/specd/v1; scripts/gen_proto.py)

The gateway's own statistics (acceptance, step costs, drift, draft selection, task
types) live in `gateway/`, beside the code that keeps them.
"""
