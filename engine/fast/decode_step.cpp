// The kernels a decode step calls (and an eager forward's norms, rms_norm.cpp), built as one
// library from one translation unit: torch's headers are most of a build (parsing them: ~4.6 s
// of 6.4 s on a 2-core Xeon), and a first start builds this beside the step's own compile, so
// they are parsed once for both.
#include "decode_attention.cpp"
#include "matvec.cpp"
#include "rms_norm.cpp"
