// Memory-lean CPU variants of a few aten ops, registered as torch.ops.monet_like.*.
//
// They let a replayed training step keep less: a 1-bit ReLU mask instead of the
// activation, a 1-byte max-pool index instead of an int64 one, BatchNorm and
// hardtanh backward from the output instead of the input, and a BatchNorm forward
// that overwrites its input. Each matches the aten op it replaces (bitwise where
// the aten kernel's order of operations can be followed, see the comments).

#ifdef MONET_LIKE_PYTHON_MODULE
// setup.py builds this file as the Python module monet_like._C; importing it runs
// the registrations below. The JIT build loads it as a plain shared library.
#include <Python.h>
#endif

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace monet_like {
namespace {

// Elements per parallel task: below this, threads cost more than they save.
constexpr int64_t kGrain = 32768;

int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, work_per_item));
}

// ---------------------------------------------------------------------------
// ReLU with a bit mask

at::Tensor relu_mask(const at::Tensor& self) {
  const at::Tensor x = self.contiguous();
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor mask = at::empty({nbytes}, x.options().dtype(at::kByte));
  uint8_t* m = mask.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "relu_mask", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* p = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, nbytes, kGrain / 8, [&](int64_t b0, int64_t b1) {
      for (int64_t j = b0; j < b1; ++j) {
        const int64_t base = 8 * j;
        const int64_t count = std::min<int64_t>(8, n - base);
        uint8_t byte = 0;
        for (int64_t i = 0; i < count; ++i) {
          // threshold_backward zeroes where y <= 0, so NaN keeps its gradient.
          const opmath_t v = static_cast<opmath_t>(p[base + i]);
          byte |= static_cast<uint8_t>(!(v <= opmath_t(0))) << i;
        }
        m[j] = byte;
      }
    });
  });
  return mask;
}

// An unsigned integer as wide as a floating type. Masking an element's bits copies
// or zeroes it without a branch (so the loop vectorizes; the data-dependent branch
// mispredicts half the time) and exactly (NaN payloads, signed zeros).
template <size_t N>
struct UintOf;
template <>
struct UintOf<2> {
  using type = uint16_t;
};
template <>
struct UintOf<4> {
  using type = uint32_t;
};
template <>
struct UintOf<8> {
  using type = uint64_t;
};
template <typename T>
using uint_of_t = typename UintOf<sizeof(T)>::type;

// For each mask byte, the 8 element masks it stands for (all ones where the bit is set).
template <typename U>
struct ByteMasks {
  std::array<std::array<U, 8>, 256> masks;
  ByteMasks() {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      for (uint32_t i = 0; i < 8; ++i) {
        masks[byte][i] = ((byte >> i) & 1u) ? static_cast<U>(~U(0)) : U(0);
      }
    }
  }
};

template <typename U>
void copy_where_bit(const U* gp, const uint8_t* mp, U* op, int64_t n) {
  static const ByteMasks<U> table;  // a table lookup beats 8 shifts per byte
  const int64_t nbytes = (n + 7) / 8;
  const auto* masks = table.masks.data();
  at::parallel_for(0, nbytes, kGrain / 8, [=](int64_t b0, int64_t b1) {
    for (int64_t j = b0; j < b1; ++j) {
      const U* __restrict__ src = gp + 8 * j;
      U* __restrict__ dst = op + 8 * j;
      const uint32_t byte = mp[j];
      const int64_t count = std::min<int64_t>(8, n - 8 * j);
      if (count == 8) {
        const U* __restrict__ m = masks[byte].data();
        for (int i = 0; i < 8; ++i) {
          dst[i] = src[i] & m[i];
        }
      } else {
        for (int64_t i = 0; i < count; ++i) {
          dst[i] = src[i] & static_cast<U>(U(0) - static_cast<U>((byte >> i) & 1u));
        }
      }
    }
  });
}

at::Tensor relu_backward_mask(const at::Tensor& grad_output, const at::Tensor& mask) {
  TORCH_CHECK(mask.scalar_type() == at::kByte, "relu_backward_mask: mask must be uint8, got ",
              mask.scalar_type());
  TORCH_CHECK(at::isFloatingType(grad_output.scalar_type()),
              "relu_backward_mask: grad_output must be floating point, got ",
              grad_output.scalar_type());
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor mk = mask.contiguous();
  const int64_t n = g.numel();
  const int64_t nbytes = (n + 7) / 8;
  TORCH_CHECK(mk.numel() == nbytes, "relu_backward_mask: mask has ", mk.numel(),
              " bytes, but grad_output has ", n, " elements (needs ", nbytes, ")");
  at::Tensor out = at::empty(g.sizes(), g.options());
  const uint8_t* mp = mk.const_data_ptr<uint8_t>();
  // Only the element width matters: a set bit copies the gradient's bits.
  switch (g.element_size()) {
    case 2:
      copy_where_bit(static_cast<const uint16_t*>(g.const_data_ptr()), mp,
                     static_cast<uint16_t*>(out.data_ptr()), n);
      break;
    case 4:
      copy_where_bit(static_cast<const uint32_t*>(g.const_data_ptr()), mp,
                     static_cast<uint32_t*>(out.data_ptr()), n);
      break;
    case 8:
      copy_where_bit(static_cast<const uint64_t*>(g.const_data_ptr()), mp,
                     static_cast<uint64_t*>(out.data_ptr()), n);
      break;
    default:
      TORCH_CHECK(false, "relu_backward_mask: unsupported dtype ", g.scalar_type());
  }
  return out;
}

