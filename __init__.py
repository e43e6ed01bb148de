"""qwen3-spmd: Qwen3 inference in JAX as one SPMD program over a (stage, seq) mesh.

The repository root is this package (see pyproject's `package-dir`): `qwen3_spmd.model`
(the Flax model and checkpoint IO), `.sharding` (mesh and placement), `.pipeline` (the
stage loop, prefill and decode programs, the engine), `.ring` (ring and Ulysses
attention, decode context parallelism) and `.run` (the command line).
"""
