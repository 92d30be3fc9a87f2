"""Load a Hugging Face directory (single or sharded safetensors) of any supported family into the torch decoder."""
from __future__ import annotations

import ctypes
import gc
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.kernels import cpu_quant
from engine.models import gguf_file, hugepages, quant
from engine.models.config import ModelConfig
from engine.models.decoder import Decoder
from engine.models.quant import Blocks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_RENAME = {"self_attn.o_proj.weight": "o_proj.weight", "self_attn.o_proj.bias": "o_proj.bias",
           "mlp.down_proj.weight": "down.weight", "mlp.down_proj.bias": "down.bias",
           "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
           "input_layernorm.weight": "input_norm.weight", "post_attention_layernorm.weight": "post_norm.weight"}
# Gemma's four norms: its post_attention_layernorm normalises the attention's output, the MLP's input norm is
# pre_feedforward_layernorm
_GEMMA = {**_RENAME, "post_attention_layernorm.weight": "attn_out_norm.weight",
          "pre_feedforward_layernorm.weight": "post_norm.weight",
          "post_feedforward_layernorm.weight": "mlp_out_norm.weight"}
_FUSED = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
          "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1)}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    return DTYPES[name]


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors in {path}")
    return files


def safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A Hugging Face directory's tensors, by their names there."""
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_state(path: Path, dtype: torch.dtype, gemma: bool = False,
               tensors: Iterable[tuple[str, torch.Tensor | Blocks]] | None = None) -> dict:
    """Our parameter names from the checkpoint's (`tensors`: Hugging Face names and tensors or Blocks; by default
    the directory's safetensors), with q/k/v and gate/up fused (into a list of Blocks where a part is blocks)."""
    rename = _GEMMA if gemma else _RENAME
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in safetensors(path) if tensors is None else tensors:
        if not isinstance(tensor, Blocks):
            tensor = tensor.to(dtype)
        if name == "model.embed_tokens.weight":
            state["embed.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            state["lm_head.weight"] = tensor
        elif m := _LAYER.fullmatch(name):
            layer, rest = m.groups()
            stem, _, kind = rest.rpartition(".")
            if stem in _FUSED:
                target, slot = _FUSED[stem]
                parts.setdefault(f"layers.{layer}.{target}.{kind}", {})[slot] = tensor
            elif rest in rename:
                state[f"layers.{layer}.{rename[rest]}"] = tensor
    for name, pieces in parts.items():
        ordered = [pieces[i] for i in sorted(pieces)]
        if any(isinstance(p, Blocks) for p in ordered):
            state[name] = [p if isinstance(p, Blocks) else Blocks.of(p) for p in ordered]
        else:
            state[name] = torch.cat(ordered, dim=0)
    return state


def load_model(path: str | Path, dtype: str = "auto", device: str = "cpu", quantization: str = "none",
               acts: str = "int8") -> Decoder:
    """The model at `path` (a directory or a .gguf file); `quantization` (q8_0 | q4_0) quantizes a directory's
    projections at load; `acts`: decode's x against blocks (quantized_activations: int8, int16, float32)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    kernel = cpu_quant.load() if device == "cpu" else None
    gguf = path.suffix == ".gguf"
    if quantization != "none":
        return _quantized(path, cfg, dtype, quantization, kernel, acts)
    # a quantized file on a CPU with the block kernels, or on a CUDA device (kernels/triton_quant.py), computes in
    # fp32 from its blocks; elsewhere (or asked for bf16 / fp16) it is dequantized into the model dtype
    blocks_run = kernel is not None or torch.device(device).type == "cuda"
    keep = gguf and blocks_run and dtype in ("auto", "float32") and gguf_file.quantized(path)
    torch_dtype = torch.float32 if keep else resolve_dtype(dtype, cfg)
    tensors = gguf_file.tensors(path, cfg, keep) if gguf else None
    # on a GPU x stays float (QLinear.int8 is the CPU kernels')
    model = _build(path, cfg, load_state(path, torch_dtype, cfg.gemma_norms, tensors), kernel, device,
                   acts if kernel is not None else "float32")
    if gguf:
        gguf_file.close()
    trim()
    return model


def trim() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps what loading freed: the file's parsed metadata, the
    tensors' copies before packing, about as much as the weights again)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc
        pass


def _quantized(path: Path, cfg: ModelConfig, dtype: str, kind: str, kernel, acts: str) -> Decoder:
    """A safetensors model with its projections quantized into `kind` blocks (the embedding and head in Q8_0)."""
    if kernel is None:
        raise ValueError(f"quantization: {kind} runs on the CPU block kernels, which are not available here (a CUDA "
                         "device, another CPU, or PAGODA_CPU_KERNELS=0)")
    if dtype not in ("auto", "float32"):
        raise ValueError(f"quantization: {kind} computes in float32, got dtype {dtype}")
    state = load_state(path, torch.float32, cfg.gemma_norms, quant.quantized(safetensors(path), kind))
    model = _build(path, cfg, state, kernel, "cpu", acts)
    trim()
    return model


def _build(path: Path, cfg: ModelConfig, state: dict, kernel, device: str, acts: str) -> Decoder:
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ValueError(f"model: {path} has untied embeddings but no lm_head.weight")
    with torch.device("meta"):
        model = Decoder(cfg)
    blocks = {name: state.pop(name) for name in [n for n, v in state.items() if not isinstance(v, torch.Tensor)]}
    model.load_state_dict(state, strict=False, assign=True)
    for name, parts in blocks.items():
        quant.install(model, name, parts if isinstance(parts, list) else [parts], kernel, acts)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"model: {path} lacks weights for {missing[:4]}")
    model = model.to(device).eval()
    hugepages.pack(model)                 # CPU only: decode streams the weights every token
    return model
