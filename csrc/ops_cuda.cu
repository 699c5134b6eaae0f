// CUDA kernels of the monet_like operators, and the cuDNN convolution with an explicitly chosen
// algorithm (MONeT's `conv` mode).
//
// The schemas of ops 1-7 below, and of the device-generic conv2d_algo, conv2d_backward_algo and
// conv2d_algorithms (at the end), are defined by TORCH_LIBRARY(monet_like) in csrc/ops.cpp,
// together with their CPU kernels; this file only adds CUDA kernels for them. The conv_cudnn_*
// ops exist only with CUDA, so this file defines their schemas itself (TORCH_LIBRARY_FRAGMENT).
//
// Everything lives in this one translation unit to keep the build short: compiling a .cu file
// against torch's headers takes minutes on a small machine.
//
// The cuDNN part needs cudnn.h on the include path (pip's nvidia-cudnn wheel ships it under
// site-packages/nvidia/cudnn/include). Without it the file still builds, without the conv ops.
//
// Simple kernels: one thread per element (grid-stride loops, 64-bit indices), one block per
// channel for the per-channel reductions of batch norm. Inputs are made contiguous first.

#include <ATen/core/Tensor.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__has_include)
#if __has_include(<cudnn.h>)
#define MONET_LIKE_WITH_CUDNN 1
#endif
#endif

#ifdef MONET_LIKE_WITH_CUDNN
#include <ATen/Context.h>
#include <ATen/cudnn/Handle.h>
#include <cudnn.h>
#endif

namespace monet_like_cuda {

constexpr int kThreads = 256;  // a power of two: block_sum2 below relies on it

inline int64_t grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(1) << 20));
}

#define MONET_GRID_LOOP(i, n)                                                     \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);      \
       i += int64_t(blockDim.x) * gridDim.x)

void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got ", t.device());
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.device() == b.device(), op, ": tensors are on different devices: ", a.device(),
              " and ", b.device());
}

// --------------------------------------------------------------------------------------------
// 1. relu_mask: one bit per element, LSB first; bit = !(y <= 0), so NaN gives 1.

template <typename scalar_t>
__global__ void relu_mask_kernel(const scalar_t* __restrict__ y, uint8_t* __restrict__ mask,
                                 int64_t n, int64_t nbytes) {
  using opmath_t = at::opmath_type<scalar_t>;
  MONET_GRID_LOOP(j, nbytes) {
    const int64_t base = j * 8;
    unsigned byte = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const int64_t k = base + b;
      if (k < n && !(static_cast<opmath_t>(y[k]) <= opmath_t(0))) byte |= 1u << b;
    }
    mask[j] = static_cast<uint8_t>(byte);
  }
}

