"""Checkpoints that survive a crash while they are written, for restarts (torchrun ``--max-restarts``).

``CheckpointDir(path).save(step, obj)`` writes ``ckpt-<step>.pt`` atomically: into a temporary file
in the same directory, fsync'd, renamed over the final name, the directory fsync'd. A crash at any
moment leaves the previous checkpoints as they were and at worst a stray temporary file (removed by
the next save). The file ends with a trailer (a magic tag and the SHA-256 of the payload), so a
truncated or corrupted file is told apart from a good one before ``torch.load`` sees it. The newest
``keep`` checkpoints are kept, so there is one to fall back to.

``load_latest()`` returns the newest good checkpoint, loaded with ``torch.load(weights_only=True)``;
a bad one gives a warning naming the file and why, and the previous one is tried. If checkpoints exist
but none is readable, it raises (starting over silently would throw the training away).
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from typing import Any, List, Optional, Tuple

import torch

MAGIC = b"OSPCKPT1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that cannot be read back (truncated, corrupted or not a checkpoint)."""


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (temporary file, fsync, rename, fsync of the directory),
    with osp's integrity trailer."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getvalue()
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.write(MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str, map_location="cpu", weights_only: bool = True) -> Any:
    """Read a file written by ``save_atomic``; ``CorruptCheckpoint`` naming the file if it is not whole.
    ``weights_only=False`` unpickles any object (only for files this job wrote itself: osp.horovod.elastic's
    commits hold the user's own values)."""
    with open(path, "rb") as f:
        data = f.read()
    tail = len(MAGIC) + 32
    if len(data) < tail or data[-tail:-32] != MAGIC:
        raise CorruptCheckpoint(f"osp: checkpoint {path} is truncated or not an osp checkpoint "
                                f"({len(data)} bytes, no end marker)")
    payload = data[:-tail]
    if hashlib.sha256(payload).digest() != data[-32:]:
        raise CorruptCheckpoint(f"osp: checkpoint {path} is corrupted (its SHA-256 does not match the one "
                                "written with it)")
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
    except Exception as e:
        raise CorruptCheckpoint(f"osp: checkpoint {path} cannot be loaded: {e}") from e


class CheckpointDir:
    """Numbered checkpoints in one directory (see the module docstring)."""

    def __init__(self, path: str, keep: int = 2):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise ValueError(f"osp: CheckpointDir(keep) must be an integer >= 2 (one to fall back to), got {keep!r}")
        self.path, self.keep = path, keep
        os.makedirs(path, exist_ok=True)

    def files(self) -> List[Tuple[int, str]]:
        """(step, path) of the checkpoints here, newest first."""
        out = []
        for name in os.listdir(self.path):
            m = _NAME.match(name)
            if m:
                out.append((int(m.group(1)), os.path.join(self.path, name)))
        return sorted(out, reverse=True)

    def save(self, step: int, obj: Any) -> str:
        path = os.path.join(self.path, f"ckpt-{step:09d}.pt")
        for name in os.listdir(self.path):  # temporary files of a writer that crashed
            if name.startswith(".ckpt-") and ".tmp" in name:
                os.unlink(os.path.join(self.path, name))
        save_atomic(obj, path)
        for _, old in self.files()[self.keep:]:
            os.unlink(old)
        return path

    def load_latest(self, map_location="cpu", weights_only: bool = True) -> Optional[Tuple[int, str, Any]]:
        """(step, path, object) of the newest readable checkpoint; None if there is none at all."""
        files = self.files()
        bad = []
        for step, path in files:
            try:
                return step, path, load(path, map_location, weights_only)
            except CorruptCheckpoint as e:
                bad.append(path)
                warnings.warn(f"{e}; falling back to the previous checkpoint", RuntimeWarning, stacklevel=2)
        if bad:
            raise CorruptCheckpoint(f"osp: no readable checkpoint in {self.path}: {', '.join(bad)} are all "
                                    "damaged. Remove them to start from scratch")
        return None
