"""A bad value in a Parquet file of several row groups is named by its row in the file, then in its group."""

from __future__ import annotations

import pytest

from plait.data import prepare
from plait.errors import ConfigError


def test_a_bad_parquet_value_is_named_by_its_row_in_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b"] * 10 + [None] + ["c d"] * 5}), tmp_path / "g.parquet", row_group_size=4)
    with pytest.raises(ConfigError) as exc:  # row 10 of the file is row 2 of row group 2 (it said 'row 2')
        prepare([str(tmp_path / "g.parquet")], "bytes", tmp_path / "out", workers=1)
    assert str(exc.value).startswith(f"{tmp_path}/g.parquet row 10: 'text' is null, not text (row 2 of row group 2)")
