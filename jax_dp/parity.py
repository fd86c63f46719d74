"""How far two runs are apart: the measure every k-devices-vs-one comparison uses."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def max_rel_diff(tree: Any, reference: Any) -> float:
    """max |tree - reference| / max |reference|, over all leaves at once (relative inf-norm)."""
    leaves, ref_leaves = jax.tree.leaves(tree), jax.tree.leaves(reference)
    if len(leaves) != len(ref_leaves):
        raise ValueError(f"trees differ in structure: {len(leaves)} vs {len(ref_leaves)} leaves")
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(leaves, ref_leaves))
    scale = max(float(np.max(np.abs(np.asarray(b, np.float64)))) for b in ref_leaves)
    return diff / scale if scale else diff


def cast(tree: Any, dtype) -> Any:
    """Every floating-point leaf of tree as dtype (float64 needs jax.enable_x64)."""
    def to(leaf):
        leaf = jax.numpy.asarray(leaf)
        return leaf.astype(dtype) if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) else leaf
    return jax.tree.map(to, tree)
