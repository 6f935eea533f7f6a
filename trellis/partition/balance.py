"""Part-size caps after a partitioner ran: nodes always, and with ``--balance`` training nodes and in-edges too.

Why a pass of its own: a min-cut partition of a homophilous graph follows its classes, and a training split
drawn per class (Shchur et al.'s protocol) then lands unevenly on the parts, so data-parallel ranks training
them get unequal targets and batch counts; and a part of equal nodes but more in-edges aggregates more, so its
rank is the one every step waits for. pymetis has no multi-constraint partitioning and the streaming methods
balance node counts only, so every destination-owned method gets the same greedy multi-constraint repair
(METIS-style constraints, repaired after the method): a node in a part above some cap on which it carries
weight moves to the part that holds most of its neighbours among those with room for it under every cap.
Training nodes are visited first, then the rest, in a seeded random order (when in-edges are balanced, the rest
with the largest share of neighbours in other parts first: their moves cut least), for a few rounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.utils.numba import njit

#: ``--balance`` constraints besides node counts (combine with a comma: ``train,edges``).
BALANCES = ("nodes", "train", "edges")


def parse_balance(spec: str) -> tuple[str, ...]:
    """The constraints of a ``--balance`` value besides nodes: ``"train,edges"`` -> ``("train", "edges")``.

    Raises:
        TrellisUserError: An unknown name.
    """
    names = [n.strip() for n in str(spec).split(",") if n.strip()]
    bad = [n for n in names if n not in BALANCES]
    if bad or not names:
        raise TrellisUserError(f"--balance {spec!r}: give one or more of {', '.join(BALANCES)}, comma-separated "
                               "(e.g. --balance train,edges)")
    return tuple(n for n in BALANCES[1:] if n in names)


def train_mask(store: GraphStore) -> np.ndarray:
    """``bool [N]``: the store's training nodes.

    Raises:
        TrellisUserError: The store has no training split.
    """
    train = store.split("train")
    if train is None or len(train) == 0:
        raise TrellisUserError(f"--balance train: {store.path} has no training split to balance; use --balance nodes")
    mask = np.zeros(store.num_nodes, dtype=bool)
    mask[np.asarray(train, dtype=np.int64)] = True
    return mask


@njit(cache=True, nogil=True)
def _enforce_caps(xadj: np.ndarray, adjncy: np.ndarray, parts: np.ndarray, caps: np.ndarray, order: np.ndarray,
                  weight: np.ndarray, num_parts: int, trigger: int, check: np.ndarray, target: int) -> int:
    num_c = caps.shape[0]
    sizes = np.zeros((num_parts, num_c), dtype=np.int64)
    for v in range(parts.shape[0]):
        for c in range(num_c):
            sizes[parts[v], c] += weight[v, c]
    cnt = np.zeros(num_parts, dtype=np.int64)
    moved = 0
    for v in order:
        p = parts[v]
        if weight[v, trigger] == 0 or sizes[p, trigger] <= target:
            continue
        for k in range(xadj[v], xadj[v + 1]):
            cnt[parts[adjncy[k]]] += 1
        best = -1
        for q in range(num_parts):
            if q == p:
                continue
            fits = True
            for c in range(num_c):
                if check[c] and sizes[q, c] + weight[v, c] > caps[c]:
                    fits = False
            if fits and (best < 0 or cnt[q] > cnt[best] or (cnt[q] == cnt[best] and sizes[q, 0] < sizes[best, 0])):
                best = q
        for q in range(num_parts):
            cnt[q] = 0
        if best >= 0:
            parts[v] = best
            for c in range(num_c):
                sizes[p, c] -= weight[v, c]
                sizes[best, c] += weight[v, c]
            moved += 1
    return moved


def enforce_cap(xadj: np.ndarray, adjncy: np.ndarray, parts: np.ndarray, num_parts: int, cap: int,
                seed: int) -> int:
    """Move nodes out of parts above ``cap`` nodes into parts with room; returns how many moved.

    Visits nodes in a seeded random order and sends each surplus node to the part with room that holds
    most of its neighbours, so the cut grows as little as a single greedy pass allows.
    """
    if np.bincount(parts, minlength=num_parts).max(initial=0) <= cap:
        return 0
    order = np.random.default_rng(seed).permutation(parts.shape[0])
    weight = np.ones((parts.shape[0], 1), dtype=np.int64)
    return int(_enforce_caps(xadj, adjncy, parts, np.array([cap], dtype=np.int64), order, weight, num_parts, 0,
                             np.ones(1, dtype=np.bool_), int(cap)))


@njit(cache=True, nogil=True)
def _away_share(indptr: np.ndarray, indices: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """``[N]`` share of each node's in-neighbours in another part (0 for a node without any); O(N) memory."""
    n = indptr.shape[0] - 1
    out = np.zeros(n, dtype=np.float64)
    for v in range(n):
        a, b = indptr[v], indptr[v + 1]
        if b > a:
            away = 0
            for k in range(a, b):
                if parts[indices[k]] != parts[v]:
                    away += 1
            out[v] = away / (b - a)
    return out


