"""shard_map's varying types: along which mesh axes a value varies, and a cast to more.

Inside `jax.shard_map` (check_vma on) every value carries the mesh axes it varies along;
both branches of a `lax.cond`, and a scan's carry in and out, must agree. Outside
shard_map, and on one device, the set is empty and the cast changes nothing, so the
model's layers use these without knowing whether a mesh is there.
"""

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The mesh axes along which `x` varies inside shard_map (its vma type)."""
    aval = jax.typeof(x)
    # jax 0.10 keeps it in manual_axis_type.varying; earlier releases called it vma.
    if hasattr(aval, "manual_axis_type"):
        return aval.manual_axis_type.varying
    return aval.vma


def make_varying(x, axes: frozenset):
    """`x` cast to vary along `axes` (a superset of its own): a type change, no data moves."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
