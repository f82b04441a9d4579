// The "tpu" device's per-op signature in C++: the same key tuple as _core._signature_py, built without
// the Python interpreter's per-leaf bytecode (issue #28: the signature was the largest part of a
// Fused op's host cost).
//
// Built and loaded by tpudist/device/_fastpath.py (torch.utils.cpp_extension.load, a Python module).
// outputs() makes an op's fresh tensors (with their Buffers, and in Fused mode their Lazy values)
// as _storage._outputs_py does.
// signature(op, args, kwargs, static_floats) returns exactly what the Python version returns: the
// key (id(op), treedef, specs, slots, static_floats) with torch.Size sizes in "T" specs and tuples in
// "B" specs, the leaves (args itself when no argument is a list, tuple or keyword), the slot buffers
// and the runtime scalars. A tensor whose storage holds no device buffer goes to the Python
// _host_spec (a CPU scalar, or the device-mismatch error). Anything unusual (a tensor subclass other
// than Parameter, args not a tuple, kwargs not a dict, a C++ error reading a tensor) runs the whole
// call through the Python version, so an odd case costs time, never a different key.

#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

namespace {

PyObject* g_python_signature = nullptr;  // _core._signature_py: the reference, and the fallback
PyObject* g_host_spec = nullptr;         // _core._host_spec(op, x, scalars, static_floats)
PyObject* g_meta_device = nullptr;       // the ("S", value) stand-in of a tpu torch.device
PyObject* g_tensor_type = nullptr;       // torch.Tensor
PyObject* g_parameter_type = nullptr;    // torch.nn.Parameter
PyObject* g_attr = nullptr;              // "_tpudist_buffer"
PyObject* s_T = nullptr;
PyObject* s_B = nullptr;
PyObject* s_F = nullptr;
PyObject* s_S = nullptr;
PyObject* s_Z = nullptr;
PyObject* s_numel = nullptr;
PyObject* s_dtype = nullptr;
PyObject* s_value = nullptr;
PyObject* s_type = nullptr;
PyObject* s_tpu = nullptr;
PyTypeObject* g_buffer_type = nullptr;  // _storage.Buffer
PyTypeObject* g_lazy_type = nullptr;    // _storage.Lazy
PyObject* g_create_empty = nullptr;     // torch._C._acc.create_empty_tensor(shape, dtype)
PyObject* g_buffer_attr = nullptr;      // "_tpudist_buffer", for outputs()
// the C++ hooks' tpudist_set_storage_bytes (csrc/hooks.cpp): a fresh storage's size in bytes; null without them
int (*g_set_storage_bytes)(void*, int64_t) = nullptr;
PyObject* s_graph = nullptr;
PyObject* s_index = nullptr;
constexpr Py_ssize_t kCachedTreedefs = 32;
PyObject* g_flat_treedefs[kCachedTreedefs] = {};  // ((None,) * n, n, ()) for n positional leaves

// Owns one reference; released at scope exit unless released().
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* q = nullptr) : p(q) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  PyObject* release() {
    PyObject* q = p;
    p = nullptr;
    return q;
  }
};

// Signals "run the Python version" (not a Python error).
struct Fallback {};

PyObject* flat_treedef(Py_ssize_t n) {
  if (n < kCachedTreedefs && g_flat_treedefs[n] != nullptr) {
    Py_INCREF(g_flat_treedefs[n]);
    return g_flat_treedefs[n];
  }
  Ref nones(PyTuple_New(n));
  if (!nones.p) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(nones.p, i, Py_None);
  }
  Ref empty(PyTuple_New(0));
  if (!empty.p) return nullptr;
  PyObject* treedef = Py_BuildValue("(OnO)", nones.p, n, empty.p);
  if (treedef && n < kCachedTreedefs) {
    Py_INCREF(treedef);
    g_flat_treedefs[n] = treedef;
  }
  return treedef;
}

