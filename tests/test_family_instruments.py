"""Every instrument on every family: the engine side of F2 … F9 and the lessons, run on a tiny Qwen2
(q/k/v biases), Qwen3 (per-head q/k RMSNorm), Gemma 3 (sliding-window layers with their own RoPE
base, sandwich norms, scaled embeddings) and Phi-3 (fused q/k/v and gate/up, a sliding window on
every layer) after a short real answer, each checked against what the live model computes (its
parameters, its own forward, its cache's tensors)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from engine import models
from engine.events import PromptTokens, StepPaused, TokenSampled, TurnFinished
from engine.instruments import embeddings, kv_budget
from engine.instruments.attention import enable_and_view, kv_head_of, switch_off
from engine.instruments.attention_matrix import prefill_matrix
from engine.instruments.context_sweep import ContextSweep
from engine.instruments.context_sweep import shape_of as sweep_shape
from engine.instruments.phases import ModelShape, turn_phases
from engine.instruments.precision_compare import compare_turn_at, compare_turn_kv_cache
from engine.instruments.stages import pending_stages, stages_at
from engine.instruments.tokview import message_spans, text_cost, tokenizer_view
from engine.instruments.verify_cost import verify_cost
from engine.lab import costs
from engine.lab.batched import Feed
from engine.lab.run import Lab, LabConfig, LabError, run
from engine.sampling import SamplingSettings
from engine.session import ChatSession
from tests.tiny import build_tiny_model

FAMILIES = ["qwen2", "qwen3", "gemma3_text", "phi3"]
WINDOWED = ("gemma3_text", "phi3")
"""Their tiny configs (tests/tiny.py) give layers a sliding window shorter than a turn."""
QUESTION = "How does inference work?"
GREEDY = SamplingSettings(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model type, the tiny model of that family loaded at fp32)."""
    directory = build_tiny_model(tmp_path_factory.mktemp(request.param), family=request.param)
    return request.param, models.load(str(directory), "fp32", "cpu")


@pytest.fixture
def loaded(family):
    return family[1]


def answered(loaded, settings: SamplingSettings = GREEDY) -> tuple[ChatSession, list]:
    session = ChatSession(loaded, settings, system_prompt="Be brief.")
    events = list(session.send(QUESTION))
    assert len(session.trace) >= 4 and session.fast is not None  # a real answer, on the fast path
    return session, events


def hf_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """transformers' own forward: log-probabilities of the token after `ids`."""
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


# -- F2: token inspector and fork ------------------------------------------------------------------
def test_the_inspectors_numbers_are_the_models_distribution(loaded):
    session, _ = answered(loaded)
    trace = session.trace
    for step in (0, len(trace) - 1):
        record = trace.record(step, session.namer)
        logprobs = hf_logprobs(loaded, [*trace.prompt_ids, *trace.ids[:step]])
        probs = logprobs.exp()
        assert record.id == int(probs.argmax()) and record.rank == 1
        assert record.prob == pytest.approx(float(probs[record.id]), abs=1e-4)
        assert record.entropy == pytest.approx(float(-(probs * logprobs).sum()), abs=1e-3)
        assert [c.id for c in record.top_k[:3]] == torch.topk(probs, 3).indices.tolist()


def test_a_fork_continues_as_the_model_would_from_the_forced_token(loaded):
    session, _ = answered(loaded)
    step = 2
    token = next(c.id for c in session.trace.steps[step].top_k[1:] if c.id not in session.stop_ids)
    prefix = [*session.trace.prompt_ids, *session.trace.ids[:step], token]
    list(session.fork(step, token))
    tail = session.trace.ids[step + 1 :]
    reference = loaded.model.generate(torch.tensor([prefix]), max_new_tokens=len(tail), do_sample=False)
    assert session.trace.ids[step] == token
    assert tail == reference[0, len(prefix) :].tolist()[: len(tail)]


# -- F3: step mode -------------------------------------------------------------------------------
def test_step_mode_offers_the_models_top_k_and_takes_the_choice(loaded):
    session = ChatSession(loaded, SamplingSettings(temperature=0.0, max_new_tokens=5))
    session.step_gate.pause()
    taken = []
    for event in session.send(QUESTION):
        if isinstance(event, StepPaused):
            assert event.greedy.id == event.top_k[0].id
            assert sum(c.prob for c in event.top_k) <= 1.0 + 1e-5
            pick = event.top_k[1].id if event.index == 1 else None
            taken.append(session.step_gate.take(pick).id)
    assert session.trace.ids == taken and len(taken) == 5
    assert session.trace.steps[1].rank == 2


