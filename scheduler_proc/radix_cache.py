"""The radix prefix cache: token sequences -> the KV slots that hold them.

The tree owns the slots of every cached token. A running request locks the path it
reads (lock counts run up to the root), so only unlocked leaves are ever evicted, least
recently used first. Page size is one token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


@dataclass(eq=False)
class Node:
    key: np.ndarray  # the tokens on the edge into this node
    value: np.ndarray  # their slots
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    snapshot: int = 0  # SnapshotCache: the recurrent-state snapshot at this node's end

    @property
    def depth(self) -> int:
        """Tokens from the root to this node's end."""
        node, n = self, 0
        while node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    def __lt__(self, other: "Node") -> bool:  # heap order for LRU eviction
        return self.last_access < other.last_access


@dataclass(frozen=True)
class PrefixMatch:
    slots: np.ndarray  # slots of the matched prefix, in token order
    node: Node  # the deepest matched node; lock it while the slots are in use

    def __len__(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class Insertion:
    """What RadixCache.insert did with the caller's slots."""

    adopted_from: int  # the tree owns the caller's slots from this position on
    node: Node  # the node ending the sequence
    # The tree's own slots it gave up for the caller's: the caller frees them.
    replaced: np.ndarray = field(default_factory=lambda: _EMPTY)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if len(diff) else n


class RadixCache:
    def __init__(self) -> None:
        self.root = Node(_EMPTY, _EMPTY, lock_ref=1)
        self.total_size = 0  # cached tokens (= slots the tree owns)
        self.protected_size = 0  # of which locked by running requests
        self._clock = 0

    @property
    def evictable_size(self) -> int:
        return self.total_size - self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookups ---------------------------------------------------------------------------

    def match_prefix(self, tokens: np.ndarray) -> PrefixMatch:
        """The longest cached prefix of tokens. Splits an edge matched only in part, so the
        returned node ends exactly at the match (and can be locked exactly)."""
        node, pos, parts = self.root, 0, []
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            common = common_prefix_len(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            parts.append(child.value)
            node, pos = child, pos + common
        slots = np.concatenate(parts) if parts else _EMPTY
        return PrefixMatch(slots, node)

    def match_len(self, tokens: np.ndarray) -> int:
        """Length of the cached prefix, without touching the tree (for queue ordering)."""
        pos = 0
        for _, pos in self._walk(tokens):
            pass
        return pos

    def _walk(self, tokens: np.ndarray) -> Iterator[tuple[Node | None, int]]:
        """The nodes tokens match whole, each with the match's length at its end; last,
        (None, length) when the match ends inside an edge."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                return
            common = common_prefix_len(child.key, tokens[pos:])
            pos += common
            if common < len(child.key):
                yield None, pos
                return
            node = child
            yield node, pos

    # -- updates ---------------------------------------------------------------------------

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> Insertion:
        """Cache tokens with their slots (see Insertion). Where the tree has a position
        already, it keeps its own slot if a running request reads it (the node is
        locked: the caller's is a duplicate) and takes the caller's otherwise, handing
        its own back. A request recomputes a cached position only where its hit was cut
        back (the cached copy's windows were evicted, or the hit was cut to a bucket
        edge) or the position was cached after its admission: keeping the tree's copy
        then left the caller holding a duplicate beside a copy nobody reads, and a
        request that could fit once could no longer fit both (it was preempted and
        recomputed for ever)."""
        node, pos, replaced = self.root, 0, []
        adopted_from: int | None = None
        now = self._tick()
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                leaf = Node(tokens[pos:].copy(), slots[pos:].copy(), parent=node, last_access=now)
                node.children[int(tokens[pos])] = leaf
                self.total_size += len(leaf.key)
                node = leaf
                adopted_from = pos if adopted_from is None else adopted_from
                break
            common = common_prefix_len(child.key, tokens[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            # Locks run up to the root, so the locked nodes are a head of the path: from
            # the first unlocked one on, the tree owns the caller's slots.
            if child.lock_ref == 0:
                adopted_from = pos if adopted_from is None else adopted_from
                ours = slots[pos:pos + common]
                if not np.array_equal(ours, child.value):
                    replaced.append(child.value)
                    child.value = ours.copy()
            node, pos = child, pos + common
        return Insertion(pos if adopted_from is None else adopted_from, node,
                         np.concatenate(replaced) if replaced else _EMPTY)

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge after `at` tokens; returns the new upper node."""
        upper = Node(child.key[:at], child.value[:at], parent=child.parent,
                     lock_ref=child.lock_ref, last_access=child.last_access)
        upper.children[int(child.key[at])] = child
        child.parent.children[int(upper.key[0])] = upper
        child.key, child.value, child.parent = child.key[at:], child.value[at:], upper
        return upper

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, n: int) -> np.ndarray:
        """Drop unlocked leaves, least recently used first, until at least n slots are
        freed or nothing is evictable. Returns the freed slots."""
        heap = [x for x in self._nodes() if not x.children and x.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        count = 0
        while heap and count < n:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._dropped(leaf)
            del parent.children[int(leaf.key[0])]
            self.total_size -= len(leaf.key)
            freed.append(leaf.value)
            count += len(leaf.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return np.concatenate(freed) if freed else _EMPTY

    def _dropped(self, node: Node) -> None:
        """A node is leaving the tree (evicted)."""

    def flush(self) -> np.ndarray:
        """Drop every unlocked cached prefix; returns the freed slots."""
        return self.evict(self.evictable_size)

    def nodes(self) -> list[Node]:
        """Every node but the root."""
        return self._nodes()

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.children.values())
            stack.extend(node.children.values())
        return out

    def all_slots(self) -> np.ndarray:
        """Every slot the tree owns (for invariant checks)."""
        values = [n.value for n in self._nodes()]
        return np.concatenate(values) if values else _EMPTY


class DisabledCache(RadixCache):
    """--disable-radix-cache: nothing is ever cached or matched."""

    def match_prefix(self, tokens: np.ndarray) -> PrefixMatch:
        return PrefixMatch(_EMPTY, self.root)

    def match_len(self, tokens: np.ndarray) -> int:
        return 0

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> Insertion:
        return Insertion(len(tokens), self.root)  # adopts nothing: the caller frees its slots


class SnapshotCache(RadixCache):
    """The cache of a model with recurrent layers: a prefix serves a hit only where the
    worker kept a snapshot of the recurrent state at its end (at prompt chunk ends), so a
    match is cut back to the deepest such node on its path. Snapshot ids are handed out here,
    at most `capacity` (1..capacity), and come back when their node is evicted."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._free_snapshots = list(range(capacity, 0, -1))

    @property
    def free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def match_prefix(self, tokens: np.ndarray) -> PrefixMatch:
        match = super().match_prefix(tokens)
        node = match.node
        while node is not self.root and not node.snapshot:
            node = node.parent
        return PrefixMatch(match.slots[:node.depth] if node is not self.root else _EMPTY, node)

    def match_len(self, tokens: np.ndarray) -> int:
        return max((pos for node, pos in self._walk(tokens) if node is not None and node.snapshot),
                   default=0)

    def snapshot_at(self, node: Node) -> int:
        """A snapshot id for the prefix ending at node (0: it has one already, or none is
        free: see evict_for_snapshot)."""
        if node.snapshot or node is self.root or not self._free_snapshots:
            return 0
        node.snapshot = self._free_snapshots.pop()
        return node.snapshot

    def evict_for_snapshot(self) -> np.ndarray:
        """Evict unlocked leaves, least recently used first, until a snapshot id is free
        (or nothing is evictable); returns the slots that freed."""
        freed = []
        while not self._free_snapshots and self.evictable_size:
            slots = self.evict(1)
            if not len(slots):
                break
            freed.append(slots)
        return np.concatenate(freed) if freed else _EMPTY

    def _dropped(self, node: Node) -> None:
        if node.snapshot:
            self._free_snapshots.append(node.snapshot)
            node.snapshot = 0
