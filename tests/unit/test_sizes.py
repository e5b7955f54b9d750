import pytest

from bigmem_train.errors import BadInput
from bigmem_train.sizes import format_bytes, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64GiB", 64 * 1024**3),
        ("1TB", 10**12),
        ("900 GB", 900 * 10**9),
        ("1TiB", 1024**4),
        ("512MiB", 512 * 1024**2),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("4096", 4096),
        (1024, 1024),
    ],
)
def test_absolute_sizes(text, expected):
    assert parse_size(text) == expected


def test_share_of_host():
    assert parse_size("80%", host_total_bytes=1000) == 800
    with pytest.raises(BadInput, match="host memory is unknown"):
        parse_size("80%")
    with pytest.raises(BadInput, match="between 0% and 100%"):
        parse_size("150%", host_total_bytes=1000)


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "-5GiB", "", True])
def test_bad_sizes(text):
    with pytest.raises(BadInput):
        parse_size(text)


def test_format_prints_bytes_and_gib():
    assert format_bytes(3 * 1024**3) == "3221225472 B (3.00 GiB)"