at::Tensor relu_mask_cuda(const at::Tensor& self) {
  check_cuda(self, "relu_mask", "self");
  c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor y = self.contiguous();
  const int64_t n = y.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor mask = at::empty({nbytes}, y.options().dtype(at::kByte));
  if (nbytes == 0) return mask;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "relu_mask_cuda", [&] {
    relu_mask_kernel<scalar_t><<<grid_for(nbytes), kThreads, 0, stream>>>(
        y.const_data_ptr<scalar_t>(), mask.mutable_data_ptr<uint8_t>(), n, nbytes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return mask;
}

// --------------------------------------------------------------------------------------------
// 2. relu_backward_mask: grad where the mask bit is 1, else 0.

template <typename scalar_t>
__global__ void relu_backward_mask_kernel(const scalar_t* __restrict__ grad,
                                          const uint8_t* __restrict__ mask,
                                          scalar_t* __restrict__ out, int64_t n) {
  MONET_GRID_LOOP(k, n) {
    const bool keep = (mask[k >> 3] >> (k & 7)) & 1;
    out[k] = keep ? grad[k] : scalar_t(0);
  }
}

at::Tensor relu_backward_mask_cuda(const at::Tensor& grad_output, const at::Tensor& mask) {
  const char* op = "relu_backward_mask";
  check_cuda(grad_output, op, "grad_output");
  check_cuda(mask, op, "mask");
  check_same_device(grad_output, mask, op);
  TORCH_CHECK(mask.scalar_type() == at::kByte, op, ": mask must be uint8, got ",
              mask.scalar_type());
  c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor m = mask.contiguous();
  const int64_t n = g.numel();
  TORCH_CHECK(m.numel() == (n + 7) / 8, op, ": mask has ", m.numel(),
              " bytes, but grad_output has ", n, " elements (needs ", (n + 7) / 8, ")");
  at::Tensor out = at::empty(g.sizes(), g.options());
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(),
                                  "relu_backward_mask_cuda", [&] {
    relu_backward_mask_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        g.const_data_ptr<scalar_t>(), m.const_data_ptr<uint8_t>(),
        out.mutable_data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// --------------------------------------------------------------------------------------------
// 3./4. max pooling with a uint8 index inside the window (kh * kW + kw).

struct Pool2d {
  int64_t kH, kW, sH, sW, pH, pW, dH, dW;
};

int64_t pair_item(at::IntArrayRef v, size_t i) { return v.size() == 1 ? v[0] : v[i]; }

Pool2d pool_params(at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                   at::IntArrayRef dilation, const char* op) {
  TORCH_CHECK(kernel_size.size() == 1 || kernel_size.size() == 2, op,
              ": kernel_size must have one or two elements");
  TORCH_CHECK(stride.empty() || stride.size() == 1 || stride.size() == 2, op,
              ": stride must have zero, one or two elements");
  TORCH_CHECK(padding.size() == 1 || padding.size() == 2, op,
              ": padding must have one or two elements");
  TORCH_CHECK(dilation.size() == 1 || dilation.size() == 2, op,
              ": dilation must have one or two elements");
  Pool2d p;
  p.kH = pair_item(kernel_size, 0);
  p.kW = pair_item(kernel_size, 1);
  // An empty stride means the kernel size, as in torch.nn.functional.max_pool2d.
  p.sH = stride.empty() ? p.kH : pair_item(stride, 0);
  p.sW = stride.empty() ? p.kW : pair_item(stride, 1);
  p.pH = pair_item(padding, 0);
  p.pW = pair_item(padding, 1);
  p.dH = pair_item(dilation, 0);
  p.dW = pair_item(dilation, 1);
  TORCH_CHECK(p.kH > 0 && p.kW > 0, op, ": kernel_size must be positive");
  TORCH_CHECK(p.sH > 0 && p.sW > 0, op, ": stride must be positive");
  TORCH_CHECK(p.dH > 0 && p.dW > 0, op, ": dilation must be positive");
  TORCH_CHECK(p.pH >= 0 && p.pW >= 0, op, ": padding must be non-negative");
  TORCH_CHECK(p.pH <= ((p.kH - 1) * p.dH + 1) / 2 && p.pW <= ((p.kW - 1) * p.dW + 1) / 2, op,
              ": padding should be at most half of the effective kernel size");
  TORCH_CHECK(p.kH * p.kW <= 256, op, ": a window of ", p.kH, "x", p.kW,
              " elements does not fit a uint8 index (at most 256)");
  return p;
}

// Rounds towards minus infinity, as aten's pooling shape formula does.
int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

int64_t pool_out_size(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dil,
                      bool ceil_mode) {
  int64_t out =
      floor_div(in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0), stride) + 1;
  // With ceil_mode the last window must start inside the input or its left padding.
  if (ceil_mode && (out - 1) * stride >= in + pad) --out;
  return out;
}

template <typename scalar_t>
__global__ void max_pool2d_compact_kernel(const scalar_t* __restrict__ in,
                                          scalar_t* __restrict__ out,
                                          uint8_t* __restrict__ indices, int64_t total,
                                          int64_t H, int64_t W, int64_t OH, int64_t OW,
                                          Pool2d p) {
  using opmath_t = at::opmath_type<scalar_t>;
  MONET_GRID_LOOP(o, total) {
    const int64_t ow = o % OW;
    const int64_t oh = (o / OW) % OH;
    const int64_t plane = o / (OW * OH);
    const scalar_t* src = in + plane * H * W;
    const int64_t h0 = oh * p.sH - p.pH;
    const int64_t w0 = ow * p.sW - p.pW;
    // aten starts from -inf at the window's first position inside the input (kh0, kw0).
    const int64_t kh0 = h0 < 0 ? (-h0 + p.dH - 1) / p.dH : 0;
    const int64_t kw0 = w0 < 0 ? (-w0 + p.dW - 1) / p.dW : 0;
    int64_t best = (kh0 < p.kH - 1 ? kh0 : p.kH - 1) * p.kW + (kw0 < p.kW - 1 ? kw0 : p.kW - 1);
    opmath_t best_val = static_cast<opmath_t>(-INFINITY);
    for (int64_t kh = 0; kh < p.kH; ++kh) {
      const int64_t h = h0 + kh * p.dH;
      if (h < 0 || h >= H) continue;
      for (int64_t kw = 0; kw < p.kW; ++kw) {
        const int64_t w = w0 + kw * p.dW;
        if (w < 0 || w >= W) continue;
        const opmath_t v = static_cast<opmath_t>(src[h * W + w]);
        if (v > best_val || v != v) {  // v != v: NaN propagates (the last NaN wins)
          best = kh * p.kW + kw;
          best_val = v;
        }
      }
    }
    out[o] = static_cast<scalar_t>(best_val);
    indices[o] = static_cast<uint8_t>(best);
  }
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_compact_cuda(
    const at::Tensor& self, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  const char* op = "max_pool2d_compact";
  check_cuda(self, op, "self");
  TORCH_CHECK(self.dim() == 3 || self.dim() == 4, op,
              ": expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got ", self.sizes());
  const Pool2d p = pool_params(kernel_size, stride, padding, dilation, op);
  c10::cuda::CUDAGuard guard(self.device());
  const at::Tensor x = self.contiguous();
  const int64_t H = x.size(-2), W = x.size(-1);
  const int64_t OH = pool_out_size(H, p.kH, p.pH, p.sH, p.dH, ceil_mode);
  const int64_t OW = pool_out_size(W, p.kW, p.pW, p.sW, p.dW, ceil_mode);
  TORCH_CHECK(OH > 0 && OW > 0, op, ": output size is too small (", OH, "x", OW,
              ") for input ", x.sizes());
  std::vector<int64_t> out_size(x.sizes().begin(), x.sizes().end());
  out_size[out_size.size() - 2] = OH;
  out_size[out_size.size() - 1] = OW;
  at::Tensor out = at::empty(out_size, x.options());
  at::Tensor indices = at::empty(out_size, x.options().dtype(at::kByte));
  const int64_t total = out.numel();
  if (total == 0) return {out, indices};
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "max_pool2d_compact_cuda", [&] {
    max_pool2d_compact_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        indices.mutable_data_ptr<uint8_t>(), total, H, W, OH, OW, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, indices};
}

template <typename scalar_t>
__global__ void max_pool2d_compact_backward_kernel(const scalar_t* __restrict__ grad_out,
                                                   const uint8_t* __restrict__ indices,
                                                   scalar_t* __restrict__ grad_in,
                                                   int64_t total, int64_t H, int64_t W,
                                                   int64_t OH, int64_t OW, Pool2d p) {
  MONET_GRID_LOOP(o, total) {
    const int64_t ow = o % OW;
    const int64_t oh = (o / OW) % OH;
    const int64_t plane = o / (OW * OH);
    const int64_t k = indices[o];
    const int64_t h = oh * p.sH - p.pH + (k / p.kW) * p.dH;
    const int64_t w = ow * p.sW - p.pW + (k % p.kW) * p.dW;
    if (h >= 0 && h < H && w >= 0 && w < W) {
      gpuAtomicAdd(grad_in + plane * H * W + h * W + w, grad_out[o]);  // windows overlap
    }
  }
}

at::Tensor max_pool2d_compact_backward_cuda(const at::Tensor& grad_output,
                                            const at::Tensor& indices,
                                            c10::SymIntArrayRef input_size,
                                            at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                            at::IntArrayRef padding, at::IntArrayRef dilation,
                                            bool ceil_mode) {
  const char* op = "max_pool2d_compact_backward";
  check_cuda(grad_output, op, "grad_output");
  check_cuda(indices, op, "indices");
  check_same_device(grad_output, indices, op);
  TORCH_CHECK(indices.scalar_type() == at::kByte, op, ": indices must be uint8, got ",
              indices.scalar_type());
  const at::IntArrayRef in_size = C10_AS_INTARRAYREF_SLOW(input_size);
  TORCH_CHECK(in_size.size() == 3 || in_size.size() == 4, op,
              ": input_size must be (C, H, W) or (N, C, H, W), got ", in_size);
  const Pool2d p = pool_params(kernel_size, stride, padding, dilation, op);
  const int64_t H = in_size[in_size.size() - 2], W = in_size[in_size.size() - 1];
  const int64_t OH = pool_out_size(H, p.kH, p.pH, p.sH, p.dH, ceil_mode);
  const int64_t OW = pool_out_size(W, p.kW, p.pW, p.sW, p.dW, ceil_mode);
  std::vector<int64_t> expected(in_size.begin(), in_size.end());
  expected[expected.size() - 2] = OH;
  expected[expected.size() - 1] = OW;
  TORCH_CHECK(grad_output.sizes() == at::IntArrayRef(expected), op, ": grad_output has shape ",
              grad_output.sizes(), ", the pooling of ", in_size, " gives ",
              at::IntArrayRef(expected));
  TORCH_CHECK(indices.sizes() == grad_output.sizes(), op, ": indices has shape ",
              indices.sizes(), ", grad_output ", grad_output.sizes());
  c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor idx = indices.contiguous();
  at::Tensor grad_input = at::zeros(in_size, g.options());
  const int64_t total = g.numel();
  if (total == 0) return grad_input;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(),
                                  "max_pool2d_compact_backward_cuda", [&] {
    max_pool2d_compact_backward_kernel<scalar_t><<<grid_for(total), kThreads, 0, stream>>>(
        g.const_data_ptr<scalar_t>(), idx.const_data_ptr<uint8_t>(),
        grad_input.mutable_data_ptr<scalar_t>(), total, H, W, OH, OW, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

// --------------------------------------------------------------------------------------------
// Batch norm helpers: (N, C, *) tensors, contiguous, seen as N x C x S.

// Sums a and b over the block; every thread gets the totals. blockDim.x must be kThreads.
template <typename acc_t>
__device__ __forceinline__ void block_sum2(acc_t& a, acc_t& b) {
  __shared__ acc_t sa[kThreads];
  __shared__ acc_t sb[kThreads];
  const int t = threadIdx.x;
  sa[t] = a;
  sb[t] = b;
  __syncthreads();
  for (int step = kThreads / 2; step > 0; step >>= 1) {
    if (t < step) {
      sa[t] += sa[t + step];
      sb[t] += sb[t + step];
    }
    __syncthreads();
  }
  a = sa[0];
  b = sb[0];
  __syncthreads();  // the buffers may be reused by the next call
}

struct NCS {
  int64_t N, C, S;
};

NCS ncs_of(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.dim() >= 2, op, ": expected a tensor of at least 2 dimensions (N, C, ...), got ",
              t.sizes());
  NCS d{t.size(0), t.size(1), 1};
  for (int64_t i = 2; i < t.dim(); ++i) d.S *= t.size(i);
  return d;
}

// A per-channel parameter as a contiguous tensor of the accumulation type, or undefined.
at::Tensor channel_param(const std::optional<at::Tensor>& t, int64_t C, at::ScalarType acc,
                         const at::Tensor& like, const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->numel() == C, op, ": ", name, " must have ", C, " elements, got ", t->sizes());
  check_same_device(*t, like, op);
  return t->to(acc).contiguous();
}

// --------------------------------------------------------------------------------------------
// 5. Training-mode BN backward from a value v with xhat = (v - shift[c]) * scale[c]: from
// the output y = xhat * w + b (shift = b, scale = 1 / w) or from the input x (shift = mean,
// scale = invstd). grad_input may be dy itself (each element is read before it is written).

template <typename scalar_t, typename acc_t>
__global__ void bn_backward_reduce_kernel(const scalar_t* __restrict__ dy,
                                          const scalar_t* __restrict__ v,
                                          const acc_t* __restrict__ shift,
                                          const acc_t* __restrict__ scale, NCS d,
                                          acc_t* __restrict__ sum_dy,
                                          acc_t* __restrict__ sum_dy_xhat) {
  const int64_t c = blockIdx.x;
  const int64_t m = d.N * d.S;
  acc_t s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < m; i += kThreads) {
    const int64_t n = i / d.S;
    const int64_t off = (n * d.C + c) * d.S + (i - n * d.S);
    const acc_t g = static_cast<acc_t>(dy[off]);
    s1 += g;
    s2 += g * (static_cast<acc_t>(v[off]) - shift[c]);
  }
  block_sum2(s1, s2);
  if (threadIdx.x == 0) {
    sum_dy[c] = s1;
    sum_dy_xhat[c] = s2 * scale[c];
  }
}

template <typename scalar_t, typename acc_t>
__global__ void bn_backward_input_kernel(const scalar_t* dy, const scalar_t* __restrict__ v,
                                         const acc_t* __restrict__ shift,
                                         const acc_t* __restrict__ scale,
                                         const acc_t* __restrict__ weight,
                                         const acc_t* __restrict__ invstd,
                                         const acc_t* __restrict__ sum_dy,
                                         const acc_t* __restrict__ sum_dy_xhat, NCS d,
                                         scalar_t* grad_input) {
  const int64_t total = d.N * d.C * d.S;
  const acc_t inv_m = acc_t(1) / static_cast<acc_t>(d.N * d.S);
  MONET_GRID_LOOP(i, total) {
    const int64_t c = (i / d.S) % d.C;
    const acc_t w = weight ? weight[c] : acc_t(1);
    const acc_t xhat = (static_cast<acc_t>(v[i]) - shift[c]) * scale[c];
    const acc_t g = static_cast<acc_t>(dy[i]);
    grad_input[i] = static_cast<scalar_t>(
        w * invstd[c] * (g - sum_dy[c] * inv_m - xhat * (sum_dy_xhat[c] * inv_m)));
  }
}

// Checks shared by the BN backward ops: v (the output or the input) against grad_output.
void check_bn_backward(const at::Tensor& grad_output, const at::Tensor& v,
                       const at::Tensor& save_invstd, const char* op, const char* v_name) {
  check_cuda(grad_output, op, "grad_output");
  check_cuda(v, op, v_name);
  check_cuda(save_invstd, op, "save_invstd");
  check_same_device(grad_output, v, op);
  check_same_device(grad_output, save_invstd, op);
  TORCH_CHECK(grad_output.sizes() == v.sizes(), op, ": grad_output has shape ",
              grad_output.sizes(), ", ", v_name, " ", v.sizes());
  TORCH_CHECK(grad_output.scalar_type() == v.scalar_type(), op, ": grad_output and ", v_name,
              " must have the same dtype, got ", grad_output.scalar_type(), " and ",
              v.scalar_type());
}

// Runs both kernels (the second into grad_input when defined); returns (sum_dy, sum_dy_xhat).
std::tuple<at::Tensor, at::Tensor> bn_backward_run(const at::Tensor& dy, const at::Tensor& v,
                                                   const at::Tensor& shift,
                                                   const at::Tensor& scale, const at::Tensor& w,
                                                   const at::Tensor& invstd, NCS d,
                                                   at::Tensor& grad_input) {
  const at::TensorOptions acc_opts = v.options().dtype(shift.scalar_type());
  at::Tensor sum_dy = at::zeros({d.C}, acc_opts);
  at::Tensor sum_dy_xhat = at::zeros({d.C}, acc_opts);
  auto stream = at::cuda::getCurrentCUDAStream();
  if (d.C > 0 && d.N * d.S > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(),
                                    "batch_norm_backward_cuda", [&] {
      using acc_t = at::acc_type<scalar_t, true>;
      bn_backward_reduce_kernel<scalar_t, acc_t><<<d.C, kThreads, 0, stream>>>(
          dy.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
          shift.const_data_ptr<acc_t>(), scale.const_data_ptr<acc_t>(), d,
          sum_dy.mutable_data_ptr<acc_t>(), sum_dy_xhat.mutable_data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (grad_input.defined()) {
        bn_backward_input_kernel<scalar_t, acc_t><<<grid_for(v.numel()), kThreads, 0, stream>>>(
            dy.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
            shift.const_data_ptr<acc_t>(), scale.const_data_ptr<acc_t>(),
            w.defined() ? w.const_data_ptr<acc_t>() : nullptr, invstd.const_data_ptr<acc_t>(),
            sum_dy.const_data_ptr<acc_t>(), sum_dy_xhat.const_data_ptr<acc_t>(), d,
            grad_input.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
  return {sum_dy, sum_dy_xhat};
}

// The parameters' gradients take the weight's dtype (the input's without one), as aten's do.
std::tuple<at::Tensor, at::Tensor> bn_param_grads(const at::Tensor& sum_dy,
                                                  const at::Tensor& sum_dy_xhat,
                                                  const std::optional<at::Tensor>& weight,
                                                  const at::Tensor& like,
                                                  std::array<bool, 3> output_mask) {
  const at::ScalarType param_dtype =
      (weight.has_value() && weight->defined()) ? weight->scalar_type() : like.scalar_type();
  at::Tensor grad_weight, grad_bias;
  if (output_mask[1]) grad_weight = sum_dy_xhat.to(param_dtype);
  if (output_mask[2]) grad_bias = sum_dy.to(param_dtype);
  return {grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_from_output_cuda(
    const at::Tensor& grad_output, const at::Tensor& output,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& save_invstd, std::array<bool, 3> output_mask) {
  const char* op = "batch_norm_backward_from_output";
  check_bn_backward(grad_output, output, save_invstd, op, "output");
  const NCS d = ncs_of(output, op);
  c10::cuda::CUDAGuard guard(output.device());
  const at::ScalarType acc = at::toAccumulateType(output.scalar_type(), /*is_cuda=*/true);
  const at::Tensor w = channel_param(weight, d.C, acc, output, op, "weight");
  const at::Tensor b = channel_param(bias, d.C, acc, output, op, "bias");
  TORCH_CHECK(save_invstd.numel() == d.C, op, ": save_invstd must have ", d.C,
              " elements, got ", save_invstd.sizes());
  const at::Tensor invstd = save_invstd.to(acc).contiguous();
  if (w.defined() && d.C > 0 && (output_mask[0] || output_mask[1])) {
    TORCH_CHECK(w.abs().ge(1e-8).all().item<bool>(), op,
                ": every |weight| must be at least 1e-8: the input is recovered from the "
                "output as (output - bias) / weight");
  }
  const at::TensorOptions acc_opts = output.options().dtype(acc);
  const at::Tensor shift = b.defined() ? b : at::zeros({d.C}, acc_opts);
  // 1 / w is read only where dx or dw is asked, and then |w| >= 1e-8 (checked above).
  const at::Tensor scale = w.defined() ? w.reciprocal() : at::zeros({d.C}, acc_opts).fill_(1);
  const at::Tensor dy = grad_output.contiguous();
  const at::Tensor y = output.contiguous();
  at::Tensor grad_input;
  if (output_mask[0]) grad_input = at::empty(y.sizes(), y.options());
  auto [sum_dy, sum_dy_xhat] = bn_backward_run(dy, y, shift, scale, w, invstd, d, grad_input);
  auto [grad_weight, grad_bias] = bn_param_grads(sum_dy, sum_dy_xhat, weight, output, output_mask);
  return {grad_input, grad_weight, grad_bias};
}

// (sum_dy, sum_dy_xhat) of BN backward from the input, with dx into grad_input if defined.
std::tuple<at::Tensor, at::Tensor> bn_backward_from_input_run(
    const at::Tensor& dy, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& save_mean, const at::Tensor& save_invstd, at::Tensor& grad_input,
    const char* op) {
  check_bn_backward(dy, input, save_invstd, op, "input");
  check_cuda(save_mean, op, "save_mean");
  const NCS d = ncs_of(input, op);
  c10::cuda::CUDAGuard guard(input.device());
  const at::ScalarType acc = at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true);
  const at::Tensor w = channel_param(weight, d.C, acc, input, op, "weight");
  TORCH_CHECK(save_mean.numel() == d.C && save_invstd.numel() == d.C, op,
              ": save_mean and save_invstd must have ", d.C, " elements, got ",
              save_mean.sizes(), " and ", save_invstd.sizes());
  const at::Tensor mean = save_mean.to(acc).contiguous();
  const at::Tensor invstd = save_invstd.to(acc).contiguous();
  return bn_backward_run(dy, input.contiguous(), mean, invstd, w, invstd, d, grad_input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_from_input_cuda(
    const at::Tensor& grad_output, const at::Tensor& input,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, std::array<bool, 3> output_mask) {
  const at::Tensor dy = grad_output.contiguous();
  at::Tensor grad_input;
  if (output_mask[0]) grad_input = at::empty(dy.sizes(), dy.options());
  auto [sum_dy, sum_dy_xhat] = bn_backward_from_input_run(
      dy, input, weight, save_mean, save_invstd, grad_input, "batch_norm_backward_from_input");
  auto [grad_weight, grad_bias] = bn_param_grads(sum_dy, sum_dy_xhat, weight, input, output_mask);
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor> batch_norm_backward_from_input_inplace_cuda(
    at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& save_mean, const at::Tensor& save_invstd,
    std::array<bool, 3> output_mask) {
  const char* op = "batch_norm_backward_from_input_";
  TORCH_CHECK(output_mask[0], op, ": output_mask[0] must be true (the op writes the input's "
              "gradient over grad_output)");
  TORCH_CHECK(grad_output.is_contiguous(), op,
              ": grad_output must be contiguous to take the input's gradient in place");
  auto [sum_dy, sum_dy_xhat] = bn_backward_from_input_run(grad_output, input, weight, save_mean,
                                                          save_invstd, grad_output, op);
  return bn_param_grads(sum_dy, sum_dy_xhat, weight, input, output_mask);
}

// --------------------------------------------------------------------------------------------
// 6. hardtanh_backward_from_output: dy where min < y < max, else 0. Written as aten's
// hardtanh_backward test (zero where y <= min or y >= max), as the CPU kernel is: a NaN output
// keeps its gradient.

template <typename scalar_t>
__global__ void hardtanh_backward_from_output_kernel(const scalar_t* __restrict__ dy,
                                                     const scalar_t* __restrict__ y,
                                                     scalar_t* __restrict__ out, int64_t n,
                                                     at::opmath_type<scalar_t> lo,
                                                     at::opmath_type<scalar_t> hi) {
  using opmath_t = at::opmath_type<scalar_t>;
  MONET_GRID_LOOP(k, n) {
    const opmath_t v = static_cast<opmath_t>(y[k]);
    out[k] = (v <= lo || v >= hi) ? scalar_t(0) : dy[k];
  }
}

at::Tensor hardtanh_backward_from_output_cuda(const at::Tensor& grad_output,
                                              const at::Tensor& output,
                                              const at::Scalar& min_val,
                                              const at::Scalar& max_val) {
  const char* op = "hardtanh_backward_from_output";
  check_cuda(grad_output, op, "grad_output");
  check_cuda(output, op, "output");
  check_same_device(grad_output, output, op);
  TORCH_CHECK(grad_output.sizes() == output.sizes(), op, ": grad_output has shape ",
              grad_output.sizes(), ", output ", output.sizes());
  TORCH_CHECK(grad_output.scalar_type() == output.scalar_type(), op,
              ": grad_output and output must have the same dtype, got ",
              grad_output.scalar_type(), " and ", output.scalar_type());
  c10::cuda::CUDAGuard guard(output.device());
  const at::Tensor dy = grad_output.contiguous();
  const at::Tensor y = output.contiguous();
  at::Tensor out = at::empty(dy.sizes(), dy.options());
  const int64_t n = dy.numel();
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(),
                                  "hardtanh_backward_from_output_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    hardtanh_backward_from_output_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        dy.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
        out.mutable_data_ptr<scalar_t>(), n, min_val.to<opmath_t>(), max_val.to<opmath_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// --------------------------------------------------------------------------------------------
// 7. batch_norm_inplace_: training-mode BN forward over x's own storage. One block a channel:
// the mean, then the biased variance from the mean (two passes: no cancellation), then the
// normalization in place.

template <typename scalar_t, typename acc_t>
__global__ void bn_inplace_kernel(scalar_t* __restrict__ x, const acc_t* __restrict__ weight,
                                  const acc_t* __restrict__ bias, NCS d, acc_t eps,
                                  acc_t* __restrict__ save_mean, acc_t* __restrict__ save_invstd,
                                  acc_t* __restrict__ var_unbiased) {
  const int64_t c = blockIdx.x;
  const int64_t m = d.N * d.S;
  auto offset = [&](int64_t i) {
    const int64_t n = i / d.S;
    return (n * d.C + c) * d.S + (i - n * d.S);
  };
  acc_t sum = 0, unused = 0;
  for (int64_t i = threadIdx.x; i < m; i += kThreads) sum += static_cast<acc_t>(x[offset(i)]);
  block_sum2(sum, unused);
  const acc_t mean = sum / static_cast<acc_t>(m);
  acc_t sq = 0;
  unused = 0;
  for (int64_t i = threadIdx.x; i < m; i += kThreads) {
    const acc_t dev = static_cast<acc_t>(x[offset(i)]) - mean;
    sq += dev * dev;
  }
  block_sum2(sq, unused);
  const acc_t var = sq / static_cast<acc_t>(m);
  // aten's InvStd: 0 rather than inf when both var and eps are 0.
  const acc_t invstd =
      (var == acc_t(0) && eps == acc_t(0)) ? acc_t(0) : acc_t(1) / ::sqrt(var + eps);
  if (threadIdx.x == 0) {
    save_mean[c] = mean;
    save_invstd[c] = invstd;
    var_unbiased[c] = sq / static_cast<acc_t>(m - 1);  // m == 1 gives inf or NaN, as on CPU
  }
  const acc_t w = weight ? weight[c] : acc_t(1);
  const acc_t b = bias ? bias[c] : acc_t(0);
  const acc_t scale = invstd * w;
  for (int64_t i = threadIdx.x; i < m; i += kThreads) {
    const int64_t off = offset(i);
    x[off] = static_cast<scalar_t>((static_cast<acc_t>(x[off]) - mean) * scale + b);
  }
}

std::tuple<at::Tensor, at::Tensor> batch_norm_inplace_cuda(
    at::Tensor& self, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  const char* op = "batch_norm_inplace_";
  check_cuda(self, op, "self");
  const NCS d = ncs_of(self, op);
  TORCH_CHECK(d.N * d.S > 0, op, ": no values per channel, input size ", self.sizes());
  c10::cuda::CUDAGuard guard(self.device());
  const at::ScalarType acc = at::toAccumulateType(self.scalar_type(), /*is_cuda=*/true);
  const at::Tensor w = channel_param(weight, d.C, acc, self, op, "weight");
  const at::Tensor b = channel_param(bias, d.C, acc, self, op, "bias");
  const bool has_rm = running_mean.has_value() && running_mean->defined();
  const bool has_rv = running_var.has_value() && running_var->defined();
  if (has_rm) {
    TORCH_CHECK(running_mean->numel() == d.C, op, ": running_mean must have ", d.C,
                " elements, got ", running_mean->sizes());
    check_same_device(*running_mean, self, op);
  }
  if (has_rv) {
    TORCH_CHECK(running_var->numel() == d.C, op, ": running_var must have ", d.C,
                " elements, got ", running_var->sizes());
    check_same_device(*running_var, self, op);
  }
  const at::TensorOptions acc_opts = self.options().dtype(acc);
  at::Tensor save_mean = at::empty({d.C}, acc_opts);
  at::Tensor save_invstd = at::empty({d.C}, acc_opts);
  at::Tensor var_unbiased = at::empty({d.C}, acc_opts);
  if (d.C == 0) return {save_mean, save_invstd};
  // Works on self's storage when it is contiguous; otherwise on a contiguous copy, copied back.
  at::Tensor x = self.is_contiguous() ? self : self.contiguous();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "batch_norm_inplace_cuda", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    bn_inplace_kernel<scalar_t, acc_t><<<d.C, kThreads, 0, stream>>>(
        x.mutable_data_ptr<scalar_t>(), w.defined() ? w.const_data_ptr<acc_t>() : nullptr,
        b.defined() ? b.const_data_ptr<acc_t>() : nullptr, d, static_cast<acc_t>(eps),
        save_mean.mutable_data_ptr<acc_t>(), save_invstd.mutable_data_ptr<acc_t>(),
        var_unbiased.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!x.is_same(self)) self.copy_(x);
  if (has_rm) {
    at::Tensor rm = *running_mean;
    rm.mul_(1.0 - momentum).add_(save_mean.reshape(rm.sizes()), momentum);
  }
  if (has_rv) {
    at::Tensor rv = *running_var;
    rv.mul_(1.0 - momentum).add_(var_unbiased.reshape(rv.sizes()), momentum);
  }
  return {save_mean, save_invstd};
}

// --------------------------------------------------------------------------------------------
// cuDNN convolution with an explicitly chosen algorithm (2-D, NCHW), through the cuDNN v9
// "legacy" convolution API (cudnn_cnn.h): descriptors, cudnnGetConvolution*Algorithm_v7,
// cudnnGetConvolution*WorkspaceSize and cudnnConvolution{Forward,BackwardData,BackwardFilter}.
// The workspace comes from torch's caching allocator (at::empty of bytes), so it shows in
// torch.cuda's memory statistics.

#ifdef MONET_LIKE_WITH_CUDNN

const char* const kFwdNames[] = {"IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT",
                                 "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"};
const char* const kBwdDataNames[] = {"ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD",
                                     "WINOGRAD_NONFUSED"};
const char* const kBwdFilterNames[] = {"ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD",
                                       "WINOGRAD_NONFUSED", "FFT_TILING"};
static_assert(sizeof(kFwdNames) / sizeof(kFwdNames[0]) == CUDNN_CONVOLUTION_FWD_ALGO_COUNT);
static_assert(sizeof(kBwdDataNames) / sizeof(kBwdDataNames[0]) ==
              CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT);
static_assert(sizeof(kBwdFilterNames) / sizeof(kBwdFilterNames[0]) ==
              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);

const char* const kDirection[] = {"forward", "backward-data", "backward-weight"};

int64_t algo_count(int64_t which) {
  if (which == 0) return CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
  if (which == 1) return CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
  return CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
}

const char* algo_name(int64_t which, int64_t algo) {
  if (algo < 0 || algo >= algo_count(which)) return "?";
  return which == 0 ? kFwdNames[algo] : which == 1 ? kBwdDataNames[algo] : kBwdFilterNames[algo];
}

#define MONET_CUDNN_CHECK(expr, what)                                                   \
  do {                                                                                  \
    const cudnnStatus_t monet_status_ = (expr);                                         \
    TORCH_CHECK(monet_status_ == CUDNN_STATUS_SUCCESS, "cuDNN: ", what, " failed: ",    \
                cudnnGetErrorString(monet_status_));                                    \
  } while (0)

class TensorDesc {
 public:
  TensorDesc() {
    MONET_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc_), "cudnnCreateTensorDescriptor");
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc_); }
  TensorDesc(const TensorDesc&) = delete;
  TensorDesc& operator=(const TensorDesc&) = delete;
  void set_nchw(cudnnDataType_t dtype, const std::array<int, 4>& dims) {
    const std::array<int, 4> strides{dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1};
    MONET_CUDNN_CHECK(cudnnSetTensorNdDescriptor(desc_, dtype, 4, dims.data(), strides.data()),
                      "cudnnSetTensorNdDescriptor");
  }
  cudnnTensorDescriptor_t get() const { return desc_; }

 private:
  cudnnTensorDescriptor_t desc_ = nullptr;
};

class FilterDesc {
 public:
  FilterDesc() {
    MONET_CUDNN_CHECK(cudnnCreateFilterDescriptor(&desc_), "cudnnCreateFilterDescriptor");
  }
  ~FilterDesc() { cudnnDestroyFilterDescriptor(desc_); }
  FilterDesc(const FilterDesc&) = delete;
  FilterDesc& operator=(const FilterDesc&) = delete;
  void set_nchw(cudnnDataType_t dtype, const std::array<int, 4>& dims) {
    MONET_CUDNN_CHECK(cudnnSetFilterNdDescriptor(desc_, dtype, CUDNN_TENSOR_NCHW, 4, dims.data()),
                      "cudnnSetFilterNdDescriptor");
  }
  cudnnFilterDescriptor_t get() const { return desc_; }

 private:
  cudnnFilterDescriptor_t desc_ = nullptr;
};

class ConvDesc {
 public:
  ConvDesc() {
    MONET_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&desc_), "cudnnCreateConvolutionDescriptor");
  }
  ~ConvDesc() { cudnnDestroyConvolutionDescriptor(desc_); }
  ConvDesc(const ConvDesc&) = delete;
  ConvDesc& operator=(const ConvDesc&) = delete;
  cudnnConvolutionDescriptor_t get() const { return desc_; }

 private:
  cudnnConvolutionDescriptor_t desc_ = nullptr;
};

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= INT_MAX, "conv_cudnn: ", what, " = ", v,
              " does not fit the int that cuDNN takes");
  return static_cast<int>(v);
}

int64_t list_item(at::IntArrayRef v, size_t i, const char* name) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, "conv_cudnn: ", name,
              " must have one or two elements (2-D convolution), got ", v);
  return v.size() == 1 ? v[0] : v[i];
}

// One 2-D convolution problem: its descriptors, built from the shapes alone.
struct ConvProblem {
  cudnnHandle_t handle = nullptr;
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  bool is_double = false;
  std::array<int64_t, 4> out_size{};

  ConvProblem(at::IntArrayRef in_size, at::IntArrayRef w_size, at::ScalarType dtype,
              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
              int64_t groups) {
    TORCH_CHECK(in_size.size() == 4, "conv_cudnn: expected a 4-D (N, C, H, W) input, got size ",
                in_size);
    TORCH_CHECK(w_size.size() == 4,
                "conv_cudnn: expected a 4-D (C_out, C_in / groups, kH, kW) weight, got size ",
                w_size);
    cudnnDataType_t data_type;
    switch (dtype) {
      case at::kFloat: data_type = CUDNN_DATA_FLOAT; break;
      case at::kDouble: data_type = CUDNN_DATA_DOUBLE; break;
      case at::kHalf: data_type = CUDNN_DATA_HALF; break;
      case at::kBFloat16: data_type = CUDNN_DATA_BFLOAT16; break;
      default:
        TORCH_CHECK(false, "conv_cudnn: dtype ", dtype,
                    " is not supported (float, double, half, bfloat16)");
    }
    is_double = dtype == at::kDouble;
    TORCH_CHECK(groups >= 1, "conv_cudnn: groups must be positive, got ", groups);
    TORCH_CHECK(in_size[1] == w_size[1] * groups, "conv_cudnn: the input has ", in_size[1],
                " channels, the weight expects ", w_size[1], " x ", groups, " groups");
    TORCH_CHECK(w_size[0] % groups == 0, "conv_cudnn: ", w_size[0],
                " output channels are not divisible by groups = ", groups);
    int pad[2], str[2], dil[2];
    for (size_t i = 0; i < 2; ++i) {
      pad[i] = to_int(list_item(padding, i, "padding"), "padding");
      str[i] = to_int(list_item(stride, i, "stride"), "stride");
      dil[i] = to_int(list_item(dilation, i, "dilation"), "dilation");
      TORCH_CHECK(str[i] > 0 && dil[i] > 0, "conv_cudnn: stride and dilation must be positive");
    }
    out_size[0] = in_size[0];
    out_size[1] = w_size[0];
    for (size_t i = 0; i < 2; ++i) {
      const int64_t span = int64_t(dil[i]) * (w_size[2 + i] - 1) + 1;
      const int64_t padded = in_size[2 + i] + 2 * int64_t(pad[i]);
      TORCH_CHECK(padded >= span, "conv_cudnn: the kernel (", w_size, ", dilation ", dilation,
                  ") is larger than the padded input (", in_size, ", padding ", padding, ")");
      out_size[2 + i] = (padded - span) / str[i] + 1;
    }
    std::array<int, 4> xd, wd, yd;
    for (size_t i = 0; i < 4; ++i) {
      xd[i] = to_int(in_size[i], "input size");
      wd[i] = to_int(w_size[i], "weight size");
      yd[i] = to_int(out_size[i], "output size");
    }
    for (const auto* sz : {&in_size, &w_size}) {
      int64_t numel = 1;
      for (int64_t s : *sz) numel *= s;
      to_int(numel, "number of elements");
    }
    to_int(out_size[0] * out_size[1] * out_size[2] * out_size[3], "number of output elements");
    TORCH_CHECK(xd[0] > 0 && xd[1] > 0 && yd[2] > 0 && yd[3] > 0 && wd[0] > 0,
                "conv_cudnn: empty tensors are not supported, input ", in_size, ", weight ",
                w_size);
    x.set_nchw(data_type, xd);
    w.set_nchw(data_type, wd);
    y.set_nchw(data_type, yd);
    const cudnnDataType_t compute_type = is_double ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    MONET_CUDNN_CHECK(cudnnSetConvolutionNdDescriptor(conv.get(), 2, pad, str, dil,
                                                      CUDNN_CROSS_CORRELATION, compute_type),
                      "cudnnSetConvolutionNdDescriptor");
    MONET_CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv.get(), static_cast<int>(groups)),
                      "cudnnSetConvolutionGroupCount");
    // Tensor cores for half and bfloat16; for float as torch.backends.cudnn.allow_tf32 says.
    cudnnMathType_t math = CUDNN_DEFAULT_MATH;
    if (dtype == at::kHalf || dtype == at::kBFloat16) {
      math = CUDNN_TENSOR_OP_MATH;
    } else if (dtype == at::kFloat) {
      math = at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) ? CUDNN_TENSOR_OP_MATH
                                                                     : CUDNN_FMA_MATH;
    }
    MONET_CUDNN_CHECK(cudnnSetConvolutionMathType(conv.get(), math), "cudnnSetConvolutionMathType");
    handle = at::native::getCudnnHandle();
    MONET_CUDNN_CHECK(cudnnSetStream(handle, at::cuda::getCurrentCUDAStream()), "cudnnSetStream");
  }

  // The workspace in bytes, or nullopt where cuDNN refuses the algorithm for this problem.
  std::optional<size_t> workspace(int64_t which, int64_t algo) const {
    if (algo < 0 || algo >= algo_count(which)) return std::nullopt;
    size_t bytes = 0;
    cudnnStatus_t st;
    if (which == 0) {
      st = cudnnGetConvolutionForwardWorkspaceSize(handle, x.get(), w.get(), conv.get(), y.get(),
                                                   static_cast<cudnnConvolutionFwdAlgo_t>(algo),
                                                   &bytes);
    } else if (which == 1) {
      st = cudnnGetConvolutionBackwardDataWorkspaceSize(
          handle, w.get(), y.get(), conv.get(), x.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), &bytes);
    } else {
      st = cudnnGetConvolutionBackwardFilterWorkspaceSize(
          handle, x.get(), y.get(), conv.get(), w.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), &bytes);
    }
    if (st != CUDNN_STATUS_SUCCESS) return std::nullopt;
    return bytes;
  }

  size_t require_workspace(int64_t which, int64_t algo) const {
    TORCH_CHECK(which >= 0 && which <= 2, "conv_cudnn: which must be 0 (forward), 1 "
                "(backward-data) or 2 (backward-weight), got ", which);
    TORCH_CHECK(algo >= 0 && algo < algo_count(which), "conv_cudnn: ", kDirection[which],
                " algorithm ", algo, " is out of range [0, ", algo_count(which), ")");
    const std::optional<size_t> bytes = workspace(which, algo);
    TORCH_CHECK(bytes.has_value(), "conv_cudnn: cuDNN refuses ", kDirection[which],
                " algorithm ", algo, " (", algo_name(which, algo),
                ") for this convolution; conv_cudnn_algorithms lists the supported ones");
    return *bytes;
  }

  // The supported algorithms of one direction: those cudnnGetConvolution*Algorithm_v7 reports
  // with CUDNN_STATUS_SUCCESS and whose workspace size cuDNN gives, in the heuristic's order,
  // each once (the heuristic may list an algorithm once per math type).
  std::vector<int64_t> algorithms(int64_t which) const {
    std::vector<int64_t> ids;
    auto add = [&](int64_t algo, cudnnStatus_t status) {
      if (status != CUDNN_STATUS_SUCCESS) return;
      for (int64_t seen : ids) {
        if (seen == algo) return;
      }
      if (workspace(which, algo).has_value()) ids.push_back(algo);
    };
    int max_count = 0, returned = 0;
    if (which == 0) {
      MONET_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &max_count),
                        "cudnnGetConvolutionForwardAlgorithmMaxCount");
      std::vector<cudnnConvolutionFwdAlgoPerf_t> perf(std::max(max_count, 1));
      MONET_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, x.get(), w.get(),
                                                               conv.get(), y.get(), max_count,
                                                               &returned, perf.data()),
                        "cudnnGetConvolutionForwardAlgorithm_v7");
      for (int i = 0; i < returned; ++i) add(perf[i].algo, perf[i].status);
    } else if (which == 1) {
      MONET_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &max_count),
                        "cudnnGetConvolutionBackwardDataAlgorithmMaxCount");
      std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perf(std::max(max_count, 1));
      MONET_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, w.get(), y.get(),
                                                                    conv.get(), x.get(),
                                                                    max_count, &returned,
                                                                    perf.data()),
                        "cudnnGetConvolutionBackwardDataAlgorithm_v7");
      for (int i = 0; i < returned; ++i) add(perf[i].algo, perf[i].status);
    } else {
      MONET_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &max_count),
                        "cudnnGetConvolutionBackwardFilterAlgorithmMaxCount");
      std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perf(std::max(max_count, 1));
      MONET_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, x.get(), y.get(),
                                                                      conv.get(), w.get(),
                                                                      max_count, &returned,
                                                                      perf.data()),
                        "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
      for (int i = 0; i < returned; ++i) add(perf[i].algo, perf[i].status);
    }
    return ids;
  }

  const void* one() const { return is_double ? static_cast<const void*>(&kOneD) : &kOneF; }
  const void* zero() const { return is_double ? static_cast<const void*>(&kZeroD) : &kZeroF; }

 private:
  static constexpr float kOneF = 1.0f, kZeroF = 0.0f;
  static constexpr double kOneD = 1.0, kZeroD = 0.0;
};

