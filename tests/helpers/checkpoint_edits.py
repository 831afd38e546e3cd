"""Edits of a copied test checkpoint: a JSON file or the single `model.safetensors`, changed in place by `fn`."""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file


def edit_json(path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def edit_tensors(d, fn) -> None:
    """`fn(tensors)` on the {name: tensor} dict of `d`/model.safetensors, then written back."""
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
