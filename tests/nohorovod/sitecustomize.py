"""On PYTHONPATH (``OSP_HIDE_HOROVOD=1``: tests/launch.py and tests/conftest.py put it there), every Python process
finds no Horovod, as in an environment where it was never installed: ``import horovod`` raises
ModuleNotFoundError. ``make test-without-horovod`` runs the suite so."""
import sys


class _NoHorovod:
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: OSP_HIDE_HOROVOD=1)", name=name)
        return None


sys.meta_path.insert(0, _NoHorovod())
