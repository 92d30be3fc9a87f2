"""vLLM engine arguments (vllm_backend's `1/model.json`) as EngineConfig values.

Each argument maps onto an option, or changes nothing here and is named in one log line, or asks for what this
server cannot do and fails the load, named, before any weight loads. A key that is no vLLM engine argument fails too,
as vLLM's EngineArgs(**model_json) fails on it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.models.hub import resolve

log = logging.getLogger("pagoda")

# vLLM argument -> EngineConfig option, the value as it is (null: the option's default, as vLLM's null is "derive")
SAME = {"max_model_len": "max_model_len", "max_num_seqs": "max_batch_size", "enable_prefix_caching": "prompt_cache",
        "block_size": "block_size", "max_num_batched_tokens": "prefill_chunk",
        "num_gpu_blocks_override": "num_kv_blocks", "kv_cache_memory_bytes": "kv_cache_bytes",
        "gpu_memory_utilization": "gpu_memory_utilization", "seed": "sampling_seed", "tokenizer": "tokenizer",
        "max_logprobs": "max_logprobs", "speculative_config": "speculative_config"}
DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}

# Arguments about how vLLM schedules, compiles, logs, loads or spreads work, which change no output here.
NO_EFFECT = frozenset({
    "disable_log_stats", "disable_log_requests", "enable_log_requests", "aggregate_engine_logging",
    "trust_remote_code", "tokenizer_mode", "hf_token", "code_revision", "tokenizer_revision", "config_format",
    "load_format", "safetensors_load_strategy", "model_loader_extra_config", "ignore_patterns", "use_tqdm_on_load",
    "pt_load_map_location", "max_parallel_loading_workers", "distributed_executor_backend",
    "disable_custom_all_reduce", "ray_workers_use_nsight", "swap_space", "cpu_offload_gb", "max_seq_len_to_capture",
    "cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "compilation_config",
    "enable_chunked_prefill", "max_num_partial_prefills", "max_long_partial_prefills",
    "long_prefill_token_threshold", "prefix_caching_hash_algo", "disable_cascade_attn", "disable_sliding_window",
    "async_scheduling", "num_lookahead_slots", "show_hidden_metrics_for_version", "otlp_traces_endpoint",
    "collect_detailed_traces", "enable_sleep_mode", "limit_mm_per_prompt", "mm_processor_kwargs",
    "mm_processor_cache_gb", "skip_mm_profiling", "disable_mm_preprocessor_cache", "guided_decoding_backend",
    "guided_decoding_disable_fallback", "guided_decoding_disable_any_whitespace",
    "guided_decoding_disable_additional_properties", "structured_outputs_config", "generation_config",
    "use_v2_block_manager", "worker_use_ray", "engine_use_ray", "disable_async_output_proc", "scheduler_delay_factor",
    "multi_step_stream_outputs", "num_scheduler_steps", "preemption_mode", "enable_expert_parallel",
    "calculate_kv_scales", "kv_sharing_fast_prefill", "disable_hybrid_kv_cache_manager", "worker_cls",
    "worker_extension_cls", "max_lora_rank", "max_loras", "max_cpu_loras", "fully_sharded_loras", "lora_dtype",
    "lora_extra_vocab_size", "logprobs_mode", "task", "runner", "convert",
})
# Arguments honoured only at the values that ask for nothing -> (those values, why any other is refused)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "tensor_parallel_size": ((1,), "one replica runs on one device; scale out with replicas behind vllm-router"),
    "pipeline_parallel_size": ((1,), "one replica runs on one device"),
    "data_parallel_size": ((1,), "one replica runs on one device; scale out with replicas behind vllm-router"),
    "kv_cache_dtype": (("auto",), "the KV cache holds the weights' dtype"),
    "enable_lora": ((False,), "LoRA adapters are not supported"),
    "rope_scaling": ((None, {}), "RoPE scaling overrides are not supported"),
    "rope_theta": ((None,), "RoPE overrides are not supported"),
    "hf_overrides": ((None, {}), "config overrides are not supported"),
    "override_generation_config": ((None, {}), "generation config overrides are not supported"),
    "reasoning_parser": ((None, ""), "reasoning output is split by the OpenAI server (--reasoning-parser), "
                         "not the Triton model"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "kv_transfer_config": ((None,), "KV transfer between engines is not supported"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served"),
    "enable_prompt_embeds": ((False,), "prompts are text or token ids"),
    "skip_tokenizer_init": ((False,), "the tokenizer is always loaded"),
}


def read(path: Path) -> dict[str, Any] | None:
    """model.json's arguments, or None when there is no such file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"model.json: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.json: must be a JSON object of vLLM engine arguments, got {type(data).__name__}")
    return data


def engine_values(args: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig values from vLLM engine arguments; raises ValueError naming an argument it cannot honour."""
    values: dict[str, Any] = {}
    idle: list[str] = []
    for key, value in args.items():
        if key in SAME:
            if value is not None:
                values[SAME[key]] = value
        elif key == "dtype":
            if value not in DTYPES:
                raise ValueError(f"model.json: dtype must be one of {', '.join(DTYPES)}, got {value!r}")
            values["dtype"] = DTYPES[value]
        elif key == "served_model_name":       # vLLM takes a list; its first name is the one metrics carry
            names = [value] if isinstance(value, str) else list(value or [])
            if names:
                values["served_model_name"] = names[0]
        elif key == "quantization":            # "gguf" names what a .gguf model is anyway
            if value not in (None, "gguf", "q8_0", "q4_0"):
                raise ValueError(f"model.json: quantization={json.dumps(value)} cannot be honoured here: weights "
                                 "are read as GGUF blocks (a .gguf model) or quantized at load to q8_0 or q4_0")
            if value not in (None, "gguf"):
                values["quantization"] = value
        elif key == "enforce_eager":            # vLLM's eager mode: no CUDA graphs
            if value:
                values["cuda_graphs"] = "false"
        elif key == "kv_events_config":
            values.update(_kv_events(value))
        elif key in NEUTRAL:
            allowed, why = NEUTRAL[key]
            if value not in allowed:
                raise ValueError(f"model.json: {key}={json.dumps(value)} cannot be honoured here: {why}")
        elif key in NO_EFFECT:
            idle.append(key)
        elif key not in ("model", "revision", "download_dir"):       # these three name the model
            raise ValueError(f"model.json: {key!r} is not a vLLM engine argument")
    if args.get("model"):
        model = str(args["model"])
        values["model"] = resolve(model, args.get("revision"), args.get("download_dir"))
        if values["model"] != model and "served_model_name" not in values:
            values["served_model_name"] = model       # a hub id is the served name, as vLLM's default
    if idle:
        log.info("pagoda: model.json: no effect here: %s", ", ".join(sorted(idle)))
    return values


def _kv_events(value: Any) -> dict[str, Any]:
    """vLLM's kv_events_config (an object, or its JSON text) onto the kv_events options."""
    if isinstance(value, str):
        value = json.loads(value)
    if not value:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"model.json: kv_events_config must be an object, got {value!r}")
    out: dict[str, Any] = {"kv_events": bool(value.get("enable_kv_cache_events", False))}
    if value.get("endpoint"):
        out["kv_events_endpoint"] = value["endpoint"]
    if value.get("topic") is not None:
        out["kv_events_topic"] = value["topic"]
    return out
