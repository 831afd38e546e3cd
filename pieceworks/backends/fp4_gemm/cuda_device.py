"""Device helpers of the CUDA decode kernels (cuda_decode_kernel.py prepends them to its SOURCE): PDL, predicated
streaming loads, the e4m3 scale-pair conversion, the e2m1 slot decode, bf16x2 multiply, the bf16 mma.sync,
and the bf16 roundings of the fused epilogues (SwiGLU and rope as the unfused Triton ops round).

Plain CUDA C++ with inline PTX, no headers (NVRTC compiles it without a CUDA toolkit); sm_90 for
mul.bf16x2 and griddepcontrol.
"""

DEVICE_HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;
// Programmatic dependent launch: wait for the kernel before / let the next one start early (returns at
// once when not launched with PDL). Like mul.bf16x2, needs sm_90.
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ void ld_stream(U4& r, const U4* p, bool pred) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w) : "l"(p), "r"((int)pred));
}
__device__ __forceinline__ void ld_x(U4& r, const U4* p, bool pred) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w) : "l"(p), "r"((int)pred));
}
__device__ __forceinline__ void ld_scale(u32& r, const u16* p, bool pred) {
    u16 v = (u16)r;
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.u16 %0, [%1];\n}" : "+h"(v) : "l"(p), "r"((int)pred));
    r = v;
}
// Two e4m3 scales (low byte row g, high byte row g + 8) -> bf16x2 (scale * 2^112) each (triton_k32.py).
__device__ __forceinline__ u32 scale_pair(u32 s) {
    u32 h;
    asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(h) : "r"(s));
    return (h >> 3) | 0x70007000u;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(a), "r"(sel));
    return r;
}
__device__ __forceinline__ u32 bmul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
template <int J> __device__ __forceinline__ u32 slot(u32 w) {
    const u32 m = 0x81C081C0u;
    if (J == 0) return w & m;
    if (J == 1) return (w << 3) & m;
    if (J == 2) return (w << 6) & m;
    return (((w & 0x6C006C00u) >> 7) * 2081u) & m;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_round(float v) {  // v rounded to bf16, as float
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return __uint_as_float((u32)h << 16);
}
__device__ __forceinline__ u16 to_bf16(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
// silu(g) * u rounded as the unfused path rounds (Triton's `triton_epilogue.swiglu_values`: div.full, libdevice exp).
__device__ __forceinline__ u16 swiglu(float g, float u) {
    g = bf16_round(g);
    u = bf16_round(u);
    float d;
    asm("div.full.f32 %0, %1, %2;" : "=f"(d) : "f"(g), "f"(1.0f + expf(-g)));
    return to_bf16(bf16_round(d) * u);
}

// The rope of one q/k pair as the rope kernel rounds (Triton's `triton_epilogue.rope_pair`): values, cos and
// sin rounded to bf16, every product (no FMA contraction) and sum rounded.
__device__ __forceinline__ void rope_pair(float y1, float y2, float c, float s, u16& o1, u16& o2) {
    const float x1 = bf16_round(y1), x2 = bf16_round(y2);
    c = bf16_round(c);
    s = bf16_round(s);
    o1 = to_bf16(bf16_round(__fmul_rn(x1, c)) - bf16_round(__fmul_rn(x2, s)));
    o2 = to_bf16(bf16_round(__fmul_rn(x2, c)) + bf16_round(__fmul_rn(x1, s)));
}
"""
