"""Generation with a LlamaModel and a cache_protocol cache: greedy,
seeded sampling, beam search (cache.reorder_cache) and speculative decoding
with a draft model (cache.crop).

Every function prefills the prompt in chunks of `prefill_chunk` tokens (all
at once when None), then feeds one token per step. The cache must start
empty; afterwards it holds the prompt and every generated token but the last.
"""

import dataclasses
from typing import Callable, List, Optional, Sequence, Union

import torch

from .cache_protocol import KVCache, ModelCache
from .llama import LlamaModel

Prompt = Union[torch.Tensor, Sequence[int]]


@dataclasses.dataclass
class Generation:
    """What a generation produced.

    tokens: [B, N] the new tokens. logits: where asked for, N tensors [B,
    vocab], the float32 logits each token was chosen from. accepted: for
    speculative decoding, per verification round, how many drafted tokens
    the target accepted.
    """

    tokens: torch.Tensor
    logits: Optional[List[torch.Tensor]] = None
    accepted: Optional[List[int]] = None


@dataclasses.dataclass
class BeamSearchResult:
    """sequences [num_beams, N], best first, and their summed log-probabilities."""

    sequences: torch.Tensor
    scores: torch.Tensor

    @property
    def best(self) -> torch.Tensor:
        """The highest-scoring sequence, [N]."""
        return self.sequences[0]


def as_batch(prompt: Prompt) -> torch.Tensor:
    """A prompt as LongTensor [B, L]: a list of ids or [L] is one row."""
    ids = torch.as_tensor(prompt, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError("a prompt is [L] or [B, L] token ids with L >= 1, got shape %s"
                         % (tuple(ids.shape),))
    return ids


def prefill(model: LlamaModel, cache: ModelCache, prompt: Prompt,
            prefill_chunk: Optional[int] = None) -> torch.Tensor:
    """Feeds the prompt to model and cache, prefill_chunk tokens per forward;
    returns the last token's logits, [B, vocab]."""
    ids = as_batch(prompt)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("prefill_chunk must be >= 1, got %d" % prefill_chunk)
    chunk = prefill_chunk or ids.shape[1]
    logits = None
    for piece in torch.split(ids, chunk, dim=1):
        logits = model(piece, cache, last_only=True)
    return logits[:, -1]


def _decode(model: LlamaModel, cache: ModelCache, logits: torch.Tensor, max_new_tokens: int,
            choose: Callable[[torch.Tensor], torch.Tensor], return_logits: bool) -> Generation:
    """Chooses a token from `logits` [B, vocab], feeds it, repeats: N tokens,
    N - 1 forwards (the last token is never fed)."""
    tokens: List[torch.Tensor] = []
    seen: List[torch.Tensor] = []
    for step in range(max_new_tokens):
        if step > 0:
            logits = model(tokens[-1].unsqueeze(1), cache, last_only=True)[:, -1]
        seen.append(logits)
        tokens.append(choose(logits))
    batch = logits.shape[0]
    stacked = torch.stack(tokens, dim=1) if tokens else torch.zeros((batch, 0), dtype=torch.long)
    return Generation(stacked, seen if return_logits else None)


def greedy(model: LlamaModel, prompt: Prompt, cache: ModelCache, max_new_tokens: int,
           prefill_chunk: Optional[int] = None, return_logits: bool = False) -> Generation:
    """max_new_tokens tokens, each the argmax of its logits."""
    logits = prefill(model, cache, prompt, prefill_chunk)
    return _decode(model, cache, logits, max_new_tokens, lambda row: row.argmax(-1),
                   return_logits)


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: Optional[int],
                  generator: torch.Generator) -> torch.Tensor:
    """One token per row of logits [B, vocab]: softmax(logits / temperature)
    over the top_k largest (all when None); temperature <= 0 is argmax."""
    if temperature <= 0:
        return logits.argmax(-1)
    if top_k is not None and top_k < logits.shape[-1]:
        if top_k < 1:
            raise ValueError("top_k must be >= 1, got %d" % top_k)
        threshold = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probabilities = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(1)


