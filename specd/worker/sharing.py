"""A draft that shares its target's weights: made by `specd distill` from the target alone.

A narrow model's token embedding and its tied output layer are most of a small draft
(SmolLM2-135M: 49,152 × 576, 28M weights, against 3.5M a layer). Such a draft keeps
only its own decoder layers and final norm on disk; the embedding is read from the
target's own weights when the draft loads, and the folder's manifest (`MANIFEST`) names
the tensors it takes and their digest, so a draft never loads beside a target it was not
made for.

Its output layer scores a part of the vocabulary only (`SubsetHead`): the tokens the
target emits most, scored by their rows of the shared embedding (FR-Spec; EAGLE-3's draft
vocabulary). Every other token gets a logit far below any real one, so its probability
as a proposal is 0. Rejection sampling is exact for any draft distribution, and the
target still emits those tokens itself (as a correction or bonus); the draft just never
proposes them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

MANIFEST = "specd_draft.json"
# Below any real logit and finite: a token out of the draft's vocabulary has probability
# 0 after a softmax, yet a row whose every in-vocabulary token a grammar masked (-inf)
# still softmaxes to a distribution, over the tokens the grammar allows.
OUT_OF_VOCABULARY = -1.0e4


class SubsetHead(nn.Module):
    """An output layer over `ids` (a part of a `vocab_size` vocabulary) whose logits cover
    the whole vocabulary: `OUT_OF_VOCABULARY` outside `ids`. `linear` holds the rows of
    `ids` only (an `nn.Linear`, so that it is packed on a CPU like any other); training
    reads its scores directly, over the part alone."""

    ids: torch.Tensor

    def __init__(self, rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(rows)
        self.register_buffer("ids", ids.to(device=rows.device, dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.linear(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), OUT_OF_VOCABULARY)
        return logits.index_copy_(-1, self.ids, scores)


def is_shared_draft(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def read_tensors(model_dir: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `names` (None: all) from a model directory's safetensors files, in float32."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for name in weights.keys() if names is None else set(names) & set(weights.keys()):
                found[name] = weights.get_tensor(name).float()
    missing = [name for name in names or [] if name not in found]
    if missing:
        raise ValueError(f"{model_dir} has no tensor {missing[0]} in its safetensors files")
    return found


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name and float32 bytes, in name order."""
    hashed = hashlib.sha256()
    for name in sorted(tensors):
        hashed.update(name.encode() + b"\0")
        hashed.update(tensors[name].float().contiguous().numpy().tobytes())
    return hashed.hexdigest()


def _vocabulary_head(model: Any, ids: list[int]) -> None:
    """Give `model` a `SubsetHead` over `ids`, its rows from the (shared) embedding."""
    embedding = model.get_input_embeddings().weight
    index = torch.tensor(ids, dtype=torch.long, device=embedding.device)
    model.lm_head = SubsetHead(embedding.detach()[index], index, int(model.config.vocab_size))  # indexing copies


def load(path: Path, dtype: torch.dtype, base: Path | None) -> Any:
    """The draft in `path` (a directory `save` wrote), its shared tensors read from `base`
    (its target's model directory) and checked against the manifest's digest."""
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = json.loads((path / MANIFEST).read_text())
    names = manifest["shared"]
    if base is None:
        raise ValueError(f"{path} is a draft that shares {', '.join(names)} with its target "
                         f"({manifest['target']}): give the draft worker --draft-base TARGET (specd serve "
                         f"passes its --target)")
    shared = read_tensors(base, names)
    found = digest(shared)
    if found != manifest["digest"]:
        raise ValueError(f"{base} is not the target the draft {path} was made for ({manifest['target']}): "
                         f"its {', '.join(names)} digest {found[:12]}, the draft's {manifest['digest'][:12]}. "
                         f"Serve the draft with its own target, or make one for this target with specd distill")
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = read_tensors(path)
    missing, unexpected = model.load_state_dict({**own, **shared}, strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]  # the head is made from the embedding
    if missing or unexpected:
        raise ValueError(f"{path}: the draft's weights do not fit its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    _vocabulary_head(model, manifest["vocabulary"])
    return model.to(dtype).eval()


def build(target: Any, layers: list[int], vocabulary: list[int]) -> Any:
    """A new draft from `target` (a float32 transformers causal LM with tied embeddings):
    its decoder layers `layers`, copied, its final norm, its embedding (shared, frozen) and
    a `SubsetHead` over `vocabulary`. The draft then learns to agree with the target
    (`specd distill`); only its layers and norm train."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = target.state_dict()
    own = {}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        own.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in state.items() if k.startswith(prefix)})
    own["model.norm.weight"] = state["model.norm.weight"]
    own["model.embed_tokens.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = draft.load_state_dict(own, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    _vocabulary_head(draft, vocabulary)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.lm_head.linear.weight.requires_grad_(False)
    return draft


def save(draft: Any, out: Path, target_dir: Path, target_name: str, dtype: torch.dtype) -> None:
    """Write `draft` (from `build`) to `out`: its config, its own tensors in `dtype`, and the
    manifest naming the embedding it shares with the target in `target_dir` and its
    vocabulary. The tokenizer files are the caller's."""
    from safetensors.torch import save_file

    shared = ["model.embed_tokens.weight"]
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(dtype).contiguous() for name, tensor in draft.state_dict().items()
             if name not in shared and not name.startswith("lm_head.")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    draft.config.dtype = dtype
    draft.config.save_pretrained(out)
    manifest = {"target": target_name, "shared": shared, "digest": digest(read_tensors(target_dir, shared)),
                "vocabulary": draft.lm_head.ids.tolist()}
    (out / MANIFEST).write_text(json.dumps(manifest))
