"""The `fp4_gemm` op, y = x @ dequant(W).T for an NVFP4 weight: its contract and its backends.

`auto` takes the highest-priority backend that serves here (docs/backends.md lists what each needs and
where it ran). All fp4_gemm backends of one executor share a `weight_layout` (the registry enforces it).

    backend (priority)         file           numerics    weight layout                 runs on
    cutlass, trtllm, cudnn     flashinfer.py  w4a4        128x4 scales (trtllm: rows    Blackwell, FlashInfer
      (80, 75, 70)                                        shuffled as FlashInfer does)  `mm_fp4`
    triton (50)                triton.py      w4a16       k32                           CUDA >= 8.0, triton
    cuda (40; opt in with      cuda.py        w4a16       r16c64                        CUDA >= 9.0, NVRTC,
      `backends.fp4_gemm: cuda`)                                                        bf16 models
    dequant (1)                torch.py       w4a16       dequantized at load           CPU
    torch (0, the reference)   torch.py       w4a16/w4a4  as in the checkpoint          any device

Which path serves which M (rows of x; the Triton buckets are `triton_tiles.FP4_GEMM_TILES`):

    triton   M <= cuda_decode_max_m (16) on CUDA >= 9.0 with NVRTC and bf16 x: the CUDA decode kernel
             on the k32 weights (`cuda_decode.decode_gemm(layout="k32")`); elsewhere M <= 8 an 8-row
             mma.sync tile and up to 16 a one-dot tile (split-K for small M); M = 17..1024 on sm_90 the
             wgmma kernel (`cuda_wgmma.py`), elsewhere one-dot tiles of 32 / 64 rows and a 64 x 128 tile
             up to 256; above that, dequantize to a transient bf16 weight and torch.matmul.
    cuda     M <= 16: the CUDA decode kernel, one launch; 17 .. decode_max_m (64): one launch per 16-row
             slice of x; above: cuda_dequant.py's kernel to bf16, then torch.matmul.

The CUDA decode kernel is faster than the Triton tiles up to 16 rows on the H200 and slower beyond
(docs/benchmarks.md), which is why `triton` hands it those rows on its own weights and stays the default.

Files:

    base.py                the contract (`Fp4GemmBackend`, `Fp4Weight`) and the unfused defaults
    triton.py              the Triton backend: tile tables, split-K choice, dispatch
    triton_kernels.py      its Triton kernels (GEMM with split-K reduction, SwiGLU / rope epilogues,
                           dequantize); imports triton
    triton_k32.py          the k32 bit layout and its in-register decode and K loop, in Triton (shared
                           with the MoE's Triton kernels)
    triton_tiles.py        the tile tables, swept on an H200
    cuda.py                the CUDA backend (r16c64 weights; decode kernel, slices, dequant path)
    cuda_decode.py         launches the CUDA decode kernel for M <= 16 (`decode_gemm`, both layouts)
    cuda_decode_kernel.py  the CUDA decode kernel's source (NVRTC compiles it at first launch), with its
                           design notes; also the MoE modes that backends/moe/ launches
    cuda_device.py         device helpers the CUDA kernels share (loads, decode, mma, roundings)
    cuda_dequant.py        the CUDA dequantize kernel (r16c64 -> bf16) of `cuda`'s large-M path
    cuda_launch.py         where the CUDA decode kernel runs (reasons) and `plan`, its warps per CTA
    interleave.py          row orders of the fused SwiGLU and rope epilogues (both backends)
    k32.py / r16c64.py     the two layouts, torch side: load-time repack and its inverse
    flashinfer.py          the FlashInfer w4a4 backends
    torch.py               the reference and the CPU backend

The layouts (both keep the 4-bit codes and e4m3 block scales; only their order differs):

- k32 (`triton`'s; k32.py, bits in triton_k32.py): K padded to a multiple of 512 and rows to 64, stored as
  contiguous 64-row x 128-element tiles. Each 128 elements of a row are 4 groups of 32 elements (16 bytes
  of eight 16-bit units); group t holds NVFP4 blocks t and t + 4 of the tile, each unit four codes at bit
  positions chosen so one 32-bit integer op decodes two values. Scales are read as pairs (blocks t and
  t + 4).
- r16c64 (`cuda`'s; r16c64.py): per 16 rows x 64 elements ("chunk"), lane 4g + t of a warp owns one
  16-byte vector: the codes of rows g and g + 8 for elements 16t .. 16t + 15, in the order of the
  mma.sync fragments (units in k32's bit layout); the block scales follow the same lanes. One CTA of the
  decode kernel reads one 16-row group.
"""
