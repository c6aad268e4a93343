"""Pytree key paths as the dotted names the loaders, quantizer and sharding rules use:
`Params.layers[3].wq` -> "layers.3.wq"."""

from __future__ import annotations

import jax


def path_names(kp) -> list[str]:
    """A `tree_map_with_path` key path -> its components: ["layers", "3", "wq"]."""
    names = []
    for k in kp:
        if isinstance(k, jax.tree_util.GetAttrKey):
            names.append(k.name)
        elif isinstance(k, jax.tree_util.DictKey):
            names.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            names.append(str(k.idx))
        else:
            names.append(str(k))
    return names


def path_str(kp) -> str:
    """A `tree_map_with_path` key path -> "layers.3.wq"."""
    return ".".join(path_names(kp))
