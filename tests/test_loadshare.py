"""Load caps shared between gateways through the verifier: a new gateway replica starts where
the older ones' trials got to (gateway/workers/loadshare.py, verifier_service/loadcaps.py), so it
does not learn again by losing."""
from __future__ import annotations

import grpc
import pytest

from conftest import start_stack
from gateway.app import create_server as create_gateway
from gateway.policy.loadcap import LoadCap, SharedLevel
from gateway.policy.priors import best_caps
from gateway.settings import GatewaySettings
from gateway.workers.loadshare import from_tables, share_once, to_table
from specd.config import ServerSettings
from specd.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from test_policy import run_under_load
from verifier_service.loadcaps import LoadCapBoard

SESSIONS = 16
# A prior that mildly favours γ=3 at every load: the costs predicted speculation would pay...
PRIOR = {load: [1.0, 1.03, 1.05, 1.06, 1.05, 1.03, 1.0, 0.97, 0.95] for load in (1, 2, 4, 8, 16, 32)}


def compute_bound(cap: int) -> float:
    """...where every position verified costs the whole batch: plain decoding serves more."""
    return 5.0 + SESSIONS * (cap + 1) * 1.5


def learned_gateway(steps: int = 12000) -> LoadCap:
    """A gateway's load cap that ran long enough under load for its trials to move the prior's."""
    cap = LoadCap(8, price=lambda alpha: PRIOR)
    run_under_load(cap, compute_bound, sessions=SESSIONS, steps=steps)
    assert cap.caps()[SESSIONS] < 3 and cap.origins()[SESSIONS] == "learned", cap.rates()
    return cap


def test_a_new_gateway_starts_where_an_old_one_learned_and_speculates_less_for_it():
    old = learned_gateway()
    shared = old.learned()
    assert SESSIONS in shared and shared[SESSIONS].cap == old.caps()[SESSIONS]
    fresh, taught = LoadCap(8, price=lambda alpha: PRIOR), LoadCap(8, price=lambda alpha: PRIOR, shared=shared)
    assert taught.origins()[SESSIONS] == "shared" and taught.caps()[SESSIONS] == shared[SESSIONS].cap
    taught.requests = SESSIONS
    assert (taught.cap(), taught.origin()) == (shared[SESSIONS].cap, "shared")
    taught.requests = 0
    # The first stretch of steps: the fresh replica pays for its trials; the taught one does not.
    fresh_steps = run_under_load(fresh, compute_bound, sessions=SESSIONS, steps=2000)
    taught_steps = run_under_load(taught, compute_bound, sessions=SESSIONS, steps=2000)
    assert sum(taught_steps) < 0.5 * sum(fresh_steps), (sum(taught_steps), sum(fresh_steps))


def test_a_level_takes_a_shared_one_only_with_more_evidence_and_between_trials():
    old = learned_gateway()
    level = old._levels[SESSIONS]
    weaker = SharedLevel(8, {(0, 8): (0.5, 1)})  # one trial's word against many
    old.adopt({SESSIONS: weaker})
    assert old.caps()[SESSIONS] == level.best != 8 and old.origins()[SESSIONS] == "learned"
    stronger = SharedLevel(1, {(0, 1): (0.2, level.evidence() + 10)})
    old.adopt({SESSIONS: stronger})
    assert old.caps()[SESSIONS] == 1 and old.origins()[SESSIONS] == "shared"
    assert old.learned()[SESSIONS] == stronger  # passed on as taken, for the next gateway


def test_the_verifier_keeps_the_level_with_the_most_evidence_and_refuses_nonsense():
    board = LoadCapBoard()
    one = to_table({"d->t": {8: SharedLevel(2, {(0, 2): (0.1, 6)})}})
    two = to_table({"d->t": {8: SharedLevel(0, {(0, 2): (-0.2, 9)}), 16: SharedLevel(0, {(0, 1): (-0.3, 5)})}})
    board.share(one)
    table = board.share(two)
    assert from_tables([table]) == {"d->t": {8: SharedLevel(0, {(0, 2): (-0.2, 9)}),
                                            16: SharedLevel(0, {(0, 1): (-0.3, 5)})}}
    assert from_tables([board.share(one)])["d->t"][8].cap == 0  # less evidence: not taken
    bad = worker_pb2.LoadCapTable(levels=[worker_pb2.LoadCapLevel(
        model_pair="d->t", load=8, cap=2, verdicts=[worker_pb2.LoadCapVerdict(lower=3, higher=1, trials=1)])])
    with pytest.raises(ValueError, match="lower < higher"):
        board.share(bad)
    assert from_tables([board.share(worker_pb2.LoadCapTable())])["d->t"][8].cap == 0  # nothing lost


def test_a_second_gateway_replica_starts_from_the_first_ones_caps(model_dirs):
    """Real servers on loopback: gateway A's load cap learns (its steps simulated: a stand-in
    for minutes of traffic at 16 sessions), A shares through the real verifier, and a new
    gateway B against the same workers shows A's cap as its own from start-up."""
    stack = start_stack(model_dirs, drafts=("close",), share_load_caps_s=0.0)
    second = None
    try:
        core = stack.gateway.servicer.core
        pair = next(iter(core.policies.load_caps()), None) or _first_pair(stack)
        load_cap = core.policies.load_caps()[pair]
        load_cap.price, load_cap.prior, load_cap.prior_caps = (lambda alpha: PRIOR), PRIOR, best_caps(PRIOR)
        load_cap._levels.clear()
        run_under_load(load_cap, compute_bound, sessions=SESSIONS, steps=12000)
        assert load_cap.origins()[SESSIONS] == "learned"
        stack.loop.run(share_once(core.policies, core.backend.verifier))
        # What the verifier now keeps, asked as any gateway would.
        with grpc.insecure_channel(f"127.0.0.1:{stack.verifier.port}") as channel:
            kept = worker_pb2_grpc.VerifierStub(channel).ShareLoadCaps(worker_pb2.LoadCapTable())
            assert any(level.model_pair == pair and level.load == SESSIONS for level in kept.levels)
            with pytest.raises(grpc.RpcError) as refused:
                worker_pb2_grpc.VerifierStub(channel).ShareLoadCaps(worker_pb2.LoadCapTable(
                    levels=[worker_pb2.LoadCapLevel(model_pair=pair, load=SESSIONS, cap=999)]))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over 128" in refused.value.details()
        settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=1.0),
                                   verifier_address=f"127.0.0.1:{stack.verifier.port}",
                                   draft_address=f"127.0.0.1:{stack.draft.port}", worker_timeout_s=30.0)
        assert settings.share_load_caps_s > 0  # on by default
        second = stack.loop.run(create_gateway(settings))
        second_core = second.servicer.core
        assert second_core.policies.shared_caps(pair)[SESSIONS].cap == load_cap.caps()[SESSIONS]
        with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            info = gateway_pb2_grpc.GatewayStub(channel).GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
        row = next(r for r in info.load_caps if r.model_pair == pair and r.load == SESSIONS)
        assert (row.cap, row.origin, row.learned) == (load_cap.caps()[SESSIONS], "shared", False)
    finally:
        if second is not None:
            stack.loop.run(second.stop(0))
        stack.close()


def _first_pair(stack) -> str:
    """Make the gateway's load cap for its default pair by serving one AUTO request."""
    from conftest import request

    stack.stub.Generate(request("def add(a, b):", max_new_tokens=2, mode="AUTO"))
    return next(iter(stack.gateway.servicer.core.policies.load_caps()))
