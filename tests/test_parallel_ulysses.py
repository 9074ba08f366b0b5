"""attention.kind ulysses: head-parallel all-to-all attention (gloo, CP 2 with the heads split, CP 4 with the KV
heads replicated; zigzag and block-stripe; with and without packed documents) against float64 causal attention
on the whole sequence: out 1e-5, grads 1e-4. An impossible head split is refused in one line, at load and at run."""

import pytest

from baselines_common import CP_CASES, check_cp_case, load_kind, run_cp
from mtrain.errors import ConfigError


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_cp("ulysses", tmp_path_factory)


@pytest.mark.parametrize("case", CP_CASES)
def test_ulysses_matches_reference(cp_results, case):
    check_cp_case(cp_results, case)


def test_ulysses_refuses_impossible_head_split_at_run(cp_results):
    # 6 query heads, 3 KV heads: 6 % 4 != 0 at CP 4; at CP 2, 3 KV heads neither split nor replicate evenly
    for world in (2, 4):
        message = cp_results["bad-heads"][0 if world == 2 else 2]
        assert message is not None, f"CP {world}: an impossible head split ran"
        assert "\n" not in message
        assert "6 query heads and 3 key/value heads" in message and f"parallel.cp_size={world}" in message
        assert "set parallel.cp_size to one of" in message


def test_ulysses_head_rule():
    from mtrain.parallel.ulysses import head_split_problem

    assert head_split_problem(16, 2, 2) is None  # both split
    assert head_split_problem(16, 2, 8) is None  # KV heads replicated to 4 ranks each
    assert head_split_problem(16, 2, 1) is None
    assert "one of 2, 4, 8, 16" in head_split_problem(16, 2, 3)
    assert head_split_problem(4, 2, 8) is not None  # more ranks than query heads


def test_ulysses_refuses_impossible_head_split_at_load(tmp_path):
    assert load_kind("ulysses", tmp_path, "parallel.cp_size=4").parallel.cp_size == 4  # 4 q heads, 2 KV replicated
    with pytest.raises(ConfigError) as err:
        load_kind("ulysses", tmp_path, "parallel.cp_size=3")
    message = str(err.value)
    assert "\n" not in message
    assert "4 query heads and 2 key/value heads over parallel.cp_size=3" in message
    assert "set parallel.cp_size to one of 2, 4" in message
