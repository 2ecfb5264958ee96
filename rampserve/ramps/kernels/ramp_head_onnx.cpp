// A linear ramp as one ONNX Runtime operator: rampserve.RampHead.
//
// As ONNX nodes a ramp on a token site is fifteen of them (the masked token mean's Abs, ReduceMax, Greater, Cast,
// ReduceSum, Max, ReduceSum and Div, then Sub, Gemm, Softmax, ReduceMax), each paying ONNX Runtime's dispatch and,
// at two intra-op threads, a split across its pool whose halves wait on each other: on minilm-rt a set of two such
// ramps cost a final answer 5% of the model's run (1.057x at two threads, 1.023x at one). This operator does the
// ramp in one call on the thread that runs the node, with the arithmetic of the torch operator (ramp_math.h), so
// that both serving paths compute the same logits.
//
//   RampHead(activation, weight, bias, center[, pool]) -> (logits, confidence)
//     attributes `reduce` and `score` (ramp_math.h's codes); `pool` only for a pooling ramp (reduce 3).
//     logits (n, classes) float; confidence: the highest of any row (1 - error score), a float scalar, 0 for no row.
//
// Built without linking ONNX Runtime (ORT_API_MANUAL_INIT): the library takes the API from the `OrtApiBase` that
// RegisterCustomOps receives, so headers of one version serve with the newer runtime of the Python package.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ramp_math.h"

namespace {

constexpr const char* kDomain = "rampserve";
constexpr size_t kPoolInput = 4;

struct RampHeadKernel {
  RampHeadKernel(const OrtApi& api, const OrtKernelInfo* info) : api_(api) {
    Ort::ConstKernelInfo attributes(info);
    reduce_ = attributes.GetAttribute<int64_t>("reduce");
    score_ = attributes.GetAttribute<int64_t>("score");
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* raw) {
    try {
      Ort::KernelContext context(raw);
      const Ort::ConstValue x = context.GetInput(0), weight = context.GetInput(1), bias = context.GetInput(2),
                            center = context.GetInput(3);
      const std::vector<int64_t> weight_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
      if (weight_shape.size() != 2 || bias.GetTensorTypeAndShapeInfo().GetElementCount() != size_t(weight_shape[0]) ||
          center.GetTensorTypeAndShapeInfo().GetElementCount() != size_t(weight_shape[1]))
        return error("RampHead takes a (classes, features) weight, a (classes,) bias and a (features,) center");
      ramp_math::Head head{weight.GetTensorData<float>(), bias.GetTensorData<float>(), center.GetTensorData<float>(),
                           weight_shape[0], weight_shape[1], nullptr, 0, 0};
      if (reduce_ == ramp_math::kPooled) {
        const Ort::ConstValue pool = context.GetInputCount() > kPoolInput ? context.GetInput(kPoolInput)
                                                                          : Ort::ConstValue{nullptr};
        if (pool == nullptr) return error("RampHead with a pooling reduction takes its pooling matrix, input 5");
        const std::vector<int64_t> pool_shape = pool.GetTensorTypeAndShapeInfo().GetShape();
        if (pool_shape.size() != 2) return error("RampHead's pooling matrix must have rank 2");
        head.pool = pool.GetTensorData<float>();
        head.positions = pool_shape[0];
        head.padded = pool_shape[1];
      }
      const ramp_math::Activation activation{x.GetTensorData<float>(), x.GetTensorTypeAndShapeInfo().GetShape()};
      const std::string wrong = ramp_math::argument_error(activation, head, reduce_);
      if (!wrong.empty()) return error("RampHead: " + wrong);
      const int64_t rows = activation.rows();
      float* logits = context.GetOutput(0, {rows, head.classes}).GetTensorMutableData<float>();
      ramp_math::write_logits(activation, head, reduce_, logits, head.classes);
      double highest = 0.0;
      for (int64_t r = 0; r < rows; ++r)
        highest = std::max(highest, ramp_math::confidence(logits + r * head.classes, head.classes, score_));
      *context.GetOutput(1, nullptr, 0).GetTensorMutableData<float>() = static_cast<float>(highest);
      return nullptr;
    } catch (const Ort::Exception& exc) {
      return error(exc.what());
    }
  }

 private:
  OrtStatusPtr error(const std::string& message) const {
    return api_.CreateStatus(ORT_INVALID_ARGUMENT, message.c_str());
  }

  const OrtApi& api_;
  int64_t reduce_ = 0, score_ = 0;
};

struct RampHeadOp : Ort::CustomOpBase<RampHeadOp, RampHeadKernel, true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new RampHeadKernel(api, info);
      return nullptr;
    } catch (const Ort::Exception& exc) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, exc.what());
    }
  }
  const char* GetName() const { return "RampHead"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kPoolInput + 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == kPoolInput ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even say why: a runtime older than these headers
  Ort::InitApi(api);
  static const RampHeadOp op;
  // A domain must outlive every session registered with it; one per registration, kept for the process
  static std::mutex lock;
  static std::vector<Ort::CustomOpDomain> domains;
  try {
    Ort::CustomOpDomain domain{kDomain};
    domain.Add(&op);
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> held(lock);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& exc) {
    return api->CreateStatus(ORT_FAIL, exc.what());
  }
  return nullptr;
}
