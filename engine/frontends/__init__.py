"""Front ends: the Triton model's tensors, the OpenAI-compatible server, the CLI."""
