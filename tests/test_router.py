"""The session router: placement rules, and the EndpointSlice watch feeding it.

No real Kubernetes API server can run on this machine, so the watch is tested against
`k8s_standin.StandinApiServer`, which speaks the same list/watch protocol over HTTP.
"""
from __future__ import annotations

import threading
import time

import pytest

from gateway.workers.endpointslices import Backoff, EndpointSliceWatcher, endpoints_from_slices
from gateway.workers.router import NoEndpoint, Router, parse_addresses
from k8s_standin import StandinApiServer, endpoint_slice

A, B, C = "10.0.0.1:50053", "10.0.0.2:50053", "10.0.0.3:50053"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loads(router: Router) -> dict[str, int]:
    return {e.address: e.sessions for e in router.snapshot()}


# -- placement ---------------------------------------------------------------------------

def test_new_sessions_go_to_the_least_loaded_ready_endpoint():
    router = Router.static("verifier", [A, B, C])
    assert [router.place(s) for s in ("s0", "s1", "s2", "s3")] == [A, B, C, A]
    router.release("s1")
    assert router.place("s4") == B  # the only endpoint without a session
    assert loads(router) == {A: 2, B: 1, C: 1}


def test_ties_rotate_so_short_sessions_spread():
    router = Router.static("draft", [A, B, C])
    seen = []
    for i in range(6):
        seen.append(router.place(f"s{i}"))
        router.release(f"s{i}")
    assert seen[:3] == seen[3:] and sorted(seen[:3]) == [A, B, C]


def test_sessions_stick_to_their_endpoint():
    router = Router.static("verifier", [A, B])
    first = router.place("s")
    for i in range(5):
        router.place(f"other{i}")
    assert router.place("s") == first
    assert loads(router)[first] == 3  # placing "s" again did not count it twice


def test_not_ready_endpoints_take_no_new_sessions_but_keep_theirs():
    router = Router.static("verifier", [A, B])
    on_b = next(s for s in ("x", "y") if router.place(s) == B)
    router.set_endpoints({A: True, B: False})  # B is draining
    assert {router.place(f"new{i}") for i in range(4)} == {A}
    assert loads(router)[B] == 1  # its cache is there and its stream still works
    assert router.place(on_b) == A  # a re-open moves it: a draining pod refuses new streams


def test_sessions_of_a_removed_endpoint_are_moved_on_their_next_placement():
    router = Router.static("verifier", [A, B])
    on_a = [s for s in ("p", "q", "r", "s") if router.place(s) == A]
    router.set_endpoints({B: True, C: True})
    assert A not in loads(router)  # its caches left with it
    moved = {router.fail_over(s) for s in on_a}
    assert moved <= {B, C} and all(router.place(s) in (B, C) for s in on_a)
    assert sum(loads(router).values()) == 4


def test_fail_over_avoids_the_failed_endpoint_for_a_while():
    clock = FakeClock()
    router = Router.static("verifier", [A, B], suspect_s=5.0, clock=clock)
    session = "s"
    failed = router.place(session)
    other = B if failed == A else A
    assert router.fail_over(session) == other
    router.release(session)
    # The failed endpoint is now the least loaded but suspect: new sessions avoid it.
    assert router.place("n1") == other
    clock.now = 6.0
    assert router.place("n2") == failed


def test_fail_over_falls_back_to_the_only_ready_endpoint():
    router = Router.static("verifier", [A])
    router.place("s")
    assert router.fail_over("s") == A  # a restarted container keeps its pod's address
    assert router.place("t") == A  # suspect, but the only one


def test_no_ready_endpoint_is_a_clear_error():
    router = Router("draft", {A: False})
    with pytest.raises(NoEndpoint, match="no ready draft endpoint"):
        router.place("s")
    with pytest.raises(NoEndpoint):
        Router.static("draft", []).place("s")


def test_release_forgets_the_session():
    router = Router.static("verifier", [A])
    router.place("s")
    router.release("s")
    router.release("unknown")
    assert loads(router) == {A: 0}


