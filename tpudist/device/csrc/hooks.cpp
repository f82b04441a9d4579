// The "tpu" device's PrivateUse1 hooks: what torch asks of an accelerator in C++, including a pinned
// host allocator, which a Python hooks object (torch._C._acc.PrivateUse1Hooks) cannot provide.
//
// Built and loaded by tpudist/device/_hooks.py (torch.utils.cpp_extension.load, no Python module: the
// entry points below are plain C functions called through ctypes). It answers what torch's Python hook
// answered (built, available, a primary context on tpu:0) and adds:
// - getPinnedMemoryAllocator: page-aligned host memory from c10::alloc_cpu. A host-to-device copy is a
//   JAX device_put from any host buffer, so nothing needs page-locking; "pinned" means "from this
//   allocator", which is what torch's is_pinned() and DDP's reducer (its used-parameter map is staged
//   through empty_like(pin_memory=True) for a PrivateUse1 model) need.
// - isPinnedPtr: true for any address inside a live block of that allocator.
// - Storage bytes: a tpu storage's memory is a jax.Array held by the storage's Python object
//   (device/_storage.py). tpudist_set_storage_bytes gives the storage its true size in bytes (what
//   nbytes(), UntypedStorage.size() and FSDP2/DCP read) and, as its data pointer, an address of its own:
//   the StorageImpl's, unique while the storage lives, never read (torch dereferences no PrivateUse1
//   pointer; it refuses a storage with bytes and a null pointer: "Note [Invalid Python Storages]").
// - resizePrivateUse1Bytes: UntypedStorage.resize_ calls the Python function registered with
//   tpudist_set_resize_callback (device/_storage.py: resize_(0) frees the jax.Array, a new size leaves
//   the leading elements), then sets the new byte size.
// - getNewGenerator: torch.Generator(device="tpu"). Its state is the device stream's (seed, counter)
//   pair: the offset is the number of random ops drawn since the seed, and the k-th op drawing from it
//   uses the key fold_in(key(seed), k) (device/_runtime.py advances the offset through the Python API).
// - getDefaultGenerator: one such generator, seeded with torch's default seed: the device's default
//   stream (torch.tpu.default_generators[0], what torch.tpu.manual_seed seeds).

#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>

namespace {

// A tpu generator's state: (seed, offset) as two int64s, 16 bytes of a CPU uint8 tensor, the layout of
// torch.tpu.get_rng_state() (device/_module.py).
constexpr int64_t kStateBytes = 2 * sizeof(uint64_t);

class TpuGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit TpuGeneratorImpl(c10::DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(seed) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }

  void set_offset(uint64_t offset) override {
    offset_ = offset;
  }

  uint64_t get_offset() const override {
    return offset_;
  }

  uint64_t current_seed() const override {
    return seed_;
  }

  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }

  void set_state(const c10::TensorImpl& new_state) override {
    at::detail::check_rng_state(new_state);
    TORCH_CHECK(new_state.numel() == kStateBytes, "a tpu generator's state is ", kStateBytes,
                " bytes (seed and offset, as get_state() returns them); got ", new_state.numel());
    uint64_t values[2];
    std::memcpy(values, new_state.data(), kStateBytes);
    seed_ = values[0];
    offset_ = values[1];
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({kStateBytes}, c10::ScalarType::Byte, std::nullopt, std::nullopt,
                                       std::nullopt, std::nullopt);
    const uint64_t values[2] = {seed_, offset_};
    std::memcpy(state.mutable_data_ptr(), values, kStateBytes);
    return state.getIntrusivePtr();
  }

 private:
  TpuGeneratorImpl* clone_impl() const override {
    auto* copy = new TpuGeneratorImpl(device_.index(), seed_);
    copy->offset_ = offset_;
    return copy;
  }

  uint64_t seed_;
  uint64_t offset_ = 0;
};

class PinnedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    if (data != nullptr) {
      std::lock_guard<std::mutex> guard(mutex_);
      blocks_[reinterpret_cast<std::uintptr_t>(data)] = nbytes;
      live_bytes_ += nbytes;
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool contains(const void* ptr) {
    auto address = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = blocks_.upper_bound(address);  // the first block starting after ptr
    if (it == blocks_.begin()) {
      return false;
    }
    --it;
    return address < it->first + it->second;
  }

  int64_t live_bytes() {
    std::lock_guard<std::mutex> guard(mutex_);
    return static_cast<int64_t>(live_bytes_);
  }

  static PinnedHostAllocator& instance() {
    static auto* allocator = new PinnedHostAllocator();  // never destroyed: blocks may outlive static teardown
    return *allocator;
  }

