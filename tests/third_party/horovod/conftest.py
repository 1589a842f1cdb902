# Horovod's vendored tests import horovod.torch and need a launcher: the project's pytest must not collect
# them (tests/workers/hvd_upstream_runner.py runs them against osp.horovod under torchrun).
collect_ignore_glob = ["test/*"]
