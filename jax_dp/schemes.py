"""The all-reduce schemes by name: lax.psum, and by hand with lax.ppermute the book's star and
the ring its exercise asks for."""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from jax_dp.backends.base import check_allreduce
from jax_dp.errors import ParamError
from jax_dp.parallel import AXIS, allreduce, allreduce_flat


def star_allreduce(tree: Any, axis_name: str = AXIS) -> Any:
    """The book's allreduce: devices 1..k-1 send to device 0 in turn, which sums and sends back."""
    flat, unravel = ravel_pytree(tree)
    k, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    total, received = flat, jnp.zeros_like(flat)
    for i in range(1, k):  # Only device 0 receives (x_i); the others get zeros.
        total = total + lax.ppermute(flat, axis_name, perm=[(i, 0)])
    for i in range(1, k):  # Only device i receives device 0's sum.
        received = received + lax.ppermute(total, axis_name, perm=[(0, i)])
    return unravel(jnp.where(me == 0, total, received))


def ring_allreduce(tree: Any, axis_name: str = AXIS) -> Any:
    """Reduce-scatter then all-gather around a ring: each device sends 2(k-1)/k of the data.

    The data is cut into k chunks. In k-1 reduce-scatter steps each device passes one
    chunk's running sum to its right neighbour, which adds its own; device i then holds
    the full sum of chunk i+1. In k-1 all-gather steps the full sums go round the ring.
    """
    flat, unravel = ravel_pytree(tree)
    k, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    if k == 1:
        return tree
    size = -(-flat.size // k)
    chunks = jnp.pad(flat, (0, size * k - flat.size)).reshape(k, size)
    right = [(i, (i + 1) % k) for i in range(k)]
    for s in range(k - 1):
        passed = lax.ppermute(chunks[(me - s) % k], axis_name, right)
        chunks = chunks.at[(me - s - 1) % k].add(passed)
    for s in range(k - 1):
        passed = lax.ppermute(chunks[(me + 1 - s) % k], axis_name, right)
        chunks = chunks.at[(me - s) % k].set(passed)
    return unravel(chunks.reshape(-1)[:flat.size])


BY_NAME: dict[str, Callable] = {"psum": allreduce, "star": star_allreduce, "ring": ring_allreduce}


def get_allreduce(name: str, backend: str) -> Callable:
    """The all-reduce called name (backends.check_allreduce: the hand-made ones need pmap)."""
    check_allreduce(name, backend)
    return BY_NAME[name]


def for_step(name: str) -> Callable:
    """A train step's all-reduce of (gradients, metrics) by the scheme called name: for psum,
    both as one flat buffer (parallel.allreduce_flat); by hand, the gradients so and the
    metrics by psum."""
    if name == "psum":
        return allreduce_flat
    return lambda tree, axis_name: (BY_NAME[name](tree[0], axis_name),
                                    allreduce(tree[1], axis_name))


def bytes_sent(scheme: str, size: int, k: int, itemsize: int = 4) -> list[int]:
    """Bytes each of k devices sends to allreduce size numbers of itemsize bytes by scheme
    ('star' or 'ring'; the ring pads the numbers to k equal chunks)."""
    if scheme == "star":
        return [(k - 1) * size * itemsize] + [size * itemsize] * (k - 1) if k > 1 else [0]
    if scheme == "ring":
        return [2 * (k - 1) * -(-size // k) * itemsize] * k
    raise ParamError("allreduce", f"no traffic model for {{}} {scheme!r}: use 'star' or 'ring'")
