"""Where the worker's model comes from, and the name its prefixes go under.

A Hugging Face-style directory (config.json + model.safetensors or shards,
kvcached.models.checkpoint.load_pretrained), or a tiny model with seeded
random weights (checkpoint.tiny_config and random_model) for demos and tests.

The name matters: kvcached matches prefixes per (tenant, model, layout), so
two workers share a prefix only when their names agree, and must agree only
when their weights do. A directory's name is its base name plus a digest of
its config.json and the sizes of its weight files (cheap, and different for
any other checkpoint of practical interest); a tiny model's carries its seed
and a digest of its config. --model-name overrides both.
"""

import hashlib
import json
import os
from typing import Any, Dict, Optional, Tuple

from ..models.checkpoint import load_pretrained, random_model, tiny_config
from ..models.config import LlamaConfig

# Hex digits of the digest in a model's name.
DIGEST_CHARS = 12


def _digest(*parts: bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()[:DIGEST_CHARS]


def directory_name(directory: str) -> str:
    """The prefix name of a checkpoint directory (base name, config and weight sizes)."""
    with open(os.path.join(directory, "config.json"), "rb") as file:
        config = file.read()
    sizes = sorted((name, os.path.getsize(os.path.join(directory, name)))
                   for name in os.listdir(directory) if name.endswith(".safetensors"))
    base = os.path.basename(os.path.normpath(directory))
    return "%s-%s" % (base, _digest(config, json.dumps(sizes).encode()))


def tiny_name(config: LlamaConfig, seed: int) -> str:
    """The prefix name of a seeded tiny model."""
    canonical = json.dumps(config.to_dict(), sort_keys=True).encode()
    return "tiny-seed%d-%s" % (seed, _digest(canonical))


def load_model(model_dir: Optional[str], seed: int = 0,
               tiny_overrides: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(model, prefix name): the checkpoint in `model_dir`, or where none is
    given a tiny model of `seed` (tiny_config with `tiny_overrides`)."""
    if model_dir:
        return load_pretrained(model_dir).eval(), directory_name(model_dir)
    config = tiny_config(**(tiny_overrides or {}))
    return random_model(config, seed).eval(), tiny_name(config, seed)
