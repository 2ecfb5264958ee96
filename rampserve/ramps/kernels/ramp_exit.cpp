// An early-exit ramp as a single operator for the compiled serving path.
//
// A ramp's arithmetic is small (a few thousand to a few tens of thousands of multiply-adds per input); what it
// costs on the serving path as torch operators is their dispatch: pooling, flatten, linear, softmax, max, the
// comparison with the exit floor and its reduction to a bool each allocate a tensor and pass through the
// dispatcher, about a microsecond apiece against a 0.7 ms model. This operator does a whole ramp in one call
// and allocates nothing: it writes the ramp's logits into a column of the batch's buffer (Python scores them
// exactly as the eager path does, after the answers are out when nobody exits) and says whether any row's
// confidence clears the floor, in which case the runner returns to Python to release those rows.
//
//   ramp_exit(activation, pool, weight, bias, center, reduce, out, column, floor, score) -> bool
//     reduce 0 (flat):        features = x.flatten(1)
//     reduce 1 (first token): features = x[:, 0] of an (n, T, D) activation
//     reduce 2 (token mean):  features = x.mean(dim=1) of an (n, T, D) activation
//     reduce 4 (masked token mean): features = x.sum(dim=1) / (tokens whose row is not all zero), at least 1:
//                             the mean over an input's own tokens where the model zeroes padded positions
//     reduce 3 (pooled):      features = (x.reshape(n * C, H * W) @ pool).reshape(n, -1)[:, :C * cells] of an
//                             (n, C, H, W) activation, `pool` (H * W, cells rounded up to 16) holding a pooling's
//                             weights (one channel's), zero beyond its cells
//     logits = (features - center) @ weight.T + bias, weight (K, F), written to out[:, column, :]; the center
//     keeps the sums well conditioned (see `Ramp` in kinds.py)
//
// Pooling stays a step of its own rather than folded into the head's weight: folded, resnet18-fmnist's first
// ramp reads a 125 KB weight where pooling and head read 13 KB, and the model, whose weights barely fit the
// cache, ran 20-25 us slower at batch 1 for it (measured in warm runs, as a server runs a set batch after batch).
//
// score 0: confidence = max softmax probability; score 1: 1 - entropy / log(K), clamped to [0, 1]. Both are
// computed in double from the float32 logits, as Python scores them, so that the floor's margin only has to
// cover the difference between two double computations of the same numbers. `notify` < 0: no one listens.
//
//   stash(activation, into, column, notify) -> bool: for a ramp that runs in Python (a cache ramp, which learns
//     from every batch): copies the activation into `into` and notifies, so that the releasing thread evaluates
//     the ramp from the copy while the model runs on.
//
//   ramp_stop(activation, pool, weight, bias, center, reduce, out, rows, keep, left, column, floor, stop_floor,
//             score, notify) -> Tensor: the same ramp for a run whose inputs leave the batch where they exit (the
//     "stop" exit mode). The activation holds the rows still running, `rows` (int64) the batch row each one is;
//     their logits go to out[rows[i], column, :]. A row stops where its confidence exceeds `stop_floor` and
//     keep[rows[i]] (bool, per batch row) is false: left[rows[i]] (int64, per batch row) is set to `column`.
//     The pipe is written as ramp_exit writes it (some row's confidence clears `floor`), after the logits and
//     `left`. Returns the indices (int64, into the activation's rows, increasing) of the rows that go on.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kFlat = 0, kFirstToken = 1, kTokenMean = 2, kPooled = 3, kTokenMeanMasked = 4;
constexpr int64_t kMaxProb = 0, kEntropy = 1;

