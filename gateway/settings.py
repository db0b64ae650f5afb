"""The gateway's settings, one object, built once in the entrypoint (`specd_cli`) and passed in."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.policy.gamma import POLICIES
from gateway.stats.drift import DriftSettings
from gateway.tasks import DEFAULT_PROFILES, TaskProfile
from specd.config import DEFAULT_DRAFT_PORT, DEFAULT_VERIFIER_PORT, ClientTLS, ServerSettings
from specd.contract import CORPUS, MAX_DRAFT_LENGTH, MODEL_FREE, PROMPT_LOOKUP, SUFFIX
from specd.flags import comma_list, name_pairs, optional_path, setting

DRAFT_SELECTIONS = ("task-map", "goodput")
# The draft selection of `specd gateway` and `specd serve` (--draft-selection). The
# settings object keeps "task-map" by default so code that embeds the gateway opts in.
CLI_DRAFT_SELECTION = "goodput"
# The model-free proposers `specd gateway` hosts unless --model-free says otherwise (the
# corpus proposer needs a file: --corpus hosts it).
CLI_MODEL_FREE = (PROMPT_LOOKUP, SUFFIX)
# vLLM's --tool-call-parser formats this gateway reads (gateway.edge.tools.FORMATS).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway's settings. Each field with a flag is declared once, here (`specd.flags`):
    `specd gateway` takes every flag, `specd serve` every one it does not set itself."""

    server: ServerSettings
    # How the gateway finds its workers: `specd serve` wires its own (serve=False).
    verifier_address: str = setting(f"127.0.0.1:{DEFAULT_VERIFIER_PORT}", flag="--verifier-address", serve=False,
                                    help="host:port of the verifier, or a comma list (sessions spread over them)")
    draft_address: str = setting(f"127.0.0.1:{DEFAULT_DRAFT_PORT}", flag="--draft-address", serve=False,
                                 help="host:port of the draft service, or a comma list; empty: no draft "
                                      "service, every request decodes plainly")
    verifier_service: str = setting("", flag="--verifier-service", serve=False,
                                    help="Kubernetes Service of the verifiers: watch its EndpointSlices instead")
    draft_service: str = setting("", flag="--draft-service", serve=False,
                                 help="Kubernetes Service of the drafts: watch its EndpointSlices instead")
    namespace: str = setting("", flag="--namespace", serve=False,
                             help="namespace of those Services (default: the pod's)")
    # TLS towards the workers (mutual with a client cert): the --worker-* flags of
    # `specd gateway` (`specd serve` makes its own). Without a server_name, pods found
    # through a Service are checked against that Service's name.
    worker_tls: ClientTLS = ClientTLS()
    # What a request gets when it does not say.
    default_draft_length: int = setting(4, flag="--draft-length", help="default γ")
    max_draft_length: int = setting(16, flag="--max-draft-length", help="largest γ a request may ask")
    default_max_new_tokens: int = setting(0, flag="--max-new-tokens",
                                          help="tokens a request that names no max_new_tokens (a chat with no "
                                               "max_tokens) may generate; 0: up to the end of the target's context, "
                                               "within --max-new-tokens-cap, as vLLM does")
    worker_timeout_s: float = setting(60.0, flag="--worker-timeout",
                                      help="seconds to wait at start-up for a ready verifier (and draft) to answer "
                                           "(0: without limit, as on Kubernetes, where workers load for minutes)")
    # Step budgets (gateway.workers.budgets): max(floor, factor × measured p99 step time) per forward.
    draft_step_floor_s: float = setting(0.5, flag="--draft-step-floor", metavar="SECONDS",
                                        help="shortest draft step budget; a draft step past its budget is skipped "
                                             "and the draft probed later")
    verifier_step_floor_s: float = setting(5.0, flag="--verifier-step-floor", metavar="SECONDS",
                                           help="shortest verifier step budget; past it the session moves to "
                                                "another verifier, or the request ends UNAVAILABLE")
    step_budget_factor: float = setting(4.0, flag="--step-budget-factor",
                                        help="a worker step may take this many times the service's measured p99 "
                                             "step time (per 128 tokens fed), and never less than its floor "
                                             "(docs/reliability.md)")
    max_session_reopens: int = 3  # failed re-opens in a row per worker before UNAVAILABLE
    worker_connect_timeout_s: float = 5.0  # a worker not yet connected must accept the stream within this
    max_concurrent_requests: int = setting(64, flag="--max-concurrent-requests",
                                           help="requests served at once; more get RESOURCE_EXHAUSTED (keep ≤ the "
                                                "workers' --max-sessions)")
    auto_policy: str = setting("cost", flag="--policy", choices=POLICIES, help="γ policy of SPECULATION_MODE_AUTO")
    overlap: bool = setting(False, flag="--overlap",
                            help="overlapped speculation by default: the draft pre-drafts the next step while the "
                                 "target verifies (requests may still set speculation.overlap)")
    share_load_caps_s: float = setting(10.0, flag="--share-load-caps", metavar="SECONDS",
                                       help="every this many seconds, send AUTO's learned load caps to the "
                                            "verifiers and start from what the other gateways learned (0: off; "
                                            "docs/loadcap.md)")
    default_min_confidence: float = 0.5  # for the confidence policy
    # task type → prior acceptance and γ bounds (gateway.tasks.DEFAULT_PROFILES by default)
    task_profiles: dict[str, TaskProfile] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    task_drafts: dict[str, str] = setting(factory=dict, flag="--task-draft", action="append", metavar="TASK=DRAFT",
                                          parse=name_pairs, cli_default=None,
                                          help="use this draft model for requests of this task type (repeatable)")
    metrics_host: str = setting("127.0.0.1", flag="--metrics-host", help="interface of the /metrics endpoint")
    metrics_port: int = setting(0, flag="--metrics-port",
                                help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")
    window_steps: int = 2000  # steps in the acceptance sliding window
    # The edge (docs/reliability.md): who may call, and how much one call may ask.
    api_keys_file: Path | None = setting(flag="--api-keys", parse=optional_path, metavar="FILE",
                                         help="require API keys: one 'SEGMENT KEY' or 'SEGMENT sha256:HEX' a line; "
                                              "the key decides the request's user segment")
    protect_reflection: bool = setting(False, flag="--protect-reflection",
                                       help="with --api-keys, server reflection needs a key too (health checks "
                                            "never do)")
    key_max_in_flight: int = setting(0, flag="--key-max-in-flight",
                                     help="requests in flight per tenant (segment of the key file); more get "
                                          "RESOURCE_EXHAUSTED (0: three quarters of --max-concurrent-requests when "
                                          "the file names several tenants, no limit for a lone one)")
    max_request_bytes: int = setting(1024 * 1024, flag="--max-request-bytes", help="largest request message accepted")
    max_prompt_bytes: int = setting(256 * 1024, flag="--max-prompt-bytes",
                                    help="largest prompt in UTF-8 bytes, checked before tokenizing")
    max_new_tokens_cap: int = setting(4096, flag="--max-new-tokens-cap",
                                      help="largest max_new_tokens a request may ask")
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # per stop string
    max_label_bytes: int = 64  # task_type, draft_model and policy names
    # Far above max_concurrent_requests: in a burst, admission answers RESOURCE_EXHAUSTED
    # before HTTP/2 would refuse a stream (REFUSED_STREAM, which clients see as UNAVAILABLE).
    max_streams_per_connection: int = setting(1024, flag="--max-streams-per-connection",
                                              help="concurrent requests one client connection may carry")
    min_client_ping_interval_s: float = 10.0  # client keepalive pings closer than this are strikes
    max_connection_age_s: float = setting(300.0, flag="--max-connection-age", metavar="SECONDS",
                                          help="a client connection is asked to reconnect (GOAWAY) after about "
                                               "this long, so that clients spread over gateways added since; calls "
                                               "in flight finish on it (0: never)")
    # The settings object keeps the task map, so code that embeds the gateway opts in to goodput.
    draft_selection: str = setting("task-map", flag="--draft-selection", choices=DRAFT_SELECTIONS,
                                   cli_default=CLI_DRAFT_SELECTION,
                                   help="draft of a request that names none: goodput (specd's selection: the best "
                                        "measured tokens/ms per task type and user segment, starting from "
                                        "--task-draft) or task-map (--task-draft, else the default draft)")
    drift: DriftSettings = DriftSettings()  # when a drop in acceptance raises a flag
    acceptance_baseline: Path | None = setting(flag="--acceptance-baseline", parse=optional_path, metavar="FILE",
                                               help="judge drift against this pinned acceptance per model pair and "
                                                    "task type (`specd doctor --write-baseline FILE` writes one) "
                                                    "instead of lifetime acceptance")
    # This object hosts none, so code that embeds the gateway opts in.
    model_free: tuple[str, ...] = setting((), flag="--model-free", metavar="LIST", parse=comma_list,
                                          cli_default=",".join(CLI_MODEL_FREE),
                                          help="model-free proposers the gateway hosts, comma-separated (suffix, "
                                               "prompt-lookup; empty: none): they draft from tokens already seen, "
                                               "beside the draft model (--corpus hosts the corpus proposer too)")
    suffix_cache_tokens: int = setting(262_144, flag="--suffix-cache-tokens", metavar="N",
                                       help="tokens of previous responses the suffix proposer keeps, over every "
                                            "tenant; the oldest leave first")
    corpus: Path | None = setting(flag="--corpus", parse=optional_path, metavar="FILE",
                                  help="host the corpus proposer: draft from an n-gram table of the target's own "
                                       "answers in FILE (`specd corpus` writes one), beside --model-free's")
    prompt_lookup_min: int = setting(2, flag="--prompt-lookup-min", metavar="N",
                                     help="shortest n-gram prompt lookup matches (vLLM's ngram: min n)")
    prompt_lookup_max: int = setting(5, flag="--prompt-lookup-max", metavar="N",
                                     help="longest n-gram prompt lookup matches")
    http_port: int | None = setting(flag="--http-port", type=int, metavar="N",
                                    help="also serve OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, "
                                         "/v1/models, /health) on this port of the gateway's host (0: a free one; "
                                         "default: off)")
    chat_template: Path | None = setting(flag="--chat-template", parse=optional_path, metavar="FILE",
                                         help="Jinja template for /v1/chat/completions (default: the tokenizer's)")
    tool_call_parser: str = setting("hermes", flag="--tool-call-parser", choices=TOOL_CALL_PARSERS,
                                    help="the format of tool calls on /v1/chat/completions: what tool_choice 'auto' "
                                         "reads in the model's text and 'required' generates (docs/http.md)")
    # The HTTP edge's connection limits (docs/http.md, "Limits"), as nginx and Envoy set them.
    http_header_timeout_s: float = setting(10.0, flag="--http-header-timeout", metavar="SECONDS",
                                           help="an HTTP connection must send a request's whole headers within "
                                                "this many seconds of opening (or of its last response), else it "
                                                "is closed")
    http_max_connections: int = setting(0, flag="--http-max-connections", metavar="N",
                                        help="open HTTP connections at most; past it a new one displaces the oldest "
                                             "waiting for a request, or is closed (0: 1024, or a quarter of the "
                                             "process's open-file limit when less)")
    grammar_threads: int = setting(2, flag="--grammar-threads", metavar="N",
                                   help="threads that compile structured output's grammars and compute their masks "
                                        "(never the event loop)")
    grammar_step_budget_ms: float = setting(100.0, flag="--grammar-step-budget-ms", metavar="MS",
                                            help="a structured request whose grammar takes longer to follow one step "
                                                 "ends with INVALID_ARGUMENT (an ambiguous grammar costs more at every "
                                                 "token)")
    grammar_compile_budget_s: float = setting(10.0, flag="--grammar-compile-budget-s", metavar="S",
                                              help="a grammar that takes longer to compile is refused, and stays "
                                                   "refused while this gateway remembers it")
    max_chat_messages: int = setting(2048, flag="--max-chat-messages", metavar="N",
                                     help="messages one chat request may hold; more get 400 before rendering")

    @property
    def hosted_model_free(self) -> tuple[str, ...]:
        """The model-free proposers this gateway hosts: --model-free's, and the corpus
        proposer wherever --corpus gives it a file."""
        if self.corpus is None or CORPUS in self.model_free:
            return self.model_free
        return (*self.model_free, CORPUS)

    def problems(self) -> list[str]:
        """What is wrong with these settings, in words a person can act on; checked before any
        worker is contacted."""
        found = self.drift.problems()
        if self.draft_selection not in DRAFT_SELECTIONS:
            found.append(f"draft selection must be one of {list(DRAFT_SELECTIONS)}, got {self.draft_selection!r}")
        unknown = [name for name in self.model_free if name not in MODEL_FREE]
        if unknown:
            found.append(f"unknown model-free proposers {unknown}; choose from {list(MODEL_FREE)}")
        if CORPUS in self.model_free and self.corpus is None:
            found.append("the corpus proposer needs a corpus file: give --corpus FILE (`specd corpus` writes one)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            found.append(f"prompt lookup needs 1 ≤ min n ≤ max n, got {self.prompt_lookup_min} and "
                         f"{self.prompt_lookup_max}")
        if self.suffix_cache_tokens < 0:
            found.append(f"the suffix cache cannot hold {self.suffix_cache_tokens} tokens; give 0 or more")
        if not 1 <= self.max_draft_length <= MAX_DRAFT_LENGTH:  # the workers refuse a longer step
            found.append(f"--max-draft-length must be in [1, {MAX_DRAFT_LENGTH}], got {self.max_draft_length}")
        elif not 0 <= self.default_draft_length <= self.max_draft_length:
            found.append(f"--draft-length must be in [0, {self.max_draft_length}] (--max-draft-length), got "
                         f"{self.default_draft_length}")
        if self.http_header_timeout_s <= 0 or self.http_max_connections < 0 or self.max_chat_messages < 1:
            found.append("--http-header-timeout must be above 0, --http-max-connections 0 or more and "
                         "--max-chat-messages 1 or more")
        return found
