import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

if os.environ.get("OSP_HIDE_HOROVOD") == "1":  # as if Horovod were not installed (make test-without-horovod)
    import nohorovod.sitecustomize  # noqa: F401,E402


def horovod_installed() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def one_rank():
    """A one-rank torch.distributed group in this process (in-memory store)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
