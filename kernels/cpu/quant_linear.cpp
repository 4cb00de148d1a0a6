// The matrix products of a decode step on the CPU: int8 rows, int4 groups, fp8 (e4m3) rows and
// bf16 weights. Beside kernels/quant_linear.py (Triton); twins: reference/ops/weight_quant.py
// (quantized_linear) and F.linear. kernels/cpu_ops.py packs the weights and says why each.
//
// The products: x [M, K] (bf16 or float32) times a weight held as int8 codes with a scale
// per output (W8), int4 codes with a scale and zero point per group (W4), e4m3 codes with a
// scale per output (fp8: every path a float32 one, each code made an fp16 number by two
// integer operations and widened by F16C's vcvtph2ps, see fp8_halves8) or bf16, -> [M, N]
// in x's dtype. A decode step multiplies a few rows by every weight, so it is as fast as the
// weights can be read: the codes become numbers inside the registers, never written back as
// a float weight. Every path accumulates in float32 and rounds once to x's dtype, as the twin
// does; only the order of the additions differs.
//
// The packed layouts (cpu_ops.py): per block of 16 outputs, the inputs in pairs (bf16) or
// fours (int8, int4), so that one 512-bit register holds 16 outputs x 2 bf16 inputs, the
// operand of vdpbf16ps, or 16 outputs x 4 int8 codes, the operand of VNNI's vpdpbusd.
// Three paths, chosen at run time (cpu.h, isa()):
//
// - AVX-512 BF16/VNNI with bf16 x: the codes become bf16 and meet x on vdpbf16ps (two bf16
//   products a 32-bit lane, added to a float32), or int8 codes meet x on vpdpbusd as stored.
// - float32 x on any path, and bf16 x below AVX-512 or with a float32 model's int4 scales
//   (widened to float32 first: exact; the float32 result rounded once to bf16 at the end): each
//   code becomes a float32 in the registers (an int8 or int4 code, or a bf16 weight, is
//   exactly a float32) and meets x on FMA, whose product is exact and whose sum rounds as
//   float32 does. AVX-512 takes a block's 16 outputs in one register, AVX2 in two halves of
//   8 (one after the other: 8 rows x 1 half of accumulators fit AVX2's 16 registers), the
//   scalar path in plain C++ loops that any compiler can vectorize (ARM included).
//
// int4 codes q in [0, 15] stand for (q - 8) s + z in their group. On the bf16 path, 0x4300 | q
// is the bf16 bit pattern of 128 + q (bf16 keeps 7 mantissa bits), so one OR turns a code into
// a bf16 number, and a group's products sum to D = sum x (128 + q). With X = sum x over the
// group,
//     sum x w = s sum x q + (z - 8 s) X = s D + (z - 136 s) X,
// so the kernel adds X (z - 136 s) to s D: three FMAs a group. Scales and zero points stay
// in bf16, as the twin stores them. The float32 path rebuilds the twin's weight instead,
// w = fma(q - 8, s, z): with bf16 scales (q - 8) s is exact (4 x 8 bits), so w is the twin's
// float32 weight bit for bit; float32 scales (a float32 model's) are read as they are.
#include "cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace pagedllm_cpu;

namespace {

#ifdef PAGEDLLM_X86
// ---- AVX-512 BF16/VNNI, bf16 activations ----------------------------------------------------

// --8<-- [start:int4_tile]
// MB rows x 16 outputs of the int4 product; xs holds each row's sum over each group.
template <int MB>
AVX512BF16 void int4_tile(const uint16_t* x, int64_t K, const uint8_t* w,
                          const uint16_t* scale, const uint16_t* zero, const float* xs,
                          int64_t G, int64_t gs, uint16_t* out, int64_t N) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  for (int64_t g = 0; g < G; ++g) {
    // A few rows: two sums a row (low and high nibbles), so that a product waits only
    // for every other one. Eight rows keep the registers busy with one sum a row.
    constexpr bool split = MB <= 4;
    __m512 dot[MB], dot_hi[MB];
    for (int m = 0; m < MB; ++m) dot[m] = dot_hi[m] = _mm512_setzero_ps();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
      // 32 bytes: low nibbles hold inputs k, k+1 of the 16 outputs, high ones k+2, k+3
      __m512i b = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256((const __m256i*)(w + k * 8)));
      __m512bh lo =
          (__m512bh)_mm512_or_si512(_mm512_and_si512(b, low4), bf16_128);
      __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(b, 4), bf16_128);
      for (int m = 0; m < MB; ++m) {
        // inputs k..k+3 of row m as two pairs, each pair broadcast to every lane
        const int32_t* xr = (const int32_t*)(x + m * K + k);
        dot[m] = _mm512_dpbf16_ps(dot[m], lo, (__m512bh)_mm512_set1_epi32(xr[0]));
        __m512& sum_hi = split ? dot_hi[m] : dot[m];
        sum_hi = _mm512_dpbf16_ps(sum_hi, hi, (__m512bh)_mm512_set1_epi32(xr[1]));
      }
    }
    const __m512 s = _mm512_cvtpbh_ps(
        (__m256bh)_mm256_loadu_si256((const __m256i*)(scale + g * 16)));
    const __m512 z = _mm512_fmadd_ps(  // z - 136 s
        _mm512_set1_ps(-136.f), s,
        _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(zero + g * 16)))
    );
    for (int m = 0; m < MB; ++m) {
      const __m512 d = split ? _mm512_add_ps(dot[m], dot_hi[m]) : dot[m];
      acc[m] = _mm512_fmadd_ps(d, s, acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * G + g]), z, acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m)  // round once to bf16
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}
// --8<-- [end:int4_tile]

