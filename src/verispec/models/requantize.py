"""The tensors of a GGUF file that kquant cannot run, requantized once to Q4_K / Q6_K blocks and cached.

kquant's kernels take 256-weight super-blocks, so a tensor of another block type (the shipped 0.5B
draft keeps its 896-wide layers as Q5_0 and Q8_0: 896 is not a multiple of 256) has no kquant form.
`Requantized(path, tensors)` dequantizes each such tensor with the `gguf` package, pads every row with
zeros to whole super-blocks (896 → 1024 inputs; the kernels pad the activations to match, and zero
weights times zero activations add nothing) and quantizes it: the output head and the token embedding
to Q6_K, the rest to Q4_K. The result is another rounding of the same weights, so another model: fine
for a draft (speculation stays exact whatever the draft computes), and said wherever it is loaded. The
blocks are cached per file (`~/.cache/verispec/kquant/`), so the work runs once.

The quantizers are plain ones, not llama.cpp's searched scales: per 32 (Q4_K) or 16 (Q6_K) weights a
scale (and a min) that spans the values, the super-block's float16 scales the largest of them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from verispec.paths import cache_dir
from verispec.progress import status

__all__ = ["SUPER_BLOCK", "Requantized", "padded_width", "quantize_q4_k", "quantize_q6_k"]

SUPER_BLOCK = 256  # weights per Q4_K / Q6_K super-block
SIX_BIT_TENSORS = ("token_embd.weight", "output.weight")  # kept at 6 bits, as a Q4_K_M file keeps its head
VERSION = 1  # of the quantizers: a change makes new blocks (the cache's key)


def padded_width(width: int) -> int:
    """`width` rounded up to whole super-blocks."""
    return -(-width // SUPER_BLOCK) * SUPER_BLOCK


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros(np.broadcast_shapes(numerator.shape, denominator.shape),
                                                         np.float32), where=denominator > 0)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q4_K blocks uint8 [rows, K / 256 × 144]: per 32 weights
    w ≈ d·sc·q − dmin·m with q in 0…15 and 6-bit sc, m; d and dmin float16 per super-block."""
    rows, width = weights.shape
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-blocks, 32]
    low = np.minimum(x.min(-1), 0.0)  # [blocks, 8]: a min ≤ 0, as ggml's
    scale, minimum = (x.max(-1) - low) / 15.0, -low
    d, dmin = _half(scale.max(-1) / 63.0), _half(minimum.max(-1) / 63.0)  # [blocks]
    sc = np.clip(np.rint(_safe_divide(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_divide(minimum, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]  # [blocks, 8, 1]
    offset = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint(_safe_divide(x + offset, step)), 0, 15).astype(np.uint8)  # [blocks, 8, 32]
    blocks = np.empty((x.shape[0], 144), np.uint8)
    blocks[:, 0:2], blocks[:, 2:4] = d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)
    packed = blocks[:, 4:16]  # ggml's 12 bytes: low 6 bits of sc/m 0–3, with sc/m 4–7 split over the rest
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2g and 2g+1 share 32 bytes: low and high nibbles
    blocks[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return blocks.reshape(rows, width // SUPER_BLOCK * 144)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> Q6_K blocks uint8 [rows, K / 256 × 210]: per 16 weights
    w ≈ d·sc·(q − 32) with q in 0…63, an int8 sc, and d float16 per super-block."""
    rows, width = weights.shape
    x = weights.astype(np.float32).reshape(-1, 16, 16)  # [blocks, sub-blocks, 16]
    scale = np.abs(x).max(-1) / 31.0  # [blocks, 16]
    d = _half(scale.max(-1) / 127.0)  # [blocks]
    sc = np.clip(np.rint(_safe_divide(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_divide(x, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [blocks, halves, 128]
    blocks = np.empty((x.shape[0], 210), np.uint8)
    low = (q & 15).reshape(-1, 2, 2, 64)  # value 128h + 64s + i: low nibble s of byte 64h + i
    blocks[:, :128] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # value 128h + 32t + i: bits 2t, 2t+1 of byte 128 + 32h + i
    blocks[:, 128:192] = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks[:, 192:208] = sc.view(np.uint8)
    blocks[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, width // SUPER_BLOCK * 210)


CHUNK_ROWS = 4096  # rows requantized at a time (a 151,936-row head never exists in float32 whole)


def _requantize(data: np.ndarray, type_name: str, shape: tuple[int, ...], six_bit: bool) -> tuple[np.ndarray, str]:
    """A tensor's raw bytes (ggml type `type_name`, GGUF `shape`: inputs first) -> (blocks [rows, bytes], type)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    width, rows = shape[0], int(np.prod(shape[1:]))
    quantize, kind = (quantize_q6_k, "Q6_K") if six_bit else (quantize_q4_k, "Q4_K")
    raw = data.reshape(rows, -1)  # [rows, bytes of one row]
    pieces = []
    for begin in range(0, rows, CHUNK_ROWS):
        weights = dequantize(raw[begin : begin + CHUNK_ROWS], GGMLQuantizationType[type_name])  # [chunk, width]
        pieces.append(quantize(np.pad(weights, ((0, 0), (0, padded_width(width) - width)))))
    return np.concatenate(pieces), kind


def _cache_file(path: Path) -> Path:
    """Keyed by the file (size, time) and the quantizers' version (`VERSION`)."""
    stat = path.stat()
    return cache_dir() / "kquant" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{VERSION}.safetensors"


class Requantized:
    """GGUF name -> (type name, blocks uint8 [rows, bytes]) for the tensors `tensors` (name ->
    `gguf_weights.TensorInfo`) of the file at `path`, requantized as the module docstring says. The
    blocks are made once and stored in the cache; each is read from there when asked for."""

    def __init__(self, path: Path, tensors: dict):
        from safetensors import safe_open

        self.file = _cache_file(path)
        if self.file.exists():
            with safe_open(str(self.file), "pt") as stored:
                self.kinds = stored.metadata() or {}
        if not self.file.exists() or not set(self.kinds) >= set(tensors):
            self.kinds = _store(path, tensors, self.file)

    def __contains__(self, name: str) -> bool:
        return name in self.kinds

    def __getitem__(self, name: str) -> tuple[str, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(str(self.file), "pt") as stored:
            return self.kinds[name], stored.get_tensor(name)


def _store(path: Path, tensors: dict, file: Path) -> dict[str, str]:
    """Requantize `tensors` of `path` into `file`; GGUF name -> type name."""
    from safetensors.torch import save_file

    blocks, kinds = {}, {}
    with status(f"requantizing {len(tensors)} tensors of {path.name} to Q4_K/Q6_K for kquant (once; cached)"), open(path, "rb") as f:
        for name, info in tensors.items():
            f.seek(info.offset)
            data = np.frombuffer(f.read(info.nbytes), np.uint8)
            values, kinds[name] = _requantize(data, info.type_name, info.shape, name in SIX_BIT_TENSORS)
            blocks[name] = torch.from_numpy(values)
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_suffix(f".{os.getpid()}.partial")  # two processes at once: each writes its own, one wins
    save_file(blocks, str(partial), metadata=kinds)
    partial.replace(file)
    return kinds
