"""A model worker whose KV cache lives in kvcached, sharing prefixes with
other workers: `python -m kvcached.worker --help` (cli.py).

- session.py: one request (system + user prompt -> greedy tokens), the
  system prompt's K/V looked up, restored and published through kvcached;
  time to first token with and without the hit.
- model_source.py: a checkpoint directory or a seeded tiny model, and the
  name its prefixes are shared under.
- tokenizer.py: a byte-level tokenizer, so that prompts can be text.

torch is required here (Debian's python3-torch), as in kvcached.models.
"""

from .model_source import load_model
from .session import LOCAL, MODES, ServeResult, open_cache, serve, warm_up
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "LOCAL", "MODES", "ServeResult", "load_model", "open_cache",
           "serve", "warm_up"]
