// The vectoriser's expf without the finite-math assumption.
//
// The kernels build with -ffast-math -fno-finite-math-only: error isolation finds a
// broken request by the NaN or inf in its logits, which the kernels must carry through
// rather than fold away. But glibc declares its vector expf (libmvec) to the compiler
// only under __FAST_MATH__, which -fno-finite-math-only undefines, so the loops that
// call std::exp (SiLU, the attention softmax) fell back to one scalar expf per element:
// SiLU 3.5-6x and a decode's attention 1.6x slower. Declared again here as glibc does;
// libmvec's expf handles NaN and inf lanes correctly (it falls back to the scalar expf
// for them), so nothing assumes finite inputs.
#pragma once

#include <cmath>

#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__FAST_MATH__)
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif
