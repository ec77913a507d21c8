"""Decode speed: the fused Llama forward (`fused`), the compiled decode step (`compiled`), the C++
kernels built in the background (`kernels`: decode attention, `attention` + `decode_attention.cpp`;
the sampler's summary, `sample_summary.cpp`) and handing weight pages back to the OS (`pages`).
The HF forward stays the reference every fast path is tested against."""