# -- F4: sampler stages --------------------------------------------------------------------------
def test_the_stages_end_in_the_distribution_the_answer_showed(loaded):
    session, _ = answered(loaded)
    for step in (0, len(session.trace) - 1):
        final = stages_at(session, step).final
        shown = session.trace.steps[step].top_k
        assert [c.id for c in final.top[: len(shown)]] == [c.id for c in shown]
        assert [c.prob for c in final.top[: len(shown)]] == pytest.approx([c.prob for c in shown], abs=1e-4)
    settings = SamplingSettings(temperature=0.8, top_k=5, seed=1, max_new_tokens=2)
    session = ChatSession(loaded, settings)
    session.step_gate.pause()
    for event in session.send(QUESTION):
        if isinstance(event, StepPaused):
            stages = pending_stages(session)
            assert stages.final.kept == 5 and [c.id for c in stages.final.top] == [c.id for c in event.top_k]
            session.step_gate.take()


# -- F5: tokenizer view --------------------------------------------------------------------------
def test_the_tokenizer_view_cuts_the_turn_by_message(loaded):
    session, first = answered(loaded)
    events = list(session.send("And then?"))
    prompt = next(e for e in events if isinstance(e, PromptTokens))
    answer = [e.id for e in events if isinstance(e, TokenSampled)]
    view = tokenizer_view(session, prompt.ids, prompt.reused, answer)
    assert 0 < view.reused < view.prompt_tokens and view.generated == len(answer)
    spans = message_spans(session, [*prompt.ids, *answer])
    # A random model's answer may hold broken UTF-8 that its saved text re-tokenizes otherwise:
    # its span can end early and the rest stays "assistant" (the answer being written).
    assert [s.role for s in spans[:4]] == ["system", "user", "assistant", "user"]
    assert {s.role for s in spans[4:]} == {"assistant"} and spans[-1].end == len(prompt.ids) + len(answer)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert view.span_cost(spans[3]).text == "user\nAnd then?\n"
    cost = text_cost(session.tokenizer, QUESTION, session.namer)
    assert cost.tokens == len(session.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])


# -- F6: phases, verify cost, the context sweep --------------------------------------------------
def layer_extras(loaded) -> tuple[int, int]:
    """The family's own weights beside the matrices, per layer: biases and norm weights."""
    block = loaded.model.model.layers[0]
    biases = sum(p.numel() for n, p in block.named_parameters() if n.endswith("bias"))
    norms = sum(p.numel() for n, p in block.named_parameters() if "norm" in n)
    return biases, norms


