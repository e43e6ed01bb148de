"""Checkpoint IO: where weights come from, kept apart from the model itself.

- `hf_names`: the name table: Hugging Face's tensor name and shape of each parameter.
- `hf`: Hugging Face safetensors folders (strict checks, lazy reads).
- `orbax_io`: orbax checkpoints written by `qwen3-spmd convert`, for fast sharded restore.
- `random_weights`: seeded random weights for presets, demos and tests.

Each source reads a parameter by its NNX state path (`model.params`), for the layers
asked for; `sharding.place` cuts every device's shard from what it reads.
"""
