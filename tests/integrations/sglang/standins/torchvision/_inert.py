"""The inert parts of the ``torchvision`` stand-in (see the package's docstring).

Every name the stand-in does not define is a placeholder *class* made on first access:
modules can import it, subclass it, use it as a default or in ``isinstance`` checks, and
only calling it (making an instance) fails, with a message naming it. Dunder names are
left undefined so that ``hasattr``/``getattr`` probes of Python and of libraries behave
as for a module that lacks them.
"""

from __future__ import annotations

import enum
from typing import Any


class InterpolationMode(enum.Enum):
    """``torchvision.transforms.InterpolationMode``'s members and values."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    """``torchvision.io.ImageReadMode``'s members and values."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


class _Unavailable:
    _qualified = "torchvision"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self._qualified} is a stand-in in kvoffload's SGLang test environment "
            "(tests/integrations/sglang/standins/torchvision): image processing is not available there"
        )


def module_getattr(module_name: str):
    """A module ``__getattr__`` that makes (and remembers) a placeholder class per name."""
    made: dict[str, type] = {}

    def __getattr__(name: str) -> type:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        if name not in made:
            made[name] = type(name, (_Unavailable,), {"_qualified": f"{module_name}.{name}"})
        return made[name]

    return __getattr__
