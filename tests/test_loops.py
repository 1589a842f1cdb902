"""Training loops as users write them, on 2 real ranks with both engines and every mode: clipping,
GradScaler (an overflow on one rank only), freezing after wrapping, a GAN with two optimizers,
in-place parameter edits, BatchNorm buffers and changes to the model after wrapping. Each pattern
is compared with plain torch.optim on the rank-averaged gradient and replicas must be bitwise equal
(tests/workers/loops_worker.py)."""
import os

import pytest

import launch

WORKER = os.path.join(launch.HERE, "workers", "loops_worker.py")
COMMON = ["clip/equals_clip_of_average", "clip/replicas_equal", "clip/direct_clip_warned_once"] + [
    f"{s}/{c}" for s in ("scaler", "scaler_unscale_clip")
    for c in ("skips_the_overflow_step_everywhere", "replicas_equal", "scales_equal", "scale_backed_off")] + [
    f"{f}/{c}" for f in ("freeze", "freeze_first_adam", "freeze_first_sgd")
    for c in ("frozen_layer_does_not_move", "equals_torch_optim", "replicas_equal")] + [
    "gan/replicas_equal", "two_opts/equals_torch_optim", "two_opts/replicas_equal",
    "edit/clamp_after_flush_kept_exactly", "edit/replicas_equal",
    "buffers/differ_without_sync", "buffers/eval_equal_after_sync"] + [
    f"after_wrap/{c}" for c in ("double", "half", "assign", "unfrozen", "add_param_group")]
EXPECTED = {
    "bsp": COMMON + ["clip/grad_is_average_after_backward", "gan/equals_bsp_reference",
                     "two_backwards/raises_after_averaging"],
    "osp": COMMON + ["edit/unflushed_refused_data", "edit/unflushed_refused_inplace",
                     "edit/load_state_dict_unflushed_refused", "edit/before_flush_refused",
                     "two_backwards/equals_torch_optim"],
}
EXPECTED["dsync"] = [c for c in EXPECTED["osp"] if c != "clip/direct_clip_warned_once"] + [
    "clip/direct_clip_refused_under_dsync", "after_wrap/auto_delay_refuses_scaler"]
EXPECTED["hsp"] = COMMON + ["gan/equals_bsp_reference", "two_backwards/equals_torch_optim"]


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bsp", "osp", "dsync", "hsp"])
@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_training_loops(backend, mode, tmp_path):
    launcher = "horovod" if backend == "horovod" else "spawn"
    proc = launch.run(launcher, 2, [WORKER, mode, backend, str(tmp_path)], timeout=300)
    launch.check(proc)
    for r in launch.rank_results(tmp_path, 2, proc):
        assert sorted(r["checks"]) == sorted(EXPECTED[mode])
