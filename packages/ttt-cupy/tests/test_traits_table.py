"""The committed traits table (src/ttt_cupy/_traits_table.py) equals a fresh generation from
the C++ Traits (csrc/traits.cuh) by tools/gen_traits_table.py: the launcher's threads and
shared-memory sizes have one source."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gen_traits_table.py"


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the table's generator)")
def test_traits_table_is_up_to_date():
    spec = importlib.util.spec_from_file_location("gen_traits_table", TOOL)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    from ttt_cupy import _traits_table

    assert gen.TABLE.read_text() == gen.generate(), \
        "_traits_table.py is stale: run python packages/ttt-cupy/tools/gen_traits_table.py"
    # the table the installed package imports (editable or not) is the committed one
    assert Path(_traits_table.__file__).read_text() == gen.TABLE.read_text()
