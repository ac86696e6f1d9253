// The SIMD kernels, compiled once per Highway target (foreach_target.h
// re-includes this file with HWY_NAMESPACE = N_AVX2, N_SSE4, ...). Each
// target fills a KernelTable; adam.cpp chooses one at run time. Compiled with
// -ffp-contract=off so every target performs exactly the operations listed
// in kernel_table.h (see reference.cpp).
//
// Loads and stores are unaligned (spans start anywhere in a chunk); the last
// partial vector of a block goes through a zero-padded stack buffer, so no
// kernel reads or writes outside [begin, begin + count).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_adam/kernel_table.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_adam/adam_kernels.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"

// Hardware fp16 conversion (F16C: round to nearest even, subnormals, inf and
// NaN all correct) on x86 targets AVX2 and better; every other target uses
// the integer conversions below. See Note [16-bit rounding] in float16.h.
#undef TIDAL_CPU_ADAM_F16C
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2 && !defined(HWY_DISABLE_F16C)
#define TIDAL_CPU_ADAM_F16C 1
#else
#define TIDAL_CPU_ADAM_F16C 0
#endif

HWY_BEFORE_NAMESPACE();
namespace tidal::cpu_adam {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;

using detail::BlockStats;
using detail::KernelTable;
using detail::SpanPointers;
using detail::UpdateConstants;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VU = hn::Vec<DU>;
using DI = hn::RebindToSigned<DF>;
using DU16 = hn::Rebind<std::uint16_t, DF>;

// Element storage of each kind of buffer: 0 = fp32, 1 = fp16, 2 = bf16
// (DType order), and for copies 0 = none.
enum Kind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <int K>
using Storage = std::conditional_t<K == kF32, float, std::uint16_t>;

// fp16 bits (zero-extended into u32 lanes) -> fp32, exact for every input.
HWY_INLINE VF F16BitsToF32(DF df, VU h) {
  const DU du;
  const VU shifted_exp = hn::Set(du, 0x7C00u << 13);
  VU o = hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x7FFFu)));
  const VU exp = hn::And(o, shifted_exp);
  o = hn::Add(o, hn::Set(du, (127u - 15u) << 23));  // rebias the exponent
  // Inf/NaN: rebias once more to reach exponent 255.
  o = hn::IfThenElse(hn::Eq(exp, shifted_exp), hn::Add(o, hn::Set(du, (128u - 16u) << 23)), o);
  // Zero/subnormal: o now reads as 2^-15 * (1 + m/1024); adding 2^-14's
  // exponent step and subtracting 2^-14 leaves m * 2^-24 exactly.
  const VF renormalized = hn::Sub(hn::BitCast(df, hn::Add(o, hn::Set(du, 1u << 23))),
                                  hn::BitCast(df, hn::Set(du, 113u << 23)));
  o = hn::IfThenElse(hn::Eq(exp, hn::Zero(du)), hn::BitCast(du, renormalized), o);
  return hn::BitCast(df, hn::Or(o, hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)))));
}

// fp32 -> fp16 bits in u32 lanes, round to nearest even, as f32_to_f16_rne.
HWY_INLINE VU F32ToF16Bits(DF df, VF f) {
  const DU du;
  const DI di;
  const VU u = hn::BitCast(du, f);
  const VU sign = hn::ShiftRight<16>(hn::And(u, hn::Set(du, 0x80000000u)));
  const VU a = hn::And(u, hn::Set(du, 0x7FFFFFFFu));
  const auto ai = hn::BitCast(di, a);  // a < 2^31: signed compares are exact
  // Normal results: rebias, then round the 13 dropped bits to nearest even.
  VU r = hn::Sub(a, hn::Set(du, 112u << 23));
  r = hn::Add(r, hn::Add(hn::Set(du, 0xFFFu), hn::And(hn::ShiftRight<13>(r), hn::Set(du, 1u))));
  const VU normal = hn::ShiftRight<13>(r);
  // Subnormal results: adding 0.5f (ulp 2^-24, the fp16 subnormal unit)
  // makes the FPU round to nearest even; the low bits are the fp16 value.
  const VU half_bits = hn::Set(du, 126u << 23);
  const VU subnormal =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), hn::BitCast(df, half_bits))), half_bits);
  const VU special = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x7F800000))),
                                    hn::Set(du, 0x7E00u), hn::Set(du, 0x7C00u));
  VU o = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, hn::Set(di, 0x38800000))), subnormal, normal);
  o = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, hn::Set(di, 0x477FEFFF))), special, o);
  return hn::Or(o, sign);
}

