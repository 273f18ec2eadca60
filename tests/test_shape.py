import pytest

from monarch_kernel.shape import Point, Shape, SliceError, parse_ranks

pytestmark = pytest.mark.unit


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


def test_parse_ranks_accepted_forms():
    assert parse_ranks("2", 4) == [2]
    assert parse_ranks("0", 1) == [0]
    assert parse_ranks("0:2", 4) == [0, 1]
    assert parse_ranks("1,3", 4) == [1, 3]
    assert parse_ranks("::2", 4) == [0, 2]
    assert parse_ranks("1:", 4) == [1, 2, 3]
    assert parse_ranks(":2", 4) == [0, 1]
    assert parse_ranks("-1", 4) == [3]
    assert parse_ranks("-4", 4) == [0]
    assert parse_ranks("0,2:4", 4) == [0, 2, 3]
    assert parse_ranks("3,1,3", 4) == [1, 3]  # sorted, no duplicates
    assert parse_ranks(" 1 , 3 ", 4) == [1, 3]
    assert parse_ranks("2:10", 4) == [2, 3]  # clipped like mesh.slice(gpus=slice(2, 10))
    assert parse_ranks("3:1:-1", 4) == [2, 3]


@pytest.mark.parametrize(
    "spec,size,message",
    [
        ("5", 4, "rank 5 is out of range: the mesh has 4 ranks (0-3)"),
        ("4", 4, "rank 4 is out of range: the mesh has 4 ranks (0-3)"),
        ("1", 1, "rank 1 is out of range: the mesh has 1 rank (0)"),
        ("1,9", 4, "rank 9 is out of range: the mesh has 4 ranks (0-3)"),
        ("-5", 4, "rank -5 is out of range: the mesh has 4 ranks (0-3, or -4 to -1 counting"),
    ],
)
def test_parse_ranks_out_of_range_names_the_rank_and_the_valid_ranks(spec, size, message):
    with pytest.raises(SliceError) as err:
        parse_ranks(spec, size)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("spec", ["", "   "])
def test_parse_ranks_empty(spec):
    with pytest.raises(SliceError) as err:
        parse_ranks(spec, 4)
    text = str(err.value)
    assert text.startswith("empty --ranks") and "0:2" in text and "(0-3)" in text, text


@pytest.mark.parametrize("spec", ["1,,3", "1,", ",1", " , "])
def test_parse_ranks_empty_list_item(spec):
    with pytest.raises(SliceError, match=r"has an empty item.*use a rank \(2\), a slice"):
        parse_ranks(spec, 4)


@pytest.mark.parametrize(
    "spec,bad",
    [("x", "'x'"), ("1.5", "'1.5'"), ("one", "'one'"), ("1,b", "'b'"), ("0x1", "'0x1'")],
)
def test_parse_ranks_non_numeric_says_which_item(spec, bad):
    with pytest.raises(SliceError) as err:
        parse_ranks(spec, 4)
    text = str(err.value)
    assert text.startswith(f"bad --ranks {spec!r}: rank {bad} is not an integer; use a rank")
    assert "a slice (0:2, ::2)" in text and "(1,3)" in text


def test_parse_ranks_dash_range_suggests_the_slice():
    with pytest.raises(SliceError) as err:
        parse_ranks("0-3", 4)
    assert "rank '0-3' is not an integer (for ranks 0 to 3 write 0:4;" in str(err.value)
    with pytest.raises(SliceError, match="for ranks 1 to 2 write 1:3"):
        parse_ranks("0,1-2", 4)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("1:2:3:4", "slice '1:2:3:4' has 4 parts; a slice is start:stop or start:stop:step"),
        ("a:2", "slice part 'a' is not an integer"),
        ("0:2:x", "slice part 'x' is not an integer"),
        ("::0", "slice '::0' has a step of 0; use e.g. ::2"),
        ("3:1", "slice '3:1' of --ranks selects no rank: the mesh has 4 ranks (0-3)"),
        ("5:", "slice '5:' of --ranks selects no rank: the mesh has 4 ranks (0-3)"),
        ("1,5:", "slice '5:' of --ranks selects no rank"),  # not silently just rank 1
    ],
)
def test_parse_ranks_bad_slices(spec, message):
    with pytest.raises(SliceError) as err:
        parse_ranks(spec, 4)
    assert message in str(err.value), str(err.value)


def test_parse_ranks_errors_are_value_errors_and_size_must_be_positive():
    with pytest.raises(ValueError, match="out of range"):  # SliceError is a ValueError
        parse_ranks("9", 4)
    with pytest.raises(ValueError, match="at least one rank"):
        parse_ranks("0", 0)
