"""A model named the way vLLM names one: a local path, or a Hugging Face hub id looked up in the local cache and
fetched when this host may."""
from __future__ import annotations

from pathlib import Path

# what a Hugging Face checkpoint needs here: no PyTorch .bin weights, no ONNX or GGUF copies
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def resolve(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The directory `model` names; raises ValueError naming it when there is none."""
    if Path(model).exists():
        return model
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ValueError(f"model: {model!r} is not a directory (and huggingface_hub, which finds hub ids, is not "
                         f"installed)") from None
    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, allow_patterns=FILES,
                                 local_files_only=True)
    except Exception:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"model: {model!r} is neither a directory nor in the Hugging Face cache "
                             f"(HF_HUB_OFFLINE is set)") from None
    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, allow_patterns=FILES)
    except Exception as e:
        raise ValueError(f"model: {model!r} is neither a directory nor a Hugging Face model this host can "
                         f"fetch ({type(e).__name__})") from None
