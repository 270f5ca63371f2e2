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


SIGNATURES = pathlib.Path(__file__).with_name("data") / "store_py_signatures.txt"


def upstream_signatures():
    """(method, [(argument, has default, variadic)]) per line of the signature file."""
    for line in SIGNATURES.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("(")
        args = []
        for a in filter(None, (x.strip() for x in rest.rstrip(")").split(","))):
            variadic = a.startswith("*")
            arg, eq, _ = a.lstrip("*").partition("=")
            args.append((arg.strip(), bool(eq), variadic))
        yield name, args


def ours(method):
    import inspect

    sig = inspect.signature(getattr(store.MooncakeDistributedStore, method))
    return [(p.name, p.default is not inspect.Parameter.empty, p.kind == inspect.Parameter.VAR_POSITIONAL)
            for p in sig.parameters.values() if p.name != "self"]


def test_every_upstream_method_takes_the_same_arguments_with_the_same_defaults():
    """Callers pass arguments by keyword (`batch_replica_clear(keys, segment_name=...)`): the names,
    their order, which have defaults and which are variadic match upstream. Ours may add optional
    arguments after upstream's (the tensor writes take a `config`). Where upstream puts a defaulted
    argument before a required one (`load_tensor_from_safetensor(key=None, file_name)`, not
    expressible in Python), ours may give the later one a default too."""
    wrong = []
    for method, theirs in upstream_signatures():
        mine, extra = ours(method)[:len(theirs)], ours(method)[len(theirs):]
        names_match = [a[0] for a in mine] == [a[0] for a in theirs] and all(a[1] for a in extra)
        variadic_match = [a[2] for a in mine] == [a[2] for a in theirs]
        defaults_match = all(m[1] == t[1] or (m[1] and any(x[1] for x in theirs[:i]))
                             for i, (m, t) in enumerate(zip(mine, theirs)))
        if not (names_match and variadic_match and defaults_match):
            wrong.append(f"{method}: upstream {theirs}, ours {mine}")
    assert not wrong, "\n".join(wrong)