// ---------------------------------------------------------------------------
// Max pooling with a 1-byte index (position inside the window, kh * kW + kw)

struct Pool2d {
  int64_t kH, kW, sH, sW, pH, pW, dH, dW;
  bool ceil_mode;
};

// aten accepts one value for both dims, and an empty stride for "same as kernel".
int64_t pick(at::IntArrayRef v, size_t i, const char* what) {
  TORCH_CHECK(v.size() == 1 || v.size() == 2, "max_pool2d_compact: ", what,
              " must have one or two values, got ", v.size());
  return v.size() == 1 ? v[0] : v[i];
}

Pool2d pool_params(at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                   at::IntArrayRef dilation, bool ceil_mode) {
  Pool2d p{};
  p.kH = pick(kernel_size, 0, "kernel_size");
  p.kW = pick(kernel_size, 1, "kernel_size");
  p.sH = stride.empty() ? p.kH : pick(stride, 0, "stride");
  p.sW = stride.empty() ? p.kW : pick(stride, 1, "stride");
  p.pH = pick(padding, 0, "padding");
  p.pW = pick(padding, 1, "padding");
  p.dH = pick(dilation, 0, "dilation");
  p.dW = pick(dilation, 1, "dilation");
  p.ceil_mode = ceil_mode;
  TORCH_CHECK(p.kH > 0 && p.kW > 0, "max_pool2d_compact: kernel size must be positive");
  TORCH_CHECK(p.sH > 0 && p.sW > 0, "max_pool2d_compact: stride must be positive");
  TORCH_CHECK(p.dH > 0 && p.dW > 0, "max_pool2d_compact: dilation must be positive");
  TORCH_CHECK(p.pH >= 0 && p.pW >= 0, "max_pool2d_compact: padding must be non-negative");
  TORCH_CHECK(p.pH <= ((p.kH - 1) * p.dH + 1) / 2 && p.pW <= ((p.kW - 1) * p.dW + 1) / 2,
              "max_pool2d_compact: padding should be at most half of the effective kernel size");
  TORCH_CHECK(p.kH * p.kW <= 256, "max_pool2d_compact: a ", p.kH, "x", p.kW,
              " window has more than 256 positions, which a uint8 index cannot name; "
              "use aten.max_pool2d_with_indices for it");
  return p;
}

