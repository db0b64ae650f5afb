"""The application layer: the `specd` command line and the tools behind its commands.

    parser     the parser of every subcommand, and `main`
    launch     `specd draft|verifier|gateway`: one service in this process
    serve      `specd serve`: the three services as local processes (the demo)
    supervisor `specd serve`'s process supervisor (restart a worker that dies)
    generate   `specd generate`: a prompt to a gateway, the text and acceptance figures back
    bench      `specd bench`: every γ policy and target-only, side by side
    loadbench  `specd bench --concurrency`: throughput and latency under load
    doctor     `specd doctor`: the acceptance checklist against a live gateway
    distill    `specd distill`: train a draft to agree with its target
    corpus     `specd corpus`: the target's own answers, for the gateway's corpus proposer
    training   the time-budgeted training loop of `specd distill` and scripts/make_demo_pair.py
    trace      `specd trace collect|show`: spans without a tracing backend
    certs      `specd certs`: a development CA and certificates
    clientauth the client side of API keys (--api-key-env)

This package is the only one that may import the services (`draft_service`,
`verifier_service`, `gateway`); nothing in the core `specd` package or in a service
imports it (tests/test_layering.py). `python -m specd_cli` is the `specd` command.
"""
from specd_cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
