"""LlamaModel: a no-cache forward equals a plain transcription of HF's
Llama; decoding with a cache (prefill in chunks, then one token a step)
gives the logits of the full-sequence forward; sliding-window layers with
sinks decode past their window; and the attention inputs do not depend on
which superset of the needed keys a cache returns (torch.equal logits)."""

import pytest

torch = pytest.importorskip("torch")

from kvcached import models  # noqa: E402 (after the torch check)
from kvcached.models import tiny_config  # noqa: E402

CONFIGS = {
    "full": tiny_config(),
    "sliding": tiny_config(num_hidden_layers=3, sliding_window=5, attention_sinks=2,
                           layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention"]),
    "mha-tied": tiny_config(num_key_value_heads=4, tie_word_embeddings=True, head_dim=8),
}


def token_ids(length, batch=1, seed=0, vocab=256):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def incremental_logits(model, ids, cache, prompt_length, prefill_chunk):
    """Logits of every position: the first prompt_length tokens fed in chunks
    of prefill_chunk, the rest one a step. [B, L, vocab]."""
    pieces = list(torch.split(ids[:, :prompt_length], prefill_chunk or prompt_length, dim=1))
    pieces += list(torch.split(ids[:, prompt_length:], 1, dim=1))
    return torch.cat([model(piece, cache) for piece in pieces], dim=1)


# A transcription of transformers' Llama forward, written without the model's
# helpers: per-position cos/sin, repeat_kv, an explicit [L, L] mask.
def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, config):
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def _reference_attention(layer, x, index, config):
    batch, length, _ = x.shape
    attn = layer.self_attn
    q = attn.q_proj(x).view(batch, length, -1, config.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, length, -1, config.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, length, -1, config.head_dim).transpose(1, 2)
    positions = torch.arange(length)
    q, k = _rotate(q, positions, config), _rotate(k, positions, config)
    groups = config.num_attention_heads // config.num_key_value_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(2, 3) / config.head_dim ** 0.5
    query, key = positions[:, None], positions[None, :]
    allowed = key <= query
    if config.is_sliding(index):
        allowed &= (query - key < config.sliding_window) | (key < config.attention_sinks)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