int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// The output-size rule of aten's pooling_output_shape, ceil_mode included.
int64_t pool_out_size(int64_t in, int64_t k, int64_t pad, int64_t stride, int64_t dil,
                      bool ceil_mode) {
  int64_t out = floor_div(in + 2 * pad - dil * (k - 1) - 1 + (ceil_mode ? stride - 1 : 0),
                          stride) + 1;
  if (ceil_mode && (out - 1) * stride >= in + pad) {
    --out;  // the last window must start inside the input or its left padding
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> max_pool2d_compact(const at::Tensor& self,
                                                      at::IntArrayRef kernel_size,
                                                      at::IntArrayRef stride,
                                                      at::IntArrayRef padding,
                                                      at::IntArrayRef dilation, bool ceil_mode) {
  TORCH_CHECK(self.dim() == 3 || self.dim() == 4,
              "max_pool2d_compact: expected a 3-D (C, H, W) or 4-D (N, C, H, W) input, got ",
              self.dim(), "-D");
  const Pool2d p = pool_params(kernel_size, stride, padding, dilation, ceil_mode);
  const int64_t H = self.size(-2), W = self.size(-1);
  const int64_t OH = pool_out_size(H, p.kH, p.pH, p.sH, p.dH, ceil_mode);
  const int64_t OW = pool_out_size(W, p.kW, p.pW, p.sW, p.dW, ceil_mode);
  TORCH_CHECK(OH >= 1 && OW >= 1, "max_pool2d_compact: input ", H, "x", W,
              " is too small for the window; output would be ", OH, "x", OW);
  const int64_t planes = self.dim() == 4 ? self.size(0) * self.size(1) : self.size(0);

  const at::Tensor x = self.contiguous();
  std::vector<int64_t> out_sizes(self.sizes().begin(), self.sizes().end());
  out_sizes[out_sizes.size() - 2] = OH;
  out_sizes[out_sizes.size() - 1] = OW;
  at::Tensor out = at::empty(out_sizes, x.options());
  at::Tensor idx = at::empty(out_sizes, x.options().dtype(at::kByte));
  if (out.numel() == 0) {
    return std::make_tuple(out, idx);
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "max_pool2d_compact", [&] {
        using opmath_t = at::opmath_type<scalar_t>;
        const scalar_t* in = x.const_data_ptr<scalar_t>();
        scalar_t* op = out.data_ptr<scalar_t>();
        uint8_t* ip = idx.data_ptr<uint8_t>();
        at::parallel_for(0, planes, grain_for(OH * OW * p.kH * p.kW), [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; ++c) {
            const scalar_t* plane = in + c * H * W;
            scalar_t* oplane = op + c * OH * OW;
            uint8_t* iplane = ip + c * OH * OW;
            for (int64_t oh = 0; oh < OH; ++oh) {
              // Same window walk as aten's cpu_max_pool: clip the end, step the start
              // past the top padding by whole dilations.
              int64_t ih0 = oh * p.sH - p.pH;
              const int64_t ih1 = std::min(ih0 + (p.kH - 1) * p.dH + 1, H);
              int64_t kh0 = 0;
              while (ih0 < 0) {
                ih0 += p.dH;
                ++kh0;
              }
              for (int64_t ow = 0; ow < OW; ++ow) {
                int64_t iw0 = ow * p.sW - p.pW;
                const int64_t iw1 = std::min(iw0 + (p.kW - 1) * p.dW + 1, W);
                int64_t kw0 = 0;
                while (iw0 < 0) {
                  iw0 += p.dW;
                  ++kw0;
                }
                // aten starts from -inf at the window's first in-bounds element and
                // takes an element when val > max or val is NaN (so the last NaN wins).
                opmath_t best = -std::numeric_limits<opmath_t>::infinity();
                int64_t best_k = std::min(kh0, p.kH - 1) * p.kW + std::min(kw0, p.kW - 1);
                int64_t kh = kh0;
                for (int64_t ih = ih0; ih < ih1; ih += p.dH, ++kh) {
                  const scalar_t* row = plane + ih * W;
                  int64_t kw = kw0;
                  for (int64_t iw = iw0; iw < iw1; iw += p.dW, ++kw) {
                    const opmath_t v = static_cast<opmath_t>(row[iw]);
                    if (v > best || std::isnan(v)) {
                      best = v;
                      best_k = kh * p.kW + kw;
                    }
                  }
                }
                oplane[oh * OW + ow] = static_cast<scalar_t>(best);
                iplane[oh * OW + ow] = static_cast<uint8_t>(best_k);
              }
            }
          }
        });
      });
  return std::make_tuple(out, idx);
}

at::Tensor max_pool2d_compact_backward(const at::Tensor& grad_output, const at::Tensor& indices,
                                       at::IntArrayRef input_size, at::IntArrayRef kernel_size,
                                       at::IntArrayRef stride, at::IntArrayRef padding,
                                       at::IntArrayRef dilation, bool ceil_mode) {
  TORCH_CHECK(input_size.size() == 3 || input_size.size() == 4,
              "max_pool2d_compact_backward: input_size must have 3 or 4 entries, got ",
              input_size.size());
  TORCH_CHECK(grad_output.dim() == static_cast<int64_t>(input_size.size()),
              "max_pool2d_compact_backward: grad_output has ", grad_output.dim(),
              " dims but input_size has ", input_size.size());
  TORCH_CHECK(indices.scalar_type() == at::kByte,
              "max_pool2d_compact_backward: indices must be uint8, got ", indices.scalar_type());
  TORCH_CHECK(indices.sizes() == grad_output.sizes(),
              "max_pool2d_compact_backward: indices ", indices.sizes(),
              " and grad_output ", grad_output.sizes(), " differ in shape");
  const Pool2d p = pool_params(kernel_size, stride, padding, dilation, ceil_mode);
  const size_t nd = input_size.size();
  const int64_t H = input_size[nd - 2], W = input_size[nd - 1];
  const int64_t OH = grad_output.size(-2), OW = grad_output.size(-1);
  TORCH_CHECK(OH == pool_out_size(H, p.kH, p.pH, p.sH, p.dH, ceil_mode) &&
                  OW == pool_out_size(W, p.kW, p.pW, p.sW, p.dW, ceil_mode),
              "max_pool2d_compact_backward: grad_output ", grad_output.sizes(),
              " does not match pooling an input of size ", input_size);
  for (size_t d = 0; d + 2 < nd; ++d) {
    TORCH_CHECK(grad_output.size(d) == input_size[d],
                "max_pool2d_compact_backward: grad_output ", grad_output.sizes(),
                " and input_size ", input_size, " differ in the leading dims");
  }
  const int64_t planes = nd == 4 ? input_size[0] * input_size[1] : input_size[0];

  const at::Tensor g = grad_output.contiguous();
  const at::Tensor id = indices.contiguous();
  at::Tensor grad_input = at::zeros(input_size, g.options());
  if (g.numel() == 0) {
    return grad_input;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, g.scalar_type(), "max_pool2d_compact_backward", [&] {
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const uint8_t* ip = id.const_data_ptr<uint8_t>();
        scalar_t* gi = grad_input.data_ptr<scalar_t>();
        // Row and column offset of each window position: no integer division in the
        // loop. Positions past the window (a corrupt index) land out of bounds.
        std::array<int64_t, 256> off_h, off_w;
        off_h.fill(std::numeric_limits<int32_t>::max());
        off_w.fill(0);
        for (int64_t k = 0; k < p.kH * p.kW; ++k) {
          off_h[k] = (k / p.kW) * p.dH;
          off_w[k] = (k % p.kW) * p.dW;
        }
        at::parallel_for(0, planes, grain_for(OH * OW), [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; ++c) {
            const scalar_t* gplane = gp + c * OH * OW;
            const uint8_t* iplane = ip + c * OH * OW;
            scalar_t* giplane = gi + c * H * W;
            // Row-major over the output and accumulating in scalar_t, as aten's
            // cpu_max_pool_backward does, so overlapping windows sum identically.
            for (int64_t oh = 0; oh < OH; ++oh) {
              for (int64_t ow = 0; ow < OW; ++ow) {
                const uint8_t k = iplane[oh * OW + ow];
                const int64_t ih = oh * p.sH - p.pH + off_h[k];
                const int64_t iw = ow * p.sW - p.pW + off_w[k];
                // Out of bounds only for a window that lies wholly in the padding.
                if (ih >= 0 && ih < H && iw >= 0 && iw < W) {
                  giplane[ih * W + iw] += gplane[oh * OW + ow];
                }
              }
            }
          }
        });
      });
  return grad_input;
}

