// tidal._C.cpu_adam: CPU Adam over CPU tensors. Two entry points:
//   * adam_update_tensors(): one call per parameter group of
//     tidal.optim.CPUAdam (every tensor its own span and step);
//   * adam_update() / adam_step() / grad_stats(): the low-level entries
//     on flat buffers, addressed by element offset and count;
//   * adam_chunk_step(): the chunk engine's step of one chunk, all its
//     tensors (ranges) in one call (see the docstrings below).
// The kernels take raw pointers (cpu_adam/adam.h); this file only checks the
// tensors, takes their pointers with the GIL held, and releases the GIL
// around the kernels.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <variant>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/update_worker.h"
#include "hooks/torch_threads.h"
#include "python/csrc/bindings.h"
#include "runtime/core/error.h"
#include "runtime/core/uncounted.h"

namespace tidal::python {
namespace {

namespace ca = tidal::cpu_adam;

// torch's Python spelling of a dtype, for error messages.
std::string torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

ca::DType to_dtype(const at::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ca::DType::kFloat32;
    case at::kHalf: return ca::DType::kFloat16;
    case at::kBFloat16: return ca::DType::kBFloat16;
    default:
      TIDAL_THROW(TypeError, name, " has dtype ", torch_dtype_name(t.scalar_type()),
                  "; CPU Adam takes torch.float32, torch.float16 or torch.bfloat16");
  }
}

// A checked view of elements [offset, offset + count) of a CPU tensor.
struct Flat {
  void* data = nullptr;
  std::size_t count = 0;
  ca::DType dtype = ca::DType::kFloat32;
};

Flat flat(const at::Tensor& t, const std::string& name, std::int64_t offset = 0,
          std::int64_t count = -1) {
  TIDAL_CHECK(t.defined(), name, " is an undefined tensor");
  TIDAL_CHECK(t.device().is_cpu(), name, " is on ", t.device().str(),
              "; CPU Adam updates CPU tensors only (keep master params and optimizer state "
              "in host memory, or use torch.optim.AdamW for device tensors)");
  TIDAL_CHECK(t.layout() == at::kStrided, name, " has layout ", t.layout(),
              "; CPU Adam takes dense (strided) tensors");
  TIDAL_CHECK(t.is_contiguous(), name, " is not contiguous (shape ", t.sizes(), ", strides ",
              t.strides(), "); CPU Adam walks memory linearly. Tip: keep the tensor "
              "contiguous, e.g. param.data = param.data.contiguous()");
  const ca::DType dtype = to_dtype(t, name);
  const std::int64_t numel = t.numel();
  if (count < 0) count = numel - offset;
  TIDAL_CHECK(offset >= 0 && count >= 0 && offset + count <= numel, name, ": elements [", offset,
              ", ", offset + count, ") are out of range for ", numel, " elements");
  Flat f;
  f.dtype = dtype;
  f.count = static_cast<std::size_t>(count);
  f.data = count == 0 ? nullptr
                      : static_cast<char*>(t.data_ptr()) + offset * static_cast<std::int64_t>(
                                                                     ca::dtype_size(dtype));
  return f;
}

ca::AdamHyperParams hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                          bool adamw_mode, bool bias_correction) {
  ca::AdamHyperParams h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw_mode = adamw_mode;
  h.bias_correction = bias_correction;
  return h;
}

using Ranges = std::optional<std::vector<std::pair<std::int64_t, std::int64_t>>>;
using Steps = std::variant<std::int64_t, std::vector<std::int64_t>>;

