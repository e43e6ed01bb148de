"""What runs the model on the mesh and serves requests, in rooms that import downward
only: `requests` (what a request may ask), `bounds` (the least engine sizes),
`programs/` (the device programs inside the shard_map), `runtime/` (the engine: weights
on the mesh, programs compiled once per shape), `structured/` (structured outputs'
grammars), `batch/` (requests, rows and prefix blocks on the host), `speculative/`
(speculative decoding), `scheduling/` (planner, executor and scheduler: continuous
batching)."""
