"""Values out of the submission's process: ``Encoder`` there turns them into JSON nodes and raw
bytes, ``decode`` in the judge turns those back, trusting nothing (issue 46, item 1).

What comes out is plain data (None, bools, numbers, strings, bytes, tuples, lists, dicts, sets),
tensors and numeric numpy arrays by value (dtype, shape and raw bytes), and, for anything else, a
reference (a handle number, with the object's kind, class name and the library's classes it
derives from) that the judge turns into a proxy (``pagedlab_course.grade.proxy``). A call's result is copied whole; a name, attribute or
item that holds a mutable container (``pool.refs``) comes as a reference with a snapshot of it,
so that the judge reads it without asking again and writes to the student's own list
(``pool.refs[1] += 1``). A reference to an object carries a snapshot of its attributes, two
levels deep, within a budget: a step's requests and their ids come in one answer.

The decoder accepts exactly these shapes, of the sizes the frame allows, and builds nothing but
the judge's own plain values, tensors, arrays and proxies: no pickle, no class named by the
submission is ever looked up.
"""

from __future__ import annotations

import sys
import types
from collections import Counter, OrderedDict, defaultdict, deque

SCALARS = (type(None), bool, int, float, str)
# Mutable containers sent as references with a snapshot, by the kind the judge rebuilds them as.
MUTABLE = {list: "list", dict: "dict", defaultdict: "dict", set: "set", deque: "deque", OrderedDict: "OrderedDict",
           Counter: "Counter"}
KINDS = {"list": list, "dict": dict, "set": set, "deque": deque, "OrderedDict": OrderedDict, "Counter": Counter,
         "object": None}
VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128")


class Garbled(Exception):
    """The submission's process sent something that is not a value."""


class Encoder:
    """Encodes values in the submission's process. ``export(obj)`` gives an object's handle;
    ``budget`` bounds the nodes spent on snapshots (never on a call's result, which is whole)."""

    def __init__(self, export, budget: int = 3000):
        self.export, self.budget, self.blobs = export, budget, []
        self.shown: set[int] = set()  # objects whose snapshot or attributes this answer already holds

    def value(self, obj, live: bool = False, depth: int = 2):
        kind = type(obj)
        if kind in SCALARS:
            return obj
        if kind in (bytes, bytearray):
            return {"t": "bytes", "b": self._blob(bytes(obj))}
        if kind in (tuple, frozenset):
            return {"t": kind.__name__, "v": [self.value(v, live, depth) for v in obj]}
        if kind in MUTABLE:
            if not live:
                return self._contents(obj, MUTABLE[kind], False, depth)
            ref = self.ref(obj, MUTABLE[kind])
            self.budget -= 1
            if self.budget > 0 and id(obj) not in self.shown:
                self.shown.add(id(obj))
                ref["snap"] = self._contents(obj, MUTABLE[kind], True, depth)
            return ref
        if kind in VIEWS:
            return {"t": "list", "v": [self.value(v, live, depth) for v in obj]}
        torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
        if torch is not None and isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().contiguous().reshape(-1)
            return {"t": "tensor", "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape),
                    "device": obj.device.type, "b": self._blob(flat.view(torch.uint8).numpy().tobytes())}
        if numpy is not None and isinstance(obj, numpy.generic) and obj.dtype.kind in "biufc":
            return self.value(obj.item(), live, depth)
        if numpy is not None and type(obj) is numpy.ndarray and obj.dtype.kind in "biufc":
            return {"t": "array", "dtype": obj.dtype.str, "shape": list(obj.shape),
                    "b": self._blob(numpy.ascontiguousarray(obj).tobytes())}
        ref = self.ref(obj, "object")
        library = [[c.__module__, c.__qualname__] for c in type(obj).__mro__ if c.__module__.startswith("pagedlab.")]
        if library:
            ref["library"] = library[:10]
        attrs = getattr(obj, "__dict__", None)
        if depth > 0 and self.budget > 0 and type(attrs) is dict and not isinstance(obj, types.ModuleType):
            ref["attrs"] = self.attrs(obj, depth - 1)
        return ref

    def attrs(self, obj, depth: int = 1) -> dict:
        """The object's own attributes as the judge would read them (none a data descriptor of its
        class shadows), each as a live value; {} if this answer holds them already."""
        if id(obj) in self.shown:
            return {}
        self.shown.add(id(obj))
        found = {}
        for name, value in list(vars(obj).items()):
            if type(name) is str and not data_descriptor(type(obj), name) and self.budget > 0:
                self.budget -= 1
                found[name] = self.value(value, True, depth)
        return found

    def ref(self, obj, kind: str) -> dict:
        return {"t": "ref", "h": self.export(obj), "kind": kind, "type": type(obj).__qualname__[:200]}

    def _contents(self, obj, kind: str, live: bool, depth: int):
        if kind in ("dict", "OrderedDict", "Counter"):
            return {"t": "dict", "v": [[self.value(k, live, depth), self.value(v, live, depth)] for k, v in obj.items()]}
        return {"t": "set" if kind == "set" else "list", "v": [self.value(v, live, depth) for v in obj]}

    def _blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1


def data_descriptor(cls, name: str) -> bool:
    """Whether ``cls`` has a property (or other data descriptor) ``name``, which an instance's own
    attribute of that name cannot shadow."""
    for base in cls.__mro__:
        if name in vars(base):
            attr = vars(base)[name]
            return hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__")
    return False


def blobs(header: dict, payload: bytes) -> list[bytes]:
    """The raw byte strings a frame carries, cut at the lengths its header gives."""
    sizes = header.get("blobs", [])
    if type(sizes) is not list or not all(type(n) is int and n >= 0 for n in sizes) or sum(sizes) != len(payload):
        raise Garbled("blob lengths that do not add up to the payload")
    out, at = [], 0
    for n in sizes:
        out.append(payload[at:at + n])
        at += n
    return out


