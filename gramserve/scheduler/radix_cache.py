"""Prefix cache: a radix tree over token ids whose nodes own KV slots of a `TokenSlotAllocator`.

Page size is 1: every cached token owns exactly one KV slot, and ``node.value[i]`` is the slot holding the
K/V of ``node.key[i]``. Each namespace (``None`` by default; later a LoRA adapter id, a hash of multimodal
inputs, ...) has its own root, so token sequences in different namespaces never share KV.

Slot ownership (the contract with the scheduler)
------------------------------------------------
* Slots stored in the tree belong to the tree. A caller that got slots from `match_prefix` may read them
  (write them into its slot table) but must never free them; to keep them alive while it uses them it
  `lock`s the returned node and later `unlock`s it. Unlocked nodes may be evicted at any time by `evict`
  (or `reset`), which returns their slots to the allocator.
* ``already = insert(tokens, slots)`` hands ``slots[already:]`` to the tree. ``slots[:already]`` stay the
  caller's responsibility: the tree already held those tokens (with its own slots), so the caller's slots
  for that range are not referenced by the tree. Typical use, with ``m`` = the length matched (and locked)
  when the request was admitted, whose slots came from the tree::

      already = cache.insert(tokens, slots)          # slots[:m] are the tree's own slots
      allocator.free(slots[m:already])               # private duplicates of what another request cached
      cache.unlock(prefix_node)

  i.e. free only the part of ``slots[:already]`` that you allocated yourself.
* Disabled cache: `match_prefix` returns an empty match, `insert` stores nothing and returns 0, so the caller
  frees all of its slots itself, exactly as if nothing were cached; `evict` frees nothing.

Eviction is LRU over unlocked leaves: a lazily invalidated min-heap keyed on last-access ticks, so an
`evict` costs O(k log n) for k evicted nodes (plus amortised heap clean-up), and freed slots go back to the
allocator in one `free` call.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Hashable, Iterator, NamedTuple

import torch

from gramserve.scheduler.memory import TokenSlotAllocator


class Node:
    """One edge of the radix tree: ``key`` (token ids) and ``value`` (their KV slots), same length."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "namespace", "alive")

    def __init__(
        self, key: list[int], value: torch.Tensor, parent: Node | None, namespace: Hashable, last_access: int = 0
    ):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token of the child's key -> child
        # Number of locks held on this node or any of its descendants (a lock counts on the whole path).
        self.lock_ref = 0
        self.last_access = last_access
        self.namespace = namespace
        self.alive = True  # False once evicted / reset

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        key = self.key if len(self.key) <= 8 else self.key[:8] + ["..."]
        return (
            f"Node(ns={self.namespace!r}, key={key}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, alive={self.alive})"
        )


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 KV slots of the matched prefix (owned by the tree)
    node: Node  # the node the match ends at (exactly); lock it to protect the prefix

    @property
    def length(self) -> int:
        return int(self.slots.numel())


