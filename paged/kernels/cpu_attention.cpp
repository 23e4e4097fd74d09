// Paged attention on a CPU, in C++ (guide §5 "block tables", §7 "the paged kernel").
//
// The loop of decode_v1.py and prefill.py, written for a CPU. One task is a tile: a sequence,
// one KV head (or, at decode with many sequences, all of them), and a run of that sequence's new tokens. Its rows
// are (token, query head) pairs for every query head that shares the tile's KV heads (GQA), so each K and V row
// is read once per tile. The task walks the sequence's block table and reads K and V where they lie in the
// pool, block by block, with an online softmax: nothing is gathered into a contiguous copy (at prefill the keys
// alone are first turned, once per sequence, into the layout the vector lanes want). Tasks run on torch's
// own thread pool (at::parallel_for), longest first, each thread taking the next task as it needs one, so
// ragged sequences do not leave a core idle. While a block is computed, the next one's rows are requested from
// memory into the L2 cache, a few cache lines at a time over all of the block's work.
//
//   query            [num_tokens, num_heads, head_dim]                  any strides, head_dim contiguous
//   key_cache        [num_blocks, block_size, num_kv_heads, head_dim]   NHD; value_cache the same
//   block_tables     int32 [num_seqs, max_blocks_per_seq]
//   context_lens     int32 [num_seqs]       cached tokens, this step's included
//   query_start_loc  int32 [num_seqs + 1]   prefill: sequence b's new tokens are rows qsl[b] .. qsl[b + 1] - 1
//   slot_mapping     int32 or int64 [num_tokens]   block_id * block_size + offset; -1 skips the token
//
// cpu.py builds this file on first use and checks inputs as the Triton wrappers do; the checks here
// keep every read and write inside its tensor, and raise ValueError.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kQueryTile = 16;         // new tokens per prefill tile
constexpr int64_t kWorkPerThread = 4096;   // (row, key) pairs a thread should have before another one joins
constexpr int64_t kSeqsPerThread = 4;      // decode: sequences per thread from which a tile takes all KV heads
constexpr int64_t kSpanKeys = 128;         // prefill: keys a step of the walk over the blocks takes at least

// Rows of `num_tokens` consecutive new tokens of sequence `seq`, starting at row `token` of the query and at
// position `first_pos` of the sequence, against KV heads kv_head .. kv_head + num_kv_heads - 1 and the query
// heads that share them. With G = num_kv_heads * group rows per token, row r is token r / G and query head
// kv_head * group + r % G; it sees the keys at positions 0 .. first_pos + r / G (causal; at decode the one
// token sees them all).
struct Tile {
  int64_t seq, kv_head, num_kv_heads, token, num_tokens, first_pos, cost;
};

using Vec = at::vec::Vectorized<float>;  // torch's SIMD vector: 8 floats with AVX2, 16 with AVX-512
constexpr int64_t kLanes = Vec::size();

// A row of K or V as floats: the row itself when the pool holds fp32, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(row[i]);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* row, float*, int64_t) {
  return row;
}

// The next block's K and V rows (at prefill V alone: the scores read the turned keys), requested from memory a few
// cache lines at a time while this block is computed: a burst of hundreds of requests at once would hold the core
// until most of them had arrived. They are requested into the L2 cache, not L1: a request for L1 holds one of the
// core's few L1 miss slots until its line arrives, and while they are all taken the loads of the block being
// computed wait too; from L2 a line is a few cycles away.
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t stride = 0, row_bytes = 0, rows = 0;  // rows of row_bytes, stride bytes apart
  int64_t row = 0, byte = 0;                    // the next line to request
  Prefetch() = default;
  template <typename T>
  Prefetch(const T* k_rows, const T* v_rows, int64_t n, int64_t row_stride, int64_t d)
      : k(reinterpret_cast<const char*>(k_rows)), v(reinterpret_cast<const char*>(v_rows)),
        stride(row_stride * sizeof(T)), row_bytes(d * sizeof(T)), rows(n) {}
  int64_t lines() const { return rows * ((row_bytes + 63) / 64); }
  inline void issue(int64_t count) {
    for (; count > 0 && row < rows; --count) {
      if (k != nullptr) __builtin_prefetch(k + row * stride + byte, /*write=*/0, /*locality: into L2=*/2);
      __builtin_prefetch(v + row * stride + byte, /*write=*/0, /*locality: into L2=*/2);
      if ((byte += 64) >= row_bytes) byte = 0, ++row;
    }
  }
};

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// out[i] = q . k[i] for four keys at once: four running sums keep the multiply-add units busy.
inline void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const Vec x = Vec::loadu(q + d);
    s0 = at::vec::fmadd(x, Vec::loadu(k[0] + d), s0);
    s1 = at::vec::fmadd(x, Vec::loadu(k[1] + d), s1);
    s2 = at::vec::fmadd(x, Vec::loadu(k[2] + d), s2);
    s3 = at::vec::fmadd(x, Vec::loadu(k[3] + d), s3);
  }
  out[0] = sum_lanes(s0), out[1] = sum_lanes(s1), out[2] = sum_lanes(s2), out[3] = sum_lanes(s3);
  for (; d < n; ++d)
    for (int i = 0; i < 4; ++i) out[i] += q[d] * k[i][d];
}