// The four flat chunk buffers of adam_chunk_step (and the sums, where given),
// checked against each other.
ca::AdamChunk chunk_of(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                       const at::Tensor& half, const std::optional<at::Tensor>& grad) {
  const Flat p = flat(param, "param");
  TIDAL_CHECK_TYPE(p.dtype == ca::DType::kFloat32,
                   "param must be torch.float32 (the fp32 master chunk), got ",
                   ca::dtype_name(p.dtype));
  const std::int64_t n = static_cast<std::int64_t>(p.count);
  const Flat m = flat(exp_avg, "exp_avg");
  const Flat v = flat(exp_avg_sq, "exp_avg_sq");
  const Flat h16 = flat(half, "half");
  TIDAL_CHECK_TYPE(m.dtype == v.dtype, "exp_avg is ", ca::dtype_name(m.dtype),
                   " but exp_avg_sq is ", ca::dtype_name(v.dtype), "; they must match");
  for (const auto& [name, f] : {std::pair<const char*, const Flat*>{"exp_avg", &m},
                                {"exp_avg_sq", &v}, {"half", &h16}}) {
    TIDAL_CHECK(static_cast<std::int64_t>(f->count) == n, name, " has ", f->count,
                " elements but param has ", n, "; the four chunk buffers must be equally long");
  }
  ca::AdamChunk chunk{static_cast<float*>(p.data), m.data, v.data, h16.data,
                      p.count, h16.dtype, m.dtype};
  if (grad) {
    const Flat g = flat(*grad, "grad");
    TIDAL_CHECK_TYPE(g.dtype == ca::DType::kFloat32,
                     "grad must be torch.float32 (the gradient sums), got ",
                     ca::dtype_name(g.dtype));
    TIDAL_CHECK(static_cast<std::int64_t>(g.count) == n, "grad has ", g.count,
                " elements but param has ", n, "; the chunk buffers must be equally long");
    chunk.grad = static_cast<const float*>(g.data);
  }
  return chunk;
}

// adam_chunk_step's ranges (None: the whole chunk of `numel`) with their steps.
std::vector<ca::ChunkRange> ranges_of(const Ranges& ranges, const Steps& step, std::size_t numel) {
  std::vector<ca::ChunkRange> rs;
  if (ranges) {
    rs.reserve(ranges->size());
    for (std::size_t i = 0; i < ranges->size(); ++i) {
      const auto [off, cnt] = (*ranges)[i];
      TIDAL_CHECK(off >= 0 && cnt >= 0, "ranges[", i, "] = (", off, ", ", cnt,
                  "): offset and count must be >= 0");
      rs.push_back({static_cast<std::size_t>(off), static_cast<std::size_t>(cnt), 1});
    }
  } else {
    rs.push_back({0, numel, 1});
  }
  if (const auto* steps = std::get_if<std::vector<std::int64_t>>(&step)) {
    TIDAL_CHECK(steps->size() == rs.size(), "step has ", steps->size(),
                " entries but there are ", rs.size(), " ranges; give one step per range "
                "or one int for all");
    for (std::size_t i = 0; i < rs.size(); ++i) rs[i].step = (*steps)[i];
  } else {
    for (ca::ChunkRange& r : rs) r.step = std::get<std::int64_t>(step);
  }
  return rs;
}

// The copy of `src` into `dst` (named `dst_name`, `src_name` in errors): one
// dtype, one length.
ca::CopySpan copy_span(const Flat& dst, const Flat& src, const std::string& dst_name,
                       const std::string& src_name) {
  TIDAL_CHECK_TYPE(dst.dtype == src.dtype, dst_name, " is ", ca::dtype_name(dst.dtype), " but ", src_name,
                   " is ", ca::dtype_name(src.dtype), "; the copy copies bytes, not values");
  TIDAL_CHECK(dst.count == src.count, dst_name, " has ", dst.count, " elements but ", src_name, " has ",
              src.count);
  return {dst.data, src.data, dst.count * ca::dtype_size(dst.dtype)};
}

// The buffers of one low-level call, checked against each other.
struct SpanArgs {
  ca::AdamDTypes dtypes;
  ca::AdamSpan span;
};

