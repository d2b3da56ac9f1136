"""Draft tokens from history: vLLM's speculative decoding with drafts looked up in what the same
prompt produced before (``rollout.speculative.method=history``).

RL rollouts repeat themselves: a prompt's ``n`` samples share much of their answers, and an RL
dataset is read epoch after epoch, so the same prompt's earlier answers resemble the next ones
(HistoSpec reports up to 2.1x rollout speed-up on math and code from such drafts). A draft here is the
continuation of the longest n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
that ends the request's context and occurs in one of: the prompt itself (prompt look-up, as
vLLM's ``ngram``), the other samples of the same prompt so far, or the answers it got earlier in
this worker (the last ``history_answers`` per prompt, for the ``history_prompts`` prompts drafted
from most recently). Among the places a n-gram occurs, the one with the longest continuation wins
(a sibling that ran ahead), ties going to the most recent.

What differs from vLLM's ``ngram`` and ``suffix`` methods: ngram sees only the request's own
tokens; suffix decoding (Arctic Inference, not a dependency here) keeps a global suffix tree over
every request. Keying the history by prompt keeps a draft to answers of the same question.

vLLM builds this class through ``speculative_config={"method": "custom_class", "model":
"workers.rollout.history_drafts.HistoryDrafter"}`` inside the model runner; it knows nothing of
requests until :meth:`bind` hands it the runner (for each row's request id and prompt) and the
settings. The number of drafts per step comes from the dense batch size -> tokens table that the
scheduler and the adaptive tuner share (workers/rollout/adaptive_drafting.py).
"""
from __future__ import annotations

from collections import OrderedDict, deque

# occurrences kept per n-gram and prompt: enough to find a sibling that ran ahead, few enough
# that a look-up stays a handful of list reads
OCCURRENCES = 4


