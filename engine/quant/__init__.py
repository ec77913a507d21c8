"""Precisions (`precision`: fp32, bf16, fp16, bitsandbytes int8/nf4, w8a8, w8, w4) and the
formats of our own: `int8` (w8a8, int8 weights and activations on fbgemm), `w8` (int8 weights,
fp32 activations) and `w4` (llama.cpp's Q4_0 4-bit blocks, fp32 activations)."""
