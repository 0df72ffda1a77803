"""Generation against LocalCache: greedy equals argmax over no-cache
forwards; seeded sampling is reproducible; one beam is greedy, several
score their sequences correctly; speculative decoding is greedy decoding,
token for token, whatever the draft proposes."""

import pytest

torch = pytest.importorskip("torch")

from kvcached import models  # noqa: E402 (after the torch check)
from kvcached.models import tiny_config  # noqa: E402

SLIDING = tiny_config(num_hidden_layers=3, sliding_window=6, attention_sinks=2,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"])
PROMPT = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model():
    return models.random_model(tiny_config(num_hidden_layers=3), seed=21)


def cache_for(model, **kwargs):
    return models.LocalCache.for_model(model.config, **kwargs)


def no_cache_greedy(model, prompt, steps):
    """Greedy tokens by re-running the whole sequence each step (no cache)."""
    ids = prompt
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompt.shape[1]:]


@pytest.mark.parametrize("config", [None, SLIDING], ids=["full", "sliding"])
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_greedy_is_argmax_of_no_cache_forwards(model, config, prefill_chunk):
    if config is not None:
        model = models.random_model(config, seed=22)
    out = models.greedy(model, PROMPT, cache_for(model), 16, prefill_chunk, return_logits=True)
    assert torch.equal(out.tokens, no_cache_greedy(model, PROMPT, 16))
    assert len(out.logits) == 16 and out.logits[0].shape == (1, 256)
    assert torch.equal(torch.stack(out.logits, 1).argmax(-1), out.tokens)


def test_greedy_on_a_batch(model):
    prompts = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(2))
    out = models.greedy(model, prompts, cache_for(model), 5)
    assert out.tokens.shape == (3, 5)
    for row in range(3):
        assert torch.equal(out.tokens[row:row + 1], no_cache_greedy(model, prompts[row:row + 1], 5))


def test_a_cache_ends_holding_all_but_the_last_token(model):
    cache = cache_for(model)
    models.greedy(model, PROMPT, cache, 6)
    assert cache.get_seq_length() == PROMPT.shape[1] + 5


def test_sampling_is_reproducible_by_seed(model):
    def run(seed, **kwargs):
        return models.sample(model, PROMPT, cache_for(model), 12, seed=seed, **kwargs).tokens

    assert torch.equal(run(5, temperature=1.5), run(5, temperature=1.5))
    assert not torch.equal(run(5, temperature=1.5), run(6, temperature=1.5))
    greedy = models.greedy(model, PROMPT, cache_for(model), 12).tokens
    assert torch.equal(run(7, top_k=1), greedy)
    assert torch.equal(run(7, temperature=0.0), greedy)


def test_top_k_samples_only_the_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0, 3.0]])
    generator = torch.Generator().manual_seed(0)
    drawn = {int(models.generate.sample_tokens(logits, 5.0, 2, generator)) for _ in range(200)}
    assert drawn == {1, 2}


@pytest.mark.parametrize("config", [None, SLIDING], ids=["full", "sliding"])
def test_one_beam_is_greedy(model, config):
    if config is not None:
        model = models.random_model(config, seed=23)
    beams = models.beam_search(model, PROMPT, cache_for(model), 14, num_beams=1)
    greedy = models.greedy(model, PROMPT, cache_for(model), 14).tokens
    assert torch.equal(beams.best.unsqueeze(0), greedy)


def sequence_log_probability(model, prompt, continuation):
    ids = torch.cat([prompt, continuation.unsqueeze(0)], dim=1)
    log_probs = torch.log_softmax(model(ids)[0, prompt.shape[1] - 1:-1], dim=-1)
    return log_probs.gather(1, continuation.unsqueeze(1)).sum()


@pytest.mark.parametrize("config", [None, SLIDING], ids=["full", "sliding"])
def test_beams_score_their_sequences(model, config):
    """Each beam's score is its sequence's log-probability under a no-cache
    forward, so reorder_cache gave every beam its own history."""
    if config is not None:
        model = models.random_model(config, seed=24)
    cache = cache_for(model)
    beams = models.beam_search(model, PROMPT, cache, 10, num_beams=4, prefill_chunk=3)
    assert beams.sequences.shape == (4, 10) and cache.batch_size == 4
    assert torch.all(beams.scores[:-1] >= beams.scores[1:])
    for sequence, score in zip(beams.sequences, beams.scores):
        assert torch.isclose(sequence_log_probability(model, PROMPT, sequence), score, atol=1e-4)
    assert len({tuple(s.tolist()) for s in beams.sequences}) == 4


def perturbed(model, scale, seed):
    """A draft: the model's weights plus noise (so it agrees only sometimes)."""
    draft = models.LlamaModel(model.config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for theirs, mine in zip(model.parameters(), draft.parameters()):
            mine.copy_(theirs + scale * theirs.std() * torch.randn(theirs.shape,
                                                                  generator=generator))
    return draft.eval()


@pytest.mark.parametrize("draft_kind", ["itself", "perturbed", "unrelated"])
@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_speculative_decoding_is_greedy(model, draft_kind, draft_tokens):
    draft = {"itself": model, "perturbed": perturbed(model, 0.05, 31),
             "unrelated": models.random_model(tiny_config(num_hidden_layers=1), seed=32)
             }[draft_kind]
    greedy = models.greedy(model, PROMPT, cache_for(model), 20, return_logits=True)
    target_cache, draft_cache = cache_for(model), cache_for(draft)
    out = models.speculative(model, draft, PROMPT, target_cache, draft_cache, 20,
                             draft_tokens=draft_tokens, prefill_chunk=4, return_logits=True)
    assert torch.equal(out.tokens, greedy.tokens)
    for theirs, mine in zip(greedy.logits, out.logits):
        assert torch.allclose(theirs, mine, rtol=1e-4, atol=1e-5)
    assert target_cache.get_seq_length() == draft_cache.get_seq_length() == 11 + 19
    if draft_kind == "itself":
        assert all(count == min(draft_tokens, 19) for count in out.accepted[:-1])
    if draft_kind == "perturbed" and draft_tokens > 1:
        assert max(out.accepted) > 0 and min(out.accepted) < draft_tokens  # both paths ran


def test_speculative_decoding_with_sliding_layers_before_they_fill():
    """Crop works on rotating layers until their window fills (mlx-lm's
    trimmable rule); a longer run refuses rather than rewind a ring."""
    model = models.random_model(tiny_config(sliding_window=40, attention_sinks=2), seed=33)
    draft = perturbed(model, 0.3, 34)
    greedy = models.greedy(model, PROMPT, cache_for(model), 20).tokens
    out = models.speculative(model, draft, PROMPT, cache_for(model), cache_for(draft), 20, 3)
    assert torch.equal(out.tokens, greedy)
    with pytest.raises(ValueError, match="has filled"):
        models.speculative(model, draft, PROMPT, cache_for(model), cache_for(draft), 60, 3)
