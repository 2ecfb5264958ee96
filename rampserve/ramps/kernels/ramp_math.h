// A linear ramp's arithmetic over plain arrays, shared by the ramp operator for torch (ramp_exit.cpp) and the one for
// ONNX Runtime (ramp_head_onnx.cpp): the two must compute the same logits and confidences, so they compute them here.
//
//   reduce 0 (flat):        features = x.flatten(1)
//   reduce 1 (first token): features = x[:, 0] of an (n, T, D) activation
//   reduce 2 (token mean):  features = x.mean(dim=1) of an (n, T, D) activation
//   reduce 4 (masked token mean): features = x.sum(dim=1) / (tokens whose row is not all zero), at least 1: the
//                           mean over an input's own tokens where the model zeroes padded positions
//   reduce 3 (pooled):      features = (x.reshape(n * C, H * W) @ pool).reshape(n, -1)[:, :C * cells] of an
//                           (n, C, H, W) activation, `pool` (H * W, cells rounded up to 16) holding a pooling's
//                           weights (one channel's), zero beyond its cells
//   logits = (features - center) @ weight.T + bias, weight (K, F); the center keeps the sums well conditioned (see
//   `Ramp` in kinds.py)
//
// Pooling stays a step of its own rather than folded into the head's weight: folded, resnet18-fmnist's first ramp
// reads a 125 KB weight where pooling and head read 13 KB, and the model, whose weights barely fit the cache, ran
// 20-25 us slower at batch 1 for it (measured in warm runs, as a server runs a set batch after batch).
//
// score 0: confidence = max softmax probability; score 1: 1 - entropy / log(K), clamped to [0, 1]. Both are computed
// in double from the float32 logits, as Python scores them, so that the floor's margin only has to cover the
// difference between two double computations of the same numbers.

#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ramp_math {

constexpr int64_t kFlat = 0, kFirstToken = 1, kTokenMean = 2, kPooled = 3, kTokenMeanMasked = 4;
constexpr int64_t kMaxProb = 0, kEntropy = 1;

// Dot products of R rows with K weight rows at once, a machine vector wide: each loaded vector serves several
// accumulators, and R * K independent sums keep the multiply-add units busy. GCC's vector extension compiles to
// the CPU it is built for (-march=native), at the width of its registers: vectors of 16 floats, wider than an AVX2
// machine's, ran 4-9x slower there (the token mean of 44 tokens of 384: 15.3 us against 1.8; a (4096, 10) head 13.5
// us against 3.5). Function multiversioning (target_clones) instead kept the helpers from inlining into the clones
// and ran 2-3x slower. A pooling matrix's cells are padded to 16 (`kernel_args.LANES`), a multiple of every width.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float lanes __attribute__((vector_size(kLanes * sizeof(float))));
constexpr int kRowBlock = 4, kClassBlock = 4;
// Maps pooled at once: 8 independent sums hide the multiply-add's latency (4 maps ran 1.4x slower, 16 gained 10%
// more for twice the registers)
constexpr int kMapBlock = 8;

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int R, int K>
void dot_block(const float* x, int64_t x_stride, const float* center, const float* w, int64_t features, float* out,
               int64_t out_stride) {
  lanes sums[R][K] = {};
  int64_t i = 0;
  for (; i + kLanes <= features; i += kLanes) {
    const lanes c = load(center + i);
    lanes xs[R];
    for (int r = 0; r < R; ++r) xs[r] = load(x + r * x_stride + i) - c;
    for (int k = 0; k < K; ++k) {
      const lanes wk = load(w + k * features + i);
      for (int r = 0; r < R; ++r) sums[r][k] += xs[r] * wk;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; ++k) {
      float total = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) total += sums[r][k][l];
      for (int64_t j = i; j < features; ++j) total += (x[r * x_stride + j] - center[j]) * w[k * features + j];
      out[r * out_stride + k] = total;
    }
  }
}

