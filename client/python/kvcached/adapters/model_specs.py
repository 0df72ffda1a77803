"""CacheSpecs for models: one layer spec per attention layer, standard for
full attention and rotating for sliding-window layers.

A model describes each layer as kvcached.models.cache_protocol's
LayerCacheSpec does: `window` (None for full attention) and `keep` (the
attention sinks). A query at q attends k when q - k < window or k < keep,
so a rotating layer that holds every such key keeps `keep` sinks and
`window` recent tokens: max_size = window + keep (mlx-lm's max_size =
window where keep is 0).
"""

from typing import Any, List, Optional, Sequence

from .. import specs
from ..dtypes import DType
from ..proto import pb
from .layer_state import LayerKind


def _window_and_keep(layer: Any) -> "tuple[Optional[int], int]":
    """(window, keep) of a LayerCacheSpec-like object (attributes) or None (full)."""
    if layer is None:
        return None, 0
    return getattr(layer, "window", None), int(getattr(layer, "keep", 0) or 0)


def layer_spec(layer: Any, heads: int, head_dim: int, v_head_dim: int = 0) -> pb.LayerSpec:
    """The kvcached layer spec of one model layer (LayerCacheSpec-like, or None: full)."""
    window, keep = _window_and_keep(layer)
    if window is None:
        return specs.standard(heads, head_dim, v_head_dim)
    return specs.rotating(heads, head_dim, max_size=window + keep, keep=keep,
                          v_head_dim=v_head_dim)


def cache_spec_for_layers(layers: Sequence[Any], heads: int, head_dim: int,
                          dtype: DType = DType.FLOAT16, model: str = "",
                          v_head_dim: int = 0) -> pb.CacheSpec:
    """A one-row CacheSpec of these model layers (LayerCacheSpec-like, None: full)."""
    return specs.cache_spec([layer_spec(layer, heads, head_dim, v_head_dim) for layer in layers],
                            dtype=dtype, batch_size=1, model=model)


def _config_value(config: Any, name: str, default: Any = None) -> Any:
    """An attribute of a config object, or a key of a config dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def config_layers(config: Any) -> List[Any]:
    """The per-layer cache specs a model config gives: its layer_cache_specs()
    or `layer_cache_specs` where it has them, else full attention everywhere."""
    given = _config_value(config, "layer_cache_specs")
    if callable(given):
        given = given()
    if given is not None:
        return list(given)
    return [None] * int(_config_value(config, "num_hidden_layers"))


def config_head_dim(config: Any) -> int:
    """head_dim, or hidden_size / num_attention_heads where a config has none."""
    head_dim = _config_value(config, "head_dim")
    if head_dim:
        return int(head_dim)
    return int(_config_value(config, "hidden_size")) // int(
        _config_value(config, "num_attention_heads"))


def cache_spec_from_config(config: Any, dtype: DType = DType.FLOAT16,
                           model: str = "") -> pb.CacheSpec:
    """The one-row CacheSpec of a model config (Hugging Face-style names:
    num_key_value_heads, head_dim or hidden_size / num_attention_heads)."""
    heads = _config_value(config, "num_key_value_heads") or _config_value(
        config, "num_attention_heads")
    return cache_spec_for_layers(config_layers(config), int(heads), config_head_dim(config),
                                 dtype=dtype, model=model)


def layer_kinds(spec: pb.CacheSpec) -> List[LayerKind]:
    """The adapters' view of a spec's layers; ValueError for kinds they do not serve."""
    kinds = []
    for index, layer in enumerate(spec.layers):
        kind = layer.WhichOneof("kind")
        if kind == "standard":
            kinds.append(LayerKind())
        elif kind == "rotating":
            kinds.append(LayerKind(int(layer.rotating.max_size), int(layer.rotating.keep)))
        else:
            raise ValueError("layer %d is %s: the adapters serve standard and rotating layers"
                             % (index, kind))
    return kinds


def one_row(spec: pb.CacheSpec) -> pb.CacheSpec:
    """The spec with batch_size 1 and no padding: one sequence per cache."""
    row = pb.CacheSpec()
    row.CopyFrom(spec)
    row.batch_size = 1
    del row.left_padding[:]
    return row


def check_update(spec: pb.CacheSpec, layer: int, keys: Any, values: Any) -> None:
    """Raises ValueError, before anything is sent or stored, where keys and
    values [B, H, L, D] cannot be layer `layer`'s update: so a refused update
    changes nothing, here or in kvcached."""
    if not 0 <= layer < len(spec.layers):
        raise ValueError("layer_idx %d is not in 0 .. %d" % (layer, len(spec.layers) - 1))
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError("keys %s and values %s must be [B, H, L, D] alike"
                         % (tuple(keys.shape), tuple(values.shape)))
    layout = spec.layers[layer]
    want = (layout.num_kv_heads, layout.k_head_dim, layout.v_head_dim or layout.k_head_dim)
    got = (int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]))
    if got != want:
        raise ValueError("layer %d: (heads, key dim, value dim) %s; the spec has %s"
                         % (layer, got, want))
    if keys.shape[2] < 1:
        raise ValueError("layer %d: an update needs at least one token (L = 0)" % layer)