// fp32 -> bf16 bits in u32 lanes, round to nearest even, NaN -> 0x7FC0.
HWY_INLINE VU F32ToBF16Bits(DF df, VF f) {
  const DU du;
  const DI di;
  const VU u = hn::BitCast(du, f);
  const VU lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  const VU rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), lsb)));
  const auto is_nan =
      hn::Gt(hn::BitCast(di, hn::And(u, hn::Set(du, 0x7FFFFFFFu))), hn::Set(di, 0x7F800000));
  (void)df;
  return hn::IfThenElse(hn::RebindMask(du, is_nan), hn::Set(du, 0x7FC0u), rounded);
}

template <int K>
HWY_INLINE VF LoadAsF32(DF df, const Storage<K>* p) {
  if constexpr (K == kF32) {
    return hn::LoadU(df, p);
  } else {
    const DU du;
    const DU16 du16;
#if TIDAL_CPU_ADAM_F16C
    if constexpr (K == kF16) {
      const hn::Rebind<hwy::float16_t, DF> dh;
      return hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
    }
#endif
    const VU bits = hn::PromoteTo(du, hn::LoadU(du16, p));
    if constexpr (K == kF16) {
      return F16BitsToF32(df, bits);
    } else {
      return hn::BitCast(df, hn::ShiftLeft<16>(bits));
    }
  }
}

template <int K>
HWY_INLINE void StoreFromF32(DF df, VF v, Storage<K>* p) {
  if constexpr (K == kF32) {
    hn::StoreU(v, df, p);
  } else {
    const DI di;
    const DU16 du16;
#if TIDAL_CPU_ADAM_F16C
    if constexpr (K == kF16) {
      const hn::Rebind<hwy::float16_t, DF> dh;
      hn::StoreU(hn::DemoteTo(dh, v), dh, reinterpret_cast<hwy::float16_t*>(p));
      return;
    }
#endif
    const VU bits = K == kF16 ? F32ToF16Bits(df, v) : F32ToBF16Bits(df, v);
    // Lanes hold values < 2^16, so the saturating demotion is exact.
    hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, bits)), du16, p);
  }
}

struct VecConstants {
  explicit VecConstants(DF df, const UpdateConstants& c)
      : grad_scale(hn::Set(df, c.grad_scale)),
        weight_decay(hn::Set(df, c.weight_decay)),
        decay_factor(hn::Set(df, c.decay_factor)),
        one_minus_beta1(hn::Set(df, c.one_minus_beta1)),
        beta2(hn::Set(df, c.beta2)),
        one_minus_beta2(hn::Set(df, c.one_minus_beta2)),
        bias_correction2_sqrt(hn::Set(df, c.bias_correction2_sqrt)),
        eps(hn::Set(df, c.eps)),
        neg_step_size(hn::Set(df, c.neg_step_size)) {}
  VF grad_scale, weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2,
      bias_correction2_sqrt, eps, neg_step_size;
};

// Streaming (non-temporal) stores of the 16-bit copy: x86 AVX2 and better,
// where the copy's u16 vector is a whole 16- or 32-byte register (Highway's
// Stream writes 16 bytes even for a partial vector). See Note [Streaming the
// param copy] in adam.h.
#undef TIDAL_CPU_ADAM_STREAM
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
#define TIDAL_CPU_ADAM_STREAM 1
#else
#define TIDAL_CPU_ADAM_STREAM 0
#endif

