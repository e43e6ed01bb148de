"""The device programs: what each device runs inside the mesh-wide shard_map (prefill,
decode, sampling, the pipeline schedules) and the prompt layout they read."""
