"""Qwen2 models (torch, MLX), the safetensors loader and random-checkpoint presets."""
