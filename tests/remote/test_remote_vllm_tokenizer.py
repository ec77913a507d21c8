"""The tokenizer view's vLLM path, against a fake that answers in vLLM's documented shapes
(vllm/entrypoints/serve/tokenize/protocol.py: TokenizeCompletionRequest, TokenizeChatRequest,
DetokenizeRequest; TokenizeResponse {count, max_model_len, tokens, token_strs}; DetokenizeResponse
{prompt}). No vLLM runs here; the real path is proven on llama.cpp in test_remote_tokenizer.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.remote import dialects
from engine.remote.client import RemoteClient, RemoteError
from engine.remote.target import RemoteTarget
from engine.remote.token_bytes import SeenTokens
from engine.remote.tokenizer import ServerTokenizer, _vllm_pieces

FIELDS = {
    "prompt": {"model", "prompt", "add_special_tokens", "return_token_strs"},
    "messages": {"model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message"},
    "detokenize": {"model", "tokens"},
}
"""The request fields vLLM's protocol defines (a few more exist; we send no others)."""
ENGLISH = {"tokens": [2020, 1072, 23630, 746, 47], "token_strs": ["How", "Ġdoes", "Ġinference", "Ġwork", "?"]}
KOREAN_START = {"tokens": [183, 131, 238], "token_strs": ["ì", "¶", "Ķ"]}  # 추 as three byte tokens


@pytest.fixture
def vllm():
    sent = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sent.append((self.path, body))
            if self.path == "/detokenize":
                assert set(body) <= FIELDS["detokenize"]
                answer = {
                    "prompt": "How does inference work?" if body["tokens"] == ENGLISH["tokens"] else "?"
                }
            elif self.path == "/tokenize":
                kind = "messages" if "messages" in body else "prompt"
                assert set(body) <= FIELDS[kind]
                found = KOREAN_START if body.get("prompt") == "추" else ENGLISH
                answer = {"count": len(found["tokens"]), "max_model_len": 8192, "tokens": found["tokens"]}
                if body.get("return_token_strs"):
                    answer["token_strs"] = found["token_strs"]
            else:
                self.send_response(404)
                self.end_headers()
                return
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = RemoteClient(RemoteTarget(f"http://127.0.0.1:{server.server_address[1]}/v1"))
    yield ServerTokenizer(client, dialects.VLLM, "HuggingFaceTB/SmolLM2-135M-Instruct", SeenTokens()), sent
    client.close()
    server.shutdown()
    server.server_close()


def test_vllm_text_cost_and_detokenize(vllm):
    tokenizer, sent = vllm
    cost = tokenizer.text_cost("How does inference work?")
    assert [(p.id, p.bytes) for p in cost.pieces] == [
        (2020, b"How"),
        (1072, b" does"),
        (23630, b" inference"),
        (746, b" work"),
        (47, b"?"),
    ]
    path, body = sent[-1]
    assert path == "/tokenize" and body["add_special_tokens"] is False and body["return_token_strs"] is True
    assert body["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert [p.bytes for p in tokenizer.text_cost("추").pieces] == [b"\xec", b"\xb6", b"\x94"]  # byte-level
    assert tokenizer.detokenize(ENGLISH["tokens"]) == "How does inference work?"


def test_vllm_template_ids_send_the_messages_without_a_generation_prompt(vllm):
    tokenizer, sent = vllm
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.template_ids(chat) == ENGLISH["tokens"]
    path, body = sent[-1]
    assert path == "/tokenize" and body["messages"] == chat and body["add_generation_prompt"] is False


def test_a_tokenize_answer_without_token_strings_is_one_clear_error():
    with pytest.raises(RemoteError, match="no token strings"):
        _vllm_pieces({"count": 1, "max_model_len": 8192, "tokens": [1]})  # return_token_strs ignored
