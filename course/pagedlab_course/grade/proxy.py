"""The student's objects as the judge sees them (issue 46, item 1): ``Peer`` makes requests of
the submission's process over the channel, ``Remote`` stands for one of its objects.

What the judge sends is pickled (the submission's process unpickles what the judge made; the
judge never unpickles): its arguments are copies, a proxy goes back as the student's own object,
and the judge's functions (a check's ``key_fn``) as callbacks the student's code may call. What
comes back is plain data or proxies (``pagedlab_course.grade.copyout``).

A proxy answers ``==`` from plain data alone: a container's from its snapshot, any other object
by identity; the student's ``__eq__``, ``__hash__`` or ``__class__`` is never asked. Reads are
cached until the judge next asks the submission to run code (a call, an assignment), which may
change anything; the judge asks for no dunder attribute of a student's object.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
import time
import types
import weakref

from pagedlab_course.grade.copyout import SCALARS, VIEWS, Garbled, blobs, decode

# A container's attributes answered from its snapshot; any other is a method run by the student.
READS = {"list": {"copy", "index", "count"}, "deque": {"copy", "index", "count", "maxlen"},
         "set": {"copy", "issubset", "issuperset", "isdisjoint", "union", "intersection", "difference",
                 "symmetric_difference"},
         "dict": {"copy", "get", "keys", "values", "items"}}
READS |= {"OrderedDict": READS["dict"], "Counter": READS["dict"] | {"most_common", "elements", "total"}}
MISSING = object()


class Peer:
    """The judge's end of the channel. ``exception_class(name, bases)`` gives the judge's class
    for an exception the student's code raised; ``deadline`` (a ``time.monotonic()``) is passed
    on with each request, for the submission's own alarm."""

    def __init__(self, channel, exception_class):
        self.channel, self.exception_class = channel, exception_class
        channel.serve = self._serve
        self.epoch = 0  # bumped whenever the student's code may have run: every cached read is stale then
        self.deadline, self.limit = float("inf"), 0.0  # when the cell must end; its time limit
        self.proxies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.released: list[int] = []  # handles of proxies gone, sent with the next request
        self.reads: dict[int, int] = {}  # handle -> the epoch its attributes were last read: refreshed together
        self.callbacks: dict[int, object] = {}  # the judge's functions the student's code may call
        self.forbidden: list[dict] = []  # the student's code used what the assignment forbids

    def ask(self, op: str, h: int | None = None, name=None, args=MISSING, mutates: bool = True, **fields):
        """Run ``op`` in the submission's process; its value, or its exception raised here. Unless
        the answer says no code of the student's ran (``pure``: a plain attribute or list changed),
        a request that ``mutates`` makes every cached read stale."""
        left = self.deadline - time.monotonic()
        header = {"op": op, "h": h, "name": name, "timeout": max(left, 0.001) if left < float("inf") else None,
                  "release": self.released, **fields}
        self.released = []
        reply, payload = self.channel.request(header, b"" if args is MISSING else self.lend(args))
        if mutates and reply.get("pure") is not True:
            self.epoch += 1
        try:
            values = blobs(reply, payload)
            if "error" in reply:
                raise self._exception(reply["error"], values)
            if "target" in reply:  # a pure change: the object changed, as it is now
                decode(reply["target"], values, self._remote)
            if reply.get("method") is True:
                return METHOD
            if type(reply.get("forbidden")) is list:  # the output's report of forbidden uses
                self.forbidden += [{"what": str(u.get("what"))[:300], "where": str(u.get("where"))[:300]}
                                   for u in reply["forbidden"][:100] if type(u) is dict]
            value = decode(reply.get("value"), values, self._remote)
            others = reply.get("others", {})
            if type(reply.get("self", {})) is not dict or type(others) is not dict:
                raise Garbled("attributes that are not a mapping")
            for key, attrs in ([(h, reply["self"])] if "self" in reply else []) + list(others.items()):
                if type(key) is not int and not (key.isascii() and key.isdigit()):
                    raise Garbled(f"a handle that is not one: {key[:20]!r}")
                proxy = self.proxies.get(int(key))
                if proxy is not None and type(attrs) is dict:  # a getattr's refresh of the objects read lately
                    _refresh(proxy, None, {k: decode(v, values, self._remote) for k, v in _names(attrs)})
            return value
        except Garbled as err:
            raise Garbled(f"the submission's process answered {op} with something that is not a value: {err}") from None

    def lend(self, value) -> bytes:
        """``value`` pickled for the submission's process (see the module's docstring)."""
        out = io.BytesIO()
        _Lender(out, self).dump(value)
        return out.getvalue()

    def names(self, names: list[str]) -> dict:
        """The student's values of those of ``names`` its namespace binds."""
        found = self.ask("names", name=list(names), mutates=False)
        if type(found) is not dict or not all(type(k) is str and k in names for k in found):
            raise Garbled("names that were not asked for")
        return found

    def output(self) -> str:
        """What the student's code printed since the last time asked ('' once the channel is
        broken); the uses of forbidden names it made are added to ``forbidden``."""
        try:
            text = self.ask("output", mutates=False)
        except Exception:  # noqa: BLE001 - a broken channel, or an answer that is not one
            return ""
        return text if type(text) is str else ""

    def callback(self, fn) -> int:
        key = id(fn)
        self.callbacks.setdefault(key, fn)
        return key

    def _remote(self, h: int, kind: str, type_name: str, snap, attrs, library=()) -> Remote:
        proxy = self.proxies.get(h)
        if proxy is None or proxy._Remote__kind != kind:
            proxy = Remote(self, h, kind, type_name, next(filter(None, map(_library_class, library)), None))
            self.proxies[h] = proxy
        if h in self.released:  # a proxy of it died since; the new one keeps the handle
            self.released.remove(h)
        _refresh(proxy, snap, attrs)
        return proxy

    def _serve(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """A callback the student's code makes, of a function the judge passed it."""
        self.epoch += 1
        try:
            fn = self.callbacks.get(header.get("cb")) if header.get("op") == "callback" else None
            if fn is None:
                raise Garbled(f"a request the judge does not answer: {str(header.get('op'))[:50]!r}")
            values = blobs(header, payload)
            args, kwargs = decode(header.get("args"), values, self._remote), decode(header.get("kwargs"), values, self._remote)
            if type(args) is not list or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
                raise Garbled("a callback's arguments that are not a list and a mapping")
            return {}, self.lend(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the check's function raised: the student's code sees it
            return {"error": {"type": type(exc).__name__, "message": str(exc)[:2000]}}, b""
        finally:
            self.epoch += 1

    def _exception(self, error, values: list[bytes]) -> BaseException:
        """The judge's exception for one the student's code raised: the judge's class of that name
        (the notebook's ``OutOfBlocks``, a builtin), or one made here, with its message."""
        if type(error) is not dict or not all(type(error.get(k)) is str for k in ("type", "message", "where")) \
                or not error["type"].isidentifier() or type(error.get("bases", [])) is not list:
            raise Garbled("an error that is not one")
        bases = [b for b in error.get("bases", []) if type(b) is str and b.isidentifier()]
        cls = self.exception_class(error["type"], bases)
        exc = cls.__new__(cls)
        args = decode(error["args"], values, self._remote) if "args" in error else None
        plain = type(args) in (list, tuple) and all(type(a) in SCALARS for a in args)
        exc.args = tuple(args) if plain else (error["message"],)  # never an object whose __str__ is asked later
        if not issubclass(cls, Exception):  # the timeout: the cell's limit, in the judge's words
            exc.args = (f"ran for more than {self.limit:g} s",)
        for name, node in _names(error.get("attrs", {}) if type(error.get("attrs")) is dict else {}):
            value = decode(node, values, self._remote)
            if not hasattr(cls, name) and type(value) in SCALARS:  # the student's own (``needed``): plain, never a method
                setattr(exc, name, value)
        exc.grade_where = error["where"][:300]
        return exc


def _names(attrs: dict):
    for name, node in attrs.items():
        if name.isidentifier() and not name.startswith("__"):
            yield name, node


class _Lender(pickle.Pickler):
    """Pickles the judge's values for the submission's process: proxies as handles, functions
    as callbacks, a dict's views as lists."""

    def __init__(self, file, peer: Peer):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.peer = peer

    def persistent_id(self, obj):
        if type(obj) is Remote:
            return ("h", obj._Remote__h)
        if type(obj) is Method:
            return ("m", obj.owner._Remote__h, obj.name)
        if type(obj) is types.MethodType or type(obj) is types.FunctionType and not _importable(obj):
            return ("cb", self.peer.callback(obj))
        return None  # pickled as usual (a library function by its name, as torch's tensors rebuild)

    def reducer_override(self, obj):
        if type(obj) in VIEWS:
            return list, (list(obj),)
        return NotImplemented


def _library_class(name: list[str]) -> type | None:
    """The judge's class of the library named (module, qualified name), if the judge has imported
    it (nothing is imported for the submission) and the library defines it there: no class it
    only imports, and no path through dunder attributes (``KVCacheManager.__class__``)."""
    module, qualname = name
    obj = sys.modules.get(module) if module.startswith("pagedlab.") else None
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if not part.startswith("__") else None
    return obj if isinstance(obj, type) and obj.__module__ == module and obj.__qualname__ == qualname else None


def _importable(fn) -> bool:
    """Whether the submission's process finds ``fn`` by its module and name (a library's function;
    not a lambda, nor a function of a check cell or a hidden check)."""
    obj = sys.modules.get(fn.__module__) if fn.__module__ != "__main__" else None
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _refresh(proxy: Remote, snap, attrs: dict | None) -> None:
    """Record what the submission just said of ``proxy``: its snapshot, or attributes."""
    peer = proxy._Remote__peer
    if proxy._Remote__epoch != peer.epoch:
        object.__setattr__(proxy, "_Remote__epoch", peer.epoch)
        object.__setattr__(proxy, "_Remote__snap", MISSING)
        proxy._Remote__attrs.clear()
    if snap is not None:
        object.__setattr__(proxy, "_Remote__snap", snap)
    if attrs:
        proxy._Remote__attrs.update(attrs)


def _snapshot(proxy: Remote):
    """A container proxy's contents as they are now (asked for again only if stale)."""
    if proxy._Remote__epoch != proxy._Remote__peer.epoch or proxy._Remote__snap is MISSING:
        proxy._Remote__peer.ask("snapshot", proxy._Remote__h, mutates=False)
    return proxy._Remote__snap


def _plain(value):
    """``value``, or a container proxy's snapshot (for comparing and arithmetic)."""
    return _snapshot(value) if type(value) is Remote and value._Remote__kind != "object" else value


class Method:
    """A method of a student's object, run there when called."""

    __slots__ = ("owner", "name")

    def __init__(self, owner: Remote, name: str):
        self.owner, self.name = owner, name

    def __call__(self, *args, **kwargs):
        return self.owner._Remote__peer.ask("callmethod", self.owner._Remote__h, self.name, (args, kwargs))

    def __repr__(self):
        return f"<method {self.name} of {self.owner._Remote__type}>"


class Remote:
    """One of the student's objects. A container (list, dict, set, deque) reads from its snapshot
    and sends each change; any other object sends every attribute read, call and change."""

    __slots__ = ("__peer", "__h", "__kind", "__type", "__library", "__epoch", "__snap", "__attrs", "__methods",
                 "__weakref__")

    def __init__(self, peer: Peer, h: int, kind: str, type_name: str, library: type | None = None):
        for name, value in (("peer", peer), ("h", h), ("kind", kind), ("type", type_name), ("library", library),
                            ("epoch", -1), ("snap", MISSING), ("attrs", {}), ("methods", set())):
            object.__setattr__(self, f"_Remote__{name}", value)

    @property
    def __class__(self):
        """The library's class the student's class derives from, if any (a ``Policy``): what the
        library's own checks of its arguments ask (``isinstance(policy, Policy)``); the judge's
        own checks ask ``type()``, which is always Remote."""
        return self.__library or Remote

    def __del__(self):
        try:
            if self.__peer.proxies.get(self.__h) is None:
                self.__peer.released.append(self.__h)
                self.__peer.reads.pop(self.__h, None)
        except Exception:  # noqa: BLE001 - the judge is exiting
            pass

    def __mro_entries__(self, bases):
        raise TypeError(f"the student's {self.__type} lives in the submission's process: a check cannot subclass it")

    # -- attributes and calls --------------------------------------------------------------------

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__") or name.startswith("_Remote__"):
            raise AttributeError(name)  # Python's and libraries' probes (__array__, ...) stay here
        if self.__kind != "object":
            if name in READS[self.__kind]:
                return getattr(_snapshot(self), name)
            return Method(self, name)
        if name in self.__methods:
            return Method(self, name)
        self.__peer.reads[self.__h] = self.__peer.epoch
        if self.__epoch == self.__peer.epoch and name in self.__attrs:
            return self.__attrs[name]
        peer = self.__peer
        peer.reads = {h: when for h, when in peer.reads.items() if when >= peer.epoch - 2}
        also = [h for h in peer.reads if h != self.__h][-32:]
        value = peer.ask("getattr", self.__h, name, mutates=False, also=also)
        if value is METHOD:
            self.__methods.add(name)
            return Method(self, name)
        _refresh(self, None, {name: value})
        return value

    def __setattr__(self, name: str, value):
        self.__peer.ask("setattr", self.__h, name, value)

    def __delattr__(self, name: str):
        self.__peer.ask("delattr", self.__h, name)

    def __call__(self, *args, **kwargs):
        return self.__peer.ask("call", self.__h, None, (args, kwargs))

    # -- the container protocol ------------------------------------------------------------------

    def __len__(self):
        return len(_snapshot(self)) if self.__kind != "object" else self.__peer.ask("len", self.__h, mutates=False)

    def __iter__(self):
        return iter(_snapshot(self) if self.__kind != "object" else self.__peer.ask("iter", self.__h, mutates=False))

    def __reversed__(self):
        return reversed(_snapshot(self) if self.__kind != "object" else self.__peer.ask("iter", self.__h, mutates=False))

    def __contains__(self, item):
        if self.__kind != "object":
            return item in _snapshot(self)
        return self.__peer.ask("contains", self.__h, None, item, mutates=False)

    def __getitem__(self, key):
        if self.__kind != "object" and (self.__type != "defaultdict" or key in _snapshot(self)):
            return _snapshot(self)[key]
        return self.__peer.ask("getitem", self.__h, None, key, mutates=self.__type == "defaultdict")

    def __setitem__(self, key, value):
        self.__peer.ask("setitem", self.__h, None, (key, value))

    def __delitem__(self, key):
        self.__peer.ask("delitem", self.__h, None, key)

    def __bool__(self):
        return bool(_snapshot(self)) if self.__kind != "object" else self.__peer.ask("bool", self.__h, mutates=False)

    def __iadd__(self, other):
        return self.__peer.ask("inplace", self.__h, "+=", other)

    def __ior__(self, other):
        return self.__peer.ask("inplace", self.__h, "|=", other)

    def __isub__(self, other):
        return self.__peer.ask("inplace", self.__h, "-=", other)

    # -- text ------------------------------------------------------------------------------------

    def __repr__(self):
        return repr(_snapshot(self)) if self.__kind != "object" else self.__text("repr")

    def __str__(self):
        return str(_snapshot(self)) if self.__kind != "object" else self.__text("str")

    def __format__(self, spec: str):
        if self.__kind != "object":
            return format(_snapshot(self), spec)
        return self.__text("str") if not spec else self.__peer.ask("format", self.__h, spec, mutates=False)

    def __text(self, op: str) -> str:
        text = self.__peer.ask(op, self.__h, mutates=False)
        if type(text) is not str:
            raise Garbled(f"{op} of a {self.__type} that is not a string")
        return text

    # -- comparisons, from plain data alone ------------------------------------------------------

    def __eq__(self, other):
        if self.__kind == "object":
            return other is self
        return _snapshot(self) == _plain(other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        if self.__kind != "object":
            raise TypeError(f"unhashable type: '{self.__type}'")
        return hash((id(self.__peer), self.__h))

    def __lt__(self, other):
        return _snapshot(self) < _plain(other) if self.__kind != "object" else NotImplemented

    def __le__(self, other):
        return _snapshot(self) <= _plain(other) if self.__kind != "object" else NotImplemented

    def __gt__(self, other):
        return _snapshot(self) > _plain(other) if self.__kind != "object" else NotImplemented

    def __ge__(self, other):
        return _snapshot(self) >= _plain(other) if self.__kind != "object" else NotImplemented

    def __add__(self, other):
        return _snapshot(self) + _plain(other) if self.__kind != "object" else NotImplemented

    def __radd__(self, other):
        return _plain(other) + _snapshot(self) if self.__kind != "object" else NotImplemented

    def __mul__(self, other):
        return _snapshot(self) * other if self.__kind != "object" else NotImplemented

    __rmul__ = __mul__

    def __copy__(self):
        return copy.copy(_snapshot(self)) if self.__kind != "object" else self

    def __deepcopy__(self, memo):
        return copy.deepcopy(_snapshot(self), memo) if self.__kind != "object" else self


METHOD = object()  # what a getattr's answer decodes to when the attribute is a method of the object


def is_remote(value) -> bool:
    return type(value) is Remote


def kind_of(value: Remote) -> tuple[str, str]:
    """(kind, class name) of a proxy."""
    return value._Remote__kind, value._Remote__type


def snapshot(value: Remote):
    return _snapshot(value)
