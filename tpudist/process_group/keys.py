"""What decides a collective's program: :class:`ProgramKey`, and the dtypes a key may name.

Below everything that builds, lowers or checks programs (``envelope``, ``lowerings``, ``programs``,
``device_arrays``), so those read the key without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

# The numpy dtype names a block (and so a fingerprint) may have.
DTYPE_NAMES = ("bfloat16", "bool", "complex128", "complex64", "float16", "float32", "float64",
               "int16", "int32", "int64", "int8", "uint8")


@dataclass(frozen=True, slots=True)
class ProgramKey:
    """Everything that decides the compiled program: same key, same program on every rank."""

    op: str
    shape: tuple[int, ...]  # one rank's input block
    dtype: str  # numpy dtype name of the block
    group: tuple[int, ...]  # global ranks in group order: the mesh
    reduce: str | None = None
    static: tuple = ()  # op-specific: root, premul factor, permutation
    root: int | None = None  # reduce and gather: the program is the all_ form's, the result stays here
