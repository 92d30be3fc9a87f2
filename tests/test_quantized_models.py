"""Models whose weights stay in blocks on a CPU (models/quant.py): a Q8_0 GGUF file and a safetensors model quantized
at load (`quantization`) decode transformers' greedy tokens on the same weights dequantized (fp32), hold no float
copy of their matrices, and refuse what they cannot do by name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.core.ngram import Lookup
from engine.core.speculate import Costs, Pace
from engine.kernels import cpu_build
from engine.kernels.cpu_gemv import MIXED, Q8X
from engine.models.presets import cached_model
from engine.models.quant import QEmbedding, QLinear
from tests.helpers import greedy, random_ids
from tests.test_gguf import copy_metadata, rounded, write

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(cpu_build.library() is None, reason="no CPU kernels here (x86 with AVX2 only)")


def reference(src: Path, prompt: list[int], kinds: dict[str, str], tokens: int = 12) -> list[int]:
    """transformers' greedy tokens with each matrix rounded through its block type (kinds: a name's part -> type)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next((k for part, k in kinds.items() if part in name), None)
            if p.ndim == 2 and kind:
                p.copy_(torch.from_numpy(rounded(p.numpy(), kind)))
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_a_q8_0_file_keeps_its_blocks_and_decodes_as_transformers(tmp_path):
    src = cached_model("tiny")
    file = write(src, tmp_path / "tiny-q8.gguf", "Q8_0")
    llm = LLM(model=str(file), max_batch_size=2, quantized_activations="float32")
    model = llm.engine.runner.model
    assert isinstance(model.embed, QEmbedding) and isinstance(model.layers[0].gate_up, QLinear)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held <= 1.25 * file.stat().st_size          # no float copy of the matrices
    prompt = random_ids(40, seed=5)
    want = reference(src, prompt, {"proj": "Q8_0", "embed": "Q8_0"})
    assert llm.generate(prompt, greedy(12))[0].token_ids == want
    by_default = LLM(model=str(file)).engine.runner.model          # int8, a second digit in outlier blocks
    assert by_default.layers[0].qkv.bits() == Q8X | MIXED and by_default.stack.dims.mode & MIXED
    dense = LLM(model=str(file), max_batch_size=1, quantized_activations="float32")   # dense KV: per-layer calls
    assert dense.generate(prompt, greedy(12))[0].token_ids == want


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2}])
def test_a_batch_past_eight_rows_decodes_as_its_sequences_alone(tmp_path, spec, monkeypatch):
    """12 sequences in one step (or 2 with 8 draft rows each) run the blocks' decode kernels in one call
    (kernels/cpu_gemv.py: BLOCK_ROWS), not a dequantized copy; every row gets what it gets alone, int8 and all.
    The prompt cache is off: the prompts' cached blocks would leave their last 8 tokens to a step of 16 rows, whose
    products round x as decode does, where alone those tokens took prefill's int16 products (models/quant.py)."""
    file = write(cached_model("tiny"), tmp_path / "tiny-q8.gguf", "Q8_0")
    llm = LLM(model=str(file), max_batch_size=12, speculative_config=spec, prompt_cache=False)
    runner = llm.engine.runner
    assert (runner.step_rows, runner.cheap_rows) == (32, 4) and runner.model.stack.max_rows == 32
    prompts = [random_ids(20, seed=s) * 2 for s in range(12 if spec is None else 2)]
    alone = [llm.generate(p, greedy(16))[0].token_ids for p in prompts]
    if spec:            # drafts of 8 that are the tokens to come, every row priced as cheap: steps of 18 rows
        truth = {tuple(p): a for p, a in zip(prompts, alone)}
        monkeypatch.setattr(Lookup, "propose", lambda lookup, prompt, out, k: truth[tuple(prompt)][len(out):][:k])
        monkeypatch.setattr(Pace, "rate", property(lambda pace: 1.0))
        llm.engine.spec.costs = Costs(32)
    widths, forward = [], runner.forward
    monkeypatch.setattr(runner, "forward", lambda rows, prev: widths.append(len(rows)) or forward(rows, prev))
    assert [o.token_ids for o in llm.generate(prompts, greedy(16))] == alone
    assert max(widths) > 8


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantization_at_load_decodes_as_transformers_on_the_rounded_weights(kind):
    src = cached_model("tiny")
    llm = LLM(model=str(src), quantization=kind, max_batch_size=2, quantized_activations="float32")
    assert isinstance(llm.engine.runner.model.layers[1].qkv, QLinear)
    prompt = random_ids(30, seed=6)
    want = reference(src, prompt, {"proj": kind.upper(), "embed": "Q8_0"})
    assert llm.generate(prompt, greedy(12))[0].token_ids == want


def test_what_quantization_cannot_do_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="quantization: must be one of none, q8_0, q4_0, got 'awq'"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantization: q8_0 quantizes a safetensors model"):
        EngineConfig(model="m.gguf", quantization="q8_0")
    with pytest.raises(ValueError, match="quantization: q4_0 computes in float32"):
        LLM(model=str(cached_model("tiny")), quantization="q4_0", dtype="bfloat16")


def test_a_tensor_type_the_kernels_do_not_read_is_refused_by_name(tmp_path):
    out = tmp_path / "iq.gguf"
    file = write(cached_model("tiny"), tmp_path / "src.gguf", "F32")
    reader = gguf.GGUFReader(str(file))
    w = gguf.GGUFWriter(str(out), "qwen2")
    copy_metadata(reader, w)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":      # bytes of Q5_1's size, named Q5_1
            qt = gguf.GGMLQuantizationType.Q5_1
            w.add_tensor(t.name, gguf.quantize(np.asarray(t.data, dtype=np.float32), qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"model: tensor blk.0.ffn_up.weight is Q5_1, which is not supported "
                                         r"\(supported: F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K\)"):
        LLM(model=str(out))


def test_vllm_backends_quantization_argument():
    from engine.frontends.vllm_args import engine_values
    assert engine_values({"quantization": "q8_0"}) == {"quantization": "q8_0"}
    assert engine_values({"quantization": "gguf"}) == {} and engine_values({"quantization": None}) == {}


def test_a_gguf_file_brings_its_chat_template_or_takes_a_directorys_tokenizer(tmp_path):
    """The file's tokenizer.chat_template serves chat; vLLM's `tokenizer` takes a directory's tokenizer and template
    instead of the file's."""
    import json
    src = cached_model("tiny")
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    bare, with_template = write(src, tmp_path / "a.gguf", "Q8_0"), write(src, tmp_path / "b.gguf", "Q8_0", template)
    assert template and LLM(model=str(bare)).engine.tokenizer.chat_template is None
    assert LLM(model=str(with_template)).engine.tokenizer.chat_template == template
    assert LLM(model=str(bare), tokenizer=str(src)).engine.tokenizer.chat_template == template
