// Python bindings of the device layer and host memory: real classes whose
// lifetimes follow the Python objects (a Stream, Event or buffer keeps its
// Device alive through the C++ shared_ptr it holds).
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <variant>

#include "cpu_adam/simd_target.h"
#include "hooks/cuda_room.h"
#include "hooks/torch_memory_provider.h"
#include "python/csrc/bindings.h"
#include "python/csrc/record.h"
#include "runtime/core/error.h"
#include "runtime/core/units.h"
#include "runtime/device/select.h"
#include "runtime/memory/caching_allocator_model.h"
#include "runtime/memory/host_buffer.h"

namespace tidal::python {
namespace {

using ByteSize = std::variant<std::size_t, std::string>;

// CachingAllocatorModel::use() with the model's segment count, for Python.
struct ModelUse : AllocatorUse {
  std::size_t segments = 0;
};

std::size_t to_bytes(const ByteSize& value) {
  if (const auto* n = std::get_if<std::size_t>(&value)) return *n;
  return parse_bytes(std::get<std::string>(value));
}

// [offset, offset + nbytes) must lie inside a buffer of `size` bytes.
void check_range(const char* what, std::size_t offset, std::size_t nbytes, std::size_t size) {
  TIDAL_CHECK(offset <= size && nbytes <= size - offset, what, ": range [", offset, ", ",
              offset + nbytes, ") is outside the buffer of ", size, " bytes");
}

char* at(void* base, std::size_t offset) { return static_cast<char*>(base) + offset; }

void copy(Device& device, void* dst, std::size_t dst_size, std::size_t dst_offset, const void* src,
          std::size_t src_size, std::size_t src_offset, std::optional<std::size_t> nbytes,
          CopyKind kind, Stream& stream) {
  const std::size_t n = nbytes.value_or(std::min(dst_size - std::min(dst_offset, dst_size),
                                                 src_size - std::min(src_offset, src_size)));
  check_range("copy destination", dst_offset, n, dst_size);
  check_range("copy source", src_offset, n, src_size);
  py::gil_scoped_release release;
  device.copy_async(at(dst, dst_offset), at(const_cast<void*>(src), src_offset), n, kind, stream);
}

}  // namespace

void bind_device(py::module_& m) {
  m.def("parse_bytes", [](const std::string& text) { return parse_bytes(text); }, py::arg("text"),
        "Bytes in a size such as '64MiB' or '5GB' (KB/MB/GB: powers of 1000; KiB/MiB/GiB: 1024).");
  m.def("cpu_simd_target", &cpu_adam::chosen_simd_target,
        "The SIMD target the CPU kernels dispatch to on this machine.");
  m.def("runnable_simd_targets", &cpu_adam::runnable_simd_targets,
        "Compiled SIMD targets this CPU can run, best first.");
  m.def("cuda_backend_compiled", &cuda_backend_compiled);
  m.def("cuda_device_count", [] {
    std::string why;
    const int n = cuda_device_count(&why);
    return py::make_tuple(n, why);
  }, "(number of GPUs, reason when 0)");
  // Note [Records, not dicts] in python/csrc/record.h.
  RecordBinding<DeviceInfo>(m, "DeviceInfo", "What a device is (runtime/device/device.h).")
      .field_from("backend", [](const DeviceInfo& i) { return std::string(to_string(i.backend)); })
      .field("name", &DeviceInfo::name)
      .field("ordinal", &DeviceInfo::ordinal)
      .field("total_memory", &DeviceInfo::total_memory_bytes)
      .field("capacity", &DeviceInfo::capacity_bytes)
      .field("free_memory", &DeviceInfo::free_memory_bytes)
      .field("pinned_memory", &DeviceInfo::pinned_host_memory)
      .field("sim_copy_bandwidth", &DeviceInfo::copy_bandwidth_bytes_per_s)
      .field("sim_copy_latency_s", &DeviceInfo::copy_latency_s)
      .field("sim_pin_bandwidth", &DeviceInfo::pin_bandwidth_bytes_per_s)
      .done();
  RecordBinding<DeviceMemoryStats>(m, "DeviceMemoryStats", "A device's memory counters, in bytes and calls.")
      .field("in_use", &DeviceMemoryStats::in_use_bytes)
      .field("peak_in_use", &DeviceMemoryStats::peak_in_use_bytes)
      .field("capacity", &DeviceMemoryStats::capacity_bytes)
      .field("live_allocations", &DeviceMemoryStats::live_allocations)
      .field("allocations", &DeviceMemoryStats::allocations)
      .field("frees", &DeviceMemoryStats::frees)
      .field("failed_allocations", &DeviceMemoryStats::failed_allocations)
      .field("provided", &DeviceMemoryStats::provided_bytes)
      .done();
  RecordBinding<HostMemoryStats>(m, "HostMemoryStats", "Host buffers' counters, in bytes and buffers.")
      .field("allocated", &HostMemoryStats::allocated_bytes)
      .field("peak_allocated", &HostMemoryStats::peak_allocated_bytes)
      .field("pinned", &HostMemoryStats::pinned_bytes)
      .field("huge_page", &HostMemoryStats::huge_page_bytes)
      .field("live_buffers", &HostMemoryStats::live_buffers)
      .done();
  m.def("host_memory_stats", [] { return host_memory_stats(); });
  m.def("reset_host_memory_peak", &reset_host_memory_peak);

  py::class_<Device, std::shared_ptr<Device>> device(m, "Device", R"doc(
A device tidal moves memory to: a CUDA GPU or the simulated device.
Create one with tidal.set_device() / tidal.get_device(); not constructible directly.)doc");
  device.def("info", [](const Device& d) { return d.info(); })
      .def_property_readonly("backend", [](const Device& d) { return to_string(d.backend()); })
      .def("memory_stats", [](const Device& d) { return d.memory_stats(); })
      .def("reset_peak_memory", &Device::reset_peak_memory)
      .def_property("capacity", &Device::capacity,
                    [](Device& d, const ByteSize& bytes) { d.set_capacity(to_bytes(bytes)); },
                    "Bytes allocate() may hand out in total; settable (int or '4GiB').")
      .def("allocate", [](Device& d, const ByteSize& nbytes) {
             return std::make_unique<DeviceBuffer>(d.allocate(to_bytes(nbytes)));
           }, py::arg("nbytes"), "Device memory; raises tidal.OutOfMemoryError past capacity.")
      .def("create_stream", &Device::create_stream, py::arg("name"))
      .def("create_event", &Device::create_event, py::arg("enable_timing") = false)
      .def("synchronize", &Device::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("copy_h2d",
           [](Device& d, DeviceBuffer& dst, const HostBuffer& src, Stream& stream,
              std::optional<std::size_t> nbytes, std::size_t dst_offset, std::size_t src_offset) {
             copy(d, dst.data(), dst.size(), dst_offset, src.data(), src.size(), src_offset, nbytes,
                  CopyKind::kHostToDevice, stream);
           },
           py::arg("dst"), py::arg("src"), py::arg("stream"), py::arg("nbytes") = py::none(),
           py::arg("dst_offset") = 0, py::arg("src_offset") = 0,
           "Asynchronous host-to-device copy on `stream` (nbytes defaults to what fits).")
      .def("copy_d2h",
           [](Device& d, HostBuffer& dst, const DeviceBuffer& src, Stream& stream,
              std::optional<std::size_t> nbytes, std::size_t dst_offset, std::size_t src_offset) {
             copy(d, dst.data(), dst.size(), dst_offset, src.data(), src.size(), src_offset, nbytes,
                  CopyKind::kDeviceToHost, stream);
           },
           py::arg("dst"), py::arg("src"), py::arg("stream"), py::arg("nbytes") = py::none(),
           py::arg("dst_offset") = 0, py::arg("src_offset") = 0)
      .def("copy_d2h_external",
           [](Device& d, HostBuffer& dst, std::uintptr_t src, std::size_t nbytes, Stream& stream,
              std::size_t dst_offset) {
             check_range("copy destination", dst_offset, nbytes, dst.size());
             py::gil_scoped_release release;
             d.copy_async_external(at(dst.data(), dst_offset), reinterpret_cast<const void*>(src), nbytes,
                                   CopyKind::kDeviceToHost, stream);
           },
           py::arg("dst"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("stream"), py::arg("dst_offset") = 0,
           "Asynchronous device-to-host copy from device memory this device did not allocate "
           "(a torch tensor's data_ptr()); the caller keeps it alive until the copy is done.")
      .def("copy_h2d_external",
           [](Device& d, std::uintptr_t dst, const HostBuffer& src, std::size_t nbytes, Stream& stream,
              std::size_t src_offset) {
             check_range("copy source", src_offset, nbytes, src.size());
             py::gil_scoped_release release;
             d.copy_async_external(reinterpret_cast<void*>(dst), at(const_cast<void*>(src.data()), src_offset),
                                   nbytes, CopyKind::kHostToDevice, stream);
           },
           py::arg("dst_ptr"), py::arg("src"), py::arg("nbytes"), py::arg("stream"), py::arg("src_offset") = 0,
           "Asynchronous host-to-device copy into device memory this device did not allocate.")
      .def("copy_d2d",
           [](Device& d, DeviceBuffer& dst, const DeviceBuffer& src, Stream& stream,
              std::optional<std::size_t> nbytes, std::size_t dst_offset, std::size_t src_offset) {
             copy(d, dst.data(), dst.size(), dst_offset, src.data(), src.size(), src_offset, nbytes,
                  CopyKind::kDeviceToDevice, stream);
           },
           py::arg("dst"), py::arg("src"), py::arg("stream"), py::arg("nbytes") = py::none(),
           py::arg("dst_offset") = 0, py::arg("src_offset") = 0)
      .def("__repr__", [](const Device& d) {
        const DeviceInfo info = d.info();
        return "<tidal.Device " + std::string(to_string(info.backend)) + " '" + info.name +
               "' capacity=" + format_bytes(info.capacity_bytes) + ">";
      });

  py::class_<Stream, std::unique_ptr<Stream>>(m, "Stream", "An in-order queue of asynchronous work.")
      .def_property_readonly("name", &Stream::name)
      .def("wait", &Stream::wait, py::arg("event"),
           "Later work on this stream waits for the event's latest record.")
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Stream::query);

  py::class_<Event, std::unique_ptr<Event>>(m, "Event", "Marks a point in a stream's work.")
      .def("record", &Event::record, py::arg("stream"))
      .def("query", &Event::query)
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("elapsed_seconds_since", &Event::elapsed_seconds_since, py::arg("start"));

  py::class_<DeviceBuffer, std::unique_ptr<DeviceBuffer>>(m, "DeviceBuffer",
                                                           "Device memory; freed when collected.")
      .def_property_readonly("nbytes", &DeviceBuffer::size)
      .def_property_readonly("data_ptr",
                             [](const DeviceBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
      .def("__repr__", [](const DeviceBuffer& b) {
        return "<tidal.DeviceBuffer " + format_bytes(b.size()) + ">";
      });

  py::class_<HostBuffer, std::unique_ptr<HostBuffer>>(m, "HostBuffer", py::buffer_protocol(), R"doc(
Aligned host memory (mimalloc), on huge pages when large, pinned when given a
CUDA device. Supports the buffer protocol: memoryview(buf), numpy.frombuffer,
torch.frombuffer see its bytes without a copy.)doc")
      .def(py::init([](const ByteSize& nbytes, std::shared_ptr<Device> pin_with, std::size_t alignment) {
             if (pin_with) return std::make_unique<HostBuffer>(to_bytes(nbytes), std::move(pin_with), alignment);
             return std::make_unique<HostBuffer>(to_bytes(nbytes), alignment);
           }),
           py::arg("nbytes"), py::arg("pin_with") = nullptr,
           py::arg("alignment") = HostBuffer::kDefaultAlignment)
      .def_property_readonly("nbytes", &HostBuffer::size)
      .def_property_readonly("pinned", &HostBuffer::pinned)
      .def_property_readonly("huge_pages", &HostBuffer::huge_pages)
      .def_property_readonly("alignment", &HostBuffer::alignment)
      .def_property_readonly("data_ptr",
                             [](const HostBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {1});
      })
      .def("__repr__", [](const HostBuffer& b) {
        return "<tidal.HostBuffer " + format_bytes(b.size()) + (b.pinned() ? " pinned" : "") + ">";
      });

  // Note [Device memory providers] (device.h), Note [Chunk memory and torch's
  // caching allocator] (hooks/torch_memory_provider.h).
  py::class_<DeviceMemoryProvider, std::shared_ptr<DeviceMemoryProvider>>(m, "DeviceMemoryProvider",
      "Where a device's allocations come from instead of its backend's allocator.")
      .def_property_readonly("name", &DeviceMemoryProvider::name)
      .def("__repr__", [](const DeviceMemoryProvider& p) {
        return "<tidal.DeviceMemoryProvider " + p.name() + ">";
      });
  using hooks::TorchMemoryProvider;
  py::class_<TorchMemoryProvider, DeviceMemoryProvider, std::shared_ptr<TorchMemoryProvider>>(
      m, "TorchMemoryProvider", R"doc(
Device memory from one of torch's allocators (CUDA caching allocator; CPU
allocator counted by the host allocation counter on the simulated device).
held_bytes: what torch counts for the blocks it handed out and did not get
back; other_bytes / other_peak_bytes: torch's allocated bytes less those, now
and at most since reset_window() (exact; see Note [Chunk memory and torch's
caching allocator]).)doc")
      .def("held_bytes", &TorchMemoryProvider::held_bytes)
      .def("held_blocks", &TorchMemoryProvider::held_blocks)
      .def("other_bytes", &TorchMemoryProvider::other_bytes)
      .def("other_peak_bytes", &TorchMemoryProvider::other_peak_bytes)
      .def("reset_window", &TorchMemoryProvider::reset_window)
      .def("allocations", &TorchMemoryProvider::allocations)
      .def("frees", &TorchMemoryProvider::frees);
  m.def("torch_cuda_memory_provider", &hooks::make_torch_cuda_memory_provider, py::arg("ordinal"),
        py::arg("stream"),
        "Chunk memory from torch's CUDA caching allocator on device `ordinal`, blocks on "
        "`stream` (a cudaStream_t as int). Raises NotImplementedError unless torch is a CUDA build.");
  // Note [Who owns a device byte] (runtime/memory/caching_allocator_model.h):
  // the model, for the GPU run that checks it against torch's own allocator.
  RecordBinding<ModelUse>(m, "CachingAllocatorModelUse", "What the model holds, in bytes, and its segments.")
      .field("reserved", &AllocatorUse::reserved)
      .field("allocated", &AllocatorUse::allocated)
      .field("active", &AllocatorUse::active)
      .field("inactive_split", &AllocatorUse::inactive_split)
      .field("segments", &ModelUse::segments)
      .done();
  py::class_<CachingAllocatorModel>(m, "CachingAllocatorModel", R"doc(
torch's CUDA caching allocator as a model: allocate(bytes, cap) places a request
as torch would (0 when it fails under the cap), free(handle) gives it back,
use() says reserved, allocated, active and inactive split bytes.)doc")
      .def(py::init<>())
      .def("allocate", [](CachingAllocatorModel& m, std::size_t bytes, std::size_t cap) {
             return m.allocate(bytes, [cap] { return cap; }, nullptr);
           }, py::arg("bytes"), py::arg("cap") = ~std::size_t{0})
      .def("free", &CachingAllocatorModel::free, py::arg("handle"))
      .def("release_cached", &CachingAllocatorModel::release_cached)
      .def("use", [](const CachingAllocatorModel& m) { return ModelUse{m.use(), m.segments()}; })
      .def_property_readonly("last_failure", &CachingAllocatorModel::last_failure)
      .def("validate", &CachingAllocatorModel::validate);
  m.def("room_to_make", [](std::size_t reserved, std::size_t active, std::size_t inactive_split,
                           std::size_t cap, std::size_t largest_request) {
          AllocatorUse u;
          u.reserved = reserved;
          u.allocated = active;
          u.active = active;
          u.inactive_split = inactive_split;
          return room_to_make(u, cap, largest_request);
        }, py::arg("reserved"), py::arg("active"), py::arg("inactive_split"), py::arg("cap"),
        py::arg("largest_request"));
  // Note [Room on a cache miss] (hooks/cuda_room.h), with a Python room maker:
  // for the GPU tests of the callback itself.
  m.def("arm_cuda_room", [](int ordinal, std::size_t cap, py::function maker) {
          // (Dropped with the GIL, whichever thread disarms or replaces it.)
          std::shared_ptr<py::function> held(new py::function(std::move(maker)), [](py::function* f) {
            py::gil_scoped_acquire gil;
            delete f;
          });
          return hooks::arm_cuda_room(ordinal, cap, [held](std::size_t bytes) {
            py::gil_scoped_acquire gil;
            return (*held)(bytes).cast<bool>();
          });
        }, py::arg("ordinal"), py::arg("cap"), py::arg("maker"),
        "While armed, torch's cache misses on device `ordinal` call maker(bytes) until a segment for "
        "the largest request seen fits under `cap` (maker returns whether it freed anything). "
        "Returns a token for disarm_cuda_room.");
  m.def("disarm_cuda_room", &hooks::disarm_cuda_room, py::arg("token"));
  m.def("torch_cpu_memory_provider", &hooks::make_torch_cpu_memory_provider,
        "Memory from torch's CPU allocator, always counted by the host allocation counter: the "
        "simulated device's stand-in for torch_cuda_memory_provider (tests).");
  device.def("set_memory_provider", &Device::set_memory_provider, py::arg("provider"),
             "Later allocations come from `provider` (None: the backend); live ones go back to "
             "where they came from.")
      .def("memory_provider", &Device::memory_provider);

  m.def("create_device",
        [](const std::string& kind, std::optional<ByteSize> capacity, std::optional<std::string> bandwidth,
           std::optional<double> latency_us, std::optional<std::string> pin_bandwidth) {
          SimDeviceOptions sim = sim_device_options_from_env();
          if (capacity) sim.capacity_bytes = to_bytes(*capacity);
          if (bandwidth) sim.copy_bandwidth_bytes_per_s = parse_bandwidth(*bandwidth);
          if (latency_us) {
            TIDAL_CHECK(*latency_us >= 0, "latency_us must be >= 0, got ", *latency_us);
            sim.copy_latency_s = *latency_us * 1e-6;
          }
          if (pin_bandwidth) sim.pin_bandwidth_bytes_per_s = parse_bandwidth(*pin_bandwidth);
          std::shared_ptr<Device> device = create_device(parse_device_kind(kind), sim);
          // On CUDA, capacity is a budget below the GPU's memory.
          if (capacity && device->backend() == DeviceBackend::kCuda) device->set_capacity(to_bytes(*capacity));
          return device;
        },
        py::arg("kind") = "auto", py::arg("capacity") = py::none(), py::arg("bandwidth") = py::none(),
        py::arg("latency_us") = py::none(), py::arg("pin_bandwidth") = py::none());
  m.def("default_device", &default_device);
  m.def("set_default_device", &set_default_device, py::arg("device"));
}

}  // namespace tidal::python
