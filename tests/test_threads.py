"""Where a worker's torch work runs: every operator of a model on the model's own thread,
from loading on, and the event loop's thread on one torch thread once the models are
loaded (specd.worker.runtime.event_loop_single_threaded; why: docs/serving-path.md, "One
OpenMP team per worker")."""
from __future__ import annotations

import asyncio
import threading

import torch

from specd.config import ServerSettings
from specd.sampling import Transform
from specd.worker import forwards, runtime
from specd.worker.settings import ModelSettings, VerifierSettings
from specd_cli.launch import _then_single_threaded
from verifier_service.scorer import Scorer
from verifier_service.server import create_server


def test_a_runner_loads_its_model_on_the_thread_that_runs_its_forwards(model_dirs, monkeypatch):
    loaded_on: list[str] = []
    forwards_on: list[str] = []
    load, forward = runtime.AutoModelForCausalLM.from_pretrained, forwards.forward

    def loading(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return load(*args, **kwargs)

    def forwarding(*args, **kwargs):
        forwards_on.append(threading.current_thread().name)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runtime.AutoModelForCausalLM, "from_pretrained", loading)
    monkeypatch.setattr(forwards, "forward", forwarding)
    scorer = Scorer(model_dirs["target"], ModelSettings(max_sessions=2))
    runner = scorer.runner
    try:
        model_thread = runner._executor.submit(lambda: threading.current_thread().name).result()
        scores = asyncio.run(scorer.score("s", 0, [5, 17, 23], [], Transform()))
        assert scores.argmax is not None and len(scores.argmax) == 1
    finally:
        asyncio.run(runner.close())
    assert model_thread != threading.current_thread().name
    assert loaded_on == [model_thread]  # packing's trial forward passed: one load
    assert set(forwards_on) == {model_thread}  # the load-time timing forwards and the step's


def test_a_worker_leaves_torch_threads_to_its_models_once_loaded(model_dirs):
    """The worker command's create_server: afterwards its event loop's thread runs torch on
    one thread, while the model's thread keeps the count the worker was started with. Run
    on a thread of its own, which takes torch's threads as a worker's main thread does."""
    seen: dict[str, int] = {}
    failed: list[BaseException] = []
    before = torch.get_num_threads()

    def worker_main() -> None:
        try:
            torch.set_num_threads(2)  # as `--threads 2` sets it before the models load
            settings = VerifierSettings(ServerSettings("127.0.0.1", 0, grace_s=0.5), model_dirs["target"],
                                        ModelSettings(max_sessions=2))

            async def serve_once() -> None:
                running = await _then_single_threaded(create_server)(settings)
                try:
                    seen["event loop"] = torch.get_num_threads()
                    target = running.servicer.scorer.runner
                    seen["model"] = await asyncio.wrap_future(target._executor.submit(torch.get_num_threads))
                finally:
                    await running.stop(0)

            asyncio.run(serve_once())
        except BaseException as exc:  # re-raised on the test's thread
            failed.append(exc)
        finally:
            torch.set_num_threads(before)  # torch's count for threads yet to start, as it was

    thread = threading.Thread(target=worker_main)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    if failed:
        raise failed[0]
    assert seen == {"event loop": 1, "model": 2}
