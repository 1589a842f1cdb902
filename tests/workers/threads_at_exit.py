"""Run a script (``threads_at_exit.py SCRIPT ARGS...``) as ``__main__``, then report which threads it left
alive: an atexit hook registered before the script's own (so it runs after them, osp's exit hook included)
writes the JSON list of its thread names to ``$THREADS_AT_EXIT_DIR/<RANK>.json``. Gloo's worker threads alive
then are the ones that can abort the interpreter's shutdown (docs/faults.md, Exiting)."""
import atexit
import json
import os
import runpy
import sys


def report():
    names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    with open(os.path.join(os.environ["THREADS_AT_EXIT_DIR"], os.environ.get("RANK", "0") + ".json"), "w") as fh:
        json.dump(names, fh)


atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
