"""Saved conversations: the SQLite store (`store`), a chat session that saves every finished
message as it goes (`chat`), and the KV cache as one self-describing file (`cache_file`)."""