// flatten_args: (leaves list, treedef) with one level of lists/tuples flattened.
bool flatten(PyObject* args, PyObject* kwargs, Ref& leaves, Ref& treedef) {
  Py_ssize_t num_args = PyTuple_GET_SIZE(args);
  Py_ssize_t num_kwargs = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
  leaves.p = PyList_New(0);
  Ref names(PyTuple_New(num_kwargs));
  Ref struct_(PyTuple_New(num_args + num_kwargs));
  if (!leaves.p || !names.p || !struct_.p) return false;
  auto add = [&](Py_ssize_t index, PyObject* a) -> bool {
    if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
      Py_ssize_t n = Py_SIZE(a);
      PyObject* entry = Py_BuildValue("(On)", reinterpret_cast<PyObject*>(Py_TYPE(a)), n);
      if (!entry) return false;
      PyTuple_SET_ITEM(struct_.p, index, entry);
      PyObject** items = PyList_CheckExact(a) ? PySequence_Fast_ITEMS(a) : &PyTuple_GET_ITEM(a, 0);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (PyList_Append(leaves.p, items[i]) < 0) return false;
      }
    } else {
      Py_INCREF(Py_None);
      PyTuple_SET_ITEM(struct_.p, index, Py_None);
      if (PyList_Append(leaves.p, a) < 0) return false;
    }
    return true;
  };
  for (Py_ssize_t i = 0; i < num_args; ++i) {
    if (!add(i, PyTuple_GET_ITEM(args, i))) return false;
  }
  if (kwargs) {
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(kwargs, &pos, &k, &v)) {
      Py_INCREF(k);
      PyTuple_SET_ITEM(names.p, i, k);
      if (!add(num_args + i, v)) return false;
      ++i;
    }
  }
  treedef.p = Py_BuildValue("(OnO)", struct_.p, num_args, names.p);
  return treedef.p != nullptr;
}

PyObject* int_tuple(c10::IntArrayRef values, const c10::IntArrayRef* zero_where_one, PyTypeObject* type) {
  Py_ssize_t n = static_cast<Py_ssize_t>(values.size());
  PyObject* t = type == &PyTuple_Type ? PyTuple_New(n) : type->tp_alloc(type, n);
  if (!t) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    int64_t v = values[i];
    if (zero_where_one && (*zero_where_one)[i] == 1) v = 0;
    PyObject* item = PyLong_FromLongLong(v);
    if (!item) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, i, item);
  }
  return t;
}

// The spec of one tensor leaf with a device buffer (appended to buffers/slots when new), or nullptr
// with a Python error set. Throws Fallback where the Python version must decide.
PyObject* tensor_spec(PyObject* x, PyObject* buf, std::vector<PyObject*>& seen, PyObject* buffers, PyObject* slots) {
  Py_ssize_t slot = -1;
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] == buf) {
      slot = static_cast<Py_ssize_t>(i);
      break;
    }
  }
  if (slot < 0) {
    slot = static_cast<Py_ssize_t>(seen.size());
    Ref numel(PyObject_GetAttr(buf, s_numel));
    Ref dtype(numel.p ? PyObject_GetAttr(buf, s_dtype) : nullptr);
    Ref value(dtype.p ? PyObject_GetAttr(buf, s_value) : nullptr);
    if (!value.p) return nullptr;
    Ref entry(PyTuple_Pack(3, numel.p, dtype.p, value.p == Py_None ? Py_True : Py_False));
    if (!entry.p || PyList_Append(buffers, buf) < 0 || PyList_Append(slots, entry.p) < 0) return nullptr;
    seen.push_back(buf);  // borrowed: buffers holds it
  }
  const at::Tensor& t = THPVariable_Unpack(x);
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) throw Fallback();
  c10::IntArrayRef sizes = t.sizes();
  c10::IntArrayRef strides = t.strides();
  at::ScalarType st = t.scalar_type();
  bool conj = t.is_conj(), neg = t.is_neg();
  bool has_one = false;
  for (int64_t n : sizes) has_one |= n == 1;
  bool lazy_bit = neg || (at::isComplexType(st) && conj);
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(st));  // borrowed
  Ref size_obj(int_tuple(sizes, nullptr, lazy_bit ? &PyTuple_Type : &THPSizeType));
  Ref stride_obj(size_obj.p ? int_tuple(strides, has_one ? &sizes : nullptr, &PyTuple_Type) : nullptr);
  Ref slot_obj(stride_obj.p ? PyLong_FromSsize_t(slot) : nullptr);
  Ref offset(slot_obj.p ? PyLong_FromLongLong(t.storage_offset()) : nullptr);
  if (!offset.p) return nullptr;
  if (lazy_bit) {
    return PyTuple_Pack(8, s_B, slot_obj.p, size_obj.p, stride_obj.p, offset.p, dtype, conj ? Py_True : Py_False,
                        neg ? Py_True : Py_False);
  }
  return PyTuple_Pack(6, s_T, slot_obj.p, size_obj.p, stride_obj.p, offset.p, dtype);
}

