"""JAX operations beneath the model and the ring, knowing neither: few-row products in
the order XLA's CPU backend runs fastest (`ops.matmul`), and shard_map's varying types
(`ops.varying`)."""
