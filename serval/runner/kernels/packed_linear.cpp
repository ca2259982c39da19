// The torch-facing entry points of the packed matmuls: a packed matrix's tensors checked and read as a
// PackedMatrix (quantized.h), the product's path chosen (int8 x, quantized_int8.cpp; int16 x,
// quantized_linear.cpp; 16-bit weights, dense_linear.cpp), and its result delivered: a tensor in x's dtype,
// or added into a residual stream.
#include "quantized.h"

using namespace serval_kernels;
using namespace serval_kernels::quantized;

namespace serval_kernels::quantized {

bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// The layout of a packed matrix from its tensors (quantized.h), each checked against x's width K.
Layout packed_layout(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                     const at::Tensor& super, int64_t K) {
  const bool nibbles = codes.scalar_type() == at::kByte;
  TORCH_CHECK(nibbles || codes.scalar_type() == at::kChar, "codes: uint8 (4-6 bits) or int8 (8 bits)");
  TORCH_CHECK(codes.dim() == 4 && codes.size(1) == K / kBlock && codes.size(3) == kChunkBytes, "codes vs x");
  const int64_t chunks = codes.size(2);
  TORCH_CHECK(nibbles ? chunks >= 4 && chunks <= 6 : chunks == 8,
              "codes: 4, 5 or 6 chunks a block of 32 (uint8), or 8 (int8)");
  const int code_bits = nibbles ? static_cast<int>(chunks) : 8;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(2) == kGroup, "scales' shape");
  const bool has_super = present(super), has_offsets = present(offsets);
  const int64_t scale_weights = scales.size(1) > 0 ? K / scales.size(1) : 0;
  Layout layout;
  if (!has_super) {
    TORCH_CHECK(code_bits != 6, "6-bit codes are Q6_K's: they need their super-block scales");
    if (code_bits == 8) {
      TORCH_CHECK(!has_offsets, "int8 codes take no offsets (Q8_0)");
      layout = Layout::kQ8;
    } else if (code_bits == 5) {
      layout = has_offsets ? Layout::kQ5 : Layout::kQ5Sym;
    } else if (scales.scalar_type() == at::kByte) {  // E8M0 exponent bytes: MXFP4
      TORCH_CHECK(!has_offsets, "MXFP4 codes take no offsets");
      layout = Layout::kMXFP4;
    } else {
      layout = has_offsets ? Layout::kQ4 : Layout::kQ4Sym;
    }
    TORCH_CHECK(layout == Layout::kMXFP4 ||
                    (scales.scalar_type() == at::kHalf && (!has_offsets || offsets.scalar_type() == at::kHalf)),
                "fp16 scales and offsets (uint8 scales: MXFP4's exponents, 4-bit codes)");
  } else {
    TORCH_CHECK(code_bits != 8, "int8 codes have no k-quant layout");
    layout = code_bits == 4 ? Layout::kQ4K : (code_bits == 5 ? Layout::kQ5K : Layout::kQ6K);
    TORCH_CHECK(K % kSuperWeights == 0, "k-quant layouts: K a multiple of 256");
    TORCH_CHECK(super.scalar_type() == at::kHalf && super.dim() == 4 && super.size(0) == codes.size(0) &&
                super.size(1) == K / kSuperWeights && super.size(2) == 2 && super.size(3) == kGroup,
                "super-block scales: (groups, K / 256, 2, 16) fp16");
    const auto sub_type = layout == Layout::kQ6K ? at::kChar : at::kByte;
    TORCH_CHECK(scales.scalar_type() == sub_type && (!has_offsets || offsets.scalar_type() == at::kByte),
                "k-quant sub-block scales and mins: 8-bit");
    TORCH_CHECK(layout == Layout::kQ6K ? !has_offsets : has_offsets,
                "Q4_K and Q5_K codes need their mins; Q6_K's have none");
  }
  TORCH_CHECK(scale_weights == (layout == Layout::kQ6K ? 16 : 32) && scales.size(1) * scale_weights == K,
              "one scale per 32 weights (Q6_K's layout: per 16)");
  TORCH_CHECK(!has_offsets || (offsets.dim() == 3 && offsets.size(0) == codes.size(0) &&
                               offsets.size(1) == K / kBlock && offsets.size(2) == kGroup), "offsets' shape");
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (!has_offsets || offsets.is_contiguous()) &&
              (!has_super || super.is_contiguous()), "packed tensors: contiguous");
  return layout;
}

}  // namespace serval_kernels::quantized

