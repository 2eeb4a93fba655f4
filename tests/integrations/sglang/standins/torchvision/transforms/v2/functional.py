"""``torchvision.transforms.v2.functional`` of the stand-in package (see ``torchvision``'s docstring)."""

from torchvision._inert import InterpolationMode, module_getattr

__all__ = ["InterpolationMode"]

__getattr__ = module_getattr(__name__)
