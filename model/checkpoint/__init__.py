"""Checkpoint IO: where weights come from, kept apart from the model itself.

- `hf`: Hugging Face safetensors folders (the name table, strict checks, lazy reads).
- `orbax_io`: orbax checkpoints written by `qwen3-spmd convert`, for fast sharded restore.
- `random_weights`: seeded random weights for presets, demos and tests.

Each source reads a parameter by its NNX state path (`model.params`), for the layers
asked for; `sharding.place` cuts every device's shard from what it reads.
"""
