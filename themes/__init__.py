"""Textual CSS themes shipped with llmchat (data files only)."""
