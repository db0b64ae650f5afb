"""Where a model comes from: a local directory, or a Hugging Face hub id.

`--target` and `--draft` take a model directory as before, or `ORG/NAME`, optionally
`ORG/NAME@REVISION` (a branch, tag or commit; `--revision` for ids that name none).
A hub id is resolved by `huggingface_hub.snapshot_download` into the local cache
(`HF_HOME`), downloading what is missing unless `HF_HUB_OFFLINE=1`, in which case only
the cache is read. A gated model's token comes from `HF_TOKEN`, as huggingface_hub reads
it. The model is then loaded from the snapshot directory, so the weights digest and the
tokenizer fingerprint are computed exactly as for a local directory.
"""
from __future__ import annotations

import re
from pathlib import Path

# What a repository id looks like (huggingface_hub's rule, without the 96-character cap).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# The files a causal LM and its tokenizer need; not the duplicate .bin/.pth weights, the
# ONNX exports or the GGUF files many repositories also carry.
_WANTED = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]


class ModelNotFound(FileNotFoundError):
    """Neither a model directory nor a hub id that resolves; the message says what to check."""


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as ORG/NAME[@REVISION] and is not an existing path."""
    return not Path(spec).exists() and _HUB_ID.fullmatch(spec.partition("@")[0]) is not None


def model_name(spec: str) -> str:
    """The name a model goes by when none is given: its directory's name, or NAME of ORG/NAME."""
    return Path(spec.partition("@")[0] if is_hub_id(spec) else spec).name


def resolve(spec: str | Path, revision: str = "") -> Path:
    """The local model directory of `spec` (a directory, or a hub id; see the module doc)."""
    text = str(spec)
    if not is_hub_id(text):
        path = Path(text)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a model directory (no config.json), nor a hub id ORG/NAME")
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, pinned = text.partition("@")
    wanted = pinned or revision or None
    try:
        return Path(snapshot_download(repo, revision=wanted, allow_patterns=_WANTED))
    except LocalEntryNotFoundError as exc:
        where = f"the cache {constants.HF_HUB_CACHE}"
        how = ("HF_HUB_OFFLINE=1 is set, so nothing is downloaded: fill the cache first "
               f"(`hf download {repo}`) or unset it" if constants.HF_HUB_OFFLINE
               else "and the hub could not be reached")
        raise ModelNotFound(f"{text}: revision {wanted or 'main'} is not in {where}; {how}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"{text}: the hub did not give revision {wanted or 'main'}: {exc} (a gated or private "
                            f"model needs HF_TOKEN)") from exc
