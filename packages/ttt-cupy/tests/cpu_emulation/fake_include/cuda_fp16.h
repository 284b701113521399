// CPU stand-in for NVRTC's cuda_fp16.h (emulation harness only): storage is a float.
#pragma once
struct __half { float v; };
inline float __half2float(__half x) { return x.v; }
inline __half __float2half_rn(float x) { return __half{x}; }
