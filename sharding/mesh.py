"""The device mesh: three axes, `stage` (pipeline parallelism), `seq` (context
parallelism) and `tensor` (tensor and expert parallelism, model.split).

Devices are laid out with `tensor` innermost (the devices of one host's fast links),
then `seq`, then `stage`, so process 0 holds the first stage's first devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
from jax.sharding import AxisType, Mesh

AXES = ("stage", "seq", "tensor")


class MeshError(ValueError):
    """A mesh that does not fit the devices: the message names both sizes."""


class MeshShape(NamedTuple):
    stage: int  # S
    seq: int  # C
    tensor: int = 1  # X

    @property
    def devices(self) -> int:
        return self.stage * self.seq * self.tensor

    def __str__(self) -> str:
        return "x".join(map(str, self if self.tensor > 1 else self[:2]))


def parse_mesh(text: str) -> MeshShape:
    """'SxC' or 'SxCxX' (e.g. '2x4', '2x1x4') -> MeshShape; SxC means X = 1."""
    try:
        sizes = tuple(int(p) for p in text.lower().split("x"))
        if len(sizes) not in (2, 3):
            raise ValueError
    except ValueError:
        raise MeshError(
            f"--mesh {text!r} is not of the form SxC or SxCxX (e.g. 2x2, 2x1x4): "
            "S pipeline stages times C sequence devices times X tensor devices"
        ) from None
    if min(sizes) < 1:
        raise MeshError(f"--mesh {text!r} needs positive sizes")
    return MeshShape(*sizes)


def make_mesh(
    stage: int, seq: int, devices: Sequence[jax.Device] | None = None, *, tensor: int = 1
) -> Mesh:
    """A ('stage', 'seq', 'tensor') mesh over `devices` (default: every visible device),
    `tensor` innermost."""
    given_devices = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    shape = MeshShape(stage, seq, tensor)
    n = shape.devices
    if n != len(devices):
        given = "given" if given_devices else "visible"
        raise MeshError(
            f"mesh {shape} needs {n} devices, but {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} {given}: pass a mesh of {len(devices)} "
            f"devices, or on CPU emulate {n} with jax.config.update('jax_num_cpu_devices', {n}) "
            "before the first JAX computation"
        )
    return jax.make_mesh(shape, AXES, devices=devices, axis_types=(AxisType.Auto,) * 3)