// MB rows x 16 outputs of the bf16 product.
template <int MB>
AVX512BF16 void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, uint16_t* out,
                          int64_t N) {
  __m512 acc[MB], acc_odd[MB];  // two sums a row, even and odd input pairs
  for (int m = 0; m < MB; ++m) acc[m] = acc_odd[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * 16));
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(w + k * 16 + 32));
    for (int m = 0; m < MB; ++m) {
      const int32_t* xr = (const int32_t*)(x + m * K + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], w0, (__m512bh)_mm512_set1_epi32(xr[0]));
      acc_odd[m] = _mm512_dpbf16_ps(acc_odd[m], w1, (__m512bh)_mm512_set1_epi32(xr[1]));
    }
  }
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_add_ps(acc[m], acc_odd[m]);
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

#ifdef PAGEDLLM_AMX
// --8<-- [start:bf16_amx]
// The bf16 product on AMX: eight 1 KiB tile registers and one instruction, tdpbf16ps, that
// multiplies a tile of 16 rows x 32 inputs by a tile of 32 inputs x 16 outputs and adds the
// 16 x 16 float32 sums to a third tile. Its second tile wants the inputs in pairs, 16 rows of
// 64 bytes: pair p holds output n's inputs 2p and 2p + 1 side by side. That is pack_bf16's
// layout already ([N/16, K/2, 16, 2]), so a block's next 32 inputs are 1 KiB in one piece.
// Four blocks (64 outputs) at a time: C tiles 0-3, the rows' 32 inputs in tile 4, the four
// blocks' weights through tiles 5 and 6. MC <= 16 rows; K % 32 == 0.
// From one row: AMX's tile loads stream the weight faster than the AVX-512 tile even for a
// single sequence (a decode step's 210 SmolLM2 products, cold in cache, one thread: 12.4 ms
// against 18.6), and every row then sums in one order whatever its batch.
constexpr int64_t kAmxRows = 1;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row, per tile
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

AMXBF16 static void amx_configure(int64_t mc) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t < 5 ? (uint8_t)mc : 16;  // sums and rows: mc; weights: 16 pairs
  }
  asm volatile("" ::: "memory");  // all 64 bytes stored before ldtilecfg reads them
  _tile_loadconfig(&cfg);
}

template <int NBLK>
AMXBF16 static void bf16_amx(const uint16_t* x, int64_t mc, int64_t K, const uint16_t* w,
                             uint16_t* out, int64_t N) {
  const int64_t block = K * 16;  // one block's weights: K/2 pairs x 16 outputs x 2
  _tile_zero(0);
  if constexpr (NBLK > 1) _tile_zero(1);
  if constexpr (NBLK > 2) _tile_zero(2);
  if constexpr (NBLK > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, K * 2);  // [mc, 32] of the rows
    _tile_loadd(5, w + k * 16, 64);  // block 0's pairs k/2 .. k/2 + 15
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NBLK > 1) { _tile_loadd(6, w + block + k * 16, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (NBLK > 2) { _tile_loadd(5, w + 2 * block + k * 16, 64); _tile_dpbf16ps(2, 4, 5); }
    if constexpr (NBLK > 3) { _tile_loadd(6, w + 3 * block + k * 16, 64); _tile_dpbf16ps(3, 4, 6); }
  }
  alignas(64) float sums[16 * 64];  // [mc, 64] float32, rounded once to bf16 below
  _tile_stored(0, sums, 256);
  if constexpr (NBLK > 1) _tile_stored(1, sums + 16, 256);
  if constexpr (NBLK > 2) _tile_stored(2, sums + 32, 256);
  if constexpr (NBLK > 3) _tile_stored(3, sums + 48, 256);
  for (int64_t m = 0; m < mc; ++m)
    for (int j = 0; j < NBLK; ++j)
      _mm256_storeu_si256((__m256i*)(out + m * N + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + m * 64 + j * 16)));
}

// Blocks 4 g0 .. 4 g1 - 1 of x [M, K] bf16 by the packed weight of NB blocks -> out [M, N]
// bf16, on AMX: one thread's share (it loads its own tile configuration and releases it).
AMXBF16 static void bf16_matmul_amx(const uint16_t* x, int64_t M, int64_t K,
                                    const uint16_t* w, int64_t NB, uint16_t* out,
                                    int64_t g0, int64_t g1) {
  const int64_t N = NB * 16;
  int64_t configured = 0;
  // Rows inside blocks: a group's 4 blocks of weights (K x 128 bytes) stay in the cache while
  // every 16 rows pass over them, so a prompt reads the weight from memory once.
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t mc = std::min<int64_t>(16, M - m0);
      if (mc != configured) amx_configure(configured = mc);
      const int64_t nb = 4 * g;
      const uint16_t* xm = x + m0 * K;
      const uint16_t* wg = w + nb * K * 16;
      uint16_t* o = out + m0 * N + nb * 16;
      switch (std::min<int64_t>(4, NB - nb)) {
        case 1: bf16_amx<1>(xm, mc, K, wg, o, N); break;
        case 2: bf16_amx<2>(xm, mc, K, wg, o, N); break;
        case 3: bf16_amx<3>(xm, mc, K, wg, o, N); break;
        default: bf16_amx<4>(xm, mc, K, wg, o, N);
      }
    }
  }
  _tile_release();
}
// --8<-- [end:bf16_amx]
#endif  // PAGEDLLM_AMX

// --8<-- [start:int8_tile]
// MB rows x 16 outputs of the int8 product (W8A16) on VNNI. vpdpbusd multiplies 4
// unsigned bytes by 4 signed bytes per 32-bit lane and adds the 4 products to an int32.
// The codes are the signed bytes, as stored: four inputs of one output a lane. The rows
// are the unsigned bytes: each row as 24-bit integers X = x 2^(23 - e), 2^e above the
// row's largest |x|, cut into three byte planes, X = A0 + 2^8 A1 + 2^16 (A2 - 128).
// bf16 has 8 significant bits: every x within 2^16 of the row's largest is an integer
// there, exactly; a smaller one is rounded by at most 2^(e - 24), as float32 would.
// sum q X = P0 + 2^8 P1 + 2^16 (P2 - 128 sum q): three int32 sums, no code converted,
// and y = s 2^(e - 23) sum q X, rounded once to bf16.
template <int MB>
AVX512BF16 __attribute__((always_inline)) static inline void int8_step(
    __m512i (*acc)[3], const uint8_t* planes, int64_t K, const int8_t* w, int64_t k) {
  // inputs k..k+3 of 16 outputs, into the sums of every row m and plane p
  const __m512i wk = _mm512_loadu_si512((const void*)(w + k * 16));
  for (int m = 0; m < MB; ++m)
    for (int p = 0; p < 3; ++p) {
      int32_t four;  // the row's plane p at inputs k..k+3
      std::memcpy(&four, planes + (m * 3 + p) * K + k, 4);
      acc[m][p] = _mm512_dpbusd_epi32(acc[m][p], _mm512_set1_epi32(four), wk);
    }
}

