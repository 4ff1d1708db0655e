"""benchmarks/linear_ncu.py on tiny shapes through the Triton interpreter: every projection's kernel output checked."""

import pytest

from benchmarks import linear_ncu
from benchmarks.linear_bench import CHECK_TOL


@pytest.mark.parametrize("m", [1, 5])
def test_each_projection_matches_the_reference(m):
    errors = linear_ncu.main(["--smoke", "--m", str(m)])
    assert set(errors) == set(linear_ncu.PROJECTIONS)
    assert all(0 < err < CHECK_TOL for err in errors.values()), errors


def test_rows_below_one_are_refused():
    with pytest.raises(SystemExit):
        linear_ncu.main(["--smoke", "--m", "0"])