// Pools M maps at once: each activation value, broadcast, times its row of the pooling matrix (the cells it falls
// in, a vector at a time), so that every value costs one vector multiply-add whatever the map's size. Each map's
// cells are stored as whole vectors: the lanes past its last cell spill into the next map's first cells or into the
// buffer's padding, where extracting lanes one by one cost more than the pooling on maps of a few positions. The
// vectors go last first, so that every spill is written over by the vector that holds those cells: a map's last
// vector (the only one that spills) before any map's first, and maps in order.
template <int M>
void pool_maps(const float* x, int64_t positions, const float* pool, int64_t padded, float* out, int64_t cells) {
  for (int64_t chunk = (cells - 1) / kLanes * kLanes; chunk >= 0; chunk -= kLanes) {
    lanes sums[M] = {};
    for (int64_t p = 0; p < positions; ++p) {
      const lanes weights = load(pool + p * padded + chunk);
      for (int m = 0; m < M; ++m) sums[m] += x[m * positions + p] * weights;
    }
    for (int m = 0; m < M; ++m) std::memcpy(out + m * cells + chunk, &sums[m], sizeof(lanes));
  }
}

template <int R>
void dot_rows(const float* x, int64_t x_stride, const float* center, const float* w, int64_t classes,
              int64_t features, float* out, int64_t out_stride) {
  int64_t k = 0;
  for (; k + kClassBlock <= classes; k += kClassBlock)
    dot_block<R, kClassBlock>(x, x_stride, center, w + k * features, features, out + k, out_stride);
  const float* rest = w + k * features;
  switch (classes - k) {
    case 3: dot_block<R, 3>(x, x_stride, center, rest, features, out + k, out_stride); break;
    case 2: dot_block<R, 2>(x, x_stride, center, rest, features, out + k, out_stride); break;
    case 1: dot_block<R, 1>(x, x_stride, center, rest, features, out + k, out_stride); break;
    default: break;
  }
}

// out[r * out_stride + k] = sum_i (x[r * x_stride + i] - center[i]) * w[k * features + i], every row and class
inline void matmul_rows(const float* x, int64_t rows, int64_t x_stride, const float* center, const float* w,
                        int64_t classes, int64_t features, float* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    dot_rows<kRowBlock>(x + r * x_stride, x_stride, center, w, classes, features, out + r * out_stride, out_stride);
  for (; r < rows; ++r)
    dot_rows<1>(x + r * x_stride, x_stride, center, w, classes, features, out + r * out_stride, out_stride);
}

// sum += token, a whole vector at a time; whether any of the token's values is not zero (a padded position's are
// all zero). Tested value by value with a short-circuit, the loop did not vectorize.
inline bool add_token(const float* token, int64_t features, float* sum) {
  typedef int32_t mask __attribute__((vector_size(sizeof(lanes))));
  mask nonzero = {};
  int64_t d = 0;
  for (; d + kLanes <= features; d += kLanes) {
    const lanes value = load(token + d);
    const lanes total = load(sum + d) + value;
    std::memcpy(sum + d, &total, sizeof(total));
    mask bits;  // a value is not zero where its bits but the sign are not
    std::memcpy(&bits, &value, sizeof(bits));
    nonzero |= bits & 0x7fffffff;
  }
  bool any = false;
  for (int64_t l = 0; l < kLanes; ++l) any = any || nonzero[l] != 0;
  for (; d < features; ++d) {
    sum[d] += token[d];
    any = any || token[d] != 0.0f;
  }
  return any;
}

inline double confidence(const float* logits, int64_t classes, int64_t score) {
  double top = logits[0];
  for (int64_t k = 1; k < classes; ++k) top = std::max(top, static_cast<double>(logits[k]));
  double total = 0.0;
  for (int64_t k = 0; k < classes; ++k) total += std::exp(logits[k] - top);
  if (score == kMaxProb) return 1.0 / total;
  double entropy = 0.0;  // -sum p log p, with log p = l - top - log(total)
  const double log_total = std::log(total);
  for (int64_t k = 0; k < classes; ++k) {
    const double log_p = logits[k] - top - log_total;
    entropy -= std::exp(log_p) * log_p;
  }
  return 1.0 - std::clamp(entropy / std::log(static_cast<double>(classes)), 0.0, 1.0);
}

// Whether any row of `logits` (rows of `classes`, `stride` apart) is more confident than `floor`. A floor of 1 or
// more is never cleared: the ramp is active only for the record (threshold 0), so nothing is scored.
inline bool any_clears(const float* logits, int64_t rows, int64_t stride, int64_t classes, double floor,
                       int64_t score) {
  if (floor >= 1.0) return false;
  for (int64_t r = 0; r < rows; ++r)
    if (confidence(logits + r * stride, classes, score) > floor) return true;
  return false;
}