// nullptr with a Python error, or the result; throws Fallback.
PyObject* signature_impl(PyObject* op, PyObject* args, PyObject* kwargs, PyObject* static_floats) {
  if (!PyTuple_CheckExact(args) || (kwargs != Py_None && !PyDict_CheckExact(kwargs))) throw Fallback();
  bool has_kwargs = kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0;
  bool flat = !has_kwargs;
  Py_ssize_t num_args = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; flat && i < num_args; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    flat = !(PyList_CheckExact(a) || PyTuple_CheckExact(a));
  }
  Ref leaves, treedef;
  if (flat) {
    Py_INCREF(args);
    leaves.p = args;
    treedef.p = flat_treedef(num_args);
    if (!treedef.p) return nullptr;
  } else if (!flatten(args, has_kwargs ? kwargs : nullptr, leaves, treedef)) {
    return nullptr;
  }
  PyObject** items = PySequence_Fast_ITEMS(leaves.p);  // a tuple or a list
  Py_ssize_t n = Py_SIZE(leaves.p);
  bool statics = static_floats == Py_True;
  Ref sig(PyTuple_New(n));
  Ref buffers(PyList_New(0));
  Ref slots(PyList_New(0));
  Ref scalars(PyList_New(0));
  if (!sig.p || !buffers.p || !slots.p || !scalars.p) return nullptr;
  std::vector<PyObject*> seen;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = items[i];
    PyObject* spec = nullptr;
    int is_tensor = Py_IS_TYPE(x, reinterpret_cast<PyTypeObject*>(g_tensor_type)) ? 1
                    : PyObject_IsInstance(x, g_tensor_type);
    if (is_tensor < 0) return nullptr;
    if (is_tensor) {
      // a subclass may override what Python reads (untyped_storage, shape, stride...): Python decides
      if (!Py_IS_TYPE(x, reinterpret_cast<PyTypeObject*>(g_tensor_type)) &&
          !Py_IS_TYPE(x, reinterpret_cast<PyTypeObject*>(g_parameter_type)))
        throw Fallback();
      if (!THPVariable_Check(x)) throw Fallback();
      const at::Tensor& t = THPVariable_Unpack(x);
      if (!t.defined() || !t.has_storage()) throw Fallback();
      Ref storage(THPStorage_Wrap(t.storage()));
      if (!storage.p) return nullptr;
      PyObject* buf_raw = nullptr;
      if (_PyObject_LookupAttr(storage.p, g_attr, &buf_raw) < 0) return nullptr;
      Ref buf(buf_raw);
      if (buf.p == nullptr || buf.p == Py_None) {
        spec = PyObject_CallFunctionObjArgs(g_host_spec, op, x, scalars.p, static_floats, nullptr);
      } else {
        spec = tensor_spec(x, buf.p, seen, buffers.p, slots.p);
      }
    } else if (PyFloat_CheckExact(x) && !statics) {
      Ref index(PyLong_FromSsize_t(PyList_GET_SIZE(scalars.p)));
      if (!index.p || PyList_Append(scalars.p, x) < 0) return nullptr;
      spec = PyTuple_Pack(2, s_F, index.p);
    } else if (PyObject_TypeCheck(x, &THPDeviceType) &&
               reinterpret_cast<THPDevice*>(x)->device.type() == c10::DeviceType::PrivateUse1 &&
               [&] {
                 Ref type(PyObject_GetAttr(x, s_type));  // "tpu": the name the backend was renamed to
                 return type.p && PyUnicode_Check(type.p) && PyUnicode_Compare(type.p, s_tpu) == 0;
               }()) {
      spec = PyTuple_Pack(2, s_S, g_meta_device);
    } else if (PyBool_Check(x)) {  // not ("S", True): that equals ("S", 1)
      spec = PyTuple_Pack(2, s_Z, x);
    } else if (PyFloat_CheckExact(x) || PyComplex_CheckExact(x)) {  // ("S", 2.0) equals ("S", 2)
      spec = PyTuple_Pack(3, s_S, x, reinterpret_cast<PyObject*>(Py_TYPE(x)));
    } else if (PyList_Check(x)) {
      Ref value(PySequence_Tuple(x));
      spec = value.p ? PyTuple_Pack(2, s_S, value.p) : nullptr;
    } else {
      spec = PyTuple_Pack(2, s_S, x);
    }
    if (!spec) return nullptr;
    PyTuple_SET_ITEM(sig.p, i, spec);
  }
  Ref op_id(PyLong_FromVoidPtr(op));
  Ref slot_tuple(PyList_AsTuple(slots.p));
  if (!op_id.p || !slot_tuple.p) return nullptr;
  Ref key(PyTuple_Pack(5, op_id.p, treedef.p, sig.p, slot_tuple.p, static_floats));
  if (!key.p) return nullptr;
  return PyTuple_Pack(4, key.p, leaves.p, buffers.p, scalars.p);
}