namespace {

// out (M, padded) fp32 -> (M, N) in dtype, rows split over the threads (on one, the bf16 conversion took
// 2% of a 512-row prefill matmul and the other thread waited). NOTE: a loop rather than narrow + to: for a
// decode step's few rows these are a dozen tensor ops' dispatch (a microsecond each, 120 matmuls a token)
// around a copy of a few hundred values.
at::Tensor unpadded(const at::Tensor& out, int64_t N, at::ScalarType dtype) {
  const int64_t M = out.size(0), padded = out.size(1);
  if (dtype == at::kFloat && N == padded) return out;
  if (dtype != at::kFloat && dtype != at::kBFloat16) return out.narrow(1, 0, N).to(dtype);
  auto y = at::empty({M, N}, out.options().dtype(dtype));
  const float* src = out.data_ptr<float>();
  parallel_chunks(M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (dtype == at::kFloat) {
        std::memcpy(y.data_ptr<float>() + m * N, src + m * padded, N * sizeof(float));
      } else {
        at::BFloat16* dst = y.data_ptr<at::BFloat16>() + m * N;
        int64_t n = 0;
        for (; n + simd::kWidth <= N; n += simd::kWidth) simd::store(dst + n, simd::load(src + m * padded + n));
        for (; n < N; ++n) dst[n] = static_cast<at::BFloat16>(src[m * padded + n]);
      }
    }
  });
  return y;
}

// Results up to this size (bf16 bytes) go group by group through the threads' tiles (GroupOutput); past it (the
// LM head's 64 x 49152: 6 MB) each group's 16 values a row land on M lines far apart, which cost more in write
// misses than unpadded's row-by-row pass (`perf`, 64-row decode step).
constexpr int64_t kGroupwiseBf16Bytes = 1 << 20;

// Whether quantized_linear's codes are a checkpoint's 16-bit weights as stored (dense_linear computes those).
bool sixteen_bit(const at::Tensor& codes) {
  return codes.scalar_type() == at::kHalf || codes.scalar_type() == at::kBFloat16;
}

// One call's packed matrix and how x meets it: quantized_linear's checks and paths, which quantized_linear_add_
// and quantized_swiglu take too.
struct PackedCall {
  PackedMatrix w;
  Layout layout;
  int64_t M, num_groups;
  bool int8_rows;  // int8 x where asked and this build has it for the layout, from int8_rows_from() rows
  at::Tensor x;  // fp32 or bf16 x as it is (other dtypes as fp32), contiguous

  PackedCall(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
             const at::Tensor& super_scales, int64_t N, bool int8_batch_activations)
      : M(x_in.size(0)), num_groups(codes.size(0)) {
    const int64_t K = x_in.size(1);
    TORCH_CHECK(K % kBlock == 0, "K: a multiple of 32");
    layout = packed_layout(codes, scales, offsets, super_scales, K);
    TORCH_CHECK(num_groups * kGroup >= N && num_groups * kGroup < N + kGroup, "N vs the packed groups");
    w = PackedMatrix{static_cast<const uint8_t*>(codes.data_ptr()), codes.stride(0), scales.data_ptr(),
                     present(offsets) ? offsets.data_ptr() : nullptr,
                     present(super_scales) ? super_scales.data_ptr<at::Half>() : nullptr, K};
    int8_rows = int8_batch_activations && has_int8_rows(layout) && M >= int8_rows_from();
    x = x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16 ? x_in.contiguous()
                                                                                : x_in.to(at::kFloat).contiguous();
  }

  // A bf16 result group by group (GroupOutput): int8 rows of bf16 x, M > 0.
  bool by_group() const { return int8_rows && M > 0 && x.scalar_type() == at::kBFloat16; }
  // ... and an N-wide result small enough for it (kGroupwiseBf16Bytes).
  bool by_group_within(int64_t N) const { return by_group() && M * N * 2 <= kGroupwiseBf16Bytes; }

  void run_by_group(const GroupOutput& to) const {
    matmul_int8_rows(x.data_ptr<at::BFloat16>(), M, w, layout, num_groups, nullptr, 0, to);
  }