SpanArgs span_args(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                   const at::Tensor& grad, const std::optional<at::Tensor>& param_copy,
                   std::int64_t step, std::int64_t offset, std::int64_t count) {
  const Flat p = flat(param, "param", offset, count);
  TIDAL_CHECK_TYPE(p.dtype == ca::DType::kFloat32, "param must be torch.float32 (the fp32 master), got ",
                   ca::dtype_name(p.dtype));
  const std::int64_t n = static_cast<std::int64_t>(p.count);
  const Flat m = flat(exp_avg, "exp_avg", offset, n);
  const Flat v = flat(exp_avg_sq, "exp_avg_sq", offset, n);
  const Flat g = flat(grad, "grad", offset, n);
  TIDAL_CHECK_TYPE(m.dtype == v.dtype, "exp_avg is ", ca::dtype_name(m.dtype), " but exp_avg_sq is ",
                   ca::dtype_name(v.dtype), "; they must match");
  SpanArgs a;
  a.dtypes.grad = g.dtype;
  a.dtypes.state = m.dtype;
  a.span.param = static_cast<float*>(p.data);
  a.span.exp_avg = m.data;
  a.span.exp_avg_sq = v.data;
  a.span.grad = g.data;
  a.span.count = p.count;
  a.span.step = step;
  if (param_copy.has_value() && param_copy->defined()) {
    const Flat c = flat(*param_copy, "param_copy", offset, n);
    a.dtypes.param_copy = c.dtype;
    a.span.param_copy = c.data;
  }
  return a;
}

// One parameter group's update in an UpdateWorker job: (ranges, steps, lr,
// beta1, beta2, eps, weight_decay).
using GroupCall = std::tuple<std::vector<std::pair<std::int64_t, std::int64_t>>, std::vector<std::int64_t>,
                             double, double, double, double, double>;