// Dot products of R rows with K weight rows at once, 16 lanes wide: each loaded vector serves several
// accumulators, and R * K independent sums keep the multiply-add units busy. GCC's vector extension compiles
// to whatever the CPU it is built on offers (-march=native: AVX-512 here; two AVX2 or four SSE operations per
// vector elsewhere). Function multiversioning (target_clones) instead kept the helpers from inlining into the
// clones and ran 2-3x slower.
typedef float lanes __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int kRowBlock = 4, kClassBlock = 4;
// Maps pooled at once: 8 independent sums hide the multiply-add's latency (4 maps ran 1.4x slower, 16 gained
// 10% more for twice the registers)
constexpr int kMapBlock = 8;

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int R, int K>
void dot_block(const float* x, int64_t x_stride, const float* center, const float* w,
                                int64_t features, float* out, int64_t out_stride) {
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

// Pools M maps at once: each activation value, broadcast, times its row of the pooling matrix (the cells it
// falls in, 16 at a time), so that every value costs one vector multiply-add whatever the map's size. Each map's
// cells are stored as whole vectors: the lanes past its last cell spill into the next map's cells, which are
// written after (maps go in order) or into the buffer's padding, where extracting lanes one by one cost more
// than the pooling on maps of a few positions.
template <int M>
void pool_maps(const float* x, int64_t positions, const float* pool, int64_t padded, float* out, int64_t cells) {
  for (int64_t chunk = 0; chunk < padded; chunk += kLanes) {
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
void matmul_rows(const float* x, int64_t rows, int64_t x_stride, const float* center, const float* w,
                 int64_t classes, int64_t features, float* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    dot_rows<kRowBlock>(x + r * x_stride, x_stride, center, w, classes, features, out + r * out_stride, out_stride);
  for (; r < rows; ++r)
    dot_rows<1>(x + r * x_stride, x_stride, center, w, classes, features, out + r * out_stride, out_stride);
}

double confidence(const float* logits, int64_t classes, int64_t score) {
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

// Whether any row of `logits` (rows of `classes`, `stride` apart) is more confident than `floor`. A floor of 1
// or more is never cleared: the ramp is active only for the record (threshold 0), so nothing is scored.
bool any_clears(const float* logits, int64_t rows, int64_t stride, int64_t classes, double floor, int64_t score) {
  if (floor >= 1.0) return false;
  for (int64_t r = 0; r < rows; ++r)
    if (confidence(logits + r * stride, classes, score) > floor) return true;
  return false;
}

// Tells the releasing thread that column `column` is ready. A full pipe or a reader gone loses nothing: the
// executor scores every column after the run and releases what is left then.
void notify_column(int64_t notify, int64_t column) {
  if (notify < 0) return;
  const unsigned char byte = static_cast<unsigned char>(column);
  ssize_t written;
  do written = ::write(static_cast<int>(notify), &byte, 1);
  while (written < 0 && errno == EINTR);
}

float* column_of(const at::Tensor& out, int64_t rows, int64_t column, int64_t classes) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == rows &&
                  column >= 0 && column < out.size(1) && out.size(2) == classes,
              "the ramp buffer must be a contiguous float32 (rows, sites, classes) tensor with a column ", column);
  return out.data_ptr<float>() + column * classes;
}

// Checks a ramp's arguments; returns its activation, contiguous
at::Tensor checked_activation(const char* op, const at::Tensor& activation, const at::Tensor& pool,
                              const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& center,
                              int64_t reduce) {
  TORCH_CHECK(activation.scalar_type() == at::kFloat && activation.dim() >= 2,
              op, " takes a float32 activation with a batch dimension");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == weight.size(0),
              op, " takes a contiguous float32 (classes, features) weight and a (classes,) bias");
  TORCH_CHECK(center.scalar_type() == at::kFloat && center.is_contiguous() && center.numel() == weight.size(1),
              op, " takes a contiguous float32 center of the head's width");
  TORCH_CHECK(reduce >= kFlat && reduce <= kTokenMeanMasked, op, ": unknown reduction ", reduce);
  TORCH_CHECK(reduce == kFlat || activation.dim() == (reduce == kPooled ? 4 : 3),
              op, ": reduction ", reduce, " does not take an activation of rank ", activation.dim());
  const at::Tensor x = activation.contiguous();
  const int64_t features = weight.size(1);
  int64_t reduced = reduce == kFlat ? x.numel() / std::max<int64_t>(x.size(0), 1) : x.size(2);
  if (reduce == kPooled) {
    TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.is_contiguous() && pool.dim() == 2 &&
                    pool.size(0) == x.size(2) * x.size(3) && pool.size(1) % kLanes == 0,
                op, ": the pooling matrix must be contiguous float32 (H * W, cells rounded up to 16)");
    const int64_t cells = features / x.size(1);
    TORCH_CHECK(cells * x.size(1) == features && cells <= pool.size(1),
                op, ": the head's width is not the activation's channels times the pooled cells");
    reduced = features;
  }
  TORCH_CHECK(reduced == features, op, ": the reduced activation has ", reduced, " features, the head takes ",
              features);
  return x;
}