template <int MB>
AVX512BF16 void int8_tile(const uint8_t* planes, int64_t K, const int8_t* w,
                          const float* scale, const int32_t* qsum,
                          const float* row_scale, uint16_t* out, int64_t N) {
  constexpr int C = MB <= 2 ? 2 : 1;  // sums a plane: few rows keep more in flight
  __m512i acc[C][MB][3];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MB; ++m)
      for (int p = 0; p < 3; ++p) acc[c][m][p] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 4 * C <= K; k += 4 * C)
    for (int c = 0; c < C; ++c) int8_step<MB>(acc[c], planes, K, w, k + 4 * c);
  for (; k < K; k += 4) int8_step<MB>(acc[0], planes, K, w, k);
  const __m512 s = _mm512_loadu_ps(scale);
  const __m512i q128 = _mm512_slli_epi32(_mm512_loadu_si512((const void*)qsum), 7);
  for (int m = 0; m < MB; ++m) {
    __m512i p0 = acc[0][m][0], p1 = acc[0][m][1], p2 = acc[0][m][2];
    for (int c = 1; c < C; ++c) {
      p0 = _mm512_add_epi32(p0, acc[c][m][0]);
      p1 = _mm512_add_epi32(p1, acc[c][m][1]);
      p2 = _mm512_add_epi32(p2, acc[c][m][2]);
    }
    __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(p2, q128));  // P2 - 128 sum q
    sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(p1));
    sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(p0));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(sum, s), _mm512_set1_ps(row_scale[m]));
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(y));
  }
}
// --8<-- [end:int8_tile]

// Four or more rows: vpdpbusd takes two cycles on this CPU (AMD Zen 4) and each row needs
// three, so from four rows on it is cheaper to turn the codes into bf16 once (exact: eight
// bits) and multiply every row with vdpbf16ps, as int4_tile does. From the same layout:
// lane n holds the codes of output n for inputs k..k+3, c_j = its byte j sign-extended,
// and the two bf16 operands are (c_0, c_1) and (c_2, c_3), each a float32's top half.
AVX512BF16 static inline void int8_lane_pairs(__m512i lane, __m512bh* p01, __m512bh* p23) {
  const __m512 c0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 24), 24));
  const __m512 c1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 16), 24));
  const __m512 c2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(lane, 8), 24));
  const __m512 c3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(lane, 24));
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  // low half: c_even's top 16 bits; high half: c_odd's (imm 0xF8: A | (B & C))
  *p01 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(c0), 16),
                                             _mm512_castps_si512(c1), high, 0xF8);
  *p23 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(c2), 16),
                                             _mm512_castps_si512(c3), high, 0xF8);
}

template <int MB>
AVX512BF16 void int8_bf16_tile(const uint16_t* x, int64_t K, const int8_t* w,
                               const float* scale, uint16_t* out, int64_t N) {
  __m512 acc[MB], acc_odd[MB];  // inputs (k, k+1) and (k+2, k+3): two sums a row
  for (int m = 0; m < MB; ++m) acc[m] = acc_odd[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    __m512bh p01, p23;
    int8_lane_pairs(_mm512_loadu_si512((const void*)(w + k * 16)), &p01, &p23);
    for (int m = 0; m < MB; ++m) {
      int32_t xr[2];  // inputs (k, k+1) and (k+2, k+3) of row m, as bf16 pairs
      std::memcpy(xr, x + m * K + k, 8);
      acc[m] = _mm512_dpbf16_ps(acc[m], p01, (__m512bh)_mm512_set1_epi32(xr[0]));
      acc_odd[m] = _mm512_dpbf16_ps(acc_odd[m], p23, (__m512bh)_mm512_set1_epi32(xr[1]));
    }
  }
  const __m512 s = _mm512_loadu_ps(scale);
  for (int m = 0; m < MB; ++m)
    _mm256_storeu_si256((__m256i*)(out + m * N), (__m256i)_mm512_cvtneps_pbh(
        _mm512_mul_ps(_mm512_add_ps(acc[m], acc_odd[m]), s)));
}
#endif  // PAGEDLLM_X86

// ---- float32 activations: every path --------------------------------------------------------
// A tile: MB rows (at most kRows) x the 16 outputs of one packed block, written as float32
// to out (row stride N). C sums a row: a few rows keep more FMAs in flight (an FMA waits
// about four cycles for the one before it on the same sum).
constexpr int64_t kRows = 8;  // AVX2: 8 rows x 8 outputs of sums, the codes and x: 16 registers

template <int MB>
constexpr int kSums = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;

// int8 lane j (byte j of four), sign-extended: (v << 8 (3 - j)) >> 24, arithmetic
#define INT8_CODE(V, J, SLLI, SRAI) SRAI(SLLI(V, 24 - 8 * (J)), 24)

inline float load_scale(const uint16_t* p) { return bf16_to_float(*p); }
inline float load_scale(const float* p) { return *p; }

