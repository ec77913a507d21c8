"""Which code runs a decode step now, and why: what the Phase panel and `--json` show.

`ChatSession.forward` takes the compiled step once it is ready, else the eager fused fast
path, else the transformers forward; this says the same in words, so a projected ITL is
never read as the compiled step's while the eager one is running.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.events import DecodeStep
from engine.fast import attention, compiled, fused, kernels

if TYPE_CHECKING:
    from engine.session import ChatSession

COMPILE_OFF = "compile off: --no-compile (or LLMCHAT_COMPILE=0)"
BUILDING = "compiling in the background (about 10 s the first time, 1-3 s once saved)"


def _attention(session: ChatSession) -> str:
    """The fused step calls the decode-attention kernel once it is loaded, for a cache type it reads."""
    readable = getattr(torch, session.info.cache_dtype) in attention.KERNEL_DTYPES
    return "kernel" if kernels.is_loaded("step") and readable and session.device.type == "cpu" else "SDPA"


def decode_step(session: ChatSession, off: str = COMPILE_OFF) -> DecodeStep:
    """The decode step `session` runs now, with the compile's state and why; `off` says why
    nothing compiles where the session was made without compiling."""
    if session.fast is None:
        why = "the fast path is off: the transformers forward (the reference)"
        if session.fast_path_wanted:
            why = f"no fast path for this model ({fused.supports(session.model)})"
        return DecodeStep("hf", "HF", "off" if not session.compile_wanted else "unsupported", why)
    if not session.compile_wanted:
        return DecodeStep("eager", _attention(session), "off", off)
    build = session.compiled
    if build is None:
        why = compiled.supports(session.fast, getattr(torch, session.info.cache_dtype)) or ""
        return DecodeStep("eager", _attention(session), "unsupported", why)
    state = build.state
    if state == "ready":
        kernel = "SDPA" if build.kernel_error else _attention(session)
        why = build.how()
        if build.kernel_error:
            why += f"; {compiled.WITHOUT_KERNEL} ({build.kernel_error})"
        return DecodeStep("compiled", kernel, "ready", why, build.compile_s)
    if state == "building":
        elapsed = time.monotonic() - build.started
        return DecodeStep("eager", _attention(session), "building", BUILDING, elapsed)
    why = {
        "failed": f"compile failed: {build.error}",
        "given up": f"compile given up: {build.error}",
        "stopped": "compile stopped: the model, precision or KV cache changed",
    }[state]
    return DecodeStep("eager", _attention(session), state, why, build.compile_s)