// The copy's vector as u16 bits, for Stream().
template <int C>
HWY_INLINE void StreamFromF32(DF df, VF v, std::uint16_t* HWY_RESTRICT aligned) {
  const DU16 du16;
#if TIDAL_CPU_ADAM_F16C
  if constexpr (C == kF16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    hn::Stream(hn::BitCast(du16, hn::DemoteTo(dh, v)), du16, aligned);
    return;
  }
#endif
  const DI di;
  const VU bits = C == kF16 ? F32ToF16Bits(df, v) : F32ToBF16Bits(df, v);
  hn::Stream(hn::DemoteTo(du16, hn::BitCast(di, bits)), du16, aligned);
}

// One vector of the operation listed in kernel_table.h. kStream: the copy
// pointer is aligned to the u16 vector and takes a non-temporal store.
template <int G, int S, int C, bool kL2, bool kStream = false>
HWY_INLINE void UpdateVector(DF df, const VecConstants& k, float* HWY_RESTRICT pp,
                             Storage<S>* HWY_RESTRICT mp, Storage<S>* HWY_RESTRICT vp,
                             const Storage<G>* gp, std::uint16_t* cp) {
  VF g = hn::Mul(LoadAsF32<G>(df, gp), k.grad_scale);
  VF p = hn::LoadU(df, pp);
  if constexpr (kL2) g = hn::Add(g, hn::Mul(k.weight_decay, p));
  p = hn::Mul(p, k.decay_factor);
  VF m = LoadAsF32<S>(df, mp);
  VF v = LoadAsF32<S>(df, vp);
  m = hn::Add(m, hn::Mul(k.one_minus_beta1, hn::Sub(g, m)));
  v = hn::Add(hn::Mul(v, k.beta2), hn::Mul(hn::Mul(k.one_minus_beta2, g), g));
  const VF denom = hn::Add(hn::Div(hn::Sqrt(v), k.bias_correction2_sqrt), k.eps);
  p = hn::Add(p, hn::Div(hn::Mul(k.neg_step_size, m), denom));
  hn::StoreU(p, df, pp);
  StoreFromF32<S>(df, m, mp);
  StoreFromF32<S>(df, v, vp);
  if constexpr (C != 0) {
    if constexpr (kStream) {
      StreamFromF32<C>(df, p, cp);
    } else {
      StoreFromF32<C>(df, p, cp);
    }
  }
}

// Fewer than one vector of elements [0, rem) through zero-padded buffers,
// so nothing outside them is read or written.
template <int G, int S, int C, bool kL2>
HWY_INLINE void UpdatePartial(DF df, const VecConstants& k, float* p, Storage<S>* m,
                              Storage<S>* v, const Storage<G>* g, std::uint16_t* copy,
                              std::size_t rem) {
  constexpr std::size_t kMax = hn::MaxLanes(DF());
  HWY_ALIGN float pb[kMax] = {};
  HWY_ALIGN Storage<S> mb[kMax] = {};
  HWY_ALIGN Storage<S> vb[kMax] = {};
  HWY_ALIGN Storage<G> gb[kMax] = {};
  HWY_ALIGN std::uint16_t cb[kMax] = {};
  std::memcpy(pb, p, rem * sizeof(float));
  std::memcpy(mb, m, rem * sizeof(Storage<S>));
  std::memcpy(vb, v, rem * sizeof(Storage<S>));
  std::memcpy(gb, g, rem * sizeof(Storage<G>));
  UpdateVector<G, S, C, kL2>(df, k, pb, mb, vb, gb, cb);
  std::memcpy(p, pb, rem * sizeof(float));
  std::memcpy(m, mb, rem * sizeof(Storage<S>));
  std::memcpy(v, vb, rem * sizeof(Storage<S>));
  if constexpr (C != 0) std::memcpy(copy, cb, rem * sizeof(std::uint16_t));
}

