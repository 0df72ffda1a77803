"""A Llama-architecture transformer in torch (float32 compute) whose KV
cache is any cache_protocol.ModelCache: LocalCache, or one kept in kvcached.

    embed_tokens -> per layer: x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))
                 -> norm -> lm_head (or the embeddings, tied)

Attention: q_proj, k_proj, v_proj; RoPE (rope.py) on q and k before k goes
to the cache; grouped-query heads; optional sliding-window layers with sinks
(attention.py); o_proj. MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
Parameter names are Hugging Face's (model.layers.{i}.self_attn.q_proj.weight
...), so HF checkpoints load as they are (checkpoint.py).
"""

import os
from typing import Optional, Union

import torch
from torch import nn

from .attention import attend
from .cache_protocol import ModelCache
from .config import LlamaConfig
from .rope import RotaryTable, apply_rotary


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """A Linear left uninitialized: weights come from a checkpoint or
    random_model, and initializing a large model first would cost seconds."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension (HF LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes x [..., size]."""
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class LlamaAttention(nn.Module):
    """One layer's attention; its K/V go through the cache (when there is one)."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        spec = config.layer_cache_spec(layer_idx)
        self.window, self.keep = spec.window, spec.keep
        bias = config.attention_bias
        self.q_proj = _linear(config.hidden_size, self.heads * self.head_dim, bias)
        self.k_proj = _linear(config.hidden_size, self.kv_heads * self.head_dim, bias)
        self.v_proj = _linear(config.hidden_size, self.kv_heads * self.head_dim, bias)
        self.o_proj = _linear(self.heads * self.head_dim, config.hidden_size, bias)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, L, heads * D] -> [B, heads, L, D], contiguous (caches send its bytes)."""
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: Optional[ModelCache]) -> torch.Tensor:
        """x [B, L, hidden] at `positions` [L]; returns [B, L, hidden]."""
        query = apply_rotary(self._heads(self.q_proj(x), self.heads), cos, sin)
        key = apply_rotary(self._heads(self.k_proj(x), self.kv_heads), cos, sin).contiguous()
        value = self._heads(self.v_proj(x), self.kv_heads)
        if cache is None:
            keys, values, key_positions = key, value, positions
        else:
            keys, values = cache.update(key, value, self.layer_idx)
            key_positions = cache.key_positions(self.layer_idx)
        # The cache's stored copies (maybe f16/bf16), computed with in float32.
        out = attend(query, keys.to(torch.float32), values.to(torch.float32), positions,
                     key_positions, self.window, self.keep)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, bias)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, bias)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]."""
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added back to the residual stream."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, cache: Optional[ModelCache]) -> torch.Tensor:
        """x [B, L, hidden] -> [B, L, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """HF's LlamaModel (the `model.` prefix of every weight name)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, config.vocab_size,
                                               config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, index)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """HF's LlamaForCausalLM: token ids in, next-token logits out (float32).

    With a cache, a forward continues where the cache's layers are
    (get_seq_length) and appends its tokens to them; without one, it runs
    the tokens alone from position 0.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else _linear(config.hidden_size, config.vocab_size, False))
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.rope_scaling)

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike]) -> "LlamaModel":
        """checkpoint.load_pretrained: config.json and model.safetensors (or shards)."""
        from .checkpoint import load_pretrained  # checkpoint imports this module
        return load_pretrained(directory)

    def save_pretrained(self, directory: Union[str, os.PathLike],
                        dtype: torch.dtype = torch.float32,
                        max_shard_bytes: Optional[int] = None) -> None:
        """checkpoint.save_pretrained: config.json and the weights in `dtype`."""
        from .checkpoint import save_pretrained
        save_pretrained(self, directory, dtype, max_shard_bytes)

    def output_weight(self) -> torch.Tensor:
        """The [vocab, hidden] matrix of the logits (lm_head, or the tied embeddings)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: Optional[ModelCache] = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, L, vocab] for input_ids [B, L] (last_only: [B, 1, vocab],
        the last token's, skipping the vocabulary projection of the others)."""
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError("input_ids must be [B, L] with L >= 1, got %s"
                             % (tuple(input_ids.shape),))
        start = 0 if cache is None else cache.get_seq_length(0)
        positions = torch.arange(start, start + input_ids.shape[1])
        cos, sin = self.rotary.cos_sin(positions)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, cos, sin, cache)
        x = self.model.norm(x[:, -1:] if last_only else x)
        return nn.functional.linear(x, self.output_weight())
