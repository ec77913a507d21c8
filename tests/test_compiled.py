"""The compiled decode step: built in the background, same tokens as eager, never in the way."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import models
from engine.events import TokenSampled, TurnFinished
from engine.fast import compiled, fused, gemm, matvec, steps
from engine.kvcache_layers import PreallocatedLayer
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

QUESTION = "How does inference work?"
ROOT = Path(__file__).resolve().parents[1]


def _greedy(session: ChatSession, prompt: str = QUESTION) -> list[int]:
    return [e.id for e in session.send(prompt) if isinstance(e, TokenSampled)]


def _wait_for_earlier_builds() -> None:
    """Earlier tests' step builds, which may still be shortening the switch interval, finished."""
    for earlier in list(compiled._compiling):
        earlier.join(600)


# fp32 is laid out [out, in] for the compiled matvec, or [in, out] when an eager session built
# the fast path first on a torch without oneDNN; fp16 and w8's int8 weights are widened inside
# the matvec, w4's 4-bit blocks too.
@pytest.mark.parametrize(
    "precision, eager_first",
    [("fp32", False), ("fp32", True), ("fp16", False), ("w8", False), ("w4", False)],
)
def test_compiled_step_picks_the_eager_tokens_past_a_cache_growth(
    tiny_model_dir, precision, eager_first, monkeypatch
):
    loaded = models.load(str(tiny_model_dir), precision, "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=PreallocatedLayer.initial_capacity)
    if eager_first:
        monkeypatch.setattr(gemm, "onednn_works", lambda: False)
        ChatSession(loaded, settings, compile=False)
    fast = ChatSession(loaded, settings, compile=True)
    assert fast.fast.transposed == eager_first
    assert fast.compiled is not None
    assert fast.compiled.ready.wait(600), fast.compiled.describe()
    first_tokens = _greedy(fast)  # the regional step, and the whole one from when it takes over
    assert fast.compiled.wait_settled(600) and fast.compiled.kind == "whole", fast.compiled.describe()
    compiled_tokens = _greedy(fast)  # past the first 256 slots: the buffers grow (capacity is dynamic)
    assert len(fast.cache) > PreallocatedLayer.initial_capacity
    eager = ChatSession(loaded, settings, compile=False)  # the same two turns, eager
    eager_turn_1, eager_tokens = _greedy(eager), _greedy(eager)
    assert compiled_tokens == eager_tokens
    assert first_tokens == eager_turn_1
    assert len(set(eager_tokens)) > 3
    assert "whole model in one graph" in fast.compiled.describe()
    kernel = "matvec kernel" in fast.compiled.describe()
    assert kernel == (matvec.enabled and not eager_first)  # a transposed float32 matrix: aten's matmul


@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_a_chosen_kv_cache_precision_gets_a_compiled_step_of_its_own(tiny_model_dir, cache):
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=24)
    session = ChatSession(loaded, settings, compile=True)
    assert session.compiled.wait_settled(600)
    built_for_fp32 = session.compiled
    session.set_cache_precision(cache)
    assert session.compiled is not built_for_fp32 and session.compiled.cache_dtype == getattr(
        torch, session.info.cache_dtype
    )
    assert "until the compiled step for the" in session.decode_path() or session.compiled_serves
    assert session.compiled.wait_settled(600) and session.compiled_serves, session.compiled.describe()
    tokens = _greedy(session)
    assert session.decoded_by[1] == "compiled"
    eager = ChatSession(loaded, settings, compile=False, kv_cache=cache)
    assert tokens == _greedy(eager)
    for mine, theirs in zip(session.cache.layers, eager.cache.layers):  # stored as eager stores it
        assert mine.keys.dtype == theirs.keys.dtype and mine.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(mine.dequantized(torch.float32), theirs.dequantized(torch.float32)):
            assert torch.allclose(a, b, rtol=0.02, atol=0.02)  # rounding apart, as compiled fp32 is
    build = session.compiled
    build.want_verify()
    assert build.wait_verify(600)
    assert build.verify_ready.is_set(), build.verify_error  # a verify over this cache, as eager scores it
    with torch.inference_mode():
        rows = session.forward(list(range(30, 35)), every=True)
        expected = eager.forward(list(range(30, 35)), every=True)
    assert torch.equal(rows.argmax(-1), expected.argmax(-1))
    assert torch.allclose(rows, expected, rtol=0.02, atol=0.02)
    session.set_cache_precision("fp32")  # back: the step built for it serves at once
    assert session.compiled is built_for_fp32 and session.compiled_serves


