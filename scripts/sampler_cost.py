"""What sampling a token costs inside a real answer: torch's ops against the summary kernel.

    .venv/bin/python scripts/sampler_cost.py [--precision bf16] [--temperatures 0,0.7] [--rounds 4]
                                             [--model GGUF --raw]

Runs the built-in model's (or --model's; --raw for a base model, as `llmchat --raw`) compiled
decode step in a chat session and answers the same prompt
(128 tokens, EOS ignored) with the sampler summarizing each step by torch's ops and by the one
kernel call (engine/fast/sample_summary.cpp), alternating answer by answer so both see the
machine in the same state. Prints, per answer, the sampler's microseconds per token and the
median inter-token latency. Measured in an answer, not a loop: right after a step every torch
op pays more than in a loop benchmark (docs/benchmarks-history.md). Not part of CI.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import DEFAULT_MODEL, models
from engine import session as session_module
from engine.events import TokenSampled
from engine.fast import kernels
from engine.sampling import Sampler, SamplingSettings
from engine.session import ChatSession, Message

PROMPT = "Write a long story about a dragon."


class TimedSampler(Sampler):
    """The session's sampler, summarizing by the kernel or not, adding up its time per call."""

    fused_now = True
    seconds = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, fused=TimedSampler.fused_now)

    def sample(self, logits: torch.Tensor, seen: torch.Tensor):
        started = time.perf_counter()
        draw = super().sample(logits, seen)
        TimedSampler.seconds += time.perf_counter() - started
        return draw


def answer(session: ChatSession, fused: bool) -> tuple[float, float]:
    """(sampler microseconds per token, median inter-token latency in microseconds)."""
    TimedSampler.fused_now, TimedSampler.seconds = fused, 0.0
    session.reset()
    ids = session.template([Message("user", PROMPT)])
    tokens = [e for e in session.run(ids, stop_at_eos=False) if isinstance(e, TokenSampled)]
    itl = statistics.median(t.latency_s for t in tokens[1:])
    return TimedSampler.seconds / len(tokens) * 1e6, itl * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--raw", action="store_true", help="no chat template: the prompt is continued")
    args = parser.parse_args()
    problem = kernels.load("sampling")
    if problem is not None:
        raise SystemExit(f"the kernels did not build: {problem}")
    session_module.Sampler = TimedSampler
    loaded = models.load(args.model, args.precision, "cpu", chat=not args.raw)
    session = ChatSession(loaded, compile=True, raw=args.raw)
    session.compiled.wait_settled(900)
    for temperature in (float(t) for t in args.temperatures.split(",")):
        session.sampling = SamplingSettings(temperature=temperature, max_new_tokens=128, seed=1)
        answer(session, fused=True)  # warm-up
        print(f"{args.precision}, temperature {temperature:g}: sampler us/token, median ITL us")
        ratios = []
        for _ in range(args.rounds):
            (torch_s, torch_itl), (kernel_s, kernel_itl) = answer(session, False), answer(session, True)
            ratios.append(torch_itl / kernel_itl)
            print(
                f"  torch ops {torch_s:5.0f} {torch_itl:7.0f}   kernel {kernel_s:5.0f} {kernel_itl:7.0f}"
                f"   tok/s kernel/torch {ratios[-1]:.3f}x",
                flush=True,
            )
        print(f"  median tok/s kernel/torch: {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