// Prefill: every sequence's keys turned into the vector lanes once, before any tile runs, a step of the walk at a
// time: step i (keys i * span_keys ..) of sequence `seq` and KV head h is kt[d * width + t] = k[i * span_keys + t][d],
// zero past the context, so that a vector of kt holds one dimension of kLanes keys. A tile's dozens of rows share
// each load of it, and the tiles that walk the same blocks (every later tile of the sequence) turn nothing.
struct TurnedKeys {
  std::unique_ptr<float[]> data;       // not zeroed when made: each step writes all of its own
  std::vector<int64_t> offset, steps;  // per sequence: where its steps begin in data, and how many it has
  int64_t span = 1, width = 0;         // blocks a step, and its keys rounded up to whole vectors
  float* step(int64_t seq, int64_t kv_head, int64_t i, int64_t D) const {
    return data.get() + offset[seq] + (kv_head * steps[seq] + i) * D * width;
  }
};

// p[i][t] = q[i] . k[t] for four rows i and V vectors of keys at once, from key t0 of a turned block: each vector
// of keys loaded once for the four rows, no sum across lanes, and 4 * V running sums, enough independent chains to
// keep both multiply-add units busy while each waits on the one before it.
template <int V>
inline void scores4_chunk(const float* q, int64_t q_stride, const float* kt, int64_t D, int64_t width, float* p,
                          int64_t p_stride, int64_t t0) {
  Vec s[4][V];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < V; ++j) s[i][j] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec k[V];
    for (int j = 0; j < V; ++j) k[j] = Vec::loadu(kt + d * width + t0 + j * kLanes);
    for (int i = 0; i < 4; ++i) {
      const Vec x(q[i * q_stride + d]);
      for (int j = 0; j < V; ++j) s[i][j] = at::vec::fmadd(x, k[j], s[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < V; ++j) s[i][j].store(p + i * p_stride + t0 + j * kLanes);
}

// p[i][t] = q[i] . k[t] for four rows i at once and the first n keys t of a turned step (n whole vectors).
inline void scores4(const float* q, int64_t q_stride, const float* kt, int64_t D, int64_t width, int64_t n, float* p,
                    int64_t p_stride) {
  constexpr int kWide = kLanes >= 16 ? 4 : 2;  // 16 running sums with AVX-512's 32 registers, 8 with AVX2's 16
  int64_t t = 0;
  for (; t + kWide * kLanes <= n; t += kWide * kLanes) scores4_chunk<kWide>(q, q_stride, kt, D, width, p, p_stride, t);
  for (; t < n; t += kLanes) scores4_chunk<1>(q, q_stride, kt, D, width, p, p_stride, t);
}

// y[d .. d + V * kLanes) += sum over t < n of p[t] * x[t][same range]. The V vectors of y stay in registers over
// all n rows: V independent chains of multiply-adds, so that no multiply-add waits for the one before it.
template <int V>
inline void weighted_sum_chunk(const float* p, const float* const* x, int64_t n, float* y, int64_t d) {
  Vec acc[V];
  for (int i = 0; i < V; ++i) acc[i] = Vec::loadu(y + d + i * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    const Vec a(p[t]);
    for (int i = 0; i < V; ++i) acc[i] = at::vec::fmadd(a, Vec::loadu(x[t] + d + i * kLanes), acc[i]);
  }
  for (int i = 0; i < V; ++i) acc[i].store(y + d + i * kLanes);
}

// y += sum over t < n of p[t] * x[t], for rows x[t] of length d_total: as many vectors at a time as fit.
inline void weighted_sum(const float* p, const float* const* x, int64_t n, float* y, int64_t d_total) {
  int64_t d = 0;
  for (; d + 8 * kLanes <= d_total; d += 8 * kLanes) weighted_sum_chunk<8>(p, x, n, y, d);
  if (d + 4 * kLanes <= d_total) weighted_sum_chunk<4>(p, x, n, y, d), d += 4 * kLanes;
  if (d + 2 * kLanes <= d_total) weighted_sum_chunk<2>(p, x, n, y, d), d += 2 * kLanes;
  if (d + kLanes <= d_total) weighted_sum_chunk<1>(p, x, n, y, d), d += kLanes;
  for (; d < d_total; ++d)
    for (int64_t t = 0; t < n; ++t) y[d] += p[t] * x[t][d];
}

// y_i += sum over t < n of p_i[t] * x[t] for four rows i at once (p_i and y_i p_stride and y_stride apart): each
// vector of x is loaded once for the four rows, and sixteen running sums stay in registers.
inline void weighted_sum4(const float* p, int64_t p_stride, const float* const* x, int64_t n, float* y,
                          int64_t y_stride, int64_t d_total) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= d_total; d += 4 * kLanes) {
    Vec acc[4][4];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = Vec::loadu(y + i * y_stride + d + j * kLanes);
    for (int64_t t = 0; t < n; ++t) {
      Vec row[4];
      for (int j = 0; j < 4; ++j) row[j] = Vec::loadu(x[t] + d + j * kLanes);
      for (int i = 0; i < 4; ++i) {
        const Vec a(p[i * p_stride + t]);
        for (int j = 0; j < 4; ++j) acc[i][j] = at::vec::fmadd(a, row[j], acc[i][j]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j].store(y + i * y_stride + d + j * kLanes);
  }
  for (; d < d_total; ++d)
    for (int i = 0; i < 4; ++i)
      for (int64_t t = 0; t < n; ++t) y[i * y_stride + d] += p[i * p_stride + t] * x[t][d];
}

inline void rescale(float a, float* y, int64_t n) {  // y *= a
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) (Vec::loadu(y + d) * Vec(a)).store(y + d);
  for (; d < n; ++d) y[d] *= a;
}