// Tells the releasing thread that column `column` is ready. A full pipe or a reader gone loses nothing: the executor
// scores every column after the run and releases what is left then.
inline void notify_column(int64_t notify, int64_t column) {
  if (notify < 0) return;
  const unsigned char byte = static_cast<unsigned char>(column);
  ssize_t written;
  do written = ::write(static_cast<int>(notify), &byte, 1);
  while (written < 0 && errno == EINTR);
}

// A ramp's activation (contiguous float32, rows first) by its shape
struct Activation {
  const float* data;
  std::vector<int64_t> shape;

  int64_t rows() const { return shape.empty() ? 0 : shape[0]; }
  int64_t row_size() const {
    int64_t size = 1;
    for (size_t i = 1; i < shape.size(); ++i) size *= shape[i];
    return size;
  }
};

// A linear head: weight (classes, features), bias (classes), center (features); for a pooling ramp the pooling
// matrix (positions, padded cells), else positions and padded 0
struct Head {
  const float* weight;
  const float* bias;
  const float* center;
  int64_t classes, features;
  const float* pool;
  int64_t positions, padded;
};

// What is wrong with a ramp's arguments, empty where nothing is (each operator raises it its own way)
inline std::string argument_error(const Activation& x, const Head& head, int64_t reduce) {
  const int64_t rank = static_cast<int64_t>(x.shape.size());
  if (rank < 2) return "a ramp takes an activation with a batch dimension";
  if (reduce < kFlat || reduce > kTokenMeanMasked) return "unknown reduction " + std::to_string(reduce);
  if (reduce != kFlat && rank != (reduce == kPooled ? 4 : 3))
    return "reduction " + std::to_string(reduce) + " does not take an activation of rank " + std::to_string(rank);
  int64_t reduced = reduce == kFlat ? x.row_size() : x.shape[2];
  if (reduce == kPooled) {
    if (head.positions != x.shape[2] * x.shape[3] || head.padded % kLanes != 0)
      return "the pooling matrix must be (H * W, cells rounded up to a multiple of " + std::to_string(kLanes) + ")";
    const int64_t cells = head.features / x.shape[1];
    if (cells * x.shape[1] != head.features || cells > head.padded)
      return "the head's width is not the activation's channels times the pooled cells";
    reduced = head.features;
  }
  if (reduced != head.features)
    return "the reduced activation has " + std::to_string(reduced) + " features, the head takes " +
           std::to_string(head.features);
  return "";
}

// The ramp's logits for every row of `x` (checked by `argument_error`): row r's at target + r * out_stride
inline void write_logits(const Activation& x, const Head& head, int64_t reduce, float* target, int64_t out_stride) {
  const int64_t rows = x.rows(), row_size = x.row_size(), classes = head.classes, features = head.features;
  if (reduce == kPooled) {
    thread_local std::vector<float> pooled;
    const int64_t cells = features / x.shape[1];
    const int64_t maps = rows * x.shape[1], positions = head.positions, padded = head.padded;
    pooled.resize(maps * cells + padded);  // room for the last map's spilled lanes
    int64_t m = 0;
    for (; m + kMapBlock <= maps; m += kMapBlock)
      pool_maps<kMapBlock>(x.data + m * positions, positions, head.pool, padded, pooled.data() + m * cells, cells);
    for (; m < maps; ++m)
      pool_maps<1>(x.data + m * positions, positions, head.pool, padded, pooled.data() + m * cells, cells);
    matmul_rows(pooled.data(), rows, features, head.center, head.weight, classes, features, target, out_stride);
  } else if (reduce == kTokenMean || reduce == kTokenMeanMasked) {
    thread_local std::vector<float> means;
    means.assign(rows * features, 0.0f);
    const int64_t tokens = x.shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      float* mean = means.data() + r * features;
      int64_t present = 0;
      for (int64_t t = 0; t < tokens; ++t)
        present += add_token(x.data + r * row_size + t * features, features, mean);
      const int64_t count = reduce == kTokenMean ? tokens : std::max<int64_t>(present, 1);
      for (int64_t d = 0; d < features; ++d) mean[d] /= static_cast<float>(count);
    }
    matmul_rows(means.data(), rows, features, head.center, head.weight, classes, features, target, out_stride);
  } else {  // flat rows, or the first token, which leads each row
    matmul_rows(x.data, rows, row_size, head.center, head.weight, classes, features, target, out_stride);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < classes; ++k) target[r * out_stride + k] += head.bias[k];
}

}  // namespace ramp_math
