"""Exact greedy replay: score a drafting rule offline on the target's own greedy outputs.

With greedy verification the accepted length of a draft is fully determined by the output
the model produces anyway, so the honest tokens per decode step measured here equals what
vLLM measures when the proposer runs for real."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# (token matrix [rows, width], lengths [rows]) -> per row: (tree tokens, tree parents)
TreeDrafter = Callable[[np.ndarray, np.ndarray], list[tuple[list[int], list[int]]]]


@dataclass(frozen=True)
class GreedyTrace:
    """A prompt's token ids and the target's greedy continuation."""

    prompt_ids: list[int]
    output_ids: list[int]


def save_traces(traces: Sequence[GreedyTrace], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[t.prompt_ids, t.output_ids] for t in traces]))


def load_traces(path: Path) -> list[GreedyTrace]:
    return [GreedyTrace(p, o) for p, o in json.loads(path.read_text())]


def accepted_length(tree_tokens: Sequence[int], tree_parents: Sequence[int], expected: Sequence[int]) -> int:
    """Longest root-to-node path of the tree whose tokens equal ``expected`` (a chain is a
    tree whose parents are -1, 0, 1, ...)."""
    node, depth = -1, 0
    while depth < len(expected):
        child = next(
            (i for i, (token, parent) in enumerate(zip(tree_tokens, tree_parents))
             if parent == node and token == expected[depth]),
            None,
        )
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def chain_as_tree(chain: Sequence[int]) -> tuple[list[int], list[int]]:
    return list(chain), list(range(-1, len(chain) - 1))


@dataclass(frozen=True)
class ReplayResult:
    """Honest tokens per decode step and the draft volume that bought it."""

    generated: int
    requests: int
    decode_steps: int
    draft_tokens: int

    @property
    def honest_tokens_per_step(self) -> float:
        return (self.generated - self.requests) / max(self.decode_steps, 1)

    @property
    def draft_tokens_per_step(self) -> float:
        return self.draft_tokens / max(self.decode_steps, 1)


def replay(traces: Sequence[GreedyTrace], drafter: TreeDrafter) -> ReplayResult:
    """Decode every trace in lock step, drafting for all active traces in one call per step."""
    positions = [1 if t.output_ids else 0 for t in traces]
    steps = draft_tokens = 0
    width = max(len(t.prompt_ids) + len(t.output_ids) for t in traces)
    matrix = np.zeros((len(traces), width), dtype=np.int32)
    for row, trace in enumerate(traces):
        full = trace.prompt_ids + trace.output_ids
        matrix[row, : len(full)] = full
    while True:
        active = [i for i, t in enumerate(traces) if positions[i] < len(t.output_ids)]
        if not active:
            break
        lengths = np.array([len(traces[i].prompt_ids) + positions[i] for i in active], dtype=np.int32)
        trees = drafter(matrix[active], lengths)
        for row, (tokens, parents) in zip(active, trees):
            expected = traces[row].output_ids[positions[row]:]
            positions[row] += accepted_length(tokens, parents, expected) + 1
            draft_tokens += len(tokens)
        steps += len(active)
    generated = sum(len(t.output_ids) for t in traces)
    return ReplayResult(generated, len(traces), steps, draft_tokens)