inline float max_of(const float* p, int64_t n) {
  Vec maxima(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) maxima = at::vec::maximum(maxima, Vec::loadu(p + t));
  float m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, maxima);
  for (; t < n; ++t) m = std::fmax(m, p[t]);
  return m;
}

// p[t] = exp(p[t] - m) for t < n; returns their sum. A masked score (-inf) becomes exactly 0.
inline float exp_and_sum(float* p, float m, int64_t n) {
  Vec sums(0.f);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const Vec e = (Vec::loadu(p + t) - Vec(m)).exp();
    e.store(p + t);
    sums = sums + e;
  }
  float sum = sum_lanes(sums);
  for (; t < n; ++t) sum += p[t] = std::exp(p[t] - m);
  return sum;
}

// A thread's working memory, reused by every tile it runs.
struct Scratch {
  std::vector<float> q, acc, m, l, p, k_rows, v_rows;
  std::vector<const float*> k, v;  // the block's K and V rows
};

template <typename T>
struct PagedAttention {
  const T* query;
  int64_t q_stride_token, q_stride_head;
  const T* key_cache;
  const T* value_cache;
  int64_t stride_block, stride_slot, stride_head;
  const int32_t* block_tables;
  int64_t table_stride;
  T* out;  // contiguous [num_tokens, num_heads, head_dim]
  int64_t num_heads, block_size, group, head_dim;
  float scale;
  const TurnedKeys* turned;  // prefill: the keys turned into the vector lanes (a tile has one KV head then); decode: null

