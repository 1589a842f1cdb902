"""examples/accelerate_digits.py, the documented way to train with osp under Hugging Face Accelerate, on 2 CPU ranks
under torchrun: the model is not wrapped in DDP, replicas end bitwise equal, BSP ends equal to Accelerate's own DDP
path with the plain optimizer (accumulation, clipping, a scheduler, save_state each epoch), and OSP trains."""
import json
import os

import pytest
import torch

import launch

EXAMPLE = os.path.join(os.path.dirname(launch.HERE), "examples", "accelerate_digits.py")
THREADS_AT_EXIT = os.path.join(launch.HERE, "workers", "threads_at_exit.py")


def _run(tmp_path, sync: str, epochs: int) -> dict:
    out, params, threads = tmp_path / f"{sync}.json", tmp_path / f"{sync}.pt", tmp_path / f"threads-{sync}"
    threads.mkdir()
    proc = launch.run_cmd(launch.torchrun_cmd(2, [THREADS_AT_EXIT, EXAMPLE, "--sync", sync, "--epochs", str(epochs),
                                                  "--json", str(out), "--save-params", str(params),
                                                  "--checkpoint-dir", str(tmp_path / f"ckpt-{sync}")]),
                          timeout=240, env={"ACCELERATE_USE_CPU": "1", "THREADS_AT_EXIT_DIR": str(threads)})
    launch.check(proc)
    # every rank's threads once its script and every exit hook are done: Gloo's threads still alive then can abort
    # the interpreter's shutdown (SIGABRT after the work was done), so none may be left (CI saw it on the DDP path)
    left = [json.loads((threads / f"{r}.json").read_text()) for r in range(2)]
    assert all(len(names) == 1 for names in left), (sync, left)
    result = json.loads(out.read_text())
    result["params"] = torch.load(params)
    return result


@pytest.mark.multiproc
@pytest.mark.jobs
def test_accelerate_example_trains_exactly(tmp_path):
    ddp, bsp = _run(tmp_path, "ddp", 2), _run(tmp_path, "bsp", 2)
    assert ddp["model_wrapped"] == "DistributedDataParallel" and bsp["model_wrapped"] != "DistributedDataParallel"
    assert (bsp["params"] - ddp["params"]).abs().max().item() < 1e-5
    assert bsp["steps"] == 2 * 10 and bsp["replicas_bitwise"] and not bsp["in_flight"]
    osp_ = _run(tmp_path, "osp-0.25", 6)
    assert osp_["replicas_bitwise"] and not osp_["in_flight"] and osp_["model_wrapped"] == "Sequential"
    assert osp_["steps"] == 6 * 10 and osp_["lr"] == 0.1 * 0.5 ** 2, osp_  # StepLR(50) stepped at every step
    assert osp_["accuracy"] > 0.9 and osp_["tested"] == 540, osp_
