"""Token tracker: records every student completion as token ids, loss mask and logprobs.

Every ``record`` call takes the prompt ids sent to the backend and the completions it returned. The
parent of the new sequences is the longest tracked sequence whose token ids are an exact prefix of the
prompt ids (multi-turn: previous prompt + completion + new turn); the new turn is appended masked and
the completion trainable, earlier completion tokens keep their mask and logprobs. Matching is on token
ids only, never on text. ``n > 1`` completions of one prompt become ``n`` sibling sequences.

Modes: ``default`` keeps a list of current sequences and replaces a parent by its extensions (in its
place), so a later request that branches from an already extended turn starts a new sequence (the
earlier turns' sampled tokens are then masked on it). ``tree`` keeps every node with its parent id and
reproduces verifiers 0.4's message graph (``Trace.branches``): each leaf is one training sample, a
request continuing any earlier turn extends that turn's branch with its sampled tokens still trainable,
and a turn extended several times (retries, branching histories) gives several leaves.

Closed replies: when ``record`` is given ``stop_token_ids`` (the ids that end a reply), a sequence whose
last completion did not end on one of them (it was cut by ``max_tokens``) is continued only if the next
prompt token is one of them: a chat template closes a reply it re-renders with its end-of-turn token, so
any other token means the reply's text was changed after sampling (verifiers then records the changed
reply as a new, non-sampled message, and the sampled tokens are not trained on that path). Such a
request counts as a divergence (``reason="reply_changed"``) and extends the longest earlier sequence
that qualifies.

Divergence: when a request was meant to continue a sequence but its ids do not start with that
sequence's ids (a chat template that re-tokenises, strips reasoning, or renders special tokens
differently), the tracker counts it in ``stats.divergences``, logs ``tracker.prefix_divergence`` and
starts a new sequence (or extends the longest sequence that *is* an exact prefix), never mis-aligning
tokens. "Meant to continue" is either given (``expected_parents``, which the OpenAI facade derives from
the chat history) or inferred: the prompt agrees with a sequence beyond the start of its last
completion (and beyond the chosen parent) but then differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog

from pipeline.rollout.students.base import Completion
from schemas.build import make_sequence
from schemas.messages import Sequence as WireSequence

log = structlog.get_logger(__name__)

Mode = Literal["default", "tree"]


@dataclass(frozen=True, slots=True)
class Node:
    """One tracked sequence: the full token ids after a completion, with mask, logprobs and spans."""

    id: int
    tokens: tuple[int, ...]
    mask: tuple[int, ...]  # 1 = sampled by the student (trainable)
    logprobs: tuple[float, ...]  # student logprob per token, 0.0 where mask is 0
    spans: tuple[tuple[int, int], ...]  # maximal trainable [start, end) runs, ascending
    prompt_len: int  # length of the first prompt
    parent: int | None
    finish_reason: str
    turns: int  # completions along the path from the root, this one included
    open_end: bool = False  # stop ids were given and the completion did not end on one

    def continued_by(self, prompt: tuple[int, ...], stops: frozenset[int]) -> bool:
        """Whether ``prompt`` (which starts with this node's tokens) continues it with the reply intact."""
        n = len(self.tokens)
        return not (self.open_end and stops and len(prompt) > n and prompt[n] not in stops)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def last_start(self) -> int:
        """Start of the last completion (the tokens after it were sampled in one request)."""
        return self.spans[-1][0] if self.spans else len(self.tokens)


@dataclass(slots=True)
class TrackerStats:
    """Monotonic counters (kept across ``reset``) for metrics export."""

    requests: int = 0
    completions: int = 0
    extended: int = 0  # requests that continued a tracked sequence
    new_sequences: int = 0  # requests that started from a fresh prompt
    divergences: int = 0  # requests meant to continue a sequence whose ids did not match


@dataclass(frozen=True, slots=True)
class TrackerState:
    """Snapshot: ``nodes`` is the current list (default mode) or every node (tree mode)."""

    mode: Mode
    nodes: list[Node]
    stats: TrackerStats = field(default_factory=TrackerStats)


def _merge_span(spans: list[tuple[int, int]], start: int, end: int) -> None:
    if end <= start:
        return
    if spans and spans[-1][1] == start:
        spans[-1] = (spans[-1][0], end)
    else:
        spans.append((start, end))


def common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix (binary search over C-level slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]; the answer lies in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Tracker:
    """Tracks token-level trajectories of one rollout (or one group); not shared across processes."""

    def __init__(self, mode: Mode = "default") -> None:
        if mode not in ("default", "tree"):
            raise ValueError(f"mode must be 'default' or 'tree', got {mode!r}")
        self.mode: Mode = mode
        self.stats = TrackerStats()
        self._nodes: dict[int, Node] = {}  # live nodes, insertion-ordered
        self._order: list[int] = []  # default mode: current list, parents replaced in place
        self._children: dict[int, int] = {}  # tree mode: node id -> number of children
        self._next_id = 0  # never reused, so stale ids held elsewhere stay harmless after reset

    # -- queries -----------------------------------------------------------------------------------

    def get(self, node_id: int) -> Node:
        return self._nodes[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def nodes(self) -> list[Node]:
        """Current sequences (default mode, in list order) or all nodes (tree mode, creation order)."""
        if self.mode == "default":
            return [self._nodes[i] for i in self._order]
        return list(self._nodes.values())

    def leaves(self) -> list[Node]:
        """Sequences nothing extends: the trajectories to train on (all current ones in default mode)."""
        return [n for n in self.nodes() if not self._children.get(n.id)]

    def state(self) -> TrackerState:
        return TrackerState(self.mode, self.nodes(), dataclasses.replace(self.stats))

    def reset(self) -> None:
        """Forget every sequence (counters are kept: they feed monotonic metrics)."""
        self._nodes.clear()
        self._order.clear()
        self._children.clear()

    # -- recording ---------------------------------------------------------------------------------

    def record(
        self,
        prompt_ids: Sequence[int],
        completions: Sequence[Completion],
        *,
        expected_parents: Iterable[int] = (),
        stop_token_ids: Iterable[int] = (),
    ) -> list[int]:
        """Track ``completions`` of ``prompt_ids``; returns one node id per completion, in order.

        ``expected_parents``: node ids this request is meant to continue (e.g. found from chat history);
        when none of the live ones is an exact token prefix of ``prompt_ids`` that is a divergence.
        ``stop_token_ids``: the ids that end a reply (see "Closed replies" above); none disables the check.
        """
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty")
        stops = frozenset(int(t) for t in stop_token_ids)
        expected = [i for i in expected_parents if i in self._nodes]
        parent, changed = self._find_parent(prompt, expected, stops)
        if changed is not None:
            self._diverged(prompt, changed, parent, "reply_changed")
        else:
            self._check_divergence(prompt, parent, expected)
        self.stats.requests += 1
        self.stats.completions += len(completions)
        if parent is None:
            self.stats.new_sequences += 1
        else:
            self.stats.extended += 1
        ids = [self._add(self._build(prompt, parent, c, stops)) for c in completions]
        if parent is not None and self.mode == "default" and ids:
            self._replace(parent.id, ids)
        elif parent is not None and self.mode == "tree":
            self._children[parent.id] = self._children.get(parent.id, 0) + len(ids)
        return ids

    def _find_parent(
        self, prompt: tuple[int, ...], expected: list[int], stops: frozenset[int]
    ) -> tuple[Node | None, Node | None]:
        """The node to extend, and the longest prefix node refused because its reply was changed."""
        best: Node | None = None
        changed: Node | None = None
        for node in self.nodes():
            n = node.length
            if n > len(prompt) or (best is not None and n < best.length):
                continue
            if prompt[:n] != node.tokens:
                continue
            if not node.continued_by(prompt, stops):
                if changed is None or n >= changed.length:
                    changed = node
                continue
            if best is None or n > best.length or node.id in expected or best.id not in expected:
                best = node  # longest; on ties the expected one, else the most recent
        if changed is not None and best is not None and best.length > changed.length:
            changed = None  # a longer intact sequence is extended: nothing was lost
        return best, changed

    def _check_divergence(self, prompt: tuple[int, ...], parent: Node | None, expected: list[int]) -> None:
        if expected:
            nodes = [self._nodes[i] for i in expected]
            if any(prompt[: x.length] == x.tokens for x in nodes):
                return
            suspect = max(nodes, key=lambda x: common_prefix_len(x.tokens, prompt))
            self._diverged(prompt, suspect, parent, "expected_parent")
            return
        floor = parent.length if parent is not None else 0
        for node in self.nodes():
            if node is parent:
                continue
            t = max(node.last_start, floor)  # agreeing beyond both means a broken continuation
            if t < node.length and t < len(prompt) and prompt[: t + 1] == node.tokens[: t + 1]:
                self._diverged(prompt, node, parent, "partial_match")
                return

    def _diverged(self, prompt: tuple[int, ...], node: Node, parent: Node | None, why: str) -> None:
        self.stats.divergences += 1
        cp = common_prefix_len(node.tokens, prompt)
        log.warning(
            "tracker.prefix_divergence",
            reason=why,
            node=node.id,
            stored_len=node.length,
            prompt_len=len(prompt),
            common_prefix=cp,
            stored_next=list(node.tokens[cp : cp + 4]),
            prompt_next=list(prompt[cp : cp + 4]),
            extended=parent.id if parent is not None else None,
            action="extend_shorter_prefix" if parent is not None else "new_sequence",
        )

    def _build(self, prompt: tuple[int, ...], parent: Node | None, c: Completion, stops: frozenset[int]) -> Node:
        if parent is None:
            tokens, mask, lps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
            spans: list[tuple[int, int]] = []
            prompt_len, turns = len(prompt), 1
        else:
            new = prompt[parent.length :]
            tokens = [*parent.tokens, *new]
            mask = [*parent.mask, *([0] * len(new))]
            lps = [*parent.logprobs, *([0.0] * len(new))]
            spans = list(parent.spans)
            prompt_len, turns = parent.prompt_len, parent.turns + 1
        start = len(tokens)
        tokens.extend(int(t) for t in c.token_ids)
        mask.extend([1] * len(c.token_ids))
        lps.extend(float(x) for x in c.logprobs)
        _merge_span(spans, start, len(tokens))
        self._next_id += 1
        return Node(
            id=self._next_id,
            tokens=tuple(tokens),
            mask=tuple(mask),
            logprobs=tuple(lps),
            spans=tuple(spans),
            prompt_len=prompt_len,
            parent=parent.id if parent is not None else None,
            finish_reason=c.finish_reason,
            turns=turns,
            open_end=bool(stops) and not (c.token_ids and int(c.token_ids[-1]) in stops),
        )

    def _add(self, node: Node) -> int:
        self._nodes[node.id] = node
        if self.mode == "default":
            self._order.append(node.id)
        return node.id

    def _replace(self, parent_id: int, child_ids: list[int]) -> None:
        """Default mode: the children take the parent's place in the current list."""
        for cid in child_ids:
            self._order.remove(cid)
        at = self._order.index(parent_id)
        self._order[at : at + 1] = child_ids
        del self._nodes[parent_id]

    # -- output ------------------------------------------------------------------------------------

    def to_sequence(
        self, node_id: int, score: float = 0.0, *, messages: list[dict[str, Any]] | None = None
    ) -> WireSequence:
        """The node as a wire ``schemas.Sequence`` (logprobs 0.0 where masked, explicit ``spans``)."""
        node = self._nodes[node_id]
        seq = make_sequence(
            node.tokens, node.mask, prompt_len=node.prompt_len, logprobs=node.logprobs, score=score, messages=messages
        )
        return msgspec.structs.replace(seq, spans=list(node.spans))

    def sequences(self, scores: Sequence[float] | None = None, *, all_nodes: bool = False) -> list[WireSequence]:
        """Wire sequences for the leaves (or every node with ``all_nodes``), with optional scores."""
        nodes = self.nodes() if all_nodes else self.leaves()
        if scores is not None and len(scores) != len(nodes):
            raise ValueError(f"{len(scores)} scores for {len(nodes)} sequences")
        return [self.to_sequence(n.id, scores[i] if scores is not None else 0.0) for i, n in enumerate(nodes)]
