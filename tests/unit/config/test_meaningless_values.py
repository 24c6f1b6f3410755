"""Values that would run as if unset, refused with one error naming the key and what it may be:
a mistyped debug.fail_point (nothing injected, so a reliability test would test nothing), a
debug.fail_rank outside the world, a train.accumulate above the samples a rank takes per step."""

from __future__ import annotations

import pytest

from hpc_rlx.config.schema import BY_PATH
from hpc_rlx.config.spec import check_accumulate
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.injection import FAIL_POINTS


def test_an_unknown_fail_point_is_one_error_listing_the_points():
    with pytest.raises(ConfigError) as e:
        BY_PATH["debug.fail_point"].validate("finsh", 2)
    assert "debug.fail_point must be null or one of spec, startup" in str(e.value)
    assert "finish" in str(e.value) and "'finsh'" in str(e.value)
    for point in (None, *FAIL_POINTS):
        BY_PATH["debug.fail_point"].validate(point, 2)


@pytest.mark.parametrize("value", [7, [0, 2], [1, 7]])
def test_a_fail_rank_outside_the_world_is_one_error_naming_the_largest_rank(value):
    with pytest.raises(ConfigError, match=r"outside the world of 2 \(the largest rank is 1\)"):
        BY_PATH["debug.fail_rank"].validate(value, 2)
    BY_PATH["debug.fail_rank"].validate(1, 2)
    BY_PATH["debug.fail_rank"].validate([0, 1], 2)
    BY_PATH["debug.fail_rank"].validate(7, None)      # the world unknown (a config read alone)


@pytest.mark.parametrize("value", [[], [-1], "1", [0.5]])
def test_a_fail_rank_that_is_no_rank_is_refused(value):
    with pytest.raises(ConfigError, match="debug.fail_rank must be null, a rank or a list of ranks"):
        BY_PATH["debug.fail_rank"].validate(value, 4)


def test_accumulate_above_a_ranks_samples_per_step_names_the_largest_useful_value():
    with pytest.raises(ConfigError) as e:
        check_accumulate({"accumulate": 1000, "batch_size": 64}, 2)
    assert str(e.value).startswith("train.accumulate=1000 is more micro-batches than the 32 sample(s) a rank")
    assert "the largest value that means something is 32" in str(e.value)
    check_accumulate({"accumulate": 32, "batch_size": 64}, 2)
    check_accumulate({"accumulate": 33, "batch_size": 65}, 2)     # the busiest rank takes 33
    with pytest.raises(ConfigError, match="is 33"):
        check_accumulate({"accumulate": 34, "batch_size": 65}, 2)