  // The keys of every sequence with new tokens, turned a step at a time (TurnedKeys), the steps shared among the
  // threads.
  void turn_keys(TurnedKeys& turned, const int32_t* lens, const int32_t* starts, int64_t num_seqs,
                 int64_t num_kv_heads) const {
    const int64_t bs = block_size, D = head_dim;
    turned.span = std::max<int64_t>(1, kSpanKeys / bs);
    const int64_t span_keys = turned.span * bs;
    turned.width = (span_keys + kLanes - 1) / kLanes * kLanes;
    std::vector<std::array<int64_t, 3>> steps;  // (sequence, KV head, step)
    int64_t size = 0;
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const bool has_tiles = starts[seq + 1] > starts[seq];
      turned.offset.push_back(size);
      turned.steps.push_back(has_tiles ? (lens[seq] + span_keys - 1) / span_keys : 0);
      size += num_kv_heads * turned.steps.back() * D * turned.width;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t i = 0; i < turned.steps.back(); ++i) steps.push_back({seq, h, i});
    }
    turned.data.reset(new float[size]);
    at::parallel_for(0, steps.size(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const auto [seq, h, i] = steps[job];
        float* kt = turned.step(seq, h, i, D);
        const int32_t* table = block_tables + seq * table_stride;
        const int64_t first = i * span_keys, n = std::min(span_keys, lens[seq] - first);  // keys in the context
        for (int64_t t = 0; t < n; ++t) {
          const T* k = key_cache + table[(first + t) / bs] * stride_block + (first + t) % bs * stride_slot +
                       h * stride_head;
          for (int64_t d = 0; d < D; ++d) kt[d * turned.width + t] = static_cast<float>(k[d]);
        }
        for (int64_t d = 0; d < D; ++d) std::fill(kt + d * turned.width + n, kt + (d + 1) * turned.width, 0.f);
      }
    });
  }

  void run(const Tile& tile, const Tile* next, Scratch& s) const {
    const int64_t D = head_dim, G = tile.num_kv_heads * group, bs = block_size;
    // The walk takes `span` blocks a step: one at decode; at prefill enough for kSpanKeys keys, so that each row's
    // softmax bookkeeping (a maximum, exponentials, sums across lanes) is paid once for many keys.
    const bool keys_in_lanes = turned != nullptr;  // prefill: scores from the turned keys, V read where it lies
    const int64_t span = keys_in_lanes ? turned->span : 1, span_keys = span * bs;
    const int64_t kv_stride = span_keys + 3;
    const int64_t rows = tile.num_tokens * G;                       // row r: token r / G, query head r % G
    const int64_t last_pos = tile.first_pos + tile.num_tokens - 1;   // the last key any row of the tile sees
    const int64_t num_blocks = last_pos / bs + 1;                    // the blocks the tile walks
    const int64_t width = keys_in_lanes ? turned->width : 0;
    const int64_t padded_rows = (rows + 3) / 4 * 4;                  // rows of zero queries fill the last four
    s.q.assign(padded_rows * D, 0.f);
    s.acc.assign(padded_rows * D, 0.f);
    s.m.assign(rows, -std::numeric_limits<float>::infinity());     // running maximum of each row's scores
    s.l.assign(rows, 0.f);                                          // running sum of exp(score - m)
    const int64_t p_stride = std::max((span_keys + 3) / 4 * 4, width);  // room for the last four keys, or vector
    s.p.resize(padded_rows * p_stride);                             // one step's scores, then weights
    if (!keys_in_lanes) s.k_rows.resize(tile.num_kv_heads * span_keys * D);  // prefill reads the turned keys
    s.v_rows.resize(tile.num_kv_heads * span_keys * D);
    s.k.resize(tile.num_kv_heads * kv_stride);
    s.v.resize(tile.num_kv_heads * kv_stride);
    const float** k = s.k.data();
    const float** v = s.v.data();
    for (int64_t r = 0; r < rows; ++r) {                            // the scale is folded into the queries
      const T* q = query + (tile.token + r / G) * q_stride_token + (tile.kv_head * group + r % G) * q_stride_head;
      for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = static_cast<float>(q[d]) * scale;
    }
    const int32_t* table = block_tables + tile.seq * table_stride;
    for (int64_t j = 0; j < num_blocks; j += span) {               // blocks j .. j_end - 1
      const int64_t j_end = std::min(j + span, num_blocks), start = j * bs;
      const int64_t n = std::min(span_keys, last_pos + 1 - start);  // the last block may be partly filled
      // Block j_end travels while these are computed; during the last step, the first block of the thread's next tile.
      const bool last_block = j_end == num_blocks;
      const Tile* ahead_tile = last_block ? next : &tile;
      Prefetch ahead;
      if (ahead_tile != nullptr) {
        const int64_t at = block_tables[ahead_tile->seq * table_stride + (last_block ? 0 : j_end)] * stride_block +
                           ahead_tile->kv_head * stride_head;
        const T* k_rows = keys_in_lanes ? nullptr : key_cache + at;  // at prefill the turned keys are read instead
        ahead = Prefetch(k_rows, value_cache + at, bs, stride_slot, ahead_tile->num_kv_heads * D);
      }
      // A third of its lines are requested among the scores, the rest before each row's weighted sum of V: spread
      // over the whole block's work, not bunched in its first part, the requests keep the memory busy throughout.
      const int64_t score_calls = keys_in_lanes ? padded_rows / 4 : rows * ((n + 3) / 4);
      const int64_t lines_among_scores = ahead.lines() / 3;
      const int64_t lines_per_call = (lines_among_scores + score_calls - 1) / score_calls;
      const int64_t lines_per_row = (ahead.lines() - lines_among_scores + rows - 1) / rows;
      for (int64_t b = j; b < j_end; ++b) {
        const int64_t physical = table[b];                          // the indirection: one int32 per block
        const int64_t first = (b - j) * bs, keys = std::min(bs, n - first);  // its keys in this step
        for (int64_t h = 0; h < tile.num_kv_heads; ++h) {
          const T* k_block = key_cache + physical * stride_block + (tile.kv_head + h) * stride_head;
          const T* v_block = value_cache + physical * stride_block + (tile.kv_head + h) * stride_head;
          for (int64_t t = 0; t < keys; ++t) {                      // K and V rows, read where they lie
            const int64_t i = h * kv_stride + first + t, row = (h * span_keys + first + t) * D;
            if (!keys_in_lanes) k[i] = as_float(k_block + t * stride_slot, s.k_rows.data() + row, D);
            v[i] = as_float(v_block + t * stride_slot, s.v_rows.data() + row, D);
          }
        }
      }
      if (!keys_in_lanes)
        for (int64_t h = 0; h < tile.num_kv_heads; ++h)
          for (int64_t t = n; t < n + 3; ++t) k[h * kv_stride + t] = k[h * kv_stride];  // pads the last four keys
      // scores = q . k for every row and key of the step: at prefill, four rows at a time against the turned
      // keys; at decode, where a tile has a few rows, each row against four keys at a time
      if (keys_in_lanes)
        for (int64_t r = 0; r < rows; r += 4)
          scores4(s.q.data() + r * D, D, turned->step(tile.seq, tile.kv_head, j / span, D), D, width,
                  (n + kLanes - 1) / kLanes * kLanes, s.p.data() + r * p_stride, p_stride),
              ahead.issue(lines_per_call);
      else
        for (int64_t t = 0; t < n; t += 4)
          for (int64_t r = 0; r < rows; ++r)
            dot4(s.q.data() + r * D, k + (r % G) / group * kv_stride + t, D, s.p.data() + r * p_stride + t),
                ahead.issue(lines_per_call);
      for (int64_t r = 0; r < rows; ++r) {
        // keys after the row's own position are masked (only in a prefill tile's last blocks)
        const int64_t visible = std::clamp<int64_t>(tile.first_pos + r / G - start + 1, 0, n);
        float* p = s.p.data() + r * p_stride;
        std::fill(p + visible, p + n, -std::numeric_limits<float>::infinity());
        // online softmax: raise the row's maximum, rescale what was summed under the old one
        const float m_new = std::fmax(s.m[r], max_of(p, n));       // finite: every row sees key 0 in block 0
        const float alpha = std::exp(s.m[r] - m_new);              // 0 at the first block, 1 if m did not rise
        s.l[r] = s.l[r] * alpha + exp_and_sum(p, m_new, n);
        float* acc = s.acc.data() + r * D;
        if (alpha != 1.f) rescale(alpha, acc, D);
        s.m[r] = m_new;
        ahead.issue(lines_per_row);
        if (!keys_in_lanes) weighted_sum(p, v + (r % G) / group * kv_stride, visible, acc, D);  // acc += p @ V
      }
      if (keys_in_lanes)  // acc += p @ V four rows at a time: a masked key weighs exactly 0; padding rows are dropped
        for (int64_t r = 0; r < rows; r += 4)
          weighted_sum4(s.p.data() + r * p_stride, p_stride, v, n, s.acc.data() + r * D, D, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* o = out + (tile.token + r / G) * num_heads * D + (tile.kv_head * group + r % G) * D;
      const float inv_l = 1.f / s.l[r];
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(s.acc[r * D + d] * inv_l);
    }
  }
};

