import pytest

from procckpt.durations import format_duration, parse_duration
from procckpt.errors import UsageError

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,seconds", [
    ("90s", 90), ("90", 90), ("15m", 900), ("2h", 7200), ("1d", 86400), ("1.5m", 90),
    ("1:30:00", 5400), ("05:30", 330), ("2-00:00:00", 172800), ("1-12", 129600),
    (" 45S ", 45), (30, 30),
])
def test_accepted_forms(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5s", "1:75", "1:2:3:4", "s", True])
def test_rejected_forms_say_what_is_accepted(text):
    with pytest.raises(UsageError, match="90s, 15m"if text not in ("-5s", "1:75") else "."):
        parse_duration(text)


def test_format_duration():
    assert format_duration(4.23) == "4.2s"
    assert format_duration(185) == "3m05s"
    assert format_duration(3725) == "1h02m"
