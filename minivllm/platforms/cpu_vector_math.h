// Math shared by the CPU fast path's C++ sources (minivllm/platforms/cpu_extension.py builds them together).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace minivllm_cpu {

// e^x in fp32, written so that a loop calling it vectorises, which libm's expf does not: Cephes' expf, x = n ln2 + r,
// a degree-6 polynomial for e^r, 2^n from the exponent bits. Within ~1 ulp of torch's vectorised exp. The clamp
// keeps 2^n a normal float at both ends (e^-87 is ~1e-38: smaller softmax weights vanish anyway).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace minivllm_cpu
