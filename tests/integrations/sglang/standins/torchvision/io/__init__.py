"""``torchvision.io`` of the stand-in package (see ``torchvision``'s docstring)."""

from torchvision._inert import ImageReadMode, module_getattr

__all__ = ["ImageReadMode"]

__getattr__ = module_getattr(__name__)
