"""The cache directory's JSON tables (measured costs, exact widths, backend choices): shared by processes
that measure at the same time (test workers, server replicas), so every write must leave a whole table."""

import json
import multiprocessing

from verispec.paths import cache_dir, read_table, store_in_table


def _store_many(folder: str, worker: int) -> None:
    import os

    os.environ["VERISPEC_CACHE"] = folder
    for i in range(40):
        store_in_table("costs.json", f"w{worker}-{i}", [float(i)] * 50)


def test_processes_writing_at_once_leave_a_whole_table_and_keep_what_they_wrote_last(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    workers = [multiprocessing.get_context("spawn").Process(target=_store_many, args=(str(tmp_path), w)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    table = json.loads((tmp_path / "costs.json").read_text())  # a torn write would not parse
    assert all(worker.exitcode == 0 for worker in workers)
    assert {f"w{w}-39" for w in range(4)} <= set(table)  # each process's last entry survives the others' writes
    assert {path.name for path in tmp_path.glob(".costs.json.*")} == {".costs.json.lock"}  # no partial file left behind


def test_a_missing_or_unreadable_table_reads_as_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert read_table("costs.json") == {}
    (cache_dir() / "costs.json").write_text('{"a": 1}\n}')  # what a torn write used to leave
    assert read_table("costs.json") == {}
    store_in_table("costs.json", "b", 2)
    assert read_table("costs.json") == {"b": 2}
