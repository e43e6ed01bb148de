"""Test session set-up: 8 emulated CPU devices, float32 matmuls at full precision.

The device count must be set before anything touches a JAX backend, so it happens
here, at import, before any test module is collected.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# generate keeps compiled programs in ~/.cache unless told otherwise: tests (and the
# runs they start) leave the user's cache alone; test_cli tests the cache on its own.
os.environ.setdefault("QWEN3_SPMD_COMPILE_CACHE", "off")
from qwen3_spmd.run.cli import size_cpu_threads  # noqa: E402

size_cpu_threads(8)  # a device waiting in a collective holds a thread of XLA's CPU pool

import jax  # noqa: E402

# QWEN3_SPMD_TEST_PLATFORM=cuda runs the single-device tests on a GPU (meshes larger
# than the GPUs present then fail to build: pick those tests by file).
jax.config.update("jax_platforms", os.environ.get("QWEN3_SPMD_TEST_PLATFORM", "cpu"))
jax.config.update("jax_default_matmul_precision", "highest")
