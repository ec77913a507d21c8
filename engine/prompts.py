"""The texts the benchmarks feed the model: a long prompt's filler prose, and short questions
(what is fed does not change a step's time, only what is asked of the cache)."""

FILLER = (
    "The history of computing is a story of abstraction layered on abstraction, from switches and "
    "vacuum tubes to transistors, integrated circuits, operating systems, compilers and networks. "
)
QUESTIONS = (
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "Why is the sky blue? Answer briefly.",
    "What is two plus two?",
)
