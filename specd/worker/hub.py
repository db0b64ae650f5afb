"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face hub id.

`--target` and `--draft` take a model directory, a `.gguf` file, or `ORG/NAME`, optionally
`ORG/NAME@REVISION` (a branch, tag or commit; `--revision` for ids that name none).
A hub id is resolved by `huggingface_hub.snapshot_download` into the local cache
(`HF_HOME`), downloading what is missing unless `HF_HUB_OFFLINE=1`, in which case only
the cache is read. A gated model's token comes from `HF_TOKEN`, as huggingface_hub reads
it. The model is then loaded from the snapshot directory, so the weights digest and the
tokenizer fingerprint are computed exactly as for a local directory.

A GGUF file (llama.cpp's and Ollama's format) is converted once into a model directory in
specd's cache (`$SPECD_CACHE`, else ~/.cache/specd), keyed by the file's sha256: transformers
reads it (its `gguf` support, which needs the `gguf` package), dequantizes every tensor to
float32, which holds a 4- to 8-bit quantized value exactly, and saves the weights, the
tokenizer and the chat template the file carries. The workers then load that directory
in their serving dtype like any other, so every path (the lean forward, the tokenizer
sent to the gateway, `specd bench`) is the one a directory takes.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
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


def is_gguf(spec: str | Path) -> bool:
    return str(spec).endswith(".gguf")


def model_name(spec: str) -> str:
    """The name a model goes by when none is given: its directory's name, a GGUF file's name
    without `.gguf`, or NAME of ORG/NAME."""
    if is_gguf(spec):
        return Path(spec).name.removesuffix(".gguf")
    return Path(spec.partition("@")[0] if is_hub_id(spec) else spec).name


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd")


def from_gguf(path: Path) -> Path:
    """The model directory converted from a GGUF file (see the module doc), made at the first
    call and found in the cache after; ModelNotFound when transformers cannot read it."""
    if not path.is_file():
        raise ModelNotFound(f"{path}: no such GGUF file")
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    # The directory is named after the file, so the model goes by that name as a directory would.
    converted = cache_root() / "gguf" / digest.hexdigest()[:16] / model_name(str(path))
    if (converted / "config.json").is_file():
        return converted
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (ImportError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelNotFound(f"{path}: transformers cannot load this GGUF file ({exc}); it reads the "
                            f"architectures its GGUF support lists, with the `gguf` package installed") from exc
    # Dequantized at load: what is saved is plain float32, not a quantized checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    converted.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=converted.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(converted)  # whole or absent: a worker reading the cache never sees half of it
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (converted / "config.json").is_file():  # not another process's conversion winning the race
            raise
    return converted


def resolve(spec: str | Path, revision: str = "") -> Path:
    """The local model directory of `spec` (a directory, or a hub id; see the module doc)."""
    text = str(spec)
    if is_gguf(text):
        return from_gguf(Path(text))
    if not is_hub_id(text):
        path = Path(text)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a model directory (no config.json), a .gguf file, nor a hub id "
                                f"ORG/NAME")
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
