"""Per-generation TPU facts: slice shapes, hosts, links, memory and compute.

Figures are per chip. Sources:

- [BOOK] "How to Scale Your Model" (the JAX scaling book), part 2 "All about TPUs",
  tables "TPU specs" and "Interconnect figures" (https://jax-ml.github.io/scaling-book/tpus/),
  in the version that has a TPU7x row. The part 3 "Sharded matrices" gives the ~1 us per-hop
  latency (https://jax-ml.github.io/scaling-book/sharding/).
- [GCP] Google Cloud TPU pages: v5e (https://cloud.google.com/tpu/docs/v5e), v5p
  (https://cloud.google.com/tpu/docs/v5p), v6e (https://cloud.google.com/tpu/docs/v6e), TPU7x
  (https://cloud.google.com/tpu/docs/tpu7x).
- [JAX-MP] JAX "Introduction to multi-controller JAX" listing `jax.devices()` on a v5litepod-16:
  four processes, each holding a 2x2 block of chips, processes numbered x-fastest.

ICI bandwidth: we use the scaling book's one-way per-link figures (v4 4.5e10, v5p 9e10, v5e 4.5e10,
v6e 9e10, TPU7x 9e10 B/s). Google's per-chip bidirectional totals divided over the links give about
10% more (v5p 1200 GB/s / 6 links / 2 directions = 1e11; v5e 400 / 4 / 2 = 5e10; v6e 800 / 4 / 2 =
1e11), which older versions of the book used. The book's figures are the ones its worked examples
(our test vectors) are computed with.
"""

from __future__ import annotations

import dataclasses

# [BOOK] sharding chapter, "A note on ICI latency": each hop costs ~1 us whatever the data volume.
HOP_LATENCY_SECONDS = 1e-6

# [BOOK] interconnect table, one-way bytes/s per ICI link.
V4_ICI_ONE_WAY_BYTES_PER_S = 4.5e10
V5P_ICI_ONE_WAY_BYTES_PER_S = 9e10
V5E_ICI_ONE_WAY_BYTES_PER_S = 4.5e10
V6E_ICI_ONE_WAY_BYTES_PER_S = 9e10
TPU7X_ICI_ONE_WAY_BYTES_PER_S = 9e10

# [BOOK] "TPU Networking": v4 and v5p link to 6 neighbours (3-D torus), v5e and v6e to 4 (2-D torus;
# [GCP] v5e/v6e "ICI ports per chip: 4"). [GCP] TPU7x is a 3-D torus of 4x4x4 cubes like v5p: 6.
LINKS_PER_CHIP_3D = 6
LINKS_PER_CHIP_2D = 4

_GIB = 2**30
# [BOOK] "HBM capacity/chip" (GB there; [GCP] states GiB: v4 32, v5p 95 usable of 96, v5e 16,
# v6e 32, TPU7x 192). We keep the physical capacity in GiB.
V4_HBM_BYTES = 32 * _GIB
V5P_HBM_BYTES = 96 * _GIB
V5E_HBM_BYTES = 16 * _GIB
V6E_HBM_BYTES = 32 * _GIB
TPU7X_HBM_BYTES = 192 * _GIB

# [BOOK] "HBM BW/chip (bytes/s)".
V4_HBM_BYTES_PER_S = 1.2e12
V5P_HBM_BYTES_PER_S = 2.8e12
V5E_HBM_BYTES_PER_S = 8.1e11
V6E_HBM_BYTES_PER_S = 1.6e12
TPU7X_HBM_BYTES_PER_S = 7.4e12

# [BOOK] "FLOPs/s/chip (bf16)" ([GCP] TPU7x: 2307 TFLOPs).
V4_PEAK_BF16_FLOPS = 2.75e14
V5P_PEAK_BF16_FLOPS = 4.59e14
V5E_PEAK_BF16_FLOPS = 1.97e14
V6E_PEAK_BF16_FLOPS = 9.2e14
TPU7X_PEAK_BF16_FLOPS = 2.3e15

# [GCP] v5e and v6e: the supported 2-D slice shapes (names as Google writes them).
PUBLISHED_2D_SHAPES = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))

# [GCP] v4 / v5p / TPU7x: the 3-D slice shapes below a full 4x4x4 cube that Google offers (v5p-8
# 2x2x1, v5p-16 2x2x2, v5p-32 2x2x4, v5p-64 2x4x4; v4 and TPU7x the same), in any axis order;
# larger slices are whole cubes: every size a multiple of 4 ([BOOK] "4x4x4 or 4x4x8 ... wraparounds").
PUBLISHED_3D_SUB_CUBE_SHAPES = ((1, 2, 2), (2, 2, 2), (2, 2, 4), (2, 4, 4))
# One or two chips of a single 2x2x1 host (sorted sizes): not a slice Google sells, but what a
# process sees when it uses only some chips of a host; the only topology 1- and 2-rank worlds have.
PART_OF_HOST_3D_SHAPES = ((1, 1, 1), (1, 1, 2))

