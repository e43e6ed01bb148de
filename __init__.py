"""qwen3-spmd: Qwen3 inference in JAX as one SPMD program over a (stage, seq, tensor)
mesh: pipeline, context (ring and Ulysses) and tensor (and expert) parallelism.

The repository root is this package (see pyproject's `package-dir`): `qwen3_spmd.model`
(the Flax model and checkpoint IO), `.sharding` (mesh and placement), `.pipeline` (the
stage loop, prefill and decode programs, the engine), `.ring` (ring and Ulysses
attention, decode context parallelism) and `.run` (the command line, and `run.llm`:
`LLM` and `SamplingParams`, the Python door, re-exported here).
"""

__all__ = ["LLM", "Output", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazily: importing the package must not import JAX, so that a command line can
    # still set the CPU device count first (`qwen3_spmd.run.llm` imports it).
    if name in __all__:
        from qwen3_spmd.run import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'qwen3_spmd' has no attribute {name!r}")
