// The records kernel's down rows added two ways, with the rows in L2 (one core): as the kernel
// added them when this was written (csrc/neuron_ffn.h, axpy_block then: a Q8_0 row's int8
// weights widened to float, times the neuron's activation and the block's scale, four neurons'
// FMAs a load and store of the sums), and a prototype in 16-bit integers (each activation times
// a block's scale rounded to int16 against one scale for the call, two neurons' widened weights
// interleaved and summed into int32 by vpdpwssd, AVX512_VNNI). Built and run by
// benchmarks/down_axpy.py; prints each way's time a neuron and the prototype's largest error
// against the float sums.
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

constexpr int D = 4096, NB = D / 32;
struct Row {
  int8_t q[D];
  float d[NB];
};

__attribute__((noinline)) void axpy_float(const Row* const* r, const float* h, float* out) {
  for (int b = 0; b < NB; b++) {
    __m512 hv[4];
    for (int n = 0; n < 4; n++) hv[n] = _mm512_set1_ps(h[n] * r[n]->d[b]);
    for (int v = 0; v < 2; v++) {
      float* o = out + 32 * b + 16 * v;
      __m512 acc = _mm512_loadu_ps(o);
      for (int n = 0; n < 4; n++) {
        const __m128i q = _mm_loadu_si128((const __m128i*)(r[n]->q + 32 * b + 16 * v));
        acc = _mm512_fmadd_ps(hv[n], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), acc);
      }
      _mm512_storeu_ps(o, acc);
    }
  }
}

// c[b] = round(h d[b] / S), 16 blocks a vector
__attribute__((noinline)) void coefficients(const Row* r, float h_over_s, int16_t* c) {
  const __m512 hv = _mm512_set1_ps(h_over_s);
  for (int b = 0; b < NB; b += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(hv, _mm512_loadu_ps(r->d + b)));
    _mm256_storeu_si256((__m256i*)(c + b), _mm512_cvtsepi32_epi16(q));
  }
}

// int32 sums in the unpacks' order: of a block's 32, lanes 4k..4k+3 of `lo` hold outputs
// 8k..8k+3 and of `hi` 8k+4..8k+7
__attribute__((noinline)) void axpy_int16(const Row* const* r, const int16_t (*c)[NB], int32_t* acc) {
  for (int b = 0; b < NB; b++) {
    __m512i w[4];
    for (int n = 0; n < 4; n++) w[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(r[n]->q + 32 * b)));
    __m512i lo = _mm512_loadu_si512(acc + 32 * b), hi = _mm512_loadu_si512(acc + 32 * b + 16);
    for (int p = 0; p < 4; p += 2) {
      const __m512i cp = _mm512_set1_epi32((uint16_t)c[p][b] | ((uint32_t)(uint16_t)c[p + 1][b] << 16));
      lo = _mm512_dpwssd_epi32(lo, _mm512_unpacklo_epi16(w[p], w[p + 1]), cp);
      hi = _mm512_dpwssd_epi32(hi, _mm512_unpackhi_epi16(w[p], w[p + 1]), cp);
    }
    _mm512_storeu_si512(acc + 32 * b, lo);
    _mm512_storeu_si512(acc + 32 * b + 16, hi);
  }
}

int main() {
  constexpr int N = 64, REPS = 400;  // 64 rows of 4.6 KB: in L2
  std::mt19937 g(0);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::uniform_real_distribution<float> dd(0.0005f, 0.05f), hd(-4.0f, 4.0f);
  std::vector<Row> rows(N);
  for (auto& r : rows) {
    for (int i = 0; i < D; i++) r.q[i] = (int8_t)qd(g);
    for (int b = 0; b < NB; b++) r.d[b] = dd(g);
  }
  std::vector<float> h(N);
  for (auto& x : h) x = hd(g);
  float big = 0.0f;  // the call's scale: its largest |h d| to 32,767
  for (int n = 0; n < N; n++)
    for (int b = 0; b < NB; b++) big = std::fmax(big, std::fabs(h[n] * rows[n].d[b]));
  const float S = big / 32767.0f;
  std::vector<const Row*> rp(N);
  for (int i = 0; i < N; i++) rp[i] = &rows[i];
  alignas(64) static float out[D];
  alignas(64) static int32_t acc[D];
  static int16_t c[N][NB];
  double best_f = 1e9, best_i = 1e9;
  for (int turn = 0; turn < 7; turn++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < REPS; it++) {
      for (int i = 0; i < D; i++) out[i] = 0.0f;
      for (int n = 0; n < N; n += 4) axpy_float(rp.data() + n, h.data() + n, out);
    }
    auto t1 = std::chrono::steady_clock::now();
    for (int it = 0; it < REPS; it++) {
      for (int i = 0; i < D; i++) acc[i] = 0;
      for (int n = 0; n < N; n++) coefficients(rp[n], h[n] / S, c[n]);
      for (int n = 0; n < N; n += 4) axpy_int16(rp.data() + n, c + n, acc);
    }
    auto t2 = std::chrono::steady_clock::now();
    best_f = std::fmin(best_f, std::chrono::duration<double, std::micro>(t1 - t0).count() / (REPS * N));
    best_i = std::fmin(best_i, std::chrono::duration<double, std::micro>(t2 - t1).count() / (REPS * N));
  }
  double err = 0.0, ref = 0.0;  // against the float sums, outputs in the unpacks' order
  for (int b = 0; b < NB; b++)
    for (int j = 0; j < 32; j++) {
      const int half = j / 16, k = (j % 16) / 4, i = j % 4, o = 32 * b + 8 * k + 4 * half + i;
      err = std::fmax(err, std::fabs(out[o] - S * (double)acc[32 * b + j]));
      ref = std::fmax(ref, std::fabs(out[o]));
    }
  std::printf("float %.4f us a neuron\nint16 %.4f us a neuron\nlargest error %.3g of the largest sum\n",
              best_f, best_i, err / ref);
}