void check_conv_tensor(const at::Tensor& t, const at::Tensor& like, const char* op,
                       const char* name) {
  check_cuda(t, op, name);
  check_same_device(t, like, op);
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " has dtype ",
              t.scalar_type(), ", expected ", like.scalar_type());
}

// A workspace from the caching allocator; stays alive until the caller's kernels are queued
// (the allocator's stream semantics make its reuse safe after that).
at::Tensor workspace_tensor(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// Encoding: [n_fwd, fwd algorithm ids..., n_bwd_data, bwd-data ids..., n_bwd_filter,
// bwd-filter ids...], each group in cuDNN's heuristic order (best first), ids being the
// cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t values.
std::vector<int64_t> conv_cudnn_algorithms_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                at::IntArrayRef stride, at::IntArrayRef padding,
                                                at::IntArrayRef dilation, int64_t groups) {
  const char* op = "conv_cudnn_algorithms";
  check_cuda(input, op, "input");
  check_conv_tensor(weight, input, op, "weight");
  c10::cuda::CUDAGuard guard(input.device());
  const ConvProblem prob(input.sizes(), weight.sizes(), input.scalar_type(), stride, padding,
                         dilation, groups);
  std::vector<int64_t> flat;
  for (int64_t which = 0; which < 3; ++which) {
    const std::vector<int64_t> ids = prob.algorithms(which);
    flat.push_back(static_cast<int64_t>(ids.size()));
    flat.insert(flat.end(), ids.begin(), ids.end());
  }
  return flat;
}

