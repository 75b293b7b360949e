"""A thread that hands the models over lets its OpenMP pool go (`models/openmp.py`): its worker threads end, and
the server's scheduler does it as it starts, for the thread that loaded the engine, and for its own thread each time
it falls idle; `load`, `prepare`, `generate`, `stream` and `generate_batch` do it for the thread that called them.
The threads that draft side by side (`drafters/batching.py`) never start a pool."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest
from server_helpers import tiny_engine

from verispec.engine import GenerationConfig

POOL = textwrap.dedent("""
    import os, threading, time, torch
    from verispec.models.openmp import _pause_resource_all, release_thread_pool
    torch.set_num_threads(2)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    x = torch.randn(2048, 2048)
    seen = {"libgomp": _pause_resource_all() is not None}

    def work():
        seen["before"] = tasks()
        seen["released without a pool"] = release_thread_pool()  # nothing to free: no error, no thread gone
        seen["before, released"] = tasks()
        (x * 2).sum()  # a parallel region of two threads: this thread's pool starts a worker
        seen["with its pool"] = tasks()
        seen["released"] = release_thread_pool()
        deadline = time.monotonic() + 5
        while tasks() > seen["before"] and time.monotonic() < deadline:  # the workers end just after they are let go
            time.sleep(0.01)
        seen["after"] = tasks()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(seen)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc; libgomp is torch's Linux runtime")
def test_a_thread_lets_its_openmp_pool_go():
    out = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, timeout=120, check=True).stdout
    seen = eval(out)  # noqa: S307 - the dict our own child printed
    if not seen["libgomp"]:
        pytest.skip("torch runs on another OpenMP runtime than libgomp here")
    assert seen["released"] and seen["released without a pool"] and seen["before, released"] == seen["before"]
    assert seen["with its pool"] == seen["before"] + 1  # one worker beside the thread itself
    assert seen["after"] == seen["before"]


DRAFTING = textwrap.dedent("""
    import os, threading, torch
    from verispec.drafters.batching import draft_together
    from verispec.models.openmp import _libgomp
    torch.set_num_threads(2)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    x = torch.randn(2048, 2048)

    def work():  # a drafting task's host work, on a big enough tensor for a parallel region of two threads
        (x * 2).sum()
        return threading.current_thread().name, torch.get_num_threads()

    draft_together([lambda: None] * 2)  # starts the drafting threads (kept for the next step), no parallel work yet
    before = tasks()
    results = draft_together([work, work])
    print({"libgomp": _libgomp() is not None, "results": results, "new threads": tasks() - before,
           "caller": torch.get_num_threads()})
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc; libgomp is torch's Linux runtime")
def test_drafting_threads_start_no_openmp_pool():
    """A drafting thread's parallel regions run on it alone: no pool beside the calling thread's, which runs every
    forward (with one, the process held more OpenMP threads than CPUs and each pass woke its workers through the
    kernel: BENCHMARKS.md, "AMX", sampled traffic under load). The calling thread keeps its own count."""
    out = subprocess.run([sys.executable, "-c", DRAFTING], capture_output=True, text=True, timeout=120, check=True).stdout
    seen = eval(out)  # noqa: S307 - the dict our own child printed
    if not seen["libgomp"]:
        pytest.skip("torch runs on another OpenMP runtime than libgomp here")
    assert seen["results"] == [("verispec-draft", 1)] * 2
    assert seen["new threads"] == 0 and seen["caller"] == 2


def test_the_scheduler_takes_over_from_the_loading_thread_and_lets_its_own_pool_go_when_idle(tiny_target, monkeypatch):
    from verispec.serving.http import scheduler as scheduler_module

    released = []
    monkeypatch.setattr(scheduler_module, "release_thread_pool", lambda: released.append(True) or True)
    scheduler = scheduler_module.Scheduler(tiny_engine(tiny_target))
    assert released == []
    scheduler.start()
    try:
        assert released == [True]
        time.sleep(0.2)
        assert released == [True]  # idle since it started: nothing to let go
        scheduler.submit([20, 21, 22, 20], GenerationConfig(max_new_tokens=3), asyncio.new_event_loop())
        deadline = time.monotonic() + 30
        while len(released) < 2 and time.monotonic() < deadline:  # it works, then falls idle: its own pool goes
            time.sleep(0.01)
        assert released == [True, True] and scheduler.turns and not scheduler.active_count
        time.sleep(0.2)
        assert released == [True, True]  # once per fall, not every idle turn
    finally:
        scheduler.stop()


def test_preparing_a_drafter_lets_the_preparing_threads_pool_go_once_it_built_something(tiny_target, monkeypatch):
    """The server prepares a request's own drafter on a thread of asyncio's: that thread's pool goes after the build and
    the measurements, on that thread; a drafter already prepared is a lookup, with nothing to let go."""
    import threading

    from verispec.engine import loop

    engine, calls = tiny_engine(tiny_target), []
    monkeypatch.setattr(loop, "release_thread_pool", lambda: calls.append(threading.get_ident()) or True)
    thread = threading.Thread(target=engine.prepare, args=("ngram:max_n=2",))
    thread.start()
    thread.join()
    assert calls == [thread.ident]
    assert engine.prepare("ngram:max_n=2") is not None and calls == [thread.ident]


def test_the_engine_leaves_no_pool_to_the_thread_that_called_it(tiny_target, monkeypatch):
    """`generate`, `stream` (once it ends) and `generate_batch` each let the calling thread's pool go as they return,
    and `load` as it returns: whichever thread generates next has the cores."""
    import threading

    from verispec.engine import build, loop

    calls = []
    record = lambda: calls.append(threading.get_ident()) or True  # noqa: E731
    engine, config = tiny_engine(tiny_target), GenerationConfig(max_new_tokens=4)
    engine.prepare()  # (its own release: the test above)
    monkeypatch.setattr(loop, "release_thread_pool", record)
    engine.generate("t20 t21 t22", config)
    assert calls == [threading.get_ident()]
    events = engine.stream("t20 t21 t22", config)
    next(events)
    assert len(calls) == 1  # not while it streams
    list(events)
    assert len(calls) == 2
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate_batch(["t20 t21", "t22 t20"], config, max_batch=2)))
    worker.start()
    worker.join()
    assert len(done[0]) == 2 and len(calls) == 3 and calls[-1] == worker.ident

    monkeypatch.setattr(build, "release_thread_pool", record)
    build.load(str(tiny_target), draft="none", dtype="float32")
    assert len(calls) == 4
