// The CUDA engine: cuBLAS matrix products with 16-bit operands (fp16, or bf16 with --precision
// bf16) and fp32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F), small kernels of ours for bias,
// activation, loss and bias gradients, and halfstep's fused step. One stream; the host waits only
// when it reads a loss.
//
// Layout: activations and gradients are row-major (batch × features), which cuBLAS sees as
// column-major (features × batch); a weight W (out × in, row-major) is column-major in × out.
//   forward   Z  = A W^T  ->  Z_cm(out×B)  = W_cm^T(out×in) · A_cm(in×B)
//   weight    dW = G^T A  ->  dW_cm(in×out) = A_cm(in×B) · G_cm^T(B×out)
//   input     dA = G W    ->  dA_cm(in×B)  = W_cm(in×out) · G_cm(out×B)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "model.hpp"

namespace train {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}
void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": " + cublasGetStatusString(status));
  }
}
#define TRAIN_CHECK(expr) check((expr), #expr)
#define TRAIN_LAUNCHED() check(cudaGetLastError(), "kernel launch")

// The 16-bit formats' conversions (T: __half or __nv_bfloat16), to nearest.
__device__ float value(__half x) { return __half2float(x); }
__device__ float value(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ T rounded(float x);
template <>
__device__ __half rounded<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 rounded<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Hidden layer: a = T(relu(z + b)).
template <class T>
__global__ void bias_relu_kernel(const float* z, const T* bias, T* a, int rows, int cols) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(rows) * cols) return;
  const float x = z[i] + value(bias[i % cols]);
  a[i] = rounded<T>(fmaxf(x, 0.0f));
}

// Output layer: z += b, kept in fp32 for the loss.
template <class T>
__global__ void bias_kernel(float* z, const T* bias, int rows, int cols) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<long long>(rows) * cols) return;
  z[i] += value(bias[i % cols]);
}