@torch.no_grad()
def reference_forward(model, ids):
    config = model.config
    x = model.model.embed_tokens(ids)
    for index, layer in enumerate(model.model.layers):
        h = _rms(x, layer.input_layernorm.weight, config.rms_norm_eps)
        x = x + _reference_attention(layer, h, index, config)
        h = _rms(x, layer.post_attention_layernorm.weight, config.rms_norm_eps)
        mlp = layer.mlp
        x = x + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    x = _rms(x, model.model.norm.weight, config.rms_norm_eps)
    return x @ model.output_weight().T


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_no_cache_forward_is_hf_llama(name):
    model = models.random_model(CONFIGS[name], seed=1)
    ids = token_ids(20, batch=2)
    assert torch.allclose(model(ids), reference_forward(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("prefill_chunk", [1, 3, 7, None])
def test_decoding_with_a_cache_gives_the_full_forwards_logits(name, prefill_chunk):
    """12 prompt tokens in chunks, then 12 steps (the sliding layers' window
    is 5, sinks 2: they decode well past it)."""
    model = models.random_model(CONFIGS[name], seed=2)
    ids = token_ids(24, batch=2, seed=3)
    cache = models.LocalCache.for_model(model.config)
    logits = incremental_logits(model, ids, cache, 12, prefill_chunk)
    assert torch.allclose(logits, model(ids), rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("prefill_chunk", [1, 4, None])
def test_caches_returning_different_supersets_give_equal_logits(dtype, prefill_chunk):
    """A rotating cache returns sinks, the window and extra earlier tokens;
    a cache keeping everything returns all. The model selects the same keys
    from both, so the logits are bit for bit the same."""
    model = models.random_model(CONFIGS["sliding"], seed=4)
    ids = token_ids(30, seed=5)
    rotating = models.LocalCache.for_model(model.config, dtype)
    everything = models.LocalCache.for_model(model.config, dtype, rotating_windows=False)
    first = incremental_logits(model, ids, rotating, 13, prefill_chunk)
    second = incremental_logits(model, ids, everything, 13, prefill_chunk)
    assert torch.equal(first, second)
    held = rotating.key_positions(0).numel()
    assert held == 5 + 2 and everything.key_positions(0).numel() == 30


@pytest.mark.parametrize("dtype, tolerance", [(torch.float16, 2e-2), (torch.bfloat16, 1.5e-1)])
def test_half_precision_caches_round_keys_and_values(dtype, tolerance):
    model = models.random_model(CONFIGS["sliding"], seed=6)
    ids = token_ids(20, seed=7)
    exact = incremental_logits(model, ids, models.LocalCache.for_model(model.config), 8, 3)
    cache = models.LocalCache.for_model(model.config, dtype)
    rounded = incremental_logits(model, ids, cache, 8, 3)
    assert cache.keys_values(1)[0].dtype == dtype
    assert not torch.equal(rounded, exact)  # the rounding reached the logits
    assert (rounded - exact).abs().max() < tolerance * exact.abs().max()


def test_sinks_are_attended_past_the_window():
    """Same weights, keep 2 vs keep 0: equal while every query's window
    still covers the first tokens, different afterwards."""
    sinks = models.random_model(CONFIGS["sliding"], seed=8)
    plain = models.LlamaModel(models.LlamaConfig(**dict(vars(CONFIGS["sliding"]),
                                                        attention_sinks=0)))
    plain.load_state_dict(sinks.state_dict())
    ids = token_ids(16, seed=9)
    with_sinks, without = sinks(ids), plain(ids)
    assert torch.equal(with_sinks[:, :5], without[:, :5])  # q - k < 5 reaches position 0
    assert not torch.allclose(with_sinks[:, 6:], without[:, 6:], atol=1e-3)


def test_a_batch_is_its_rows():
    model = models.random_model(CONFIGS["sliding"], seed=10)
    ids = token_ids(18, batch=3, seed=11)
    cache = models.LocalCache.for_model(model.config)
    together = incremental_logits(model, ids, cache, 9, 4)
    for row in range(3):
        alone = model(ids[row:row + 1])
        assert torch.allclose(together[row:row + 1], alone, rtol=1e-4, atol=1e-5)


def test_last_only_is_the_last_row():
    model = models.random_model(CONFIGS["full"], seed=12)
    ids = token_ids(9)
    assert torch.allclose(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-5)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        model(torch.zeros(4, dtype=torch.long))


class CopyingCache:
    """A cache as a kvcached-backed one behaves: it keeps every token (a
    superset of any window) and returns fresh contiguous tensors, as a
    fetch into new arrays would, instead of views of a growing buffer."""

    def __init__(self, config, dtype):
        self.inner = models.LocalCache.for_model(config, dtype, rotating_windows=False)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        keys, values = self.inner.update(key_states, value_states, layer_idx)
        return keys.clone(), values.clone()

    def key_positions(self, layer_idx):
        return self.inner.key_positions(layer_idx)

    def get_seq_length(self, layer_idx=0):
        return self.inner.get_seq_length(layer_idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_copying_superset_cache_gives_equal_logits(dtype):
    model = models.random_model(CONFIGS["sliding"], seed=13)
    ids = token_ids(26, batch=2, seed=14)
    local = incremental_logits(model, ids, models.LocalCache.for_model(model.config, dtype), 10, 4)
    copying = CopyingCache(model.config, dtype)
    assert isinstance(copying, models.ModelCache)  # all a forward needs
    assert torch.equal(incremental_logits(model, ids, copying, 10, 4), local)


def test_chunking_changes_logits_only_by_rounding():
    """Different prefill chunks run the linear layers on different row
    counts, which CPU GEMMs may sum in different orders: equal up to
    float32 rounding, not bit for bit (measured: within 2e-6)."""
    model = models.random_model(CONFIGS["sliding"], seed=15)
    ids = token_ids(40, seed=16)
    runs = [incremental_logits(model, ids, models.LocalCache.for_model(model.config), 16, chunk)
            for chunk in (1, 5, 16)]
    for run in runs[:-1]:
        assert torch.allclose(run, runs[-1], rtol=0, atol=1e-4)
    again = incremental_logits(model, ids, models.LocalCache.for_model(model.config), 16, 5)
    assert torch.equal(again, runs[1])  # the same chunking: the same bits