@dataclass
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0  # tokens served from the cache by match_prefix
    inserted_tokens: int = 0  # tokens newly stored by insert
    evicted_tokens: int = 0

    @property
    def miss_tokens(self) -> int:
        return self.query_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _common_prefix_len(key: list[int], tokens: list[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator, disabled: bool = False):
        self.allocator = allocator
        self.device = allocator.device
        self.disabled = disabled
        self._roots: dict[Hashable, Node] = {}
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._dummy_root = Node([], self._empty, None, None)
        self._tick = 0
        self._seq = itertools.count()
        # Lazy LRU heap of (last_access, seq, node); an entry is valid iff the node is alive, an unlocked leaf
        # and its last_access still equals the entry's. Every evictable leaf has at least one valid entry.
        self._heap: list[tuple[int, int, Node]] = []
        self._num_nodes = 0  # non-root nodes
        self._evictable_size = 0  # tokens in nodes with lock_ref == 0
        self._protected_size = 0  # tokens in nodes with lock_ref > 0
        self.stats = CacheStats()

    # --- sizes --------------------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        """Tokens (= slots) in unlocked nodes: what `evict` can give back."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens (= slots) in locked nodes (held by running requests)."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._evictable_size + self._protected_size

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def namespaces(self) -> list[Hashable]:
        return list(self._roots)

    # --- internals ----------------------------------------------------------------------------------

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _root(self, namespace: Hashable, create: bool) -> Node | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = Node([], self._empty, None, namespace)
            root.lock_ref = 1  # never evicted, never counted in the sizes
        return root

    def _push_if_evictable(self, node: Node) -> None:
        if node.parent is not None and node.lock_ref == 0 and not node.children and node.alive:
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [
            (n.last_access, next(self._seq), n) for n in self._iter_nodes() if n.lock_ref == 0 and not n.children
        ]
        heapq.heapify(self._heap)

    def _iter_nodes(
        self,
        namespace: Hashable = ...,
    ) -> Iterator[Node]:
        """All non-root nodes (of one namespace, or of all when none is given), parents before children."""
        roots = self._roots.values() if namespace is ... else [r for r in [self._roots.get(namespace)] if r]
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _split(self, child: Node, k: int) -> Node:
        """Split ``child`` after its first k tokens (0 < k < len); returns the new upper node."""
        upper = Node(child.key[:k], child.value[:k], child.parent, child.namespace, child.last_access)
        upper.lock_ref = child.lock_ref  # child is upper's only descendant line: same locks
        upper.children[child.key[k]] = child
        child.parent.children[child.key[0]] = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        self._num_nodes += 1
        return upper

    # --- public API ---------------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int], namespace: Hashable = None) -> MatchResult:
        """The longest cached prefix of ``tokens`` in ``namespace``: its slots and the node it ends at.

        A match ending inside an edge splits that node, so ``node`` always ends exactly at the match.
        Marks the path as recently used. The slots belong to the tree: lock ``node`` while using them.
        """
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        if self.disabled:
            return MatchResult(self._empty, self._dummy_root)
        root = self._root(namespace, create=False)
        if root is None:
            return MatchResult(self._empty, self._dummy_root)
        tick = self._next_tick()
        node, i, parts = root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_prefix_len(child.key, tokens, i)
            partial = k < len(child.key)
            if partial:
                child = self._split(child, k)
            child.last_access = tick
            parts.append(child.value)
            node, i = child, i + k
            if partial:
                break
        self._push_if_evictable(node)
        self.stats.hit_tokens += i
        slots = self._empty if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)
        return MatchResult(slots, node)

    def insert(self, tokens: list[int], slots: torch.Tensor, namespace: Hashable = None) -> int:
        """Cache ``tokens`` with their KV ``slots`` (same length); returns how many leading tokens were
        already cached.

        Ownership: the tree takes ``slots[already:]``; ``slots[:already]`` remain the caller's business (free
        the ones you allocated yourself, don't free ones that came from `match_prefix`). Disabled: stores
        nothing, returns 0 (the caller frees everything it allocated).
        """
        if len(tokens) != int(slots.numel()):
            raise ValueError(f"insert: {len(tokens)} tokens but {int(slots.numel())} slots")
        if self.disabled or not tokens:
            return 0
        tokens = list(tokens)
        root = self._root(namespace, create=True)
        tick = self._next_tick()
        node, i = root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                value = slots[i:].to(self.device, torch.int64).clone()
                leaf = Node(tokens[i:], value, node, namespace, tick)
                node.children[tokens[i]] = leaf
                self._num_nodes += 1
                self._evictable_size += len(leaf.key)
                self.stats.inserted_tokens += len(leaf.key)
                self._push_if_evictable(leaf)
                return i
            k = _common_prefix_len(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = tick
            node, i = child, i + k
        self._push_if_evictable(node)
        return i

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted). No-op on a root."""
        if not node.alive:
            raise ValueError(f"lock on an evicted node: {node!r}")
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one `lock` of ``node``."""
        if not node.alive:
            raise ValueError(f"unlock on an evicted node: {node!r}")
        first = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock without a matching lock: {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.key)
                self._evictable_size += len(node.key)
            node = node.parent
        self._push_if_evictable(first)

    def evict(self, num_tokens: int | float) -> int:
        """Free at least ``num_tokens`` slots if possible, evicting least recently used unlocked leaves
        (parents left childless become candidates too). Returns how many slots were freed."""
        if self.disabled or num_tokens <= 0:
            return 0
        freed, parts = 0, []
        heap = self._heap
        while freed < num_tokens and heap:
            access, _, node = heapq.heappop(heap)
            if not node.alive or node.children or node.lock_ref or node.parent is None or node.last_access != access:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.key[0]]
            node.alive = False
            parts.append(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            self._num_nodes -= 1
            if parent.parent is None:
                if not parent.children and self._roots.get(parent.namespace) is parent:
                    del self._roots[parent.namespace]
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))
        if parts:
            self.allocator.free(torch.cat(parts))
        self.stats.evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drop the whole tree, returning every slot to the allocator. Raises if any node is locked."""
        if self._protected_size:
            raise RuntimeError(f"reset with {self._protected_size} tokens locked")
        nodes = list(self._iter_nodes())
        if nodes:
            self.allocator.free(torch.cat([n.value for n in nodes]))
        for n in nodes:
            n.alive = False
        self.stats.evicted_tokens += self._evictable_size
        self._roots.clear()
        self._heap = []
        self._num_nodes = 0
        self._evictable_size = 0

    # --- debugging ----------------------------------------------------------------------------------

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (for checks; O(n))."""
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty

    def check_invariants(self) -> None:
        """Recompute everything from scratch and assert it matches the incremental bookkeeping (O(n))."""
        evictable = protected = count = 0
        valid_entries = {id(n) for a, _, n in self._heap if n.alive and n.last_access == a}
        for ns, root in self._roots.items():
            assert root.parent is None and root.namespace == ns and root.alive
            assert root.children, f"empty root kept for namespace {ns!r}"
        for n in self._iter_nodes():
            count += 1
            assert n.alive and n.parent is not None and n.parent.children.get(n.key[0]) is n
            assert len(n.key) > 0 and len(n.key) == n.value.numel(), n
            assert n.namespace == n.parent.namespace
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), n
            if n.lock_ref:
                protected += len(n.key)
            else:
                evictable += len(n.key)
                if not n.children:
                    assert id(n) in valid_entries, f"evictable leaf missing from the LRU heap: {n!r}"
        assert count == self._num_nodes, (count, self._num_nodes)
        assert evictable == self._evictable_size, (evictable, self._evictable_size)
        assert protected == self._protected_size, (protected, self._protected_size)

    def pretty(self, namespace: Hashable = ...) -> str:
        lines = []

        def walk(n: Node, depth: int) -> None:
            for c in n.children.values():
                lines.append(f"{'  ' * depth}{c.key} -> {c.value.tolist()} lock={c.lock_ref}")
                walk(c, depth + 1)

        for ns, root in self._roots.items():
            if namespace is ... or ns == namespace:
                lines.append(f"[{ns!r}]")
                walk(root, 1)
        return "\n".join(lines)
