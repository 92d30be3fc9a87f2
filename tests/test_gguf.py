"""GGUF files (engine/models/gguf_file.py), written here from presets as llama.cpp's convert_hf_to_gguf.py writes
them (its tensor names, its q/k row order for the `llama` architecture, Llama 3's RoPE scaling as `rope_freqs`),
load into transformers' greedy tokens on the original directory (fp32); a file of an architecture the decoder does
not cover is refused by name before a tensor is read."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from engine.models.config import ModelConfig
from engine.models.decoder import inv_freq
from engine.models.presets import cached_model
from tests.helpers import greedy, random_ids

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

_HF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
       "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
       "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
       "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    stem, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_HF[stem]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k rows for GGML's RoPE: within each head, (2, pairs) becomes (pairs, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(src: Path, out: Path, quant: str = "F32", template: str | None = None) -> Path:
    """The preset directory `src` as a GGUF file; 2-D weights in `quant` (F32, F16 or Q8_0); with `template`, the
    chat template llama.cpp's converter copies from tokenizer_config.json."""
    from safetensors.numpy import load_file
    data = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dir(src)
    arch = data["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    spec = cfg.rope["full_attention"]
    w.add_rope_freq_base(spec.theta)
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7}[quant])
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch != "llama" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if data.get("bos_token_id") is not None:
        w.add_bos_token_id(data["bos_token_id"])
    eos = data["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if template is not None:
        w.add_chat_template(template)
    if spec.kind == "llama3":                  # as llama.cpp: the scaling as divisors of the default frequencies
        plain = inv_freq(type(spec)(spec.theta), cfg.head_dim)
        w.add_tensor("rope_freqs.weight", (plain / inv_freq(spec, cfg.head_dim)).numpy().astype(np.float32))
    for name, array in load_file(str(src / "model.safetensors")).items():
        array = array.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = permute(array, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if array.ndim == 2 and quant == "F16":
            array = array.astype(np.float16)
        elif array.ndim == 2 and quant == "Q8_0":
            kind = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quantize(array, kind), raw_dtype=kind)
            continue
        w.add_tensor(gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def copy_metadata(reader, writer) -> None:
    """A qwen2 file's geometry, tokenizer and file type from gguf-py's reader into a writer (to rewrite tensors)."""
    for field in reader.fields.values():
        if field.name.startswith(("qwen2.", "tokenizer.", "general.file_type")):
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1]
                                 if field.types[0] == gguf.GGUFValueType.ARRAY else None)


def rounded(array: np.ndarray, quant: str) -> np.ndarray:
    if quant == "F16":
        return array.astype(np.float16).astype(np.float32)
    kind = gguf.GGMLQuantizationType[quant]
    return gguf.dequantize(gguf.quantize(array, kind), kind).reshape(array.shape)


def llama(tmp_path: Path) -> Path:
    """The tiny preset as a Llama (q/k/v biases unused) with Llama 3's RoPE scaling: a small vocabulary."""
    import shutil
    src = tmp_path / "tiny-llama-small"
    shutil.copytree(cached_model("tiny"), src)
    data = json.loads((src / "config.json").read_text())
    data.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
                rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                       high_freq_factor=4.0, original_max_position_embeddings=256))
    (src / "config.json").write_text(json.dumps(data))
    return src


@pytest.mark.parametrize("preset,quant,acts", [("llama", "F32", "float32"), ("tiny", "F16", "float32"),
                                               ("tiny", "Q8_0", "float32"), ("tiny", "Q8_0", "int16")])
def test_a_gguf_file_decodes_as_transformers_on_its_source(preset, quant, acts, tmp_path):
    """float32: x in fp32 against the blocks; int16: x as two int8 digits (prefill in fp32)."""
    src = llama(tmp_path) if preset == "llama" else cached_model(preset)
    file = write(src, tmp_path / f"{preset}.gguf", quant)
    prompt = random_ids(40, seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():        # the source's matrices as the file holds them (gguf-py's own round trip)
        for p in model.parameters():
            if p.ndim == 2 and quant != "F32":
                p.copy_(torch.from_numpy(rounded(p.numpy(), quant)))
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    got = LLM(model=str(file), dtype="float32", quantized_activations=acts).generate(prompt, greedy(12))
    got = got[0].token_ids
    assert got == want[0, len(prompt):].tolist()


def test_an_architecture_the_decoder_does_not_cover_is_refused_by_name(tmp_path):
    out = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(out), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="model: GGUF architecture 'phi3' is not supported"):
        LLM(model=str(out))
