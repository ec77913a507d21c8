"""llmchat's inference engine: models, sampling, the KV cache and the chat session.

Nothing in this package imports Textual or Rich, so the headless CLI and the tests can
drive it directly.
"""
