"""Which model a worker holds: a digest of its weights, computed once at load.

The gateway validates each worker's models at start-up (name, weights digest,
tokenizer fingerprint) and names that identity on every stream it opens; a worker
holding another model refuses it (docs/design.md §10). No gRPC here.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

# Weight files in the formats transformers saves; safetensors when present (a directory
# may also keep a .bin copy that is never loaded).
_WEIGHT_PATTERNS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth"))
_CHUNK = 16 * 1024 * 1024


def weight_files(model_dir: Path) -> list[Path]:
    """The model's weight files, in name order: safetensors if any, else pickled ones."""
    for patterns in _WEIGHT_PATTERNS:
        files = sorted({f for pattern in patterns for f in Path(model_dir).glob(pattern) if f.is_file()})
        if files:
            return files
    return []


def weights_digest(model_dir: Path) -> str:
    """sha256 over the weight files: each file's name, a NUL, its size, then its bytes.

    Reads every byte once (about a second per GB, from the page cache the load just
    filled), so two directories with the same weights agree and any changed weight
    shows. A directory without weight files gets the digest of nothing.
    """
    digest = hashlib.sha256()
    for path in weight_files(model_dir):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as weights:
            while chunk := weights.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
