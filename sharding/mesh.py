"""The device mesh: two axes, `stage` (pipeline parallelism) and `seq` (context parallelism)."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh


class MeshError(ValueError):
    """A mesh that does not fit the devices: the message names both sizes."""


def parse_mesh(text: str) -> tuple[int, int]:
    """'SxC' (e.g. '2x4') -> (stages, seq devices)."""
    try:
        stage, seq = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise MeshError(f"--mesh {text!r} is not of the form SxC (e.g. 2x2): "
                        "S pipeline stages times C sequence devices") from None
    if stage < 1 or seq < 1:
        raise MeshError(f"--mesh {text!r} needs positive sizes")
    return stage, seq


def make_mesh(stage: int, seq: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('stage', 'seq') mesh over `devices` (default: every visible device)."""
    devices = list(jax.devices() if devices is None else devices)
    if stage * seq != len(devices):
        raise MeshError(
            f"mesh {stage}x{seq} needs {stage * seq} devices, but {len(devices)} are visible: "
            f"choose --mesh with stage*seq = {len(devices)}, or (on CPU) --cpu-devices {stage * seq}")
    return jax.make_mesh((stage, seq), ("stage", "seq"), devices=devices,
                         axis_types=(AxisType.Auto, AxisType.Auto))
