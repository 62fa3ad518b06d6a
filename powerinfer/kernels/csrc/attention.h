// Attention over the paged KV cache, one tile of queries at a time, written over neuron_ffn.h's
// SIMD layer (V, W, vfma, ...) and compiled per instruction set with it; ops.cpp's
// `paged_attention` places the new keys and values, cuts the step into tiles and calls this.
//
// The pool holds, per block and KV head, the keys transposed (D, BS) and the values as rows
// (BS, D) (`model.KVCache`). Keys stored d-major make a query's scores against 16 keys D vector
// multiply-adds of the query's d-th value with the keys' d-th row: no horizontal sums and no
// transposes at read time, where rows of keys would need one reduction per key. The tile's
// queries go in groups of 4, and keys in units of 16: a group's scores against a unit live in
// registers, softmax is online (flash attention's running max and sum, in float) in steps of 4
// units (64 positions), and the group's outputs are accumulated in registers 4 vectors at a time
// over the step's value rows. Included inside namespace powerinfer::ISA_NS (see the end of neuron_ffn.h).

// exp(x) for x <= 0, within about 1 ulp of expf (Cephes' expf polynomial); x below -87 gives a
// tiny positive number, never 0: callers zero what they masked out themselves.
inline V vexp(V x) {
#if defined(__AVX512F__)
  x = _mm512_max_ps(x, vset(-87.0f));
  const V n = _mm512_roundscale_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
#else
  x = _mm256_max_ps(x, vset(-87.0f));
  const V n = _mm256_round_ps(vmul(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset(-2.12194440e-4f), r);
#endif
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset(1.0f)));
#if defined(__AVX512F__)
  return _mm512_scalef_ps(p, n);
#else
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(p, _mm256_castsi256_ps(e));
#endif
}

inline V vmax(V a, V b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#else
  return _mm256_max_ps(a, b);
#endif
}

inline float hmax(V v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#endif
}

template <typename T>
inline V load_kv(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return vload(p);
  else
    return bf16_to_f32(p);
}

constexpr int ATTN_QG = 4;        // queries of a group
constexpr int ATTN_KU = 16;       // keys of a unit (their scores in registers)
constexpr int ATTN_KV = ATTN_KU / W;  // vectors of a unit's row of keys
constexpr int ATTN_UNITS = 4;     // units of a step of the online softmax
constexpr int ATTN_SK = ATTN_KU * ATTN_UNITS;  // keys of a step: positions [64 s, 64 s + 64)

// o[i] (the group's outputs, NV vectors from column d0) = corr[i] o[i] + sum_j p[i][j] v[j] over
// the step's value rows j0 .. j1 - 1 (row j: row j % 16 of unit j / 16's, vu[j / 16], rows `D`
// apart).
template <typename T, int NV, int QN>
inline void pv_chunk(const AttnTile& a, int64_t i0, int qn_, const float (*p)[ATTN_SK], const float* corr,
                     const T* const* vu, int64_t j0, int64_t j1, int64_t d0) {
  const int qn = QN ? QN : qn_;  // (a whole group's count known when compiled: its loops unrolled)
  V acc[ATTN_QG][NV];
  for (int i = 0; i < qn; i++) {
    const V c = vset(corr[i]);
    for (int v = 0; v < NV; v++) acc[i][v] = vmul(c, vload(a.out + (i0 + i) * a.D + d0 + v * W));
  }
  for (int64_t j = j0; j < j1; j++) {
    const T* vj = vu[j / ATTN_KU] + (j % ATTN_KU) * a.D + d0;
    V row[NV];
    for (int v = 0; v < NV; v++) row[v] = load_kv(vj + v * W);
    for (int i = 0; i < qn; i++) {
      const V pj = vset(p[i][j]);
      for (int v = 0; v < NV; v++) acc[i][v] = vfma(pj, row[v], acc[i][v]);
    }
  }
  for (int i = 0; i < qn; i++)
    for (int v = 0; v < NV; v++) vstore(a.out + (i0 + i) * a.D + d0 + v * W, acc[i][v]);
}