// ---------------------------------------------------------------------------
// BatchNorm (training mode)

// Per-channel parameter as doubles, or `fill` when absent.
std::vector<double> channel_values(const std::optional<at::Tensor>& t, int64_t C, double fill,
                                   const char* op, const char* what) {
  std::vector<double> v(C, fill);
  if (t.has_value() && t->defined()) {
    TORCH_CHECK(t->numel() == C, op, ": ", what, " has ", t->numel(), " elements, expected ", C);
    const at::Tensor d = t->to(at::kDouble).contiguous();
    std::copy(d.const_data_ptr<double>(), d.const_data_ptr<double>() + C, v.begin());
  }
  return v;
}

// Sums over long rows in double use kLanes independent partial sums: one running
// sum is bound by the latency of an add per element, independent lanes vectorize.
constexpr int kLanes = 8;

// Calls body(i, lane) for i in [0, len), lane = the partial sum i adds to.
template <typename F>
inline void for_lanes(int64_t len, const F& body) {
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      body(i + l, l);
    }
  }
  for (; i < len; ++i) {
    body(i, 0);
  }
}

inline double lanes_total(const double* acc) {
  double t = 0.0;
  for (int l = 0; l < kLanes; ++l) {
    t += acc[l];
  }
  return t;
}

bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

at::Tensor double_vector(const std::vector<double>& v) {
  return at::tensor(at::ArrayRef<double>(v), at::TensorOptions().dtype(at::kDouble));
}

// Training BatchNorm backward from a value v whose per-channel affine map gives the
// normalized input: xhat = (v - shift[c]) * scale[c]. From the output: v = y, shift =
// beta, scale = 1 / gamma; from the input: v = x, shift = mean, scale = invstd. No
// buffer as large as the input (aten's CPU kernel takes one). `grad_input` may be
// `dy` itself: each element is read before the same element is written.
struct BatchNormSums {
  std::vector<double> dy, xhat_dy;  // per channel: sum(dy), sum(xhat * dy)
};

BatchNormSums batch_norm_backward_into(const at::Tensor& dy, const at::Tensor& v,
                                       const std::vector<double>& shift,
                                       const std::vector<double>& scale,
                                       const std::vector<double>& w,
                                       const std::vector<double>& invstd,
                                       at::Tensor* grad_input) {
  const int64_t N = v.size(0), C = v.size(1);
  const int64_t S = (N * C) == 0 ? 0 : v.numel() / (N * C);
  const double count = static_cast<double>(N * S);
  BatchNormSums sums{std::vector<double>(C, 0.0), std::vector<double>(C, 0.0)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "batch_norm_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
    const scalar_t* vp = v.const_data_ptr<scalar_t>();
    // Per-channel sums of dy and of xhat * dy, in double.
    at::parallel_for(0, C, grain_for(N * S), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        double s_dy[kLanes] = {}, s_vdy[kLanes] = {};
        const double sc = shift[c];
        for (int64_t n = 0; n < N; ++n) {
          const scalar_t* __restrict__ gr = dyp + (n * C + c) * S;
          const scalar_t* __restrict__ vr = vp + (n * C + c) * S;
          for_lanes(S, [&](int64_t i, int l) {
            const double g = static_cast<double>(gr[i]);
            s_dy[l] += g;
            s_vdy[l] += (static_cast<double>(vr[i]) - sc) * g;
          });
        }
        sums.dy[c] = lanes_total(s_dy);
        sums.xhat_dy[c] = lanes_total(s_vdy) * scale[c];
      }
    });
    if (grad_input == nullptr || count == 0) {
      return;
    }
    // dx = w * invstd * (dy - mean(dy) - xhat * mean(xhat * dy)), expanded so that
    // each element costs two multiply-adds and no division. No __restrict__ on dy and
    // dx: they are one buffer when the gradient is written in place.
    scalar_t* dxp = grad_input->data_ptr<scalar_t>();
    at::parallel_for(0, N * C, grain_for(S), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t c = r % C;
        const double a = w[c] * invstd[c];
        const double k = a * scale[c] * sums.xhat_dy[c] / count;
        const auto ca = static_cast<opmath_t>(a);
        const auto ck = static_cast<opmath_t>(-k);
        const auto c0 = static_cast<opmath_t>(k * shift[c] - a * sums.dy[c] / count);
        const scalar_t* gr = dyp + r * S;
        const scalar_t* __restrict__ vr = vp + r * S;
        scalar_t* dx = dxp + r * S;
        for (int64_t s = 0; s < S; ++s) {
          const auto g = static_cast<opmath_t>(gr[s]);
          const auto x = static_cast<opmath_t>(vr[s]);
          dx[s] = static_cast<scalar_t>(ca * g + ck * x + c0);
        }
      }
    });
  });
  return sums;
}