PyObject* signature(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4) {
    PyErr_Format(PyExc_TypeError, "signature(op, args, kwargs, static_floats) takes 4 arguments, got %zd", argc);
    return nullptr;
  }
  if (g_python_signature == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tpudist fastpath: init() was not called");
    return nullptr;
  }
  try {
    return signature_impl(argv[0], argv[1], argv[2], argv[3]);
  } catch (const Fallback&) {
  } catch (const std::exception&) {  // a C++ error reading a tensor: Python raises its own
  }
  if (PyErr_Occurred()) return nullptr;
  return PyObject_Vectorcall(g_python_signature, argv, 4, nullptr);
}

// Reads a tuple of Python ints into ``out``; false (no error set) if it is not a tuple of exact ints.
bool int_tuple(PyObject* tuple, std::vector<int64_t>& out) {
  if (!PyTuple_CheckExact(tuple)) return false;
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(tuple, i);
    if (!PyLong_CheckExact(item)) return false;
    out[i] = PyLong_AsLongLong(item);
    if (out[i] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// torch._C._acc.create_empty_tensor(shape, dtype) without pybind11's argument conversion: a PrivateUse1
// tensor of ``shape`` over an empty storage (torch/csrc/acc/Module.cpp, createEmptyTensor;
// test_device_fastpath compares the two tensors' metadata), contiguous or with the given ``strides`` (a
// tuple; None: contiguous), as _storage._create_empty_py makes it. nullptr with a Python error set.
PyObject* create_empty(PyObject* shape, PyObject* dtype, PyObject* stride_tuple = Py_None) {
  std::vector<int64_t> sizes, strides;
  bool plain = THPDtype_Check(dtype) && int_tuple(shape, sizes) &&
               (stride_tuple == Py_None || (int_tuple(stride_tuple, strides) && strides.size() == sizes.size()));
  if (!plain) {
    if (stride_tuple != Py_None) {
      PyErr_Format(PyExc_TypeError, "create_empty(shape, dtype, strides): shape and strides must be tuples of "
                   "ints of one length, got shape=%R, strides=%R", shape, stride_tuple);
      return nullptr;
    }
    PyObject* call_args[2] = {shape, dtype};
    return PyObject_Vectorcall(g_create_empty, call_args, 2, nullptr);
  }
  if (stride_tuple == Py_None) {
    strides.resize(sizes.size());
    int64_t numel = 1;
    for (size_t i = sizes.size(); i > 0; --i) {
      strides[i - 1] = numel;
      numel *= sizes[i - 1];
    }
  }
  try {
    c10::Storage storage{c10::Storage::use_byte_size_t{}, 0, c10::GetAllocator(c10::kMeta), true};
    storage.set_data_ptr_noswap(at::DataPtr{nullptr, c10::Device(c10::DeviceType::PrivateUse1, 0)});
    at::Tensor tensor = at::detail::make_tensor<at::TensorImpl>(
        std::move(storage), c10::DispatchKeySet({c10::DispatchKey::PrivateUse1}),
        c10::scalarTypeToTypeMeta(reinterpret_cast<THPDtype*>(dtype)->scalar_type));
    tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, 0);
    return THPVariable_Wrap(std::move(tensor));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* create_empty_py(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 && argc != 3) {
    PyErr_SetString(PyExc_TypeError, "create_empty(shape, dtype, strides=None)");
    return nullptr;
  }
  return create_empty(argv[0], argv[1], argc == 3 ? argv[2] : Py_None);
}

// An instance of a __slots__ class with the given slots set, without running its __init__ (a Python
// frame per object): _storage.Buffer and _storage.Lazy only store their arguments.
PyObject* new_slotted(PyTypeObject* type, std::initializer_list<std::pair<PyObject*, PyObject*>> values) {
  Ref obj(type->tp_alloc(type, 0));
  if (!obj.p) return nullptr;
  for (const auto& [name, value] : values) {
    if (PyObject_GenericSetAttr(obj.p, name, value) < 0) return nullptr;
  }
  return obj.release();
}

// outputs(outputs, values, graph, index, written) -> [tensor, ...]: a fresh tensor per (shape, dtype,
// numel[, strides]) of ``outputs`` over a new storage holding Buffer(numel, dtype, value). value is values[i]
// (Strict: the kernel's arrays) or, with values None, Lazy(graph, index + i) (Fused), and then a
// weakref to the buffer is appended to ``written``. What _fused.record and _execute._dispatch did in Python.
PyObject* outputs(PyObject* /*module*/, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 5 || !PyTuple_CheckExact(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "outputs(outputs: tuple, values, graph, index, written)");
    return nullptr;
  }
  if (g_buffer_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tpudist fastpath: init_outputs() was not called");
    return nullptr;
  }
  PyObject *specs = argv[0], *values = argv[1], *graph = argv[2], *written = argv[4];
  Py_ssize_t n = PyTuple_GET_SIZE(specs);
  Py_ssize_t index = 0;
  if (values == Py_None) {
    index = PyLong_AsSsize_t(argv[3]);
    if (index == -1 && PyErr_Occurred()) return nullptr;
    if (!PyList_CheckExact(written)) {
      PyErr_SetString(PyExc_TypeError, "outputs(): written must be a list");
      return nullptr;
    }
  }
  Ref fresh(PyList_New(n));
  if (!fresh.p) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* spec = PyTuple_GET_ITEM(specs, i);
    if (!PyTuple_CheckExact(spec) || (PyTuple_GET_SIZE(spec) != 3 && PyTuple_GET_SIZE(spec) != 4)) {
      PyErr_SetString(PyExc_TypeError, "outputs(): each output is (shape, dtype, numel[, strides])");
      return nullptr;
    }
    PyObject *shape = PyTuple_GET_ITEM(spec, 0), *dtype = PyTuple_GET_ITEM(spec, 1), *numel = PyTuple_GET_ITEM(spec, 2);
    PyObject* strides = PyTuple_GET_SIZE(spec) == 4 ? PyTuple_GET_ITEM(spec, 3) : Py_None;
    Ref value;
    if (values == Py_None) {
      Ref position(PyLong_FromSsize_t(index + i));
      if (!position.p) return nullptr;
      value.p = new_slotted(g_lazy_type, {{s_graph, graph}, {s_index, position.p}});
    } else {
      value.p = PySequence_GetItem(values, i);
    }
    if (!value.p) return nullptr;
    Ref buf(new_slotted(g_buffer_type, {{s_value, value.p}, {s_numel, numel}, {s_dtype, dtype}}));
    if (!buf.p) return nullptr;
    Ref tensor(create_empty(shape, dtype, strides));
    if (!tensor.p) return nullptr;
    if (!THPVariable_Check(tensor.p)) {
      PyErr_SetString(PyExc_TypeError, "outputs(): create_empty_tensor did not return a tensor");
      return nullptr;
    }
    const c10::Storage& tensor_storage = THPVariable_Unpack(tensor.p).storage();
    Ref storage(THPStorage_Wrap(tensor_storage));
    if (!storage.p || PyObject_SetAttr(storage.p, g_buffer_attr, buf.p) < 0) return nullptr;
    if (g_set_storage_bytes != nullptr) {
      int64_t count = PyLong_AsLongLong(numel);
      if (count == -1 && PyErr_Occurred()) return nullptr;
      auto itemsize = static_cast<int64_t>(c10::elementSize(reinterpret_cast<THPDtype*>(dtype)->scalar_type));
      g_set_storage_bytes(tensor_storage.unsafeGetStorageImpl(), count * itemsize);
    }
    if (values == Py_None) {
      Ref ref(PyWeakref_NewRef(buf.p, nullptr));
      if (!ref.p || PyList_Append(written, ref.p) < 0) return nullptr;
    }
    PyList_SET_ITEM(fresh.p, i, tensor.release());
  }
  return fresh.release();
}

