// The CPU engine: the same mixed-precision network as the CUDA engine, with OpenBLAS doing the
// matrix products on fp16-rounded operands (fp32 accumulation) and halfstep's reference
// backend doing the optimizer step.
#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "model.hpp"

namespace train {
namespace {

using halfstep::to_f16_bits;

// Decodes fp16 bit patterns through a table built once from halfstep's exact conversion.
const std::vector<float>& f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) {
      t[b] = static_cast<float>(halfstep::from_f16_bits(static_cast<std::uint16_t>(b)));
    }
    return t;
  }();
  return table;
}

class CpuEngine final : public Engine {
 public:
  CpuEngine(const Dims& dims, const Dataset& data, const std::vector<std::vector<float>>& masters,
            std::int64_t steps)
      : dims_(dims), data_(data), losses_(static_cast<std::size_t>(steps), NAN) {
    const auto shapes = tensor_shapes(dims);
    std::size_t total = 0;
    for (const TensorShape& t : shapes) total += static_cast<std::size_t>(t.numel);
    flat_grad_.assign(total, 0);
    flat_model_.resize(total);
    std::size_t at = 0;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      Param p;
      p.master = masters[t];
      p.m.assign(p.master.size(), 0.0f);
      p.v.assign(p.master.size(), 0.0f);
      p.n = p.master.size();
      p.grad = flat_grad_.data() + at;
      p.model = flat_model_.data() + at;
      for (std::size_t i = 0; i < p.n; ++i) p.model[i] = to_f16_bits(p.master[i]);
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
    std::size_t largest = 0;  // the largest weight gradient
    for (const TensorShape& t : shapes) largest = std::max(largest, static_cast<std::size_t>(t.numel));
    scratch_.resize(largest);
    weights_.resize(static_cast<std::size_t>(dims.layers()));
  }

  std::string name() const override { return "cpu (OpenBLAS products, halfstep reference backend)"; }
  halfstep::Backend backend() const override { return halfstep::Backend::reference; }

  std::vector<halfstep::ParamTensor> tensors() override {
    std::vector<halfstep::ParamTensor> out;
    for (Param& p : params_) {
      out.push_back({p.master.data(), p.grad, p.m.data(), p.v.data(), p.model,
                     static_cast<std::int64_t>(p.master.size()), p.group});
    }
    return out;
  }
  std::uint16_t* flat_grads() override { return flat_grad_.data(); }
  std::uint16_t* flat_model() override { return flat_model_.data(); }

  void forward_backward(std::int64_t step, const halfstep::FusedAdamW& opt, float grad_factor) override {
    const std::vector<float>& f16 = f16_table();
    const int B = dims_.batch, L = dims_.layers();
    const auto row0 = static_cast<std::size_t>(dims_.first_row(step));

    // The model copy as the products see it: fp16 weights.
    for (int l = 0; l < L; ++l) {
      const Param& w = params_[static_cast<std::size_t>(2 * l)];
      weights_[static_cast<std::size_t>(l)].resize(w.n);
      for (std::size_t i = 0; i < w.n; ++i) weights_[static_cast<std::size_t>(l)][i] = f16[w.model[i]];
    }

    // Forward: Z = A W^T + b; hidden layers store fp16(relu(Z)), the last layer stays fp32.
    std::copy_n(&data_.x[row0 * static_cast<std::size_t>(dims_.d_in)],
                static_cast<std::size_t>(B) * static_cast<std::size_t>(dims_.d_in), acts_[0].begin());
    for (int l = 0; l < L; ++l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      std::vector<float>& z = acts_[static_cast<std::size_t>(l + 1)];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, out, in, 1.0f,
                  acts_[static_cast<std::size_t>(l)].data(), in,
                  weights_[static_cast<std::size_t>(l)].data(), in, 0.0f, z.data(), out);
      const std::uint16_t* bias = params_[static_cast<std::size_t>(2 * l + 1)].model;
      const bool last = l == L - 1;
      for (int r = 0; r < B; ++r) {
        for (int c = 0; c < out; ++c) {
          float& x = z[static_cast<std::size_t>(r) * static_cast<std::size_t>(out) + static_cast<std::size_t>(c)];
          x += f16[bias[static_cast<std::size_t>(c)]];
          if (!last) x = f16[to_f16_bits(std::max(x, 0.0f))];
        }
      }
    }

    // Loss (fp32 mean squared error) and its gradient, seeded with the loss scale, in fp16.
    const float scale = *opt.device_loss_scale() * grad_factor;
    const std::vector<float>& pred = acts_[static_cast<std::size_t>(L)];
    const std::size_t n_out = static_cast<std::size_t>(B) * static_cast<std::size_t>(dims_.d_out);
    const float* target = &data_.y[row0 * static_cast<std::size_t>(dims_.d_out)];
    double loss = 0.0;
    std::vector<std::uint16_t> g16(n_out);
    for (std::size_t i = 0; i < n_out; ++i) {
      const float e = pred[i] - target[i];
      loss += static_cast<double>(e) * e;
      g16[i] = to_f16_bits(scale * (2.0f * e / static_cast<float>(n_out)));
    }
    losses_[static_cast<std::size_t>(step)] = static_cast<float>(loss / static_cast<double>(n_out));
    for (std::size_t i = 0; i < n_out; ++i) grad_a_[i] = f16[g16[i]];

    // Backward, from the last layer down: dW = G^T A and db = sum over the batch, both written
    // in fp16; dA = G W, masked by the ReLU, rounded to fp16.
    for (int l = L - 1; l >= 0; --l) {
      const int in = dims_.fan_in(l), out = dims_.fan_out(l);
      Param& w = params_[static_cast<std::size_t>(2 * l)];
      Param& b = params_[static_cast<std::size_t>(2 * l + 1)];
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, B, 1.0f, grad_a_.data(), out,
                  acts_[static_cast<std::size_t>(l)].data(), in, 0.0f, scratch_.data(), in);
      for (std::size_t i = 0; i < w.n; ++i) w.grad[i] = to_f16_bits(scratch_[i]);
      for (int c = 0; c < out; ++c) {
        float sum = 0.0f;
        for (int r = 0; r < B; ++r) sum += grad_a_[static_cast<std::size_t>(r) * static_cast<std::size_t>(out) + static_cast<std::size_t>(c)];
        b.grad[static_cast<std::size_t>(c)] = to_f16_bits(sum);
      }
      if (l == 0) break;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, in, out, 1.0f, grad_a_.data(), out,
                  weights_[static_cast<std::size_t>(l)].data(), in, 0.0f, grad_b_.data(), in);
      const std::vector<float>& a = acts_[static_cast<std::size_t>(l)];
      for (std::size_t i = 0; i < static_cast<std::size_t>(B) * static_cast<std::size_t>(in); ++i) {
        grad_b_[i] = a[i] > 0.0f ? f16[to_f16_bits(grad_b_[i])] : 0.0f;
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
    std::vector<float> master, m, v;
    std::size_t n = 0;
    std::uint16_t* grad = nullptr;   // into flat_grad_
    std::uint16_t* model = nullptr;  // into flat_model_
    std::int32_t group = 0;
  };
  Dims dims_;
  const Dataset& data_;
  std::vector<Param> params_;
  std::vector<std::uint16_t> flat_grad_, flat_model_;
  std::vector<std::vector<float>> acts_, weights_;
  std::vector<float> grad_a_, grad_b_, scratch_, losses_;
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const Dims& dims, const Dataset& data,
                                        const std::vector<std::vector<float>>& masters,
                                        std::int64_t steps) {
  return std::make_unique<CpuEngine>(dims, data, masters, steps);
}

}  // namespace train
