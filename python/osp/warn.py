"""Warnings attributed to the user's line: the first frame outside osp and outside the torch modules that
call into it (``torch.optim``'s step wrapper, ``torch.amp``'s GradScaler, ``torch.nn``, autograd, Lightning),
so ``-W error`` filters and the printed location name the call in the training script."""
from __future__ import annotations

import os
import sys
import warnings

_OSP = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBS = tuple(os.sep + os.path.join(*p) + os.sep for p in
              (("torch", "optim"), ("torch", "amp"), ("torch", "nn"), ("torch", "autograd"), ("torch", "utils"),
               ("torch", "_dynamo"), ("torch", "cuda", "amp"), ("lightning",), ("pytorch_lightning",)))


_EXAMPLE = _OSP + "train.py"  # the example job (python -m osp.train) is the user's script there


def _outside(filename: str) -> bool:
    if filename == _EXAMPLE:
        return True
    return not (filename.startswith(_OSP) or any(lib in filename for lib in _LIBS)
                or filename.endswith(os.sep + os.path.join("torch", "_tensor.py")))


def warn(message: str, category: type = RuntimeWarning) -> None:
    """``warnings.warn`` at the user's line (see the module docstring)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and not _outside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    if frame is None:  # no user frame (e.g. from osp's own tools): where the warning was raised
        level = 1
    warnings.warn(message, category, stacklevel=level + 1)