PyObject* init_outputs(PyObject* /*module*/, PyObject* args) {
  PyObject *buffer_type, *lazy_type, *create_empty, *attr;
  unsigned long long set_storage_bytes = 0;
  if (!PyArg_ParseTuple(args, "O!O!OU|K", &PyType_Type, &buffer_type, &PyType_Type, &lazy_type, &create_empty, &attr,
                        &set_storage_bytes))
    return nullptr;
  g_set_storage_bytes = reinterpret_cast<int (*)(void*, int64_t)>(static_cast<std::uintptr_t>(set_storage_bytes));
  Py_INCREF(buffer_type);
  Py_INCREF(lazy_type);
  Py_INCREF(create_empty);
  Py_INCREF(attr);
  Py_XDECREF(g_buffer_attr);
  g_buffer_attr = attr;
  Py_XDECREF(reinterpret_cast<PyObject*>(g_buffer_type));
  Py_XDECREF(reinterpret_cast<PyObject*>(g_lazy_type));
  Py_XDECREF(g_create_empty);
  g_buffer_type = reinterpret_cast<PyTypeObject*>(buffer_type);
  g_lazy_type = reinterpret_cast<PyTypeObject*>(lazy_type);
  g_create_empty = create_empty;
  Py_RETURN_NONE;
}

