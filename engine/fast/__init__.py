"""Decode speed: the fused Llama forward (`fused`), the compiled decode step (`compiled`), the
decode-attention kernel (`attention` + `decode_attention.cpp`) and handing weight pages back to
the OS (`pages`). The HF forward stays the reference every fast path is tested against."""