def test_the_counted_parameters_are_the_models(family):
    model_type, loaded = family
    shape = ModelShape.of(loaded)
    biases, norms = layer_extras(loaded)
    h, d, heads, kv_heads = shape.hidden, shape.head_dim, shape.heads, shape.kv_heads
    expected = {
        "qwen2": ((heads + 2 * kv_heads) * d, 2 * h),
        "qwen3": (0, 2 * h + 2 * d),
        "gemma3_text": (0, 4 * h + 2 * d),  # norms of the attention's and MLP's outputs too
        "phi3": (0, 2 * h),
    }
    assert (biases, norms) == expected[model_type]
    assert (shape.layer_biases, shape.layer_norms) == (biases, norms)
    assert shape.parameters == sum(p.numel() for p in loaded.model.parameters()) == loaded.info.parameters
    table = loaded.model.get_input_embeddings().weight
    every = sum(t.numel() * t.element_size() for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    assert shape.streamed_weight_bytes == every - table.numel() * table.element_size()


@pytest.mark.parametrize("precision", ["bf16", "w8"])
def test_the_count_holds_at_other_precisions(family, precision):
    model_type, fp32 = family
    loaded = models.load(fp32.info.spec, precision, "cpu")
    ChatSession(loaded)  # the fast path re-homes the weights
    assert ModelShape.of(loaded).parameters == loaded.info.parameters == fp32.info.parameters


def test_the_phases_of_a_turn_are_counted_from_its_stats(loaded):
    session, events = answered(loaded)
    stats = next(e for e in events if isinstance(e, TurnFinished)).stats
    shape = ModelShape.of(loaded)
    phases = turn_phases(shape, stats)
    assert phases.prefill.tokens == stats.prefilled_tokens > 0 and phases.decode.seconds > 0
    assert phases.prefill.flops == shape.prefill_flops(stats.prefilled_tokens, stats.reused_tokens)
    assert shape.kv_bytes_per_token * len(session.cache) == session.cache.tensor_bytes()
    cost = verify_cost(shape, 4, len(session.cache))
    assert cost.flops_ratio > 4 and 1 < cost.bytes_ratio < 1.5


def test_the_context_sweep_fills_its_own_cache_by_the_formula(loaded):
    session, _ = answered(loaded)
    ids = list(session.cache.ids)
    points = [ContextSweep(steps=2).measure(session, n) for n in (16, 32)]
    kv = sweep_shape(session).kv_bytes_per_token
    assert kv == loaded.info.kv_bytes_per_token
    assert [p.cache_bytes for p in points] == [16 * kv, 32 * kv]
    assert all(p.ttft_s > 0 and p.itl_s > 0 and p.decode_path == "eager fast path" for p in points)
    assert list(session.cache.ids) == ids
    assert sweep_shape(session).weight_bytes == ModelShape.of(loaded).streamed_weight_bytes


# -- F7: attention -------------------------------------------------------------------------------
def test_attention_rows_sum_to_one_and_the_newest_row_is_the_matrixs_last(loaded):
    session, _ = answered(loaded)
    info = loaded.info
    try:
        for layer, head in ((0, 0), (info.layers - 1, info.heads - 1)):
            newest = enable_and_view(session, layer, head)
            assert sum(newest.weights) == pytest.approx(1.0, abs=1e-5)
            matrix = prefill_matrix(session, layer, head)
            assert matrix.kv_head == kv_head_of(head, info.heads, info.kv_heads)
            assert all(sum(row) == pytest.approx(1.0, abs=1e-5) for row in matrix.rows)
            assert list(matrix.rows[-1]) == pytest.approx(list(newest.weights), abs=1e-5)
    finally:
        switch_off(session)
    assert session.fast is not None and loaded.model.config._attn_implementation == "sdpa"


def test_the_probe_leaves_the_answer_as_it_was(loaded):
    plain, _ = answered(loaded)
    probed = ChatSession(loaded, GREEDY, system_prompt="Be brief.")
    enable_and_view(probed, None, None)  # the HF forward with eager attention from now on
    try:
        list(probed.send(QUESTION))
    finally:
        switch_off(probed)
    assert probed.trace.ids == plain.trace.ids


# -- F8: precision compare and the KV budget -----------------------------------------------------
def test_precision_compare_answers_the_turn_and_measures_the_drift(loaded):
    session, _ = answered(loaded)
    greedy = session.trace.ids
    compared = [compare_turn_at(session, p, 6) for p in ("bf16", "w8")]  # w8 keeps Qwen2's biased q/k/v float
    for result in (*compared, compare_turn_kv_cache(session, "int8", 6)):
        assert [s.token for s in result.steps] == greedy[: len(result.steps)] and len(result.steps) >= 4
        assert 0.0 <= result.agreement <= 1.0 and all(s.kl >= 0 for s in result.steps)
    assert result.other.kv_bytes_per_token < result.reference.kv_bytes_per_token
    shape = kv_budget.shape_of(loaded.info)
    assert shape.bytes_per_token("fp32") == loaded.info.kv_bytes_per_token
    assert session.cache.tensor_bytes() == len(session.cache) * shape.bytes_per_token("fp32")


# -- F9: the serving lab -------------------------------------------------------------------------
def test_a_windowed_model_is_refused_by_the_lab_in_one_line(family):
    model_type, loaded = family
    if model_type not in WINDOWED:
        pytest.skip("its layers attend over the whole context")
    with pytest.raises(LabError) as refused:
        Lab(loaded, LabConfig(budget_mib=1))
    assert "sliding windows" in str(refused.value) and "\n" not in str(refused.value)


def test_the_lab_serves_each_request_the_models_own_answer(family):
    model_type, loaded = family
    if model_type in WINDOWED:
        pytest.skip("the lab's batched forward has no sliding windows (refused: the test above)")
    config = LabConfig(requests=3, max_batch=3, max_new=6, budget_mib=1, arrivals="once", sweep_steps=1)
    result = run(loaded, config)
    assert result.outputs_agree and result.sweep
    spec = result.specs[0]
    served = next(r for r in result.policies[0].requests if r.spec.id == spec.id).out
    reference = loaded.model.generate(torch.tensor([spec.prompt]), max_new_tokens=6, do_sample=False)
    assert list(served) == reference[0, len(spec.prompt) :].tolist()[: len(served)]
    info = loaded.info
    assert result.pool["block_bytes"] == info.kv_bytes_per_token * config.block_size
    assert result.pool["tensor_bytes"] == result.pool["formula_bytes"]


def test_the_labs_step_is_counted_as_f6_counts_a_decode_step(family):
    model_type, loaded = family
    if model_type in WINDOWED:
        pytest.skip("the lab's batched forward has no sliding windows")
    lab = Lab(loaded, LabConfig(budget_mib=1))
    try:
        shape = lab.shape
        feeds = [Feed(0, (5,), 20)]
        assert costs.step_flops(shape, feeds) == shape.decode_flops(20)
        assert costs.step_bytes(shape, feeds, lab.kv.token_bytes()) == shape.decode_bytes(20)
    finally:
        lab.release()


# -- lessons: embeddings -------------------------------------------------------------------------
def model_query_and_key(loaded, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's q [heads, d] and k [kv_heads, d] of the token alone, as the model computes them
    before RoPE (after Qwen3's q/k norms), caught by hooks on its own forward."""
    attn, info, kept = loaded.model.model.layers[0].self_attn, loaded.info, {}
    if hasattr(attn, "qkv_proj"):  # Phi-3: one matrix, q then k then v
        return phi3_query_and_key(loaded, token)
    sources = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else (attn.q_proj, attn.k_proj)
    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: kept.__setitem__(name, out.detach()))
        for name, module in zip("qk", sources)
    ]
    try:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([[token]]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return kept["q"].float().reshape(info.heads, info.head_dim), kept["k"].float().reshape(
        info.kv_heads, info.head_dim
    )


def phi3_query_and_key(loaded, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    attn, info, kept = loaded.model.model.layers[0].self_attn, loaded.info, {}
    hook = attn.qkv_proj.register_forward_hook(lambda m, a, out: kept.__setitem__("qkv", out.detach()))
    try:
        with torch.inference_mode():
            loaded.model(input_ids=torch.tensor([[token]]), use_cache=False)
    finally:
        hook.remove()
    q_size, k_size = info.heads * info.head_dim, info.kv_heads * info.head_dim
    qkv = kept["qkv"].float().reshape(-1)
    return qkv[:q_size].reshape(info.heads, -1), qkv[q_size : q_size + k_size].reshape(info.kv_heads, -1)


def closed_form(x: torch.Tensor, inv_freq: torch.Tensor, distance: int) -> float:
    """Σ_i |x_i|² cos(Δ θ_i) / |x|² per head over pairs (i, i + d/2), mean over heads."""
    half = x.shape[-1] // 2
    energy = x[:, :half] ** 2 + x[:, half:] ** 2
    return float(((energy * torch.cos(distance * inv_freq)).sum(-1) / energy.sum(-1)).mean())


def test_the_embedding_lesson_rotates_the_query_the_model_computes(family):
    model_type, loaded = family
    session, _ = answered(loaded)
    token = embeddings.tokens_of(session, " Paris")[0]
    result = embeddings.token_embedding(session, token)
    table = loaded.model.get_input_embeddings().weight
    assert result.norm == pytest.approx(float(table[token].norm()), rel=1e-5)
    assert token not in [n.id for n in result.neighbours] and len(result.neighbours) == 10
    q, k = model_query_and_key(loaded, token)
    rotary = loaded.model.model.rotary_emb
    # Gemma 3 rotates each kind of layer by its own base: layer 0 is a local (sliding) one.
    inv_freq = getattr(rotary, "sliding_attention_inv_freq", None)
    inv_freq = (rotary.inv_freq if inv_freq is None else inv_freq).float()
    assert result.rope.layer_kind == ("sliding_attention" if model_type == "gemma3_text" else None)
    q_row, _, k_row = result.rope.rows
    for distance, q_cos, k_cos in zip(result.rope.distances, q_row.cosines, k_row.cosines):
        assert q_cos == pytest.approx(closed_form(q, inv_freq, distance), abs=1e-4)
        assert k_cos == pytest.approx(closed_form(k, inv_freq, distance), abs=1e-4)
    assert not math.isnan(result.rope.base)


def test_a_cancelled_sweep_and_an_oversized_one_say_so(loaded):
    session = ChatSession(loaded, GREEDY)
    cancel = threading.Event()
    cancel.set()
    assert ContextSweep().measure(session, 16, cancel) is None
    with pytest.raises(ValueError, match="window"):
        ContextSweep().measure(session, session.context)
