"""llmchat's inference engine: models, sampling, the KV cache and the chat session.

The loop a student reads lives here at the top: `models` (load), `session` (prefill, then
decode), `sampling`, `kvcache`, `detok`, `events`, and `worker` (the inference thread);
`session_protocol` is what both kinds of session offer. The rest is grouped by concern:

| package | job |
|---|---|
| `fast/` | decode speed: the fused forward, the compiled step, the C++ kernels |
| `quant/` | precisions (one record each) and the int8 formats (w8a8, w8) |
| `saved/` | saved conversations: the store, a chat that saves itself, KV cache files |
| `remote/` | a model on a server, as the second kind of session |
| `speculative/` | speculative decoding: drafters, verification, the decode strategy |
| `lab/` | the serving lab: a paged KV cache, batched forwards, scheduling policies |
| `instruments/` | teaching instruments that read real values from the running model |

Nothing in this package imports Textual or Rich, so the headless CLI and the tests can
drive it directly.
"""

DEFAULT_MODEL = "smollm2-135m"
"""The built-in model's alias. Spelled here, where nothing imports torch, so the app and the
command line name it without loading the engine."""
