"""N-gram prompt-lookup proposer: drafts the tokens that followed the latest earlier occurrence
of the sequence's current suffix. Model-free and incremental: O(new tokens x n) per step."""

from __future__ import annotations


class NgramIndex:
    """Per-sequence index: for every n-gram (n in [n_min, n_max]) the position right after its
    most recent occurrence that already has a continuation."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_min = n_min
        self.n_max = n_max
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # tokens[: _num_indexed] have been indexed as continuations

    def update(self, tokens: list[int]) -> None:
        """Indexes every position j < len(tokens) not yet seen: n-gram tokens[j-n:j] -> j."""
        for j in range(max(self._num_indexed, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self._next[tuple(tokens[j - n : j])] = j
        self._num_indexed = max(self._num_indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens continuing ``tokens`` (longest matching n-gram first)."""
        self.update(tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            j = self._next.get(tuple(tokens[-n:]))
            if j is not None:
                return tokens[j : j + k]
        return []


class NgramProposer:
    """Keeps one ``NgramIndex`` per live sequence."""

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.n_min, self.n_max)
        return index.propose(tokens, k)

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)