PyObject* init(PyObject* /*module*/, PyObject* args) {
  PyObject *python_signature, *host_spec, *meta_device, *tensor_type, *parameter_type, *attr;
  if (!PyArg_ParseTuple(args, "OOOOOU", &python_signature, &host_spec, &meta_device, &tensor_type, &parameter_type,
                        &attr))
    return nullptr;
  for (PyObject** slot : {&g_python_signature, &g_host_spec, &g_meta_device, &g_tensor_type, &g_parameter_type,
                          &g_attr})
    Py_CLEAR(*slot);
  Py_INCREF(python_signature);
  Py_INCREF(host_spec);
  Py_INCREF(meta_device);
  Py_INCREF(tensor_type);
  Py_INCREF(parameter_type);
  Py_INCREF(attr);
  g_python_signature = python_signature;
  g_host_spec = host_spec;
  g_meta_device = meta_device;
  g_tensor_type = tensor_type;
  g_parameter_type = parameter_type;
  g_attr = attr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signature)), METH_FASTCALL,
     "signature(op, args, kwargs, static_floats) -> (key, leaves, buffers, scalars), as _core._signature_py"},
    {"init", init, METH_VARARGS,
     "init(python_signature, host_spec, meta_device, tensor_type, parameter_type, attr)"},
    {"outputs", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outputs)), METH_FASTCALL,
     "outputs(outputs, values, graph, index, written) -> fresh tensors over new Buffers"},
    {"create_empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(create_empty_py)), METH_FASTCALL,
     "create_empty(shape: tuple, dtype, strides: tuple | None = None) -> a tensor over an empty storage, as "
     "torch._C._acc.create_empty_tensor(shape, dtype) makes it (contiguous) or of the given strides"},
    {"init_outputs", init_outputs, METH_VARARGS, "init_outputs(buffer_type, lazy_type, create_empty_tensor, attr, set_storage_bytes=0)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tpudist_fastpath", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_tpudist_fastpath() {
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  s_T = PyUnicode_InternFromString("T");
  s_B = PyUnicode_InternFromString("B");
  s_F = PyUnicode_InternFromString("F");
  s_S = PyUnicode_InternFromString("S");
  s_Z = PyUnicode_InternFromString("Z");
  s_numel = PyUnicode_InternFromString("numel");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_value = PyUnicode_InternFromString("value");
  s_type = PyUnicode_InternFromString("type");
  s_tpu = PyUnicode_InternFromString("tpu");
  s_graph = PyUnicode_InternFromString("graph");
  s_index = PyUnicode_InternFromString("index");
  if (!s_graph || !s_index || !s_T || !s_B || !s_F || !s_S || !s_Z || !s_numel || !s_dtype || !s_value || !s_type || !s_tpu) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
