"""vLLM engine arguments (vllm_backend's 1/model.json) onto EngineConfig, and the options they brought: the sampling
seed, max_logprobs, the device-memory share and a separate tokenizer."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine import Engine
from engine.frontends.vllm_args import engine_values
from engine.runners.torch.runner import TorchRunner

SAMPLE = {"model": "facebook/opt-125m", "gpu_memory_utilization": 0.1, "enforce_eager": True}   # vllm_backend's


def test_engine_arguments_map_onto_options(tiny_dir, caplog):
    args = {"model": tiny_dir, "gpu_memory_utilization": 0.1, "enforce_eager": True, "dtype": "half",
            "max_num_seqs": 8, "enable_prefix_caching": False, "max_num_batched_tokens": 256, "block_size": 16,
            "max_model_len": 128, "seed": 3, "served_model_name": ["qwen", "alias"], "num_gpu_blocks_override": 40,
            "max_logprobs": 5, "tokenizer": tiny_dir, "kv_cache_memory_bytes": 1 << 20, "tensor_parallel_size": 1,
            "quantization": None, "max_num_partial_prefills": 1, "disable_log_stats": True,
            "trust_remote_code": True}
    with caplog.at_level(logging.INFO, logger="pagoda"):
        values = engine_values(args)
    assert values == {"model": tiny_dir, "gpu_memory_utilization": 0.1, "cuda_graphs": "false", "dtype": "float16",
                      "max_batch_size": 8, "prompt_cache": False, "prefill_chunk": 256, "block_size": 16,
                      "max_model_len": 128, "sampling_seed": 3, "served_model_name": "qwen", "num_kv_blocks": 40,
                      "max_logprobs": 5, "tokenizer": tiny_dir, "kv_cache_bytes": 1 << 20}
    assert EngineConfig.from_strings(values).model_name == "qwen"
    said = [r.getMessage() for r in caplog.records if "no effect here" in r.getMessage()]
    assert said == ["pagoda: model.json: no effect here: disable_log_stats, max_num_partial_prefills, "
                    "trust_remote_code"]
    assert engine_values({"max_model_len": None, "enable_prefix_caching": None}) == {}     # null: derive, as vLLM
    events = engine_values({"kv_events_config": json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                            "endpoint": "tcp://*:5599", "topic": "kv"})})
    assert events == {"kv_events": True, "kv_events_endpoint": "tcp://*:5599", "kv_events_topic": "kv"}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert engine_values({"speculative_config": spec}) == {"speculative_config": spec}


@pytest.mark.parametrize("args,message", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 cannot be honoured here: one replica runs on one device"),
    ({"quantization": "awq"}, 'quantization="awq" cannot be honoured here'),
    ({"reasoning_parser": "qwen3"}, "reasoning_parser=\"qwen3\" cannot be honoured here: reasoning output is split"),
    ({"enable_lora": True}, "enable_lora=true cannot be honoured"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype="),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"colour": "blue"}, "'colour' is not a vLLM engine argument"),
])
def test_arguments_it_cannot_honour_fail_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        engine_values(args)


def test_a_hub_id_is_found_in_the_hugging_face_cache(tiny_dir, tmp_path, monkeypatch):
    """vLLM names models by hub id; one already in the local cache (or under download_dir) is served from there,
    under its id. vllm_backend's own sample names facebook/opt-125m, which this host has not got: the load fails
    naming the model."""
    from huggingface_hub import constants
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--pagoda-tests--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    values = engine_values({"model": "pagoda-tests/tiny", "download_dir": str(tmp_path)})
    assert values == {"model": str(repo / "snapshots" / commit), "served_model_name": "pagoda-tests/tiny"}
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert engine_values({"model": "pagoda-tests/tiny"})["model"] == str(repo / "snapshots" / commit)
    with pytest.raises(ValueError, match="model: 'facebook/opt-125m' is neither a directory nor in the Hugging "
                                         "Face cache"):
        engine_values(SAMPLE)


def test_model_json_overrides_config_pbtxt_and_env_overrides_both(tiny_dir, tmp_path, monkeypatch, caplog):
    from tests.test_triton_model import start_model
    (tmp_path / "llm" / "1").mkdir(parents=True)
    (tmp_path / "llm" / "1" / "model.json").write_text(json.dumps({"model": tiny_dir, "max_num_seqs": 2,
                                                                   "dtype": "float32", "disable_log_stats": True}))
    pbtxt = {"model": "", "max_batch_size": "4", "engine_process": "false", "num_threads": "1", "block_size": "16"}
    with caplog.at_level(logging.INFO, logger="pagoda"):
        _, model = start_model(monkeypatch, pbtxt, tmp_path / "llm")
    config = model.engine.config
    model.finalize()
    assert (config.model, config.max_batch_size, config.block_size, config.dtype) == (tiny_dir, 2, 16, "float32")
    assert "model.json overrides config.pbtxt's max_batch_size, model" in caplog.text
    monkeypatch.setenv("PAGODA_MAX_BATCH_SIZE", "3")
    _, model = start_model(monkeypatch, pbtxt, tmp_path / "llm")
    assert model.engine.config.max_batch_size == 3
    model.finalize()
    (tmp_path / "llm" / "1" / "model.json").write_text(json.dumps({"model": tiny_dir, "tensor_parallel_size": 4}))
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        start_model(monkeypatch, pbtxt, tmp_path / "llm")


def test_the_sampling_seed_seeds_requests_without_their_own(tiny_dir):
    """vLLM's engine seed: a fresh engine replays the same sampled output for an unseeded request."""
    def sampled(seed: int) -> list[int]:
        llm = LLM(model=tiny_dir, dtype="float32", sampling_seed=seed)
        return llm.generate("hi", SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))[0].token_ids
    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32", max_logprobs=2)
    with pytest.raises(ValueError, match=r"logprobs: 3 exceeds max_logprobs \(2\)"):
        llm.generate("hi", SamplingParams(max_tokens=2, logprobs=3))
    assert len(llm.generate("hi", SamplingParams(max_tokens=2, logprobs=2))[0].logprobs) == 2
    with pytest.raises(ValueError, match="max_logprobs: this server returns at most 20"):
        EngineConfig(max_logprobs=21)
    with pytest.raises(ValueError, match="gpu_memory_utilization: must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_gpu_memory_utilization_sizes_the_pool_from_the_runners_budget(tiny_dir, monkeypatch):
    """On CUDA the pool takes what the share leaves after the weights (the runner's kv_budget, checked on a GPU by
    perf/gpu_check.sh); on a CPU there is no budget and kv_cache_bytes bounds the pool as before."""
    config = dict(model=tiny_dir, dtype="float32", max_batch_size=2, block_size=16)
    plain = Engine(EngineConfig(**config)).pool.num_blocks
    assert Engine(EngineConfig(**config, gpu_memory_utilization=0.5)).pool.num_blocks == plain
    monkeypatch.setattr(TorchRunner, "kv_budget",
                        lambda self, share, tokens: int(share * 100) * 16 * self.bytes_per_token + 5)
    assert Engine(EngineConfig(**config, gpu_memory_utilization=0.5)).pool.num_blocks == 50
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.001 of the device leaves no room"):
        Engine(EngineConfig(**config, gpu_memory_utilization=0.001))
