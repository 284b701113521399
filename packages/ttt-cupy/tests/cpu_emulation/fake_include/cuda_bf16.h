// CPU stand-in for NVRTC's cuda_bf16.h (emulation harness only): storage is a float.
#pragma once
struct __nv_bfloat16 { float v; };
inline float __bfloat162float(__nv_bfloat16 x) { return x.v; }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __nv_bfloat16{x}; }