// int8: y = s sum_k x_k q_k, the scale applied once to the float32 sum (the twin applies it
// to every weight first, q s: the same sum, another rounding or two).
template <int MB>
void int8_f32_tile_scalar(const float* x, int64_t K, const int8_t* w, const float* scale,
                          float* out, int64_t N) {
  float acc[MB][16] = {};
  for (int64_t k = 0; k < K; k += 4)  // 64 bytes: [16 outputs][4 inputs]
    for (int j = 0; j < 4; ++j) {
      float c[16];
      for (int n = 0; n < 16; ++n) c[n] = (float)w[k * 16 + n * 4 + j];
      for (int m = 0; m < MB; ++m) {
        const float xv = x[m * K + k + j];
        for (int n = 0; n < 16; ++n) acc[m][n] += xv * c[n];
      }
    }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 16; ++n) out[m * N + n] = acc[m][n] * scale[n];
}

// int4: each weight rebuilt as the twin builds it, (q - 8) s + z, then summed as float32.
template <int MB, typename S>
void int4_f32_tile_scalar(const float* x, int64_t K, const uint8_t* w, const S* scale,
                          const S* zero, int64_t G, int64_t gs, float* out, int64_t N) {
  float acc[MB][16] = {};
  for (int64_t g = 0; g < G; ++g) {
    float s[16], z[16];
    for (int n = 0; n < 16; ++n) s[n] = load_scale(scale + g * 16 + n);
    for (int n = 0; n < 16; ++n) z[n] = load_scale(zero + g * 16 + n);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 4)
      for (int j = 0; j < 4; ++j) {  // byte 2n + (j & 1): input k + j, low nibble if j < 2
        float c[16];
        for (int n = 0; n < 16; ++n) {
          const uint8_t b = w[k * 8 + 2 * n + (j & 1)];
          c[n] = (float)((j < 2 ? b & 0xF : b >> 4) - 8) * s[n] + z[n];
        }
        for (int m = 0; m < MB; ++m) {
          const float xv = x[m * K + k + j];
          for (int n = 0; n < 16; ++n) acc[m][n] += xv * c[n];
        }
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 16; ++n) out[m * N + n] = acc[m][n];
}

template <int MB>
void bf16_f32_tile_scalar(const float* x, int64_t K, const uint16_t* w, float* out,
                          int64_t N) {
  float acc[MB][16] = {};
  for (int64_t k = 0; k < K; ++k) {  // pair k / 2: [16 outputs][2 inputs]
    float c[16];
    for (int n = 0; n < 16; ++n) c[n] = bf16_to_float(w[(k >> 1) * 32 + 2 * n + (k & 1)]);
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * K + k];
      for (int n = 0; n < 16; ++n) acc[m][n] += xv * c[n];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 16; ++n) out[m * N + n] = acc[m][n];
}

// fp8 (e4m3) codes: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities, NaN at
// 0x7F and 0xFF. The value of each of the 256 codes, exactly (every e4m3 number is a float32).
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = (b & 0x7F) == 0x7F ? NAN
                      : e == 0           ? std::ldexp((float)m, -9)  // subnormal: m 2^-9
                                         : std::ldexp((float)(8 + m), e - 10);
      value[b] = b & 0x80 ? -v : v;
    }
  }
};
const E4m3Table kE4m3;

// fp8: y = s sum_k x_k w_k, each code looked up, the scale applied once to the float32 sum.
template <int MB>
void fp8_f32_tile_scalar(const float* x, int64_t K, const uint8_t* w, const float* scale,
                         float* out, int64_t N) {
  float acc[MB][16] = {};
  for (int64_t k = 0; k < K; ++k) {  // 16 bytes: input k of the 16 outputs
    float c[16];
    for (int n = 0; n < 16; ++n) c[n] = kE4m3.value[w[k * 16 + n]];
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * K + k];
      for (int n = 0; n < 16; ++n) acc[m][n] += xv * c[n];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < 16; ++n) out[m * N + n] = acc[m][n] * scale[n];
}

#ifdef PAGEDLLM_X86
// -- AVX2 + FMA: a block's 16 outputs as two halves of 8, one after the other. Bytes of a
// half: int8 32 of each 64 (8 outputs x 4 inputs), int4 16 of each 32, bf16 32 of each 64.
// 8 scales or zero points as float32, from bf16 (exact) or float32
AVX2FMA static inline __m256 scales8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
AVX2FMA static inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }

// Sums acc[m][c] += w * x[m][k]: the weight vector for input k meets every row's x_k.
template <int MB>
AVX2FMA __attribute__((always_inline)) static inline void fma_rows8(
    __m256 (*acc)[kSums<MB>], __m256 w, const float* x, int64_t K, int64_t k, int c) {
  for (int m = 0; m < MB; ++m)
    acc[m][c] = _mm256_fmadd_ps(w, _mm256_set1_ps(x[m * K + k]), acc[m][c]);
}

template <int MB>
AVX2FMA static inline void store_rows8(__m256 (*acc)[kSums<MB>], __m256 s, float* out,
                                       int64_t N) {
  for (int m = 0; m < MB; ++m) {
    __m256 sum = acc[m][0];
    for (int c = 1; c < kSums<MB>; ++c) sum = _mm256_add_ps(sum, acc[m][c]);
    _mm256_storeu_ps(out + m * N, _mm256_mul_ps(sum, s));
  }
}

template <int MB>
AVX2FMA void int8_f32_tile_avx2(const float* x, int64_t K, const int8_t* w, const float* scale,
                                float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 4) {
      // lane n: the four codes of output 8h + n, inputs k..k+3, one a byte
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + k * 16 + h * 32));
#define CODE(J) _mm256_cvtepi32_ps(INT8_CODE(v, J, _mm256_slli_epi32, _mm256_srai_epi32))
      fma_rows8<MB>(acc, CODE(0), x, K, k, 0);
      fma_rows8<MB>(acc, CODE(1), x, K, k + 1, 1 % C);
      fma_rows8<MB>(acc, CODE(2), x, K, k + 2, 2 % C);
      fma_rows8<MB>(acc, _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24)), x, K, k + 3, 3 % C);
#undef CODE
    }
    store_rows8<MB>(acc, _mm256_loadu_ps(scale + 8 * h), out + 8 * h, N);
  }
}