// The ramp's logits for every row of `x` (checked by `checked_activation`): row r's at target + r * out_stride
void write_logits(const at::Tensor& x, const at::Tensor& pool, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& center, int64_t reduce, float* target, int64_t out_stride) {
  const int64_t rows = x.size(0), classes = weight.size(0), features = weight.size(1);
  const int64_t row_size = x.numel() / std::max<int64_t>(rows, 1);
  const float* data = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  const float* c = center.data_ptr<float>();
  if (reduce == kPooled) {
    thread_local std::vector<float> pooled;
    const int64_t cells = features / x.size(1);
    const int64_t maps = rows * x.size(1), positions = pool.size(0), padded = pool.size(1);
    pooled.resize(maps * cells + padded);  // room for the last map's spilled lanes
    const float* weights = pool.data_ptr<float>();
    int64_t m = 0;
    for (; m + kMapBlock <= maps; m += kMapBlock)
      pool_maps<kMapBlock>(data + m * positions, positions, weights, padded, pooled.data() + m * cells, cells);
    for (; m < maps; ++m)
      pool_maps<1>(data + m * positions, positions, weights, padded, pooled.data() + m * cells, cells);
    matmul_rows(pooled.data(), rows, features, c, w, classes, features, target, out_stride);
  } else if (reduce == kTokenMean || reduce == kTokenMeanMasked) {
    thread_local std::vector<float> means;
    means.assign(rows * features, 0.0f);
    const int64_t tokens = x.size(1);
    for (int64_t r = 0; r < rows; ++r) {
      float* mean = means.data() + r * features;
      int64_t present = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* token = data + r * row_size + t * features;
        bool nonzero = false;
        for (int64_t d = 0; d < features; ++d) {
          mean[d] += token[d];
          nonzero = nonzero || token[d] != 0.0f;
        }
        present += nonzero;
      }
      const int64_t count = reduce == kTokenMean ? tokens : std::max<int64_t>(present, 1);
      for (int64_t d = 0; d < features; ++d) mean[d] /= static_cast<float>(count);
    }
    matmul_rows(means.data(), rows, features, c, w, classes, features, target, out_stride);
  } else {  // flat rows, or the first token, which leads each row
    matmul_rows(data, rows, row_size, c, w, classes, features, target, out_stride);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < classes; ++k) target[r * out_stride + k] += b[k];
}

bool ramp_exit(const at::Tensor& activation, const at::Tensor& pool, const at::Tensor& weight,
               const at::Tensor& bias, const at::Tensor& center, int64_t reduce, const at::Tensor& out,
               int64_t column, double floor, int64_t score, int64_t notify) {
  const at::Tensor x = checked_activation("ramp_exit", activation, pool, weight, bias, center, reduce);
  const int64_t rows = x.size(0), classes = weight.size(0);
  float* target = column_of(out, rows, column, classes);
  const int64_t out_stride = out.size(1) * classes;
  write_logits(x, pool, weight, bias, center, reduce, target, out_stride);
  const bool exits = any_clears(target, rows, out_stride, classes, floor, score);
  if (exits) notify_column(notify, column);
  return exits;
}