// Run every tile on torch's thread pool, longest first, each thread taking the next tile as it needs one.
template <typename T>
void run_tiles(const PagedAttention<T>& attention, std::vector<Tile>& tiles) {
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  int64_t work = 0;
  for (const Tile& tile : tiles) work += tile.cost;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / kWorkPerThread));
  // With two tiles or more for every thread, a thread claims its next tile as it starts one, so that the next tile's
  // first block can travel while this one ends; with fewer, a claimed tile could wait while another thread idles.
  const bool claim_ahead = tiles.size() >= 2 * static_cast<size_t>(threads);
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (size_t i = next++; i < tiles.size();) {
      const size_t following = claim_ahead ? next++ : tiles.size();
      attention.run(tiles[i], following < tiles.size() ? &tiles[following] : nullptr, scratch);
      i = claim_ahead ? following : next++;
    }
  });
}

void check_pool(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache) {
  TORCH_CHECK_VALUE(query.dim() == 3 && key_cache.dim() == 4, "query must be 3-D and key_cache 4-D");
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes() && value_cache.strides() == key_cache.strides(),
                    "value_cache must have key_cache's shape and strides");
  TORCH_CHECK_VALUE(query.scalar_type() == key_cache.scalar_type() &&
                        value_cache.scalar_type() == key_cache.scalar_type(),
                    "query, key_cache and value_cache must have one dtype");
  TORCH_CHECK_VALUE(query.size(2) == key_cache.size(3), "query and key_cache must have one head_dim");
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK_VALUE(query.stride(2) == 1 && key_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK_VALUE(key_cache.size(1) > 0, "block_size must be positive");
}

