"""Files of a batch job: the input records, the output part files, and the ids already written.

Input: JSONL (one JSON object per line) or Parquet, one prompt per record with a unique `id`.
A line that is not a JSON object, or a record without an id, cannot be generated but must not be
lost either: it gets the id `line:N` (`row:N` in Parquet, N counting from 1) and becomes an error.
Duplicate ids are refused before any work starts, since results are matched to records by id.

Output directory:

    results/part-<run>-<n>.jsonl|parquet   one record per generated prompt
    errors/part-<run>-<n>.jsonl|parquet    one record per failed prompt: id, error, error_type, actor
    summary.json                           the last run's summary

Each part file is written whole, to a temporary name first and then renamed, so a job killed at
any moment leaves only complete files; a rerun reads the ids already in both folders and skips them.
Ids are written as strings.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from verispec.errors import VerispecError

__all__ = ["InputRecord", "read_input", "PartWriter", "written_ids", "IdCheck", "check_ids", "FORMATS"]

FORMATS = ("jsonl", "parquet")
KINDS = ("results", "errors")


@dataclass
class InputRecord:
    id: str
    record: dict | None  # None: unusable (see `problem`)
    problem: str | None = None


def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise VerispecError(f"cannot tell the format of {path}: name it *.jsonl (one JSON object per line) or *.parquet")


def _record_id(value) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return None
    return str(value)


def _from_object(obj, where: str) -> InputRecord:
    if not isinstance(obj, dict):
        return InputRecord(where, None, f"{where}: not a JSON object (got {type(obj).__name__}); each record is an object with an 'id'")
    record = {key: value for key, value in obj.items() if value is not None}  # null = not given (Parquet fills missing columns with nulls)
    record_id = _record_id(record.get("id"))
    if record_id is None:
        return InputRecord(where, None, f"{where}: the record has no usable 'id' (a non-empty string or an integer), got {obj.get('id')!r}")
    return InputRecord(record_id, record)


def read_input(path: str | Path) -> list[InputRecord]:
    """Every record of the input, in order; raises if the file is missing or ids repeat."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no input file at {path}: give a .jsonl or .parquet file with one prompt per record")
    records: list[InputRecord] = []
    if input_format(path) == "jsonl":
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as error:
                    records.append(InputRecord(f"line:{number}", None, f"line {number} is not valid JSON: {error}"))
                    continue
                records.append(_from_object(obj, f"line:{number}"))
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "id" not in table.column_names:
            raise VerispecError(f"{path} has no 'id' column (columns: {', '.join(table.column_names)}): add a unique id per record")
        records = [_from_object(row, f"row:{number}") for number, row in enumerate(table.to_pylist(), 1)]
    repeated = [record_id for record_id, count in Counter(r.id for r in records).items() if count > 1]
    if repeated:
        shown = ", ".join(repr(r) for r in repeated[:5]) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
        raise VerispecError(f"{path}: ids must be unique, but {shown} occur more than once: give every record its own id")
    return records


def _schema(kind: str):
    import pyarrow as pa

    if kind == "errors":
        return pa.schema([("id", pa.string()), ("error", pa.string()), ("error_type", pa.string()), ("actor", pa.string())])
    ints = ["prompt_tokens", "new_tokens", "steps", "proposed_tokens", "accepted_tokens", "judged_tokens"]
    floats = ["mean_accepted_length", "acceptance_rate", "draft_seconds", "target_seconds", "wall_seconds", "tokens_per_second"]
    return pa.schema([("id", pa.string()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())), ("finish_reason", pa.string()),
                      *[(name, pa.int64()) for name in ints], *[(name, pa.float64()) for name in floats],
                      ("per_position_acceptance", pa.list_(pa.float64())), ("actor", pa.string())])


class PartWriter:
    """Writes rows of one kind (results or errors) as whole part files of this run."""

    def __init__(self, out_dir: Path, kind: str, fmt: str, run_id: str | None = None):
        self.folder = Path(out_dir) / kind
        self.folder.mkdir(parents=True, exist_ok=True)
        self.kind, self.fmt = kind, fmt
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.parts = 0
        for leftover in self.folder.glob(".part-*.tmp"):  # a run killed while writing: that part was never renamed
            leftover.unlink()

    def write(self, rows: list[dict]) -> Path | None:
        if not rows:
            return None
        self.parts += 1
        final = self.folder / f"part-{self.run_id}-{self.parts:05d}.{self.fmt}"
        temporary = final.with_name(f".{final.name}.tmp")
        if self.fmt == "jsonl":
            with temporary.open("w", encoding="utf-8") as file:
                file.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                file.flush()
                os.fsync(file.fileno())
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = _schema(self.kind)
            pq.write_table(pa.Table.from_pylist([{name: row.get(name) for name in schema.names} for row in rows], schema=schema), temporary)
        os.replace(temporary, final)
        return final


def written_ids(out_dir: str | Path) -> dict[str, Counter]:
    """For results and errors: how many times each id was written, over every part file of every run."""
    found: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    for kind in KINDS:
        folder = Path(out_dir) / kind
        for part in sorted(folder.glob("part-*")) if folder.is_dir() else []:
            if part.suffix == ".jsonl":
                with part.open(encoding="utf-8") as file:
                    found[kind].update(json.loads(line)["id"] for line in file if line.strip())
            elif part.suffix == ".parquet":
                import pyarrow.parquet as pq

                found[kind].update(pq.read_table(part, columns=["id"]).column("id").to_pylist())
    return found


@dataclass
class IdCheck:
    """Input ids against what the output directory holds."""

    inputs: int
    results: int
    errors: int
    missing: list[str] = field(default_factory=list)  # in the input, written nowhere
    duplicated: list[str] = field(default_factory=list)  # written more than once (results and errors together)
    unknown: list[str] = field(default_factory=list)  # written, but not in the input

    @property
    def complete(self) -> bool:
        return not (self.missing or self.duplicated or self.unknown)

    def describe(self) -> str:
        line = f"{self.inputs} input ids, {self.results} results + {self.errors} errors"
        if self.complete:
            return line + " = every input id exactly once"
        problems = [f"{len(ids)} {what} ({', '.join(ids[:5])}{' …' if len(ids) > 5 else ''})"
                    for what, ids in (("not written yet", self.missing), ("written more than once", self.duplicated),
                                      ("not in the input", self.unknown)) if ids]
        return line + ": " + "; ".join(problems)


def check_ids(input_ids: list[str], out_dir: str | Path) -> IdCheck:
    written = written_ids(out_dir)
    everything = written["results"] + written["errors"]
    wanted = set(input_ids)
    return IdCheck(
        inputs=len(wanted), results=len(written["results"]), errors=len(written["errors"]),
        missing=[i for i in input_ids if i not in everything],
        duplicated=sorted(i for i, n in everything.items() if n > 1),
        unknown=sorted(i for i in everything if i not in wanted),
    )
