"""`qwen3-spmd bench`: jit-compiled benchmarks with JSON output.

- `command`: the subcommand (flags, settings, the run over meshes and scenarios).
- `jobs`: one prefill or decode job on one mesh, timed.
- `measure`: timing, rooflines measured on this machine, FLOP and byte counts.
- `peer`: the same jobs through Hugging Face transformers, in the same run.
- `report`: ratios, targets, the table and the plot.
- `capacity`: the longest prompt a memory budget admits, per mesh (`python -m qwen3_spmd.run.bench.capacity`).
"""