// pv_chunk over the head's width, 4 vectors at a time
template <typename T, int QN>
inline void pv_all(const AttnTile& a, int64_t i0, int qn, const float (*p)[ATTN_SK], const float* corr,
                   const T* const* vu, int64_t j0, int64_t j1) {
  const int64_t D = a.D;
  int64_t d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) pv_chunk<T, 4, QN>(a, i0, qn, p, corr, vu, j0, j1, d0);
  switch ((D - d0) / W) {
    case 3: pv_chunk<T, 3, QN>(a, i0, qn, p, corr, vu, j0, j1, d0); break;
    case 2: pv_chunk<T, 2, QN>(a, i0, qn, p, corr, vu, j0, j1, d0); break;
    case 1: pv_chunk<T, 1, QN>(a, i0, qn, p, corr, vu, j0, j1, d0); break;
  }
}

// The scores of a group's queries q (qn rows, D apart) against NU units from unit u0 of a
// step, into p: each a sum over d in order (one multiply-add chain), the same floats whatever NU.
// With AVX-512 a whole step's 4 units at once: 16 accumulators, 4 keys' vectors loaded for each
// 4 broadcast query values (against 1 for 4 a unit at a time); AVX2's 16 registers hold one.
#if defined(__AVX512F__)
constexpr int ATTN_QK_UNITS = 4;
#else
constexpr int ATTN_QK_UNITS = 1;
#endif
template <typename T, int NU, int QN>
inline void step_scores(const AttnTile& a, int qn_, const float* q, const T* const* ku, float (*p)[ATTN_SK],
                        int u0) {
  constexpr int C = NU * ATTN_KV;
  const int qn = QN ? QN : qn_;
  const int64_t D = a.D, BS = a.BS;
  V s[ATTN_QG][C];
  for (int i = 0; i < qn; i++)
    for (int c = 0; c < C; c++) s[i][c] = vzero();
  for (int64_t d = 0; d < D; d++) {
    V k[C];
    for (int u = 0; u < NU; u++)
      for (int v = 0; v < ATTN_KV; v++) k[u * ATTN_KV + v] = load_kv(ku[u0 + u] + d * BS + v * W);
    for (int i = 0; i < qn; i++) {
      const V qd = vset(q[i * D + d]);
      for (int c = 0; c < C; c++) s[i][c] = vfma(qd, k[c], s[i][c]);
    }
  }
  for (int i = 0; i < qn; i++)
    for (int c = 0; c < C; c++) vstore(p[i] + u0 * ATTN_KU + c * W, s[i][c]);
}

// Queries i0 .. i0 + qn - 1 against one step of the online softmax: `nu` units of 16 keys from
// position p0 (a multiple of 64), unit k's keys ku[k] (its first column of a (D, BS) block),
// its values vu[k] (its first row). The scores unit by unit in registers, then per query one
// max, one correction and one sum over the step's keys it sees, then the values. A step's keys
// are fixed by position alone (the tile's last position may cut its last units off, past every
// key its queries see), so each query's floats are the same however the step's queries are
// cut into tiles and groups (a prompt in chunks, a token alone or in a batch).
// QN: the group's query count where it is known when compiled (a whole group, ATTN_QG: every
// loop over its queries unrolled), else 0 and `qn_` says
template <typename T, int QN>
inline void attend_step(const AttnTile& a, int64_t i0, int qn_, const T* const* ku, const T* const* vu, int nu,
                        int64_t p0, float* m, float* l) {
  const int qn = QN ? QN : qn_;
  const int64_t D = a.D, n = nu * ATTN_KU;
  alignas(64) float p[ATTN_QG][ATTN_SK];
  const float* q = a.q + i0 * D;
  if (ATTN_QK_UNITS == ATTN_UNITS && nu == ATTN_UNITS) {
    step_scores<T, ATTN_QK_UNITS, QN>(a, qn, q, ku, p, 0);
  } else {
    for (int u = 0; u < nu; u++) step_scores<T, 1, QN>(a, qn, q, ku, p, u);
  }
  float corr[ATTN_QG];
  int64_t jlo = n, jhi = 0;  // the keys some query of the group sees
  for (int i = 0; i < qn; i++) {
    const int64_t qi = i0 + i, pos = a.qpos[qi];
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
    const int64_t j0 = std::max<int64_t>(0, lo - p0), j1 = std::min<int64_t>(n, pos - p0 + 1);
    if (j1 <= j0) {  // none of this step's keys
      corr[i] = 1.0f;
      for (int64_t j = 0; j < n; j++) p[i][j] = 0.0f;
      continue;
    }
    jlo = std::min(jlo, j0), jhi = std::max(jhi, j1);
    const bool whole = j0 == 0 && j1 == ATTN_SK;  // (by position alone: never a cut step)
    float mx;
    if (whole) {
      V vm = vload(p[i]);
      for (int v = 1; v < ATTN_SK / W; v++) vm = vmax(vm, vload(p[i] + v * W));
      mx = hmax(vm);
    } else {
      mx = -INFINITY;
      for (int64_t j = j0; j < j1; j++) mx = std::max(mx, p[i][j]);
    }
    const float mnew = std::max(m[qi], mx);
    corr[i] = std::exp(m[qi] - mnew);
    V sum = vzero();
    for (int64_t v = 0; v < n / W; v++) {
      const V e = vexp(vadd(vload(p[i] + v * W), vset(-mnew)));
      vstore(p[i] + v * W, e);
      sum = vadd(sum, e);
    }
    float total = 0.0f;
    if (whole) {
      total = hsum(sum);
    } else {  // keys outside [j0, j1) hold what the scores of other positions made: zeroed
      for (int64_t j = 0; j < n; j++) {
        if (j < j0 || j >= j1) p[i][j] = 0.0f;
        total += p[i][j];
      }
    }
    l[qi] = l[qi] * corr[i] + total;
    m[qi] = mnew;
  }
  if (jhi <= jlo) return;
  pv_all<T, QN>(a, i0, qn, p, corr, vu, jlo, jhi);
}