// Parameter gradients take the weight's dtype, as aten's do (float for a bfloat16
// input with float weights).
std::tuple<at::Tensor, at::Tensor> batch_norm_param_grads(
    const BatchNormSums& sums, const at::Tensor& like, const std::optional<at::Tensor>& weight,
    std::array<bool, 3> output_mask) {
  const at::ScalarType param_dtype = defined(weight) ? weight->scalar_type() : like.scalar_type();
  at::Tensor grad_weight, grad_bias;
  if (output_mask[1]) {
    grad_weight = double_vector(sums.xhat_dy).to(like.options().dtype(param_dtype));
  }
  if (output_mask[2]) {
    grad_bias = double_vector(sums.dy).to(like.options().dtype(param_dtype));
  }
  return std::make_tuple(grad_weight, grad_bias);
}

void check_batch_norm_backward(const at::Tensor& grad_output, const at::Tensor& v,
                               const char* op, const char* v_name) {
  TORCH_CHECK(v.dim() >= 2, op, ": expected at least 2 dims (N, C, ...), got ", v.dim());
  TORCH_CHECK(grad_output.sizes() == v.sizes(), op, ": grad_output ", grad_output.sizes(),
              " and ", v_name, " ", v.sizes(), " differ in shape");
  TORCH_CHECK(grad_output.scalar_type() == v.scalar_type(), op, ": grad_output and ", v_name,
              " differ in dtype");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_from_output(
    const at::Tensor& grad_output, const at::Tensor& output,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& save_invstd, std::array<bool, 3> output_mask) {
  const char* op = "batch_norm_backward_from_output";
  check_batch_norm_backward(grad_output, output, op, "output");
  const int64_t C = output.size(1);
  const std::vector<double> w = channel_values(weight, C, 1.0, op, "weight");
  const std::vector<double> b = channel_values(bias, C, 0.0, op, "bias");
  const std::vector<double> invstd = channel_values(save_invstd, C, 0.0, op, "save_invstd");
  if (output_mask[0] || output_mask[1]) {
    for (int64_t c = 0; c < C; ++c) {
      TORCH_CHECK(std::abs(w[c]) >= 1e-8, op, ": weight[", c, "] = ", w[c],
                  "; output-activated BatchNorm needs nonzero gamma (|weight| >= 1e-8) to "
                  "recover its input from its output");
    }
  }
  std::vector<double> inv_w(C);
  for (int64_t c = 0; c < C; ++c) {
    inv_w[c] = w[c] == 0.0 ? 0.0 : 1.0 / w[c];  // 0 only where neither dx nor dw is asked
  }
  const at::Tensor dy = grad_output.contiguous();
  at::Tensor grad_input;
  if (output_mask[0]) {
    grad_input = at::empty(dy.sizes(), dy.options());
  }
  const BatchNormSums sums = batch_norm_backward_into(
      dy, output.contiguous(), b, inv_w, w, invstd, output_mask[0] ? &grad_input : nullptr);
  auto [grad_weight, grad_bias] = batch_norm_param_grads(sums, dy, weight, output_mask);
  return std::make_tuple(grad_input, grad_weight, grad_bias);
}

// native_batch_norm_backward (training) from the input, without aten's CPU scratch.
BatchNormSums batch_norm_backward_from_input_into(
    const at::Tensor& dy, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& save_mean, const at::Tensor& save_invstd, at::Tensor* grad_input,
    const char* op) {
  check_batch_norm_backward(dy, input, op, "input");
  const int64_t C = input.size(1);
  const std::vector<double> w = channel_values(weight, C, 1.0, op, "weight");
  const std::vector<double> mean = channel_values(save_mean, C, 0.0, op, "save_mean");
  const std::vector<double> invstd = channel_values(save_invstd, C, 0.0, op, "save_invstd");
  return batch_norm_backward_into(dy, input.contiguous(), mean, invstd, w, invstd, grad_input);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_backward_from_input(
    const at::Tensor& grad_output, const at::Tensor& input,
    const std::optional<at::Tensor>& weight, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, std::array<bool, 3> output_mask) {
  const at::Tensor dy = grad_output.contiguous();
  at::Tensor grad_input;
  if (output_mask[0]) {
    grad_input = at::empty(dy.sizes(), dy.options());
  }
  const BatchNormSums sums = batch_norm_backward_from_input_into(
      dy, input, weight, save_mean, save_invstd, output_mask[0] ? &grad_input : nullptr,
      "batch_norm_backward_from_input");
  auto [grad_weight, grad_bias] = batch_norm_param_grads(sums, dy, weight, output_mask);
  return std::make_tuple(grad_input, grad_weight, grad_bias);
}

// The same, with the input's gradient written over grad_output (dead after this op).
std::tuple<at::Tensor, at::Tensor> batch_norm_backward_from_input_(
    at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& save_mean, const at::Tensor& save_invstd,
    std::array<bool, 3> output_mask) {
  const char* op = "batch_norm_backward_from_input_";
  TORCH_CHECK(output_mask[0], op, ": output_mask[0] must be true (the op writes the input's "
              "gradient over grad_output)");
  TORCH_CHECK(grad_output.is_contiguous(), op,
              ": grad_output must be contiguous to take the input's gradient in place");
  const BatchNormSums sums = batch_norm_backward_from_input_into(
      grad_output, input, weight, save_mean, save_invstd, &grad_output, op);
  return batch_norm_param_grads(sums, grad_output, weight, output_mask);
}

// Stats dtype: the input's, but float for half / bfloat16 inputs.
at::ScalarType stats_dtype(at::ScalarType input) {
  return (input == at::kHalf || input == at::kBFloat16) ? at::kFloat : input;
}

std::tuple<at::Tensor, at::Tensor> batch_norm_inplace_(
    at::Tensor& self, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, double momentum, double eps) {
  const char* op = "batch_norm_inplace_";
  TORCH_CHECK(self.dim() >= 2, op, ": expected at least 2 dims (N, C, ...), got ", self.dim());
  TORCH_CHECK(self.numel() > 0, op, ": no values per channel");
  // aten's own CPU batch norm with its output aimed at its input: it gathers the
  // statistics in a first pass and then maps every element onto itself, so writing
  // over the input is safe, and the result (output, saved and running statistics) is
  // bitwise that of native_batch_norm. A kernel of our own differed by ~1e-7, which
  // the following BatchNorms of a deep net amplified to 1e-3 in the gradients.
  at::Tensor save_mean = at::empty({0}, self.options());
  at::Tensor save_invstd = at::empty({0}, self.options());
  at::native_batch_norm_out(self, save_mean, save_invstd, self, weight, bias, running_mean,
                            running_var, /*training=*/true, momentum, eps);
  return std::make_tuple(save_mean, save_invstd);
}

// ---------------------------------------------------------------------------
// Hardtanh backward from the output

at::Tensor hardtanh_backward_from_output(const at::Tensor& grad_output, const at::Tensor& output,
                                         const at::Scalar& min_val, const at::Scalar& max_val) {
  TORCH_CHECK(grad_output.sizes() == output.sizes(),
              "hardtanh_backward_from_output: grad_output ", grad_output.sizes(), " and output ",
              output.sizes(), " differ in shape");
  TORCH_CHECK(grad_output.scalar_type() == output.scalar_type(),
              "hardtanh_backward_from_output: grad_output and output differ in dtype");
  const at::Tensor g = grad_output.contiguous();
  const at::Tensor y = output.contiguous();
  at::Tensor out = at::empty(g.sizes(), g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, g.scalar_type(), "hardtanh_backward_from_output", [&] {
        // aten's hardtanh_backward passes dy only where lo < x < hi (NaN gives 0); for
        // y = clamp(x) that is lo < y < hi, since y sits on a bound exactly when x was
        // on or past it. Compared in opmath, as aten does.
        using opmath_t = at::opmath_type<scalar_t>;
        using U = uint_of_t<scalar_t>;
        const auto lo = min_val.to<opmath_t>();
        const auto hi = max_val.to<opmath_t>();
        const U* gp = static_cast<const U*>(g.const_data_ptr());
        const scalar_t* yp = y.const_data_ptr<scalar_t>();
        U* op = static_cast<U*>(out.data_ptr());
        at::parallel_for(0, g.numel(), kGrain, [=](int64_t i0, int64_t i1) {
          const U* __restrict__ src = gp;
          const scalar_t* __restrict__ ys = yp;
          U* __restrict__ dst = op;
          for (int64_t i = i0; i < i1; ++i) {
            const auto v = static_cast<opmath_t>(ys[i]);
            const auto inside = static_cast<U>((v > lo) & (v < hi));
            dst[i] = src[i] & static_cast<U>(U(0) - inside);
          }
        });
      });
  return out;
}

// ---------------------------------------------------------------------------
// Convolution with an explicit algorithm (the `conv` mode)
//
// Algorithm -1 is PyTorch's own choice on every device (at::convolution picks the backend:
// oneDNN for float on this CPU). On CPU, algorithm 0 is PyTorch's im2col + GEMM path
// (slow_conv2d): for a k x k kernel it holds the whole batch's columns (k*k times the input)
// as workspace, for a 1x1 stride-1 unpadded convolution none at all, where oneDNN reorders
// its input and output into a blocked layout. Which is cheaper depends on the layer; the
// profiler measures both and the solver chooses. The backward runs its data and weight
// parts as two calls, each with its own algorithm and workspace, except when both are
// PyTorch's own choice: then it is one call, as in eager autograd.

constexpr int64_t kAtenAlgo = -1;
constexpr int64_t kIm2colAlgo = 0;
// Algorithm -k (k >= 2, one of these): PyTorch's own choice run over the batch in k
// chunks (as many as there are samples, if fewer). oneDNN's workspace, a blocked copy of
// the input or the output, then covers one chunk: about a k-th of the whole batch's, for
// about the same time (MobileNetV2's depthwise backward at batch 136: 0.82 GB in one
// call, 0.27 GB in 8 chunks). Each chunk's result is copied into the whole output.
constexpr int64_t kChunkedAlgos[] = {-2, -8};

bool is_chunked(int64_t algo) {
  return std::find(std::begin(kChunkedAlgos), std::end(kChunkedAlgos), algo) !=
         std::end(kChunkedAlgos);
}

bool im2col_applies(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef dilation,
                    int64_t groups) {
  const bool plain = std::all_of(dilation.begin(), dilation.end(), [](int64_t d) { return d == 1; });
  // slow_conv2d takes contiguous (NCHW) inputs only: its backward refuses a channels-last
  // one, and its forward would return another layout than the graph was traced with.
  return input.dim() == 4 && weight.dim() == 4 && groups == 1 && plain && input.is_contiguous() &&
         (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble);
}

void check_conv_algo(int64_t algo, bool im2col_ok, const char* op, const char* direction) {
  TORCH_CHECK(algo == kAtenAlgo || is_chunked(algo) || (algo == kIm2colAlgo && im2col_ok), op,
              ": ", direction, " algorithm ", algo,
              " is not available on CPU for this convolution (",
              im2col_ok ? "-1 (aten), -2 or -8 (aten over 2 or 8 batch chunks) or 0 (im2col)"
                        : "only -1 (aten), -2 or -8 (aten over 2 or 8 batch chunks): im2col "
                          "needs groups 1, no dilation, a contiguous input, float or double",
              ")");
}

// [first, first + length) of the batch of `n` samples cut in `chunks` near-equal parts.
std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t chunks, int64_t c) {
  const int64_t first = c * n / chunks;
  return {first, (c + 1) * n / chunks - first};
}

// `full` (allocated at the first chunk, in that chunk's layout) with `part` copied in at
// the batch rows [first, first + length).
void place_chunk(at::Tensor& full, const at::Tensor& part, int64_t n, int64_t first,
                 int64_t length) {
  if (!full.defined()) {
    std::vector<int64_t> sizes(part.sizes().begin(), part.sizes().end());
    sizes[0] = n;
    full = at::empty(sizes, part.options().memory_format(part.suggest_memory_format()));
  }
  full.narrow(0, first, length).copy_(part);
}

at::Tensor conv2d_algo(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                       int64_t algo) {
  check_conv_algo(algo, im2col_applies(input, weight, dilation, groups), "conv2d_algo", "forward");
  if (algo == kAtenAlgo) {
    return at::convolution(input, weight, bias, stride, padding, dilation, false, {0, 0}, groups);
  }
  if (is_chunked(algo)) {
    const int64_t n = input.size(0), chunks = std::max<int64_t>(1, std::min(-algo, n));
    at::Tensor out;
    for (int64_t c = 0; c < chunks; ++c) {
      const auto [first, length] = chunk_range(n, chunks, c);
      place_chunk(out,
                  at::convolution(input.narrow(0, first, length), weight, bias, stride, padding,
                                  dilation, false, {0, 0}, groups),
                  n, first, length);
    }
    return out;
  }
  return at::_slow_conv2d_forward(input, weight, weight.sizes().slice(2), bias, stride, padding);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_backward_algo(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
    std::array<bool, 3> output_mask, int64_t algo_data, int64_t algo_weight) {
  const char* op = "conv2d_backward_algo";
  const bool ok = im2col_applies(input, weight, dilation, groups);
  check_conv_algo(algo_data, ok, op, "backward-data");
  check_conv_algo(algo_weight, ok, op, "backward-weight");
  auto part = [&](int64_t algo, std::array<bool, 3> mask) {
    if (algo == kAtenAlgo) {
      return at::convolution_backward(grad_output, input, weight, std::nullopt, stride, padding,
                                      dilation, false, {0, 0}, groups, mask);
    }
    if (is_chunked(algo)) {  // one part (mask) over batch chunks: see kChunkedAlgos
      const int64_t n = input.size(0), chunks = std::max<int64_t>(1, std::min(-algo, n));
      at::Tensor grad_in, grad_w;
      for (int64_t c = 0; c < chunks; ++c) {
        const auto [first, length] = chunk_range(n, chunks, c);
        auto [gi, gw, gb] = at::convolution_backward(
            grad_output.narrow(0, first, length), input.narrow(0, first, length), weight,
            std::nullopt, stride, padding, dilation, false, {0, 0}, groups, mask);
        if (mask[0]) place_chunk(grad_in, gi, n, first, length);
        if (mask[1]) grad_w = grad_w.defined() ? grad_w.add_(gw) : gw;
      }
      return std::make_tuple(grad_in, grad_w, at::Tensor());
    }
    return at::_slow_conv2d_backward(grad_output, input, weight, weight.sizes().slice(2), stride,
                                     padding, mask);
  };
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0] && output_mask[1] && algo_data == kAtenAlgo && algo_weight == kAtenAlgo) {
    // PyTorch's own choice for both parts: one call, as autograd makes it.
    std::tie(grad_input, grad_weight, std::ignore) = part(kAtenAlgo, {true, true, false});
  } else {
    if (output_mask[0]) grad_input = std::get<0>(part(algo_data, {true, false, false}));
    if (output_mask[1]) grad_weight = std::get<1>(part(algo_weight, {false, true, false}));
  }
  if (output_mask[2]) grad_bias = grad_output.sum({0, 2, 3});
  return {grad_input, grad_weight, grad_bias};
}

