"""LlamaConfig from HF config.json names, and checkpoints written with
save_pretrained that reload to identical weights (single file, sharded,
tied embeddings, f16/bf16 on disk)."""

import json

import pytest

torch = pytest.importorskip("torch")

from kvcached import models  # noqa: E402 (after the torch check)
from kvcached.models import checkpoint, rope, safetensors  # noqa: E402


def assert_same_weights(a, b):
    left, right = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_hf_config_names_and_defaults():
    config = models.LlamaConfig.from_dict({
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
        "num_attention_heads": 8, "vocab_size": 100, "model_type": "llama",
        "torch_dtype": "bfloat16", "unused_by_us": [1, 2]})
    assert config.num_key_value_heads == 8 and config.head_dim == 8
    assert config.layer_types == ["full_attention"] * 3 and config.attention_sinks == 0
    assert config.layer_cache_specs() == [models.LayerCacheSpec()] * 3
    assert not config.tie_word_embeddings and config.rms_norm_eps == 1e-6


def test_sliding_layers_with_sinks():
    config = checkpoint.tiny_config(num_hidden_layers=3, sliding_window=8, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"])
    assert config.attention_sinks == 4  # mlx-lm's keep, by default
    spec = config.layer_cache_spec(0)
    assert (spec.window, spec.keep, spec.max_size) == (8, 4, 12)
    assert config.layer_cache_spec(1) == models.LayerCacheSpec()
    mistral = checkpoint.tiny_config(sliding_window=16, attention_sinks=0)
    assert [s.max_size for s in mistral.layer_cache_specs()] == [16, 16]
    qwen = models.LlamaConfig.from_dict(dict(checkpoint.tiny_config().to_dict(),
                                             sliding_window=32, use_sliding_window=False))
    assert qwen.sliding_window is None and qwen.attention_sinks == 0


@pytest.mark.parametrize("values, message", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "no multiple"),
    (dict(layer_types=["full_attention"]), "2 layers"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "unknown"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_window"),
    (dict(head_dim=7), "even"),
    (dict(hidden_size=0), "hidden_size"),
])
def test_bad_configs_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.tiny_config(**values)


def test_a_config_missing_a_field_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="intermediate_size"):
        models.LlamaConfig.from_json_file(path)


def test_config_json_round_trip(tmp_path):
    config = checkpoint.tiny_config(sliding_window=8, attention_sinks=2,
                                    layer_types=["sliding_attention", "full_attention"])
    config.to_json_file(tmp_path / "config.json")
    assert models.LlamaConfig.from_json_file(tmp_path / "config.json") == config


def test_save_pretrained_reloads_identical_weights(tmp_path):
    model = models.random_model(checkpoint.tiny_config(), seed=3)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = models.load_pretrained(tmp_path)
    assert reloaded.config == model.config
    assert_same_weights(model, reloaded)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(ids), reloaded(ids))


def test_sharded_checkpoints_reload(tmp_path):
    model = models.random_model(checkpoint.tiny_config(), seed=4)
    checkpoint.save_pretrained(model, tmp_path, max_shard_bytes=64 * 1024)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == "model-00001-of-%05d.safetensors" % len(shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_weights(model, models.load_pretrained(tmp_path))


def test_tied_embeddings_have_no_lm_head(tmp_path):
    model = models.random_model(checkpoint.tiny_config(tie_word_embeddings=True), seed=5)
    model.save_pretrained(tmp_path)
    names = safetensors.load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    reloaded = models.load_pretrained(tmp_path)
    assert reloaded.lm_head is None
    assert_same_weights(model, reloaded)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_as_float32(tmp_path, dtype):
    model = models.random_model(checkpoint.tiny_config(), seed=6)
    model.save_pretrained(tmp_path, dtype=dtype)
    on_disk = safetensors.load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in on_disk.values()} == {dtype}
    reloaded = models.load_pretrained(tmp_path)
    for name, parameter in reloaded.named_parameters():
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, dict(model.named_parameters())[name].to(dtype).float())


def test_weights_that_do_not_fit_are_named(tmp_path):
    model = models.random_model(checkpoint.tiny_config(), seed=7)
    model.save_pretrained(tmp_path)
    tensors = dict(safetensors.load_file(tmp_path / "model.safetensors"))
    del tensors["model.norm.weight"]
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\].*layers.9"):
        checkpoint.load_weights(model, tensors)
    tensors = dict(safetensors.load_file(tmp_path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="model.norm.weight is \\(3,\\)"):
        checkpoint.load_weights(model, tensors)


def test_a_directory_without_weights_is_refused(tmp_path):
    checkpoint.tiny_config().to_json_file(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.load_pretrained(tmp_path)


def test_rope_scaling_kinds():
    plain = rope.inverse_frequencies(64, 500000.0)
    linear = rope.inverse_frequencies(64, 500000.0, {"type": "linear", "factor": 4.0})
    assert torch.allclose(linear, plain / 4)
    llama3 = rope.inverse_frequencies(64, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    # High frequencies kept, the lowest slowed by the whole factor.
    assert llama3[0] == plain[0] and torch.isclose(llama3[-1], plain[-1] / 8)
    with pytest.raises(ValueError, match="yarn"):
        rope.inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_the_kvcached_cache_spec_mirrors_the_local_layout():
    from kvcached.models import layout

    config = checkpoint.tiny_config(sliding_window=8, attention_sinks=3,
                                    layer_types=["sliding_attention", "full_attention"])
    spec = layout.cache_spec(config, torch.bfloat16, batch_size=2, model="tiny")
    assert spec.batch_size == 2 and spec.model == "tiny"
    assert spec.dtype == int(layout.DType.BFLOAT16)
    sliding, full = spec.layers
    assert (sliding.rotating.max_size, sliding.rotating.keep) == (11, 3)
    assert full.HasField("standard")
    assert (full.num_kv_heads, full.k_head_dim) == (2, 16)
    with pytest.raises(ValueError, match="float64"):
        layout.cache_spec(config, torch.float64)
