"""The examples in tpudist.mesh docstrings run and give what they show."""

import doctest
import importlib

import pytest

MODULES = ["tpudist.mesh", "tpudist.mesh.cost", "tpudist.mesh.describe", "tpudist.mesh.generations",
           "tpudist.mesh.layout", "tpudist.mesh.plot", "tpudist.mesh.topology"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"Topology": importlib.import_module(
        "tpudist.mesh").Topology})
    assert result.attempted > 0 and result.failed == 0
