"""Model runners: they own every tensor; the core hands them rows of ints."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runners.base import ModelRunner


def make_runner(config: "EngineConfig", model_dir: str) -> "ModelRunner":
    if config.runner == "torch":
        from engine.runners.torch.runner import TorchRunner
        return TorchRunner(model_dir, config.dtype, config.device, config.num_threads, config.attention,
                           config.compile, config.cuda_graphs, config.max_batch_size, config.sampling_seed,
                           config.quantization, config.quantized_activations)
    if config.runner == "mlx":
        try:
            from engine.runners.mlx.runner import MLXRunner
        except ImportError as e:
            raise ValueError(f"runner: mlx is not installed ({e}); pip install -e '.[mlx]'") from None
        return MLXRunner(model_dir, config.dtype, config.sampling_seed)
    raise ValueError(f"runner: {config.runner!r} is not available in this build")
