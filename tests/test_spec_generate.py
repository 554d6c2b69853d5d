"""Speculative greedy generation equals transformers' greedy generate, token for token (fp32).

Oracle: ``reference_generate`` (transformers ``generate(do_sample=False)``, eager attention, one
prompt at a time). ``generate(num_speculative_tokens=k)`` must return the same tokens for every
k in 1..4 whatever the drafts: a noisy oracle drafter (the true continuation with ~40% of the
tokens replaced) makes every verify step accept some drafts and reject others, so rollbacks
happen at every offset, across the 4- and 128-entry boundaries (prompts of 5, 126 and 129
tokens, 12 new tokens), in steps that mix verify decodes with prompt chunks and with requests
joining and leaving. fp32 differences between a verify step and one-token steps are ~1e-6
relative, far below the logit gaps of the random model, so equality must be exact.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from dsv4attn.serving.drafter import Drafter, NgramDrafter
from dsv4attn.serving.model import PagedDeepseekV4, reference_generate
from dsv4attn.serving.spec import SpecStats, accept_greedy
from dsv4attn.serving.cli import random_prompts
from dsv4attn.serving.tiny import tiny_hf_model

LENGTHS = (5, 126, 129)
NEW = 12


class NoisyOracleDrafter(Drafter):
    """Proposes the oracle's continuation, each token replaced by a random one with ``p_wrong``."""

    def __init__(self, prompts, refs, p_wrong=0.4, seed=0, vocab=256):
        self.by_prompt = {tuple(p): r for p, r in zip(prompts, refs)}
        self.rng, self.p, self.vocab = random.Random(seed), p_wrong, vocab
        self.released = []

    def propose(self, requests, num_tokens):
        out = {}
        for rid, n in num_tokens.items():
            toks = list(requests[rid])
            prompt = next(p for p in self.by_prompt if tuple(toks[:len(p)]) == p)
            ref = self.by_prompt[prompt]
            done = len(toks) - len(prompt)
            d = ref[done:done + n]
            out[rid] = [self.rng.randrange(self.vocab) if self.rng.random() < self.p else t for t in d]
        return out

    def release(self, request_id):
        self.released.append(request_id)


def _prompts(lengths, seed=1, vocab=256):
    return random_prompts(len(lengths), vocab, seed, lengths)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_hf_model(0)
    prompts = _prompts(LENGTHS)
    return model, prompts, reference_generate(model, prompts, NEW)


def _impl(device):
    return "auto" if device.type == "cuda" else "reference"


# k, token budget, chunk size, live requests: plain steps, verify decodes mixed with prompt
# chunks, requests joining/leaving (2 live), small chunks
CASES = [(1, 512, None, 4), (2, 64, 32, 4), (3, 512, None, 2), (4, 48, 24, 3)]


@pytest.mark.parametrize("k,budget,chunk,max_reqs", CASES)
def test_speculative_greedy_equals_transformers(tiny, device, k, budget, chunk, max_reqs):
    model, prompts, want = tiny
    pm = PagedDeepseekV4(model.to(device), max_model_len=256, max_num_batched_tokens=512, max_num_reqs=max_reqs,
                         impl=_impl(device), num_speculative_tokens=4)
    drafter = NoisyOracleDrafter(prompts, want, seed=k)
    got, stats = pm.generate(prompts, NEW, token_budget=budget, chunk_size=chunk, num_speculative_tokens=k,
                             drafter=drafter, return_stats=True)
    model.to("cpu")
    assert got == want
    assert isinstance(stats, SpecStats) and stats.generated == len(prompts) * NEW
    assert 0 < stats.accepted < stats.drafted  # both verify outcomes happened
    assert stats.decode_steps + stats.accepted == stats.generated - len(prompts)  # prefill gives 1 each
    assert max(stats.accepted_per_step) <= k and 0.0 < stats.acceptance_rate < 1.0
    assert sorted(drafter.released) == [("generate", i) for i in range(len(prompts))]
    assert pm.requests == [] and all(p.num_free == p.num_blocks for p in pm.engine.manager.pools.values())


