// The CPU engine: the same mixed-precision network as the CUDA engine, with matrix products on
// operands rounded to the 16-bit format (fp16, or bf16 with --precision bf16; fp32 accumulation)
// in a fixed order of its own, and halfstep's host backend doing the optimizer step.
//
// The products are not left to a BLAS: OpenBLAS picks its kernels by CPU type, and their
// summation orders differ (blocking, vector width, FMA or not), so the same run ended at another
// loss and loss scale on another CPU. Here every sum runs over k in ascending order from zero, one
// rounded multiply and one rounded add per term (examples/CMakeLists.txt compiles with
// -ffp-contract=off, so no compiler fuses them), whatever the CPU. The register-blocked loop runs
// the default scenario in about 1.15 times OpenBLAS's time (84 s against 74 s, 2 cores).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "model.hpp"

namespace train {
namespace {

// C = X Y for row-major X (m x k), Y (k x n) and C (m x n). Each element is the sum over p of
// X[i][p] * Y[p][j], added in ascending order of p to an fp32 accumulator that starts at zero.
// Tiles of kRows x kCols elements keep their accumulators in registers while p runs, as vectors
// across columns (GCC's and Clang's vector types: left to itself, the compiler vectorised these
// loops four times slower); a vector lane is one column's own sum, so nothing is reordered. The
// edges take the same order one element at a time.
void product(int m, int n, int k, const float* x, const float* y, float* c) {
  typedef float Vec __attribute__((vector_size(16)));
  constexpr int kRows = 4, kVecs = 2, kCols = kVecs * static_cast<int>(sizeof(Vec) / sizeof(float));
  const auto at = [](int row, int cols, int col) {
    return static_cast<std::size_t>(row) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(col);
  };
  for (int i0 = 0; i0 < m; i0 += kRows) {
    for (int j0 = 0; j0 < n; j0 += kCols) {
      if (i0 + kRows <= m && j0 + kCols <= n) {
        Vec acc[kRows][kVecs] = {};
        for (int p = 0; p < k; ++p) {
          Vec yv[kVecs];
          std::memcpy(yv, y + at(p, n, j0), sizeof yv);
          for (int r = 0; r < kRows; ++r) {
            const float xv = x[at(i0 + r, k, p)];
            for (int v = 0; v < kVecs; ++v) acc[r][v] += xv * yv[v];
          }
        }
        for (int r = 0; r < kRows; ++r) std::memcpy(c + at(i0 + r, n, j0), acc[r], sizeof acc[r]);
      } else {
        for (int i = i0; i < std::min(i0 + kRows, m); ++i) {
          for (int j = j0; j < std::min(j0 + kCols, n); ++j) {
            float sum = 0.0f;
            for (int p = 0; p < k; ++p) sum += x[at(i, k, p)] * y[at(p, n, j)];
            c[at(i, n, j)] = sum;
          }
        }
      }
    }
  }
}

// T = A^T for row-major A (rows x cols): the products take their operands in X Y form.
void transpose(int rows, int cols, const float* a, float* t) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      t[static_cast<std::size_t>(c) * static_cast<std::size_t>(rows) + static_cast<std::size_t>(r)] =
          a[static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(c)];
    }
  }
}

// Decodes the bit patterns of `dtype` (f16 or bf16) through a table built once from halfstep's
// exact conversion.
const std::vector<float>& decode_table(halfstep::DType dtype) {
  const auto build = [](halfstep::DType d) {
    std::vector<float> t(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) {
      t[b] = static_cast<float>(halfstep::from_bits16(d, static_cast<std::uint16_t>(b)));
    }
    return t;
  };
  static const std::vector<float> f16 = build(halfstep::DType::f16), bf16 = build(halfstep::DType::bf16);
  return dtype == halfstep::DType::bf16 ? bf16 : f16;
}

