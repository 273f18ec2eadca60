import pytest

from monarch_kernel.shape import Point, Shape, SliceError, parse_ranks


def test_slice_int_drops_dim_and_slice_keeps_it():
    s = Shape.from_extent({"hosts": 2, "gpus": 4})
    assert s.ranks() == list(range(8))
    assert s.slice(hosts=1).extent == {"gpus": 4}
    assert s.slice(hosts=1).ranks() == [4, 5, 6, 7]
    assert s.slice(gpus=0).extent == {"hosts": 2}
    assert s.slice(gpus=0).ranks() == [0, 4]
    assert s.slice(hosts=1, gpus=1).ranks() == [5] and len(s.slice(hosts=1, gpus=1)) == 1
    assert s.slice(gpus=slice(1, 3)).ranks() == [1, 2, 5, 6]
    assert s.slice(gpus=slice(None, None, 2)).slice(hosts=0).ranks() == [0, 2]
    assert s.slice(gpus=-1).ranks() == [3, 7]


def test_slice_errors_say_what_is_wrong():
    s = Shape.from_extent({"gpus": 4})
    with pytest.raises(SliceError, match="no dimension 'hosts'.*'gpus'"):
        s.slice(hosts=0)
    with pytest.raises(SliceError, match="out of range for dim 'gpus' of size 4"):
        s.slice(gpus=4)
    with pytest.raises(SliceError, match="empty"):
        s.slice(gpus=slice(3, 1))
    with pytest.raises(SliceError, match="int or a slice"):
        s.slice(gpus="0")


def test_points_and_index():
    s = Shape.from_extent({"hosts": 2, "gpus": 2})
    pts = s.points()
    assert pts[3] == Point({"hosts": 1, "gpus": 1}, 3)
    assert pts[3].rank == 3 and pts[3]["gpus"] == 1 and pts[3].hosts == 1
    assert dict(pts[2]) == {"hosts": 1, "gpus": 0}
    assert s.index_of({"hosts": 1, "gpus": 0}) == 2
    with pytest.raises(SliceError):
        s.index_of({"gpus": 0})


def test_parse_ranks():
    assert parse_ranks("0:2", 4) == [0, 1]
    assert parse_ranks("1,3", 4) == [1, 3]
    assert parse_ranks("::2", 4) == [0, 2]
    assert parse_ranks("-1", 4) == [3]
    for bad in ("x", "5", "", "1:2:3:4", "3:1"):
        with pytest.raises(SliceError):
            parse_ranks(bad, 4)