template <int MB, typename S>
AVX2FMA void int4_f32_tile_avx2(const float* x, int64_t K, const uint8_t* w, const S* scale,
                                const S* zero, int64_t G, int64_t gs, float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  // The 16 bits of bytes 2n, 2n + 1 hold from the bottom q(k), q(k+2), q(k+1), q(k+3). XOR
  // 8 turns a nibble q into the 4-bit two's complement of q - 8; a nibble shifted to the top
  // of a 32-bit lane and back (arithmetic) is then q - 8, the top one by sign extension.
  const __m128i flip = _mm_set1_epi16((short)0x8888);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 s = scales8(scale + g * 16 + 8 * h), z = scales8(zero + g * 16 + 8 * h);
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
        const __m256i v = _mm256_cvtepi16_epi32(
            _mm_xor_si128(_mm_loadu_si128((const __m128i*)(w + k * 8 + h * 16)), flip));
#define WEIGHT(Q) _mm256_fmadd_ps(_mm256_cvtepi32_ps(Q), s, z)  // (q - 8) s + z
#define NIBBLE(AT) _mm256_srai_epi32(_mm256_slli_epi32(v, 28 - (AT)), 28)
        fma_rows8<MB>(acc, WEIGHT(NIBBLE(0)), x, K, k, 0);
        fma_rows8<MB>(acc, WEIGHT(NIBBLE(8)), x, K, k + 1, 1 % C);
        fma_rows8<MB>(acc, WEIGHT(NIBBLE(4)), x, K, k + 2, 2 % C);
        fma_rows8<MB>(acc, WEIGHT(_mm256_srai_epi32(v, 12)), x, K, k + 3, 3 % C);
#undef NIBBLE
#undef WEIGHT
      }
    }
    store_rows8<MB>(acc, _mm256_set1_ps(1.f), out + 8 * h, N);
  }
}

template <int MB>
AVX2FMA void bf16_f32_tile_avx2(const float* x, int64_t K, const uint16_t* w, float* out,
                                int64_t N) {
  constexpr int C = kSums<MB>;
  const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 4) {  // two pairs: lane n holds w(k) low, w(k+1) high
      const __m256i p0 = _mm256_loadu_si256((const __m256i*)(w + k * 16 + h * 16));
      const __m256i p1 = _mm256_loadu_si256((const __m256i*)(w + k * 16 + 32 + h * 16));
      fma_rows8<MB>(acc, _mm256_castsi256_ps(_mm256_slli_epi32(p0, 16)), x, K, k, 0);
      fma_rows8<MB>(acc, _mm256_castsi256_ps(_mm256_and_si256(p0, high)), x, K, k + 1, 1 % C);
      fma_rows8<MB>(acc, _mm256_castsi256_ps(_mm256_slli_epi32(p1, 16)), x, K, k + 2, 2 % C);
      fma_rows8<MB>(acc, _mm256_castsi256_ps(_mm256_and_si256(p1, high)), x, K, k + 3, 3 % C);
    }
    store_rows8<MB>(acc, _mm256_set1_ps(1.f), out + 8 * h, N);
  }
}

// e4m3 codes in registers, without a table: a code sign-extended to 16 bits and shifted left
// by 7 puts its sign at bit 15 (and 14: cleared), its exponent at bits 13..10 and its mantissa
// at 9..7 -- the fp16 number 2^-8 times the code's value. fp16's exponent has one more bit and
// a bias 8 larger (15 against 7), and e4m3's subnormals (m 2^-9) land on fp16's own (m 2^-17),
// which vcvtph2ps (F16C) converts to float32 exactly. The 2^8 joins the scale, once a tile.
// The NaN codes (0x7F, 0xFF) read as 1.875 here: pack_fp8 gives a row holding one a NaN
// scale, so the row's outputs are NaN, as the twin's are.
AVX2FMA static inline __m128i fp8_halves8(const uint8_t* p) {  // 8 codes -> 8 fp16
  const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)p));
  return _mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16((short)0xBFFF));
}

template <int MB>
AVX2FMA void fp8_f32_tile_avx2(const float* x, int64_t K, const uint8_t* w, const float* scale,
                               float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 4)  // input k + j: 8 bytes of its 16, outputs 8h..8h+7
      for (int j = 0; j < 4; ++j)
        fma_rows8<MB>(acc, _mm256_cvtph_ps(fp8_halves8(w + (k + j) * 16 + 8 * h)), x, K,
                      k + j, j % C);
    store_rows8<MB>(acc, _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), _mm256_set1_ps(256.f)),
                    out + 8 * h, N);
  }
}

// -- AVX-512 with float32 x: the AVX2 loops on a whole block of 16 outputs a register.
AVX512BF16 static inline __m512 scales16(const uint16_t* p) {
  return widen(_mm256_loadu_si256((const __m256i*)p));
}
AVX512BF16 static inline __m512 scales16(const float* p) { return _mm512_loadu_ps(p); }

template <int MB>
AVX512BF16 __attribute__((always_inline)) static inline void fma_rows16(
    __m512 (*acc)[kSums<MB>], __m512 w, const float* x, int64_t K, int64_t k, int c) {
  for (int m = 0; m < MB; ++m)
    acc[m][c] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[m * K + k]), acc[m][c]);
}

template <int MB>
AVX512BF16 static inline void store_rows16(__m512 (*acc)[kSums<MB>], __m512 s, float* out,
                                           int64_t N) {
  for (int m = 0; m < MB; ++m) {
    __m512 sum = acc[m][0];
    for (int c = 1; c < kSums<MB>; ++c) sum = _mm512_add_ps(sum, acc[m][c]);
    _mm512_storeu_ps(out + m * N, _mm512_mul_ps(sum, s));
  }
}