template <int G, int S, int C, bool kL2>
void UpdateBlock(const UpdateConstants& c, const SpanPointers& s, std::size_t begin,
                 std::size_t count) {
  const DF df;
  const std::size_t n = hn::Lanes(df);
  const VecConstants k(df, c);
  float* HWY_RESTRICT p = s.param + begin;
  Storage<S>* HWY_RESTRICT m = static_cast<Storage<S>*>(s.exp_avg) + begin;
  Storage<S>* HWY_RESTRICT v = static_cast<Storage<S>*>(s.exp_avg_sq) + begin;
  // NB: grad and param_copy may be the same buffer (the 16-bit chunk holds
  // the gradients and then receives the new params), so neither is
  // restrict; each vector of grads is loaded before its copy is stored.
  const Storage<G>* g = static_cast<const Storage<G>*>(s.grad) + begin;
  std::uint16_t* copy =
      C != 0 ? static_cast<std::uint16_t*>(s.param_copy) + begin : nullptr;

  std::size_t i = 0;
#if TIDAL_CPU_ADAM_STREAM
  // Note [Streaming the param copy]: a write-only copy (not the gradients'
  // own slot, which the loads already brought into the cache) goes around
  // the cache. Peel elements until the copy is aligned to its u16 vector.
  if constexpr (C != 0) {
    const std::uintptr_t align = n * sizeof(std::uint16_t);
    const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(copy);
    if (c.stream_copy && static_cast<const void*>(copy) != static_cast<const void*>(g) &&
        addr % sizeof(std::uint16_t) == 0 && count >= 2 * n) {
      const std::size_t head = ((align - addr % align) % align) / sizeof(std::uint16_t);
      if (head != 0) UpdatePartial<G, S, C, kL2>(df, k, p, m, v, g, copy, head);
      i = head;
      for (; i + n <= count; i += n) {
        UpdateVector<G, S, C, kL2, true>(df, k, p + i, m + i, v + i, g + i, copy + i);
      }
      // Order the streamed stores before whatever publishes this block's
      // completion (the join of the parallel loop).
      hwy::FlushStream();
    }
  }
#endif
  for (; i + n <= count; i += n) {
    UpdateVector<G, S, C, kL2>(df, k, p + i, m + i, v + i, g + i, C != 0 ? copy + i : nullptr);
  }
  if (i == count) return;
  UpdatePartial<G, S, C, kL2>(df, k, p + i, m + i, v + i, g + i, C != 0 ? copy + i : nullptr,
                              count - i);
}

