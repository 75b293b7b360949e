"""Scale-out on Ray, for real on this machine: one local Ray instance (the machine's CPUs) for the module.

Serving: `verispec serve --ray` comes up and answers; two replicas answer concurrent requests of the
official `openai` client with the engine's own outputs; each replica's metrics reach Ray's Prometheus
export labelled by replica; a replica killed (SIGKILL) mid-load fails its in-flight requests with a
clear retryable 503 (or a final SSE error event), Serve replaces it, and every later request is
answered. Batch: 50 records with 2 bad ones give 48 results + 2 errors, a run cut short (--limit)
and a rerun complete the rest without duplicates, and a third run has nothing left to do.

Without Ray installed, the Ray tests skip (and a test checks the error message that says how to install it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import MODEL, TinyLoader, _free_port, expected_text, tiny_engine

import verispec
from verispec.cli import main
from verispec.serving.cluster.batch_io import check_ids, read_input, written_ids
from verispec.serving.cluster.metrics_mirror import parse_prometheus
from verispec.serving.cluster.proxy import REPLICA_LOST_CODE, SERVE_PROXY_ENV
from verispec.errors import VerispecError
from verispec.serving.http.metrics import Metrics

pytestmark = pytest.mark.first  # the longest file, mostly waiting on the cluster: started first, it overlaps the rest

PROMPTS = ["t5 t9 t2 t7", "t22 t3 t3 t3 t8 t2 t30 t42 t5", "t20 t21 t22 t20 t21", "t7 t7 t7", "t33 t2", "t40"]


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    """condition()'s first truthy value, polling; fails with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up after {timeout:.0f} s waiting for {what() if callable(what) else what}"
        time.sleep(interval)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance with this machine's CPUs; its workers import this verispec and the test helpers."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'verispec[ray]' (scripts/setup.sh --test installs it)")
    pytest.importorskip("ray.serve", reason="Ray Serve is missing: pip install 'ray[serve,data]'")
    pytest.importorskip("pyarrow", reason="pyarrow is missing: pip install 'verispec[ray]'")
    paths = [str(Path(verispec.__file__).parents[1]), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    metrics_port = _free_port()
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {**SERVE_PROXY_ENV, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}},
             _metrics_export_port=metrics_port)
    try:
        yield {"address": ray.get_runtime_context().gcs_address, "metrics_port": metrics_port}
    finally:
        ray.shutdown()


# ---- without a cluster ---------------------------------------------------------------------------

def test_missing_ray_says_how_to_install(monkeypatch):
    from verispec.serving.cluster.cluster import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    with pytest.raises(VerispecError, match=r"pip install 'verispec\[ray\]'"):
        require_ray()


def test_mirror_reads_back_every_metric_family():
    metrics = Metrics()
    metrics.record_request("completions", 200, 0.3)
    metrics.record_verification(proposed=4, accepted=2, emitted=3)
    samples = {(name, tuple(sorted(labels.items()))): (kind, value) for kind, name, labels, value in parse_prometheus(metrics.render())}
    assert samples[("verispec_requests_total", (("endpoint", "completions"), ("status", "200")))] == ("counter", 1)
    assert samples[("verispec_mean_accepted_length", ())] == ("gauge", 3.0)
    assert samples[("verispec_request_latency_seconds_bucket", (("endpoint", "completions"), ("le", "0.5")))] == ("histogram", 1)


def test_batch_input_problems_are_records_and_duplicates_are_refused(tmp_path):
    good = tmp_path / "in.jsonl"
    good.write_text('{"id": 1, "prompt": "t3"}\n\nnot json\n{"prompt": "t4"}\n[1, 2]\n{"id": "b", "prompt": "t5", "seed": null}\n')
    records = read_input(good)
    assert [r.id for r in records] == ["1", "line:3", "line:4", "line:5", "b"]
    assert [r.problem is None for r in records] == [True, False, False, False, True]
    assert "not valid JSON" in records[1].problem and "no usable 'id'" in records[2].problem
    assert records[4].record == {"id": "b", "prompt": "t5"}  # null = not given
    repeated = tmp_path / "twice.jsonl"
    repeated.write_text('{"id": "a", "prompt": "t3"}\n{"id": "a", "prompt": "t4"}\n')
    with pytest.raises(VerispecError, match="ids must be unique, but 'a' occur"):
        read_input(repeated)
    (tmp_path / "in.csv").write_text("id,prompt\n")
    with pytest.raises(VerispecError, match=r"name it \*\.jsonl .* or \*\.parquet"):
        read_input(tmp_path / "in.csv")