# [BOOK] host size 2x2x1 for v4p and v5p ([GCP] v5p: 2x2x1 is 1 host, 4x4x4 is 16 hosts); [BOOK]
# TPU7x host size 2x2x1.
HOST_SHAPE_3D = (2, 2, 1)
# [GCP] v5e: VMs hold 1, 4 or 8 chips; a slice of up to 8 chips is one VM. [JAX-MP] a multi-host
# v5e slice (v5litepod-16) runs one process per 2x2 block of chips, which is what rank order and
# host_of must follow. ([GCP] also counts physical hosts of 8 chips for the pod: 4x4 = 2 hosts.)
HOST_SHAPE_2D_MULTI_HOST = (2, 2)
SINGLE_HOST_MAX_CHIPS_2D = 8

# [BOOK] "a 4x4x4 or 4x4x8 will still have wraparounds along all axes provided by optical
# switches"; "a 2x2x4 won't have any wraparounds": wraps come with whole 4x4x4 cubes.
CUBE_SIZE = 4
# [BOOK] "TPU v5e 8x16 will have a wraparound on the longer axis": 2-D pods wrap axes of 16.
WRAP_AXIS_SIZE_2D = 16

# Pod sizes in chips: [BOOK] v4 16x16x16, v5p 16x20x28 (8960), v5e/v6e 16x16; [GCP] TPU7x 9216.
V4_POD_CHIPS = 4096
V5P_POD_CHIPS = 8960
POD_CHIPS_2D = 256
TPU7X_POD_CHIPS = 9216


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    """Facts about one TPU generation; one instance per name in `GENERATIONS`.

    Attributes:
        name: tpudist's name for it: "v4", "v5e", "v5p", "v6e" or "7x".
        device_kind: the `device_kind` of its JAX devices, as `jax._src.mesh_utils` spells it.
        num_dims: 3 for 3-D torus generations, 2 for the 2-D ones.
        ici_one_way_bytes_per_s: one ICI link, one direction.
        links_per_chip: ICI links of one chip.
        hbm_bytes: HBM capacity of one chip.
        hbm_bytes_per_s: HBM bandwidth of one chip.
        peak_bf16_flops: dense bf16 FLOP/s of one chip.
        devices_per_chip: JAX devices one chip shows (7x: one per TensorCore).
        pod_chips: chips in a full pod; no slice is larger.

    Example:
        >>> GENERATIONS["v5p"].ici_bidi_bytes_per_s
        180000000000.0
    """

    name: str
    device_kind: str
    num_dims: int
    ici_one_way_bytes_per_s: float
    links_per_chip: int
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float
    devices_per_chip: int
    pod_chips: int

    @property
    def ici_bidi_bytes_per_s(self) -> float:
        """One link in both directions: what a chip gets along one wrapped ring axis."""
        return 2 * self.ici_one_way_bytes_per_s

    @property
    def wraps_by_cube(self) -> bool:
        """True where wraparound comes from whole 4x4x4 cubes (3-D generations)."""
        return self.num_dims == 3


GENERATIONS: dict[str, Generation] = {
    "v4": Generation(
        "v4", "TPU v4", 3, V4_ICI_ONE_WAY_BYTES_PER_S, LINKS_PER_CHIP_3D, V4_HBM_BYTES,
        V4_HBM_BYTES_PER_S, V4_PEAK_BF16_FLOPS, 1, V4_POD_CHIPS),
    "v5e": Generation(
        "v5e", "TPU v5 lite", 2, V5E_ICI_ONE_WAY_BYTES_PER_S, LINKS_PER_CHIP_2D, V5E_HBM_BYTES,
        V5E_HBM_BYTES_PER_S, V5E_PEAK_BF16_FLOPS, 1, POD_CHIPS_2D),
    "v5p": Generation(
        "v5p", "TPU v5p", 3, V5P_ICI_ONE_WAY_BYTES_PER_S, LINKS_PER_CHIP_3D, V5P_HBM_BYTES,
        V5P_HBM_BYTES_PER_S, V5P_PEAK_BF16_FLOPS, 1, V5P_POD_CHIPS),
    "v6e": Generation(
        "v6e", "TPU v6 lite", 2, V6E_ICI_ONE_WAY_BYTES_PER_S, LINKS_PER_CHIP_2D, V6E_HBM_BYTES,
        V6E_HBM_BYTES_PER_S, V6E_PEAK_BF16_FLOPS, 1, POD_CHIPS_2D),
    # [GCP] each TPU7x chip has two TensorCores and JAX shows each as a device (core_on_chip 0, 1).
    "7x": Generation(
        "7x", "TPU7x", 3, TPU7X_ICI_ONE_WAY_BYTES_PER_S, LINKS_PER_CHIP_3D, TPU7X_HBM_BYTES,
        TPU7X_HBM_BYTES_PER_S, TPU7X_PEAK_BF16_FLOPS, 2, TPU7X_POD_CHIPS),
}

GENERATION_NAMES = tuple(GENERATIONS)