def test_ngram_drafter_generate_and_k0_unchanged(tiny):
    """Prompt lookup on the real model: same tokens (k = 2, and k = 0 through the same path)."""
    model, prompts, want = tiny
    pm = PagedDeepseekV4(model, max_model_len=256, impl="reference", num_speculative_tokens=2)
    assert pm.generate(prompts, NEW, num_speculative_tokens=2) == want
    got, stats = pm.generate(prompts, NEW, num_speculative_tokens=0, return_stats=True)
    assert got == want and stats.drafted == 0 and stats.decode_steps == len(prompts) * (NEW - 1)


def test_generate_refuses_bad_speculation_arguments(tiny):
    model, prompts, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=256, impl="reference", num_speculative_tokens=1)
    with pytest.raises(ValueError, match="num_speculative_tokens=2 exceeds"):
        pm.generate(prompts, 2, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        pm.generate(prompts, 2, num_speculative_tokens=-1)
    with pytest.raises(TypeError, match="Drafter"):
        pm.generate(prompts, 2, num_speculative_tokens=1, drafter=lambda toks, n: [])

    class Bad(Drafter):
        def propose(self, requests, num_tokens):
            return {rid: [999] for rid in num_tokens}

    with pytest.raises(ValueError, match="drafter proposed"):
        pm.generate(prompts, 3, num_speculative_tokens=1, drafter=Bad())
    assert pm.requests == [] and not pm.engine.in_step  # the failed run left nothing behind
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PagedDeepseekV4(model, max_model_len=256, num_speculative_tokens=8)


def test_ngram_lookup_and_accept_rule():
    d = NgramDrafter(max_ngram=3, min_ngram=1)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # longest match "1 2 3" -> what followed
    assert d.lookup([5, 1, 2, 7, 1, 2, 8, 2], 2) == [8, 2]  # only "2" matches: its newest occurrence
    assert d.lookup([4, 5, 6], 2) == [] and d.lookup([7], 3) == []
    assert d.lookup([1, 1, 1, 1], 5) == [1]  # the continuation ends at the last token
    assert d.propose({"r": [3, 4, 3]}, {"r": 2}) == {"r": [4, 3]}
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
    assert accept_greedy([4, 5, 6], [4, 5, 7, 9]) == 2
    assert accept_greedy([], [3]) == 0 and accept_greedy([1, 2], [1, 2, 3]) == 2 and accept_greedy([2], [1, 2]) == 0


def test_verify_step_logits_equal_one_token_steps(tiny):
    """The logits of a 1 + 4 token decode step equal those of five one-token steps (fp32, up
    to rounding): the new tokens of a request are causally masked among themselves."""
    model, prompts, _ = tiny
    pm = PagedDeepseekV4(model, max_model_len=256, impl="reference", num_speculative_tokens=4)
    seq = prompts[1] + [7, 8, 9, 10, 11]  # positions 126..130 cross the 128 entry
    pm.step({"a": prompts[1], "b": prompts[1]})
    plan = pm.begin_step({"a": seq[126:131]})
    assert plan.metadata.batch.num_decodes == 1 and plan.metadata.batch.num_decode_tokens == 5
    multi = pm.forward_step(all_tokens=True)
    pm.end_step()
    single = torch.stack([pm.step({"b": [t]})["b"] for t in seq[126:131]])
    assert (multi - single).abs().max() <= 1e-4 * single.abs().max()
    pm.rollback("a", 4)  # keep one token, then feed the rest as one-token steps: same logits again
    pm.commit("a")
    again = torch.stack([pm.step({"a": [t]})["a"] for t in seq[127:131]])
    assert (again - single[1:]).abs().max() <= 1e-4 * single.abs().max()


def test_cli_num_speculative_tokens(capsys, tmp_path):
    """``python -m dsv4attn generate --num-speculative-tokens 2 --check``: PASS (same tokens as
    transformers) and the acceptance summary line."""
    import json

    from dsv4attn.serving import cli

    f = tmp_path / "p.json"
    f.write_text(json.dumps([[3, 1, 4, 1, 5], list(range(20)) * 3]))  # repeats: prompt lookup finds matches
    rc = cli.main(["generate", "--tiny", "1", "--prompts", str(f), "--max-new-tokens", "6", "--check",
                   "--no-progress", "--device", "cpu", "--num-speculative-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "speculative decoding k=2" in out and "accepted" in out
