"""Run a script (``threads_at_exit.py SCRIPT ARGS...``) as ``__main__``, then report which threads it left
alive: an atexit hook registered before the script's own (so it runs after them, osp's exit hook included)
writes the JSON list of its thread names to ``$THREADS_AT_EXIT_DIR/<RANK>.json``. Gloo's worker threads alive
then are the ones that can abort the interpreter's shutdown (docs/faults.md, Exiting)."""
import atexit
import json
import os
import runpy
import sys


def thread_names() -> list:
    """This process's threads, by the names the kernel has for them (Gloo's: gloo_tcp_loop, pt_gloo_runloop)."""
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def report():
    with open(os.path.join(os.environ["THREADS_AT_EXIT_DIR"], os.environ.get("RANK", "0") + ".json"), "w") as fh:
        json.dump(thread_names(), fh)


if __name__ == "__main__":
    atexit.register(report)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