template <typename T>
inline void attend_t(const AttnTile& a) {
  const int64_t D = a.D, BS = a.BS, es = sizeof(T);
  float m[ATTN_MAX_TILE], l[ATTN_MAX_TILE];
  int64_t lo = INT64_MAX, hi = -1;
  for (int64_t i = 0; i < a.nq; i++) {
    m[i] = -INFINITY, l[i] = 0.0f;
    for (int64_t d = 0; d < D; d++) a.out[i * D + d] = 0.0f;
    const int64_t pos = a.qpos[i];
    lo = std::min(lo, a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0);
    hi = std::max(hi, pos);
  }
  auto unit = [&](int64_t u, const T*& ku, const T*& vu) {  // unit u's keys and values
    const int64_t p0 = u * ATTN_KU, off = (int64_t)a.table[p0 / BS] * a.block_stride, in = p0 % BS;
    ku = (const T*)(a.k + off) + in;            // column `in` of the (D, BS) keys
    vu = (const T*)(a.v + off + in * D * es);  // row `in` of the (BS, D) values
  };
  const int64_t last = hi / ATTN_KU;  // the tile's last unit
  for (int64_t u0 = lo / ATTN_SK * ATTN_UNITS; u0 <= last; u0 += ATTN_UNITS) {  // steps of 64 positions
    const int nu = (int)std::min<int64_t>(ATTN_UNITS, last - u0 + 1);
    const T *ku[ATTN_UNITS], *vu[ATTN_UNITS];
    for (int k = 0; k < nu; k++) unit(u0 + k, ku[k], vu[k]);
    if (u0 + nu <= last) {  // the next step's blocks are anywhere in the pool: fetch its first unit ahead
      const T *kn, *vn;
      unit(u0 + nu, kn, vn);
      for (int64_t d = 0; d < D; d += 64 / (ATTN_KU * es) > 0 ? 64 / (ATTN_KU * es) : 1)
        _mm_prefetch((const char*)(kn + d * BS), _MM_HINT_T0);
      for (int64_t b = 0; b < ATTN_KU * D * es; b += 64) _mm_prefetch((const char*)vn + b, _MM_HINT_T0);
    }
    for (int64_t i0 = 0; i0 < a.nq; i0 += ATTN_QG) {
      const int qn = (int)std::min<int64_t>(ATTN_QG, a.nq - i0);
      if (qn == ATTN_QG)
        attend_step<T, ATTN_QG>(a, i0, qn, ku, vu, nu, u0 * ATTN_KU, m, l);
      else
        attend_step<T, 0>(a, i0, qn, ku, vu, nu, u0 * ATTN_KU, m, l);
    }
  }
  for (int64_t i = 0; i < a.nq; i++) {
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    for (int64_t d = 0; d < D; d++) a.out[i * D + d] *= inv;
  }
}

inline void attend(const AttnTile& a) {
  if (a.bf16)
    attend_t<uint16_t>(a);
  else
    attend_t<float>(a);
}
