"""A single .gguf file (llama.cpp's, ollama's) as the model: geometry, tokenizer and chat template from its metadata,
weights from its tensors.

The geometry comes from llama.cpp's metadata keys, completed with the family's config defaults by transformers; the
tokenizer is transformers' conversion of `tokenizer.ggml.*` into a `tokenizers` tokenizer. The metadata is read with
transformers' GGUF reader (memory-mapped, long string arrays skipped), and so is the tensor table; the tensors are
views of the file's mapping, dequantized (where they are) by llama.cpp's own `gguf` package, and renamed to the Hugging
Face names the loader maps. Two of llama.cpp's conversions are
undone, as transformers undoes them: the `llama` architecture's q/k rows were permuted for GGML's RoPE, and Gemma's
norm weights were stored as 1 + w. Llama 3's RoPE scaling, stored as the `rope_freqs` tensor, is applied as
llama.cpp applies it (transformers' loader drops it).

Block-quantized tensors stay in their blocks where the CPU kernels read them (models/quant.py), else they are
dequantized at load (`gguf.dequantize`). A tensor of any other type is refused by name before any weight loads.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.kernels import cpu_quant
from engine.models.quant import Blocks

ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")     # general.architecture values the decoder covers
TYPES = tuple(cpu_quant.TYPES)                             # tensor types read (kept as blocks on a CPU)
_FLOATS = (0, 1, 30)                                       # ggml's F32, F16, BF16
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm"}
_GEMMA = {**_NAMES, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]                 # torch's order
    ggml_type: int
    offset: int                            # in the file
    nbytes: int


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def metadata(path: Path) -> tuple[dict, tuple[str, ...]]:
    """The file's metadata keys (long string arrays left as counts) and tensor names, no tensor read."""
    if not path.is_file():
        raise ValueError(f"model: {path} is not a file")
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        raise ValueError(f"model: {path} is a GGUF file, which needs transformers 5.24 or later and gguf (pip "
                         f"install 'pagoda-engine[gguf]')") from None
    return read_gguf_metadata(str(path))


def architecture(meta: dict) -> str:
    arch = meta.get("general.architecture", "")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    return arch


_MODEL_TYPES = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# llama.cpp's metadata keys (under the architecture's name) and the config.json keys they stand for
_KEYS = {"context_length": "max_position_embeddings", "embedding_length": "hidden_size",
         "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
         "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
         "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
         "rope.freq_base": "rope_theta", "attention.sliding_window": "sliding_window"}


def hf_config(path: str | Path) -> dict:
    """The checkpoint's config.json from the file's metadata, completed with transformers' defaults for the
    family (Gemma 3's local RoPE base and layer pattern, which llama.cpp does not store)."""
    path = Path(path)
    meta, names = metadata(path)
    arch = architecture(meta)                         # refused by name before anything else is read
    found = {hf: meta[f"{arch}.{key}"] for key, hf in _KEYS.items() if f"{arch}.{key}" in meta}
    model_type = _MODEL_TYPES[arch]
    if arch == "llama" and "sliding_window" in found:
        model_type = "mistral"
    tensors = {t.name: t for t in _table(path)}
    found["vocab_size"] = int(tensors["token_embd.weight"].shape[0])
    found["tie_word_embeddings"] = "output.weight" not in names
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if (value := meta.get(f"tokenizer.ggml.{key.replace('pad', 'padding')}")) is not None:
            found[key] = value
    from transformers import AutoConfig
    data = AutoConfig.for_model(model_type, **found).to_dict()
    data.pop("architectures", None)                   # named by its model_type (models/config.py)
    # dtype auto: the file's float type; a block-quantized file's compute type is bf16 (general.file_type: 0 all F32,
    # 1 mostly F16, 32 mostly BF16, the rest quantized)
    data["torch_dtype"] = {0: "float32", 1: "float16", 32: "bfloat16"}.get(meta.get("general.file_type", 0),
                                                                        "bfloat16")
    data.pop("dtype", None)
    # Llama 3's RoPE scaling travels as a tensor of per-frequency divisors, which transformers' reader drops
    if "rope_freqs.weight" in tensors:
        params = dict(data.get("rope_parameters") or {"rope_theta": data.get("rope_theta", 10_000.0)})
        divisors = np.asarray(_data(path, tensors["rope_freqs.weight"]).view(np.float32))
        params.update(rope_type="default", rope_freqs=[float(x) for x in divisors])
        data["rope_parameters"] = params
    return data


