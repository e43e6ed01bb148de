"""The environment of the processes that tests start: servers, jax.distributed peers,
the command line."""

import os

DEVICE_COUNT = "xla_force_host_platform_device_count"


def child_env() -> dict[str, str]:
    """This process's environment without its emulated device count (conftest.py's 8),
    so that the child's --cpu-devices or jax_num_cpu_devices decides. The session's
    compile cache and its other XLA flags (conftest.py: LLVM at -O0) stay."""
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if DEVICE_COUNT not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env
