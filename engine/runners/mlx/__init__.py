"""The MLX runner (Apple silicon; mlx[cpu] on Linux)."""
