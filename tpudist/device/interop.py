"""What the packages above the device use of it: a tpu tensor's storage and its value, new tensors
over ``jax.Array`` s, the device's lock and chip, and a digest of the sources its programs are built
from.

The process group moves tpu tensors' storages through its collectives without a host copy
(``tpudist.process_group.device_arrays``, ``p2p``); the compile backend reads and makes tpu tensors
at its programs' edges (``tpudist.compile.device_io``). Both import this module only where a tpu
tensor is at hand: importing the device installs it (the process group checks
``"tpudist.device" in sys.modules`` first).
"""

from __future__ import annotations

from tpudist.device import _oom, _runtime, _storage

# The device's state is process-global (backward runs on autograd's thread): hold it while reading
# or replacing storage values.
LOCK = _runtime.LOCK
device = _runtime.device  # the chip the device drives
follow_process_group = _runtime.follow_process_group  # after a "tpu" world booted or shut down

# A tpu tensor's storage: ``Buffer`` (its ``value``: a flat jax.Array, a ``Shaped`` one, a ``Lazy`` one a
# pending Fused graph will compute, or None while unwritten).
Buffer, Lazy, Shaped = _storage.Buffer, _storage.Lazy, _storage.Shaped
buffer_of = _storage.buffer_of
concrete = _storage.concrete  # a storage's value as the device's programs read it (runs a pending graph)
is_whole = _storage.is_whole
value_of = _storage.value_of
flush = _storage.flush  # runs the pending Fused graph (a sync point)
retype = _storage._retype  # noqa: SLF001 - a value's bits as another dtype of the same item size

# New tensors over arrays.
new_tensor = _storage.new_tensor
outputs = _storage.outputs  # several at once, as an op's outputs (C++ where it built)
to_cpu = _storage.to_cpu

raise_if_oom = _oom.raise_if_oom  # XLA's out-of-memory error as torch.OutOfMemoryError
source_digest = _storage._source_fingerprint  # noqa: SLF001 - changes when a lowering or the device changes