int64_t conv_cudnn_workspace_cuda(const at::Tensor& input, const at::Tensor& weight,
                                  at::IntArrayRef stride, at::IntArrayRef padding,
                                  at::IntArrayRef dilation, int64_t groups, int64_t which,
                                  int64_t algo) {
  const char* op = "conv_cudnn_workspace";
  check_cuda(input, op, "input");
  check_conv_tensor(weight, input, op, "weight");
  c10::cuda::CUDAGuard guard(input.device());
  const ConvProblem prob(input.sizes(), weight.sizes(), input.scalar_type(), stride, padding,
                         dilation, groups);
  return static_cast<int64_t>(prob.require_workspace(which, algo));
}

at::Tensor conv_cudnn_forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                                   at::IntArrayRef padding, at::IntArrayRef dilation,
                                   int64_t groups, int64_t algo) {
  const char* op = "conv_cudnn_forward";
  check_cuda(input, op, "input");
  check_conv_tensor(weight, input, op, "weight");
  c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const ConvProblem prob(x.sizes(), w.sizes(), x.scalar_type(), stride, padding, dilation,
                         groups);
  const size_t ws_bytes = prob.require_workspace(0, algo);
  at::Tensor out = at::empty(at::IntArrayRef(prob.out_size), x.options());
  at::Tensor ws = workspace_tensor(ws_bytes, x);
  const cudnnStatus_t st = cudnnConvolutionForward(
      prob.handle, prob.one(), prob.x.get(), x.const_data_ptr(), prob.w.get(), w.const_data_ptr(),
      prob.conv.get(), static_cast<cudnnConvolutionFwdAlgo_t>(algo),
      ws_bytes ? ws.mutable_data_ptr() : nullptr, ws_bytes, prob.zero(), prob.y.get(),
      out.mutable_data_ptr());
  TORCH_CHECK(st == CUDNN_STATUS_SUCCESS, op, ": cuDNN forward algorithm ", algo, " (",
              algo_name(0, algo), ") failed: ", cudnnGetErrorString(st));
  if (bias.has_value() && bias->defined()) {
    check_conv_tensor(*bias, input, op, "bias");
    TORCH_CHECK(bias->numel() == prob.out_size[1], op, ": bias must have ", prob.out_size[1],
                " elements, got ", bias->sizes());
    out.add_(bias->reshape({1, prob.out_size[1], 1, 1}));
  }
  return out;
}

