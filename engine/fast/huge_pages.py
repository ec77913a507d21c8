"""The fast path's weights moved into 2 MiB pages, on a thread of their own.

A decode step streams every weight once a token. In 4 KiB pages that is a TLB miss every 4 KiB
(in a virtual machine, a page walk through two sets of tables); in 2 MiB pages, one every 2 MiB.
Gemma 3 270M's compiled fp32 step (1.07 GB a token) ran 4.8% faster with them, in one process
with both copies of the weights, 20 windows alternating (2-core Zen 4 VM; BENCHMARKS.md).

Linux backs a range with huge pages on request (MADV_HUGEPAGE, for memory faulted in later) or
rebuilds it in them in place (MADV_COLLAPSE, Linux 6.1+): no second copy, so no higher peak, but
copying ~1 GB that way takes 1-6 s here, so it runs beside the app's first seconds, not in its
load. Before 6.1 the advice alone leaves the work to the kernel's own background collapsing.
The contents never change; only how they are mapped does. LLMCHAT_HUGE_PAGES=0 turns it off
(to measure the difference).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref

import torch

from engine.fast import pages
from engine.fast.pages import libc

SIZE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # Linux


def whole_pages(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(start, length) of the 2 MiB pages lying wholly inside a CPU tensor's bytes; None if none do."""
    return pages.whole_pages(tensor, SIZE)


def settle(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Start moving `tensors`' memory into huge pages; the thread doing it, or None where there is
    nothing to do (no whole huge page among them, not Linux, turned off)."""
    work = _work(tensors)
    if not work:
        return None
    thread = threading.Thread(target=_collapse, args=(work,), name="llmchat-huge-pages", daemon=True)
    thread.start()
    return thread


def move(tensors: list[torch.Tensor]) -> None:
    """Move `tensors`' memory into huge pages now, where `settle` would."""
    _collapse(_work(tensors))


def _work(tensors: list[torch.Tensor]) -> list[tuple[weakref.ref, tuple[int, int]]]:
    """Each tensor with whole huge pages, by a weak reference, and those pages, the largest (the LM
    head) first; empty where nothing is to be moved."""
    if os.environ.get("LLMCHAT_HUGE_PAGES") == "0" or not sys.platform.startswith("linux") or libc() is None:
        return []
    # Weak references: a model dropped meanwhile (a precision switch) is freed at once, and its
    # tensors' addresses, which new memory may reuse, are skipped.
    work = [(weakref.ref(t), inside) for t in tensors if (inside := whole_pages(t)) is not None]
    return sorted(work, key=lambda item: -item[1][1])


def _collapse(work: list[tuple[weakref.ref, tuple[int, int]]]) -> None:
    for tensor, (start, length) in work:
        alive = tensor()  # held while its pages are rebuilt
        if alive is None:
            continue
        address, size = ctypes.c_void_p(start), ctypes.c_size_t(length)
        libc().madvise(address, size, MADV_HUGEPAGE)
        libc().madvise(address, size, MADV_COLLAPSE)
