"""``bus.salt``: the salt format's round trip, and that no text a client can put in a
``cache_salt`` makes ``verify_salt`` raise anything but ``SaltError``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.salt import SALT_PREFIX, SaltError, caller_salt, encode_salt, verify_salt

SECRET = b"0123456789abcdef-secret"
KEY = bytes(range(32))


def test_round_trip_and_backend_binding() -> None:
    salt = encode_salt(SECRET, "b1", KEY, "tenant-7")
    info = verify_salt(SECRET, "b1", salt)
    assert info is not None and (info.prefix_key, info.caller_salt) == (KEY, "tenant-7")
    assert caller_salt(salt) == "tenant-7"
    with pytest.raises(SaltError):
        verify_salt(SECRET, "b2", salt)
    assert verify_salt(SECRET, "b1", "tenant-7") is None


@pytest.mark.parametrize(
    "mac",
    ["é" * 22, "A" * 21 + "\u00ff", "\U0001f600" * 22, "A" * 21 + "\udc80"],
    ids=["latin1", "last-char", "emoji", "lone-surrogate"],
)
def test_non_ascii_mac_is_a_salt_error(mac: str) -> None:
    """A client controls ``cache_salt``: a non-ASCII MAC of the right length once made
    ``hmac.compare_digest`` raise ``TypeError`` out of the ingestion path."""
    with pytest.raises(SaltError):
        verify_salt(SECRET, "b1", f"{SALT_PREFIX}{KEY.hex()}.{mac}.tenant")


@given(st.text(max_size=120))
def test_any_text_after_the_prefix_verifies_or_is_a_salt_error(rest: str) -> None:
    try:
        verify_salt(SECRET, "b1", SALT_PREFIX + rest)
    except SaltError:
        pass


@given(st.text(min_size=22, max_size=22), st.text(max_size=20))
def test_any_mac_of_the_right_length_is_a_salt_error(mac: str, caller: str) -> None:
    with pytest.raises(SaltError):
        verify_salt(SECRET, "b1", f"{SALT_PREFIX}{KEY.hex()}.{mac}.{caller}")
