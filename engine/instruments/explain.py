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
        "the K/V cache and which this turn had to prefill. With --server the pieces come from the "
        "server's own tokenizer (its /tokenize and /detokenize), the one the model there reads.",
        "cost = tokens;  characters per token = len(text) / tokens;  prefilled = prompt tokens − reused",
    ),
    "phases": Explanation(
        "Two phases, measured",
        "A forward pass costs about 2 FLOPs per parameter per token, plus attention over the "
        "context. Prefill reads each weight once for all prompt tokens, so its roof is compute; a "
        "decode step reads them all for one token (about 0.5 FLOP per byte at fp32), so its roof "
        "is memory. The view says how close each came to its roof (decode figures are per step); "
        "far below both, fixed costs per pass or other programs limit it. The peaks are the median "
        "of 5 runs (c measures again); a turn that got under 70% of the CPU it wanted is flagged "
        "busy. A verify pass over K drafts and the last token reads the weights once, like one "
        "step, and does K+1 tokens' work: speculation uses the idle arithmetic.",
        "FLOPs ≈ 2·P·n + 4·layers·heads·d·pairs;  bytes ≈ W + kv·context;  intensity = FLOPs/bytes;  "
        "roof = min(peak FLOP/s, intensity × bandwidth);  reached = achieved ÷ roof;  verify of K: "
        "FLOPs ≈ (K+1)× a step, bytes ≈ 1× a step",
    ),
    "attention": Explanation(
        "Attention view",
        "In each layer, every head turns the newest token into a query and scores it against the "
        "key of every position in the context; softmax turns the scores into weights that sum to "
        "1, and the output mixes the positions' values by those weights. The view shows those "
        "weights for one layer and head (or their mean), summed per message, and each query head "
        "under the K/V head it shares: with grouped-query attention several query heads read one "
        "cached K and V, yet look at different places because their queries differ. It needs eager "
        "attention, which builds the full weight matrix, so decoding is slower while it is open.",
        "weights = softmax(q·Kᵀ / √d);  output = weights · V;  Σ weights = 1;  "
        "kv head = head ÷ (heads / kv heads)",
    ),
    "attention_matrix": Explanation(
        "Attention over the whole prompt",
        "A prefill computes attention for every prompt position at once: one matrix per layer and "
        "head, a row per query position and a column per key. The causal mask hides every key after "
        "the query (the dotted upper triangle, weight exactly 0), so row q is where position q looks "
        "among positions 0..q, and a row never changes when later tokens arrive: that is why the "
        "K/V cache can keep them. Many heads put a large share of every row on position 0, whatever "
        "token it is: an attention sink, a place to park weight the head does not need elsewhere.",
        "A = softmax(Q·Kᵀ / √d + M),  M[q,k] = −∞ for k > q;  Σ_k A[q,k] = 1;  "
        "sink share = mean over q ≥ 1 of A[q,0] (even spread: mean 1/(q+1))",
    ),
    "kv_heads": Explanation(
        "K/V heads: MHA, GQA, MQA",
        "The cache keeps a key and a value vector per K/V head, per layer, per token. Multi-head "
        "attention (MHA) gives every query head its own K/V head; grouped-query attention (GQA) "
        "lets a group of query heads share one, and multi-query attention (MQA) has them all share "
        "a single head. The cache shrinks by the same factor, and so do the bytes each decode step "
        "reads; the cost is some quality. The KV panel computes what this context would take with "
        "each count; only this model's row is measured from the tensors.",
        "bytes/token = 2 (K,V) × layers × kv heads × head_dim × bytes per element;  group = heads / kv heads",
    ),
    "precision": Explanation(
        "Precision compare",
        "The same turn runs at two precisions. The first answers; the second is fed the first's "
        "tokens (teacher forcing), so at every position both predict from the same context. "
        "Top-1 agreement counts where the second would have picked the same token, the KL "
        "divergence measures how far its whole distribution moved, and the first divergent token "
        "is where a free-running answer would part ways. Fewer bits per weight means less memory "
        "to read per token; the cost is this drift. A KV cache precision compares one model with an "
        "fp32 cache and a rounded one: the cache, not the weights, grows with the context, so its "
        "bytes per token decide how much context fits (the table below: the same formula for a 7B "
        "and a 70B model).",
        "KL(P‖Q) = Σ_v P(v)·(ln P(v) − ln Q(v));  agreement = #{t : argmax Q_t = x_t} / steps",
    ),
    "context": Explanation(
        "Context length is not free",
        "Each size is prefilled from an empty cache of the experiment's own (the chat's cache is "
        "left as it was) and then decoded a few steps, with the chat's own forward. Prefill "
        "multiplies every prompt token through every weight and attends over every pair of "
        "tokens, so TTFT grows with the prompt (linearly, then faster as the pairs add up). A "
        "decode step reads every weight once whatever the context, plus the K and V of every "
        "cached position: ITL grows slowly while the weights dominate the bytes read, and the "
        "cache's share grows with the context until, at c*, it outweighs them. Small models with "
        "few KV heads reach c* late; grouped-query attention (fewer KV heads) pushes it further out.",
        "TTFT(n) ≈ 2·P·n + 4·layers·heads·d·n²/2 FLOPs;  bytes per decode step = W + kv·c,  "
        "kv = 2·layers·kv_heads·head_dim·bytes;  c* = W / kv",
    ),
    "lens": Explanation(
        "Logit lens",
        "Each layer adds its attention and MLP outputs to the residual stream, one vector per "
        "position; after the last layer the final norm and the LM head turn it into a score for "
        "every token. The logit lens applies that same norm and head to the stream after each "
        "earlier layer: what the model would predict if it stopped there. Early layers guess "
        "generic tokens (punctuation, 'the'); the answer rises through the top guesses late, and "
        "entropy falls where the model settles. After the last layer the lens is the model's "
        "own distribution, which is checked.",
        "lens_l = softmax(W_head · norm(h_l)), h_l = the residual after layer l;  H = −Σ p log₂ p bits",
    ),
    "ablation": Explanation(
        "Ablation",
        "To see what one part of the model does for one prediction, turn it off and compare. A "
        "head is silenced by zeroing its slice of the attention output before the output "
        "projection, so it adds nothing to the residual stream; an MLP by zeroing its output. "
        "The same context goes through the model with the part and without it: the top tokens "
        "side by side and the KL divergence between the two distributions say how much it "
        "mattered. Most single heads change little (the model is redundant); a late MLP or an "
        "early layer can change the answer.",
        "KL(p ‖ q) = Σ p log(p / q) nats;  head h off: attn_out[:, h·d:(h+1)·d] = 0 before o_proj",
    ),
    "embeddings": Explanation(
        "Embeddings",
        "A token enters the model as one row of the embedding table: a vector of hidden-size numbers "
        "learned in training. Tokens used alike end up with rows pointing alike, so the nearest "
        "rows by cosine similarity are often the same word in other spellings, or words of the "
        "same kind. Where the table is tied to the LM head, the same row also scores the token as "
        "the next one (its logit is the final hidden state · this row). The vector carries no "
        "position: in each layer the query and key are rotated by an angle proportional to the "
        "position (RoPE), a different speed for each pair of dimensions. Two rotations by p and "
        "p+Δ differ by Δ alone, so the similarity of the same token at two positions, like the "
        "attention score q·k, depends on how far apart they are, not where they are.",
        "cos(a, b) = a·b / (‖a‖‖b‖);  RoPE: pair i turns by p·θ_i, θ_i = base^(−2i/d);  "
        "cos(R_p q, R_{p+Δ} q) = Σ_i ‖q_i‖² cos(Δ·θ_i) / ‖q‖²",
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
        "falls. Peak blocks is the most of the pool any moment held. When users arrive slower than "
        "even sequential serves them, every policy keeps up and serves the offered load: the line "
        "under the table says so, and arrivals 'saturate' sends 4 x max B users at once, with "
        "answers of 1 to 64 tokens, so the engine sets the pace.",
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
"""Keyed by instrument: inspector, fork, step, stages, tokenizer, phases, attention (its matrix mode:
attention_matrix), precision, lab (and lab.* for each view of the serving lab), and the lessons
context and embeddings; kv_heads explains the KV panel's head-count table (Help, F1)."""


def explain(instrument: str) -> Explanation:
    try:
        return EXPLANATIONS[instrument]
    except KeyError:
        raise ValueError(
            f"no explanation for {instrument!r}; choose one of {', '.join(EXPLANATIONS)}"
        ) from None