void bind_update_worker(py::module_& m) {
  py::class_<ca::UpdateTicket, std::shared_ptr<ca::UpdateTicket>>(
      m, "UpdateTicket", "A job submitted to an UpdateWorker.")
      .def("done", &ca::UpdateTicket::done)
      .def(
          "wait", [](const ca::UpdateTicket& t) {
            py::gil_scoped_release no_gil;
            t.wait();
          },
          "Blocks until the job has run, the GIL released.")
      .def("failed", [](const ca::UpdateTicket& t) { return t.done() && t.error() != nullptr; },
           "Done, with an error.")
      .def("undo_failed", &ca::UpdateTicket::undo_failed,
           "Done, failing before it updated anything (a fence or the undo copy).")
      .def(
          "result",
          [](const ca::UpdateTicket& t) {
            {
              py::gil_scoped_release no_gil;
              t.wait();
            }
            if (std::exception_ptr e = t.error()) std::rethrow_exception(e);
            const ca::UpdateTimes times = t.times();
            return py::make_tuple(times.fenced_from, times.started, times.ended);
          },
          "Waits; (began, fences passed, ended) in time.perf_counter() seconds, or raises the "
          "job's error.");

  py::class_<ca::UpdateWorker, std::shared_ptr<ca::UpdateWorker>>(m, "UpdateWorker", R"doc(
A thread of tidal's (not Python's) that runs chunk updates in the order they
are submitted, without the GIL (Note [The worker without the GIL] in
cpu_adam/update_worker.h); its host allocations are uncounted (Note [tidal's
own host allocations]). Dropping it runs the jobs still queued.)doc")
      .def(py::init([] { return std::make_shared<ca::UpdateWorker>([] { ++g_uncounted_depth; }); }))
      .def(
          "submit",
          [](ca::UpdateWorker& w, const at::Tensor& param, const at::Tensor& exp_avg,
             const at::Tensor& exp_avg_sq, const at::Tensor& half, const std::vector<GroupCall>& calls,
             const std::vector<CopyFence>& fences, const std::optional<std::vector<at::Tensor>>& undo,
             std::int64_t undo_lo, std::int64_t undo_hi, const std::optional<at::Tensor>& grad,
             bool adamw_mode, bool bias_correction, double loss_scale, int num_threads,
             const std::string& pool) {
            ca::UpdateJob job;
            job.chunk = chunk_of(param, exp_avg, exp_avg_sq, half, grad);
            for (const auto& [ranges, steps, lr, beta1, beta2, eps, weight_decay] : calls) {
              ca::ChunkCall call;
              call.hyper = hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
              call.ranges = ranges_of(ranges, steps, job.chunk.numel);
              call.options.loss_scale = loss_scale;
              call.options.check_overflow = false;
              job.calls.push_back(std::move(call));
            }
            if (undo) {
              const at::Tensor* views[] = {&param, &exp_avg, &exp_avg_sq, &half};
              TIDAL_CHECK(undo->size() == 4, "undo has ", undo->size(),
                          " buffers; give one per chunk buffer (param, exp_avg, exp_avg_sq, half)");
              TIDAL_CHECK(undo_lo >= 0 && undo_lo <= undo_hi &&
                              static_cast<std::size_t>(undo_hi) <= job.chunk.numel,
                          "undo range [", undo_lo, ", ", undo_hi, ") is not inside the chunk of ",
                          job.chunk.numel, " elements");
              const std::int64_t n = undo_hi - undo_lo;
              for (std::size_t i = 0; i < 4; ++i) {
                const std::string name = "undo[" + std::to_string(i) + "]";
                const std::string source = name + "'s chunk buffer";
                const Flat whole = flat((*undo)[i], name);
                TIDAL_CHECK(static_cast<std::int64_t>(whole.count) >= n, name, " has ", whole.count,
                            " elements; the undo range needs ", n);
                job.undo.push_back(
                    copy_span(flat((*undo)[i], name, 0, n), flat(*views[i], source, undo_lo, n), name, source));
              }
            }
            for (const CopyFence& f : fences) job.fences.push_back(f.wait);
            job.exec = ca::ExecOptions{num_threads, ca::CopyStores::kAuto, tidal::hooks::block_runner(pool)};
            return std::const_pointer_cast<ca::UpdateTicket>(w.submit(std::move(job)));
          },
          py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("half"),
          py::arg("calls"), py::kw_only(), py::arg("fences") = std::vector<CopyFence>{},
          py::arg("undo") = py::none(), py::arg("undo_lo") = 0, py::arg("undo_hi") = 0,
          py::arg("grad") = py::none(), py::arg("adamw_mode") = true,
          py::arg("bias_correction") = true, py::arg("loss_scale") = 1.0,
          py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
          R"doc(Queues one chunk's update and returns its UpdateTicket: the fences waited
for, then (undo given: four buffers) the chunk buffers' elements [undo_lo,
undo_hi) copied into undo's, then adam_chunk_step once per call, each call
(ranges, steps, lr, beta1, beta2, eps, weight_decay) with no overflow check
and no clipping (the caller's grad scale in loss_scale). The buffers as
adam_chunk_step takes them; they must stay alive and in place until the
ticket is done.)doc")
      .def(
          "run_or_wait",
          [](ca::UpdateWorker& w, const ca::UpdateTicket& t) {
            py::gil_scoped_release no_gil;
            UncountedScope uncounted;  // (as on the worker's thread)
            return w.run_or_wait(t);
          },
          py::arg("ticket"),
          R"doc(Blocks until `ticket`'s job (one of this worker's) is done, the GIL
released, running it on this thread where the worker has not started it and
no job before it touches the same chunk (Note [A waiter runs the job itself]
in cpu_adam/update_worker.h). Returns True where it ran here.)doc");
}

