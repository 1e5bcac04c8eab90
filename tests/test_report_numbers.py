"""benchmarks/report.py's cells: the numbers of the results files (ms, GiB, tokens/s, ratios, errors down to 1e-8)
to 3 significant digits or as whole numbers, without an exponent from 1e-4 on."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import report


def test_a_value_that_rounds_to_a_thousand_is_written_whole():
    assert [report._fmt(x) for x in (998.4, 999.4, 999.5, 999.96, 1000.0, 1000.84, -999.7)] == [
        "998", "999", "1,000", "1,000", "1,000", "1,001", "-1,000"]


# |value| in [1e-4, 1e18], and values just below a power of ten ([9.995, 10) in each decade), which 3 significant
# digits round up to it (999.5 -> 1e+03 in .3g): a plain float strategy seldom draws them
MAGNITUDES = st.floats(min_value=1e-4, max_value=1e18) | st.builds(
    lambda mantissa, exponent: mantissa * 10.0**exponent, st.floats(9.995, 10.0, exclude_max=True), st.integers(-4, 17))


@settings(max_examples=300)  # microseconds each, against the CI profile's 12
@given(MAGNITUDES, st.sampled_from([1.0, -1.0]))
def test_a_cell_has_no_exponent_and_three_digits_of_its_value(magnitude, sign):
    """Within half a unit of the third significant digit (5e-3 of |value|), or of the last whole digit from 999.5 on
    (0.5 <= 5e-3 |value|); the parse adds a rounding of 2^-53."""
    value = sign * magnitude
    cell = report._fmt(value)
    assert "e" not in cell, cell
    assert math.isclose(float(cell.replace(",", "")), value, rel_tol=5e-3 + 2.0**-52), cell
