"""Draft-token proposers for speculative decoding (:mod:`dsv4attn.serving.spec`).

A :class:`Drafter` sees, for every request of a decode step, all its tokens so far (prompt +
accepted output; the last one is the token the step feeds first) and proposes up to ``n``
tokens that the target model then verifies in the same step. Proposals only change speed, never
the greedy output: a wrong draft is rejected and rolled back.

- :class:`NgramDrafter` (prompt lookup): finds the most recent earlier occurrence of the
  request's last ``n`` tokens (longest ``n`` first) and proposes what followed it. No model, no
  state; good on inputs that repeat (code, documents, summaries).
- Plugging in an MTP head or a draft model: subclass :class:`Drafter`. The token lists are
  authoritative, so a stateful drafter (its own paged caches) can tell from them how many of its
  previous proposals were accepted and roll its own caches back (``PagedDeepseekV4.rollback``);
  ``release`` is called when a request leaves.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Mapping, Sequence


class Drafter(abc.ABC):
    """Proposes draft tokens; see the module docstring."""

    @abc.abstractmethod
    def propose(self, requests: Mapping[Hashable, Sequence[int]], num_tokens: Mapping[Hashable, int]
                ) -> dict[Hashable, list[int]]:
        """``requests``: id -> every token so far; ``num_tokens``: id -> most drafts wanted (>= 1).
        Returns id -> at most ``num_tokens[id]`` token ids (fewer or none is fine; missing ids
        mean none)."""

    def release(self, request_id: Hashable) -> None:
        """``request_id`` finished; drop any state held for it."""


def _positive(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: match the last ``n`` tokens (``max_ngram`` down to ``min_ngram``)
    against earlier text and propose the continuation of the most recent match.

    ``lookback``: only the last ``lookback`` tokens are searched (None: all), bounding the host
    cost per request and step at O(lookback * max_ngram).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, lookback: int | None = 4096) -> None:
        self.max_ngram = _positive("max_ngram", max_ngram)
        self.min_ngram = _positive("min_ngram", min_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.lookback = None if lookback is None else _positive("lookback", lookback)

    def propose(self, requests: Mapping[Hashable, Sequence[int]], num_tokens: Mapping[Hashable, int]
                ) -> dict[Hashable, list[int]]:
        return {rid: self.lookup(requests[rid], k) for rid, k in num_tokens.items()}

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the most recent earlier occurrence of the longest
        matching suffix n-gram of ``tokens`` (``[]`` if none)."""
        toks = list(tokens if self.lookback is None else tokens[-self.lookback:])
        L = len(toks)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pat = toks[L - n:]
            first = pat[0]
            # an occurrence starting at i is followed by toks[i + n]; i + n <= L - 1, newest first
            for i in range(L - n - 1, -1, -1):
                if toks[i] == first and toks[i:i + n] == pat:
                    return toks[i + n:i + n + k]
        return []