at::Tensor conv_cudnn_backward_data_cuda(const at::Tensor& grad_output, const at::Tensor& weight,
                                         c10::SymIntArrayRef input_size, at::IntArrayRef stride,
                                         at::IntArrayRef padding, at::IntArrayRef dilation,
                                         int64_t groups, int64_t algo) {
  const char* op = "conv_cudnn_backward_data";
  check_cuda(grad_output, op, "grad_output");
  check_conv_tensor(weight, grad_output, op, "weight");
  c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor dy = grad_output.contiguous();
  const at::Tensor w = weight.contiguous();
  const at::IntArrayRef in_size = C10_AS_INTARRAYREF_SLOW(input_size);
  const ConvProblem prob(in_size, w.sizes(), dy.scalar_type(), stride, padding, dilation, groups);
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(prob.out_size), op, ": grad_output has shape ",
              dy.sizes(), ", the convolution's output has ", at::IntArrayRef(prob.out_size));
  const size_t ws_bytes = prob.require_workspace(1, algo);
  at::Tensor grad_input = at::empty(in_size, dy.options());
  at::Tensor ws = workspace_tensor(ws_bytes, dy);
  const cudnnStatus_t st = cudnnConvolutionBackwardData(
      prob.handle, prob.one(), prob.w.get(), w.const_data_ptr(), prob.y.get(),
      dy.const_data_ptr(), prob.conv.get(), static_cast<cudnnConvolutionBwdDataAlgo_t>(algo),
      ws_bytes ? ws.mutable_data_ptr() : nullptr, ws_bytes, prob.zero(), prob.x.get(),
      grad_input.mutable_data_ptr());
  TORCH_CHECK(st == CUDNN_STATUS_SUCCESS, op, ": cuDNN backward-data algorithm ", algo, " (",
              algo_name(1, algo), ") failed: ", cudnnGetErrorString(st));
  return grad_input;
}

