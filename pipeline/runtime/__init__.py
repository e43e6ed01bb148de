"""The device runtime: the engine places weights on the mesh once, compiles each program
once per shape (the registry) and runs it; the cache's copies; the ring-or-Ulysses choice."""