// Mean squared error in fp32 and its gradient 2(pred - y)/n, seeded with the loss scale read from
// device memory (times `factor` for an injected spike) and written in T. One block; the loss is
// reduced in a fixed order.
constexpr int kLossThreads = 1024;
template <class T>
__global__ void mse_kernel(const float* pred, const float* y, int n, const float* loss_scale,
                           float factor, T* grad, float* loss_out) {
  __shared__ double partial[kLossThreads];
  const float seed = *loss_scale * factor;
  double sum = 0.0;
  for (int i = threadIdx.x; i < n; i += kLossThreads) {
    const float e = pred[i] - y[i];
    sum += static_cast<double>(e) * e;
    grad[i] = rounded<T>(seed * (2.0f * e / static_cast<float>(n)));
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kLossThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss_out = static_cast<float>(partial[0] / n);
}

// db[c] = T(sum over the batch of g[r][c]), accumulated in fp32.
template <class T>
__global__ void bias_grad_kernel(const T* g, T* db, int rows, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = 0.0f;
  for (int r = 0; r < rows; ++r) sum += value(g[static_cast<long long>(r) * cols + c]);
  db[c] = rounded<T>(sum);
}

// ReLU backward: the gradient passes where the stored activation is positive.
template <class T>
__global__ void relu_backward_kernel(T* g, const T* a, long long n) {
  const long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (!(value(a[i]) > 0.0f)) g[i] = rounded<T>(0.0f);
}

unsigned blocks_for(long long n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

template <class T>
T* device_alloc(std::size_t count) {
  void* p = nullptr;
  TRAIN_CHECK(cudaMalloc(&p, count * sizeof(T) + 16));
  return static_cast<T*>(p);
}

std::vector<std::uint16_t> to_bits(halfstep::DType dtype, const std::vector<float>& x) {
  std::vector<std::uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = halfstep::to_bits16(dtype, x[i]);
  return out;
}

class CudaEngine final : public Engine {
 public:
  CudaEngine(const Dims& dims, const Dataset& data, const std::vector<std::vector<float>>& masters,
             std::int64_t steps, const halfstep::StepConfig& config)
      : dims_(dims), dtype_(config.model_dtype), config_(config) {
    TRAIN_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TRAIN_CHECK(cublasCreate(&blas_));
    TRAIN_CHECK(cublasSetStream(blas_, stream_));
    const auto shapes = tensor_shapes(dims);
    std::size_t total = 0;
    for (const TensorShape& t : shapes) total += static_cast<std::size_t>(t.numel);
    flat_grad_ = device_alloc<std::uint16_t>(total);
    flat_model_ = device_alloc<std::uint16_t>(total);
    TRAIN_CHECK(cudaMemset(flat_grad_, 0, total * 2));
    std::size_t at = 0;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      const auto n = static_cast<std::size_t>(shapes[t].numel);
      Param p;
      p.n = n;
      p.group = shapes[t].group;
      const std::size_t master_bytes = slot_bytes(config, halfstep::Slot::master);
      if (master_bytes > 0) p.master = device_alloc<unsigned char>(n * master_bytes);  // none: null
      // The moments in their format, zero in every one (block8: scales of 0 decode every code to 0).
      const std::size_t m_bytes = slot_bytes(config, halfstep::Slot::exp_avg, shapes[t]);
      const std::size_t v_bytes = slot_bytes(config, halfstep::Slot::exp_avg_sq, shapes[t]);
      p.m = device_alloc<unsigned char>(n * m_bytes);
      p.v = device_alloc<unsigned char>(n * v_bytes);
      TRAIN_CHECK(cudaMemset(p.m, 0, n * m_bytes));
      TRAIN_CHECK(cudaMemset(p.v, 0, n * v_bytes));
      p.row = shapes[t].row;
      p.scales = scale_count(config, shapes[t]);
      if (p.scales > 0) {
        p.m_scale = device_alloc<float>(p.scales);
        p.v_scale = device_alloc<float>(p.scales);
        TRAIN_CHECK(cudaMemset(p.m_scale, 0, p.scales * sizeof(float)));
        TRAIN_CHECK(cudaMemset(p.v_scale, 0, p.scales * sizeof(float)));
      }
      p.grad = flat_grad_ + at;
      p.model = flat_model_ + at;
      at += n;
      params_.push_back(p);
    }
    write_masters(masters);

    const std::vector<std::uint16_t> x = to_bits(dtype_, data.x);
    x_ = device_alloc<std::uint16_t>(x.size());
    TRAIN_CHECK(cudaMemcpy(x_, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    y_ = device_alloc<float>(data.y.size());
    TRAIN_CHECK(cudaMemcpy(y_, data.y.data(), data.y.size() * 4, cudaMemcpyHostToDevice));
    const auto b = static_cast<std::size_t>(dims.batch);
    const std::size_t widest = static_cast<std::size_t>(std::max({dims.width, dims.d_out, dims.d_in}));
    for (int l = 1; l < dims.layers(); ++l) {
      acts_.push_back(device_alloc<std::uint16_t>(b * static_cast<std::size_t>(dims.width)));
    }
    z_ = device_alloc<float>(b * widest);
    g_a_ = device_alloc<std::uint16_t>(b * widest);
    g_b_ = device_alloc<std::uint16_t>(b * widest);
    losses_ = device_alloc<float>(static_cast<std::size_t>(steps));
    settle();
  }

  ~CudaEngine() override {
    cudaStreamSynchronize(stream_);
    for (Param& p : params_) {
      cudaFree(p.master);
      cudaFree(p.m);
      cudaFree(p.v);
      cudaFree(p.m_scale);
      cudaFree(p.v_scale);
    }
    cudaFree(flat_grad_);
    cudaFree(flat_model_);
    for (std::uint16_t* a : acts_) cudaFree(a);
    cudaFree(x_);
    cudaFree(y_);
    cudaFree(z_);
    cudaFree(g_a_);
    cudaFree(g_b_);
    cudaFree(losses_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    cudaDeviceProp prop{};
    int device = 0;
    cudaGetDevice(&device);
    cudaGetDeviceProperties(&prop, device);
    return std::string("cuda (") + prop.name + ", cuBLAS products, halfstep fused step)";
  }
  halfstep::Backend backend() const override { return halfstep::Backend::cuda; }

  std::vector<halfstep::ParamTensor> tensors() override {
    std::vector<halfstep::ParamTensor> out;
    for (Param& p : params_) {
      out.push_back({p.master, p.grad, p.m, p.v, p.model, static_cast<std::int64_t>(p.n), p.group});
      out.back().row = p.row;
      out.back().exp_avg_scale = p.m_scale;
      out.back().exp_avg_sq_scale = p.v_scale;
    }
    return out;
  }
  std::uint16_t* flat_grads() override { return flat_grad_; }
  std::uint16_t* flat_model() override { return flat_model_; }

  void forward_backward(std::int64_t step, const halfstep::FusedAdamW& opt, float grad_factor) override {
    if (dtype_ == halfstep::DType::bf16) {
      pass<__nv_bfloat16>(step, opt, grad_factor, CUDA_R_16BF);
    } else {
      pass<__half>(step, opt, grad_factor, CUDA_R_16F);
    }
  }

  halfstep::Stream stream() const override { return stream_; }
  void step(halfstep::FusedAdamW& opt) override { opt.step(stream_); }

  float loss(std::int64_t step) override {
    TRAIN_CHECK(cudaStreamSynchronize(stream_));
    float value = 0.0f;
    TRAIN_CHECK(cudaMemcpy(&value, losses_ + step, sizeof value, cudaMemcpyDeviceToHost));
    return value;
  }

  // Sets the masters in their format and the model copies (the masters rounded to nearest).
  void write_masters(const std::vector<std::vector<float>>& master) {
    sync();
    for (std::size_t t = 0; t < params_.size(); ++t) {
      const Param& p = params_[t];
      const InitialState init = initial_state(config_, master[t]);
      if (p.master != nullptr) {
        TRAIN_CHECK(cudaMemcpy(p.master, init.master.data(), init.master.size(), cudaMemcpyHostToDevice));
      }
      TRAIN_CHECK(cudaMemcpy(p.model, init.model.data(), p.n * 2, cudaMemcpyHostToDevice));
    }
    settle();
  }

  void sync() override { TRAIN_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  // Forward, loss and backward with T (__half or __nv_bfloat16, cuBLAS's `type`) for the 16-bit
  // buffers.
  template <class T>
  void pass(std::int64_t step, const halfstep::FusedAdamW& opt, float grad_factor, cudaDataType type) {
    const auto as = [](std::uint16_t* p) { return reinterpret_cast<T*>(p); };
    const int B = dims_.batch, L = dims_.layers();
    const long long row0 = dims_.first_row(step);
    const float one = 1.0f, zero = 0.0f;
    constexpr int kThreads = 256;

    // Forward.
    const T* input = as(x_) + row0 * dims_.d_in;
    for (int l = 0; l < L; ++l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      const Param& w = params_[static_cast<std::size_t>(2 * l)];
      const Param& b = params_[static_cast<std::size_t>(2 * l + 1)];
      TRAIN_CHECK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, B, in, &one, w.model, type,
                               in, input, type, in, &zero, z_, CUDA_R_32F, out,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      const long long n = static_cast<long long>(B) * out;
      if (l < L - 1) {
        T* a = as(acts_[static_cast<std::size_t>(l)]);
        bias_relu_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream_>>>(z_, as(b.model), a, B, out);
        TRAIN_LAUNCHED();
        input = a;
      } else {
        bias_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream_>>>(z_, as(b.model), B, out);
        TRAIN_LAUNCHED();
      }
    }

    // Loss and its scaled gradient; the scale is read on the device.
    mse_kernel<T><<<1, kLossThreads, 0, stream_>>>(z_, y_ + row0 * dims_.d_out, B * dims_.d_out,
                                                   opt.device_loss_scale(), grad_factor, as(g_a_),
                                                   losses_ + step);
    TRAIN_LAUNCHED();

    // Backward.
    for (int l = L - 1; l >= 0; --l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      Param& w = params_[static_cast<std::size_t>(2 * l)];
      Param& b = params_[static_cast<std::size_t>(2 * l + 1)];
      const T* a_in = l == 0 ? as(x_) + row0 * dims_.d_in : as(acts_[static_cast<std::size_t>(l - 1)]);
      TRAIN_CHECK(cublasGemmEx(blas_, CUBLAS_OP_N, CUBLAS_OP_T, in, out, B, &one, a_in, type,
                               in, g_a_, type, out, &zero, w.grad, type, in,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      bias_grad_kernel<T><<<blocks_for(out, kThreads), kThreads, 0, stream_>>>(as(g_a_), as(b.grad), B, out);
      TRAIN_LAUNCHED();
      if (l == 0) break;
      TRAIN_CHECK(cublasGemmEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, in, B, out, &one, w.model, type,
                               in, g_a_, type, out, &zero, g_b_, type, in,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      const long long n = static_cast<long long>(B) * in;
      relu_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream_>>>(as(g_b_), a_in, n);
      TRAIN_LAUNCHED();
      std::swap(g_a_, g_b_);
    }
  }

  // Copies from pageable memory use the legacy stream and may return before they land; the
  // engine's own stream does not wait for it.
  void settle() { TRAIN_CHECK(cudaStreamSynchronize(cudaStreamLegacy)); }

  struct Param {
    std::size_t n = 0;
    std::int32_t group = 0;
    unsigned char* master = nullptr;           // in its format; null without a master
    unsigned char *m = nullptr, *v = nullptr;  // the moments in their format
    float *m_scale = nullptr, *v_scale = nullptr;  // block8: a scale per block
    std::size_t scales = 0;
    std::int64_t row = 0;
    std::uint16_t *grad = nullptr, *model = nullptr;  // 16-bit, in dtype_
  };
  Dims dims_;
  halfstep::DType dtype_;  // the model copy's, the activations' and the gradients' format
  halfstep::StepConfig config_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::vector<Param> params_;
  std::vector<std::uint16_t*> acts_;
  std::uint16_t* flat_grad_ = nullptr;   // every tensor's gradient, end to end
  std::uint16_t* flat_model_ = nullptr;  // every tensor's model copy, end to end
  std::uint16_t* x_ = nullptr;
  float* y_ = nullptr;
  float* z_ = nullptr;
  std::uint16_t* g_a_ = nullptr;
  std::uint16_t* g_b_ = nullptr;
  float* losses_ = nullptr;
};

}  // namespace

bool cuda_available() {
  int devices = 0;
  const bool ok = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  if (!ok) (void)cudaGetLastError();
  return ok;
}

std::unique_ptr<Engine> make_cuda_engine(const Dims& dims, const Dataset& data,
                                         const std::vector<std::vector<float>>& masters,
                                         std::int64_t steps, const halfstep::StepConfig& config) {
  check_engine_formats(config);
  return std::make_unique<CudaEngine>(dims, data, masters, steps, config);
}

}  // namespace train