at::Tensor conv_cudnn_backward_weight_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                           c10::SymIntArrayRef weight_size,
                                           at::IntArrayRef stride, at::IntArrayRef padding,
                                           at::IntArrayRef dilation, int64_t groups,
                                           int64_t algo) {
  const char* op = "conv_cudnn_backward_weight";
  check_cuda(grad_output, op, "grad_output");
  check_conv_tensor(input, grad_output, op, "input");
  c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor dy = grad_output.contiguous();
  const at::Tensor x = input.contiguous();
  const at::IntArrayRef w_size = C10_AS_INTARRAYREF_SLOW(weight_size);
  const ConvProblem prob(x.sizes(), w_size, dy.scalar_type(), stride, padding, dilation, groups);
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(prob.out_size), op, ": grad_output has shape ",
              dy.sizes(), ", the convolution's output has ", at::IntArrayRef(prob.out_size));
  const size_t ws_bytes = prob.require_workspace(2, algo);
  at::Tensor grad_weight = at::empty(w_size, dy.options());
  at::Tensor ws = workspace_tensor(ws_bytes, dy);
  const cudnnStatus_t st = cudnnConvolutionBackwardFilter(
      prob.handle, prob.one(), prob.x.get(), x.const_data_ptr(), prob.y.get(),
      dy.const_data_ptr(), prob.conv.get(), static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo),
      ws_bytes ? ws.mutable_data_ptr() : nullptr, ws_bytes, prob.zero(), prob.w.get(),
      grad_weight.mutable_data_ptr());
  TORCH_CHECK(st == CUDNN_STATUS_SUCCESS, op, ": cuDNN backward-weight algorithm ", algo, " (",
              algo_name(2, algo), ") failed: ", cudnnGetErrorString(st));
  return grad_weight;
}

