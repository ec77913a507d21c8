"""Teaching instruments: each reads real values from the running model, one job per module.

| module | instrument |
|---|---|
| `trace.py` | token inspector: the per-answer history of steps, and the forced step a fork starts from |
| `stepping.py` | step mode: the gate the decode loop waits at while a student picks each token |
| `stages.py` | sampler stages: the distribution after each filter of the chain |
| `tokview.py` | tokenizer view: pieces, IDs, characters per token, template, cached/new boundary, \
message spans |
| `phases.py` | the two phases measured: FLOPs and bytes per phase, achieved rates, machine calibration |
| `attention.py` | attention view: one layer's (or the mean) attention row over the context, by message |
| `precision_compare.py` | precision compare: the same turn at two precisions, teacher-forced |
| `explain.py` | the paragraph a student opens in place for each instrument |
| `view.py` | `SessionView`: what the UI thread may read of the running session |

Whatever runs the model lives here too (the attention probe of a session, the second
precision's load), so the app only hands these functions to the engine's `call`.

`ChatSession.fork` and the step-mode hook in `ChatSession._decode` live in `engine/session.py`.
"""
