"""`qwen3-spmd plan`: the meshes a model can run on, ranked by a cost model."""
