"""LlamaConfig: a Llama-architecture model's shape, as Hugging Face's
config.json names it, and the cache layout it implies.

Sliding-window layers, optional: `sliding_window` (how far back a query
attends) with `layer_types` (one "full_attention" or "sliding_attention" per
layer, as newer HF configs write it; without it, Mistral's reading: every
layer slides), and `attention_sinks`, the first tokens every sliding layer
always attends (mlx-lm's rotating-cache `keep`; 4 when sliding layers exist
and the config says nothing).
"""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Union

from .cache_protocol import LayerCacheSpec

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DEFAULT_ATTENTION_SINKS = 4  # mlx-lm's RotatingKVCache keep in make_prompt_cache


@dataclasses.dataclass
class LlamaConfig:
    """The shape of a Llama-family model (HF config.json field names).

    Resolved on construction: num_key_value_heads (default: one per query
    head), head_dim (default hidden_size // num_attention_heads), layer_types
    (always a full list) and attention_sinks (0 without sliding layers).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[List[str]] = None
    attention_sinks: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError("LlamaConfig.%s must be a positive integer, got %r"
                                 % (name, getattr(self, name)))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("LlamaConfig.num_attention_heads %d is no multiple of "
                             "num_key_value_heads %d" % (self.num_attention_heads,
                                                         self.num_key_value_heads))
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2 != 0:
            raise ValueError("LlamaConfig.head_dim must be even (RoPE rotates pairs), got %d"
                             % self.head_dim)
        self._resolve_layer_types()

    def _resolve_layer_types(self) -> None:
        if self.layer_types is None:
            kind = FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION
            self.layer_types = [kind] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("LlamaConfig.layer_types has %d entries for %d layers"
                             % (len(self.layer_types), self.num_hidden_layers))
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError("LlamaConfig.layer_types: unknown %s" % unknown)
        any_sliding = SLIDING_ATTENTION in self.layer_types
        if any_sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError("LlamaConfig: sliding_attention layers need sliding_window >= 1")
        if self.attention_sinks is None:
            self.attention_sinks = DEFAULT_ATTENTION_SINKS if any_sliding else 0
        if self.attention_sinks < 0:
            raise ValueError("LlamaConfig.attention_sinks must be >= 0")

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "LlamaConfig":
        """From config.json's dictionary; keys this model does not use are ignored."""
        known = {field.name for field in dataclasses.fields(cls)}
        chosen = {key: value for key, value in values.items() if key in known}
        # Qwen2-style configs name a window they do not use.
        if values.get("use_sliding_window") is False and "layer_types" not in values:
            chosen.pop("sliding_window", None)
        missing = sorted(field.name for field in dataclasses.fields(cls)
                         if field.default is dataclasses.MISSING and field.name not in chosen)
        if missing:
            raise ValueError("config has no %s" % ", ".join(missing))
        return cls(**chosen)

    @classmethod
    def from_json_file(cls, path: Union[str, os.PathLike]) -> "LlamaConfig":
        """From a config.json file."""
        with open(path, encoding="utf-8") as file:
            try:
                values = json.load(file)
            except json.JSONDecodeError as error:
                raise ValueError("%s is no JSON: %s" % (os.fspath(path), error)) from error
        if not isinstance(values, dict):
            raise ValueError("%s holds no JSON object" % os.fspath(path))
        return cls.from_dict(values)

    def to_dict(self, torch_dtype: str = "float32") -> Dict[str, Any]:
        """config.json's dictionary, with the fields HF tools look for
        (torch_dtype: what the weights are stored as)."""
        values = dataclasses.asdict(self)
        if values["sliding_window"] is None:  # nothing HF would write for plain Llama
            for key in ("sliding_window", "layer_types", "attention_sinks"):
                values.pop(key)
        values.update(model_type="llama", architectures=["LlamaForCausalLM"],
                      hidden_act="silu", torch_dtype=torch_dtype)
        return values

    def to_json_file(self, path: Union[str, os.PathLike], torch_dtype: str = "float32") -> None:
        """Writes config.json."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(torch_dtype), file, indent=2, sort_keys=True)
            file.write("\n")

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends a sliding window."""
        return self.layer_types[layer_idx] == SLIDING_ATTENTION

    def layer_cache_spec(self, layer_idx: int) -> LayerCacheSpec:
        """What layer `layer_idx` needs from a cache (window and sinks)."""
        if self.is_sliding(layer_idx):
            return LayerCacheSpec(window=self.sliding_window, keep=self.attention_sinks)
        return LayerCacheSpec()

    def layer_cache_specs(self) -> List[LayerCacheSpec]:
        """layer_cache_spec of every layer, in order: how caches are laid out."""
        return [self.layer_cache_spec(index) for index in range(self.num_hidden_layers)]