#endif  // MONET_LIKE_WITH_CUDNN

// --------------------------------------------------------------------------------------------
// The device-generic conv ops of csrc/ops.cpp on CUDA: algorithm -1 is PyTorch's own choice
// (at::convolution), any other is a cuDNN algorithm id of its direction.

constexpr int64_t kAtenAlgo = -1;

at::Tensor conv2d_algo_cuda(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            int64_t algo) {
  if (algo == kAtenAlgo) {
    return at::convolution(input, weight, bias, stride, padding, dilation, false, {0, 0}, groups);
  }
#ifdef MONET_LIKE_WITH_CUDNN
  return conv_cudnn_forward_cuda(input, weight, bias, stride, padding, dilation, groups, algo);
#else
  TORCH_CHECK(false, "conv2d_algo: algorithm ", algo, " needs cuDNN, absent from this build");
#endif
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_algo_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> output_mask, int64_t algo_data, int64_t algo_weight) {
#ifndef MONET_LIKE_WITH_CUDNN
  TORCH_CHECK(algo_data == kAtenAlgo && algo_weight == kAtenAlgo, "conv2d_backward_algo: ",
              "algorithms other than -1 need cuDNN, absent from this build");
#endif
  auto aten_part = [&](std::array<bool, 3> mask) {
    return at::convolution_backward(grad_output, input, weight, std::nullopt, stride, padding,
                                    dilation, false, {0, 0}, groups, mask);
  };
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0] && output_mask[1] && algo_data == kAtenAlgo && algo_weight == kAtenAlgo) {
    std::tie(grad_input, grad_weight, std::ignore) = aten_part({true, true, false});
    output_mask[0] = output_mask[1] = false;  // done: one call, as in eager autograd
  }
  if (output_mask[0]) {
#ifdef MONET_LIKE_WITH_CUDNN
    grad_input = algo_data == kAtenAlgo
                     ? std::get<0>(aten_part({true, false, false}))
                     : conv_cudnn_backward_data_cuda(grad_output, weight, input.sym_sizes(), stride,
                                                     padding, dilation, groups, algo_data);
#else
    grad_input = std::get<0>(aten_part({true, false, false}));
#endif
  }
  if (output_mask[1]) {
#ifdef MONET_LIKE_WITH_CUDNN
    grad_weight = algo_weight == kAtenAlgo
                      ? std::get<1>(aten_part({false, true, false}))
                      : conv_cudnn_backward_weight_cuda(grad_output, input, weight.sym_sizes(),
                                                        stride, padding, dilation, groups,
                                                        algo_weight);
#else
    grad_weight = std::get<1>(aten_part({false, true, false}));
#endif
  }
  if (output_mask[2]) grad_bias = grad_output.sum({0, 2, 3});
  return {grad_input, grad_weight, grad_bias};
}

