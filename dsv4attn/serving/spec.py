"""Speculative decoding (draft and verify) over :class:`dsv4attn.serving.model.PagedDeepseekV4`.

A decode step of a running request feeds ``[last token, d_1 .. d_m]`` (``m <= k`` drafts from a
:class:`dsv4attn.serving.drafter.Drafter`); the engine treats up to ``1 + k`` new tokens per
request as a decode (``decode_threshold``), and every query token has its own candidate set
(SWA window ending at its own position, compressed entries ``< (p + 1) // r``), so the request's
new tokens are causally masked among themselves. The model's greedy token after each fed token
verifies the next draft: the first ``a`` drafts that equal it are accepted, the token after them
is the bonus, and the ``m - a`` rejected drafts are rolled back (``PagedDeepseekV4.rollback``:
bookkeeping and trailing blocks only, see :meth:`PagedAttentionEngine.rollback`) before the
request's tokens are committed. Greedy output is identical to plain decoding.

Scheduling is :class:`dsv4attn.serving.scheduler.ContinuousBatcher`'s: decodes first (each
``1 + m`` tokens), then prompt chunks, then joining requests; drafts never take a request past
``max_new_tokens`` (so the join-time block reservation still holds) nor past the step budget.
With CUDA graphs enabled (``PagedDeepseekV4.enable_cuda_graphs``) short proposals are padded to
the full draft count (repeating their last token), so that decode steps are uniform verify steps
``1 + k`` tokens per request, which replay captured graphs; a padded draft is verified like any
other (it is accepted only if it is the model's own greedy token).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsv4attn.serving.drafter import Drafter, NgramDrafter
from dsv4attn.serving.scheduler import ContinuousBatcher, _Request

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters of one speculative ``generate`` (decode steps only count verify work)."""

    num_speculative_tokens: int
    steps: int = 0
    decode_steps: int = 0  # (request, step) pairs that verified drafts or decoded one token
    drafted: int = 0  # draft tokens fed for verification
    accepted: int = 0  # of which accepted
    generated: int = 0  # new tokens returned
    tokens_processed: int = 0  # tokens fed through the model (prompts, decodes, drafts)
    seconds: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list, repr=False)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_decode(self) -> float:
        """New tokens per (request, decode step): 1 + accepted drafts on average."""
        return (self.decode_steps + self.accepted) / self.decode_steps if self.decode_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (f"speculative decoding k={self.num_speculative_tokens}: {self.generated} tokens in {self.steps} steps, "
                f"{self.seconds:.2f} s ({self.tokens_per_second:.1f} tokens/s); drafted {self.drafted}, accepted "
                f"{self.accepted} ({100 * self.acceptance_rate:.1f}%), {self.tokens_per_decode:.2f} tokens per decode")


def accept_greedy(drafts: Sequence[int], predicted: Sequence[int]) -> int:
    """Drafts accepted by greedy verification: the longest prefix with ``drafts[i] ==
    predicted[i]`` (``predicted[i]``: the model's argmax after the i-th fed token)."""
    a = 0
    while a < len(drafts) and drafts[a] == predicted[a]:
        a += 1
    return a


