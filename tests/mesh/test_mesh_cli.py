"""Tests of describe(), plot_mesh() and the `python -m tpudist describe` command line."""

import sys

import pytest

from tpudist.__main__ import main
from tpudist.mesh import Topology, describe, plot_mesh

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_describe_topology():
    lines = describe(Topology.parse("v5p:4x4x4")).splitlines()
    assert lines[0] == "v5p:4x4x4: TPU v5p slice of 64 chips (x=4, y=4, z=4), 3-D torus"
    assert lines[1] == "  wraparound on every axis (slices of whole 4x4x4 cubes wrap)"
    assert lines[2] == ("  hosts: 16 of up to 4 chips (2x2x1); ranks are host-major, x fastest "
                        "within a host")
    assert "6 ICI links of 9e+10 B/s one-way" in lines[3]
    assert Topology.parse("v5p:4x4x4").describe() == "\n".join(lines)


def test_describe_2d_and_7x():
    assert "wraparound on y only (axes of 16 chips wrap)" in describe(Topology.parse("v5e:8x16"))
    assert "devices: 2 per chip (TensorCores)" in describe(Topology.parse("7x:2x2x1"))
    assert "devices:" not in describe(Topology.parse("v5p:2x2x1"))


def test_describe_layout():
    layout = Topology.parse("v5e:8x16").mesh_layout((8, 16), axis_names=("dp", "tp"))
    text = layout.describe()
    # tp (16) lies on y, the wrapped axis of 8x16; dp (8) on x, a line of 8 chips (7 hops back).
    # A 1 MiB all-reduce over tp: 2 * 2**20 * 15/16 / 9e10 = 21.8 us; over dp without wraparound:
    # 2 * 2**20 * 7/8 / 4.5e10 = 40.8 us.
    assert "mesh (dp=8, tp=16):" in text
    assert ("  tp 16 chips on y: ring with wraparound; neighbours 1 hop apart; all_reduce of 1 MiB "
            "21.8 us") in text
    assert ("  dp 8 chips on x: no wraparound, 7 hops back; neighbours 1 hop apart; all_reduce of "
            "1 MiB 40.8 us") in text
    assert "ranks:" not in text  # 128 chips: too many to print


def test_describe_rejects_other_values():
    with pytest.raises(TypeError):
        describe("v5p:4x4x4")


def test_cli_describe_topology(capsys):
    assert main(["describe", "v4:2x2x4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "v4:2x2x4: TPU v4 slice of 16 chips (x=2, y=2, z=4), 3-D torus"
    assert "wraparound on no axis" in out


def test_cli_describe_mesh(capsys):
    assert main(["describe", "v5p:4x4x4", "--mesh", "4x16", "--axes", "dp,tp"]) == 0
    out = capsys.readouterr().out
    # JAX gives the last mesh axis (16) the first pair of physical axes whose sizes multiply to 16
    # (x, y); dp takes the z left over.
    assert "\n  dp 4 chips on z: ring with wraparound" in out
    assert "\n  tp 16 chips on x, y: ring with wraparound" in out
    assert "ranks:" in out


# name, argv, exact stderr
CLI_ERRORS = [
    ("bad_shape", ["describe", "v5p:2x2x6"],
     "tpudist describe: error: shape=(2, 2, 6) is not a v5p slice: v5p slices are 2x2x1, 2x2x2, "
     "2x2x4, 2x4x4 (any order) or whole 4x4x4 cubes, every size a multiple of 4 (4x4x4, 4x4x8, "
     "...), up to 8960 chips; 1x1x1 and 2x1x1 (any order) are one or two chips of a host. The "
     "nearest are 2x2x4 (16 chips) or 2x4x4 (32 chips): pass one of these, e.g. 'v5p:2x4x4'.\n"),
    ("mesh_needs_split", ["describe", "v4:4x4x4", "--mesh", "8x8"],
     "tpudist describe: error: mesh_shape=(8, 8) does not fit topology v4:4x4x4: each mesh axis "
     "must be a product of physical axes; pass allow_split_physical_axes=True to split one.\n"),
    ("axes_without_mesh", ["describe", "v4:4x4x4", "--axes", "dp,tp"],
     "tpudist describe: error: --axes names mesh axes: pass --mesh too, e.g. --mesh 4x16 --axes "
     "dp,tp\n"),
]


@pytest.mark.parametrize("name,argv,stderr", CLI_ERRORS, ids=[row[0] for row in CLI_ERRORS])
def test_cli_errors(name, argv, stderr, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", stderr)


def test_cli_split_is_accepted(capsys):
    assert main(["describe", "v4:4x4x4", "--mesh", "8x8", "--allow-split"]) == 0
    assert "(2 of 4)" in capsys.readouterr().out  # a mesh axis holds half of a physical axis


def test_cli_needs_a_command():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_cli_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mesh.png"
    assert main(["describe", "v5p:4x4x4", "--mesh", "4x16", "--axes", "dp,tp",
                 "--plot", str(path)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {path}\n")
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("text,mesh_shape,names", [("v5e:8x16", (8, 16), ("dp", "tp")),
                                                   ("7x:2x2x2", (2, 2, 2), None)])
def test_plot_mesh_writes_png(tmp_path, text, mesh_shape, names):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    assert plot_mesh(Topology.parse(text), mesh_shape, names, path, color_axis=0) == str(path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_mesh_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    with pytest.raises(ImportError) as info:
        plot_mesh(Topology.parse("v4:2x2x1"), (4,), None, tmp_path / "x.png")
    assert str(info.value) == (
        "plot_mesh needs matplotlib, which is not installed: install the plot extra "
        "(pip install 'tpudist[plot]') or matplotlib itself.")
    assert not (tmp_path / "x.png").exists()