void bind_classes(py::module_& m) {
  py::class_<ca::GradStats>(m, "GradStats",
                            "Result of grad_stats(); also built by a caller that sums the stats "
                            "of several chunks for adam_chunk_step(known_stats=...).")
      .def(py::init([](bool finite, double sum_squares) { return ca::GradStats{finite, sum_squares}; }),
           py::kw_only(), py::arg("finite"), py::arg("sum_squares"))
      .def_readonly("finite", &ca::GradStats::finite, "False when any gradient is inf or nan.")
      .def_readonly("sum_squares", &ca::GradStats::sum_squares,
                    "Sum of (grad * grad_scale)**2; meaningful only when finite.")
      .def("__repr__", [](const ca::GradStats& s) {
        return "GradStats(finite=" + std::string(s.finite ? "True" : "False") +
               ", sum_squares=" + std::to_string(s.sum_squares) + ")";
      });
  py::class_<ca::AdamStepResult>(m, "AdamStepResult", "Result of adam_step().")
      .def_readonly("overflow", &ca::AdamStepResult::overflow,
                    "True when an inf/nan gradient was found and nothing was written.")
      .def_readonly("grad_norm", &ca::AdamStepResult::grad_norm,
                    "L2 norm of the unscaled gradients, -1.0 when not computed.")
      .def_readonly("clip_coef", &ca::AdamStepResult::clip_coef,
                    "Factor applied to the unscaled gradients (1.0: not clipped).")
      .def("__repr__", [](const ca::AdamStepResult& r) {
        return "AdamStepResult(overflow=" + std::string(r.overflow ? "True" : "False") +
               ", grad_norm=" + std::to_string(r.grad_norm) +
               ", clip_coef=" + std::to_string(r.clip_coef) + ")";
      });
}

}  // namespace