def test_concurrent_use_keeps_the_counts_consistent():
    router = Router.static("verifier", [A, B, C])

    def churn(worker: int) -> None:
        for i in range(300):
            sid = f"{worker}-{i}"
            router.place(sid)
            if i % 3:
                router.release(sid)

    def flap() -> None:
        for i in range(300):
            router.set_endpoints({A: True, B: i % 2 == 0, C: True})

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(4)] + [threading.Thread(target=flap)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(loads(router).values()) == 4 * 100


def test_parse_addresses():
    assert parse_addresses(" a:1, [::1]:2 ,") == ["a:1", "[::1]:2"]
    with pytest.raises(ValueError, match="'nohost' is not HOST:PORT"):
        parse_addresses("a:1,nohost")


def test_endpoints_from_slices():
    one = endpoint_slice("s1", "ns", "verifier", [("10.0.0.1", True), ("10.0.0.2", False)], 50053, "grpc", 1)
    two = endpoint_slice("s2", "ns", "verifier", [("10.0.0.2", True)], 50053, "grpc", 2)
    v6 = endpoint_slice("s3", "ns", "verifier", [("fd00::1", True)], 50053, "grpc", 3)
    v6["endpoints"][0]["conditions"] = {}  # a missing ready condition means ready
    other_port = endpoint_slice("s4", "ns", "verifier", [("10.0.0.9", True)], 9400, "metrics", 4)
    assert endpoints_from_slices([one, two, v6, other_port], "grpc") == {
        "10.0.0.1:50053": True, "10.0.0.2:50053": True, "[fd00::1]:50053": True}


# -- the EndpointSlice watch, against the stand-in API server ------------------------------

def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def api():
    with StandinApiServer(namespace="specd") as server:
        server.put_slice("verifier-a", "specd-verifier", [("10.0.0.1", True)])
        server.put_slice("draft-a", "specd-draft", [("10.0.9.9", True)], port=50052)
        yield server


@pytest.fixture
def watched(api):
    router = Router("verifier")
    watcher = EndpointSliceWatcher(router, "specd-verifier", "specd", configuration=api.configuration(),
                                   watch_timeout_s=1, backoff=Backoff(first_s=0.01, max_s=0.05)).start()
    assert watcher.wait_synced(5.0)
    yield router
    watcher.stop()


def endpoints(router: Router) -> dict[str, bool]:
    return {e.address: e.ready for e in router.snapshot()}


def test_watch_lists_only_its_service(api, watched):
    assert endpoints(watched) == {A: True}
    assert api.requests[0]["labelSelector"] == "kubernetes.io/service-name=specd-verifier"


def test_watch_added_endpoint_becomes_usable(api, watched):
    api.put_slice("verifier-b", "specd-verifier", [("10.0.0.2", True)])
    wait_for(lambda: endpoints(watched) == {A: True, B: True})
    assert {watched.place(s) for s in ("s1", "s2")} == {A, B}


def test_watch_not_ready_endpoint_gets_no_new_sessions(api, watched):
    api.put_slice("verifier-a", "specd-verifier", [("10.0.0.1", True), ("10.0.0.2", True)])
    wait_for(lambda: len(endpoints(watched)) == 2)
    api.put_slice("verifier-a", "specd-verifier", [("10.0.0.1", False), ("10.0.0.2", True)])  # MODIFIED
    wait_for(lambda: endpoints(watched) == {A: False, B: True})
    assert {watched.place(f"s{i}") for i in range(4)} == {B}


def test_watch_deleted_endpoint_sessions_are_replaced(api, watched):
    api.put_slice("verifier-b", "specd-verifier", [("10.0.0.2", True)])
    wait_for(lambda: len(endpoints(watched)) == 2)
    sessions = [f"s{i}" for i in range(4)]
    on_a = [s for s in sessions if watched.place(s) == A]
    api.delete_slice("verifier-a")
    wait_for(lambda: endpoints(watched) == {B: True})
    assert on_a and A not in loads(watched)
    assert {watched.fail_over(s) for s in on_a} == {B}


def test_watch_resumes_after_a_normal_end_without_listing(api, watched):
    watches = api.count("watch")
    wait_for(lambda: api.count("watch") > watches, timeout_s=4.0)  # the 1 s watch timed out
    assert api.count("list") == 1
    api.put_slice("verifier-b", "specd-verifier", [("10.0.0.2", True)])
    wait_for(lambda: B in endpoints(watched))


def test_watch_relists_after_410_gone(api, watched):
    api.compact()  # history gone, open watches ended: resuming from the old version gets 410
    api.put_slice("verifier-c", "specd-verifier", [("10.0.0.3", True)])
    wait_for(lambda: endpoints(watched) == {A: True, C: True})
    assert api.expired_watches >= 1 and api.count("list") >= 2


def test_watch_backs_off_and_recovers_from_server_errors(api, watched):
    api.fail_next(3)
    api.compact()
    api.put_slice("verifier-b", "specd-verifier", [("10.0.0.2", False)])
    wait_for(lambda: endpoints(watched) == {A: True, B: False})
    assert api.count("list") >= 2


def test_a_new_session_follows_its_prefix_within_a_bounded_load():
    from specd.prefixkeys import prompt_keys

    router = Router.static("verifier", [A, B, C])
    system = list(range(100))  # a shared system prompt of 6 full blocks
    first = router.place("s1", prompt_keys(b"", system + [1, 2, 3]))
    # The same system prompt, another question: the endpoint that has it, not the least loaded.
    assert router.place("s2", prompt_keys(b"", system + [7, 8, 9])) == first
    assert router.prefix_placements == 1
    # Another tenant's salt shares no key: placed by load.
    assert router.place("s3", prompt_keys(b"tenant", system + [7])) != first
    # Past LOAD_SLACK × the mean, the holder takes no more: the load spreads.
    for i in range(4, 40):
        router.place(f"s{i}", prompt_keys(b"", system + [i]))
    counts = loads(router)
    assert max(counts.values()) <= 1.25 * sum(counts.values()) / 3 + 4 + 1, counts
    assert router.prefix_placements > 5  # the holder took sessions until its bound
    # A prompt shorter than a block has no key, and a re-placed session keeps its endpoint.
    assert prompt_keys(b"", [1, 2, 3]) == []
    assert router.place("s2", prompt_keys(b"", system)) == first
