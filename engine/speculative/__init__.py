"""Speculative decoding: a cheap drafter proposes K tokens, the model checks them in one forward.

drafters.py proposes (prompt lookup, a draft model); verify.py accepts or rejects so that the
answer keeps the model's own distribution; loop.py is the decode loop that uses them.
"""
