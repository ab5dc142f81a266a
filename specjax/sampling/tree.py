"""Token trees as Medusa-style paths of child ranks, and the static tables the tree sampler uses.

A tree is a tuple of paths, e.g. `((0,), (1,), (0, 0), (0, 1), (0, 0, 0))`: path (r_1, .., r_d)
is the node reached from the root (the context's last token) by taking child rank r_1, then r_2,
and so on; every prefix of a path must be present. The chain of k proposals is
`((0,), (0, 0), ..., (0,) * k)`. Nodes are numbered 1..N in (depth, path) order, the root is 0,
so each depth is a contiguous range and a node's children follow it in rank order.

A `DynamicTree` is a budget instead of a shape (EAGLE-2, Li et al. 2024): the sampler builds the
tree per round and row from the draft's confidence (specjax.sampling.dynamic_tree).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import numpy as np


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """An EAGLE-2 tree budget: `depth` D levels, `expand` m (each level expands the m most
    probable frontier nodes into their m most probable children), `nodes` N of all the drafted
    candidates are verified (the N of highest cumulative draft log-probability).

    Drafts D calls a round (the catch-up and D - 1 levels of m nodes) and verifies N nodes in one
    target call. Raises ValueError naming the field unless D, m >= 1 and 1 <= N <= m + (D - 1) m^2
    (the candidates drafted).
    """

    depth: int
    expand: int
    nodes: int

    def __post_init__(self):
        for name in ('depth', 'expand', 'nodes'):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f'DynamicTree.{name} must be an int >= 1, got {v!r}')
            object.__setattr__(self, name, int(v))
        if self.nodes > self.candidates:
            raise ValueError(
                f'DynamicTree.nodes={self.nodes} exceeds the {self.candidates} candidates a '
                f'depth={self.depth}, expand={self.expand} tree drafts (expand + (depth - 1) * '
                'expand^2)'
            )

    @property
    def candidates(self) -> int:
        """M: nodes drafted a round (m at depth 1, m^2 at each deeper level)."""
        return self.expand + (self.depth - 1) * self.expand**2

    @property
    def num_fed(self) -> int:
        """F: nodes the draft feeds a round (the frontier of each depth < D)."""
        return (self.depth - 1) * self.expand


def chain(k: int) -> tuple[tuple[int, ...], ...]:
    """The chain of k proposals as a tree."""
    return tuple((0,) * d for d in range(1, k + 1))


def check_tree(tree) -> tuple[tuple[int, ...], ...]:
    """Validates `tree` and returns it canonical (sorted by depth, then path); raises ValueError."""
    if isinstance(tree, str | bytes) or not hasattr(tree, '__iter__'):
        raise ValueError(f'tree must be a tuple of paths (tuples of child ranks), got {tree!r}')
    paths = []
    for path in tree:
        ok = isinstance(path, tuple | list) and len(path) >= 1
        ok = ok and all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) and r >= 0 for r in path
        )
        if not ok:
            raise ValueError(f'tree path {path!r} must be a non-empty tuple of ints >= 0')
        paths.append(tuple(int(r) for r in path))
    if not paths:
        raise ValueError('tree must hold at least one path')
    seen = set()
    for path in paths:
        if path in seen:
            raise ValueError(f'tree has the duplicate path {path}')
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f'tree path {path} lacks its prefix {path[:-1]}')
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@dataclasses.dataclass(frozen=True)
class TreeTables:
    """Static tables of a canonical tree with N nodes (root 0) and depth D.

    token_parent int [N + 1] (-1 at the root), depth int [N + 1], rank int [N + 1];
    children int [N + 1, R] (rank order, -1 padded; R = most children of a node);
    ancestor bool [N + 1, N + 1]: ancestor[i, j] iff j is i or one of its ancestors;
    level_start / level_end: node range [start, end) of each depth 1..D (index d - 1);
    num_fed F: nodes of depth < D (the draft feeds them to propose their children);
    top: children ranks the draft needs per node at T = 0 (max rank + 1, over all nodes).
    """

    parent: np.ndarray
    depth: np.ndarray
    rank: np.ndarray
    children: np.ndarray
    ancestor: np.ndarray
    level_start: tuple[int, ...]
    level_end: tuple[int, ...]
    num_fed: int
    top: int

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @property
    def max_depth(self) -> int:
        return len(self.level_start)


@functools.lru_cache(maxsize=64)
def tables(tree: tuple[tuple[int, ...], ...]) -> TreeTables:
    """The TreeTables of a canonical tree (from check_tree)."""
    index = {(): 0, **{p: i + 1 for i, p in enumerate(tree)}}
    n = len(tree)
    parent = np.array([-1] + [index[p[:-1]] for p in tree], np.int32)
    depth = np.array([0] + [len(p) for p in tree], np.int32)
    rank = np.array([0] + [p[-1] for p in tree], np.int32)
    kids = [[] for _ in range(n + 1)]
    for i in range(1, n + 1):
        kids[parent[i]].append(i)  # tree order = rank order among siblings
    width = max(len(c) for c in kids)
    children = np.full((n + 1, width), -1, np.int32)
    for i, c in enumerate(kids):
        children[i, : len(c)] = c
    ancestor = np.eye(n + 1, dtype=bool)
    for i in range(1, n + 1):
        ancestor[i] |= ancestor[parent[i]]
    max_depth = int(depth.max())
    starts = tuple(int(np.argmax(depth == d)) for d in range(1, max_depth + 1))
    ends = tuple(int(n + 1 - np.argmax(depth[::-1] == d)) for d in range(1, max_depth + 1))
    return TreeTables(
        parent=parent,
        depth=depth,
        rank=rank,
        children=children,
        ancestor=ancestor,
        level_start=starts,
        level_end=ends,
        num_fed=int((depth[1:] < max_depth).sum()),
        top=int(rank.max()) + 1,
    )