template <int MB>
AVX512BF16 void int8_f32_tile_avx512(const float* x, int64_t K, const int8_t* w,
                                     const float* scale, float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  __m512 acc[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    const __m512i v = _mm512_loadu_si512((const void*)(w + k * 16));
#define CODE(J) _mm512_cvtepi32_ps(INT8_CODE(v, J, _mm512_slli_epi32, _mm512_srai_epi32))
    fma_rows16<MB>(acc, CODE(0), x, K, k, 0);
    fma_rows16<MB>(acc, CODE(1), x, K, k + 1, 1 % C);
    fma_rows16<MB>(acc, CODE(2), x, K, k + 2, 2 % C);
    fma_rows16<MB>(acc, _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)), x, K, k + 3, 3 % C);
#undef CODE
  }
  store_rows16<MB>(acc, _mm512_loadu_ps(scale), out, N);
}

template <int MB, typename S>
AVX512BF16 void int4_f32_tile_avx512(const float* x, int64_t K, const uint8_t* w,
                                     const S* scale, const S* zero, int64_t G, int64_t gs,
                                     float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  const __m256i flip = _mm256_set1_epi16((short)0x8888);  // as in int4_f32_tile_avx2
  __m512 acc[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = scales16(scale + g * 16), z = scales16(zero + g * 16);
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 4) {
      const __m512i v = _mm512_cvtepi16_epi32(
          _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(w + k * 8)), flip));
#define WEIGHT(Q) _mm512_fmadd_ps(_mm512_cvtepi32_ps(Q), s, z)
#define NIBBLE(AT) _mm512_srai_epi32(_mm512_slli_epi32(v, 28 - (AT)), 28)
      fma_rows16<MB>(acc, WEIGHT(NIBBLE(0)), x, K, k, 0);
      fma_rows16<MB>(acc, WEIGHT(NIBBLE(8)), x, K, k + 1, 1 % C);
      fma_rows16<MB>(acc, WEIGHT(NIBBLE(4)), x, K, k + 2, 2 % C);
      fma_rows16<MB>(acc, WEIGHT(_mm512_srai_epi32(v, 12)), x, K, k + 3, 3 % C);
#undef NIBBLE
#undef WEIGHT
    }
  }
  store_rows16<MB>(acc, _mm512_set1_ps(1.f), out, N);
}

template <int MB>
AVX512BF16 void bf16_f32_tile_avx512(const float* x, int64_t K, const uint16_t* w, float* out,
                                     int64_t N) {
  constexpr int C = kSums<MB>;
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  __m512 acc[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    const __m512i p0 = _mm512_loadu_si512((const void*)(w + k * 16));
    const __m512i p1 = _mm512_loadu_si512((const void*)(w + k * 16 + 32));
    fma_rows16<MB>(acc, _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16)), x, K, k, 0);
    fma_rows16<MB>(acc, _mm512_castsi512_ps(_mm512_and_si512(p0, high)), x, K, k + 1, 1 % C);
    fma_rows16<MB>(acc, _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16)), x, K, k + 2, 2 % C);
    fma_rows16<MB>(acc, _mm512_castsi512_ps(_mm512_and_si512(p1, high)), x, K, k + 3, 3 % C);
  }
  store_rows16<MB>(acc, _mm512_set1_ps(1.f), out, N);
}

template <int MB>
AVX512BF16 void fp8_f32_tile_avx512(const float* x, int64_t K, const uint8_t* w,
                                    const float* scale, float* out, int64_t N) {
  constexpr int C = kSums<MB>;
  const __m512i keep = _mm512_set1_epi16((short)0xBFFF);  // as in fp8_halves8
  __m512 acc[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4) {
    // 32 bytes at a time, inputs k and k + 1 (then k + 2, k + 3): 32 fp16, one shift, one AND
    for (int j = 0; j < 4; j += 2) {
      const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(
          _mm256_loadu_si256((const __m256i*)(w + (k + j) * 16))), 7), keep);
      fma_rows16<MB>(acc, _mm512_cvtph_ps(_mm512_castsi512_si256(h)), x, K, k + j, j % C);
      fma_rows16<MB>(acc, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), x, K, k + j + 1,
                     (j + 1) % C);
    }
  }
  store_rows16<MB>(acc, _mm512_mul_ps(_mm512_loadu_ps(scale), _mm512_set1_ps(256.f)), out, N);
}
#endif  // PAGEDLLM_X86

// tile.template operator()<R>() for R = rows (1..kRows): the tiles take their rows as a
// template argument, so that their sums stay in registers.
template <class Tile>
void tile_rows(int64_t rows, const Tile& tile) {
  switch (rows) {
    case 1: tile.template operator()<1>(); break;
    case 2: tile.template operator()<2>(); break;
    case 3: tile.template operator()<3>(); break;
    case 4: tile.template operator()<4>(); break;
    case 5: tile.template operator()<5>(); break;
    case 6: tile.template operator()<6>(); break;
    case 7: tile.template operator()<7>(); break;
    case 8: tile.template operator()<8>(); break;
  }
}

// The float32 paths of an op: x as float32 rows (a bf16 x widened once, exactly), every
// block of 16 outputs in tiles of kRows rows, out in x's dtype. tile<R>(xm, o, nb) writes
// rows xm.. of block nb as float32 to o (row stride N).
template <class Tile>
at::Tensor float_product(const at::Tensor& x, int64_t NB, const Tile& tile) {
  const int64_t M = x.size(0), K = x.size(1), N = NB * 16;
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  auto out = at::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        tile_rows(std::min(kRows, M - m0), [&]<int R>() {
          tile.template operator()<R>(xp + m0 * K, op + m0 * N + nb * 16, nb);
        });
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());  // one rounding
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "x must be a contiguous [M, K] bfloat16 or float32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " inputs; the weight takes ", K);
}