def test_one_compiled_block_serves_every_layer_and_each_model_has_its_own(tiny_model_dir):
    # Regional: the block is compiled once for all layers (plus the head), then the whole step.
    # Compiled code runs without guards, so two live models must never share it: fp32 and fp16
    # of the same model, stepped in turns, each pick their own eager tokens.
    settings = SamplingSettings(temperature=0.0, max_new_tokens=12)
    sessions = {}
    for precision in ("fp32", "fp16"):
        loaded = models.load(str(tiny_model_dir), precision, "cpu")
        session = ChatSession(loaded, settings, compile=True)
        assert session.compiled.ready.wait(600) and isinstance(session.compiled._step, steps._RegionalStep)
        assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
        assert len(session.fast.layers) > 1 and session.compiled_step_ready()
        sessions[precision] = (session, ChatSession(loaded, settings, compile=False))
    streams = {
        p: (compiled.send(QUESTION), eager.send(QUESTION)) for p, (compiled, eager) in sessions.items()
    }
    picked = {p: ([], []) for p in sessions}
    for _ in range(64):  # interleaved: the fp16 step runs between fp32 steps and back
        for precision, pair in streams.items():
            for stream, tokens in zip(pair, picked[precision]):
                event = next(stream, None)
                while event is not None and not isinstance(event, TokenSampled):
                    event = next(stream, None)
                if event is not None:
                    tokens.append(event.id)
    for precision, (from_compiled, from_eager) in picked.items():
        assert len(from_compiled) == 12 and from_compiled == from_eager, precision


def test_a_step_saved_before_is_loaded_without_the_child_and_without_tracing(
    tiny_model_dir, monkeypatch, tmp_path
):
    # The child process (start, imports, model load: ~8 s of the built-in model's ~11 s)
    # compiles each step and saves it; the app, and every later start, loads what it saved.
    # Nothing is traced in the app's process: Dynamo's trace of the whole step, even from
    # Inductor's cache, held the GIL ~5 s while an answer asked meanwhile crawled.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    children = []
    fill = compiled._compile_in_a_subprocess
    monkeypatch.setattr(
        compiled, "_compile_in_a_subprocess", lambda *a: (children.append(a[:3]), fill(*a))[1]
    )
    settings = SamplingSettings(temperature=0.0, max_new_tokens=8)
    answers = []
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):  # two loads: two fast paths, two builds of the same steps
        loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
        session = ChatSession(loaded, settings, compile=True)
        assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
        answers.append(_greedy(session))
    assert children == [(str(tiny_model_dir), "fp32", kind) for kind in ("regional", "whole")]  # first start
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == traced
    assert len(list((tmp_path / "inductor" / "llmchat-steps").glob("*.step"))) == 2
    assert answers[0] == answers[1] == _greedy(ChatSession(loaded, settings, compile=False))


