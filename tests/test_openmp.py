"""A thread that hands the models over lets its OpenMP pool go (`models/openmp.py`): its worker threads end, and
the server's scheduler does it as it starts, for the thread that loaded the engine; so does the thread that
prepares a request's own drafter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from server_helpers import tiny_engine

from verispec.models.openmp import release_thread_pool

POOL = textwrap.dedent("""
    import os, threading, time, torch
    from verispec.models.openmp import _pause_resource_all, release_thread_pool
    torch.set_num_threads(2)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    x = torch.randn(2048, 2048)
    seen = {"libgomp": _pause_resource_all() is not None}

    def work():
        seen["before"] = tasks()
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
    assert seen["released"]
    assert seen["with its pool"] == seen["before"] + 1  # one worker beside the thread itself
    assert seen["after"] == seen["before"]


def test_releasing_without_a_pool_is_harmless():
    assert release_thread_pool() in (True, False)  # this thread may have no pool: nothing to free, no error
    assert release_thread_pool() in (True, False)


def test_the_scheduler_takes_over_from_the_loading_thread(tiny_target, monkeypatch):
    from verispec.serving.http import scheduler as scheduler_module

    released = []
    monkeypatch.setattr(scheduler_module, "release_thread_pool", lambda: released.append(True) or True)
    scheduler = scheduler_module.Scheduler(tiny_engine(tiny_target))
    assert released == []
    scheduler.start()
    try:
        assert released == [True]
    finally:
        scheduler.stop()


def test_a_request_drafter_is_prepared_on_a_thread_that_then_lets_its_pool_go(tiny_target, monkeypatch):
    import threading

    from verispec.engine import GenerationConfig
    from verispec.serving.http import app as app_module

    engine, calls = tiny_engine(tiny_target), []
    monkeypatch.setattr(app_module, "release_thread_pool", lambda: calls.append(("released", threading.get_ident())) or True)
    monkeypatch.setattr(engine, "prepare", lambda *args: calls.append(("prepared", threading.get_ident())))
    thread = threading.Thread(target=app_module._prepare, args=(engine, GenerationConfig(drafter="ngram")))
    thread.start()
    thread.join()
    assert [what for what, _ in calls] == ["prepared", "released"] and len({ident for _, ident in calls}) == 1
