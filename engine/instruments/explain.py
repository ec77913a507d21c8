"""The paragraph a student opens in place for each instrument: what it shows, and the formula."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Explanation:
    title: str
    text: str
    formula: str


EXPLANATIONS: dict[str, Explanation] = {
    "inspector": Explanation(
        "Token inspector",
        "Every step of an answer is one prediction: the model turned the whole context into a "
        "probability for each of the vocabulary's tokens, and one was drawn. For the selected "
        "step you see the token's ID, its piece and raw bytes (a piece can hold half a UTF-8 "
        "character), its log-probability and rank, the K/V cache slot it was written to, the "
        "top-k alternatives, and the entropy of the distribution: near 0 the model was sure, "
        "large values mean many tokens were plausible. exp(entropy) is how many equally likely "
        "choices that uncertainty is worth.",
        "logprob = ln p(token);  entropy H = −Σ p ln p (nats; bits = H / ln 2);  "
        "rank = 1 + #{v : p(v) > p(token)}",
    ),
    "fork": Explanation(
        "Fork from an alternative",
        "Pick another token at any step and the answer continues from there. The K/V cache "
        "already holds the prompt and every token before that step, so it is cut back to that "
        "position and only the new token and what follows are computed: the counts show how many "
        "positions were reused and how many were fed. The original answer is kept as a branch. "
        "One different token early on can send the whole answer somewhere else, because every "
        "later prediction is conditioned on it.",
        "reused = len(prompt) + step;  fed = 1 (the chosen token), then one per new token",
    ),
    "step": Explanation(
        "Step mode",
        "Decoding pauses before each token is fed back. You see what the sampler drew, what "
        "greedy decoding (temperature 0) would take, and the top-k alternatives with their "
        "probabilities; the token you pick is appended to the context and the model predicts the "
        "next one from it. This is the whole generation loop, one turn of the crank at a time. "
        "Resume to run at full speed again.",
        "x_{t+1} ~ softmax(f(x_≤t) / T) after the filters;  greedy: x_{t+1} = argmax f(x_≤t)",
    ),
    "stages": Explanation(
        "Sampler stages",
        "The model gives one score (logit) per token; the sampler reshapes that distribution in "
        "stages before drawing. Repetition penalty lowers tokens already in the context; "
        "temperature sharpens (<1) or flattens (>1) it; top-k keeps the k most probable; top-p "
        "keeps the smallest set whose probability reaches p; min-p drops tokens less probable "
        "than min-p times the best one. Each row shows what a stage removed and the "
        "renormalized probabilities that remain.",
        "penalty: z/θ if z>0 else z·θ;  p = softmax(z/T);  top-p: keep while Σ(before) < p;  "
        "min-p: keep p ≥ min_p·max p",
    ),
    "tokenizer": Explanation(
        "Tokenizer view",
        "The model never sees characters, only token IDs. Byte Pair Encoding merged frequent "
        "byte pairs into a vocabulary of pieces, so common English words are one token while "
        "text the tokenizer saw rarely splits into many, sometimes mid-character: in SmolLM2 "
        "'How does inference work?' is 5 tokens and the same question in Korean is 32. The chat "
        "template wraps each message in special tokens. The marker shows which tokens came from "
        "the K/V cache and which this turn had to prefill.",
        "cost = tokens;  characters per token = len(text) / tokens;  prefilled = prompt tokens − reused",
    ),
    "phases": Explanation(
        "Two phases, measured",
        "Every weight is used twice per token (a multiply and an add), so a forward pass costs "
        "about 2 FLOPs per parameter per token, plus attention over the context. Prefill pushes "
        "all prompt tokens through at once, reading each weight once for many tokens: high "
        "arithmetic intensity, limited by compute. A decode step does the same reading for a "
        "single token: about 0.5 FLOP per byte at fp32, far below the machine's balance point, "
        "so it waits on memory. The bars compare the achieved rates with this machine's measured "
        "peaks.",
        "FLOPs ≈ 2·P·n + 4·layers·heads·d·pairs;  bytes ≈ W + kv·context;  intensity = FLOPs/bytes;  "
        "memory-bound if intensity < peak FLOP/s ÷ bandwidth",
    ),
    "attention": Explanation(
        "Attention view",
        "In each layer, every head turns the newest token into a query and scores it against the "
        "key of every position in the context; softmax turns the scores into weights that sum to "
        "1, and the output mixes the positions' values by those weights. The view shows those "
        "weights for one layer and head (or their mean), summed per message. It needs eager "
        "attention, which builds the full weight matrix, so decoding is slower while it is open.",
        "weights = softmax(q·Kᵀ / √d);  output = weights · V;  Σ weights = 1",
    ),
    "precision": Explanation(
        "Precision compare",
        "The same turn runs at two precisions. The first answers; the second is fed the first's "
        "tokens (teacher forcing), so at every position both predict from the same context. "
        "Top-1 agreement counts where the second would have picked the same token, the KL "
        "divergence measures how far its whole distribution moved, and the first divergent token "
        "is where a free-running answer would part ways. Fewer bits per weight means less memory "
        "to read per token; the cost is this drift.",
        "KL(P‖Q) = Σ_v P(v)·(ln P(v) − ln Q(v));  agreement = #{t : argmax Q_t = x_t} / steps",
    ),
    "lab": Explanation(
        "Serving lab",
        "A server answers many users at once. Here simulated users send real questions to the "
        "loaded model, and the same workload is served three ways: one request at a time; static "
        "batches (wait for B requests, run them until all finish); and continuous batching (admit a "
        "request whenever KV blocks are free, let finished ones leave at once, prefill new prompts "
        "in chunks beside the others' decode tokens, preempt the newest request when the pool runs "
        "out and recompute it later). Every number is measured on this machine; the clock is the "
        "sum of the measured step times. A teaching instrument at classroom scale, not a serving "
        "path: for real serving, point llmchat at a server (--server). Esc stops the lab and frees "
        "its pool; the chat's own KV cache is never touched.",
        "throughput = tokens generated / time until the last request is done",
    ),
    "lab.timeline": Explanation(
        "Per request",
        "One row per user: where its time went on the lab's clock. Queued (waiting for room), "
        "prefill (its prompt fed, in chunks), decode (one token per step), preempted (its blocks "
        "taken back; it will recompute), done. TTFT is arrival to first token; ITL the gap between "
        "its tokens, which grows when more sequences share a step.",
        "TTFT = t(first token) − t(arrival);  ITL = t(token i+1) − t(token i)",
    ),
    "lab.pool": Explanation(
        "The paged KV pool",
        "The K/V cache lives in one pool of fixed-size blocks. Each request holds a block table "
        "(its blocks, in order) and gets a new block only when its tokens fill the last one, so "
        "memory follows the tokens actually held. A contiguous cache must reserve room for the "
        "longest possible request up front for each one; the difference is the waste. The bytes "
        "are counted from the pool's tensors, and the formula is shown beside them.",
        "bytes per block = 2 × layers × kv_heads × head_dim × element bytes × block size",
    ),
    "lab.steps": Explanation(
        "Per step",
        "Each step is one forward pass over every scheduled token: B decode tokens and any prefill "
        "chunks, multiplied through the weights together. The weights are read once per step "
        "however many sequences share it, so the arithmetic intensity (FLOPs per byte moved) grows "
        "with B. Below the machine's balance point (peak FLOP/s ÷ bandwidth, measured by the phases "
        "instrument, F6) a step waits on memory and extra sequences are nearly free; above it, on "
        "arithmetic.",
        "intensity = (2·P·T + 2·h·vocab·B + attention) / (W + Σ kv·(context + 2n))",
    ),
    "lab.policies": Explanation(
        "Three policies, same workload",
        "The same users, questions and arrival times, served by each policy in turn. Sequential "
        "never shares a step, so its throughput is the batch-1 rate. Static batching shares steps "
        "but makes early finishers' seats idle and late arrivals wait for the next batch. "
        "Continuous batching fills seats as they free up, so throughput rises and the p90 TTFT "
        "falls. Peak blocks is the most of the pool any moment held.",
        "p90 = the value 90% of requests stay under",
    ),
    "lab.sweep": Explanation(
        "The decode sweep",
        "B sequences decode together for a few steps, for B = 1, 2, 4, 8, 16 (as many as the pool "
        "holds). While a step is memory-bound, B tokens cost about what one does: the aggregate "
        "rate grows almost B-fold and each user's ITL barely moves. Where the curve bends away "
        "from the ○ line (B × the B=1 rate) the step has turned compute-bound.",
        "aggregate tok/s = B / step time;  per-user ITL = step time",
    ),
}
"""Keyed by instrument: inspector, fork, step, stages, tokenizer, phases, attention, precision, lab
(and lab.* for each view of the serving lab)."""


def explain(instrument: str) -> Explanation:
    try:
        return EXPLANATIONS[instrument]
    except KeyError:
        raise ValueError(
            f"no explanation for {instrument!r}; choose one of {', '.join(EXPLANATIONS)}"
        ) from None
