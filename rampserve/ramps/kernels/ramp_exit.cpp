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
//     the ramp's logits (reductions and head as ramp_math.h computes them) written to out[:, column, :]; `pool`
//     is a pooling ramp's matrix, empty for another reduction; `score` the error score of ramp_math.h.
//     `notify` < 0: no one listens.
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

#include <cstdint>
#include <cstring>
#include <vector>

#include "ramp_math.h"

namespace {

using ramp_math::any_clears;
using ramp_math::confidence;
using ramp_math::notify_column;

float* column_of(const at::Tensor& out, int64_t rows, int64_t column, int64_t classes) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == rows &&
                  column >= 0 && column < out.size(1) && out.size(2) == classes,
              "the ramp buffer must be a contiguous float32 (rows, sites, classes) tensor with a column ", column);
  return out.data_ptr<float>() + column * classes;
}

// A ramp's arguments as ramp_math.h reads them, checked; `x` is the activation made contiguous, which they point into
struct Checked {
  at::Tensor x;
  ramp_math::Activation activation;
  ramp_math::Head head;
};

Checked checked(const char* op, const at::Tensor& activation, const at::Tensor& pool, const at::Tensor& weight,
                const at::Tensor& bias, const at::Tensor& center, int64_t reduce) {
  TORCH_CHECK(activation.scalar_type() == at::kFloat, op, " takes a float32 activation");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                  bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == weight.size(0),
              op, " takes a contiguous float32 (classes, features) weight and a (classes,) bias");
  TORCH_CHECK(center.scalar_type() == at::kFloat && center.is_contiguous() && center.numel() == weight.size(1),
              op, " takes a contiguous float32 center of the head's width");
  const bool pools = reduce == ramp_math::kPooled;
  TORCH_CHECK(!pools || (pool.scalar_type() == at::kFloat && pool.is_contiguous() && pool.dim() == 2),
              op, ": the pooling matrix must be contiguous float32");
  Checked out{activation.contiguous(), {}, {}};
  out.activation = {out.x.data_ptr<float>(), out.x.sizes().vec()};
  out.head = {weight.data_ptr<float>(), bias.data_ptr<float>(), center.data_ptr<float>(), weight.size(0),
              weight.size(1), pools ? pool.data_ptr<float>() : nullptr, pools ? pool.size(0) : 0,
              pools ? pool.size(1) : 0};
  const std::string error = ramp_math::argument_error(out.activation, out.head, reduce);
  TORCH_CHECK(error.empty(), op, ": ", error);
  return out;
}

bool ramp_exit(const at::Tensor& activation, const at::Tensor& pool, const at::Tensor& weight,
               const at::Tensor& bias, const at::Tensor& center, int64_t reduce, const at::Tensor& out,
               int64_t column, double floor, int64_t score, int64_t notify) {
  const Checked ramp = checked("ramp_exit", activation, pool, weight, bias, center, reduce);
  const int64_t rows = ramp.x.size(0), classes = weight.size(0);
  float* target = column_of(out, rows, column, classes);
  const int64_t out_stride = out.size(1) * classes;
  ramp_math::write_logits(ramp.activation, ramp.head, reduce, target, out_stride);
  const bool exits = any_clears(target, rows, out_stride, classes, floor, score);
  if (exits) notify_column(notify, column);
  return exits;
}

at::Tensor ramp_stop(const at::Tensor& activation, const at::Tensor& pool, const at::Tensor& weight,
                     const at::Tensor& bias, const at::Tensor& center, int64_t reduce, const at::Tensor& out,
                     const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& left, int64_t column,
                     double floor, double stop_floor, int64_t score, int64_t notify) {
  const Checked ramp = checked("ramp_stop", activation, pool, weight, bias, center, reduce);
  const int64_t running = ramp.x.size(0), classes = weight.size(0), batch = out.dim() > 0 ? out.size(0) : 0;
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
  ramp_math::write_logits(ramp.activation, ramp.head, reduce, logits.data(), classes);
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