#ifdef PAGEDLLM_X86
// Each row as int8_tile's three byte planes [3, K] and its scale 2^(e - 23). A row with a
// value that is not finite gives NaN outputs (the planes cannot hold it). K % 16 == 0.
AVX512BF16 void int8_planes(const uint16_t* x, int64_t M, int64_t K, uint8_t* planes,
                            float* row_scale) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    __m512 peak = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {  // max |x|, and whether any is NaN
      const __m512 v = widen(_mm256_loadu_si256((const __m256i*)(xr + k)));
      peak = _mm512_max_ps(peak, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float top = _mm512_reduce_max_ps(peak);
    const bool finite = !nan && std::isfinite(top);
    int e = 0;
    std::frexp(finite ? top : 0.f, &e);  // top < 2^e
    e = std::max(e, -100);  // 2^(23 - e) and 2^(e - 23) stay normal floats; tinier x round
    row_scale[m] = finite ? std::ldexp(1.f, e - 23) : NAN;
    const __m512 up = _mm512_set1_ps(finite ? std::ldexp(1.f, 23 - e) : 0.f);
    uint8_t* a = planes + m * 3 * K;
    for (int64_t k = 0; k < K; k += 16) {  // X = x 2^(23 - e), |X| < 2^23, nearest even
      const __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(
          widen(_mm256_loadu_si256((const __m256i*)(xr + k))), up));
      _mm_storeu_si128((__m128i*)(a + k), _mm512_cvtepi32_epi8(X));  // low byte
      _mm_storeu_si128((__m128i*)(a + K + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(X, 8)));
      _mm_storeu_si128((__m128i*)(a + 2 * K + k), _mm512_cvtepi32_epi8(
          _mm512_add_epi32(_mm512_srai_epi32(X, 16), _mm512_set1_epi32(128))));
    }
  }
}
#endif

}  // namespace

// packed [N/16, K/4, 32] uint8; scales, zeros [N/16, G, 16] bf16 (or float32: a float32
// model's, read as they are on the float32 path)
at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales, const at::Tensor& zeros,
                          int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0 && packed.dim() >= 2,
              "int4_matmul takes cpu_ops.pack_int4's tensors");
  const int64_t NB = packed.size(0), K = packed.size(1) * 4, N = NB * 16, G = K / group_size;
  check_x(x, K);
  TORCH_CHECK(K % group_size == 0 && packed.numel() == N * K / 2 &&
              packed.scalar_type() == at::kByte && scales.numel() == NB * G * 16 &&
              zeros.numel() == NB * G * 16 && packed.is_contiguous() &&
              scales.is_contiguous() && zeros.is_contiguous(),
              "int4_matmul takes cpu_ops.pack_int4's tensors");
  TORCH_CHECK(scales.scalar_type() == zeros.scalar_type() &&
              (scales.scalar_type() == at::kBFloat16 ||
               scales.scalar_type() == at::kFloat),
              "int4 scales and zero points are both bf16 or both float32");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const bool bf16_scales = scales.scalar_type() == at::kBFloat16;
#ifdef PAGEDLLM_X86
  if (isa() >= Isa::avx512 && x.scalar_type() == at::kBFloat16 && bf16_scales) {
    const int64_t M = x.size(0);
    auto out = at::empty({M, N}, x.options());
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    std::vector<float> xs(M * G);  // [M, G]: each row's sum over each group
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k)
          sum += bf16_to_float(xp[m * K + k]);
        xs[m * G + g] = sum;
      }
    const uint16_t* sp = (const uint16_t*)scales.data_ptr();
    const uint16_t* zp = (const uint16_t*)zeros.data_ptr();
    uint16_t* op = (uint16_t*)out.data_ptr();
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          tile_rows(std::min(kRows, M - m0), [&]<int R>() {
            int4_tile<R>(xp + m0 * K, K, wp + nb * K * 8, sp + nb * G * 16, zp + nb * G * 16,
                         xs.data() + m0 * G, G, group_size, op + m0 * N + nb * 16, N);
          });
    });
    return out;
  }
#endif
  auto run = [&]<typename S>(const S* sp, const S* zp) {
    [[maybe_unused]] const Isa path = isa();
    return float_product(x, NB, [&]<int R>(const float* xm, float* o, int64_t nb) {
      const uint8_t* w = wp + nb * K * 8;
      const S *s = sp + nb * G * 16, *z = zp + nb * G * 16;
#ifdef PAGEDLLM_X86
      if (path >= Isa::avx512)
        return int4_f32_tile_avx512<R>(xm, K, w, s, z, G, group_size, o, N);
      if (path == Isa::avx2) return int4_f32_tile_avx2<R>(xm, K, w, s, z, G, group_size, o, N);
#endif
      int4_f32_tile_scalar<R>(xm, K, w, s, z, G, group_size, o, N);
    });
  };
  if (bf16_scales)
    return run((const uint16_t*)scales.data_ptr(), (const uint16_t*)zeros.data_ptr());
  return run(scales.data_ptr<float>(), zeros.data_ptr<float>());
}

// packed [N/16, K/4, 64] int8 (16 outputs x 4 inputs); scales [N] float32; qsum [N] int32
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& scales, const at::Tensor& qsum) {
  TORCH_CHECK(packed.dim() >= 2, "int8_matmul takes cpu_ops.pack_int8's codes");
  const int64_t NB = packed.size(0), K = packed.size(1) * 4, N = NB * 16;
  check_x(x, K);
  // K <= 65536: a plane's int32 sum of 255 x 128 products an input cannot wrap
  TORCH_CHECK(K % 16 == 0 && K <= 65536 && packed.is_contiguous() &&
              packed.scalar_type() == at::kChar && packed.numel() == N * K &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
              scales.numel() == N && qsum.scalar_type() == at::kInt &&
              qsum.is_contiguous() && qsum.numel() == N,
              "int8_matmul takes cpu_ops.pack_int8's codes (inputs a multiple of 16, at most "
              "65536), float32 scales and int32 sums");
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  [[maybe_unused]] const Isa path = isa();
#ifdef PAGEDLLM_X86
  if (path >= Isa::avx512 && x.scalar_type() == at::kBFloat16) {
    const int64_t M = x.size(0);
    auto out = at::empty({M, N}, x.options());
    uint16_t* op = (uint16_t*)out.data_ptr();
    if (M >= 4) {  // the codes as bf16, every row on vdpbf16ps
      const uint16_t* xp = (const uint16_t*)x.data_ptr();
      at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t nb = b0; nb < b1; ++nb)
          for (int64_t m0 = 0; m0 < M; m0 += kRows)
            tile_rows(std::min(kRows, M - m0), [&]<int R>() {
              int8_bf16_tile<R>(xp + m0 * K, K, wp + nb * K * 16, sp + nb * 16,
                                op + m0 * N + nb * 16, N);
            });
      });
      return out;
    }
    std::vector<uint8_t> planes(M * 3 * K);  // one to three rows: VNNI on the codes as stored
    std::vector<float> row_scale(M);
    int8_planes((const uint16_t*)x.data_ptr(), M, K, planes.data(), row_scale.data());
    const int32_t* qp = qsum.data_ptr<int32_t>();
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        tile_rows(M, [&]<int R>() {
          if constexpr (R <= 3)
            int8_tile<R>(planes.data(), K, wp + nb * K * 16, sp + nb * 16, qp + nb * 16,
                         row_scale.data(), op + nb * 16, N);
        });
    });
    return out;
  }