def test_batch_runs_locally_without_ray_and_resumes(tiny_text_pair, tmp_path, monkeypatch):
    """`--local`: the same job (files, resume, check) in this process; Ray is not even importable."""
    monkeypatch.setitem(sys.modules, "ray", None)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"t{20 + i} t5", "max_tokens": 4}) + "\n"
                                               for i in range(6)) + '{"id": "q6", "prompt": "t5", "top_k": -1}\n')
    argv = ["batch", "--local", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target",
            str(tiny_text_pair[0]), "--draft", "ngram", "--gamma-policy", "constant", "--batch-size", "2"]
    assert main(argv + ["--limit", "3"]) == 0
    assert sum(map(len, written_ids(tmp_path / "out").values())) == 3
    assert main(argv) == 0
    check = check_ids([f"q{i}" for i in range(7)], tmp_path / "out")
    assert check.complete and (check.results, check.errors) == (6, 1), check.describe()


def test_serve_options_refuse_half_an_autoscaling_range():
    from verispec.serving.cluster.serve import ServeOptions

    with pytest.raises(VerispecError, match="both --min-replicas and --max-replicas"):
        ServeOptions(min_replicas=1)
    with pytest.raises(VerispecError, match="0 ≤ --min-replicas ≤ --max-replicas"):
        ServeOptions(min_replicas=3, max_replicas=2)
    scaling = ServeOptions(min_replicas=1, max_replicas=4, max_batch=8, max_queue=16).deployment_options()
    assert scaling["autoscaling_config"]["target_ongoing_requests"] == 8 and scaling["max_ongoing_requests"] == 24


def test_serve_run_builder_takes_string_arguments():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'verispec[ray]'")
    from verispec.serving.cluster.serve import build_app

    app = build_app({"target": "some-model", "draft": "ngram", "gamma": "3", "min_replicas": "1", "max_replicas": "3", "replica_cpus": "2"})
    deployment = app._bound_deployment  # (no public accessor for what an Application is bound to)
    loader, app_options, cpus = deployment.init_args
    assert (loader.target, loader.gamma, cpus) == ("some-model", 3, 2.0) and app_options["max_batch"] == 8
    assert deployment._deployment_config.autoscaling_config.max_replicas == 3
    with pytest.raises(VerispecError, match="unknown argument.*replica_count"):
        build_app({"replica_count": "2"})


# ---- serving on Ray Serve --------------------------------------------------------------------------

def test_cli_serve_ray_comes_up_answers_and_cleans_up(cluster, tiny_target):
    """`verispec serve --ray --ray-address …` joins the cluster, serves with the limits it was given (an API
    key, a prefill chunk, a KV pool: refused with --ray before), and on SIGTERM removes what it started."""
    from verispec.serving.cluster.serve import serve_running

    if serve_running():
        pytest.skip("Serve is already running on this cluster: this test must run before the others start it")
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "verispec.cli", "serve", "--ray", "--ray-address", cluster["address"], "--replicas", "1",
         "--replica-cpus", "0.5", "--port", str(port), "--target", str(tiny_target), "--draft", "ngram",
         "--gamma-policy", "constant", "--model-name", MODEL, "--api-key", "k3y", "--prefill-chunk", "16",
         "--kv-pool-tokens", "3000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        def serving():
            assert process.poll() is None, "verispec serve --ray exited:\n" + "".join(lines)
            return any("serving on http://127.0.0.1:" in line for line in lines)
        wait_for(serving, 180, "verispec serve --ray to deploy")
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert health["model"] == MODEL and health["drafter"].startswith("ngram")
        assert (health["prefill_chunk"], health["kv_pool_tokens"]) == (16, 3000)
        body = {"model": MODEL, "prompt": [20, 21, 22], "max_tokens": 5}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 401
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60, headers={"Authorization": "Bearer k3y"})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
        assert response.headers["x-verispec-replica"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
        reader.join(10)
    output = "".join(lines)
    assert process.returncode == 0, output
    assert "ray_verispec_" in output and "stopping: removing the deployment" in output
    assert not serve_running(), "Serve was started by the command and should be shut down with it"


@pytest.fixture(scope="module")
def served(cluster, tiny_target):
    """Two replicas of the tiny engine on Serve; each target pass sleeps 30 ms so that requests overlap."""
    from ray import serve

    from verispec.serving.cluster.serve import ServeOptions, deploy

    options = ServeOptions(replicas=2, replica_cpus=0.5, port=_free_port(), model_name=MODEL, max_batch=4, max_queue=16)
    url = deploy(TinyLoader(str(tiny_target), delay=0.03), options)
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_target):
    return tiny_engine(tiny_target)


def replicas_answering(url: str, calls: int = 20) -> dict[str, int]:
    """replica id → process id, from the headers of `calls` /health answers."""
    seen: dict[str, int] = {}
    for _ in range(calls):
        response = httpx.get(url + "/health", timeout=30)
        if response.status_code == 200:
            seen[response.headers["x-verispec-replica"]] = int(response.headers["x-verispec-pid"])
    return seen


