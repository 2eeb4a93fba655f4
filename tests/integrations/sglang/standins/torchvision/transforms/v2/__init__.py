"""``torchvision.transforms.v2`` of the stand-in package (see ``torchvision``'s docstring)."""

from torchvision._inert import InterpolationMode, module_getattr
from torchvision.transforms.v2 import functional  # noqa: F401

__all__ = ["InterpolationMode"]

__getattr__ = module_getattr(__name__)