class PromptHistory:
    """Every token sequence seen for one prompt, and where each n-gram occurs in them.

    A document is the prompt itself (document 0) or one sample: the prompt's last
    ``max_n`` tokens followed by the sample's answer, so that n-grams spanning the end of the
    prompt and the start of an answer are found as well."""

    def __init__(self, prompt: list[int], min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        # document id -> tokens; ids are never reused (live requests hold theirs), dropped
        # answers leave the dict
        self.docs: dict[int, list[int]] = {}
        self.next_doc = 0
        self.index: dict[tuple, list[tuple[int, int]]] = {}
        # (position, n-gram) -> answer documents with that n-gram just before that position: the
        # same prompt's answers agree position by position, and a repeated n-gram (digits,
        # boilerplate) has too many places elsewhere for the few kept in ``index``
        self.aligned: dict[tuple, list[int]] = {}
        self.finished: deque[int] = deque()  # answer documents done, oldest first
        self.pending: set[int] = set()  # documents with tokens not indexed yet
        self.indexed: dict[int, int] = {}  # document -> tokens indexed
        self.dropped = 0
        self.new_doc(list(prompt))
        self.tail = list(prompt[-max_n:])

    def new_doc(self, tokens: list[int]) -> int:
        doc = self.next_doc
        self.next_doc += 1
        self.docs[doc] = list(tokens)
        self.pending.add(doc)
        return doc

    def extend(self, doc: int, tokens) -> None:
        """Append tokens to a document; they are indexed at the next draft from this history (an
        answer finished in a full batch costs a list copy, not its n-grams)."""
        self.docs[doc].extend(tokens)
        self.pending.add(doc)

    def _index_pending(self) -> None:
        """Index the n-grams each token appended since the last draft continues."""
        for doc in self.pending:
            seq = self.docs.get(doc)
            if seq is None:
                continue
            for pos in range(self.indexed.get(doc, 0), len(seq)):  # pos: the continuation's position
                for n in range(self.min_n, min(self.max_n, pos) + 1):
                    key = tuple(seq[pos - n:pos])
                    places = self.index.setdefault(key, [])
                    places.append((doc, pos))
                    if len(places) > OCCURRENCES:
                        del places[0]
                    if doc > 0:
                        docs = self.aligned.setdefault((pos, key), [])
                        docs.append(doc)
                        if len(docs) > OCCURRENCES:
                            del docs[0]
            self.indexed[doc] = len(seq)
        self.pending.clear()

    def truncate(self, doc: int, length: int) -> None:
        """vLLM took tokens back (a request's output cut to what it kept): drop them here too. The
        index may still point past the cut; a draft from there is only verified and rejected."""
        del self.docs[doc][length:]
        self.indexed[doc] = min(self.indexed.get(doc, 0), length)

    def finish(self, doc: int, keep: int) -> None:
        """An answer is done: keep it as a draft source, dropping the oldest beyond ``keep``."""
        self.finished.append(doc)
        while len(self.finished) > keep:
            del self.docs[self.finished.popleft()]
            self.dropped += 1
        if self.dropped > keep:  # the index still points into dropped documents: rebuild it
            self._reindex()

    def _reindex(self) -> None:
        """Rebuild the index over the documents kept (ids stay: live requests hold them)."""
        self.index, self.aligned, self.indexed = {}, {}, {}
        self.pending = set(self.docs)
        self.dropped = 0

    def draft(self, doc: int, k: int) -> list[int]:
        """Up to ``k`` tokens continuing the document ``doc`` ends with: the longest n-gram that
        another answer has at the same position (an earlier answer, or a sibling that got as far
        by the same path), else the longest n-gram anywhere, taking the occurrence with the
        longest continuation."""
        self._index_pending()
        seq = self.docs[doc]
        here, longest = len(seq), min(self.max_n, len(seq))
        for n in range(longest, self.min_n - 1, -1):
            key = tuple(seq[-n:])
            runs = [self.docs[other][here:here + k] for other in self.aligned.get((here, key), ())
                    if other != doc and other in self.docs]
            best = max(runs, key=len, default=[])
            if best:
                return best
        for n in range(longest, self.min_n - 1, -1):
            best = []
            for other, pos in reversed(self.index.get(tuple(seq[-n:]), ())):
                source = self.docs.get(other)
                if source is not None and len(source[pos:pos + k]) > len(best):
                    best = source[pos:pos + k]
            if best:
                return best
        return []


class HistoryDrafter:
    """vLLM's custom proposer protocol: ``propose(sampled_token_ids, num_tokens_no_spec,
    token_ids_cpu, slot_mappings)`` returns one draft list per row of the runner's input batch.

    A step the table gives no drafts (a full batch) costs nothing here: requests are tracked only
    from the first step that drafts for them, and every request's answer is kept when vLLM drops
    its state (the runner's ``_on_request_state_removed``), drafted for or not."""

    def __init__(self, vllm_config):
        self.k_max = vllm_config.speculative_config.num_speculative_tokens
        self.runner = None  # until bind(): no drafts (vLLM's profiling runs come first)
        self.k_by_batch: list[int] | None = None
        self.prompts: OrderedDict[tuple, PromptHistory] = OrderedDict()
        self.live: dict[str, tuple[PromptHistory, int]] = {}  # request drafted for -> (its history, its document)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner loads every drafter's model; this one has none."""

    def bind(self, runner, min_n: int, max_n: int, answers: int, prompts: int,
             k_by_batch: list[int] | None) -> None:
        """``k_by_batch[b]``: the drafts per request when ``b`` requests share the step (the
        scheduler's dynamic table, rewritten in place by the adaptive tuner); None: ``k_max``."""
        self.runner, self.min_n, self.max_n = runner, min_n, max_n
        self.answers, self.max_prompts, self.k_by_batch = answers, prompts, k_by_batch
        removed = getattr(runner, "_on_request_state_removed", None)
        if removed is None:
            raise RuntimeError("rollout.speculative.method=history needs vLLM's model-runner hook "
                               "_on_request_state_removed (vLLM 0.32), which this vLLM lacks: use method=ngram or "
                               "draft_model")

        def on_removed(req_id, state):
            self.request_done(req_id, state)
            removed(req_id, state)

        runner._on_request_state_removed = on_removed

    def _history(self, prompt) -> PromptHistory:
        key = tuple(prompt)
        history = self.prompts.get(key)
        if history is None:
            history = self.prompts[key] = PromptHistory(list(prompt), self.min_n, self.max_n)
            while len(self.prompts) > self.max_prompts:
                self.prompts.popitem(last=False)
        self.prompts.move_to_end(key)
        return history

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """One draft per row. A request's tokens are read from the runner's own state of it
        (``output_token_ids``, which vLLM keeps for penalties), not copied each step."""
        rows = len(sampled_token_ids)
        table = self.k_by_batch
        k = self.k_max if table is None else table[min(rows, len(table) - 1)]
        if self.runner is None or k <= 0:
            return [[] for _ in range(rows)]
        requests, live, drafts = self.runner.requests, self.live, []
        for i, req_id in enumerate(self.runner.input_batch.req_ids[:rows]):
            state = requests[req_id]
            entry = live.get(req_id)
            if entry is None:
                history = self._history(state.prompt_token_ids)
                entry = live[req_id] = (history, history.new_doc(history.tail))
            history, doc = entry
            self._sync(history, doc, state.output_token_ids)
            drafts.append(history.draft(doc, k) if len(sampled_token_ids[i]) > 0 else [])
        return drafts

    def request_done(self, req_id: str, state) -> None:
        """A request finished or was aborted: its answer becomes a draft source. (A preempted
        request keeps its state in vLLM, so it stays here too.)"""
        entry = self.live.pop(req_id, None)
        if state is None or self.runner is None:
            return
        if entry is None:  # never drafted for: its answer becomes a document now
            if not state.output_token_ids:
                return
            history = self._history(state.prompt_token_ids)
            entry = (history, history.new_doc(history.tail))
        history, doc = entry
        self._sync(history, doc, state.output_token_ids)
        history.finish(doc, self.answers)

    @staticmethod
    def _sync(history: PromptHistory, doc: int, out: list[int]) -> None:
        """Bring a document up to the request's tokens (-1: a placeholder vLLM fills later)."""
        have = len(history.docs[doc]) - len(history.tail)
        if len(out) > have:
            history.extend(doc, [t for t in out[have:] if t >= 0])
        elif len(out) < have:
            history.truncate(doc, len(history.tail) + len(out))
