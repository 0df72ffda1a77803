"""Hugging Face-style checkpoint directories for LlamaModel, and seeded
random models for tests.

    directory/config.json                     LlamaConfig
    directory/model.safetensors               every weight, or sharded:
    directory/model.safetensors.index.json    {"weight_map": {name: shard file}}
    directory/model-00001-of-00002.safetensors ...

Weights are read over a private map of each file (safetensors.py) and cast
to float32 into the model's parameters: one copy, nothing else held.
"""

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from . import safetensors
from .config import LlamaConfig
from .llama import LlamaModel

PathLike = Union[str, os.PathLike]
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Weights some HF checkpoints carry that this model computes instead.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _shard_files(directory: PathLike) -> List[str]:
    """The safetensors files of a checkpoint: the one file, or the index's shards."""
    single = os.path.join(directory, WEIGHTS_FILE)
    if os.path.exists(single):
        return [single]
    index_path = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index_path):
        raise FileNotFoundError("%s holds neither %s nor %s"
                                % (os.fspath(directory), WEIGHTS_FILE, INDEX_FILE))
    with open(index_path, encoding="utf-8") as file:
        weight_map = json.load(file).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError("%s has no weight_map object" % index_path)
    return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]


def _checkpoint_tensors(directory: PathLike) -> Iterator[Tuple[str, torch.Tensor]]:
    for path in _shard_files(directory):
        yield from safetensors.load_file(path).items()


def load_weights(model: LlamaModel, tensors: Dict[str, torch.Tensor]) -> None:
    """Copies named tensors (HF names) into the model's parameters, cast to
    float32. Raises ValueError naming missing, unexpected or misshapen weights."""
    parameters = dict(model.named_parameters())
    tied = model.lm_head is None
    unexpected = sorted(name for name in tensors if name not in parameters
                        and not name.endswith(_IGNORED_SUFFIXES)
                        and not (tied and name == "lm_head.weight"))
    missing = sorted(name for name in parameters if name not in tensors)
    if unexpected or missing:
        raise ValueError("checkpoint weights do not fit the config: missing %s, unexpected %s"
                         % (missing or "none", unexpected or "none"))
    for name, parameter in parameters.items():  # all checked before any is copied
        if tuple(tensors[name].shape) != tuple(parameter.shape):
            raise ValueError("weight %s is %s, the config makes it %s"
                             % (name, tuple(tensors[name].shape), tuple(parameter.shape)))
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(tensors[name])


def load_pretrained(directory: PathLike) -> LlamaModel:
    """A LlamaModel from config.json and model.safetensors (or its shards)."""
    config = LlamaConfig.from_json_file(os.path.join(directory, CONFIG_FILE))
    model = LlamaModel(config)
    load_weights(model, dict(_checkpoint_tensors(directory)))
    return model.eval()


def _state_to_save(model: LlamaModel, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    return {name: parameter.detach().to(dtype)
            for name, parameter in model.named_parameters()}


def _shards(tensors: Dict[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """Names grouped into shards of at most max_shard_bytes (a bigger
    tensor alone in its shard), in name order, as HF splits them."""
    shards: List[List[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_pretrained(model: LlamaModel, directory: PathLike, dtype: torch.dtype = torch.float32,
                    max_shard_bytes: Optional[int] = None) -> None:
    """Writes config.json and the weights (in `dtype`) as HF does: one
    model.safetensors, or shards and their index past max_shard_bytes."""
    os.makedirs(directory, exist_ok=True)
    model.config.to_json_file(os.path.join(directory, CONFIG_FILE),
                              torch_dtype=str(dtype).replace("torch.", ""))
    tensors = _state_to_save(model, dtype)
    metadata = {"format": "pt"}
    shards = _shards(tensors, max_shard_bytes) if max_shard_bytes else [sorted(tensors)]
    if len(shards) == 1:
        safetensors.save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata)
        return
    weight_map: Dict[str, str] = {}
    for number, names in enumerate(shards, start=1):
        file_name = "model-%05d-of-%05d.safetensors" % (number, len(shards))
        safetensors.save_file({name: tensors[name] for name in names},
                              os.path.join(directory, file_name), metadata)
        weight_map.update((name, file_name) for name in names)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)


def tiny_config(**overrides: Any) -> LlamaConfig:
    """A small config for tests: 2 layers, hidden 64, 4 query and 2 KV heads
    (grouped-query), vocab 256; any field can be overridden."""
    values: Dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=4096, rope_theta=10000.0)
    values.update(overrides)
    return LlamaConfig(**values)


def random_model(config: LlamaConfig, seed: int = 0) -> LlamaModel:
    """A LlamaModel with seeded random weights, scaled so activations and
    logits stay O(1): distinct logits, so greedy choices are no near-ties
    that rounding could flip between two ways of computing them."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(parameter.shape, generator=generator)
            elif name.endswith("bias"):
                values = 0.1 * torch.randn(parameter.shape, generator=generator)
            elif name == "model.embed_tokens.weight":
                values = torch.randn(parameter.shape, generator=generator)
            else:  # [out, in]: unit variance out for unit variance in
                scale = parameter.shape[1] ** -0.5
                values = scale * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(values)
    return model.eval()
