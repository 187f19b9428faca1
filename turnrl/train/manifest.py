"""Checksums of a checkpoint's files, written with it and checked before it is loaded.

`save_checkpoint` writes `manifest.json` (the size and sha256 of every file of the checkpoint) into the
temporary directory before the rename, so a checkpoint and its manifest appear together. Loading first
re-hashes the files it needs (streamed in 1 MiB chunks: about a second per GB on one core) and compares.
A truncated, zeroed, missing or altered file, one that cannot be read, or one that fails to load is a
`CheckpointError`: it names the file, says what is wrong, and names the previous checkpoint of the run to
resume from. A flipped bit inside a tensor is invisible to safetensors and `torch.load` (the data parses);
only the checksum catches it. Checkpoints saved before manifests existed load unverified, with a note.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from turnrl.config import ConfigError

MANIFEST = "manifest.json"
CHUNK = 1 << 20
_noted: set[Path] = set()


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as it is; the message says which file, why, and what to use instead.
    A `ConfigError`, so `turnrl` prints it without a traceback and exits 2."""


def digest(file: Path) -> tuple[int, str, bool]:
    """(size, sha256 hex, whether every byte is zero) of a file, read in chunks."""
    sha, size, zero = hashlib.sha256(), 0, True
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
            zero = zero and not chunk.strip(b"\0")
    return size, sha.hexdigest(), zero


def write_manifest(directory: Path) -> None:
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        size, sha, _ = digest(file)
        files[file.relative_to(directory).as_posix()] = {"size": size, "sha256": sha}
    with open(directory / MANIFEST, "w") as f:
        json.dump({"version": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """relative path -> {size, sha256}; None for a checkpoint saved before manifests."""
    file = directory / MANIFEST
    if not file.exists():
        return None
    with reading(directory, file):
        files = json.loads(file.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
        return files


def previous_checkpoint(directory: Path) -> Path | None:
    """The newest `step_N` directory beside `directory` with a smaller N."""
    own = _step(directory.name)
    if own is None:
        return None
    earlier = [(n, p) for p in directory.parent.glob("step_*")
               if p.is_dir() and (n := _step(p.name)) is not None and n < own]
    return max(earlier)[1] if earlier else None


def _step(name: str) -> int | None:
    match = re.fullmatch(r"step_(\d+)", name)
    return int(match.group(1)) if match else None


def broken(directory: Path, file: Path, what: str) -> CheckpointError:
    previous = previous_checkpoint(directory)
    if previous is not None:
        hint = (f"Resume from the previous checkpoint instead: trainer.resume={previous} "
                f"(for `turnrl eval`/`turnrl serve`: --checkpoint {previous}).")
    else:
        hint = (f"No earlier checkpoint is left in {directory.parent}: start the run again "
                "(a new output_dir, or trainer.overwrite=true).")
    return CheckpointError(f"checkpoint file {file} {what}. {hint}")


@contextmanager
def reading(directory: Path, file: Path) -> Iterator[None]:
    """Turn any failure to read or load `file` into a `CheckpointError` that names it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise broken(directory, file, f"cannot be read or loaded ({type(exc).__name__}: {exc})"[:600]) from exc


def verify(directory: Path, prefix: str = "") -> None:
    """Check every file of the manifest whose relative path starts with `prefix` (all by default)."""
    manifest = read_manifest(directory)
    if manifest is None:
        if directory not in _noted:
            _noted.add(directory)
            print(f"[turnrl] note: {directory} has no {MANIFEST} (saved before turnrl stored checksums); "
                  "loading it unverified", flush=True)
        return
    for rel, entry in sorted(manifest.items()):
        if not rel.startswith(prefix):
            continue
        file = directory / rel
        if not file.is_file():
            raise broken(directory, file, "is missing (the manifest lists it)")
        try:
            size, sha, zero = digest(file)
        except OSError as exc:
            raise broken(directory, file, f"cannot be read ({exc})") from exc
        if size != entry["size"]:
            raise broken(directory, file, f"has the wrong size: {size} bytes, the manifest says {entry['size']} "
                                          "(truncated or cut short)")
        if zero and size:
            raise broken(directory, file, f"is all zero bytes ({size} of them; zeroed on disk)")
        if sha != entry["sha256"]:
            raise broken(directory, file, f"fails its checksum: sha256 {sha[:16]}..., the manifest says "
                                          f"{entry['sha256'][:16]}... (the file changed after it was saved)")