def test_the_app_starts_the_compile_child_as_it_loads_the_model_and_the_session_takes_it_over(
    tiny_model_dir, monkeypatch, tmp_path
):
    # The child waited for the app's own load of the model (Gemma 3 270M through transformers:
    # ~5 s) before it started: the step was ready ~17 s after the load began, ~13 s now.
    import queue

    from engine.events import ModelReady
    from engine.worker import InferenceWorker

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    started = []
    start = compiled._start_child
    monkeypatch.setattr(compiled, "_start_child", lambda key: (started.append(key), start(key))[1])
    loading = models.load
    monkeypatch.setattr(
        models, "load", lambda *a, **k: (started.append("the app's load"), loading(*a, **k))[1]
    )
    events: queue.Queue = queue.Queue()
    worker = InferenceWorker(events.put, SamplingSettings(temperature=0.0, max_new_tokens=8), compile=True)
    regional = (str(tiny_model_dir), "fp32", "regional", "float32")
    try:
        worker.load(str(tiny_model_dir), "fp32", "cpu")
        while not isinstance(events.get(timeout=120), ModelReady):
            pass
        session = worker.session
        assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
        # The regional step's child before the app's load, taken over by the session's build.
        assert started == [regional, "the app's load", regional[:2] + ("whole", "float32")]
        assert _greedy(session) == _greedy(ChatSession(session.loaded, worker.sampling, compile=False))
    finally:
        worker.shutdown()
    # A later start: the step is saved (noted by the child), so nothing starts before the load.
    assert steps.made_before(*regional)
    compiled.start_early(str(tiny_model_dir), "fp32", torch.float32)
    assert len(started) == 3 and not compiled._early


def test_the_early_child_starts_only_where_a_step_compiles_here(monkeypatch):
    """On a CPU at fp32, 16-bit, w8 and w4 (over the KV cache chosen), not at w8a8 (its weights are
    opaque to the compiler), on a GPU (a CUDA graph, nothing to compile) or without --compile."""
    from engine import worker as worker_module
    from engine.quant.precision import precision_for
    from engine.worker import InferenceWorker, Load

    started = []
    monkeypatch.setattr(worker_module, "start_early", lambda *args: started.append(args))
    worker = InferenceWorker(lambda event: None, compile=True)
    try:
        for precision in ("fp32", "bf16", "w8", "w4", "w8a8"):
            worker._compile_early(Load("m", precision, "cpu"))
        worker._compile_early(Load("m", "fp32", "cuda"))
        worker.kv_cache = "int8"
        worker._compile_early(Load("m", "fp32", "cpu"))
        worker.compile = False
        worker._compile_early(Load("m", "fp32", "cpu"))
    finally:
        worker.shutdown()
    own = [("m", name, precision_for(name, "cpu").cache_dtype) for name in ("fp32", "bf16", "w8", "w4")]
    assert started == [*own, ("m", "fp32", torch.int8)]


def test_an_early_child_no_session_takes_over_is_stopped_and_one_with_nothing_to_compile_noted(
    tiny_model_dir, monkeypatch, tmp_path
):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    spec = str(tiny_model_dir)
    # The user switched to another precision while the first still loaded: its child stops.
    compiled.start_early(spec, "bf16", torch.bfloat16)
    (stale,) = compiled._early.values()
    compiled.start_early(spec, "fp32", torch.float32)
    assert stale.poll() is not None and list(compiled._early) == [(spec, "fp32", "regional", "float32")]
    # The step was saved already (its note lost): the session loads it and the early child stops.
    compiled.stop_early()
    assert not compiled._compile_in_a_subprocess(spec, "fp32", "regional", torch.float32)
    next((tmp_path / "inductor" / "llmchat-steps" / "made").iterdir()).unlink()
    compiled.start_early(spec, "fp32", torch.float32)
    (early,) = compiled._early.values()
    session = ChatSession(models.load(spec, "fp32", "cpu"), SamplingSettings(), compile=True)
    try:
        assert session.compiled.ready.wait(120)
        assert early.poll() is not None and not compiled._early
    finally:
        session.compiled.stop()
    # A model the fast path does not run: its child notes that there is nothing to compile, and
    # later starts start none for it.
    capping = {"attn_logit_softcapping": 50.0}
    capped = build_tiny_model(tmp_path / "capped", family="gemma3_text", config=capping)
    assert not compiled._compile_in_a_subprocess(str(capped), "fp32", "regional", torch.float32)
    assert steps.made_before(str(capped), "fp32", "regional", "float32")
    assert not steps.made_before(str(capped), "bf16", "regional", "bfloat16")


