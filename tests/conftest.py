"""Test session set-up: 8 emulated CPU devices, float32 matmuls at full precision, and
one persistent compilation cache for the session.

The device count must be set before anything touches a JAX backend, so it happens
here, at import, before any test module is collected.
"""

import atexit
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Compiling is most of the suite's time, and LLVM's optimizations (XLA's CPU default is
# -O2) are about a third of each compile: at -O0 the suite does 25-33% less work per
# module (CPU seconds, e.g. test_engine_mesh 140 -> 95), while the tiny models' programs
# still run in milliseconds. The results move by rounding only (logits by ~1e-6), within
# every tolerance here; every check compares runs made under the same flags or a
# transformers reference. The subprocesses inherit it (tests/children.py), but for the
# pages' examples, which run in a reader's environment and print their tokens.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Only for the CPU: under a GPU's jax 0.11.2 the flag ended the test process before its
# first test (2026-12-06, an H100), as XLA does with a flag it does not know.
on_cpu = os.environ.get("QWEN3_SPMD_TEST_PLATFORM", "cpu") == "cpu"
if on_cpu and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

# Many tests compile the same programs (a fresh engine of the same shapes, a server and
# the generate runs beside it): one compilation cache in a folder made for this session,
# so each process after the first that compiles a program reads it back. It never
# leaves the session (the user's ~/.cache is left alone) and goes at its end. The
# subprocesses the tests start inherit it: `generate` and `serve` read
# $QWEN3_SPMD_COMPILE_CACHE, a plain JAX program $JAX_COMPILATION_CACHE_DIR. A hit still
# reports XLA's compile event (/jax/core/compile/backend_compile_duration, counted
# around the cache read), so a test that counts compiles sees a program read back too.
# test_cli tests the cache itself in folders of its own. The first process of the session
# (pytest, or xdist's controller, which loads this file before it starts its workers)
# makes the folder; the workers inherit it through the environment, so a program one
# worker compiled is read back by the other (the modules share the tiny checkpoints'
# shapes), and the maker removes it at the end.
CACHE_DIR = os.environ.get("QWEN3_SPMD_TEST_CACHE")
if CACHE_DIR is None:
    CACHE_DIR = os.environ["QWEN3_SPMD_TEST_CACHE"] = tempfile.mkdtemp(
        prefix="qwen3-spmd-test-xla-"
    )
    atexit.register(shutil.rmtree, CACHE_DIR, ignore_errors=True)
os.environ["QWEN3_SPMD_COMPILE_CACHE"] = CACHE_DIR
os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # tiny programs too

from qwen3_spmd.run.cli import size_cpu_threads  # noqa: E402

size_cpu_threads(8)  # a device waiting in a collective holds a thread of XLA's CPU pool

import jax  # noqa: E402

# QWEN3_SPMD_TEST_PLATFORM=cuda runs the single-device tests on a GPU (meshes larger
# than the GPUs present then fail to build: pick those tests by file).
jax.config.update("jax_platforms", os.environ.get("QWEN3_SPMD_TEST_PLATFORM", "cpu"))
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_compilation_cache", True)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


# The longest modules (many engines, servers, 2-process runs), longest first. The two
# xdist workers (pyproject's addopts: --dist loadfile --no-loadscope-reorder) take
# whole modules in collection order, each its next when it is almost done, so the long
# ones start early and the many short ones fill in at the end, which both workers
# then reach at about the same time. A module not named here keeps its place after them.
LONGEST_FIRST = [
    "test_scheduler.py",
    "test_serve.py",
    "test_engine_mesh.py",
    "test_tensor.py",
    "test_moe.py",
    "test_engine_ulysses.py",
    "test_speculative.py",
    "test_prompt_logprobs.py",
    "test_multihost.py",
    "test_bench.py",
    "test_doc_examples.py",
    "test_prefix_cache.py",
    "test_cli.py",
    "test_orbax.py",
    "test_serve_app.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_in_use():
    """JAX decides once per process, at its first compile, whether the process uses
    the cache: that compile is this one, with the cache on, whichever test runs first
    (an in-process `bench` turns the cache off for its own figures)."""
    jax.jit(lambda x: x + 1)(1).block_until_ready()


@pytest.fixture(scope="module", autouse=True)
def _release_programs():
    """Each compiled program holds memory mappings of its JIT code (a few per kernel),
    and a process may hold 65,530 (Linux's vm.max_map_count). A worker that kept every
    module's programs reached that after 15 minutes or so and segfaulted inside XLA (in
    a compile or a compile-cache write, a different test each time, never a module
    alone). When a module ends, its engines are gone (a module that shares them through
    a module-level table empties it in a fixture of its own, torn down before this
    one); here JAX's caches let go of their programs, and the mappings with them
    (docs/testing.md)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _compile_cache_on():
    """`bench` and `generate --compile-cache off` run in this process turn the cache
    off (JAX then writes no programs, though it still reads): on again for the next
    test."""
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
