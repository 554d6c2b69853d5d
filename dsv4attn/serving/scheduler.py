"""Continuous batching for greedy generation over :class:`dsv4attn.serving.model.PagedDeepseekV4`.

Every step: one decode token for each running request whose prompt is in the caches, then
prompt chunks (at most ``chunk_size`` tokens each) until the token budget is spent, first for
running requests still prefilling, then for waiting requests that may join. A request joins
when a live slot is free and the context-sized cache group can hold its whole final length on
top of what the running requests reserved (so a running request never runs out of blocks and
nothing is ever preempted); it leaves (blocks freed) as soon as it has its tokens.

With the model's prefix cache on (``PagedDeepseekV4(max_cached_prefixes=N)``): a joining request
whose prompt starts with a cached prefix starts from its hold and feeds only the rest; prompt
chunks end at multiples of the prefix granule where they can, and every granule boundary a step
passes is saved (:mod:`dsv4attn.serving.prefix_cache`). Admission then counts real free blocks:
the running requests' remaining reservations plus the newcomer's (less the columns it shares)
must fit in the free blocks, after giving least recently used holds back if needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    fed: int = 0  # tokens in the caches (or in the step being run)
    out: list[int] = field(default_factory=list)
    reserve: int = 0  # main-group blocks reserved for the final length


class ContinuousBatcher:
    """Runs ``generate`` for one :class:`PagedDeepseekV4`; see the module docstring."""

    def __init__(self, model, token_budget: int | None = None, chunk_size: int | None = None) -> None:
        eng = model.engine
        budget = eng.max_num_batched_tokens if token_budget is None else token_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= eng.max_num_batched_tokens:
            raise ValueError(f"token_budget must be an int in [1, max_num_batched_tokens={eng.max_num_batched_tokens}]"
                             f", got {token_budget!r}")
        chunk = budget if chunk_size is None else chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.model, self.engine, self.budget, self.chunk = model, eng, budget, chunk
        self.cache = getattr(model, "prefix_cache", None)  # a PrefixCache, or None (off)

    def _blocks_for(self, num_tokens: int) -> int:
        return self.engine.blocks_to_reserve(num_tokens)

    def _admit(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[_Request]:
        """The start of every ``run``: :meth:`_requests`, then (when there is work) refuse to
        start while requests of an earlier generate() are still live in the engine."""
        reqs = self._requests(prompts, max_new_tokens)
        if max_new_tokens:
            clashes = [rid for rid in self.engine.requests if isinstance(rid, tuple) and rid[:1] == ("generate",)]
            if clashes:
                raise RuntimeError(f"requests {clashes} of an earlier generate() are still live")
        return reqs

    def _requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[_Request]:
        """Validate the prompts and build their requests, each with its main-group reservation."""
        eng = self.engine
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of lists of token ids, got {type(prompts).__name__}")
        vocab = self.model.config.vocab_size
        capacity = eng.num_blocks[eng.main_group]
        reqs = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids")
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}] holds {bad[0]!r}: token ids are ints in [0, {vocab})")
            final = len(p) + max(max_new_tokens - 1, 0)  # the last new token is never fed back
            if final > eng.max_model_len:
                raise ValueError(f"prompts[{i}] needs {final} tokens > max_model_len={eng.max_model_len}")
            r = _Request(i, list(p), reserve=self._blocks_for(final))
            if r.reserve > capacity:
                raise ValueError(f"prompts[{i}] needs {r.reserve} blocks of {eng.main_group!r} for {final} tokens, the "
                                 f"cache has {capacity}: raise num_blocks or memory_bytes")
            reqs.append(r)
        return reqs

    def _fill_prefills(self, running: list[_Request], waiting: list[_Request], tokens: dict, budget: int,
                       reserved: int) -> tuple[int, int]:
        """Add prompt chunks to ``tokens`` until ``budget`` is spent: running requests still
        prefilling first, then waiting requests that may join (a free slot and room for their
        reservation). Returns the budget and reservation left."""
        eng = self.engine
        for r in running:
            if r.fed < len(r.prompt) and budget > 0:
                n = self._chunk(r, budget)
                tokens[r.rid] = r.prompt[r.fed:r.fed + n]
                budget -= n
        while waiting and budget > 0 and len(running) < eng.max_num_reqs:
            r = waiting[0]
            hit, hold = self._lookup(r)
            if not self._fits(r, running, reserved, hit, hold):
                break
            waiting.pop(0)
            running.append(r)
            reserved += r.reserve
            if hold is not None:
                assert self.cache is not None
                self.model.add_request(("generate", r.rid), hold)
                self.cache.use(hold, hit)
                r.fed = hit
            n = self._chunk(r, budget)
            tokens[r.rid] = r.prompt[r.fed:r.fed + n]
            budget -= n
        if not tokens:
            raise RuntimeError("no request could be scheduled (token budget or cache too small)")
        return budget, reserved

    def _chunk(self, r: _Request, budget: int) -> int:
        """Prompt tokens ``r`` feeds next: at most ``chunk_size`` and the budget; with the prefix
        cache on, cut back to a granule boundary when the chunk passes one short of the prompt's end."""
        n = min(self.chunk, budget, len(r.prompt) - r.fed)
        end = r.fed + n
        if self.cache is not None and end < len(r.prompt):
            g = self.cache.granule
            if end // g * g > r.fed:
                n = end // g * g - r.fed
        return n

    def _lookup(self, r: _Request):
        """``(tokens, hold)`` of the longest cached prefix of ``r``'s prompt short of its last token."""
        if self.cache is None:
            return 0, None
        self.cache.stats.lookups += 1
        return self.cache.lookup(r.prompt, len(r.prompt) - 1)

    def _fits(self, r: _Request, running: list[_Request], reserved: int, hit: int, hold) -> bool:
        """Whether ``r`` may join: without the prefix cache, its reservation on top of the running
        ones fits the context-sized pool; with it, the blocks every running request may still take
        plus ``r``'s (less the columns it shares) fit the free blocks, after giving least recently
        used holds back (never ``hold``, the one ``r`` would start from)."""
        eng = self.engine
        if self.cache is None:
            return reserved + r.reserve <= eng.num_blocks[eng.main_group]
        pending = 0
        for q in running:
            rid = ("generate", q.rid)
            have = eng.blocks_to_reserve(eng.manager.num_tokens(rid)) if rid in eng.manager else 0
            pending += max(0, q.reserve - have)
        need = pending + max(0, r.reserve - eng.blocks_to_reserve(hit))
        while need > eng.num_free_blocks() and self.cache.evict_one(keep=hold):
            pass
        return need <= eng.num_free_blocks()

    def _save_prefixes(self, tokens: dict, running: list[_Request], behind: int = 0) -> None:
        """Inside a step after every layer ran: hold every granule boundary the step's tokens
        reached, up to ``behind`` tokens short of each request's step end (speculative steps:
        drafts are not verified yet)."""
        for r in running:
            if r.rid in tokens:
                self._save_range(r, r.fed, r.fed + len(tokens[r.rid]) - behind)

    def _save_range(self, r: _Request, lo: int, hi: int) -> None:
        """Hold the granule boundaries ``h`` with ``lo < h <= hi`` of ``r``'s fed tokens (prompt,
        then outputs)."""
        if self.cache is None:
            return
        g = self.cache.granule
        first = (lo // g + 1) * g
        if first > hi:
            return
        seq = r.prompt + r.out
        for h in range(first, min(hi, len(seq)) + 1, g):
            self.cache.save(("generate", r.rid), seq, h)

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None = None,
            progress: Callable[[int], None] | None = None) -> list[list[int]]:
        reqs = self._admit(prompts, max_new_tokens)
        if not max_new_tokens:
            return [[] for _ in reqs]
        waiting, running = list(reqs), list[_Request]()
        reserved = 0
        while waiting or running:
            tokens: dict = {}
            budget = self.budget
            for r in running:
                if r.fed >= len(r.prompt) and budget > 0:
                    tokens[r.rid] = [r.out[-1]]
                    budget -= 1
            budget, reserved = self._fill_prefills(running, waiting, tokens, budget, reserved)
            if self.cache is None:
                logits = self.model.step({("generate", rid): t for rid, t in tokens.items()})
            else:
                plan = self.model.begin_step({("generate", rid): t for rid, t in tokens.items()})
                out = self.model.forward_step()
                self._save_prefixes(tokens, running)
                self.model.end_step()
                logits = {rid: out[i] for i, rid in enumerate(plan.order)}
            done = []
            for r in running:
                if r.rid not in tokens:
                    continue
                r.fed += len(tokens[r.rid])
                if r.fed >= len(r.prompt):  # this step fed the prompt's end or a decode token
                    r.out.append(int(logits[("generate", r.rid)].argmax()))
                    if len(r.out) >= max_new_tokens or (eos_token_id is not None and r.out[-1] == eos_token_id):
                        done.append(r)
            for r in done:
                running.remove(r)
                reserved -= r.reserve
                self.model.free(("generate", r.rid))
            if progress is not None:
                progress(sum(len(t) for t in tokens.values()))
        return [r.out for r in reqs]