void bind_cpu_adam(py::module_& parent) {
  py::module_ m = parent.def_submodule("cpu_adam", R"doc(
SIMD Adam/AdamW on CPU tensors (see cpu_adam/adam.h for the contracts).

Every tensor must be a contiguous CPU tensor. params are float32 (the fp32
master weights); exp_avg/exp_avg_sq float32 or bfloat16 (both the same);
grads float32, float16 or bfloat16; param_copy, where given, float16 or
bfloat16 and receives the updated params rounded to nearest even. The GIL is
released while the kernels run.)doc");
  bind_classes(m);
  m.attr("block_elements") = ca::kBlockElements;

  m.def(
      "adam_update_tensors",
      [](const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
         const std::vector<std::int64_t>& steps, double lr, double beta1, double beta2, double eps,
         double weight_decay, bool adamw_mode, bool bias_correction, int num_threads,
         const std::string& pool) {
        const std::size_t n = params.size();
        TIDAL_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                        steps.size() == n,
                    "params, grads, exp_avgs, exp_avg_sqs and steps must have one entry per "
                    "param; got lengths ",
                    n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ",
                    steps.size());
        std::vector<ca::AdamSpan> spans(n);
        ca::AdamDTypes dtypes;
        for (std::size_t i = 0; i < n; ++i) {
          const std::string idx = "[" + std::to_string(i) + "]";
          const Flat p = flat(params[i], "params" + idx);
          TIDAL_CHECK_TYPE(p.dtype == ca::DType::kFloat32, "params", idx,
                           " must be torch.float32, got ", ca::dtype_name(p.dtype));
          const Flat g = flat(grads[i], "grads" + idx);
          const Flat m = flat(exp_avgs[i], "exp_avgs" + idx);
          const Flat v = flat(exp_avg_sqs[i], "exp_avg_sqs" + idx);
          for (const Flat* f : {&g, &m, &v}) {
            TIDAL_CHECK_TYPE(f->dtype == ca::DType::kFloat32, "grads, exp_avgs and exp_avg_sqs",
                             idx, " must be torch.float32 like their param, got ",
                             ca::dtype_name(f->dtype));
            TIDAL_CHECK(f->count == p.count, "grads, exp_avgs and exp_avg_sqs", idx,
                        " must have as many elements as params", idx, " (", p.count, "), got ",
                        f->count);
          }
          spans[i] = ca::AdamSpan{static_cast<float*>(p.data), m.data, v.data, g.data, nullptr,
                                  p.count, steps[i]};
        }
        const ca::AdamHyperParams h =
            hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
        const ca::ExecOptions exec{num_threads, ca::CopyStores::kAuto, tidal::hooks::block_runner(pool)};
        py::gil_scoped_release no_gil;
        ca::adam_update(h, dtypes, spans, 1.0, exec);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
      py::arg("steps"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
      py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode") = true,
      py::arg("bias_correction") = true, py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
      R"doc(One Adam/AdamW step over fp32 tensors, one span per param, all in one
parallel pass. steps[i] is the step this update makes (torch's state['step']
after its increment). Used by tidal.optim.CPUAdam.)doc");

  m.def(
      "adam_update",
      [](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         const at::Tensor& grad, const std::optional<at::Tensor>& param_copy, std::int64_t step,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, double grad_scale, std::int64_t offset, std::int64_t count,
         int num_threads) {
        const SpanArgs a = span_args(param, exp_avg, exp_avg_sq, grad, param_copy, step, offset, count);
        const ca::AdamHyperParams h =
            hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
        py::gil_scoped_release no_gil;
        ca::adam_update(h, a.dtypes, {&a.span, 1}, grad_scale, ca::ExecOptions{num_threads});
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
      py::arg("param_copy") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"),
      py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
      py::arg("weight_decay") = 0.0, py::arg("adamw_mode") = true,
      py::arg("bias_correction") = true, py::arg("grad_scale") = 1.0, py::arg("offset") = 0,
      py::arg("count") = -1, py::arg("num_threads") = 0,
      R"doc(The update pass over elements [offset, offset + count) of flat buffers.

The chunk engine's entry: param, exp_avg, exp_avg_sq and grad are the
chunks of the four chunk lists (tensor i sits at the same offset in each);
param_copy, when given, receives the updated params as float16/bfloat16 and
may be the very tensor that holds the 16-bit grads (each element is read
before it is overwritten). Any memory the process owns can take part through
a zero-copy tensor view, e.g. torch.frombuffer(host_buffer, dtype=...).

The update sees grad * grad_scale: pass clip_coef / loss_scale to unscale
and clip in the same pass. No inf/nan check here; see adam_step() and
grad_stats(). count=-1 means to the end of param.)doc");

  m.def(
      "adam_step",
      [](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         const at::Tensor& grad, const std::optional<at::Tensor>& param_copy, std::int64_t step,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, double loss_scale, double max_grad_norm, bool check_overflow,
         std::int64_t offset, std::int64_t count, int num_threads) {
        const SpanArgs a = span_args(param, exp_avg, exp_avg_sq, grad, param_copy, step, offset, count);
        const ca::AdamHyperParams h =
            hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
        ca::AdamStepOptions opt;
        opt.loss_scale = loss_scale;
        opt.max_grad_norm = max_grad_norm;
        opt.check_overflow = check_overflow;
        py::gil_scoped_release no_gil;
        return ca::adam_step(h, a.dtypes, {&a.span, 1}, opt, ca::ExecOptions{num_threads});
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
      py::arg("param_copy") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"),
      py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
      py::arg("weight_decay") = 0.0, py::arg("adamw_mode") = true,
      py::arg("bias_correction") = true, py::arg("loss_scale") = 1.0,
      py::arg("max_grad_norm") = 0.0, py::arg("check_overflow") = true, py::arg("offset") = 0,
      py::arg("count") = -1, py::arg("num_threads") = 0,
      R"doc(Both passes over one buffer set: the gradient pass (inf/nan check and
sum of squares, when check_overflow or max_grad_norm > 0 asks for it), then
the update with grad / loss_scale * clip_coef, where clip_coef =
min(1, max_grad_norm / (norm + 1e-6)) as in torch.nn.utils.clip_grad_norm_.
On an inf/nan gradient (check_overflow) nothing is written and the result
says overflow=True. Returns an AdamStepResult.)doc");

  m.def(
      "grad_stats",
      [](const at::Tensor& grad, double grad_scale, std::int64_t offset, std::int64_t count,
         int num_threads) {
        const Flat g = flat(grad, "grad", offset, count);
        const ca::GradSpan span{g.data, g.count};
        py::gil_scoped_release no_gil;
        return ca::grad_stats(g.dtype, {&span, 1}, grad_scale, ca::ExecOptions{num_threads});
      },
      py::arg("grad"), py::kw_only(), py::arg("grad_scale") = 1.0, py::arg("offset") = 0,
      py::arg("count") = -1, py::arg("num_threads") = 0,
      R"doc(The gradient pass alone: GradStats(finite, sum_squares of grad * grad_scale).
For a global norm over many buffers, add the sum_squares of each.)doc");

  m.def(
      "adam_chunk_step",
      [](const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
         const at::Tensor& half, const Ranges& ranges, const Steps& step, double lr, double beta1,
         double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
         double loss_scale, double max_grad_norm, bool check_overflow,
         const std::optional<ca::GradStats>& known_stats, const std::optional<at::Tensor>& grad,
         int num_threads, const std::string& pool) {
        const ca::AdamChunk chunk = chunk_of(param, exp_avg, exp_avg_sq, half, grad);
        const std::vector<ca::ChunkRange> rs = ranges_of(ranges, step, chunk.numel);
        const ca::AdamHyperParams h =
            hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction);
        ca::AdamStepOptions opt;
        opt.loss_scale = loss_scale;
        opt.max_grad_norm = max_grad_norm;
        opt.check_overflow = check_overflow;
        opt.known_stats = known_stats;
        const ca::ExecOptions exec{num_threads, ca::CopyStores::kAuto, tidal::hooks::block_runner(pool)};
        py::gil_scoped_release no_gil;
        return ca::adam_chunk_step(h, chunk, rs, opt, exec);
      },
      py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("half"),
      py::arg("ranges") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"),
      py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
      py::arg("weight_decay") = 0.0, py::arg("adamw_mode") = true,
      py::arg("bias_correction") = true, py::arg("loss_scale") = 1.0,
      py::arg("max_grad_norm") = 0.0, py::arg("check_overflow") = true,
      py::arg("known_stats") = py::none(), py::arg("grad") = py::none(),
      py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
      R"doc(The optimizer step of one chunk in one call (cpu_adam/adam.h, adam_chunk_step).

param (float32), exp_avg and exp_avg_sq (float32 or bfloat16) and half (float16
or bfloat16) are the four flat chunk buffers of equal length; half holds the
loss-scaled gradients and receives the updated params rounded to nearest even.
half may be float32 (the engine's fp32 mode): it receives the params exactly.
ranges: list of (offset, count), the tensors of the chunk (disjoint, inside
it); None updates the whole chunk. step: the step this update makes, one int
or one per range. Elements outside the ranges are untouched.

known_stats: GradStats(finite=..., sum_squares=...) of the unscaled gradients
of every chunk of the step (sum of grad_stats(half, grad_scale=1/loss_scale)
over them). Given, the step is one memory pass per chunk: unscale, clip with
min(1, max_grad_norm / (norm + 1e-6)), skip on inf/nan, Adam/AdamW and the
16-bit write-back. Without it, the inf/nan check and the norm cover this
chunk's ranges only. Returns an AdamStepResult; the GIL is released.

grad: a float32 chunk of loss-scaled gradient sums (gradient accumulation,
Note [Gradient sums in chunks]); given, the gradients are read from it and half
only receives the updated params.)doc");

  m.def(
      "fold_gradients",
      [](const at::Tensor& sum, const at::Tensor& half, const std::optional<at::Tensor>& master,
         const std::vector<std::tuple<std::int64_t, std::int64_t, bool>>& ranges,
         int num_threads, bool measure) -> py::object {
        const Flat s = flat(sum, "sum");
        const Flat h16 = flat(half, "half");
        // (None: the half keeps the gradients; Note [The weights' image
        // instead of the restore] in hooks/gradient_sums.h.)
        const Flat w = master.has_value() ? flat(*master, "master") : s;
        TIDAL_CHECK_TYPE(s.dtype == ca::DType::kFloat32 && w.dtype == ca::DType::kFloat32,
                         "sum and master must be torch.float32, got ", ca::dtype_name(s.dtype),
                         " and ", ca::dtype_name(w.dtype));
        TIDAL_CHECK(s.count == h16.count && w.count == h16.count, "sum (", s.count, "), half (",
                    h16.count, ") and master (", w.count,
                    ") must have as many elements each; they are one chunk of three lists");
        const float* masters = master.has_value() ? static_cast<const float*>(w.data) : nullptr;
        std::vector<ca::FoldSpan> spans;
        spans.reserve(ranges.size());
        const std::size_t half_size = ca::dtype_size(h16.dtype);
        for (std::size_t i = 0; i < ranges.size(); ++i) {
          const auto [off, cnt, first] = ranges[i];
          TIDAL_CHECK(off >= 0 && cnt >= 0 && static_cast<std::size_t>(off + cnt) <= h16.count,
                      "ranges[", i, "] = (", off, ", ", cnt, "): out of range for a chunk of ",
                      h16.count, " elements");
          spans.push_back({static_cast<float*>(s.data) + off,
                           static_cast<char*>(h16.data) + off * half_size,
                           masters == nullptr ? nullptr : masters + off,
                           static_cast<std::size_t>(cnt),
                           first});
        }
        std::vector<ca::GradStats> stats(measure ? spans.size() : 0);
        {
          py::gil_scoped_release no_gil;
          ca::fold_gradients(h16.dtype, spans, ca::ExecOptions{num_threads}, stats);
        }
        if (!measure) return py::none();
        return py::cast(stats);
      },
      py::arg("sum"), py::arg("half"), py::arg("master"), py::arg("ranges"), py::kw_only(),
      py::arg("num_threads") = 0, py::arg("measure") = false,
      R"doc(Gradient accumulation's fold (cpu_adam/adam.h, fold_gradients): for each
(offset, count, first) range, sum = (first ? 0 : sum) + float(half), then half
= master rounded to half's dtype. sum and master are float32 chunks, half the
16-bit chunk (float32 in fp32 mode) holding the landed gradients. master None:
half keeps the gradients (the engine's chunk takes back the block of its
weights instead: Note [The weights' image instead of the restore]). measure:
also returns one GradStats per range, of its new sums, bitwise what
grad_stats of those sums returns (Note [Measured in the fold]); else None.)doc");

  m.def(
      "copy_tensors",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs, int num_threads) {
        TIDAL_CHECK(dsts.size() == srcs.size(), "dsts (", dsts.size(), ") and srcs (", srcs.size(),
                    ") must have as many tensors");
        std::vector<ca::CopySpan> spans;
        spans.reserve(dsts.size());
        for (std::size_t i = 0; i < dsts.size(); ++i) {
          const std::string di = "dsts[" + std::to_string(i) + "]";
          const std::string si = "srcs[" + std::to_string(i) + "]";
          spans.push_back(copy_span(flat(dsts[i], di), flat(srcs[i], si), di, si));
        }
        py::gil_scoped_release no_gil;
        ca::copy_spans(spans, ca::ExecOptions{num_threads});
      },
      py::arg("dsts"), py::arg("srcs"), py::kw_only(), py::arg("num_threads") = 0,
      R"doc(dsts[i].copy_(srcs[i]) for contiguous CPU tensors of the same dtype and size,
on oneTBB's threads (cpu_adam/adam.h, copy_spans; Note [A second OpenMP team]): for
copies made on a thread other than the script's, which torch's operators would
give an OpenMP team of its own.)doc");

  bind_update_worker(m);

  m.def("available_targets", &ca::available_kernel_targets,
        "Kernel targets this build and CPU run, best first; 'reference' (plain C++) last.");
  m.def(
      "set_target", [](const std::string& name) { ca::set_kernel_target(name); }, py::arg("name"),
      "Selects the kernels process-wide: a name from available_targets(), 'auto', "
      "'baseline' (Highway's fallback) or 'reference'. The environment variable "
      "TIDAL_CPU_ADAM_TARGET sets the initial choice.");
  m.def("target", &ca::kernel_target, "The kernel target in use.");
}

}  // namespace tidal::python
