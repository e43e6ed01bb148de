"""The device mesh: two axes, `stage` (pipeline parallelism) and `seq` (context parallelism)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh


class MeshError(ValueError):
    """A mesh that does not fit the devices: the message names both sizes."""


def parse_mesh(text: str) -> tuple[int, int]:
    """'SxC' (e.g. '2x4') -> (stages, seq devices)."""
    try:
        stage, seq = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise MeshError(
            f"--mesh {text!r} is not of the form SxC (e.g. 2x2): "
            "S pipeline stages times C sequence devices"
        ) from None
    if stage < 1 or seq < 1:
        raise MeshError(f"--mesh {text!r} needs positive sizes")
    return stage, seq


def make_mesh(stage: int, seq: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('stage', 'seq') mesh over `devices` (default: every visible device)."""
    given_devices = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    n = stage * seq
    if n != len(devices):
        given = "given" if given_devices else "visible"
        raise MeshError(
            f"mesh {stage}x{seq} needs {n} devices, but {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} {given}: pass a mesh of {len(devices)} "
            f"devices, or on CPU emulate {n} with jax.config.update('jax_num_cpu_devices', {n}) "
            "before the first JAX computation"
        )
    return jax.make_mesh(
        (stage, seq), ("stage", "seq"), devices=devices, axis_types=(AxisType.Auto, AxisType.Auto)
    )
