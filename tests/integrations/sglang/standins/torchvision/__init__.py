"""Stand-in for ``torchvision`` in kvoffload's SGLang test environment (``.venv/sglang``).

Why: the registry's torchvision 0.28.0 is a CUDA build and fails to import under the CPU
torch 2.13.0 that environment runs (``operator torchvision::nms does not exist``), yet
SGLang 0.5.23 imports ``torchvision.transforms`` (its config and multimodal modules,
through ``sglang.srt.entrypoints.engine``) and transformers 5.19 reaches for
``torchvision.io`` and ``torchvision.transforms.v2``. The tiny text models the tests serve
never process an image, so this package only has to import.

What: the two enums code reads at import time (``transforms.InterpolationMode``,
``io.ImageReadMode``), the submodules ``transforms`` (with ``functional``),
``transforms.v2`` (with ``functional``) and ``io``; every other name is an inert
placeholder class that fails only when instantiated (``torchvision._inert``). A
``unittest.mock.MagicMock`` is not enough: transformers registers real classes keyed on
these names and compares them.

Only ``tests/integrations/sglang/conftest.py`` (and ``engine.py`` for the engine's child
processes) puts this folder on the path; no dist-info is installed, so libraries that ask
``importlib.metadata`` whether torchvision is installed are told it is not.
"""

from torchvision import io, transforms  # noqa: F401
from torchvision._inert import module_getattr

__version__ = "0.0.0+kvoffload.standin"

__getattr__ = module_getattr(__name__)