at::Tensor ramp_stop(const at::Tensor& activation, const at::Tensor& pool, const at::Tensor& weight,
                     const at::Tensor& bias, const at::Tensor& center, int64_t reduce, const at::Tensor& out,
                     const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& left, int64_t column,
                     double floor, double stop_floor, int64_t score, int64_t notify) {
  const at::Tensor x = checked_activation("ramp_stop", activation, pool, weight, bias, center, reduce);
  const int64_t running = x.size(0), classes = weight.size(0), batch = out.dim() > 0 ? out.size(0) : 0;
  float* target = column_of(out, batch, column, classes);
  const int64_t out_stride = out.size(1) * classes;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == running,
              "ramp_stop: `rows` must be contiguous int64, one per row of the activation");
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.is_contiguous() && keep.numel() == batch &&
                  left.scalar_type() == at::kLong && left.is_contiguous() && left.numel() == batch,
              "ramp_stop: `keep` (bool) and `left` (int64) must be contiguous, one per row of the batch");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < running; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < batch, "ramp_stop: row ", row[i], " is not a row of the batch");
  thread_local std::vector<float> logits;
  logits.resize(running * classes);
  write_logits(x, pool, weight, bias, center, reduce, logits.data(), classes);
  const bool* kept = keep.data_ptr<bool>();
  int64_t* leaves = left.data_ptr<int64_t>();
  at::Tensor going = at::empty({running}, rows.options());
  int64_t* goes = going.data_ptr<int64_t>();
  int64_t count = 0;
  bool clears = false;
  const bool scores = std::min(floor, stop_floor) < 1.0;  // else no row can clear either (see any_clears)
  for (int64_t i = 0; i < running; ++i) {
    float* to = target + row[i] * out_stride;
    std::memcpy(to, logits.data() + i * classes, classes * sizeof(float));
    if (scores) {
      const double sure = confidence(to, classes, score);
      clears = clears || sure > floor;
      if (sure > stop_floor && !kept[row[i]]) {
        leaves[row[i]] = column;
        continue;
      }
    }
    goes[count++] = i;
  }
  if (clears) notify_column(notify, column);
  return count == running ? going : going.narrow(0, 0, count);
}

bool stash(const at::Tensor& activation, const at::Tensor& into, int64_t column, int64_t notify) {
  TORCH_CHECK(into.scalar_type() == activation.scalar_type(), "stash: the buffer must have the activation's type");
  const at::Tensor x = activation.contiguous();
  if (into.sizes() != x.sizes()) {
    // Its storage grows only. Once Python has read it as an array its storage cannot be resized (torch keeps the
    // array's memory valid): a larger one replaces it then, the array keeping the old one alive. In release mode
    // a site's activation has the same shape batch after batch; in stop mode it has the rows still running
    if (into.storage().resizable() || into.storage().nbytes() >= x.nbytes())
      into.resize_(x.sizes());
    else
      into.set_(at::empty(x.sizes(), x.options()));
  }
  std::memcpy(into.data_ptr(), x.data_ptr(), x.nbytes());
  notify_column(notify, column);
  return true;
}

}  // namespace

TORCH_LIBRARY(rampserve, m) {
  m.def("ramp_exit(Tensor activation, Tensor pool, Tensor weight, Tensor bias, Tensor center, int reduce, "
        "Tensor(a!) out, int column, float floor, int score, int notify) -> bool",
        ramp_exit);
  m.def("ramp_stop(Tensor activation, Tensor pool, Tensor weight, Tensor bias, Tensor center, int reduce, "
        "Tensor(a!) out, Tensor rows, Tensor keep, Tensor(b!) left, int column, float floor, float stop_floor, "
        "int score, int notify) -> Tensor",
        ramp_stop);
  m.def("stash(Tensor activation, Tensor(a!) into, int column, int notify) -> bool", stash);
}
