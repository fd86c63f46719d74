"""Mixed precision as a model wrapper: the step never sees it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dp.models.model import Model


def computing_in(model: Model, dtype: str) -> Model:
    """model computing in dtype ('float32': model itself). Its apply casts a copy of each float
    param and the images down (the float32 params stay the ones updated, and their gradient
    comes back float32 through the cast) and gives the logits back in float32."""
    if dtype == "float32":  # The params' own dtype (float64 in the parity checks).
        return model

    def apply(params, state, x, mask, **kwargs):
        cast = lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
        logits, state = model.apply(jax.tree.map(cast, params), state, x.astype(dtype), mask,
                                    **kwargs)
        return logits.astype(jnp.float32), state
    # No module: a capability that swaps its layer types would drop the casts.
    return Model(model.init, apply)