def sample(model: LlamaModel, prompt: Prompt, cache: ModelCache, max_new_tokens: int,
           temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
           prefill_chunk: Optional[int] = None, return_logits: bool = False) -> Generation:
    """Sampled generation, reproducible: the same seed and logits give the
    same tokens (a torch.Generator seeded with `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    logits = prefill(model, cache, prompt, prefill_chunk)
    return _decode(model, cache, logits, max_new_tokens,
                   lambda row: sample_tokens(row, temperature, top_k, generator), return_logits)


def beam_search(model: LlamaModel, prompt: Prompt, cache: KVCache, max_new_tokens: int,
                num_beams: int, prefill_chunk: Optional[int] = None) -> BeamSearchResult:
    """Beam search over summed log-probabilities (no length penalty, no end
    token) for a one-row prompt. The cache is prefilled once; its rows are
    fanned out to the beams and reordered with cache.reorder_cache whenever
    the surviving beams' parents are not the rows as they lie."""
    ids = as_batch(prompt)
    if ids.shape[0] != 1 or num_beams < 1:
        raise ValueError("beam_search takes one prompt row and num_beams >= 1")
    logits = prefill(model, cache, ids, prefill_chunk)
    sequences = torch.zeros((1, 0), dtype=torch.long)
    scores = torch.zeros(1)
    for step in range(max_new_tokens):
        if step > 0:
            logits = model(sequences[:, -1:], cache, last_only=True)[:, -1]
        total = scores.unsqueeze(1) + torch.log_softmax(logits, dim=-1)
        vocab = total.shape[1]
        scores, flat = total.view(-1).topk(min(num_beams, total.numel()))
        parents = torch.div(flat, vocab, rounding_mode="floor")
        if not torch.equal(parents, torch.arange(total.shape[0])):
            cache.reorder_cache(parents)
        sequences = torch.cat([sequences.index_select(0, parents), (flat % vocab).unsqueeze(1)],
                              dim=1)
    return BeamSearchResult(sequences, scores)


def _draft(draft: LlamaModel, draft_cache: KVCache, pending: torch.Tensor,
           count: int) -> List[torch.Tensor]:
    """count tokens the draft proposes greedily after `pending` [1]: it is
    fed pending and all proposals but the last."""
    proposals: List[torch.Tensor] = []
    token = pending
    for _ in range(count):
        token = draft(token.view(1, 1), draft_cache, last_only=True)[:, -1].argmax(-1)
        proposals.append(token)
    return proposals


def _accepted(proposals: List[torch.Tensor], choices: torch.Tensor) -> int:
    """How many leading proposals equal the target's own choices."""
    count = 0
    while count < len(proposals) and int(proposals[count]) == int(choices[count]):
        count += 1
    return count


def speculative(target: LlamaModel, draft: LlamaModel, prompt: Prompt, target_cache: KVCache,
                draft_cache: KVCache, max_new_tokens: int, draft_tokens: int = 4,
                prefill_chunk: Optional[int] = None,
                return_logits: bool = False) -> Generation:
    """Greedy speculative decoding of a one-row prompt: the draft proposes up
    to draft_tokens tokens greedily, the target checks them in one forward,
    keeps the agreeing prefix plus its own next token, and both caches are
    cropped back to what was kept. The tokens are the target's greedy ones.

    Both caches must be croppable (a rotating layer refuses once its window
    has filled: ValueError)."""
    ids = as_batch(prompt)
    if ids.shape[0] != 1 or draft_tokens < 1:
        raise ValueError("speculative takes one prompt row and draft_tokens >= 1")
    logits = prefill(target, target_cache, ids, prefill_chunk)
    prefill(draft, draft_cache, ids, prefill_chunk)
    tokens, seen, accepted = [logits.argmax(-1)], [logits], []
    # Invariant: both caches hold every token before tokens[-1] (pending).
    while len(tokens) < max_new_tokens:
        base = target_cache.get_seq_length()
        count = min(draft_tokens, max_new_tokens - len(tokens) - 1)
        fed = [tokens[-1]] + _draft(draft, draft_cache, tokens[-1], count)
        verified = target(torch.cat(fed).view(1, -1), target_cache)[0]
        choices = verified.argmax(-1)
        kept = _accepted(fed[1:], choices)
        accepted.append(kept)
        tokens += fed[1:kept + 1] + [choices[kept:kept + 1]]
        seen += [verified[i:i + 1] for i in range(kept + 1)]
        target_cache.crop(base + 1 + kept)
        _resync_draft(draft, draft_cache, fed, base + 1 + kept)
    return Generation(torch.stack(tokens, dim=1)[:, :max_new_tokens],
                      seen[:max_new_tokens] if return_logits else None, accepted)


def _resync_draft(draft: LlamaModel, draft_cache: KVCache, fed: List[torch.Tensor],
                  length: int) -> None:
    """Brings the draft's cache to `length` tokens: it holds fed[:-1] past
    the previous round's length, so it is cropped, or (all accepted) fed
    the last proposal too."""
    held = draft_cache.get_seq_length()
    if held > length:
        draft_cache.crop(length)
    elif held < length:
        draft(fed[-1].view(1, 1), draft_cache, last_only=True)