// [n_forward, ids..., n_backward_data, ids..., n_backward_weight, ids...]
std::vector<int64_t> conv2d_algorithms(const at::Tensor& input, const at::Tensor& weight,
                                       at::IntArrayRef stride, at::IntArrayRef padding,
                                       at::IntArrayRef dilation, int64_t groups) {
  std::vector<int64_t> ids = {kAtenAlgo};
  if (im2col_applies(input, weight, dilation, groups)) ids.push_back(kIm2colAlgo);
  ids.insert(ids.end(), std::begin(kChunkedAlgos), std::end(kChunkedAlgos));
  std::vector<int64_t> flat;
  for (int which = 0; which < 3; ++which) {
    flat.push_back(static_cast<int64_t>(ids.size()));
    flat.insert(flat.end(), ids.begin(), ids.end());
  }
  return flat;
}

}  // namespace
}  // namespace monet_like

TORCH_LIBRARY(monet_like, m) {
  // Fake (meta) kernels and autograd live in Python, in monet_like.kernels.
  m.set_python_module("monet_like.kernels");
  m.def("relu_mask(Tensor self) -> Tensor");
  m.def("relu_backward_mask(Tensor grad_output, Tensor mask) -> Tensor");
  m.def(
      "max_pool2d_compact(Tensor self, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, bool ceil_mode) -> (Tensor, Tensor)");
  m.def(
      "max_pool2d_compact_backward(Tensor grad_output, Tensor indices, SymInt[] input_size, "
      "int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode) "
      "-> Tensor");
  m.def(
      "batch_norm_backward_from_output(Tensor grad_output, Tensor output, Tensor? weight, "
      "Tensor? bias, Tensor save_invstd, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "batch_norm_backward_from_input(Tensor grad_output, Tensor input, Tensor? weight, "
      "Tensor save_mean, Tensor save_invstd, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  m.def(
      "batch_norm_backward_from_input_(Tensor(a!) grad_output, Tensor input, Tensor? weight, "
      "Tensor save_mean, Tensor save_invstd, bool[3] output_mask) -> (Tensor, Tensor)");
  m.def(
      "hardtanh_backward_from_output(Tensor grad_output, Tensor output, Scalar min_val, "
      "Scalar max_val) -> Tensor");
  m.def(
      "batch_norm_inplace_(Tensor(a!) self, Tensor? weight, Tensor? bias, "
      "Tensor(b!)? running_mean, Tensor(c!)? running_var, float momentum, float eps) "
      "-> (Tensor, Tensor)");
  m.def(
      "conv2d_algo(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, int algo) -> Tensor");
  m.def(
      "conv2d_backward_algo(Tensor grad_output, Tensor input, Tensor weight, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, bool[3] output_mask, int algo_data, "
      "int algo_weight) -> (Tensor, Tensor, Tensor)");
  m.def(
      "conv2d_algorithms(Tensor input, Tensor weight, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups) -> int[]");
}

TORCH_LIBRARY_IMPL(monet_like, CPU, m) {
  m.impl("relu_mask", &monet_like::relu_mask);
  m.impl("relu_backward_mask", &monet_like::relu_backward_mask);
  m.impl("max_pool2d_compact", &monet_like::max_pool2d_compact);
  m.impl("max_pool2d_compact_backward", &monet_like::max_pool2d_compact_backward);
  m.impl("batch_norm_backward_from_output", &monet_like::batch_norm_backward_from_output);
  m.impl("batch_norm_backward_from_input", &monet_like::batch_norm_backward_from_input);
  m.impl("batch_norm_backward_from_input_", &monet_like::batch_norm_backward_from_input_);
  m.impl("hardtanh_backward_from_output", &monet_like::hardtanh_backward_from_output);
  m.impl("batch_norm_inplace_", &monet_like::batch_norm_inplace_);
  m.impl("conv2d_algo", &monet_like::conv2d_algo);
  m.impl("conv2d_backward_algo", &monet_like::conv2d_backward_algo);
  m.impl("conv2d_algorithms", &monet_like::conv2d_algorithms);
}

#ifdef MONET_LIKE_PYTHON_MODULE
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "monet_like._C",
      "monet_like's C++ operators; importing registers torch.ops.monet_like.*", -1, nullptr,
      nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
#endif
