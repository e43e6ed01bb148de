"""The device mesh: four axes, `data` (replicas: data parallelism), `stage` (pipeline
parallelism), `seq` (context parallelism) and `tensor` (tensor and expert parallelism,
model.split).

Devices are laid out with `tensor` innermost (the devices of one host's fast links),
then `seq`, then `stage`, then `data`, so process 0 holds the first replica's first
stage's first devices, and replicas split across hosts before stages do. A replica is a
('stage', 'seq', 'tensor') mesh of its own: its weights are the same as every other
replica's, its rows and KV pages its own, and a program's step has no collective along
`data` but Qwen3-MoE's all-to-alls, whose experts the "a2a" split spreads over `data` x
`tensor` (model.split).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "stage", "seq", "tensor")
# One replica's axes: the collectives of a model step run along these only (but the
# "a2a" experts' all-to-alls, model.moe).
MODEL_AXES = ("stage", "seq", "tensor")


class MeshError(ValueError):
    """A mesh that does not fit the devices: the message names both sizes."""


class MeshShape(NamedTuple):
    stage: int  # S
    seq: int  # C
    tensor: int = 1  # X
    data: int = 1  # D

    @classmethod
    def of(cls, mesh) -> MeshShape:
        """The shape of a mesh (or abstract mesh) with these axes."""
        return cls(*(mesh.shape[a] for a in ("stage", "seq", "tensor", "data")))

    @property
    def devices(self) -> int:
        return self.data * self.stage * self.seq * self.tensor

    @property
    def replica_devices(self) -> int:
        """The devices of one replica, S C X."""
        return self.stage * self.seq * self.tensor

    def __str__(self) -> str:
        if self.data > 1:
            return "x".join(map(str, (self.data, self.stage, self.seq, self.tensor)))
        return "x".join(map(str, self[:3] if self.tensor > 1 else self[:2]))


def parse_mesh(text: str) -> MeshShape:
    """'SxC', 'SxCxX' or 'DxSxCxX' (e.g. '2x4', '2x1x4', '2x1x1x4') -> MeshShape; SxC
    means X = 1, and fewer than four parts D = 1."""
    try:
        sizes = tuple(int(p) for p in text.lower().split("x"))
        if len(sizes) not in (2, 3, 4):
            raise ValueError
    except ValueError:
        raise MeshError(
            f"--mesh {text!r} is not of the form SxC, SxCxX or DxSxCxX (e.g. 2x2, 2x1x4, "
            "2x1x1x4): D replicas times S pipeline stages times C sequence devices times "
            "X tensor devices"
        ) from None
    if min(sizes) < 1:
        raise MeshError(f"--mesh {text!r} needs positive sizes")
    if len(sizes) == 4:
        return MeshShape(*sizes[1:], data=sizes[0])
    return MeshShape(*sizes)


def stage_devices(mesh: Mesh) -> list[list[jax.Device]]:
    """Each stage's devices, every replica's (its `seq` and `tensor` devices)."""
    return [list(mesh.devices[:, s].flat) for s in range(mesh.shape["stage"])]


def make_mesh(
    stage: int,
    seq: int,
    devices: Sequence[jax.Device] | None = None,
    *,
    tensor: int = 1,
    data: int = 1,
) -> Mesh:
    """A ('data', 'stage', 'seq', 'tensor') mesh over `devices` (default: every visible
    device), `tensor` innermost."""
    given_devices = devices is not None
    devices = list(jax.devices() if devices is None else devices)
    shape = MeshShape(stage, seq, tensor, data)
    n = shape.devices
    if n != len(devices):
        given = "given" if given_devices else "visible"
        raise MeshError(
            f"mesh {shape} needs {n} devices, but {len(devices)} "
            f"{'is' if len(devices) == 1 else 'are'} {given}: pass a mesh of {len(devices)} "
            f"devices, or on CPU emulate {n} with jax.config.update('jax_num_cpu_devices', {n}) "
            "before the first JAX computation"
        )
    return jax.make_mesh(
        (data, stage, seq, tensor), AXES, devices=devices, axis_types=(AxisType.Auto,) * 4
    )
