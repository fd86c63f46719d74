"""What every backend is: the Backend interface, the backends' and all-reduces' names; no JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from jax_dp.errors import ParamError, check_choice

if TYPE_CHECKING:
    import jax

# pmap is the book's; single, one device with no collectives, is the reference.
BACKENDS = ("pmap", "shard_map", "jit", "single")
# How gradients are summed: lax.psum, or jax_dp.schemes' hand-made star and ring.
ALLREDUCES = ("psum", "star", "ring")


def check_allreduce(name: str, backend: str) -> None:
    """Refuse an unknown all-reduce, and a hand-made one (written for pmap's axis) elsewhere."""
    check_choice("allreduce", name, ALLREDUCES)
    if name != "psum" and backend != "pmap":
        raise ParamError(("allreduce", "backend"), f"{{}} {name} is written for the pmap "
                         "backend; use {} pmap")


class Backend:
    """How state and batches are placed on devices, and how a per-shard step is compiled.

    wrap(fn) takes fn written for one shard (collectives over `axis_name`) whose last
    argument is split over the devices and whose others are replicated, and returns it
    to call on placed values (jax.pmap's or jax.jit's wrapper: compiled on its first call, or
    ahead by compile). replicate puts one copy of a host tree on every device,
    unreplicate reads one copy back; to_host and from_host move a placed tree whole,
    every device's copy included (they differ only where each device holds its own).
    """
    name: str
    axis_name: str | None

    def __init__(self, devices: Sequence[jax.Device]):
        import jax

        self.devices = tuple(devices)
        # This process's devices: in a multi-process run, devices spans every process.
        self.local = tuple(d for d in self.devices if d.process_index == jax.process_index())

    def replicate(self, tree: Any) -> Any:
        raise NotImplementedError

    def shard(self, batch: Any) -> Any:
        raise NotImplementedError

    def unreplicate(self, tree: Any) -> Any:
        raise NotImplementedError

    def wrap(self, fn: Callable, donate_argnums: tuple[int, ...] = ()) -> Callable:
        """fn wrapped to run on these devices."""
        raise NotImplementedError

    def to_host(self, tree: Any) -> Any:
        """A placed tree on the host, every device's copy included."""
        return self.unreplicate(tree)

    def from_host(self, tree: Any) -> Any:
        """to_host's result placed back."""
        return self.replicate(tree)

    def compile(self, wrapped: Callable, *args) -> Callable:
        """wrapped (wrap's result) compiled ahead of time for args like these."""
        return wrapped.lower(*args).compile()
