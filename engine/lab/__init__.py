"""The serving lab: continuous batching over a paged KV cache, on the real model, measured.

A teaching instrument at classroom scale, not a serving path (`llmchat --server` talks to a real
server). pool.py holds the K/V blocks, batched.py runs B sequences in one forward pass,
workload.py makes the simulated users, scheduler.py runs the three policies, sweep.py measures
decode at B = 1, 2, 4, ..., and run.py puts one whole run together.
"""
