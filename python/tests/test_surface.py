"""The whole Python surface of Mooncake's `mooncake.store` exists here under the same names.

`data/store_py_names.txt` lists upstream's classes, enums, methods and module functions. Names this
project does not have yet are listed in PENDING; the test fails on any other missing name, and on
a pending name that exists (so the list only shrinks as the surface is filled in).
"""

import pathlib

from mooncake_rs import store

NAMES = pathlib.Path(__file__).with_name("data") / "store_py_names.txt"

# Not implemented yet (issue 14 is under way); every entry here is a known gap.
PENDING = set()


def names():
    for line in NAMES.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            yield line


def exists(name):
    owner, _, member = name.partition(".")
    if owner == "store":
        return hasattr(store, member)
    cls = getattr(store, owner, None)
    if cls is None:
        return False
    return not member or hasattr(cls, member)


def test_every_upstream_name_exists_or_is_a_known_gap():
    listed = list(names())
    assert len(listed) > 120, "the upstream list was not read"
    missing = {n for n in listed if not exists(n)}
    assert not missing - PENDING, f"missing from the surface: {sorted(missing - PENDING)}"
    assert not PENDING - missing, f"implemented now, take out of PENDING: {sorted(PENDING - missing)}"
    assert PENDING <= set(listed), f"not upstream names: {sorted(PENDING - set(listed))}"