class SpeculativeBatcher(ContinuousBatcher):
    """Greedy ``generate`` with draft-and-verify decode steps; see the module docstring.

    ``num_speculative_tokens``: drafts per request and step (0 .. the model's
    ``num_speculative_tokens``); ``drafter``: default :class:`NgramDrafter`. After ``run``,
    ``stats`` holds a :class:`SpecStats`. With the model's prefix cache on, prompt boundaries
    are held inside the step (all but the last k tokens of a chunk) and the rest after each
    verification's rollback, before its commit (holding accepts the tokens).
    """

    def __init__(self, model, num_speculative_tokens: int, drafter: Drafter | None = None,
                 token_budget: int | None = None, chunk_size: int | None = None) -> None:
        eng = model.engine
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        if k > eng.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens={k} exceeds the model's {eng.num_speculative_tokens}: build "
                             f"PagedDeepseekV4(..., num_speculative_tokens={k}) (it sizes the rollback headroom)")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a dsv4attn.serving.drafter.Drafter, got {type(drafter).__name__}")
        super().__init__(model, token_budget, chunk_size)
        self.k = k
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.stats = SpecStats(k)

    def _drafts(self, decodes: list[_Request], budget: int, max_new_tokens: int) -> dict[int, list[int]]:
        """Drafts per decoding request: at most k, never past max_new_tokens, within the budget."""
        want: dict = {}
        spare = budget - len(decodes)  # every decode feeds its last token first
        for r in decodes:
            n = min(self.k, max_new_tokens - len(r.out) - 1, spare)
            if n > 0:
                want[("generate", r.rid)] = n
                spare -= n
        if not want:
            return {}
        by_rid = {("generate", r.rid): r for r in decodes}
        got = self.drafter.propose({rid: by_rid[rid].prompt + by_rid[rid].out for rid in want}, want)
        if not isinstance(got, dict):
            raise TypeError(f"drafter.propose must return a dict, got {type(got).__name__}")
        vocab, out, pad = self.model.config.vocab_size, {}, self.engine.graphs is not None
        for rid, n in want.items():
            d = got.get(rid, [])
            if isinstance(d, (str, bytes)) or not isinstance(d, Sequence) or len(d) > n or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in d):
                raise ValueError(f"drafter proposed {d!r} for {rid!r}: expected at most {n} token ids in [0, {vocab})")
            d = list(d)
            if pad:  # uniform verify steps replay the captured graphs
                d += [d[-1] if d else by_rid[rid].out[-1]] * (n - len(d))
            out[by_rid[rid].rid] = d
        return out

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int | None = None,
            progress: Callable[[int], None] | None = None) -> list[list[int]]:
        eng, model, st = self.engine, self.model, self.stats
        reqs = self._admit(prompts, max_new_tokens)
        if not max_new_tokens:
            return [[] for _ in reqs]
        waiting, running, reserved = list(reqs), list[_Request](), 0
        sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        try:
            while waiting or running:
                tokens: dict = {}
                budget = self.budget
                decodes = [r for r in running if r.fed >= len(r.prompt)][:budget]
                drafts = self._drafts(decodes, budget, max_new_tokens)
                for r in decodes:
                    tokens[r.rid] = [r.out[-1]] + drafts.get(r.rid, [])
                    budget -= len(tokens[r.rid])
                budget, reserved = self._fill_prefills(running, waiting, tokens, budget, reserved)
                plan = model.begin_step({("generate", rid): t for rid, t in tokens.items()})
                offsets = plan.offsets()
                rows: list[int] = []
                where: dict[int, tuple[int, int]] = {}
                by_id = {r.rid: r for r in running}
                for rid in tokens:
                    r = by_id[rid]
                    o, n = offsets[("generate", rid)]
                    if r.fed >= len(r.prompt):  # decode: logits after every fed token
                        where[rid] = (len(rows), n)
                        rows.extend(range(o, o + n))
                    elif r.fed + n >= len(r.prompt):  # the prompt's end: logits of its last token
                        where[rid] = (len(rows), 1)
                        rows.append(o + n - 1)
                logits = model.forward_step(rows=rows)  # runs every layer (fills the caches) even if no row is asked
                self._save_prefixes({rid: t for rid, t in tokens.items() if by_id[rid].fed < len(by_id[rid].prompt)},
                                    running, behind=eng.num_speculative_tokens)
                model.end_step()
                pred = logits.argmax(dim=-1).tolist()
                done = []
                for r in running:
                    if r.rid not in tokens:
                        continue
                    fed = tokens[r.rid]
                    before = r.fed
                    if r.rid not in where:  # a prompt chunk that does not end the prompt
                        r.fed += len(fed)
                        self._save_range(r, max(before, r.fed - eng.num_speculative_tokens), r.fed)
                        continue
                    i, n = where[r.rid]
                    p = pred[i:i + n]
                    if r.fed >= len(r.prompt):  # verify: fed = [last, d_1 .. d_m]
                        d = fed[1:]
                        a = accept_greedy(d, p)
                        if len(d) - a:
                            model.rollback(("generate", r.rid), len(d) - a)
                        st.decode_steps += 1
                        st.drafted += len(d)
                        st.accepted += a
                        st.accepted_per_step.append(a)
                        new = p[:a + 1]
                        r.fed += 1 + a
                    else:
                        new = p[:1]
                        r.fed += len(fed)
                    if eos_token_id is not None and eos_token_id in new:
                        new = new[:new.index(eos_token_id) + 1]
                    r.out.extend(new)
                    # boundaries this step reached that the in-step save could not take (drafts and
                    # the last k prompt tokens), now accepted: before the commit releases their windows
                    lo = before if before >= len(r.prompt) else max(before, before + len(fed) - eng.num_speculative_tokens)
                    self._save_range(r, lo, r.fed)
                    model.commit(("generate", r.rid))
                    if len(r.out) >= max_new_tokens or (eos_token_id is not None and r.out[-1] == eos_token_id):
                        del r.out[max_new_tokens:]
                        done.append(r)
                for r in done:
                    running.remove(r)
                    reserved -= r.reserve
                    model.free(("generate", r.rid))
                    self.drafter.release(("generate", r.rid))
                n_fed = sum(len(t) for t in tokens.values())
                st.steps += 1
                st.tokens_processed += n_fed
                if progress is not None:
                    progress(n_fed)
        except BaseException:
            model.abort_step()
            for r in running:
                if ("generate", r.rid) in eng.requests:
                    model.free(("generate", r.rid))
            raise
        sync()
        st.seconds = time.perf_counter() - t0
        st.generated = sum(len(r.out) for r in reqs)
        log.info(st.summary())
        return [r.out for r in reqs]
