"""The least value of each of the engine's sizes, in one table: `Engine` checks them, and
the command line reads them to answer before JAX loads (so nothing here imports JAX)."""

LEAST = {
    "microbatches": 1,
    "groups": 1,
    # A request holds one prompt token and one new token at least: a cache of one
    # position would refuse every request.
    "max_seq_len": 2,
    "chunk": 1,
    "block_size": 1,
}
