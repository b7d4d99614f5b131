"""The judge's end of the channel (pagedlab_course.grade.proxy, copyout) given answers a
submission's process could forge: each is refused as not a value (``Garbled``, which fails the
check that asked, naming it) or taken as plain data, and never makes the judge ask the student's
code for more. Found reviewing the channel (issue 46, item 1); each test was seen failing first."""

import pytest

from pagedlab_course.grade.copyout import Garbled
from pagedlab_course.grade.proxy import Peer


class Forger:
    """A channel whose every answer is the next of ``answers``; records what the judge asked."""

    def __init__(self, *answers):
        self.answers, self.asked, self.serve = list(answers), [], None

    def request(self, header, payload=b""):
        self.asked.append(header["op"])
        return self.answers.pop(0), b""


def peer(*answers) -> tuple[Peer, Forger]:
    channel = Forger(*answers)
    return Peer(channel, lambda name, bases: type(name, (Exception,), {})), channel


def ref(h: int, **fields) -> dict:
    return {"t": "ref", "h": h, "kind": "object", "type": "Allocator", **fields}


def test_an_errors_arguments_are_plain_data_never_an_object_to_ask_again():
    """An error whose arguments held a reference: the judge's message for it (``str(exc)``, made
    after the cell's alarm is off) asked the submission's process for the object's ``__str__``,
    with no time limit."""
    judge, channel = peer({"error": {"type": "ValueError", "message": "m", "where": "", "args": {"t": "tuple", "v": [ref(7)]}}},
                          {"value": "what the student's __str__ says"})
    with pytest.raises(Exception) as raised:
        judge.ask("call", 1, None, ((), {}))
    str(raised.value)
    assert channel.asked == ["call"] and raised.value.args == ("m",)


def test_a_proxy_claims_no_class_but_one_the_library_defines():
    """A reference names the library's classes its object derives from (what ``isinstance`` of the
    library's own checks asks); any attribute path from a library module was taken, so a student's
    object could pass for ``type`` itself or for a class the library only imports."""
    from pagedlab.memory import KVCacheManager

    judge, _ = peer({"value": ref(1, library=[["pagedlab.memory", "KVCacheManager.__class__"]])},
                    {"value": ref(2, library=[[KVCacheManager.__module__, "KVCacheManager"]])})
    forged, honest = judge.ask("call", 0, None, ((), {})), judge.ask("call", 0, None, ((), {}))
    assert not isinstance(forged, type) and isinstance(honest, KVCacheManager)


def test_a_refresh_of_other_objects_keyed_by_what_is_not_a_handle_is_not_a_value():
    """A getattr's answer refreshes other objects by handle, a string of digits; '²' is a digit
    to ``str.isdigit`` and not to ``int``: a ValueError, not a refusal."""
    judge, _ = peer({"value": 1, "others": {"²": {}}})
    with pytest.raises(Garbled):
        judge.ask("getattr", 0, "x", mutates=False)


@pytest.mark.parametrize("node", [
    {"t": "tensor", "dtype": "float32", "shape": [0, 1 << 62], "device": "cpu", "b": 0},
    {"t": "array", "dtype": "<f4", "shape": [0, 1 << 62], "b": 0},
])
def test_a_shape_no_tensor_can_have_is_not_a_value(node):
    """An empty tensor or array of an impossible shape (its bytes add up: zero): numpy raised
    ValueError, not a refusal, and torch made a tensor of 2**62 columns."""
    judge, _ = peer({"value": node, "blobs": [0]})
    with pytest.raises(Garbled):
        judge.ask("call", 0, None, ((), {}))


def test_an_errors_attributes_are_plain_data_never_an_object_to_ask_again():
    """The same through an attribute the judge's own class formats (A2's OutOfBlocks says how many
    blocks were `needed`): a reference there was asked for its `__format__` after the alarm."""
    class OutOfBlocks(Exception):
        def __str__(self):
            return f"needed {self.needed}"

    channel = Forger({"error": {"type": "OutOfBlocks", "message": "m", "where": "", "attrs": {"needed": ref(7)}}},
                     {"value": "what the student's __format__ says"})
    judge = Peer(channel, lambda name, bases: OutOfBlocks)
    with pytest.raises(OutOfBlocks) as raised:
        judge.ask("call", 1, None, ((), {}))
    with pytest.raises(AttributeError):
        str(raised.value)
    assert channel.asked == ["call"]