@njit(cache=True, nogil=True)
def _neighbours_in(indptr: np.ndarray, indices: np.ndarray, parts: np.ndarray, nodes: np.ndarray,
                   q: int) -> np.ndarray:
    """``[len(nodes)]`` in-neighbours of each of ``nodes`` in part ``q``."""
    out = np.zeros(nodes.shape[0], dtype=np.int64)
    for i in range(nodes.shape[0]):
        v = nodes[i]
        for k in range(indptr[v], indptr[v + 1]):
            if parts[indices[k]] == q:
                out[i] += 1
    return out


def give_every_part_a_training_node(indptr: np.ndarray, indices: np.ndarray, parts: np.ndarray,
                                    train: np.ndarray, num_parts: int) -> int:
    """Swap a training node into each part that has none (when there are as many as parts); returns the swaps.

    Why: the caps bound the most a part holds, not the least: 4 training nodes over 4 parts may cap each at 2,
    and a part left with none gave its rank no target (refused, advising ``--balance train``, which then
    changed nothing). Each swap moves the training node of the richest part with the most neighbours in the
    empty part there, and a non-training node of the empty part with the most neighbours in the richest part
    back, so node counts stay as they were.
    """
    counts = np.bincount(parts[train], minlength=num_parts)
    if int(counts.sum()) < num_parts:
        return 0
    swaps = 0
    for q in np.flatnonzero(counts == 0):
        p = int(np.argmax(counts))  # holds at least 2: as many training nodes as parts, and q has none
        donors = np.flatnonzero(train & (parts == p))
        v = donors[int(np.argmax(_neighbours_in(indptr, indices, parts, donors, int(q))))]
        back = np.flatnonzero(~train & (parts == q))
        parts[v] = q
        if back.size:
            parts[back[int(np.argmax(_neighbours_in(indptr, indices, parts, back, p)))]] = p
        counts[p] -= 1
        counts[q] += 1
        swaps += 1
    return swaps


#: Rounds of the multi-constraint repair (a node that found no room in one round may in the next).
ROUNDS = 4


def rebalance(store: GraphStore, parts: np.ndarray, num_parts: int, constraints: tuple[str, ...],
              imbalance: float, seed: int, node_cap: int) -> dict[str, Any]:
    """Give every part at most its share of nodes and of each of ``constraints``, moving nodes in ``parts``.

    ``train``: training nodes; ``edges``: in-edges, the aggregation work. Neighbour counts come from the
    store's in-edge CSR (memory-mapped, so a streaming partitioner's memory stays flat). Returns what moved
    and how balanced each constraint ends (max part over mean), for the book's ``params``.
    """
    indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
    n = int(store.num_nodes)
    cols = [np.ones(n, dtype=np.int64)]
    caps = [int(node_cap)]
    train = train_mask(store) if "train" in constraints else np.zeros(n, dtype=bool)
    for name in constraints:
        col = train.astype(np.int64) if name == "train" else np.diff(indptr).astype(np.int64)
        cols.append(col)
        caps.append(max(int(np.ceil(int(col.sum()) / num_parts * (1.0 + imbalance))), int(col.max(initial=0))))
    weight = np.ascontiguousarray(np.stack(cols, axis=1))
    cap = np.asarray(caps, dtype=np.int64)
    perm = np.random.default_rng(seed).permutation(n)
    names = ("nodes", *constraints)
    # Passes in priority order. Training nodes move first (room for training nodes is all they need: the
    # passes after them make node room by moving other nodes, which leaves the training counts alone); then
    # surplus in-edges, then surplus nodes, the last two moving no training node. The edge pass drains a part
    # to half the slack above the mean, not to the cap, so the parts it fills keep room for the node pass,
    # which must keep the edge cap (else a node pass could only undo it).
    passes = []
    if "train" in names:
        passes.append((names.index("train"), perm[train[perm]], [names.index("train")], caps[names.index("train")]))
    rest = perm[~train[perm]]
    if "edges" in names:  # boundary nodes first: moving a node most of whose neighbours are elsewhere cuts least
        rest = rest[np.argsort(-_away_share(indptr, indices, parts)[rest], kind="stable")]
    if "edges" in names:
        e = names.index("edges")
        mid = int(np.ceil(float(weight[:, e].sum()) / num_parts * (1.0 + imbalance / 2)))
        passes.append((e, rest, [e], mid))
    passes.append((0, rest, [0] + ([names.index("edges")] if "edges" in names else []), caps[0]))
    moved = 0
    for _ in range(ROUNDS):
        sizes = np.stack([np.bincount(parts, weights=weight[:, c], minlength=num_parts) for c in range(len(caps))], 1)
        if np.all(sizes <= cap):
            break
        step = 0
        for trigger, order, checked, target in passes:
            check = np.zeros(len(caps), dtype=np.bool_)
            check[checked] = True
            step += int(_enforce_caps(indptr, indices, parts, cap, order, weight, int(num_parts), trigger, check,
                                      int(target)))
        moved += step
        if step == 0:
            break
    if "train" in constraints:
        moved += 2 * give_every_part_a_training_node(indptr, indices, parts, train, int(num_parts))
    out: dict[str, Any] = {"balance": ",".join(constraints) or "nodes", "rebalanced": moved}
    for c, name in enumerate(names):
        per = np.bincount(parts, weights=weight[:, c], minlength=num_parts)
        out[f"balance_{name}"] = float(per.max() / max(per.mean(), 1e-12))
    return out
