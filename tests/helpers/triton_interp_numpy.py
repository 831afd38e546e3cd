"""Imported by the Triton-interpreter helpers (after TRITON_INTERPRET=1 is set): Triton 3.6's interpreter turns a
scalar into an index with int() of its 1-element array, which NumPy 2.3 and newer refuse ("only 0-dimensional arrays
can be converted to Python scalars"), so a loop with a runtime bound (`range(0, end, ...)`) fails there. The patched
interpreter takes the element itself."""

from __future__ import annotations

from triton.runtime import interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _index_of_one_element(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _index_of_one_element
