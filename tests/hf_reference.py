"""Hugging Face transformers on the embedded model's weights: the reference inflight's numerics
are held to, made once per machine.

transformers reads the GGUF itself (dequantizing every tensor in numpy: seconds on one machine,
minutes on another), so its fp32 weights are written once as a safetensors snapshot under
$INFLIGHT_CACHE/reference and read from there (a fraction of a second). The snapshot is keyed by
the GGUF file's contents and the transformers version, so another file or another transformers
makes a new one. What the reference computes from those weights (`cached`) is kept beside it,
keyed as well by torch's version and by everything the computation is given.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from inflight.model.loader import cache_dir, default_model_path


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@functools.cache
def snapshot_dir() -> Path:
    """Keyed by the GGUF's contents (not its path: each new virtual environment installs the
    same file anew) and transformers' version."""
    digest = hashlib.sha256()
    with default_model_path().open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return cache_dir() / "reference" / _key(digest.hexdigest(), transformers.__version__)


def _write_snapshot(target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's, tied again on load
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        tmp.rename(target)  # whole or not at all, should another run be writing it too
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


def reference_model() -> Any:
    """transformers' model of the embedded GGUF, fp32, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = snapshot_dir()
    if not (path / "config.json").is_file():
        _write_snapshot(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def cached(name: str, inputs: Any, compute: Callable[[], Any]) -> Any:
    """`compute()`, saved under the snapshot's key, torch's version and `inputs` (JSON-able:
    everything the computation depends on besides the weights), and read back afterwards."""
    path = snapshot_dir().with_name(snapshot_dir().name + "-results") / f"{name}-{_key(torch.__version__, inputs)}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    os.close(fd)
    torch.save(result, tmp)
    os.replace(tmp, path)
    return result


if __name__ == "__main__":
    reference_model()
    print(f"transformers reference: {snapshot_dir()}")
