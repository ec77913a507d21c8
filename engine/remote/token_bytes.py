"""Token ids to bytes, as far as a server has shown them: the token inspector's namer for a
model whose tokenizer is on the server. Each streamed token (and each alternative that came
with its bytes) teaches one id; an id never seen has no bytes here."""

from __future__ import annotations

from engine.detok import readable_bytes


class SeenTokens:
    def __init__(self) -> None:
        self._bytes: dict[int, bytes] = {}

    def learn(self, token_id: int | None, data: bytes) -> None:
        if token_id is not None:
            self._bytes[token_id] = data

    def token_bytes(self, token_id: int | None) -> bytes | None:
        """The token's bytes, or None when the server has not shown them."""
        return self._bytes.get(token_id) if token_id is not None else None

    def piece(self, token_id: int | None) -> str:
        data = self.token_bytes(token_id)
        return readable_bytes(data) if data is not None else f"<{token_id}>"

    def pieces(self, ids) -> tuple[str, ...]:
        return tuple(self.piece(i) for i in ids)
