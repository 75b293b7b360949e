"""Stopping the server: the app on `verispec.serving.http.server.run` (what `verispec serve` runs), in a
process of its own on 127.0.0.1, on the tiny model slowed to 0.2 s per target pass. SIGTERM refuses new
requests, lets the running ones go on for the grace period, then ends each stream with a last chunk whose
finish_reason is "shutdown" and a non-streamed request with a 503, and the process exits soon after;
a second signal exits at once, whatever the grace period."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, _free_port

PROMPT = "t20 t21 t22 t20 t21"  # loops: no EOS within 100 tokens
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "temperature": 0}  # ≥ 25 target passes: ≥ 5 s
SERVER = """
import sys
from pathlib import Path

import torch
from server_helpers import slow, tiny_engine

from verispec.serving.http import create_app
from verispec.serving.http.server import run

torch.set_num_threads(1)
target, port, grace = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
run(create_app(slow(tiny_engine(target), 0.2), model_name="tiny", shutdown_grace=grace), "127.0.0.1", port)
"""


@pytest.fixture
def start(tiny_target):
    """start(grace) → (process, url) of a running server; any process left running is killed at the end."""
    processes = []

    def start_server(grace: float) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        processes.append(subprocess.Popen([sys.executable, "-c", SERVER, str(tiny_target), str(port), str(grace)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _up(url):
            assert processes[-1].poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        return processes[-1], url

    yield start_server
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


class Stream(threading.Thread):
    """One streamed completion read to its end: its chunks, and `started` once the first came."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.chunks, self.done, self.started = url, [], False, threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[len("data: "):]))
                        self.started.set()
        except httpx.TransportError:  # cut off: `done` stays False
            pass


def test_sigterm_ends_every_stream_with_finish_reason_shutdown_within_the_grace_period(start):
    """4 streams and a non-streamed request run; SIGTERM: a new request is refused, the streams end with
    a "shutdown" chunk, the other request is a 503, and the process is gone within grace + 2 s. Fails if
    the streams run to their end (≥ 5 s) or are cut without that chunk."""
    grace = 1.0
    process, url = start(grace)
    streams = [Stream(url) for _ in range(4)]
    for stream in streams:
        stream.start()
    plain: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: plain.append(httpx.post(url + "/v1/completions", json=BODY, timeout=30)), daemon=True)
    waiting.start()
    assert all(stream.started.wait(30) for stream in streams), "the streams did not start"
    assert httpx.get(url + "/health").json()["active"] == 5

    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        late = httpx.post(url + "/v1/completions", json=BODY, timeout=5)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"], late.text
    except httpx.TransportError:
        pass  # refused: no longer listening
    process.wait(grace + 5)
    assert time.monotonic() - signalled < grace + 2
    for thread in [*streams, waiting]:
        thread.join(5)
    for stream in streams:
        assert stream.done and stream.chunks[-1]["choices"][0]["finish_reason"] == "shutdown", stream.chunks[-2:]
        assert sum(len(chunk["choices"][0]["text"]) > 0 for chunk in stream.chunks) < 100  # cut short
    assert plain[0].status_code == 503 and "stopped this request after" in plain[0].json()["error"]["message"], plain[0].text


def test_a_second_signal_exits_at_once(start):
    process, url = start(grace=60.0)
    stream = Stream(url)
    stream.start()
    assert stream.started.wait(30)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert process.poll() is None, "the first signal should wait for the running stream"
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(10)
    assert time.monotonic() - signalled < 2
    stream.join(5)
    assert not stream.is_alive()


def test_cli_serve_passes_its_connection_and_shutdown_options(tiny_target, monkeypatch):
    """`verispec serve` hands --shutdown-grace and --body-timeout to the app, --max-connections and
    --keep-alive to uvicorn, and refuses impossible values before loading anything."""
    from verispec.cli import main
    from verispec.serving.http import server
    from verispec.serving.http.guard import Guard

    ran = []
    monkeypatch.setattr(server, "run", lambda app, host, port, max_connections, keep_alive: ran.append((app, max_connections, keep_alive)))
    assert main(["serve", "--target", str(tiny_target), "--draft", "ngram", "--gamma-policy", "constant", "--shutdown-grace", "3",
                 "--body-timeout", "7", "--max-connections", "9", "--keep-alive", "2"]) == 0
    app, max_connections, keep_alive = ran[0]
    guard = next(middleware for middleware in app.user_middleware if middleware.cls is Guard)
    assert (app.state.shutdown_grace, guard.kwargs["body_timeout"], max_connections, keep_alive) == (3.0, 7.0, 9, 2.0)
    for option, value in [("--shutdown-grace", "-1"), ("--body-timeout", "0"), ("--max-connections", "0"), ("--keep-alive", "0")]:
        assert main(["serve", "--target", str(tiny_target), option, value]) == 2
    assert len(ran) == 1
