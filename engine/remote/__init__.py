"""A model served elsewhere: vLLM, SGLang, llama.cpp's llama-server, Ollama or any
OpenAI-compatible server, reached over HTTP as a second kind of chat session.

| module | job |
|---|---|
| `target.py` | where the server is and how to reach it (URL, model, key variable, timeouts) |
| `client.py` | the chat stream (`openai`) and side endpoints (`httpx`), errors as one line |
| `server.py` | which server it is, its version, parallelism, the model and its context |
| `dialects.py` | per server: extra request fields, what it reports, what it does not |
| `request.py` | one chat request from the conversation and the sampling settings |
| `chunks.py` | one streamed chunk read into plain records |
| `turn.py` | an answer as it streams: events, latencies, the server's own figures |
| `prompt.py` | the prompt's token ids, asked of the server's own tokenizer |
| `metrics.py` | the server-wide KV cache fill from /metrics (llama.cpp: summed from /slots) |
| `tokenizer.py` | the tokenizer view (F5) from the server's own /tokenize and /detokenize |
| `shape.py` | the model's KV shape from a GGUF readable here (for bytes per token) |
| `cancel.py` | Esc: an Event that also cuts the HTTP calls in flight (the prompt's tokenizing, the stream) |
| `session.py` | `RemoteSession`: the same calls and events as `ChatSession` |
"""