class CpuEngine final : public Engine {
 public:
  CpuEngine(const Dims& dims, const Dataset& data, const std::vector<std::vector<float>>& masters,
            std::int64_t steps, const halfstep::StepConfig& config)
      : dims_(dims), data_(data), dtype_(config.model_dtype), losses_(static_cast<std::size_t>(steps), NAN) {
    const auto shapes = tensor_shapes(dims);
    std::size_t total = 0;
    for (const TensorShape& t : shapes) total += static_cast<std::size_t>(t.numel);
    flat_grad_.assign(total, 0);
    flat_model_.resize(total);
    std::size_t at = 0;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      Param p;
      InitialState init = initial_state(config, masters[t]);
      p.master = std::move(init.master);
      p.shape = shapes[t];
      p.n = masters[t].size();
      // Zero in every moment format (block8: scales of 0 decode every code to 0).
      p.m.assign(p.n * slot_bytes(config, halfstep::Slot::exp_avg, shapes[t]), 0);
      p.v.assign(p.n * slot_bytes(config, halfstep::Slot::exp_avg_sq, shapes[t]), 0);
      p.m_scale.assign(scale_count(config, shapes[t]), 0.0f);
      p.v_scale.assign(p.m_scale.size(), 0.0f);
      p.grad = flat_grad_.data() + at;
      p.model = flat_model_.data() + at;
      std::copy(init.model.begin(), init.model.end(), p.model);
      p.group = shapes[t].group;
      at += p.n;
      params_.push_back(std::move(p));
    }
    const auto b = static_cast<std::size_t>(dims.batch);
    for (int l = 0; l <= dims.layers(); ++l) {  // activations of every layer input, and the output
      const int cols = l == 0 ? dims.d_in : (l == dims.layers() ? dims.d_out : dims.width);
      acts_.emplace_back(b * static_cast<std::size_t>(cols));
    }
    grad_a_.resize(b * static_cast<std::size_t>(std::max({dims.width, dims.d_out, dims.d_in})));
    grad_b_.resize(grad_a_.size());
    grad_t_.resize(grad_a_.size());
    std::size_t largest = 0;  // the largest weight gradient
    for (const TensorShape& t : shapes) largest = std::max(largest, static_cast<std::size_t>(t.numel));
    scratch_.resize(largest);
    weights_.resize(static_cast<std::size_t>(dims.layers()));
    weights_t_.resize(static_cast<std::size_t>(dims.layers()));
  }

  std::string name() const override { return "cpu (fixed-order products, halfstep host backend)"; }
  halfstep::Backend backend() const override { return halfstep::Backend::host; }

  std::vector<halfstep::ParamTensor> tensors() override {
    std::vector<halfstep::ParamTensor> out;
    for (Param& p : params_) {
      out.push_back({p.master.empty() ? nullptr : p.master.data(), p.grad, p.m.data(), p.v.data(), p.model,
                     static_cast<std::int64_t>(p.n), p.group});
      out.back().row = p.shape.row;
      out.back().exp_avg_scale = p.m_scale.empty() ? nullptr : p.m_scale.data();
      out.back().exp_avg_sq_scale = p.v_scale.empty() ? nullptr : p.v_scale.data();
    }
    return out;
  }
  std::uint16_t* flat_grads() override { return flat_grad_.data(); }
  std::uint16_t* flat_model() override { return flat_model_.data(); }

  void forward_backward(std::int64_t step, const halfstep::FusedAdamW& opt, float grad_factor) override {
    const std::vector<float>& value = decode_table(dtype_);
    const halfstep::DType dtype = dtype_;
    const auto round = [dtype](float x) { return halfstep::to_bits16(dtype, x); };  // to nearest
    const int B = dims_.batch, L = dims_.layers();
    const auto row0 = static_cast<std::size_t>(dims_.first_row(step));

    // The model copy as the products see it: 16-bit weights, and their transposes for the forward
    // pass.
    for (int l = 0; l < L; ++l) {
      const Param& w = params_[static_cast<std::size_t>(2 * l)];
      std::vector<float>& weight = weights_[static_cast<std::size_t>(l)];
      weight.resize(w.n);
      for (std::size_t i = 0; i < w.n; ++i) weight[i] = value[w.model[i]];
      weights_t_[static_cast<std::size_t>(l)].resize(w.n);
      transpose(dims_.fan_out(l), dims_.fan_in(l), weight.data(), weights_t_[static_cast<std::size_t>(l)].data());
    }

    // Forward: Z = A W^T + b; hidden layers store relu(Z) rounded to 16 bits, the last layer stays fp32.
    std::copy_n(&data_.x[row0 * static_cast<std::size_t>(dims_.d_in)],
                static_cast<std::size_t>(B) * static_cast<std::size_t>(dims_.d_in), acts_[0].begin());
    for (int l = 0; l < L; ++l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      std::vector<float>& z = acts_[static_cast<std::size_t>(l + 1)];
      product(B, out, in, acts_[static_cast<std::size_t>(l)].data(), weights_t_[static_cast<std::size_t>(l)].data(),
              z.data());
      const std::uint16_t* bias = params_[static_cast<std::size_t>(2 * l + 1)].model;
      const bool last = l == L - 1;
      for (int r = 0; r < B; ++r) {
        for (int c = 0; c < out; ++c) {
          float& x = z[static_cast<std::size_t>(r) * static_cast<std::size_t>(out) + static_cast<std::size_t>(c)];
          x += value[bias[static_cast<std::size_t>(c)]];
          if (!last) x = value[round(std::max(x, 0.0f))];
        }
      }
    }

    // Loss (fp32 mean squared error) and its gradient, seeded with the loss scale, in 16 bits.
    const float scale = *opt.device_loss_scale() * grad_factor;
    const std::vector<float>& pred = acts_[static_cast<std::size_t>(L)];
    const std::size_t n_out = static_cast<std::size_t>(B) * static_cast<std::size_t>(dims_.d_out);
    const float* target = &data_.y[row0 * static_cast<std::size_t>(dims_.d_out)];
    double loss = 0.0;
    std::vector<std::uint16_t> g16(n_out);
    for (std::size_t i = 0; i < n_out; ++i) {
      const float e = pred[i] - target[i];
      loss += static_cast<double>(e) * e;
      g16[i] = round(scale * (2.0f * e / static_cast<float>(n_out)));
    }
    losses_[static_cast<std::size_t>(step)] = static_cast<float>(loss / static_cast<double>(n_out));
    for (std::size_t i = 0; i < n_out; ++i) grad_a_[i] = value[g16[i]];

    // Backward, from the last layer down: dW = G^T A and db = sum over the batch, both written
    // in 16 bits; dA = G W, masked by the ReLU, rounded to 16 bits.
    for (int l = L - 1; l >= 0; --l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      Param& w = params_[static_cast<std::size_t>(2 * l)];
      Param& b = params_[static_cast<std::size_t>(2 * l + 1)];
      transpose(B, out, grad_a_.data(), grad_t_.data());
      product(out, in, B, grad_t_.data(), acts_[static_cast<std::size_t>(l)].data(), scratch_.data());
      for (std::size_t i = 0; i < w.n; ++i) w.grad[i] = round(scratch_[i]);
      for (int c = 0; c < out; ++c) {
        float sum = 0.0f;
        for (int r = 0; r < B; ++r) sum += grad_a_[static_cast<std::size_t>(r) * static_cast<std::size_t>(out) + static_cast<std::size_t>(c)];
        b.grad[static_cast<std::size_t>(c)] = round(sum);
      }
      if (l == 0) break;
      product(B, in, out, grad_a_.data(), weights_[static_cast<std::size_t>(l)].data(), grad_b_.data());
      const std::vector<float>& a = acts_[static_cast<std::size_t>(l)];
      for (std::size_t i = 0; i < static_cast<std::size_t>(B) * static_cast<std::size_t>(in); ++i) {
        grad_b_[i] = a[i] > 0.0f ? value[round(grad_b_[i])] : 0.0f;
      }
      std::swap(grad_a_, grad_b_);
    }
  }

  halfstep::Stream stream() const override { return nullptr; }
  void step(halfstep::FusedAdamW& opt) override { opt.step(); }
  float loss(std::int64_t step) override { return losses_[static_cast<std::size_t>(step)]; }

  void sync() override {}

 private:
  struct Param {
    std::vector<unsigned char> master;  // in its format (InitialState); empty without a master
    std::vector<unsigned char> m, v;  // the moments in their format
    std::vector<float> m_scale, v_scale;  // block8: a scale per block
    TensorShape shape{};
    std::size_t n = 0;
    std::uint16_t* grad = nullptr;   // into flat_grad_
    std::uint16_t* model = nullptr;  // into flat_model_
    std::int32_t group = 0;
  };
  Dims dims_;
  const Dataset& data_;
  halfstep::DType dtype_;  // the model copy's, the activations' and the gradients' format
  std::vector<Param> params_;
  std::vector<std::uint16_t> flat_grad_, flat_model_;
  std::vector<std::vector<float>> acts_, weights_, weights_t_;
  std::vector<float> grad_a_, grad_b_, grad_t_, scratch_, losses_;
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const Dims& dims, const Dataset& data,
                                        const std::vector<std::vector<float>>& masters,
                                        std::int64_t steps, const halfstep::StepConfig& config) {
  check_engine_formats(config);
  return std::make_unique<CpuEngine>(dims, data, masters, steps, config);
}

}  // namespace train
