"""A GPU decode step replayed from a CUDA graph.

At 135M parameters a decode step on a GPU is bound by launches, not by its reads: ~25 small
kernels a layer, each launched from Python, take longer to launch than to run. A CUDA graph
records the step's kernels once and replays them all with one launch.

The step recorded is engine/fast/steps.py `whole_step`, which was written for this: it writes
the new K/V into the cache's preallocated buffers at a position it reads from a device tensor
and attends over the whole buffer with the slots past that position masked, so nothing in it
depends on the token or the position on the host. One recording serves every token until the
buffers change (a new cache, or one grown past its capacity, reallocates them): then the next
token records again, on the inference thread, inside that token's latency (a warm-up call and
the recording: tens of milliseconds).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

EVERY_ATTENTION_KERNEL = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""cuDNN's attention included: a load on a GPU turns it off for the eager forwards, whose every
call is a new length it would plan for (engine/models.py). A recording has one shape, replayed for
every token, and there its plan is the fastest (H200, bf16: a step 1.87 ms with it, 2.20 without;
at 4,000 tokens of context 3.9 against 9.6 ms)."""


class GraphedStep:
    """`step(fast, token, position, offsets, keys, values) -> logits`, replayed from a recording."""

    def __init__(self, step: Callable):
        self.step = step
        self.recordings = 0
        """How many times the step was recorded (once per set of cache buffers)."""
        self._graph: torch.cuda.CUDAGraph | None = None
        self._recorded_for: tuple | None = None
        self._token = self._position = self._offsets = self._logits = None

    def __call__(
        self, fast, token: torch.Tensor, position: torch.Tensor, offsets: torch.Tensor, keys, values
    ) -> torch.Tensor:
        buffers = (*keys, *values)
        recorded_for = (keys[0].shape[2], *(buffer.data_ptr() for buffer in buffers))
        if recorded_for != self._recorded_for:
            self._record(fast, token, position, offsets, keys, values)
            self._recorded_for = recorded_for
        self._token.copy_(token)
        self._position.copy_(position)
        self._offsets.copy_(offsets)
        self._graph.replay()
        return self._logits.clone()  # the next replay overwrites the recording's output

    def _record(self, fast, token: torch.Tensor, position: torch.Tensor, offsets, keys, values) -> None:
        self._graph = self._logits = None  # the old recording's memory goes first
        device = keys[0].device
        self._token, self._position = token.to(device).clone(), position.to(device).clone()
        self._offsets = offsets.to(device).clone()
        self._graph, self._logits = record(
            lambda: self.step(fast, self._token, self._position, self._offsets, keys, values), device
        )
        self.recordings += 1


def record(
    step: Callable[[], torch.Tensor], device: torch.device
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step()` recorded as a CUDA graph: (the graph, the output its replays write)."""
    # A warm-up call off the recording: lazy initialisations (cuBLAS's handle and workspace)
    # must not happen inside it. It writes the same K/V the replay then writes.
    with sdpa_kernel(EVERY_ATTENTION_KERNEL):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the app's other threads may touch CUDA (the memory figures) meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = step()
    return graph, output
