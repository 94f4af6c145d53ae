"""The agent's side of a scoring run: imports the agent's modules and answers calls as plain values.

Standard library only; the scorer runs this source as ``python -I -B -c SOURCE`` in the scoring
sandbox, as the sandbox's own uid (the server's ``peer_command``), with the workspace as working
directory. The hidden tests run in a different process under a different uid (``score_runner``,
the judge); the two speak one JSON message per line over this process's stdin/stdout.

Everything here runs next to the agent's code and can be replaced by it: this process is not
trusted. What it sends back is only ever JSON, decoded by the judge into plain values (``int``,
``str``, ``list``, ``Decimal``...) or into references to objects that stay here. So a returned
object that claims to equal everything, a rewritten serializer or a forged reply can only be a
(wrong) value, and nothing here can reach the judge's frames, files or report.

Requests (judge -> here): ``{"op": "import"|"getattr"|"setattr"|"call"|"op", ...}``; replies
``{"ok": VALUE}`` or ``{"error": {...}}``. While a call runs, this side may send
``{"callback": id, "args": [...], "kwargs": {...}}`` (a function the test passed, e.g. ``key=``)
and waits for its reply. Lists, dicts and sets of the judge's (``"held"``) arrive as subclasses
of ``list``/``dict``/``set`` holding a copy: reads are local, and each write sends
``{"write": id, "v": [...]}`` (the new contents) so the judge changes its own object. Nothing about
those objects is reported after a call: the judge sees only the writes that happened.
"""

import base64
import builtins
import collections
import datetime
import decimal
import fractions
import importlib
import json
import os
import sys

_objects = {}  # id -> object held for the judge
_values = {type(None), bool, int, float, str}
_OPS = {  # the operator-style requests the judge's proxies forward
    "len": len, "iter": iter, "next": next, "contains": lambda obj, item: item in obj, "repr": repr, "str": str,
    "bool": bool, "getitem": lambda obj, key: obj[key], "setitem": lambda obj, key, value: obj.__setitem__(key, value),
    "delitem": lambda obj, key: obj.__delitem__(key),
}
_channel_in = sys.stdin.buffer
_channel_out = os.fdopen(os.dup(1), "wb")