#endif
  return float_product(x, NB, [&]<int R>(const float* xm, float* o, int64_t nb) {
    const int8_t* w = wp + nb * K * 16;
#ifdef PAGEDLLM_X86
    if (path >= Isa::avx512) return int8_f32_tile_avx512<R>(xm, K, w, sp + nb * 16, o, N);
    if (path == Isa::avx2) return int8_f32_tile_avx2<R>(xm, K, w, sp + nb * 16, o, N);
#endif
    int8_f32_tile_scalar<R>(xm, K, w, sp + nb * 16, o, N);
  });
}

// From how many rows bf16_matmul multiplies a bf16 x of K inputs on AMX tiles on the path
// taken now (a prompt's many rows then stay on our kernel: optimized/quant_layers.py); 0
// where it never does.
int64_t bf16_amx_rows(int64_t K) {
#ifdef PAGEDLLM_AMX
  if (isa() == Isa::amx && K % 32 == 0) return kAmxRows;
#endif
  return 0;
}

// packed [N/16, K/2, 32] bf16
at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() >= 2, "bf16_matmul takes cpu_ops.pack_bf16's weight");
  const int64_t NB = packed.size(0), K = packed.size(1) * 2, N = NB * 16;
  check_x(x, K);
  TORCH_CHECK(K % 4 == 0 && packed.is_contiguous() && packed.numel() == N * K &&
              packed.scalar_type() == at::kBFloat16,
              "bf16_matmul takes cpu_ops.pack_bf16's weight");
  const uint16_t* wp = (const uint16_t*)packed.data_ptr();
  [[maybe_unused]] const Isa path = isa();
#ifdef PAGEDLLM_X86
  if (path >= Isa::avx512 && x.scalar_type() == at::kBFloat16) {
    const int64_t M = x.size(0);
    auto out = at::empty({M, N}, x.options());
    const uint16_t* xp = (const uint16_t*)x.data_ptr();
    uint16_t* op = (uint16_t*)out.data_ptr();
#ifdef PAGEDLLM_AMX
    if (const int64_t amx_rows = bf16_amx_rows(K); amx_rows && M >= amx_rows) {
      at::parallel_for(0, (NB + 3) / 4, 1, [&](int64_t g0, int64_t g1) {
        bf16_matmul_amx(xp, M, K, wp, NB, op, g0, g1);
      });
      return out;
    }
#endif
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t m0 = 0; m0 < M; m0 += kRows)
          tile_rows(std::min(kRows, M - m0), [&]<int R>() {
            bf16_tile<R>(xp + m0 * K, K, wp + nb * K * 16, op + m0 * N + nb * 16, N);
          });
    });
    return out;
  }
#endif
  return float_product(x, NB, [&]<int R>(const float* xm, float* o, int64_t nb) {
    const uint16_t* w = wp + nb * K * 16;
#ifdef PAGEDLLM_X86
    if (path >= Isa::avx512) return bf16_f32_tile_avx512<R>(xm, K, w, o, N);
    if (path == Isa::avx2) return bf16_f32_tile_avx2<R>(xm, K, w, o, N);
#endif
    bf16_f32_tile_scalar<R>(xm, K, w, o, N);
  });
}

// packed [N/16, K, 16] uint8 (e4m3 codes: input k's 16 outputs in a row); scales [N] float32,
// NaN for a row holding a NaN code (pack_fp8). Every path is a float32 one: x widened once.
at::Tensor fp8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(packed.dim() >= 2, "fp8_matmul takes cpu_ops.pack_fp8's codes");
  const int64_t NB = packed.size(0), K = packed.size(1), N = NB * 16;
  check_x(x, K);
  TORCH_CHECK(K % 4 == 0 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
              packed.numel() == N * K && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous() && scales.numel() == N,
              "fp8_matmul takes cpu_ops.pack_fp8's codes (inputs a multiple of 4) and float32 "
              "scales");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  [[maybe_unused]] const Isa path = isa();
  return float_product(x, NB, [&]<int R>(const float* xm, float* o, int64_t nb) {
    const uint8_t* w = wp + nb * K * 16;
#ifdef PAGEDLLM_X86
    if (path >= Isa::avx512) return fp8_f32_tile_avx512<R>(xm, K, w, sp + nb * 16, o, N);
    if (path == Isa::avx2) return fp8_f32_tile_avx2<R>(xm, K, w, sp + nb * 16, o, N);
#endif
    fp8_f32_tile_scalar<R>(xm, K, w, sp + nb * 16, o, N);
  });
}

// torch operators (torch.ops.pagedllm_cpu.*): the profiler names them, as it names aten's
TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("int4_matmul", &int4_matmul);
  m.def("int8_matmul", &int8_matmul);
  m.def("bf16_matmul", &bf16_matmul);
  m.def("bf16_amx_rows", &bf16_amx_rows);
  m.def("fp8_matmul", &fp8_matmul);
}