// [n_forward, ids..., n_backward_data, ids..., n_backward_weight, ids...], -1 first in each.
std::vector<int64_t> conv2d_algorithms_cuda(const at::Tensor& input, const at::Tensor& weight,
                                            at::IntArrayRef stride, at::IntArrayRef padding,
                                            at::IntArrayRef dilation, int64_t groups) {
#ifdef MONET_LIKE_WITH_CUDNN
  const std::vector<int64_t> cudnn =
      conv_cudnn_algorithms_cuda(input, weight, stride, padding, dilation, groups);
#else
  const std::vector<int64_t> cudnn = {0, 0, 0};
#endif
  std::vector<int64_t> flat;
  size_t at = 0;
  for (int which = 0; which < 3; ++which) {
    const int64_t n = cudnn[at++];
    flat.push_back(n + 1);
    flat.push_back(kAtenAlgo);
    flat.insert(flat.end(), cudnn.begin() + at, cudnn.begin() + at + n);
    at += n;
  }
  return flat;
}

}  // namespace monet_like_cuda

#ifdef MONET_LIKE_WITH_CUDNN
// Ops that exist only in a CUDA build with cuDNN.
TORCH_LIBRARY_FRAGMENT(monet_like, m) {
  m.def("conv_cudnn_algorithms(Tensor input, Tensor weight, int[] stride, int[] padding, "
        "int[] dilation, int groups) -> int[]");
  m.def("conv_cudnn_forward(Tensor input, Tensor weight, Tensor? bias, int[] stride, "
        "int[] padding, int[] dilation, int groups, int algo) -> Tensor");
  m.def("conv_cudnn_backward_data(Tensor grad_output, Tensor weight, SymInt[] input_size, "
        "int[] stride, int[] padding, int[] dilation, int groups, int algo) -> Tensor");
  m.def("conv_cudnn_backward_weight(Tensor grad_output, Tensor input, SymInt[] weight_size, "
        "int[] stride, int[] padding, int[] dilation, int groups, int algo) -> Tensor");
  m.def("conv_cudnn_workspace(Tensor input, Tensor weight, int[] stride, int[] padding, "
        "int[] dilation, int groups, int which, int algo) -> int");
}
#endif

TORCH_LIBRARY_IMPL(monet_like, CUDA, m) {
  using namespace monet_like_cuda;
  m.impl("relu_mask", &relu_mask_cuda);
  m.impl("relu_backward_mask", &relu_backward_mask_cuda);
  m.impl("max_pool2d_compact", &max_pool2d_compact_cuda);
  m.impl("max_pool2d_compact_backward", &max_pool2d_compact_backward_cuda);
  m.impl("batch_norm_backward_from_output", &batch_norm_backward_from_output_cuda);
  m.impl("batch_norm_backward_from_input", &batch_norm_backward_from_input_cuda);
  m.impl("batch_norm_backward_from_input_", &batch_norm_backward_from_input_inplace_cuda);
  m.impl("hardtanh_backward_from_output", &hardtanh_backward_from_output_cuda);
  m.impl("batch_norm_inplace_", &batch_norm_inplace_cuda);
  m.impl("conv2d_algo", &conv2d_algo_cuda);
  m.impl("conv2d_backward_algo", &conv2d_backward_algo_cuda);
  m.impl("conv2d_algorithms", &conv2d_algorithms_cuda);
#ifdef MONET_LIKE_WITH_CUDNN
  m.impl("conv_cudnn_algorithms", &conv_cudnn_algorithms_cuda);
  m.impl("conv_cudnn_forward", &conv_cudnn_forward_cuda);
  m.impl("conv_cudnn_backward_data", &conv_cudnn_backward_data_cuda);
  m.impl("conv_cudnn_backward_weight", &conv_cudnn_backward_weight_cuda);
  m.impl("conv_cudnn_workspace", &conv_cudnn_workspace_cuda);
#endif
}