// Sum of squares in fp32 lanes over sub-blocks of kSubBlock elements, each
// sub-block's lane sums added to a double: four independent accumulators
// (so the loop is not bound by the latency of one chain of adds) of at most
// kSubBlock / (4 * lanes) terms per lane bound the relative error by
// kSubBlock / lanes * 2^-24 (2e-6 for AVX2, 1.5e-5 for 1-lane targets;
// typically 10x less). Finite-ness: the largest |bits| seen must stay below
// the infinity pattern.
template <int G>
BlockStats StatsBlock(const void* grad, std::size_t begin, std::size_t count) {
  constexpr std::size_t kSubBlock = 256;
  const DF df;
  const DU du;
  const DI di;
  const std::size_t n = hn::Lanes(df);
  const Storage<G>* HWY_RESTRICT g = static_cast<const Storage<G>*>(grad) + begin;
  const VU abs_mask = hn::Set(du, 0x7FFFFFFFu);
  auto max_bits = hn::Zero(di);
  auto track = [&](VF x) {
    max_bits = hn::Max(max_bits, hn::BitCast(di, hn::And(hn::BitCast(du, x), abs_mask)));
  };
  double total = 0.0;
  const std::size_t full = count / n * n;  // elements in whole vectors
  std::size_t i = 0;
  while (i < full) {
    const std::size_t end = full - i > kSubBlock ? i + kSubBlock : full;
    VF acc0 = hn::Zero(df), acc1 = hn::Zero(df), acc2 = hn::Zero(df), acc3 = hn::Zero(df);
    for (; i + 4 * n <= end; i += 4 * n) {
      const VF x0 = LoadAsF32<G>(df, g + i);
      const VF x1 = LoadAsF32<G>(df, g + i + n);
      const VF x2 = LoadAsF32<G>(df, g + i + 2 * n);
      const VF x3 = LoadAsF32<G>(df, g + i + 3 * n);
      acc0 = hn::Add(acc0, hn::Mul(x0, x0));
      acc1 = hn::Add(acc1, hn::Mul(x1, x1));
      acc2 = hn::Add(acc2, hn::Mul(x2, x2));
      acc3 = hn::Add(acc3, hn::Mul(x3, x3));
      // Integer max of |bits|, not a float max: maxps drops NaN operands.
      track(x0);
      track(x1);
      track(x2);
      track(x3);
    }
    for (; i < end; i += n) {
      const VF x = LoadAsF32<G>(df, g + i);
      acc0 = hn::Add(acc0, hn::Mul(x, x));
      track(x);
    }
    const VF acc = hn::Add(hn::Add(acc0, acc1), hn::Add(acc2, acc3));
    total += static_cast<double>(hn::GetLane(hn::SumOfLanes(df, acc)));
  }
  if (i < count) {
    constexpr std::size_t kMax = hn::MaxLanes(DF());
    HWY_ALIGN Storage<G> gb[kMax] = {};
    std::memcpy(gb, g + i, (count - i) * sizeof(Storage<G>));
    const VF x = LoadAsF32<G>(df, gb);
    total += static_cast<double>(hn::GetLane(hn::SumOfLanes(df, hn::Mul(x, x))));
    track(x);
  }
  const bool finite = hn::GetLane(hn::MaxOfLanes(di, max_bits)) < 0x7F800000;
  return BlockStats{total, finite};
}

// One vector of fold_gradients(): the gradient widened (and added to the
// sum unless first), then (kRestore) the master rounded into the 16-bit
// buffer.
template <int H, bool kFirst, bool kRestore>
HWY_INLINE void FoldVector(DF df, float* HWY_RESTRICT sum, Storage<H>* half,
                           const float* HWY_RESTRICT master) {
  VF g = LoadAsF32<H>(df, half);
  if constexpr (!kFirst) g = hn::Add(hn::LoadU(df, sum), g);
  hn::StoreU(g, df, sum);
  if constexpr (kRestore) StoreFromF32<H>(df, hn::LoadU(df, master), half);
}

template <int H, bool kFirst, bool kRestore>
void FoldBlock(const FoldSpan& s, std::size_t begin, std::size_t count) {
  const DF df;
  const std::size_t n = hn::Lanes(df);
  float* HWY_RESTRICT sum = s.sum + begin;
  Storage<H>* half = static_cast<Storage<H>*>(s.half) + begin;
  const float* HWY_RESTRICT master = kRestore ? s.master + begin : nullptr;
  std::size_t i = 0;
  for (; i + n <= count; i += n) {
    FoldVector<H, kFirst, kRestore>(df, sum + i, half + i, kRestore ? master + i : nullptr);
  }
  if (i == count) return;
  // The last partial vector through zero-padded buffers.
  constexpr std::size_t kMax = hn::MaxLanes(DF());
  const std::size_t rem = count - i;
  HWY_ALIGN float sb[kMax] = {};
  HWY_ALIGN Storage<H> hb[kMax] = {};
  HWY_ALIGN float mb[kMax] = {};
  std::memcpy(sb, sum + i, rem * sizeof(float));
  std::memcpy(hb, half + i, rem * sizeof(Storage<H>));
  if constexpr (kRestore) std::memcpy(mb, master + i, rem * sizeof(float));
  FoldVector<H, kFirst, kRestore>(df, sb, hb, mb);
  std::memcpy(sum + i, sb, rem * sizeof(float));
  std::memcpy(half + i, hb, rem * sizeof(Storage<H>));
}