def tokenizer(path: str | Path):
    """(tokenizers.Tokenizer, tokenizer_config as a dict) from the file's tokenizer.ggml.* and chat template, as
    transformers converts them; BOS added to a raw prompt where the file says so (add_bos_token)."""
    from tokenizers import processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    arch, found, config = get_gguf_tokenizer(str(path))
    tok, _ = convert_gguf_tokenizer(arch, found)
    del found
    from engine.models.loader import trim
    trim()                                 # the vocabulary's and merges' Python lists (tens of MiB at 150k tokens)
    bos = config.get("bos_token")
    if config.get("add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok, config


@functools.lru_cache(maxsize=1)
def _table(path: Path) -> tuple[Tensor, ...]:
    """The file's tensor table (parsed by transformers' reader, sized by gguf-py's block table; no data read), every
    type checked against what the engine reads."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from transformers.integrations.gguf import reader
    blob = _mapped(path)
    meta, count, pos = reader._read_metadata(blob, str(path))
    entries, pos = reader._read_tensor_table(blob, count, pos)
    align = meta.get("general.alignment", 32)
    start = (pos + align - 1) // align * align
    table = []
    for name, shape, kind, offset in entries:
        known = kind in GGMLQuantizationType._value2member_map_
        if not known or GGMLQuantizationType(kind).name not in TYPES:
            kind_name = GGMLQuantizationType(kind).name if known else f"ggml type {kind}"
            raise ValueError(f"model: tensor {name} is {kind_name}, which is not supported (supported: "
                             f"{', '.join(TYPES)})")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        table.append(Tensor(name, shape, kind, start + offset, math.prod(shape) // block * size))
    return tuple(table)


@functools.lru_cache(maxsize=1)
def _mapped(path: Path) -> np.ndarray:
    return np.memmap(path, mode="r", dtype=np.uint8)


def _data(path: Path, t) -> np.ndarray:
    """A tensor's bytes, as a view of the file's mapping."""
    return _mapped(path)[t.offset:t.offset + t.nbytes]


def quantized(path: str | Path) -> bool:
    """Whether any tensor of the file is in blocks (not F32, F16 or BF16)."""
    return any(t.ggml_type not in _FLOATS for t in _table(Path(path)))


def close() -> None:
    """Let go of the file's mapping (the loader has copied what it keeps)."""
    _table.cache_clear()
    _mapped.cache_clear()


def tensors(path: str | Path, cfg, keep: bool = False) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """The file's tensors under their Hugging Face names (`cfg`: its ModelConfig): float tensors, or with `keep` the
    block-quantized ones as Blocks."""
    from gguf import GGMLQuantizationType, dequantize
    path = Path(path)
    arch = architecture(metadata(path)[0])
    names = _GEMMA if arch == "gemma3" else _NAMES
    for t in _table(path):
        if t.name in _TOP:
            name, m = _TOP[t.name], None
        elif (m := _LAYER.fullmatch(t.name)) and m[2] in names:
            name = f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"
        else:
            continue                      # rope_freqs (read with the config) and the like
        shape, data = list(t.shape), _data(path, t)
        if keep and t.ggml_type not in _FLOATS:
            data = torch.from_numpy(np.array(data)).reshape(shape[0], -1)
            if arch == "llama" and m and m[2] in ("attn_q", "attn_k"):
                data = _unpermute(data, cfg.num_attention_heads if m[2] == "attn_q" else cfg.num_key_value_heads)
            yield name, Blocks(t.ggml_type, data, shape[-1])
            continue
        if t.ggml_type == GGMLQuantizationType.F32:
            array = data.view(np.float32)
        elif t.ggml_type == GGMLQuantizationType.F16:
            array = data.view(np.float16)
        elif t.ggml_type == GGMLQuantizationType.BF16:
            array = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:                             # blocks, dequantized
            array = dequantize(data, GGMLQuantizationType(t.ggml_type))
        weight = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        if arch == "llama" and m and m[2] in ("attn_q", "attn_k"):         # weights and biases
            weight = _unpermute(weight, cfg.num_attention_heads if m[2] == "attn_q" else cfg.num_key_value_heads)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            weight = weight - 1
        yield name, weight


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's q/k row order for GGML's RoPE: within each head, rows were (pairs, 2)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
