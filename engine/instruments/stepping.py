"""Step mode: the decode loop stops before feeding each token until the caller chooses it.

The inference thread calls `offer` and then `wait`; any other thread (the UI) calls
`take`, `take_greedy` or `resume`. `wait` also returns when the answer is cancelled, with
the sampled token, so a cancel never hangs on a paused step.

    gate.pause()                      # from the next token on, each step waits
    ... StepPaused(index, sampled, greedy, top_k) arrives ...
    gate.take(alternative_id)         # or gate.take() for the sampled one, gate.take_greedy()
    gate.resume()                     # full speed again
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.sampling import Draw, SamplingSettings


@dataclass(frozen=True)
class PendingStep:
    """A drawn step waiting for a choice, with what the sampler stages view needs to redo it."""

    index: int
    draw: Draw
    logits: torch.Tensor
    """The step's raw logits (a reference, not a copy; valid while the step waits)."""
    seen: torch.Tensor
    """Token ids the repetition penalty looked at (empty when it is off)."""
    settings: SamplingSettings


class StepGate:
    """Holds one drawn step at a time until the caller answers with the token to take."""

    poll_s = 0.05
    """How often a waiting step checks the cancel flag."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.enabled = False
        """Read by the decode loop before each token: a plain attribute, nothing else per token."""
        self.pending: PendingStep | None = None
        self._choice: Draw | None = None

    # -- the caller's side (any thread) ------------------------------------------------
    def pause(self) -> None:
        """Turn step mode on; the next drawn token waits."""
        with self._lock:
            self.enabled = True

    def resume(self) -> None:
        """Turn step mode off; a waiting step takes its sampled token and decoding runs on."""
        with self._lock:
            self.enabled = False
            self._lock.notify_all()

    def take(self, token_id: int | None = None) -> Draw:
        """Answer the waiting step: `None` takes the sampled token, else the sampled or a top-k id.

        Raises RuntimeError when no step waits, ValueError for a token that is not offered.
        """
        with self._lock:
            if self.pending is None:
                raise RuntimeError("no step is waiting")
            draw = self.pending.draw
            self._choice = draw if token_id is None else draw.take(token_id)
            self._lock.notify_all()
            return self._choice

    def take_greedy(self) -> Draw:
        """Answer the waiting step with its most probable token."""
        with self._lock:
            if self.pending is None:
                raise RuntimeError("no step is waiting")
            greedy = self.pending.draw.greedy_id
        return self.take(greedy)

    # -- the decode loop's side ---------------------------------------------------------
    def offer(self, pending: PendingStep) -> None:
        with self._lock:
            self.pending = pending
            self._choice = None

    def wait(self, cancel: threading.Event) -> Draw:
        """Block until the caller answers, resumes, or cancels; return the draw to take."""
        with self._lock:
            while self._choice is None and self.enabled and not cancel.is_set():
                self._lock.wait(self.poll_s)
            assert self.pending is not None, "wait() without offer()"
            chosen = self._choice or self.pending.draw
            self.pending = None
            self._choice = None
            return chosen