  // The whole fp32 result, padded to whole groups.
  at::Tensor run_padded() const {
    auto out = at::empty({M, num_groups * kGroup}, x.options().dtype(at::kFloat));
    float* op = out.data_ptr<float>();
    if (M == 0) return out;  // nothing to compute (a step that samples no token asks for no logits)
    if (int8_rows) {
      if (x.scalar_type() == at::kFloat) matmul_int8_rows(x.data_ptr<float>(), M, w, layout, num_groups, op, out.size(1));
      else matmul_int8_rows(x.data_ptr<at::BFloat16>(), M, w, layout, num_groups, op, out.size(1));
      return out;
    }
    if (x.scalar_type() == at::kFloat) matmul_int16_rows(x.data_ptr<float>(), M, w, layout, num_groups, op, out.size(1));
    else matmul_int16_rows(x.data_ptr<at::BFloat16>(), M, w, layout, num_groups, op, out.size(1));
    return out;
  }

  // quantized_linear's (M, N) result in x's dtype.
  at::Tensor result(int64_t N, at::ScalarType dtype) const {
    if (!by_group_within(N)) return unpadded(run_padded(), N, dtype);
    auto y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
    run_by_group(GroupOutput{y.data_ptr<at::BFloat16>(), nullptr, N});
    return y;
  }
};

}  // namespace

// x: (M, K) bf16 or fp32. Returns (M, N) in x's dtype; N = the unpadded output width. Every row count goes
// through the integer dot products above, each row computed alike whatever M.
// int8_batch_activations: x is rounded to int8 per block (as llama.cpp does: faster, not exact) and goes through
// quantized_int8.cpp where it has the layout, from int8_rows_from() rows on. offsets and super_scales may be empty
// (undefined in the DecodeStack): the layout has none. codes in fp16 or
// bf16, (N, K) with no scales, are 16-bit weights: dense_linear.cpp computes those, as stored.
at::Tensor quantized_linear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                               at::Tensor super_scales, int64_t N, bool int8_batch_activations) {
  TORCH_CHECK(x.dim() == 2, "x: (rows, K)");
  if (sixteen_bit(codes)) {
    TORCH_CHECK(!present(scales) && !present(offsets) && !present(super_scales), "16-bit weights have no scales");
    TORCH_CHECK(codes.dim() == 2 && codes.size(0) == N, "16-bit weights: (N, K)");
    return dense_linear(x, codes);  // the checkpoint's F16/BF16 values as they are
  }
  return PackedCall(x, codes, scales, offsets, super_scales, N, int8_batch_activations).result(N, x.scalar_type());
}

// residual += quantized_linear(x, ...), the same bits (a bf16 result is added as its bf16 values are), with
// neither the result nor a pass over it where the int8 path writes it group by group: a decoder layer's
// x += o(attn) and x += down(act) (decode_stack.cpp). residual: (M, N) fp32, contiguous.
void quantized_linear_add_(at::Tensor residual, at::Tensor x, at::Tensor codes, at::Tensor scales,
                           at::Tensor offsets, at::Tensor super_scales, int64_t N, bool int8_batch_activations) {
  TORCH_CHECK(x.dim() == 2 && residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == N,
              "residual: (rows, N), x: (rows, K)");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous(), "residual: contiguous fp32");
  if (sixteen_bit(codes)) {
    residual.add_(quantized_linear(x, codes, scales, offsets, super_scales, N, int8_batch_activations));
    return;
  }
  const PackedCall call(x, codes, scales, offsets, super_scales, N, int8_batch_activations);
  if (call.by_group()) call.run_by_group(GroupOutput{nullptr, residual.data_ptr<float>(), N});
  else residual.add_(call.result(N, x.scalar_type()));
}

// silu_mul(quantized_linear(x, ...)) of a SwiGLU gate_up matrix (N = 2 inter: gate's rows, then up's), the same
// bits; where the int8 path writes group by group (and inter is whole groups), each thread computes a gate
// group and its up group and writes their silu(gate) * up: no 2 inter-wide result, no pass over one.
at::Tensor quantized_swiglu(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                            at::Tensor super_scales, int64_t N, bool int8_batch_activations) {
  TORCH_CHECK(x.dim() == 2 && N % 2 == 0, "x: (rows, K); N: gate's and up's rows");
  const int64_t inter = N / 2;
  if (sixteen_bit(codes))
    return silu_mul(quantized_linear(x, codes, scales, offsets, super_scales, N, int8_batch_activations));
  const PackedCall call(x, codes, scales, offsets, super_scales, N, int8_batch_activations);
  if (inter % kGroup != 0 || !call.by_group_within(N)) return silu_mul(call.result(N, x.scalar_type()));
  auto y = at::empty({call.M, inter}, x.options().dtype(at::kBFloat16));
  call.run_by_group(GroupOutput{y.data_ptr<at::BFloat16>(), nullptr, inter, /*swiglu=*/true});
  return y;
}