def decode(node, blobs: list[bytes], remote):
    """The judge's value for ``node``. ``remote(handle, kind, type_name, snapshot, attributes,
    library)`` gives the proxy of a referenced object (snapshot and attributes None when not sent;
    library: the (module, name) of each of the library's classes its class derives from)."""
    try:
        return _Decoder(blobs, remote).value(node)
    except RecursionError:
        raise Garbled("a value nested too deeply") from None


class _Decoder:
    def __init__(self, blobs, remote):
        self.blobs, self.remote = blobs, remote

    def value(self, node):
        if type(node) in SCALARS:
            return node
        if type(node) is not dict or type(node.get("t")) is not str:
            raise Garbled(f"not a value node: {str(node)[:100]}")
        tag = node["t"]
        if tag in ("list", "tuple", "set", "frozenset"):
            items = [self.value(v) for v in self._fields(node, {"v": list})["v"]]
            return {"list": list, "tuple": tuple, "set": self._hashable(set), "frozenset": self._hashable(frozenset)}[tag](items)
        if tag == "dict":
            pairs = self._fields(node, {"v": list})["v"]
            if not all(type(p) is list and len(p) == 2 for p in pairs):
                raise Garbled("a dict whose items are not pairs")
            return self._hashable(dict)([(self.value(k), self.value(v)) for k, v in pairs])
        if tag == "bytes":
            return self._blob(self._fields(node, {"b": int})["b"])
        if tag == "tensor":
            return self._tensor(self._fields(node, {"dtype": str, "shape": list, "device": str, "b": int}))
        if tag == "array":
            return self._array(self._fields(node, {"dtype": str, "shape": list, "b": int}))
        if tag == "ref":
            fields = self._fields(node, {"h": int, "kind": str, "type": str}, {"snap": dict, "attrs": dict, "library": list})
            if fields["kind"] not in KINDS or fields["h"] < 0 or len(fields["type"]) > 200:
                raise Garbled(f"a reference of an unknown kind: {fields['kind'][:50]!r}")
            snap = self._snapshot(fields["kind"], fields["snap"]) if "snap" in fields else None
            attrs = {name: self.value(v) for name, v in self._names(fields["attrs"])} if "attrs" in fields else None
            library = fields.get("library", [])
            if not all(type(c) is list and len(c) == 2 and all(type(n) is str for n in c) for c in library):
                raise Garbled("library classes that are not (module, name) pairs")
            return self.remote(fields["h"], fields["kind"], fields["type"], snap, attrs, library)
        raise Garbled(f"a value of an unknown kind: {tag[:50]!r}")

    def _snapshot(self, kind: str, node: dict):
        value = self.value(node)
        if kind == "object" or not isinstance(value, dict if kind in ("dict", "OrderedDict", "Counter") else (list, set)):
            raise Garbled(f"a snapshot that is not a {kind}")
        return KINDS[kind](value)

    def _names(self, attrs: dict):
        for name, v in attrs.items():
            if not name.isidentifier() or name.startswith("__"):
                raise Garbled(f"an attribute name that is not one: {name[:50]!r}")
            yield name, v

    @staticmethod
    def _fields(node: dict, required: dict, optional: dict = {}) -> dict:
        extra = set(node) - {"t"} - set(required) - set(optional)
        if extra or not all(type(node.get(k)) is t for k, t in required.items()) or \
                not all(type(node[k]) is t for k, t in optional.items() if k in node):
            raise Garbled(f"a {node['t']} node with the wrong fields: {sorted(node)[:10]}")
        return node

    @staticmethod
    def _hashable(make):
        def build(items):
            try:
                return make(items)
            except TypeError as err:  # an unhashable key or element
                raise Garbled(str(err)) from None
        return build

    def _blob(self, index: int) -> bytes:
        if not 0 <= index < len(self.blobs):
            raise Garbled("a reference to bytes that were not sent")
        return self.blobs[index]

    def _shape(self, shape: list, itemsize: int, data: bytes) -> tuple:
        if len(shape) > 16 or not all(type(n) is int and 0 <= n < 1 << 31 for n in shape):
            raise Garbled(f"a shape that is not one: {shape[:17]}")
        count = 1
        for n in shape:
            count *= n
        if count * itemsize != len(data):
            raise Garbled(f"{len(data)} bytes for a shape {shape} of {itemsize}-byte items")
        return tuple(shape)

    def _tensor(self, node: dict):
        import torch

        if node["dtype"] not in DTYPES or node["device"] not in ("cpu", "cuda"):
            raise Garbled(f"a tensor of dtype {node['dtype'][:30]!r} on {node['device'][:30]!r}")
        dtype, data = getattr(torch, node["dtype"]), self._blob(node["b"])
        shape = self._shape(node["shape"], torch.empty((), dtype=dtype).element_size(), data)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
        tensor = flat.reshape(shape)
        return tensor.cuda() if node["device"] == "cuda" and torch.cuda.is_available() else tensor

    def _array(self, node: dict):
        import numpy

        try:
            dtype = numpy.dtype(node["dtype"])
        except (TypeError, ValueError):
            raise Garbled(f"an array of dtype {node['dtype'][:30]!r}") from None
        if dtype.kind not in "biufc":
            raise Garbled(f"an array of dtype {node['dtype'][:30]!r}")
        data = self._blob(node["b"])
        return numpy.frombuffer(data, dtype=dtype).reshape(self._shape(node["shape"], dtype.itemsize, data)).copy()
