"""`qwen3-spmd bench`: jit-compiled benchmarks with JSON output. Measuring scripts that
are not bench scenarios (a memory budget's longest prompt, a server's start, the MoE
formulations, two revisions alternated) live in the repository's tools/.

- `command`: the subcommand (flags, settings, the run over meshes and scenarios).
- `jobs`: one prefill or decode job on one mesh, timed.
- `measure`: timing, rooflines measured on this machine, FLOP and byte counts.
- `peer`: the same jobs through Hugging Face transformers, in the same run.
- `report`: ratios, targets, the table and the plot.
"""
