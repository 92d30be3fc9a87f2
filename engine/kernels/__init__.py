"""Attention and KV-write ops: torch reference ops here; Triton kernels with the same signatures for CUDA."""
