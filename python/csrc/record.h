// A C++ struct of counters or facts, bound as a read-only Python record.
//
// Note [Records, not dicts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A struct the binding hands to Python (a device's info, memory statistics,
// DTR's counters) is bound once as a class whose fields are read-only
// attributes (def_readonly, or a getter for a field Python sees in another
// form, such as an enum's name), instead of a hand-written function copying
// each field into a dict. The callers that took those dicts keep working:
// a record also speaks the read-only mapping protocol over the same fields
// (r["key"], get, keys, values, items, iteration over the keys, len, in, ==
// against a dict), so dict(r) is the dict it replaced, and the Python API
// that hands such counters to users (tidal.stats(), memory_report(),
// tidal.device_info()) gives dict(r), which JSON and pickle take.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace tidal::python {

namespace py = pybind11;

template <typename T>
class RecordBinding {
 public:
  RecordBinding(py::handle scope, const char* name, const char* doc)
      : cls_(scope, name, doc), fields_(std::make_shared<Fields>()) {}

  // A field Python reads as it is in C++ (a member of T or of a base of T).
  template <typename C, typename M>
  RecordBinding& field(const char* name, M C::*member, const char* doc = "") {
    static_assert(std::is_base_of_v<C, T>, "a field of the record's struct or of a base of it");
    cls_.def_readonly(name, member, doc);
    fields_->push_back({name, [member](const T& t) { return py::cast(t.*member); }});
    return *this;
  }
  // A field Python reads in another form (an enum's name, a count of a list).
  template <typename F>
  RecordBinding& field_from(const char* name, F get, const char* doc = "") {
    cls_.def_property_readonly(name, get, doc);
    fields_->push_back({name, [get](const T& t) { return py::cast(get(t)); }});
    return *this;
  }

  // The mapping protocol and the repr, over the fields declared so far.
  py::class_<T> done() {
    std::shared_ptr<Fields> fields = fields_;
    auto as_dict = [fields](const T& t) {
      py::dict d;
      for (const Field& f : *fields) d[py::str(f.name)] = f.get(t);
      return d;
    };
    cls_.def("__getitem__",
             [fields](const T& t, const std::string& key) -> py::object {
               for (const Field& f : *fields) {
                 if (f.name == key) return f.get(t);
               }
               throw py::key_error(key);
             },
             py::arg("key"))
        .def("get",
             [fields](const T& t, const std::string& key, py::object fallback) -> py::object {
               for (const Field& f : *fields) {
                 if (f.name == key) return f.get(t);
               }
               return fallback;
             },
             py::arg("key"), py::arg("default") = py::none())
        .def("__contains__",
             [fields](const T&, const py::object& key) {
               if (!py::isinstance<py::str>(key)) return false;
               const std::string k = key.cast<std::string>();
               for (const Field& f : *fields) {
                 if (f.name == k) return true;
               }
               return false;
             })
        .def("keys", [as_dict](const T& t) { return as_dict(t).attr("keys")(); })
        .def("values", [as_dict](const T& t) { return as_dict(t).attr("values")(); })
        .def("items", [as_dict](const T& t) { return as_dict(t).attr("items")(); })
        .def("__iter__", [fields](const T&) {
          py::list out;
          for (const Field& f : *fields) out.append(py::str(f.name));
          return out.attr("__iter__")();
        })
        .def("__len__", [fields](const T&) { return fields->size(); })
        .def("__eq__",
             [as_dict](const T& t, const py::object& other) -> py::object {
               if (py::isinstance<T>(other)) return as_dict(t).attr("__eq__")(as_dict(other.cast<const T&>()));
               if (py::isinstance<py::dict>(other)) return as_dict(t).attr("__eq__")(other);
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             })
        .def("__repr__", [as_dict, name = std::string(py::str(cls_.attr("__name__")))](const T& t) {
          return name + "(" + std::string(py::repr(as_dict(t))) + ")";
        });
    cls_.attr("__hash__") = py::none();  // (a record compares by value)
    return cls_;
  }

 private:
  struct Field {
    std::string name;
    std::function<py::object(const T&)> get;
  };
  using Fields = std::vector<Field>;

  py::class_<T> cls_;
  std::shared_ptr<Fields> fields_;
};

}  // namespace tidal::python