def test_the_child_compiles_while_the_kernel_builds_and_the_app_loads_what_it_saved(
    tiny_model_dir, monkeypatch, tmp_path
):
    # On a fresh machine the child waited for the app's build of the attention kernel (~6 s)
    # before tracing: it now traces the step calling the kernel without it, and the app loads
    # the saved step, which calls the kernel the app has loaded meanwhile.
    import fcntl

    from engine.fast import fused, kernels

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled, "CHILD_TIMEOUT_S", 120)
    directory = kernels._build_directory("step")
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / kernels.LOCK_FILE, "a+") as build:
        fcntl.flock(build, fcntl.LOCK_EX)  # a build of the kernel in progress
        timed_out = compiled._compile_in_a_subprocess(str(tiny_model_dir), "fp32", "regional", torch.float32)
    assert not timed_out, "the child waited for the kernel's build"
    assert kernels.load("step") is None
    fast = fused.for_model(models.load(str(tiny_model_dir), "fp32", "cpu").model, compiled=True)
    step = steps.assemble("regional", steps.load(steps.saved_path(fast, torch.float32, "regional")))
    buffers, again = steps.scratch_buffers(fast, torch.float32), steps.scratch_buffers(fast, torch.float32)
    with torch.inference_mode():
        for position, token in enumerate([5, 9, 2]):  # the kernel attends over 1, 2, 3 positions
            args = (fast, torch.tensor([token]), torch.tensor([position]), steps.no_offsets(fast))
            logits, expected = step(*args, *buffers), steps.whole_step(*args, *again)
    assert torch.allclose(logits, expected, atol=1e-4) and logits.abs().sum() > 0


def test_the_child_compiles_a_base_model_too(tiny_model_dir, monkeypatch, tmp_path):
    # A model without a chat template (Gemma 3 270M, run with --raw): the child's load refused it
    # ("not a chat model"), and the app compiled the step itself, holding the GIL while an answer
    # streamed (Gemma's cold start: regional step ready after 26.6 s, 7.6 tok/s meanwhile).
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert not compiled._compile_in_a_subprocess(str(base), "fp32", "regional", torch.float32)
    loaded = models.load(str(base), "fp32", "cpu", chat=False)
    assert not getattr(loaded.tokenizer, "chat_template", None)
    fast = fused.for_model(loaded.model, compiled=True)
    assert steps.saved_path(fast, torch.float32, "regional").exists()


def test_making_a_step_ready_here_lets_a_streaming_answer_have_the_gil_often(tiny_model_dir, monkeypatch):
    # Loading a saved step holds the GIL (~0.3 s; a compile here, seconds); at Python's 5 ms
    # switch interval an answer streaming meanwhile got 250 ms tokens. While a step is made
    # ready here the interval is short, and it is back to what it was once the build is done.
    _wait_for_earlier_builds()
    seen = []
    load = steps.load
    monkeypatch.setattr(steps, "load", lambda *a: (seen.append(sys.getswitchinterval()), load(*a))[1])
    before = sys.getswitchinterval()
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=4), compile=True)
    assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
    assert seen == pytest.approx([compiled.SWITCH_INTERVAL_S] * 2)  # the regional step, the whole one
    assert compiled.SWITCH_INTERVAL_S < before / 10
    assert sys.getswitchinterval() == before


def test_two_steps_made_ready_at_once_leave_the_usual_switch_interval(tiny_model_dir, monkeypatch):
    # A precision switch mid-build: two builds load their steps at once. Each put back the
    # interval it had found, and the second had found the first's short one: the app went on
    # switching every 0.1 ms for good. Here both are inside `load` together, the first leaves first.
    _wait_for_earlier_builds()
    before = sys.getswitchinterval()
    load, both_inside, entered, lock = steps.load, threading.Barrier(2), [], threading.Lock()

    def load_beside_the_other(*args):
        with lock:
            entered.append(None)
            second = len(entered) % 2 == 0
        both_inside.wait(120)
        if second:
            time.sleep(0.3)  # the first in is the first out
        return load(*args)

    monkeypatch.setattr(steps, "load", load_beside_the_other)
    sessions = [
        ChatSession(models.load(str(tiny_model_dir), precision, "cpu"), compile=True)
        for precision in ("fp32", "fp16")
    ]
    for session in sessions:
        assert session.compiled.wait_settled(600) and session.compiled.kind == "whole"
    assert len(entered) == 4  # each one's regional step, then each one's whole step
    assert sys.getswitchinterval() == before


