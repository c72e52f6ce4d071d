"""Page allocator: free list, per-request page tables, and page commitments.

Pages held by a request are pinned: nothing is ever evicted or preempted. To make that safe, a
request *commits* the pages it may grow into (prompt + max new tokens) when it is admitted; the
commitments never exceed the pool, so a running request can always extend its table and a request
that does not fit simply waits. All methods are thread-safe (the decode role reserves pages from
another thread while the engine loop runs).
"""

from __future__ import annotations

import threading
from collections import deque


class PoolFullError(RuntimeError):
    """The pool cannot hold (or commit) the pages asked for right now."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = deque(range(num_pages))
        self._tables: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}
        self._committed_total = 0
        self._lock = threading.Lock()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def uncommitted_pages(self) -> int:
        with self._lock:
            return self.num_pages - self._committed_total

    def allocate(self, req_id: str, n_tokens: int, commit_tokens: int = 0) -> list[int]:
        """Create ``req_id``'s table with pages for ``n_tokens``, committing room for
        ``max(n_tokens, commit_tokens)`` tokens. Raises :class:`PoolFullError` if that does not fit."""
        with self._lock:
            if req_id in self._tables:
                raise ValueError(f"request {req_id!r} already holds pages")
            n_pages = self.pages_for(n_tokens)
            commit = max(n_pages, self.pages_for(commit_tokens))
            if commit > self.num_pages - self._committed_total:
                raise PoolFullError(
                    f"request {req_id!r} needs {commit} pages; "
                    f"{self.num_pages - self._committed_total} of {self.num_pages} uncommitted"
                )
            self._tables[req_id] = [self._free.popleft() for _ in range(n_pages)]
            self._committed[req_id] = commit
            self._committed_total += commit
            return list(self._tables[req_id])

    def extend(self, req_id: str, n_tokens: int) -> list[int]:
        """Grow ``req_id``'s table to cover ``n_tokens`` tokens; returns the pages added."""
        with self._lock:
            table = self._table(req_id)
            missing = self.pages_for(n_tokens) - len(table)
            if missing <= 0:
                return []
            over = len(table) + missing - self._committed[req_id]
            if over > 0:
                if over > self.num_pages - self._committed_total:
                    raise PoolFullError(f"request {req_id!r} cannot grow by {missing} pages: pool fully committed")
                self._committed[req_id] += over
                self._committed_total += over
            added = [self._free.popleft() for _ in range(missing)]
            table.extend(added)
            return added

    def shrink(self, req_id: str, n_tokens: int) -> int:
        """Free ``req_id``'s pages beyond those ``n_tokens`` tokens need (rejected draft tokens);
        its commitment stays, so it can grow again. Returns how many pages were freed."""
        with self._lock:
            table = self._table(req_id)
            keep = self.pages_for(n_tokens)
            freed = table[keep:]
            del table[keep:]
            self._free.extend(freed)
            return len(freed)

    def commit(self, req_id: str, commit_tokens: int) -> None:
        """Raise ``req_id``'s commitment to ``commit_tokens`` tokens (PoolFullError if it can't)."""
        with self._lock:
            self._table(req_id)
            extra = self.pages_for(commit_tokens) - self._committed[req_id]
            if extra <= 0:
                return
            if extra > self.num_pages - self._committed_total:
                raise PoolFullError(f"request {req_id!r} cannot commit {extra} more pages")
            self._committed[req_id] += extra
            self._committed_total += extra

    def free(self, req_id: str) -> int:
        """Return all of ``req_id``'s pages to the free list. Unknown or already freed: KeyError."""
        with self._lock:
            table = self._table(req_id)
            del self._tables[req_id]
            self._committed_total -= self._committed.pop(req_id)
            self._free.extend(table)
            return len(table)

    def has(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._tables

    def page_table(self, req_id: str) -> list[int]:
        with self._lock:
            return list(self._table(req_id))

    def stats(self) -> dict:
        with self._lock:
            free = len(self._free)
            return {
                "total": self.num_pages,
                "free": free,
                "used": self.num_pages - free,
                "requests": len(self._tables),
                "committed": self._committed_total,
                "page_size": self.page_size,
            }

    def _table(self, req_id: str) -> list[int]:
        table = self._tables.get(req_id)
        if table is None:
            raise KeyError(f"request {req_id!r} holds no pages (unknown or already freed)")
        return table