// Every sequence's context fits its table, and every table entry it uses names a block of the pool.
void check_tables(const Tensor& block_tables, const Tensor& context_lens, int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                        (block_tables.size(1) <= 1 || block_tables.stride(1) == 1),
                    "block_tables must be int32 [num_seqs, max_blocks_per_seq] with contiguous rows");
  TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
                        context_lens.size(0) == block_tables.size(0),
                    "context_lens must be int32 [num_seqs]");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t seq = 0; seq < context_lens.size(0); ++seq) {
    TORCH_CHECK_VALUE(lens[seq] >= 0 && lens[seq] <= block_tables.size(1) * block_size, "context_lens[", seq,
                      "] = ", lens[seq], " does not fit its block table");
    for (int64_t j = 0; j < (lens[seq] + block_size - 1) / block_size; ++j) {
      const int32_t block = tables[seq * block_tables.stride(0) + j];
      TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", seq, ", ", j, "] = ", block,
                        " is outside the pool [0, ", num_blocks, ")");
    }
  }
}

template <typename T>
PagedAttention<T> describe(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                           const Tensor& block_tables, const Tensor& out, double scale) {
  return PagedAttention<T>{query.data_ptr<T>(),        query.stride(0),         query.stride(1),
                           key_cache.data_ptr<T>(),    value_cache.data_ptr<T>(), key_cache.stride(0),
                           key_cache.stride(1),        key_cache.stride(2),     block_tables.data_ptr<int32_t>(),
                           block_tables.stride(0),     out.data_ptr<T>(),       query.size(1),
                           key_cache.size(1),          query.size(1) / key_cache.size(2),
                           query.size(2),              static_cast<float>(scale),
                           nullptr};
}