template <int G, int S, int C>
void FillL2(KernelTable& t) {
  t.update[G][S == kF32 ? 0 : 1][C][0] = &UpdateBlock<G, S, C, false>;
  t.update[G][S == kF32 ? 0 : 1][C][1] = &UpdateBlock<G, S, C, true>;
}

template <int G, int S>
void FillCopy(KernelTable& t) {
  FillL2<G, S, 0>(t);
  FillL2<G, S, kF16>(t);
  FillL2<G, S, kBF16>(t);
}

template <int G>
void FillGrad(KernelTable& t) {
  FillCopy<G, kF32>(t);
  FillCopy<G, kBF16>(t);
  t.stats[G] = &StatsBlock<G>;
  t.fold[G][0][0] = &FoldBlock<G, false, false>;
  t.fold[G][0][1] = &FoldBlock<G, false, true>;
  t.fold[G][1][0] = &FoldBlock<G, true, false>;
  t.fold[G][1][1] = &FoldBlock<G, true, true>;
}

KernelTable MakeTable() {
  KernelTable t{};
  t.name = hwy::TargetName(HWY_TARGET);
  FillGrad<kF32>(t);
  FillGrad<kF16>(t);
  FillGrad<kBF16>(t);
  return t;
}

}  // namespace

// Exported per target (foreach_target); highway_kernel_tables() collects them.
const KernelTable* GetKernelTable() {
  static const KernelTable table = MakeTable();
  return &table;
}

}  // namespace HWY_NAMESPACE
}  // namespace tidal::cpu_adam
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <algorithm>

namespace tidal::cpu_adam {
namespace detail {

std::vector<const KernelTable*> highway_kernel_tables() {
  using Getter = const KernelTable* (*)();
  struct Entry {
    std::int64_t target;
    Getter get;
  };
  // Highway's HWY_CHOOSE_* give the target's function or nullptr when this
  // build did not compile that target.
  const Entry entries[] = {
#if HWY_ARCH_X86
      {HWY_AVX3_DL, HWY_CHOOSE_AVX3_DL(GetKernelTable)},
      {HWY_AVX3, HWY_CHOOSE_AVX3(GetKernelTable)},
      {HWY_AVX2, HWY_CHOOSE_AVX2(GetKernelTable)},
      {HWY_SSE4, HWY_CHOOSE_SSE4(GetKernelTable)},
      {HWY_SSSE3, HWY_CHOOSE_SSSE3(GetKernelTable)},
#elif HWY_ARCH_ARM
      {HWY_SVE2_128, HWY_CHOOSE_SVE2_128(GetKernelTable)},
      {HWY_SVE_256, HWY_CHOOSE_SVE_256(GetKernelTable)},
      {HWY_SVE2, HWY_CHOOSE_SVE2(GetKernelTable)},
      {HWY_SVE, HWY_CHOOSE_SVE(GetKernelTable)},
      {HWY_NEON, HWY_CHOOSE_NEON(GetKernelTable)},
#endif
#if HWY_TARGETS & HWY_EMU128
      {HWY_EMU128, &N_EMU128::GetKernelTable},
#elif HWY_TARGETS & HWY_SCALAR
      {HWY_SCALAR, &N_SCALAR::GetKernelTable},
#endif
  };
  std::vector<Entry> runnable;
  const std::int64_t supported = hwy::SupportedTargets();
  for (const Entry& e : entries) {
    if (e.get != nullptr && (e.target & supported & HWY_TARGETS) != 0) runnable.push_back(e);
  }
  // Highway numbers better targets with lower bits.
  std::sort(runnable.begin(), runnable.end(),
            [](const Entry& a, const Entry& b) { return a.target < b.target; });
  std::vector<const KernelTable*> out;
  for (const Entry& e : runnable) out.push_back(e.get());
  return out;
}

}  // namespace detail
}  // namespace tidal::cpu_adam
#endif  // HWY_ONCE