 private:
  static void release(void* data) {
    auto& self = instance();
    {
      std::lock_guard<std::mutex> guard(self.mutex_);
      auto it = self.blocks_.find(reinterpret_cast<std::uintptr_t>(data));
      if (it != self.blocks_.end()) {
        self.live_bytes_ -= it->second;
        self.blocks_.erase(it);
      }
    }
    c10::free_cpu(data);
  }

  std::mutex mutex_;
  std::map<std::uintptr_t, size_t> blocks_;  // start address -> size of each live block
  size_t live_bytes_ = 0;
};

// A tpu storage's byte size, and an address of its own once it has bytes (see the top of this file).
void set_storage_bytes(c10::StorageImpl& storage, size_t nbytes) {
  if (storage.data() == nullptr) {
    storage.set_data_ptr_noswap(c10::DataPtr(&storage, storage.device()));
  }
  storage.set_nbytes(nbytes);
}

PyObject* g_resize = nullptr;  // resize(storage, nbytes): the buffer's side of UntypedStorage.resize_

struct TpuHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }

  bool isAvailable() const override {
    return true;
  }

  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;  // the JAX device is looked up lazily by tpudist; nothing to initialise here
  }

  void init() const override {}

  bool isPinnedPtr(const void* data) const override {
    return PinnedHostAllocator::instance().contains(data);
  }

  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &PinnedHostAllocator::instance();
  }

  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return at::make_generator<TpuGeneratorImpl>(device_index < 0 ? 0 : device_index);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    TORCH_CHECK(device_index <= 0, "the tpu device has one default generator (tpu:0); got device index ",
                static_cast<int>(device_index));
    static auto* generator = new at::Generator(at::make_generator<TpuGeneratorImpl>(0));  // lives as long as torch
    return *generator;
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    {
      pybind11::gil_scoped_acquire gil;
      TORCH_CHECK(g_resize != nullptr, "UntypedStorage.resize_(", newsize, ") of a tpu storage: tpudist.device "
                  "registered no resize function (tpudist_set_resize_callback)");
      THPObjectPtr py_storage(THPStorage_Wrap(storage));
      if (!py_storage) {
        throw python_error();
      }
      THPObjectPtr result(PyObject_CallFunction(g_resize, "OK", py_storage.get(),
                                                static_cast<unsigned long long>(newsize)));
      if (!result) {
        throw python_error();
      }
    }
    set_storage_bytes(*storage.unsafeGetStorageImpl(), newsize);
  }
};

TpuHooks* hooks() {
  static auto* instance = new TpuHooks();  // registered with torch for the process's lifetime
  return instance;
}

bool ours_registered() {
  return at::isPrivateUse1HooksRegistered() && &at::detail::getPrivateUse1Hooks() == hooks();
}

}  // namespace

// 1: registered now or before; 0: another hooks object is registered already; -1: torch raised.
extern "C" int tpudist_register_hooks() {
  try {
    if (ours_registered()) {
      return 1;
    }
    if (at::isPrivateUse1HooksRegistered()) {
      return 0;
    }
    at::RegisterPrivateUse1HooksInterface(hooks());
    return 1;
  } catch (...) {
    return -1;
  }
}

extern "C" int tpudist_hooks_registered() {
  try {
    return ours_registered() ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

// Bytes in live blocks of the pinned host allocator (tests: the allocator is used, and frees).
extern "C" int64_t tpudist_pinned_bytes() {
  return PinnedHostAllocator::instance().live_bytes();
}

// Sets a tpu storage's byte size (``storage`` is a c10::StorageImpl*: UntypedStorage._cdata). 0 on success.
extern "C" int tpudist_set_storage_bytes(void* storage, int64_t nbytes) {
  if (storage == nullptr || nbytes < 0) {
    return -1;
  }
  set_storage_bytes(*static_cast<c10::StorageImpl*>(storage), static_cast<size_t>(nbytes));
  return 0;
}

// Registers resize(storage, nbytes), called by resizePrivateUse1Bytes (a new reference is kept). 0 on success.
extern "C" int tpudist_set_resize_callback(PyObject* resize) {
  PyGILState_STATE state = PyGILState_Ensure();
  Py_XINCREF(resize);
  Py_XSETREF(g_resize, resize);
  PyGILState_Release(state);
  return 0;
}

// The default generator as a torch.Generator (a borrowed reference, made once), or NULL with a Python error set.
extern "C" PyObject* tpudist_default_generator() {
  static PyObject* wrapped = nullptr;
  PyGILState_STATE state = PyGILState_Ensure();
  if (wrapped == nullptr) {
    try {
      wrapped = THPGenerator_initDefaultGenerator(hooks()->getDefaultGenerator(0));
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  }
  PyGILState_Release(state);
  return wrapped;
}