// One new token per sequence (the last of its context) attends to the whole context.
Tensor decode(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
              const Tensor& context_lens_in, double scale) {
  check_pool(query, key_cache, value_cache);
  const Tensor context_lens = context_lens_in.contiguous();
  check_tables(block_tables, context_lens, key_cache.size(0), key_cache.size(1));
  TORCH_CHECK_VALUE(query.size(0) == context_lens.size(0), "query must have one row per sequence");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_kv_heads = key_cache.size(2), group = query.size(1) / num_kv_heads;
  std::vector<Tile> tiles;
  // A tile per (sequence, KV head), as the Triton kernel's grid; with sequences enough to share among the threads,
  // a tile per sequence, which reads each block front to back (all its heads) instead of in strided slices.
  const int64_t kv_per_tile = query.size(0) >= kSeqsPerThread * at::get_num_threads() ? num_kv_heads : 1;
  for (int64_t seq = 0; seq < query.size(0); ++seq) {
    TORCH_CHECK_VALUE(lens[seq] >= 1, "context_lens must be >= 1 at decode");
    for (int64_t h = 0; h < num_kv_heads; h += kv_per_tile)
      tiles.push_back({seq, h, kv_per_tile, seq, 1, lens[seq] - 1, kv_per_tile * group * lens[seq]});
  }
  Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_decode_cpu", [&] {
    run_tiles(describe<scalar_t>(query, key_cache, value_cache, block_tables, out, scale), tiles);
  });
  return out;
}

// A chunk of new tokens per sequence (the last query_len of its context) attends causally to the context.
Tensor prefill(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
               const Tensor& query_start_loc_in, const Tensor& context_lens_in, double scale) {
  check_pool(query, key_cache, value_cache);
  const Tensor context_lens = context_lens_in.contiguous(), query_start_loc = query_start_loc_in.contiguous();
  check_tables(block_tables, context_lens, key_cache.size(0), key_cache.size(1));
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK_VALUE(query_start_loc.scalar_type() == at::kInt && query_start_loc.dim() == 1 &&
                        query_start_loc.size(0) == num_seqs + 1,
                    "query_start_loc must be int32 [num_seqs + 1]");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(starts[0] == 0 && starts[num_seqs] == query.size(0),
                    "query_start_loc must rise from 0 to num_tokens");
  const int64_t num_kv_heads = key_cache.size(2), group = query.size(1) / num_kv_heads;
  std::vector<Tile> tiles;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t query_len = starts[seq + 1] - starts[seq];
    TORCH_CHECK_VALUE(query_len >= 0 && query_len <= lens[seq],
                      "query_start_loc must not fall, and context_lens must count the new tokens");
    for (int64_t begin = 0; begin < query_len; begin += kQueryTile) {
      const int64_t num_tokens = std::min(kQueryTile, query_len - begin);
      const int64_t first_pos = lens[seq] - query_len + begin;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        tiles.push_back({seq, h, 1, starts[seq] + begin, num_tokens, first_pos,
                         num_tokens * group * (first_pos + num_tokens)});
    }
  }
  Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_prefill_cpu", [&] {
    PagedAttention<scalar_t> attention = describe<scalar_t>(query, key_cache, value_cache, block_tables, out, scale);
    TurnedKeys turned;
    attention.turn_keys(turned, lens, starts, num_seqs, num_kv_heads);
    attention.turned = &turned;
    run_tiles(attention, tiles);
  });
  return out;
}

// Write one step's K and V rows into the pool at their slots.
void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping_in) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                        value_cache.strides() == key_cache.strides(),
                    "key_cache and value_cache must be 4-D with one shape and strides");
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == key_cache.size(2) &&
                        key.size(2) == key_cache.size(3),
                    "key and value must be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK_VALUE(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                        value_cache.scalar_type() == key_cache.scalar_type(),
                    "key, value and the caches must have one dtype");
  TORCH_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1,
                    "head_dim must be contiguous");
  const Tensor slots = slot_mapping_in.to(at::kLong).contiguous();
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == key.size(0), "slot_mapping must be [num_tokens]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  for (int64_t i = 0; i < slots.size(0); ++i)
    TORCH_CHECK_VALUE(slot[i] >= -1 && slot[i] < num_slots, "slot_mapping[", i, "] = ", slot[i],
                      " is outside [-1, ", num_slots, ")");
  const int64_t num_kv_heads = key.size(1), D = key.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "reshape_and_cache_cpu", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, slots.size(0), 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (slot[i] < 0) continue;
        const int64_t at_slot = slot[i] / block_size * key_cache.stride(0) + slot[i] % block_size * key_cache.stride(1);
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          std::copy_n(k + i * key.stride(0) + h * key.stride(1), D, kc + at_slot + h * key_cache.stride(2));
          std::copy_n(v + i * value.stride(0) + h * value.stride(1), D, vc + at_slot + h * key_cache.stride(2));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(paged_cpu, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
  m.def("prefill(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(paged_cpu, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("decode", &decode);
  m.impl("prefill", &prefill);
}
