"""`specd generate`: send a prompt to a gateway; print the text as it streams, then the
acceptance figures."""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from specd.tls import client_tls_from_args


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from specd.tls import client_channel
    from specd.v1 import gateway_pb2, gateway_pb2_grpc

    mode = {"auto": gateway_pb2.SPECULATION_MODE_AUTO, "fixed": gateway_pb2.SPECULATION_MODE_FIXED,
            "off": gateway_pb2.SPECULATION_MODE_OFF}[args.mode]
    sampling = gateway_pb2.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens or None, stop=args.stop or [], presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        logprobs=args.logprobs)
    if args.json_schema:
        sampling.structured.json_schema = Path(args.json_schema).read_text()
    elif args.regex:
        sampling.structured.regex = args.regex
    elif args.choice:
        sampling.structured.choice.choices.extend(args.choice)
    request = gateway_pb2.GenerateRequest(
        prompt=args.prompt, sampling=sampling,
        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_length=args.draft_length,
                                                  draft_model=args.draft_model, policy=args.policy),
        task_type=args.task_type, user_segment=args.user_segment)
    from specd_cli.clientauth import with_api_key

    with client_channel(args.gateway, client_tls_from_args(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        if args.wait:
            try:
                grpc.channel_ready_future(channel).result(timeout=args.wait)
            except grpc.FutureTimeoutError:
                print(f"specd generate: no gateway at {args.gateway} after {args.wait} s", file=sys.stderr)
                return 1
        try:
            stats = None
            logprobs = []
            sys.stdout.write(args.prompt)
            for chunk in stub.GenerateStream(request, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                logprobs += [entry.logprob for entry in chunk.logprobs]
                if chunk.HasField("stats"):
                    stats, finish = chunk.stats, gateway_pb2.FinishReason.Name(chunk.finish_reason)
        except grpc.RpcError as exc:
            print(f"\nspecd generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    assert stats is not None  # the gateway's last chunk carries them
    tokens_per_s = stats.generated_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    print(f"\n\n--- {stats.generated_tokens} tokens in {stats.total_ms:.0f} ms ({tokens_per_s:.1f} tokens/s), "
          f"{finish.removeprefix('FINISH_REASON_').lower()}\n"
          f"acceptance rate {stats.acceptance_rate:.2f} ({stats.accepted_tokens}/{stats.proposed_tokens} "
          f"draft tokens accepted), {stats.mean_tokens_per_step:.2f} tokens per step over {stats.steps} steps, "
          f"draft {stats.draft_model or 'none'}, policy {stats.policy}, task {stats.task_type}, "
          f"γ per step {list(stats.draft_lengths)}, seed {stats.seed}", file=sys.stderr)
    if logprobs:
        print("logprobs " + " ".join(f"{value:.3f}" for value in logprobs), file=sys.stderr)
    drafted = collections.Counter(p for p in stats.proposers if p)
    if set(drafted) - {stats.draft_model}:  # model-free proposers drafted some steps: say which
        print("steps drafted by " + ", ".join(f"{name} ×{n}" for name, n in drafted.most_common()), file=sys.stderr)
    return 0
