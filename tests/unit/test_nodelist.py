"""nvrx.slurm.nodelist: SLURM host list expansion and compression."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvrx.slurm.nodelist import MAX_HOSTS, compress_nodelist, expand_nodelist


@pytest.mark.parametrize(
    ("nodelist", "names"),
    [
        ("node1", ["node1"]),
        (
            "gpu[01-04,07],cpu-a[1-2]",
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1", "cpu-a2"],
        ),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[1-010]", ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]),
        ("n[1,02]", ["n1", "n02"]),
        ("n[0001-3]", ["n0001", "n0002", "n0003"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("x[1-2][3-4]", ["x13", "x14", "x23", "x24"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[1-2]-[3]", ["n1-3", "n2-3"]),
        ("[1-2]", ["1", "2"]),
        ("n[1-2,5-6,3]", ["n1", "n2", "n5", "n6", "n3"]),
        ("n[1-2],n[1-2]", ["n1", "n2", "n1", "n2"]),
        ("n[1,1]", ["n1", "n1"]),
        ("a,,b", ["a", "b"]),
        (",a", ["a"]),
        ("a b,c", ["a", "b", "c"]),
        (" n[1-2] ", ["n1", "n2"]),
        ("x1y[1-2]", ["x1y1", "x1y2"]),
        ("a;b", ["a;b"]),
        ("", []),
    ],
)
def test_expand(nodelist: str, names: list[str]) -> None:
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize(
    "bad",
    [
        "n[5-3]",
        "n[010-8]",
        "n[1-2",
        "n1-2]",
        "n[1-2]]",
        "n[[1]]",
        "n[]",
        "n[a-b]",
        "n[-1]",
        "n[1-]",
        "n[1-2,]",
        "n[ 1-2]",
        "n[1-2]x",
        "a[1-3]-b",
        "n[1-3]a[5-6]b",
    ],
)
def test_malformed_raises_value_error_quoting_input(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_nodelist(bad)
    assert repr(bad) in str(info.value)


def test_huge_range_is_refused_without_expanding() -> None:
    with pytest.raises(ValueError, match="more than"):
        expand_nodelist(f"n[1-{MAX_HOSTS + 1}]")
    with pytest.raises(ValueError, match="more than"):
        expand_nodelist("a[1-2000]b[1-2000]")


def test_non_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="list"):
        expand_nodelist(["node1"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("names", "nodelist"),
    [
        (["node1", "node2", "node3", "node5"], "node[1-3,5]"),
        (
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1", "cpu-a2"],
            "gpu[01-04,07],cpu-a[1-2]",
        ),
        (["n8", "n9", "n10"], "n[8-10]"),
        (["n08", "n09", "n10"], "n[08-10]"),
        (["n9", "n010"], "n[9,010]"),
        (["login"], "login"),
        (["a", "b1", "b2", "c"], "a,b[1-2],c"),
        (["n2", "n1"], "n[2,1]"),
        (["n1", "n1"], "n[1,1]"),
        (["n1", "m1", "n2"], "n1,m1,n2"),
        ([], ""),
    ],
)
def test_compress(names: list[str], nodelist: str) -> None:
    assert compress_nodelist(names) == nodelist
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize("bad", ["", "a,b", "n[1]", "a b", "x]"])
def test_compress_rejects_names_that_cannot_be_listed(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        compress_nodelist(["ok1", bad])
    assert repr(bad) in str(info.value)


_name = st.builds(
    lambda prefix, digits: prefix + digits,
    st.text(alphabet="abxyz-_.", max_size=4),
    st.text(alphabet="0123456789", max_size=4),
).filter(bool)


@given(st.lists(_name, max_size=30))
def test_expand_of_compress_is_identity(names: list[str]) -> None:
    """Order and duplicates survive a round trip."""
    assert expand_nodelist(compress_nodelist(names)) == names


@given(st.lists(st.integers(0, 300), max_size=40, unique=True), st.integers(1, 4))
def test_sorted_names_compress_into_one_bracket(numbers: list[int], width: int) -> None:
    names = [f"gpu{n:0{width}d}" for n in sorted(numbers)]
    nodelist = compress_nodelist(names)
    assert expand_nodelist(nodelist) == names
    if len({len(name) for name in names}) == 1 and len(names) > 1:
        assert nodelist.count("[") == 1