def _write_through(base, names):
    """Methods of ``base`` that, after changing the local copy, send its new contents to the judge."""

    def wrap(name):
        method = getattr(base, name)

        def write(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            _push(self)
            return result

        return write

    return {name: wrap(name) for name in names}


def _reduce(self, protocol):  # copy/deepcopy/pickle give a plain container, never another judge reference
    return (self.__class__.__mro__[1], (self.__class__.__mro__[1](self),))


_HeldList = type("_HeldList", (list,), {"__slots__": ("_held_id",), "__reduce_ex__": _reduce, **_write_through(
    list, ["__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove",
           "clear", "sort", "reverse"])})
_HeldDict = type("_HeldDict", (dict,), {"__slots__": ("_held_id",), "__reduce_ex__": _reduce, **_write_through(
    dict, ["__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault"])})
_HeldSet = type("_HeldSet", (set,), {"__slots__": ("_held_id",), "__reduce_ex__": _reduce, **_write_through(
    set, ["__ior__", "__iand__", "__isub__", "__ixor__", "add", "discard", "remove", "pop", "clear", "update",
          "difference_update", "intersection_update", "symmetric_difference_update"])})
_HELD = {"list": _HeldList, "dict": _HeldDict, "set": _HeldSet}
_held = {}  # judge's id -> the local copy standing for it


def _contents(held):
    if isinstance(held, dict):
        return [[encode(k), encode(v)] for k, v in dict.items(held)]
    return [encode(v) for v in type(held).__mro__[1].__iter__(held)]


def _push(held):
    _send({"write": held._held_id, "v": _contents(held)})
    _reply_to_value(_serve_until_reply())


def _decode_held(data):
    """The local copy of a judge's container, refreshed with the contents the judge just sent."""
    cls = _HELD[data["kind"]]
    held = _held.get(data["id"])
    if type(held) is not cls:
        held = _held[data["id"]] = cls()
        held._held_id = data["id"]
    base = cls.__mro__[1]
    base.clear(held)
    if base is dict:
        dict.update(held, ((decode(k), decode(v)) for k, v in data["v"]))
    elif base is list:
        list.extend(held, (decode(x) for x in data["v"]))
    else:
        set.update(held, (decode(x) for x in data["v"]))
    return held


def _ref(obj):
    _objects[id(obj)] = obj
    if isinstance(obj, type):
        kind = "exception_class" if issubclass(obj, BaseException) else "class"
    elif type(obj).__name__ == "module":
        kind = "module"
    else:
        kind = "callable" if callable(obj) else "object"
    bases = [c.__name__ for c in obj.__mro__ if c.__module__ == "builtins"] if kind == "exception_class" else []
    return {"$t": "ref", "id": id(obj), "kind": kind, "name": getattr(obj, "__qualname__", type(obj).__name__),
            "bases": bases}


def encode(value):
    # The judge (score_runner.py) writes and reads the same tags for standard values. Two copies on
    # purpose: each side is one standalone source run as `python -c`, and the judge must not run code
    # from the agent's side; tests/sandbox/test_scoring.py round-trips every tag between the two.
    kind = type(value)
    if kind in _values:
        return value
    if kind in (_HeldList, _HeldDict, _HeldSet):
        return {"$t": "held", "id": value._held_id}
    if kind is list:
        return {"$t": "list", "v": [encode(v) for v in value]}
    if kind is tuple:
        return {"$t": "tuple", "v": [encode(v) for v in value]}
    if kind is dict:
        return {"$t": "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {"$t": kind.__name__, "v": [encode(v) for v in value]}
    if kind is bytes:
        return {"$t": "bytes", "v": base64.b64encode(value).decode()}
    if kind is decimal.Decimal:
        return {"$t": "decimal", "v": str(value)}
    if kind is fractions.Fraction:
        return {"$t": "fraction", "v": str(value)}
    if kind is complex:
        return {"$t": "complex", "v": [value.real, value.imag]}
    if kind is range:
        return {"$t": "range", "v": [value.start, value.stop, value.step]}
    if kind in (datetime.date, datetime.datetime, datetime.time):
        return {"$t": kind.__name__, "v": value.isoformat()}
    if kind is datetime.timedelta:
        return {"$t": "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    plain = _plain(value)
    return _ref(value) if plain is None else encode(plain)


def _plain(value):
    """A standard-library container (Counter, OrderedDict, defaultdict, deque) or a named tuple as the
    builtin value it stands for, so an honest fix that returns one compares by value; None otherwise
    (a class of the agent's stays a reference)."""
    kind = type(value)
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return tuple(value)
    if kind.__module__.split(".")[0] not in sys.stdlib_module_names:
        return None
    if isinstance(value, collections.deque):
        return list(value)
    for base in (bool, int, float, str, bytes, list, tuple, dict, set, frozenset):
        if isinstance(value, base):
            return base(value)
    return None


def decode(data):
    if not isinstance(data, dict):
        return data
    tag, v = data.get("$t"), data.get("v")
    if tag == "list":
        return [decode(x) for x in v]
    if tag == "tuple":
        return tuple(decode(x) for x in v)
    if tag == "dict":
        return {decode(k): decode(x) for k, x in v}
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(x) for x in v)
    if tag == "bytes":
        return base64.b64decode(v)
    if tag == "decimal":
        return decimal.Decimal(v)
    if tag == "fraction":
        return fractions.Fraction(v)
    if tag == "complex":
        return complex(*v)
    if tag == "range":
        return range(*v)
    if tag in ("date", "datetime", "time"):
        return getattr(datetime, tag).fromisoformat(v)
    if tag == "timedelta":
        return datetime.timedelta(*v)
    if tag == "held":
        return _decode_held(data)
    if tag == "ref":
        return _objects[data["id"]]
    if tag == "cb":
        return _callback(data["id"])
    raise ValueError(f"unknown value tag {tag!r}")


def _callback(number):
    def call_judge(*args, **kwargs):
        _send({"callback": number, "args": [encode(a) for a in args],
               "kwargs": {k: encode(v) for k, v in kwargs.items()}})
        return _reply_to_value(_serve_until_reply())

    return call_judge


def _reply_to_value(message):
    if "error" in message:
        raise _judge_error(message["error"])
    return decode(message["ok"])


def _judge_error(info):
    base = getattr(builtins, str(info.get("bases", ["Exception"])[0]), Exception)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        base = Exception
    return base(info.get("message", ""))


def _send(message):
    _channel_out.write(json.dumps(message).encode() + b"\n")
    _channel_out.flush()


def _error(exc):
    kind = type(exc)
    _objects[id(kind)] = kind
    # The arguments too when they are plain scalars: KeyError('x').args is ('x',), its str is "'x'".
    try:
        args = exc.args if type(exc.args) is tuple else ()
        plain = all(type(a) in (str, int, float, bool, type(None)) for a in args) and len(repr(args)) <= 4000
    except Exception:  # an agent's exception whose args cannot be read: its message only
        args, plain = (), False
    return {"name": kind.__name__, "message": str(exc)[:4000], "id": id(kind),
            "bases": [c.__name__ for c in kind.__mro__ if c.__module__ == "builtins"],
            **({"args": list(args)} if plain else {})}


def _handle(request):
    op = request["op"]
    if op == "import":
        return importlib.import_module(request["name"])
    target = decode(request["target"])
    if op == "getattr":
        return getattr(target, request["name"])
    if op == "setattr":
        setattr(target, request["name"], decode(request["value"]))
        return None
    args = [decode(a) for a in request.get("args", [])]
    if op == "op":
        return _OPS[request["name"]](target, *args)
    kwargs = {k: decode(v) for k, v in request.get("kwargs", {}).items()}
    if "env" in request:
        os.environ.clear()
        os.environ.update(request["env"])
    return target(*args, **kwargs)


def _serve_until_reply():
    """Answer requests until a reply (to a callback of ours) comes; None when the channel closes."""
    while True:
        line = _channel_in.readline()
        if not line:
            os._exit(0)
        message = json.loads(line)
        if "op" not in message:
            return message
        try:
            reply = {"ok": encode(_handle(message))}
        except StopIteration:
            reply = {"stop": True}
        except Exception as exc:  # the agent's code failed: the judge raises it in the test
            reply = {"error": _error(exc)}
        _send(reply)


if __name__ == "__main__":
    os.dup2(2, 1)  # the agent's prints go to stderr, never into the channel
    sys.path.insert(0, os.getcwd())
    _serve_until_reply()
