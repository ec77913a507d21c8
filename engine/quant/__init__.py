"""Precisions (`precision`: fp32, bf16, fp16, bitsandbytes int8/nf4, w8a8, w8) and the two int8
formats of our own: `int8` (w8a8, int8 weights and activations on fbgemm) and `w8` (int8 weights,
fp32 activations)."""
