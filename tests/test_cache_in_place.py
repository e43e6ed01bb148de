"""The KV cache is donated to the compiled programs and updated in place: XLA's memory
analysis shows the cache aliased between input and output and no cache-sized copy."""

import jax
import numpy as np
import pytest

from model.cache import KVCache
from model.config import Qwen3Config
from model.checkpoint.hf import HFCheckpoint
from pipeline.engine import Engine
from sharding.mesh import make_mesh
from reference import TINY



@pytest.mark.parametrize("S, C", [(1, 1), (2, 2)])
def test_programs_alias_the_cache(S, C):
    cfg = Qwen3Config.from_hf(TINY)
    # A cache large against everything else, so a copy of it could not hide in temp.
    eng = Engine(cfg, HFCheckpoint(TINY, cfg), make_mesh(S, C, jax.devices()[:S * C]),
                 max_seq_len=4096, chunk=4)
    eng.generate([[5, 6, 7, 8, 9]] * S, 6, with_logits=False)
    assert isinstance(eng.cache, KVCache)
    k, v, pos = eng.cache
    kv_bytes = 2 * k.addressable_shards[0].data.nbytes  # one device's k and v
    assert np.asarray(pos).shape == (k.shape[1], k.shape[3])  # k [L_pad, B, K, S_cap, H]
    names = list(eng.programs)
    assert any(n.startswith("prefill") for n in names) and any(n.startswith("decode") for n in names)
    for name, program in eng.programs.items():
        m = program.memory_analysis()
        assert m.alias_size_in_bytes >= kv_bytes, name  # k and v updated in place
        assert m.temp_size_in_bytes < kv_bytes / 4, name  # no copy of either