def two_replicas(url: str, without: str | None = None) -> dict[str, int]:
    """The two replicas that answer (none of them `without`), waiting for them."""
    def answering():
        seen = replicas_answering(url)
        return seen if len(seen) == 2 and without not in seen else None
    return wait_for(answering, 180, "answers from two replicas" + (f" other than {without}" if without else ""))


def test_two_replicas_answer_concurrent_openai_requests_exactly(served, reference):
    two_replicas(served)  # both are up and known to the proxy before the requests that must reach both
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    jobs = [(p, 0.0, None) for p in PROMPTS] + [(PROMPTS[0], 0.9, 7), (PROMPTS[2], 0.7, 3)]

    def one(job):
        prompt, temperature, seed = job
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=temperature, seed=seed)
        return raw.parse().choices[0].text, raw.headers["x-verispec-replica"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    assert [text for text, _ in answers] == [expected_text(reference, p, 24, t, s) for p, t, s in jobs]
    assert len({replica for _, replica in answers}) == 2, "all requests went to one replica"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected_text(reference, PROMPTS[1], 16, chat=True)


def test_each_replicas_metrics_reach_prometheus_labelled_by_replica(served, cluster):
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0), PROMPTS))
    own: dict[str, float] = {}  # each replica's own /metrics (a scrape through the proxy reaches one at random)

    def both_scraped():
        response = httpx.get(served + "/metrics", timeout=30)
        samples = parse_prometheus(response.text)
        own[response.headers["x-verispec-replica"]] = next(v for _, name, _, v in samples if name == "verispec_generated_tokens_total")
        return len(own) == 2
    wait_for(both_scraped, 60, "a /metrics answer from each replica", interval=0.05)
    assert all(value > 0 for value in own.values())

    last: dict[str, float] = {}

    def exported():
        text = httpx.get(f"http://127.0.0.1:{cluster['metrics_port']}/metrics", timeout=30).text
        last.clear()
        last.update({labels["replica"]: value for _, name, labels, value in parse_prometheus(text)  # (replicas of
                     if name == "ray_verispec_generated_tokens_total" and labels.get("replica") in own})  # earlier tests linger)
        return dict(last) if last == own else None
    series = wait_for(exported, 90, lambda: f"Ray's metrics export to report {own} per replica (last seen: {last})")
    assert sum(series.values()) == sum(own.values())  # the deployment's total is the sum over the replica tag


def test_a_killed_replica_fails_its_requests_clearly_and_the_rest_are_answered(served, reference):
    """Three streamed and three plain requests (PROMPTS[2] runs 100 greedy tokens, > 1 s here); once every stream
    has its first token, the replica of the first one is killed."""
    pids = two_replicas(served)

    async def load_then_kill():
        async with httpx.AsyncClient(base_url=served, timeout=120) as http:
            async def streamed(i):
                body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 100, "temperature": 0, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    first = await anext(lines)  # the request is admitted and decoding on its replica
                    started.append(response.headers["x-verispec-replica"])
                    return response.headers["x-verispec-replica"], [first] + [line async for line in lines]

            async def plain(i):
                body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 100, "temperature": 0}
                return await http.post("/v1/completions", json=body)

            started: list[str] = []
            streams = [asyncio.create_task(streamed(i)) for i in range(3)]
            plains = [asyncio.create_task(plain(i)) for i in range(3)]
            while len(started) < len(streams):
                await asyncio.sleep(0.01)
            victim = started[0]
            os.kill(pids[victim], signal.SIGKILL)
            return victim, await asyncio.gather(*streams), await asyncio.gather(*plains)

    victim, streams, plains = asyncio.run(asyncio.wait_for(load_then_kill(), 180))  # never a hang
    lost = 0
    for replica, lines in streams:
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [line for line in lines if line][-1] == "data: [DONE]"  # every stream is closed properly
        if "error" in events[-1]:
            assert replica == victim and events[-1]["error"]["code"] == REPLICA_LOST_CODE and "retry" in events[-1]["error"]["message"]
            lost += 1
        else:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
    for response in plains:
        if response.status_code != 200:  # it was on the killed replica
            assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
            error = response.json()["error"]
            assert error["code"] == REPLICA_LOST_CODE and "retry it" in error["message"]
            lost += 1
    assert lost >= 1, "the kill hit no request in flight: nothing was tested"

    # every later request is answered (the official client retries a 503, as it does by default)
    client = openai.OpenAI(base_url=served + "/v1", api_key="unused", timeout=120)
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text, PROMPTS))
    assert texts == [expected_text(reference, p, 10) for p in PROMPTS]
    # and Serve replaced the lost replica with a new one
    replaced = two_replicas(served, without=victim)  # Serve replaced the killed replica
    assert len(set(replaced) - set(pids)) == 1