def test_a_failed_compilation_leaves_eager_answering(tiny_model_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled, "_compile_in_a_subprocess", lambda *args: False)  # it saved nothing
    monkeypatch.setattr(steps, "saved_path", lambda *args: None)
    monkeypatch.setattr(steps, "compile_here", broken)
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")  # a fresh fast path: compiled anew
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=8), compile=True)
    reports = []
    reported = threading.Event()
    session.compiled.when_done(lambda c: (reports.append(c), reported.set()))
    assert len(_greedy(session)) == 8  # eager answers meanwhile
    assert reported.wait(600)
    assert reports == [session.compiled] and not session.compiled.ready.is_set()
    assert "no C++ compiler found" in session.compiled.describe() and "\n" not in session.compiled.describe()


def test_w8a8_is_not_compiled(tiny_model_dir):
    loaded = models.load(str(tiny_model_dir), "w8a8", "cpu")
    session = ChatSession(loaded, compile=True)
    assert session.compiled is None
    assert "opaque" in compiled.supports(session.fast)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_quitting_while_compiling_ends_the_process_cleanly_and_stops_the_child():
    # Interpreter shutdown under a running compile aborted the app (exit 134); this ends it first.
    script = """
import subprocess, sys, threading, time
from engine.fast import compiled
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
compiled._children.append(child)
print(child.pid, flush=True)
compiled.exit_if_compiling(5)  # nothing compiling: returns
thread = threading.Thread(target=time.sleep, args=(120,), daemon=True)
thread.start()
compiled._compiling.append(thread)
compiled.exit_if_compiling(3)
print("still running")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 3, done.stderr
    assert "still running" not in done.stdout
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


def test_layers_that_differ_are_not_compiled_as_one_block(tiny_model_dir):
    # One block's graph runs every layer without guards: a layer of another shape or dtype would
    # run a graph made for the others. Such a model decodes eagerly and the reason is given.
    from engine.fast import fused

    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")  # a fresh fast path
    fast = fused.for_model(loaded.model, compiled=True)
    fast.layers[1].wo = fast.layers[1].wo.to(torch.bfloat16)  # one layer read at another width
    assert "layers differ" in compiled.supports(fast)
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=4), compile=True)
    assert session.compiled is None and len(_greedy(session)) == 4


def test_the_kernels_build_in_the_background_at_a_low_priority(monkeypatch):
    # On a fresh machine the kernels' C++ compiler ran at the app's priority beside an answer
    # asked at once: 6-7 tok/s. Built at nice 10 (a thread's own on Linux, inherited by the
    # compiler it starts), the answer had 18 tok/s; the app's own threads keep their priority.
    import os

    seen = []
    built = threading.Event()

    def load(name):
        seen.append((name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        built.set()

    monkeypatch.setattr(compiled.kernels, "load", load)
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    compiled._build_in_background("step")
    assert built.wait(30)
    assert seen == [("step", compiled.BUILD_NICENESS)] and ours < compiled.BUILD_NICENESS < 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == ours


@pytest.mark.parametrize(
    "precision, cache",
    [("fp32", "fp32"), ("fp32", "int8"), ("w8", "fp32"), ("w4", "fp32"), ("bf16", "bf16")],
)
def test_every_llmchat_source_a_saved_step_runs_is_in_its_key(tiny_model_dir, precision, cache):
    # A saved step runs without guards: a change to code it traced must name a new file, or the
    # next start would load the old code. The int8 cache's quantize (engine/kvcache.py) was
    # traced into the step but missing from the key.
    from engine.fast import fused

    fast = fused.for_model(models.load(str(tiny_model_dir), precision, "cpu").model, compiled=True)
    dtype = getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}[cache])
    ran = set()

    def seen(frame, event, arg):
        if event == "call":
            ran.add(Path(frame.f_code.co_filename).resolve())

    buffers = steps.scratch_buffers(fast, dtype)
    sys.setprofile(seen)
    try:
        with torch.inference_mode():
            steps.whole_step(fast, torch.tensor([3]), torch.tensor([0]), steps.no_offsets(fast), *buffers)
    finally:
        sys.setprofile(None)
    here = ROOT / "engine" / "fast"
    keyed = {(here / name).resolve() for name in steps._CODE}
    ours = {path for path in ran if ROOT / "engine" in path.parents}
    assert ours and ours <= keyed, sorted(str(p.relative_to(ROOT)) for p in ours - keyed)


def test_a_draft_model_drafts_with_its_own_compiled_step(tiny_model_dir, monkeypatch):
    """A draft at w8 (the CPU's cheap copy, `--speculative MODEL`) takes its one-token steps with a
    compiled step of its own once built: the drafts of its eager steps, the plain answer."""
    from engine.sampling import Sampler
    from engine.speculative.drafters import DraftModel
    from engine.speculative.loop import Speculation

    target = models.load(str(tiny_model_dir), "fp32", "cpu")
    vocab, tokenizer = target.info.vocab_size, target.tokenizer
    drafter = DraftModel(models.load(str(tiny_model_dir), "w8", "cpu"), vocab, tokenizer, compile=True)
    drafter.wait_compiled(600)
    assert drafter.compiled.ready.is_set(), drafter.compiled.describe()
    stepped = []
    step = drafter.compiled.step
    monkeypatch.setattr(drafter.compiled, "step", lambda *args: stepped.append(1) or step(*args))
    eager = DraftModel(models.load(str(tiny_model_dir), "w8", "cpu"), vocab, tokenizer)
    sampler = Sampler(SamplingSettings(temperature=0.0), 5)
    context = list(range(10, 40))
    assert drafter.propose(context, 4, sampler).ids == eager.propose(context, 4, sampler).ids
    assert len(stepped) == 3  # the first draft comes from the prompt's forward, the others a step each
    settings = SamplingSettings(temperature=0.0, max_new_tokens=24)
    plain, spec = ChatSession(target, settings, compile=False), ChatSession(target, settings, compile=False)
    spec.speculation = Speculation(drafter, k=4)
    assert _greedy(spec) == _greedy(plain) and spec.speculation.stats.rounds > 0


def test_a_compiled_verify_gives_every_row_the_eager_logits(tmp_path):
    """A speculative verify of a few tokens runs a compiled step of its own once asked for and
    built: every row's logits are the eager fast path's, for any number of rows (compiled once, as
    dynamic), past a growth of the cache's buffers, over global layers and Gemma 3's sliding-window
    ones (6 positions here) whose buffers dropped the oldest; the K/V it wrote serve the next step."""
    from tests.tiny import build_tiny_model

    # Gemma 3's layers: global ones and sliding windows (a Llama's verify: the speculative test below)
    loaded = models.load(str(build_tiny_model(tmp_path, family="gemma3_text")), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0)
    build = ChatSession(loaded, settings, compile=True).compiled
    assert build.wait_settled(600) and build.kind == "whole", build.describe()
    assert not build.verify_ready.is_set()  # nothing is built where no one speculates
    build.want_verify()
    assert build.wait_verify(600) and build.verify_ready.is_set(), build.verify_error
    assert "a verify of 2-16 tokens too" in build.describe()
    verified = []
    verify = build.verify
    build.verify = lambda *args: verified.append(len(args[1])) or verify(*args)
    ids = [(7 * i) % 300 + 20 for i in range(280)]
    with torch.inference_mode():
        for context, rows in ((40, 2), (41, 5), (60, 16), (252, 9)):  # 252 + 9 rows: the buffers grow
            logits = []
            for compile in (True, False):
                session = ChatSession(loaded, settings, compile=compile)
                session.forward(ids[:context])
                every = session.forward(ids[context : context + rows], every=True)
                session.cache.crop(context + 1)  # a verify that kept one draft
                logits.append((every, session.forward([5])))
            (compiled_rows, compiled_next), (eager_rows, eager_next) = logits
            assert compiled_rows.shape == (rows, loaded.info.vocab_size)
            difference = (compiled_rows - eager_rows).abs().max()
            assert torch.allclose(compiled_rows, eager_rows, atol=1e-4), difference
            assert torch.allclose(compiled_next, eager_next, atol=1e-4)
    assert verified == [2, 5, 16, 9]


def test_a_speculative_answer_verifies_on_the_compiled_step_once_built(tiny_model_dir):
    """The first speculative answer asks for the verify step (its verifies run eager meanwhile);
    later answers verify on it, say so in their step path, and keep the plain answer."""
    from engine.speculative.drafters import PromptLookup
    from engine.speculative.loop import Speculation

    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=48)
    prompt = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."
    plain = _greedy(ChatSession(loaded, settings, compile=False), prompt)

    told = []

    def speculative() -> tuple[list[int], ChatSession]:
        session = ChatSession(loaded, settings, compile=True)
        session.speculation = Speculation(PromptLookup(), k=4)
        assert session.compiled.wait_settled(600), session.compiled.describe()
        session.compiled.when_verify_built(told.append)  # as the app's worker listens, to say so
        return _greedy(session, prompt), session

    first, session = speculative()
    build = session.compiled
    assert build.wait_verify(600) and build.verify_ready.is_set(), build.verify_error
    assert told == [build] and "verify (2-16 tokens) now runs compiled too" in build.describe_verify()
    verified = []
    verify = build.verify
    build.verify = lambda *args: verified.append(len(args[1])) or verify(*args)
    second, session = speculative()
    assert first == second == plain and len(set(plain)) > 3
    assert verified and session.speculation.stats.drafted > 0
    assert session.decoded_by == ("lookup, K 4", "compiled")


def test_a_compiled_step_that_fails_says_what_it_was_fed_and_the_eager_path_finishes_the_answer(
    tiny_model_dir,
):
    """A step that raised while decoding stopped the answer, and so would every answer after it;
    and Inductor's own words name no input ("index out of bounds: 0 <= tmp7 < 399", seen once in a
    test of a Qwen2 model, never reproduced). Now the eager path takes that token and the rest,
    the build says why it serves no more, and its error says what the step was fed."""
    loaded = models.load(str(tiny_model_dir), "fp32", "cpu")
    settings = SamplingSettings(temperature=0.0, max_new_tokens=12)
    session = ChatSession(loaded, settings, compile=True)
    build = session.compiled
    assert build.wait_settled(600) and build.kind == "whole", build.describe()
    first = _greedy(session)
    vocabulary, position = len(session.fast.embed), len(session.cache)
    with pytest.raises(RuntimeError) as failed:  # the real step, fed an id past the vocabulary
        build.step(session.fast, vocabulary, session.cache)
    assert str(failed.value).startswith(f"fed [{vocabulary}] at position {position} of ")
    assert f"vocabulary {vocabulary}: " in str(failed.value) and len(session.cache) == position

    real, calls, heard = build._step, [], []

    def failing_at_the_fifth(*args):  # a fault that no input here provokes in the real step
        calls.append(args[1])
        if len(calls) == 5:
            raise RuntimeError(f"index out of bounds: 0 <= tmp7 < {vocabulary}")
        return real(*args)

    build._step = failing_at_the_fifth
    build.when_failed(heard.append)
    events = list(session.send("And then?"))
    eager = ChatSession(loaded, settings, compile=False)
    assert _greedy(eager) == first
    second = _greedy(eager, "And then?")
    assert [e.id for e in events if isinstance(e, TokenSampled)] == second and len(second) > 6
    assert len(calls) == 5 and heard == [build] and build.state == "failed"
    said = "the eager fast path decodes (no compiled step: the step failed while decoding, fed ["
    assert not session.compiled_step_ready() and session.decode_path().startswith(said)
    assert build.describe().startswith("compiled decode unavailable (the step failed while decoding, fed [")
    assert next(e for e in events if isinstance(e, TurnFinished)).stats.step_path == "fused"
    assert _greedy(session, "More?") and len(calls) == 5  # the next answer never calls it