# ---- batch generation on Ray Data ----------------------------------------------------------------

def write_records(path: Path, n: int = 50) -> list[dict]:
    records = []
    for i in range(n):
        record = {"id": f"r{i:02d}", "prompt": f"t{20 + i % 20} t{3 + i % 7} t{30 + i % 11} t5"}
        if i % 5 == 0:
            record.update(temperature=0.8, seed=i, max_tokens=6)
        records.append(record)
    records[7]["prompt"] = " ".join(["t3"] * 200)  # longer than the model's context of 128
    records[23]["top_p"] = 1.5  # out of range
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def read_jsonl_parts(folder: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(folder.glob("part-*.jsonl")) for line in part.read_text().splitlines()]


def test_batch_accounts_for_every_record_and_resumes_without_duplicates(cluster, tiny_text_pair, tmp_path, capsys):
    target = tiny_text_pair[0]
    records = write_records(tmp_path / "in.jsonl")
    ids = [r["id"] for r in records]
    argv = ["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--target", str(target),
            "--draft", "ngram", "--gamma", "3", "--gamma-policy", "constant", "--actors", "2", "--actor-cpus", "0.5", "--batch-size", "4",
            "--max-new-tokens", "8", "--flush-every", "8", "--ray-address", cluster["address"]]

    # a run cut short: only 20 records, then the job stops
    assert main(argv + ["--limit", "20"]) == 0
    first = written_ids(tmp_path / "out")
    assert sum(first["results"].values()) + sum(first["errors"].values()) == 20
    assert set(first["results"]) | set(first["errors"]) == set(ids[:20])
    assert "30 records not run yet" in capsys.readouterr().out

    # the rerun skips what is written and completes the rest
    assert main(argv) == 0
    out = capsys.readouterr().out
    check = check_ids(ids, tmp_path / "out")
    assert check.complete and (check.results, check.errors) == (48, 2), check.describe()
    assert "50 input ids, 48 results + 2 errors = every input id exactly once" in out
    assert re.search(r"total\s*│\s*\d+ │\s*\d+ │", out)  # the summary table's total row
    errors = {row["id"]: row for row in read_jsonl_parts(tmp_path / "out" / "errors")}
    assert set(errors) == {"r07", "r23"}
    assert "context of 128" in errors["r07"]["error"] and errors["r07"]["error_type"] == "PromptError"
    assert "invalid 'top_p'" in errors["r23"]["error"]
    results = {row["id"]: row for row in read_jsonl_parts(tmp_path / "out" / "results")}
    assert len(results) == 48 and set(results) | set(errors) == set(ids)

    # outputs are the engine's own: greedy (r01) and seeded sampling with per-record settings (r10)
    engine = verispec.load(str(target), "ngram", "float32", 3, "constant")
    for i, config in ((1, verispec.GenerationConfig(max_new_tokens=8)),
                      (10, verispec.GenerationConfig(max_new_tokens=6, sampling=verispec.SamplingParams(temperature=0.8), seed=10))):
        want = engine.generate(engine.prompt_ids(records[i]["prompt"]), config)
        got = results[f"r{i:02d}"]
        assert (got["token_ids"], got["text"]) == (want.token_ids, want.text)
        assert got["steps"] == want.stats.steps and got["mean_accepted_length"] == round(want.stats.mean_accepted_length, 4)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["skipped"] == 20 and summary["ran"] == 30 and summary["check"]["complete"]
    assert summary["total"]["new_tokens"] == sum(results[i]["new_tokens"] for i in results if i not in first["results"])

    # a third run has nothing left to do and writes nothing
    parts = sorted(p.name for p in (tmp_path / "out").rglob("part-*"))
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "out").rglob("part-*")) == parts


def test_batch_reads_and_writes_parquet(cluster, tiny_text_pair, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "a", "prompt": "t20 t21 t22", "messages": None, "max_tokens": 5},
            {"id": "b", "prompt": None, "messages": [{"role": "user", "content": "t5"}], "max_tokens": None},  # no chat template
            {"id": "c", "prompt": "t7 t7 t7", "messages": None, "max_tokens": 4}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    argv = ["batch", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--target", str(tiny_text_pair[0]),
            "--draft", "ngram", "--gamma-policy", "constant", "--actor-cpus", "0.5", "--ray-address", cluster["address"]]
    assert main(argv) == 0
    results = pq.read_table(tmp_path / "out" / "results")
    errors = pq.read_table(tmp_path / "out" / "errors").to_pylist()
    assert sorted(results.column("id").to_pylist()) == ["a", "c"] and results.schema.field("token_ids").type == pa.list_(pa.int64())
    assert [e["id"] for e in errors] == ["b"] and "no chat template" in errors[0]["error"]
    assert all(1 <= n <= 5 for n in results.column("new_tokens").to_pylist())
