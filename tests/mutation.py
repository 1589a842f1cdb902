"""Mutation testing (``make mutation``): how many small, plausible bugs the fast tests catch.

``MUTANTS`` holds hand-written mutants of python/osp: each replaces one exact snippet (it must occur exactly
once in its file, or the mutant is reported *stale*: the table needs updating) and names the fast in-process
tests that should catch it (pytest arguments: node ids, files, ``-k`` expressions). Each mutant is applied
in a fresh temporary copy of python/ and tests/ (the built extension too); the real checkout is never
modified. In the copy, ``pytest -x`` runs the mutant's tests with PYTHONPATH pointing at the copy's
python/ (ahead of the editable install's path entry: checked at start). The mutant is *killed* when they
fail, *survived* when they pass, *timeout* (counted as killed) past ``--timeout`` seconds; *error* when
pytest could not run them (no test selected, a bad node id). Before the mutants the union of all their
tests runs once on the unmutated copy, which must pass (``--no-baseline`` skips it).

    .venv/bin/python tests/mutation.py [--only ID[,ID]] [--list] [--jobs 1] [--json PATH] [--timeout 300]

Exit status 0 when at least 95% of the mutants are killed and none is stale or in error, else 1 (2 when the
harness itself cannot run: the copy does not import, the baseline fails).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THRESHOLD = 95.0
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # under python/osp/
    old: str  # exact snippet, occurring once
    new: str
    tests: str  # pytest arguments (shell syntax, no shell runs them)
    breaks: str


FILES = {"conf": "tests/test_conformance.py", "opt": "tests/test_optimizer.py", "ops": "tests/test_ops.py",
         "hsp": "tests/test_hsp.py", "comp": "tests/test_compression.py", "int": "tests/test_intersections.py",
         "hvd": "tests/test_horovod_parity.py", "arr": "tests/test_arrivals.py", "plan": "tests/test_plan.py",
         "auto": "tests/test_auto.py"}


def T(conf: Optional[str] = None, **more: str) -> str:
    """The fast in-process tests for a mutant: ``conf``, a -k expression over the cases of the one-rank
    conformance oracle (ids ``mode|pattern|optimizer|dtype[|compression|feature]``); ``opt=``, ``ops=``,
    ``hsp=``, ``comp=``, ``int=``, ``hvd=``, ``arr=``, ``plan=``, ``auto=``: -k expressions over the tests of that file
    (``FILES``). One -k expression, each part qualified by its file (pytest takes only the last -k), and
    never a multiproc test. The other files run first: their few tests are the quicker kill (pytest -x
    stops at the first failure). Where only real ranks can show a bug, a mutant names the one multiproc
    test node instead (``TWO_RANKS``)."""
    parts = list(more.items())
    parts += [("conf", f"test_one_rank_equals_torch_optim and ({conf})")] if conf else []
    files = " ".join(FILES[k] for k, _ in parts)
    expr = " or ".join(f"({os.path.basename(FILES[k])} and ({e}))" for k, e in parts)
    return f"{files} -m 'not multiproc and not bench' -k {shlex.quote(expr)}"


#: the selections: the conformance cases of a mode family (every pattern, optimizer and dtype the
#: tables generate for it), and the in-process tests of test_optimizer.py that exercise the same code
OSP_MODES = "osp-0.25 or osp-0.0 or osp-auto-deferring"
DSYNC_MODES = "dsync-1 or dsync-2 or dsync-3"
BSP_MODES = "bsp or osp-1.0"
EVERY_MODE = "bsp or osp-0.25 or dsync-2 or hsp-closure"
OPT_OSP = "one_rank_osp or bucket_ready_last or critical_zero or tensor_lr or step_hooks"
OPT_BSP = "BSP and not cuda"
OPT_ALL = f"{OPT_OSP} or one_rank_dsync or extra_backward or param_groups_changed"
#: the narrowest multiproc node where only real ranks show a bug (op=Sum's factor is the world size, a replica
#: check compares ranks, a compressed average divides by the world size, Lightning's launcher starts ranks)
TWO_RANKS = {
    "sum": "tests/test_intersections.py::test_op_sum_gradient_penalty_on_two_ranks",  # ~10 s
    "replicas": "tests/test_replicas.py::test_replicas_checked_at_runtime"
                "[spawn-torch-bsp,osp-0.25,dsync-2,hsp,hsp-osp]",  # ~10 s
    "compression": "tests/test_compression.py::test_two_ranks_replicas_equal_and_replay[spawn-torch]",  # ~12 s
    "lightning": "tests/test_lightning.py::test_replicas_bitwise_and_the_closure_once_per_step",  # ~60 s
    "join-amp": "tests/test_join.py::test_join_keeps_grad_scalers_in_step",  # ~10 s
    "arrivals": "tests/test_arrivals.py::test_every_mode_names_the_slow_rank",  # ~25 s
    "join-dsync": "tests/test_join.py::test_join_under_dsync_leaves_at_the_same_step",  # ~15 s
    "join-scheduler": "tests/test_join.py::test_uneven_data_joins_cleanly[spawn-torch-3]",  # ~15 s
    "hsp": "tests/test_hsp.py::test_hsp_with_a_straggler[torch-2-bsp]",  # ~15 s
    "osp.horovod": "tests/test_osp_horovod.py::test_horovods_functions_on_torch_distributed[spawn]",  # ~15 s
    "osp.horovod-elastic": "tests/test_osp_horovod.py::test_elastic_resumes_from_the_last_commit_under_torchrun"
                           "[bsp]",  # ~25 s
    "osp.horovod-elastic-osp": "tests/test_osp_horovod.py::test_elastic_resumes_from_the_last_commit_under_torchrun"
                               "[osp]",  # ~25 s
    "elastic": "tests/test_elastic.py::test_elastic_state_commit_restore_and_sync_every_mode",  # ~10 s
}

M = Mutant
MUTANTS: List[Mutant] = [
    # -- modes/osp.py ------------------------------------------------------------------------------
    M("osp-deferred-not-unscaled", "modes/osp.py",
      "            ctx.scale_grads(inp.unscale, deferreds)\n", "            pass\n",
      T(OSP_MODES, opt=OPT_OSP),
      "GradScaler: deferred blocks packed in backward are averaged still scaled"),
    M("osp-critical-not-unscaled", "modes/osp.py",
      "                ctx.scale_grads(inp.unscale, [crit])\n", "                pass\n",
      T(OSP_MODES, opt=OPT_OSP),
      "GradScaler: critical blocks packed in backward are applied still scaled"),
    M("osp-stale-ignored", "modes/osp.py",
      "stale=inp.grads_changed or self._stale(),", "stale=inp.grads_changed,",
      T(OSP_MODES, opt=OPT_OSP),
      "a .grad changed after backward packed it is not packed again (the change is lost)"),
    M("osp-clip-exact-coef-dropped", "modes/osp.py",
      "            self.ctx.clip_(self.clip, [d.full for d in self.pending], [d.absent for d in self.pending])\n",
      "",
      T(OSP_MODES, opt=OPT_OSP),
      "clip_grad_norm_: the exact correction applies the unclipped gradient"),
    M("osp-clip-provisional-dropped", "modes/osp.py",
      "            ctx.clip_(inp.clip, absent=absent)\n", "            pass\n",
      T(OSP_MODES, opt=OPT_OSP),
      "clip_grad_norm_: the provisional step is not clipped (the next forward runs at unclipped weights)"),
    M("osp-absent-stepped", "modes/osp.py",
      "            fg.set_grads(a)\n        unhooked_step(ctx.optimizer)",
      "            fg.set_grads()\n        unhooked_step(ctx.optimizer)",
      T(OSP_MODES, opt=OPT_OSP),
      "parameters without a gradient on any rank are stepped with zeros (torch leaves them alone)"),
    M("osp-edit-mask-swapped", "modes/osp.py",
      "torch.ones_like(m) if self.clip is not None else ~m)",
      "torch.ones_like(m) if self.clip is not None else m)",
      T(OSP_MODES, opt=OPT_OSP),
      "edit probe watches the exact (critical) blocks instead of the pending deferred ones"),
    M("osp-deferred-scores-mask", "modes/osp.py",
      "self.split.score(d.avg, d.snap.fg, ~d.mask, d.lo)", "self.split.score(d.avg, d.snap.fg, d.mask, d.lo)",
      T(OSP_MODES, opt=OPT_OSP),
      "scores of the landed deferred blocks are written to the critical blocks' places"),
    M("osp-last-bucket-floor", "split.py",
      "floor = min(counts[last], math.ceil(self.options.min_critical * sizes[last]))",
      "floor = min(counts[last], math.floor(self.options.min_critical * sizes[last]))",
      T(OSP_MODES, opt=OPT_OSP),
      "the bucket ready last keeps one block fewer than its min_critical floor"),
    # -- modes/dsync.py ----------------------------------------------------------------------------
    M("dsync-unscale-wrong-buckets", "modes/dsync.py",
      "for fg, lo, hi, _ in self.buckets.buckets[:s.scaled]])",
      "for fg, lo, hi, _ in self.buckets.buckets[s.scaled:]])",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "GradScaler: unscales the buckets launched after unscale_ instead of those launched scaled"),
    M("dsync-replay-step-off-by-one", "correction.py",
      "            step = self._step_count(fg) + 1\n", "            step = self._step_count(fg)\n",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "replayed Adam updates use the previous update number (bias correction)"),
    M("dsync-replay-hyper-not-restored", "correction.py",
      "            for g, h in zip(self.optimizer.param_groups, step_hyper):\n                g.update(h)\n",
      "            for g, h in zip(self.optimizer.param_groups, step_hyper):\n                pass\n",
      T(f"({DSYNC_MODES}) and (sgd or adagrad or rmsprop)", opt="one_rank_dsync"),
      "provisional updates are replayed under the current hyper-parameters, not their step's (an LR schedule)"),
    M("corr-carried-step-kept", "correction.py",
      "                    s.step += 1\n", "                    pass\n",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "DSync's carried fused snapshot keeps the number of the update it was corrected with"),
    M("corr-correct-count-kept", "correction.py",
      "                self._set_count(s.fg, s.step)\n", "",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "a fused correction does not write its update number into the state (Adam's next step counts wrong)"),
    M("corr-restore-count-kept", "correction.py",
      "            self._set_count(s.fg, s.step - 1)  # the update number of the state snapshotted\n", "",
      T(DSYNC_MODES),
      "a fused restore (DSync: a skipped average) leaves Adam's update number one ahead"),
    M("dsync-late-overflows-once", "modes/dsync.py",
      "        self._late_overflows = max(0, pending - 1)", "        self._late_overflows = 0",
      T(DSYNC_MODES),
      "two overflows found by one flush() back a GradScaler off once"),
    M("dsync-late-overflows-not-saved", "modes/dsync.py",
      "            self._late_overflows = int(state[\"late_overflows\"])", "            pass",
      T(DSYNC_MODES),
      "an overflow found by flush() is lost across a checkpoint"),
    M("dsync-due-one-late", "modes/dsync.py",
      "if self.t - s.index >= self.delay]", "if self.t - s.index > self.delay]",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "an average is applied a step later than its delay (buffers reused while still needed)"),
    M("dsync-grad-edit-check-per-rank", "modes/dsync.py",
      "if total.any(\"grads_edited\"):", "if total.total(\"grads_edited\") > 1:",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "a .grad edited after backward on one rank only is not refused (silently inexact)"),
    M("dsync-current-hyper", "modes/dsync.py",
      "snap.hyper = s.hyper[fg.group_index]", "snap.hyper = hyper(ctx.optimizer.param_groups[fg.group_index])",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "the exact update uses today's lr, not the lr of the step it corrects"),
    M("dsync-clip-not-on-average", "modes/dsync.py",
      "ctx.clip_(s.clip, avgs, absent)",
      "ctx.clip_(s.clip, absent=absent)",
      T(DSYNC_MODES, opt="one_rank_dsync"),
      "clip_grad_norm_: the clip factor scales .grad instead of the average being applied"),
    # -- modes/bsp.py ------------------------------------------------------------------------------
    M("bsp-absent-stepped", "modes/bsp.py",
      "            fg.set_grads(a)\n", "            fg.set_grads()\n",
      T(BSP_MODES, opt=OPT_BSP),
      "parameters without a gradient on any rank are stepped with zeros"),
    M("bsp-nonfinite-not-skipped", "modes/bsp.py",
      "        if self.ctx.any_nonfinite():\n", "        if False:\n",
      T(BSP_MODES, opt=OPT_BSP),
      "a step with an inf/nan average is applied instead of skipped"),
    M("bsp-missing-buckets-not-forced", "modes/bsp.py",
      "handles = list(self.buckets.launch(force=True))", "handles = list(self.buckets.launch(force=False))",
      T(BSP_MODES, opt=OPT_BSP),
      "a bucket with a missing gradient is never averaged (nor gathered into the flat gradient)"),
    # -- modes/hsp.py ------------------------------------------------------------------------------
    M("hsp-mean-ignores-passes", "modes/hsp.py",
      "factor = torch.full_like(total, float(inp.passes)).div_(total.clamp(min=1.0))",
      "factor = torch.full_like(total, 1.0).div_(total.clamp(min=1.0))",
      T("hsp", hsp="one_rank or closure"),
      "backward_passes_per_step=k: the mean per pass loses BSP's factor k"),
    M("hsp-unscale-dropped", "modes/hsp.py",
      "ctx.scale_grads(factor if inp.unscale is None else factor.mul_(inp.unscale.to(factor.device)))",
      "ctx.scale_grads(factor)",
      T("hsp", hsp="one_rank or closure"),
      "GradScaler: the summed gradient is applied still scaled"),
    M("hsp-clip-max-norm-squared", "modes/hsp.py",
      "ctx.clip_(inp.clip, absent=absent)",
      "ctx.clip_(dataclasses.replace(inp.clip, value=inp.clip.value ** 2), absent=absent)",
      T("hsp", hsp="one_rank or closure"),
      "clip_grad_norm_: clips to the square of max_norm"),
    # -- modes/base.py -----------------------------------------------------------------------------
    M("base-clip-value-range-doubled", "modes/base.py",
      "g.clamp_(min=-clip.value, max=clip.value)", "g.clamp_(min=-2 * clip.value, max=2 * clip.value)",
      T(EVERY_MODE, opt=OPT_ALL),
      "clip_grad_value_: the average is clamped into twice the asked range"),
    M("base-clip-coef-no-clamp", "modes/base.py",
      "coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)", "coef = max_norm / (total + 1e-6)",
      T(EVERY_MODE, opt=OPT_ALL),
      "a restored fused snapshot keeps the update number the provisional step wrote (Adam counts one too many)"),
    M("agreement-absent-offsets", "agreement.py",
      "            lo += len(fg.params)\n        return out",
      "            lo += len(fg.params) - 1\n        return out",
      T(EVERY_MODE, opt=OPT_ALL),
      "presence of the second param group is read one parameter off"),
    M("base-clip-first-group-only", "modes/base.py",
      "        for g in grads:\n            g.mul_(coef.to(g.device))",
      "        for g in grads[:1]:\n            g.mul_(coef.to(g.device))",
      T(EVERY_MODE, opt=OPT_ALL),
      "clipping scales the first flat group only (several param groups keep their unclipped gradients)"),
    M("base-share-excludes-zero", "modes/base.py",
      "not 0.0 <= float(value) <= 1.0", "not 0.0 < float(value) <= 1.0",
      T(EVERY_MODE, opt=f"invalid_osp_options or {OPT_ALL}"),
      "check_share rejects 0 (OSP's default min_critical)"),
    # -- correction.py -----------------------------------------------------------------------------
    M("corr-sgd-into-maximize-dropped", "correction.py",
      'maximize=h.get("maximize", False), first=bool(momentum) and snap_mom is None',
      "maximize=False, first=bool(momentum) and snap_mom is None",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "the fused SGD correction ignores maximize"),
    M("corr-snapshot-step-number", "correction.py",
      "        s.step = self._step_count(fg) + 1\n", "        s.step = self._step_count(fg)\n",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "the corrected Adam update gets the previous update number"),
    M("corr-others-not-hidden", "correction.py",
      "        for p in self.params:\n            p.grad = None\n", "",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "a generic correction re-steps every parameter, not only the touched ones"),
    M("corr-hyper-not-copied", "correction.py",
      "        return v.detach().clone()\n", "        return v.detach()\n",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "a tensor lr is snapshotted by reference: the scheduler's in-place update reaches old steps"),
    M("corr-hyper-not-restored", "correction.py",
      "        for g, h in zip(self.optimizer.param_groups, self.hyper):\n            g.update(h)\n", "",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "after a generic correction the param groups keep the corrected step's hyper-parameters"),
    M("corr-whole-never", "correction.py",
      "self.whole = type(optimizer) not in PER_PARAMETER", "self.whole = False",
      T(f"{OSP_MODES} or {DSYNC_MODES}", opt=OPT_ALL),
      "an optimizer that reads every gradient (global norm) is corrected on the touched parameters only"),
    # -- policy.py ---------------------------------------------------------------------------------
    M("split-lowest-critical", "split.py",
      "torch.sort(scores, descending=True, stable=True)", "torch.sort(scores, descending=False, stable=True)",
      T("osp-auto or osp-0.25", opt="select_critical or bucket_ready_last or auto_ or critical_zero or one_rank_osp"),
      "select_critical picks the LOWEST-scoring blocks"),
    M("policy-trial-unchecked", "policy.py",
      '"kept": a < b}', '"kept": a < 10 * b}',
      T(auto="auto_"),
      "auto keeps a share its measured steps show slower than the one it left (the check never fires)"),
    M("policy-noise-ignored", "policy.py",
      "        margin = max(stepmodel.MARGIN, noise, error)", "        margin = stepmodel.MARGIN",
      T(auto="auto_"),
      "auto leaves its share for a predicted gain below the measured noise (dithers)"),
    M("policy-shift-ignored", "policy.py",
      "        if moved <= math.log1p(self.SHIFT):", "        if moved <= 100:",
      T(auto="auto_"),
      "auto does not follow a link that changes (its vetoes and measured steps outlive the link)"),
    M("policy-sides-mixed", "policy.py",
      "        figs = self._figs[deferring] or self._figs[not deferring]",
      "        figs = self._figs[True] + self._figs[False]",
      T(auto="auto_ or own_figures"),
      "BSP is predicted from the compute measured while deferring (on a shared host, a longer one)"),
    M("policy-bsp-not-remeasured", "policy.py",
      "        if side and ratio[0] > ratio[1]:", "        if False:",
      T(auto="auto_"),
      "deferring when the link becomes faster, auto never measures BSP again and stays on OSP"),
    M("policy-count-floor", "policy.py",
      "max(math.ceil(frac * nblocks), math.ceil(self.min_critical * nblocks))",
      "max(int(frac * nblocks), math.ceil(self.min_critical * nblocks))",
      T("osp-auto or osp-0.25", opt="select_critical or bucket_ready_last or auto_ or critical_zero or one_rank_osp"),
      "the critical count rounds down (documented: ceil(critical * nblocks))"),
    M("stepmodel-tie-to-smallest", "stepmodel.py",
      "    best = max(s for s in options if pred[s] <= fastest + TIE * abs(fastest))",
      "    best = min(s for s in options if pred[s] <= fastest + TIE * abs(fastest))",
      T(auto="decide", plan="auto"),
      "a tie between shares goes to the one that defers most"),
    M("stepmodel-margin-sign", "stepmodel.py",
      "    if best != current and pred[best] < (1.0 - margin) * pred[current]:",
      "    if best != current and pred[best] < (1.0 + margin) * pred[current]:",
      T(auto="decide or auto_", plan="auto"),
      "auto leaves its share for a share predicted up to the margin SLOWER"),
    # -- agreement.py and OSP's side channel -------------------------------------------------------
    M("side-presence-off-by-one", "agreement.py",
      "return self._v[self._a.presence_at:]", "return self._v[self._a.presence_at + 1:]",
      T(OSP_MODES, opt=OPT_OSP),
      "the summed presence is read from one field late"),
    M("side-nonfinite-needs-two", "modes/osp.py",
      'nonfinite = side.any("nonfinite")', 'nonfinite = side.total("nonfinite") > 1',
      T(OSP_MODES, opt=OPT_OSP),
      "one rank's inf/nan does not skip the step"),
    M("side-stale-reads-edited", "modes/osp.py",
      'if side.any("stale"):', 'if side.any("edited"):',
      T(OSP_MODES, opt=OPT_OSP),
      "the stale flag is read from the edited field (copy-paste)"),
    M("side-edited-never", "modes/osp.py",
      '        if side.any("edited"):\n', '        if False:\n',
      T(OSP_MODES, opt=OPT_OSP),
      "a parameter edit while a correction is pending is no longer refused (the correction overwrites it)"),
    M("agreement-absent-posted-present", "agreement.py",
      "out.index_fill_(0, self._index(tuple(absent)), 0.0)", "out.index_fill_(0, self._index(tuple(absent)), 1.0)",
      T(EVERY_MODE, opt=OPT_ALL),
      "a parameter without a gradient is posted as present: the update moves it (momentum, weight decay)"),
    # -- amp.py, accumulation.py, parameters.py (the optimizer's delegates) --------------------------
    M("amp-not-unscaled", "amp.py",
      "        inp.unscale = opt.grad_scale.double().reciprocal()\n", "        pass\n",
      T(f"({OSP_MODES} or {DSYNC_MODES}) and scaler", opt=OPT_OSP),
      "GradScaler: the scaled gradients are applied as they are"),
    M("amp-overflow-not-reported", "amp.py",
      "found.fill_(1.0 if overflow else 0.0)", "found.fill_(0.0)",
      T(f"({OSP_MODES} or {DSYNC_MODES} or hsp) and scaler", opt=OPT_OSP),
      "GradScaler: an overflow osp skipped is not reported, so the scale never backs off"),
    M("acc-extra-pass-allowed", "accumulation.py",
      "if n > self.passes_per_step and not self._in_extra:", "if n > self.passes_per_step + 1 and not self._in_extra:",
      T(EVERY_MODE, opt=OPT_ALL),
      "one backward pass more than backward_passes_per_step is accumulated silently"),
    M("comp-wire-ignored", "comm.py",
      "if wire is not None and wire != tensor.dtype and tensor.is_floating_point():", "if False:",
      T(comp="one_rank"),
      "compression= is accepted and nothing is compressed: the update is not the one asked for"),
    M("comp-stage2-unchecked", "modes/osp.py",
      "nonfinite = nonfinite + (~fits(d, wire)).to(nonfinite.dtype)", "pass",
      T(comp="beyond_float16"),
      "a deferred gradient beyond float16's range overflows stage 2 after the critical blocks were applied"),
    M("acc-unreached-wait", "accumulation.py",
      "        if first:\n            self._ready_unreached()\n", "",
      T(opt="unused_parameter_does_not_hold_back"),
      "an unused parameter holds back its bucket and every later one until backward ends: no overlap"),
    M("acc-reentrant-accepted", "accumulation.py",
      "if p in self._unreached and self._unreached_open:", "if False:",
      T(opt="reentrant_checkpoint"),
      "a reentrant checkpoint's gradients arrive after their bucket started and are averaged without them"),
    M("acc-clip-request-kept", "accumulation.py",
      "        self.clip = None\n", "",
      T(EVERY_MODE, opt=OPT_ALL),
      "opt.clip_grad_norm_ asked for one step clips the steps after it too"),
    M("params-frozen-training-allowed", "parameters.py",
      "        if p.grad is not None:\n", "        if False:\n",
      T(EVERY_MODE, opt=OPT_ALL + " or frozen_when_wrapped"),
      "a parameter frozen when wrapped trains unsynchronized on each rank"),
    # -- layout.py ---------------------------------------------------------------------------------
    M("layout-nblocks-floor", "layout.py",
      "self.nblocks = max(1, -(-off // block_size))", "self.nblocks = max(1, off // block_size)",
      T(EVERY_MODE, opt=OPT_ALL),
      "a short last block is dropped (the flat buffer is too small)"),
    M("layout-zero-grad-keep-no-zero", "layout.py",
      "            self.grad.zero_()\n", "            pass\n",
      T(EVERY_MODE, opt=OPT_ALL),
      "zero_grad(set_to_none=False) leaves the gradients as they were"),
    M("layout-zero-grad-keep-revives-none", "layout.py",
      "p.grad = None if set_to_none or p.grad is None else gv", "p.grad = None if set_to_none else gv",
      T(EVERY_MODE, opt=OPT_ALL),
      "zero_grad(set_to_none=False) gives a zero gradient to a parameter that had none"),
    M("layout-probe-mask-or", "layout.py",
      "diff = diff & masks[i]", "diff = diff | masks[i]",
      T(EVERY_MODE, opt=OPT_ALL),
      "the edit probe flags every watched block as edited"),
    # -- buckets.py --------------------------------------------------------------------------------
    M("buckets-first-cap", "buckets.py",
      "first = min(limit, FIRST_BUCKET_BYTES)", "first = FIRST_BUCKET_BYTES",
      T(EVERY_MODE, opt=OPT_ALL),
      "the first bucket is 1 MiB even when bucket_mb is smaller"),
    M("buckets-dest-not-copied", "buckets.py",
      "                buf[lo:hi].copy_(fg.grad[lo:hi])\n", "                pass\n",
      T(EVERY_MODE, opt=OPT_ALL),
      "a mode's own average buffer is averaged without the bucket's gradient copied in"),
    M("buckets-last-dropped", "buckets.py",
      "            if cur:\n                self.buckets.append((fg, lo, hi, cur))\n", "",
      T(EVERY_MODE, opt=OPT_ALL),
      "the last, partly filled bucket of each group is never created"),
    # -- ops.py ------------------------------------------------------------------------------------
    M("ops-unpack-accumulate-dropped", "ops.py",
      "torch.ops.osp.unpack_blocks(buf, block_ids, block_size, flat, accumulate)",
      "torch.ops.osp.unpack_blocks(buf, block_ids, block_size, flat, False)",
      T(ops="not cuda"),
      "unpack_blocks(accumulate=True) copies instead of adding"),
    M("ops-sgd-flags-swapped", "ops.py",
      "                                nesterov, maximize, first)",
      "                                maximize, nesterov, first)",
      T(ops="not cuda"),
      "sgd_step_ passes maximize as nesterov and vice versa"),
    M("ops-adam-decoupled-dropped", "ops.py",
      "weight_decay, amsgrad, maximize, decoupled)", "weight_decay, amsgrad, maximize, False)",
      T(ops="not cuda"),
      "adam_step_ ignores decoupled (AdamW becomes Adam)"),
    M("ops-block-size-zero-accepted", "ops.py",
      "isinstance(block_size, bool) or block_size <= 0:", "isinstance(block_size, bool) or block_size < 0:",
      T(ops="not cuda"),
      "block_size=0 passes the wrappers' check"),
    M("ops-mask-numels-short-side", "ops.py",
      "(0 if last else short_by)", "(short_by if last else 0)",
      T(ops="not cuda"),
      "mask_numels charges the short last block to the wrong side"),
    M("ops-dense-check-dropped", "ops.py",
      '    _check_dense(grad, "grad")\n', "",
      T(ops="not cuda"),
      "score_blocks no longer refuses a sparse gradient with a clear message"),
    # -- horovod/: Horovod's API on torch.distributed ---------------------------------------------------
    M("hvdapi-average-is-sum", "horovod/ops.py",
      "                output.div_(_size(group))\n", "                pass\n",
      TWO_RANKS["osp.horovod"],
      "hvd.allreduce(op=hvd.Average) returns the sum (Gloo has no average: the division is osp.horovod's)"),
    M("hvdapi-allgather-padding-kept", "horovod/ops.py",
      "torch.cat([o[:k] for o, k in zip(outs, lengths)])", "torch.cat(outs)",
      TWO_RANKS["osp.horovod"],
      "hvd.allgather of first dimensions that differ returns the padding rows too"),
    M("hvdapi-outside-set-synchronized", "horovod/basics.py",
      "        if not self.included():\n            return LocalComm()\n", "",
      TWO_RANKS["osp.horovod"],
      "an optimizer on a process set without this rank is built on the set's group (Horovod's steps alone)"),
    M("hvdapi-elastic-not-resumed", "horovod/elastic.py",
      "        if state._resume():\n", "        if False:\n",
      TWO_RANKS["osp.horovod-elastic"],
      "a worker torchrun restarted starts from scratch instead of the last commit"),
    M("launcher-split-silently", "launcher.py",
      "    if comm.world_size() == 1:", "    if False:",
      "tests/test_train.py::test_a_launchers_ranks_on_an_engine_of_one_are_refused",
      "torchrun's 2 ranks on an engine of one each train alone and exit 0"),
    M("hvdapi-alltoall-async-bare", "horovod/ops.py",
      "    return _alltoall_async(tensor, splits, process_set, counts=True)",
      "    return _alltoall_async(tensor, splits, process_set)",
      TWO_RANKS["osp.horovod"],
      "synchronize(alltoall_async(t)) returns a bare tensor where Horovod returns (output, received_splits)"),
    M("split-nothing-deferred-unsaid", "split.py",
      "        self._warn_if_nothing_deferred()\n", "",
      "tests/test_optimizer.py::test_a_fixed_share_that_defers_nothing_says_so",
      "a fixed share that defers nothing on a small model runs BSP silently"),
    M("elastic-model-saved-unsettled", "statedict.py",
      "    def save(self):\n        settle(self.value)\n        self._saved_model_state",
      "    def save(self):\n        self._saved_model_state",
      TWO_RANKS["elastic"],
      "hvd.elastic.TorchState commits a model's provisional weights under OSP and DSync"),
    M("elastic-horovod-unsettled", "horovod/elastic.py",
      "        statedict.settle(self.value)\n        self.saved =", "        self.saved =",
      TWO_RANKS["osp.horovod-elastic-osp"],
      "osp.horovod's TorchState commits the model's provisional weights: a resumed run ends elsewhere"),
    M("elastic-world-not-followed", "statedict.py",
      "    if not comm.active() or (comm.rank, comm.size) == opt._world:",
      "    if True:",
      TWO_RANKS["elastic"],
      "an engine restarted into another world (hosts removed) with work in flight goes on silently"),
    # -- keywords.py: Horovod's keywords (op, gradient_predivide_factor, groups, sparse_as_dense) -----
    M("kw-sum-prescale-dropped", "keywords.py",
      "return float(size) if self.op == SUM else 1.0 / self.predivide",
      "return 1.0 if self.op == SUM else 1.0 / self.predivide",
      TWO_RANKS["sum"],
      "op=hvd.Sum applies the average of the ranks' gradients, not their sum (one rank cannot tell)"),
    M("kw-predivide-postscale-dropped", "modes/bsp.py",
      "        ctx.scale_grads(ctx.postscale)  # gradient_predivide_factor",
      "        pass  # gradient_predivide_factor",
      T("bsp and predivide-4", int="predivide"),
      "gradient_predivide_factor=f: the average is not multiplied back by f (the update is 1/f of torch's)"),
    M("kw-groups-duplicate-accepted", "keywords.py",
      "            seen.add(id(p))\n", "",
      T(hvd="bad_values_are_named or groups_naming_a_parameter_twice"),
      "groups=[[p], [p]]: a parameter listed twice is accepted (Horovod refuses it)"),
    M("kw-sparse-as-dense-ignored", "optimizer.py",
      "            fg.sparse_as_dense = sparse_as_dense\n", "            fg.sparse_as_dense = False\n",
      T(hvd="sparse"),
      "sparse_as_dense=True is accepted and a sparse embedding's gradient is refused as if it were False"),
    # -- accumulation.py: the prescale, no_sync(), early readiness, HSP's extras ----------------------
    M("acc-prescale-tensor-hook", "accumulation.py",
      "self._scaled[p] = (node, node.register_prehook(self._scale))",
      "self._scaled[p] = (node, p.register_hook(lambda g, s=self._scale: (s((g,)) or (g,))[0]))",
      T(int="predivide"),
      "the prescale on a tensor hook: torch.autograd.grad (a gradient penalty) returns the scaled gradient"),
    M("acc-no-sync-passes-counted", "accumulation.py",
      "        if self._no_sync:\n            return\n", "        if False:\n            return\n",
      T(f"no-sync and ({EVERY_MODE})", opt="no_sync"),
      "a pass inside no_sync() counts toward backward_passes_per_step: the step's average starts before its pass"),
    M("acc-no-sync-late-accepted", "accumulation.py",
      "        if self._backwards >= self.passes_per_step:\n            self._task = None\n",
      "        if self._backwards > self.passes_per_step:\n            self._task = None\n",
      T(f"no-sync and ({EVERY_MODE})", opt="no_sync"),
      "a no_sync() pass after the step's last counted pass is accumulated: its gradient misses the average"),
    M("acc-unreached-every-pass", "accumulation.py",
      "                or self._backwards + 1 < self.passes_per_step):", "                ):",
      T("(unused-param or accumulate-2) and (bsp or osp-0.25)", opt="unused_parameter or skips_a_branch"),
      "with accumulation, a parameter the FIRST pass misses is ready then: a later pass's gradient misses the average"),
    M("acc-extras-counted", "accumulation.py",
      "if n > self.passes_per_step and not self._in_extra:", "if n > self.passes_per_step:",
      T(opt="whole_steps_on_meta and HSP"),
      "HSP's extra micro-batches count toward backward_passes_per_step: the first extra is refused"),
    # -- parameters.py and layout.py: closure-only optimizers, kept strides ---------------------------
    M("params-closure-optimizer-accepted", "parameters.py",
      "    needs = _required_step_arguments(optimizer)\n", "    needs = []\n",
      T(int="needs_a_closure"),
      "an optimizer whose step() needs a closure (LBFGS) is wrapped, and fails at the first step"),
    M("layout-strides-not-kept", "layout.py",
      "    return None if kept is None else tuple(p.stride())", "    return None",
      T(int="channels_last or transposed"),
      "a channels_last parameter becomes a row-major view of the flat buffer (its kernels and gradient change layout)"),
    # -- replicas.py: the runtime replica check (needs 2 real ranks) ---------------------------------
    M("rep-first-step-skipped", "replicas.py",
      "if self.every and (index == 0 or index % self.every == 0):",
      "if self.every and index and index % self.every == 0:",
      TWO_RANKS["replicas"],
      "ranks that start from different weights train apart: the first step's check never runs"),
    M("rep-compare-any", "replicas.py",
      "if all(r == rows[0] for r in rows):", "if any(r == rows[0] for r in rows):",
      TWO_RANKS["replicas"],
      "the comparison always passes (rank 0's row equals itself)"),
    M("rep-named-off-by-one", "replicas.py",
      "                first = names[j]\n", "                first = names[j + 1]\n",
      TWO_RANKS["replicas"],
      "the error names the parameter after the first one that differs"),
    M("rep-broadcast-skipped", "optimizer.py",
      "if broadcast_parameters and not self.comm.elastic:", "if broadcast_parameters and self.comm.elastic:",
      TWO_RANKS["replicas"],
      "broadcast_parameters=True broadcasts nothing: ranks keep their own initial weights"),
    M("rep-hsp-never-synced", "modes/hsp.py",
      "        if self.exact:  # every rank has arrived", "        if False:  # every rank has arrived",
      TWO_RANKS["replicas"],
      "HSP never reaches an exact point: its replicas are never checked (a forgotten broadcast trains on)"),
    M("rep-hsp-checked-at-start", "optimizer.py",
      "if self.mode.exact and not self.mode.synced_in_step:", "if self.mode.exact:",
      TWO_RANKS["hsp"],
      "HSP's check runs at the step's start, where a fast rank waits for the straggler instead of computing extras"),
    M("rep-joined-compared", "replicas.py",
      "        if any(r[2] for r in rows):\n", "        if False:\n",
      TWO_RANKS["join-scheduler"],
      "a check inside join() compares replicas that differ by design (a scheduler the joined rank does not step)"),
    M("flush-bsp-not-synced", "optimizer.py",
      "if self._synced_calls == calls and self.mode.exact:", "if False:",
      T("(bsp or hsp) and on-synced"),
      "flush() under BSP and HSP neither calls on_synced nor checks the replicas"),
    # -- corrections bitwise torch.optim's (correction.py; tests/test_exact_adam.py) --------------------
    M("exact-sgd-half-fused", "correction.py",
      "        return super().fused_ok(fg) and fg.dtype == torch.float32\n",
      "        return super().fused_ok(fg)\n",
      "tests/test_exact_adam.py -k half",
      "fp16/bf16 SGD corrected by the packed kernel, whose rounding depends on an element's place in its parameter"),
    M("exact-adam-tensor-lr-fused", "correction.py",
      "fg.dtype == torch.float32 and not tensors and self._steps_on_host(fg)",
      "fg.dtype == torch.float32 and self._steps_on_host(fg)",
      T("tensor-lr-scheduler and (adam or adamw) and not fused"),
      "Adam with a tensor lr corrected by the kernel, which computes its step size in double, torch in fp32"),
    M("dsync-state-not-linked", "correction.py",
      "                self._link(s.fg, s.step)\n", "                pass\n",
      "tests/test_horovod_parity.py::test_horovods_optimizer_tests_pass_in_every_mode[dsync-2]",
      "DSync's exact update leaves no optimizer state where this rank had no gradient and another had one: "
      "the replicas' momentum differs (Horovod's test_force_allreduce, caught by the replica check)"),
    # -- join(): a GradScaler, DSync's late records (amp.py, optimizer.py, modes/dsync.py) -------------
    M("join-scaler-left-behind", "amp.py",
      "    scaler.step(opt)\n    scaler.update()\n", "    opt.step()\n",
      TWO_RANKS["join-amp"],
      "a joined rank steps outside its GradScaler: its scale stands still while the others' move"),
    M("join-leaves-at-first-record", "joining.py",
      "left = lag - ctx.joined_age", "left = 0",
      TWO_RANKS["join-dsync"],
      "join() ends when this rank reads the all-joined record, which DSync(auto) ranks read at other steps"),
    M("join-dsync-lag-zero", "modes/dsync.py",
      'return self.options.max_delay if self.options.delay == "auto" else self.options.delay',
      'return 0 if self.options.delay == "auto" else self.options.delay',
      TWO_RANKS["join-dsync"],
      "DSync(auto) says its records are read at once: ranks leave join() at different steps"),
    # -- clip_grad_value_ (modes/base.py, optimizer.py): the conformance pattern clip-value-opt ------
    M("clipv-lower-bound-dropped", "modes/base.py",
      "g.clamp_(min=-clip.value, max=clip.value)", "g.clamp_(max=clip.value)",
      T("clip-value-opt"),
      "clip_grad_value_: the average is clamped from above only (negative elements below -value kept)"),
    M("clipv-requested-as-norm", "clipping.py",
      '_request(opt, Clip("value", float(clip_value)))', '_request(opt, Clip("norm", float(clip_value)))',
      T("clip-value-opt"),
      "clip_grad_value_ under OSP/DSync/HSP clips the average by its norm"),
    M("clipv-bsp-not-applied", "clipping.py",
      "        torch.nn.utils.clip_grad_value_(params, clip_value)\n", "        pass\n",
      T("clip-value-opt and (bsp or osp-1.0)"),
      "clip_grad_value_ under BSP leaves the averaged .grad unclipped"),
    # -- compression.py / comm.py: the wire --------------------------------------------------------
    M("comp-cast-skipped", "comm.py",
      "target, tensor = tensor, tensor.div(self.size).to(wire)", "target, tensor = tensor, tensor.div(self.size)",
      T(comp="one_rank_equals"),
      "compression=fp16/bf16: the average travels uncast (the update is not the compressed one asked for)"),
    M("comp-no-divide-before-cast", "comm.py",
      "target, tensor = tensor, tensor.div(self.size).to(wire)", "target, tensor = tensor, tensor.to(wire)",
      TWO_RANKS["compression"],
      "a compressed average is the ranks' sum (not divided before the cast; one rank cannot tell)"),
    # -- arrivals.py: the slow rank, named ---------------------------------------------------------
    M("arr-lag-from-rank-0", "arrivals.py",
      "self._lag[r] += a - first", "self._lag[r] += a - ms[0]",
      T(arr="not multiproc"),
      "stats()['arrivals'] lag is measured from rank 0's arrival, not the earliest rank's"),
    M("arr-threshold-inclusive", "arrivals.py",
      "return mine > self.FACTOR * others and", "return mine >= self.FACTOR * others and",
      T(arr="not multiproc"),
      "a rank exactly FACTOR (1.5x) slower is named and warned of (documented: more than FACTOR)"),
    M("arr-no-floor", "arrivals.py",
      " and mine - others > self.FLOOR_MS\n", "\n",
      T(arr="not multiproc"),
      "scheduling noise of a few ms between balanced ranks is called a straggler (no absolute floor)"),
    M("arr-no-persistence", "arrivals.py",
      ' and w["persistence"] >= self.PERSIST):', "):",
      T(arr="not multiproc"),
      "a rank slow in only some of the window's steps is named (no persistence test)"),
    M("arr-no-hold", "arrivals.py",
      "        if self.named is None and self._held >= self.HOLD:",
      "        if self.named is None and self._held >= 1:",
      T(arr="not multiproc"),
      "one window showing a rank slow names it: a busy host's spell warns, and the summary contradicts it"),
    M("arr-named-forgotten", "arrivals.py",
      "        if self.named is None:\n            return None\n"
      "        return self.named[\"rank\"], self.named[\"slower\"]",
      "        w = self._slow_now()\n"
      "        return None if self.named is None or w is None else (w, self.named[\"slower\"])",
      T(arr="not multiproc"),
      "stats() judges the last window only: a rank warned of reads 'no slow rank' in the run's summary"),
    M("arr-warned-inside-the-read", "arrivals.py",
      "                self._pending = self._message(self.named)\n",
      "                self._pending = self._message(self.named)\n                self.warn_pending()\n",
      TWO_RANKS["arrivals"],
      "the warning is raised where the mode reads the record (BSP: inside backward), naming loss.backward()"),
    # -- lightning.py (one launch of Lightning's own, 2 ranks, about a minute) ---------------------
    M("lightning-no-flush-at-train-end", "lightning.py",
      "    def on_train_end(self, trainer, pl_module) -> None:\n        self.strategy.flush()\n",
      "    def on_train_end(self, trainer, pl_module) -> None:\n        pass\n",
      TWO_RANKS["lightning"],
      "fit() returns with OSP's stage 2 / DSync's averages in flight: replicas apart after training"),
    M("lightning-clipping-not-routed", "lightning.py",
      "        self._patch_clipping()\n", "",
      TWO_RANKS["lightning"],
      "gradient_clip_val under OSP/DSync clips each rank's own .grad (Lightning's clipping), not the average"),
    # -- plan.py: the stated model's terms ---------------------------------------------------------
    M("plan-hsp-ready-latency-dropped", "plan.py",
      "    return F + B + ready + cluster.allreduce_s(total) + S", "    return F + B + cluster.allreduce_s(total) + S",
      T(plan="closed_form or straggler or shared_host or latency"),
      "HSP's step leaves out its \"ready\" round (2(N-1) * latency)"),
    M("plan-osp-stage2-not-on-link", "stepmodel.py",
      "    start_free = st.link(deferred) - st.work_osp if deferred > 0 else 0.0", "    start_free = 0.0",
      T(plan="closed_form or straggler or shared_host or latency", auto="closed_forms"),
      "OSP's step finds the link free: the previous step's stage 2 is not on it"),
    M("plan-host-steal-dropped", "plan.py",
      'steal = 0.0 if mode in ("plain", "hsp") else cluster.host_cpu_s(sum(b["bytes"] for b in profile["buckets"]))',
      "steal = 0.0",
      T(plan="closed_form or straggler or shared_host or latency"),
      "a shared host's collective CPU work is not taken from the overlapping modes' compute"),
]


# -- the copy and the runs --------------------------------------------------------------------------

@dataclass
class Result:
    id: str
    file: str
    breaks: str
    tests: str
    status: str  # killed, survived, timeout, error, stale
    seconds: float = 0.0
    rc: Optional[int] = None
    detail: str = ""  # the first failing test (killed), why (error, stale)


_procs: Dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


def make_copy() -> str:
    """A fresh temporary copy of python/ (with the built extension), tests/, what the tests import or run from
    the checkout (bench/'s code: tests/launch.py waits for ranks with bench.netem; examples/) and pyproject.toml
    (the pytest configuration)."""
    tmp = tempfile.mkdtemp(prefix="osp-mutation-")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results", "out")
    for d in ("python", "tests", "bench", "examples"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(tmp, d), ignore=ignore)
    shutil.copy2(os.path.join(ROOT, "pyproject.toml"), tmp)
    return tmp


def env_for(copy: str, jobs: int) -> dict:
    env = dict(os.environ)
    # first on sys.path: ahead of the editable install's entry for the checkout's python/
    env["PYTHONPATH"] = os.path.join(copy, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def run(cmd: List[str], copy: str, jobs: int, timeout: float):
    """(rc or None on timeout, output, seconds); the process group is killed on timeout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy, jobs), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    with _lock:
        _procs[proc.pid] = proc
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    finally:
        with _lock:
            _procs.pop(proc.pid, None)
    return rc, out, time.perf_counter() - t0


def apply(m: Mutant, root: str) -> Optional[str]:
    """Apply ``m`` under ``root`` (a copy); returns why it cannot be applied, or None."""
    path = os.path.join(root, "python", "osp", m.path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        return f"cannot read {m.path}: {e}"
    n = text.count(m.old)
    if n != 1:
        return f"snippet occurs {n} times in {m.path} (expected once): update the table"
    mutated = text.replace(m.old, m.new)
    try:
        compile(mutated, path, "exec")
    except SyntaxError as e:
        return f"the mutated {m.path} does not compile: {e}"
    if root != ROOT:
        with open(path, "w") as f:
            f.write(mutated)
    return None


def first_failure(out: str) -> str:
    for line in out.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def run_mutant(m: Mutant, jobs: int, timeout: float) -> Result:
    res = Result(m.id, m.path, m.breaks, m.tests, "error")
    copy = make_copy()
    try:
        why = apply(m, copy)
        if why is not None:
            res.status, res.detail = "stale", why
            return res
        rc, out, res.seconds = run([sys.executable, *PYTEST, *shlex.split(m.tests)], copy, jobs, timeout)
        res.rc = rc
        if rc is None:
            res.status, res.detail = "timeout", f"past {timeout:g} s"
        elif rc == 0:
            res.status = "survived"
        elif rc in (1, 2):  # tests failed, or collection failed on the mutated code
            res.status, res.detail = "killed", first_failure(out)
        else:  # 3 internal error, 4 usage error (a bad node id), 5 no test selected
            res.status, res.detail = "error", f"pytest exit {rc}: {first_failure(out)}"
        return res
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def check_copy_imports(jobs: int) -> None:
    """The subprocesses must import the copy, not the checkout (osp is installed editable)."""
    copy = make_copy()
    try:
        code = "import osp, osp.ops; print(osp.__file__); print(osp.ops.HAS_EXTENSION)"
        rc, out, _ = run([sys.executable, "-c", code], copy, jobs, 120)
        lines = out.strip().splitlines()
        where = os.path.realpath(lines[-2]) if len(lines) >= 2 else ""
        if rc != 0 or not where.startswith(os.path.realpath(copy) + os.sep) or lines[-1] != "True":
            sys.exit(f"mutation: the copy does not import as it should (rc {rc}): {out.strip()[-2000:]}")
        print(f"mutation: subprocesses import osp from the copy ({where}), with its built extension")
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _merge(specs: List[str]) -> List[List[str]]:
    """The pytest arguments that run the union of ``specs``: those made by ``T`` (files, the same -m, one
    -k whose parts are qualified by file) in one run, any other on its own."""
    merged: Dict[str, List] = {}  # -m -> [files, -k parts]
    alone = []
    for spec in specs:
        args = shlex.split(spec)
        files = [a for a in args if a.endswith(".py")]
        rest = [a for a in args if not a.endswith(".py")]
        if len(rest) == 4 and rest[0] == "-m" and rest[2] == "-k":
            entry = merged.setdefault(rest[1], [[], []])
            entry[0] += [f for f in files if f not in entry[0]]
            entry[1].append(f"({rest[3]})")
        else:
            alone.append(args)
    return [[*files, "-m", m, "-k", " or ".join(parts)] for m, (files, parts) in merged.items()] + alone


def baseline(mutants: List[Mutant], jobs: int, timeout: float) -> None:
    """The union of the mutants' tests must pass on the unmutated copy (or every mutant would look
    killed). A mutant's selection that selects no test is reported when it runs (pytest exit 5: error)."""
    copy = make_copy()
    try:
        for args in _merge(sorted({m.tests for m in mutants})):
            print(f"mutation: baseline: the mutants' tests on the unmutated copy ({' '.join(args)[:100]}...)",
                  flush=True)
            rc, out, secs = run([sys.executable, *PYTEST, *args], copy, jobs, max(timeout, 900))
            if rc != 0:
                sys.exit(f"mutation: the baseline fails without any mutant (pytest exit {rc}, {secs:.0f} s): "
                         f"{first_failure(out)}")
            print(f"mutation: baseline passed in {secs:.0f} s: {first_failure(out)}", flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--list", action="store_true", help="list the mutants (and whether they apply) and exit")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant (default 300)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the tests without mutants")
    args = ap.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    assert len(set(ids)) == len(ids), "mutant ids must be unique"
    mutants = MUTANTS
    if args.only:
        want = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in want if w not in ids]
        if unknown:
            print(f"mutation: unknown mutant id(s): {', '.join(unknown)}", file=sys.stderr)
            return 2
        mutants = [m for m in MUTANTS if m.id in want]

    if args.list:
        for m in mutants:
            why = apply(m, ROOT)  # checks only: the checkout is never written
            print(f"{m.id:<34} {m.path:<16} {'STALE: ' + why if why else m.breaks}\n{'':<34} tests: {m.tests}")
        return 0

    stale = {m.id: apply(m, ROOT) for m in mutants}
    stale = {k: v for k, v in stale.items() if v}
    for k, v in stale.items():
        print(f"mutation: {k}: STALE: {v}", flush=True)
    live = [m for m in mutants if m.id not in stale]

    t_start = time.perf_counter()
    jobs = max(1, args.jobs)
    check_copy_imports(jobs)
    if not args.no_baseline and live:
        baseline(live, jobs, args.timeout)

    results: Dict[str, Result] = {}
    done = [0]

    def one(m: Mutant) -> Result:
        r = run_mutant(m, jobs, args.timeout)
        with _lock:
            done[0] += 1
            results[m.id] = r
            print(f"[{done[0]:>2}/{len(live)}] {r.id:<34} {r.status:<8} {r.seconds:6.1f}s  {r.file:<16} "
                  f"{r.detail if r.status != 'survived' else r.breaks}", flush=True)
        return r

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, live))
    except KeyboardInterrupt:
        with _lock:
            for p in list(_procs.values()):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        raise

    for k, v in stale.items():
        m = next(m for m in mutants if m.id == k)
        results[k] = Result(m.id, m.path, m.breaks, m.tests, "stale", detail=v)
    ordered = [results[m.id] for m in mutants]
    by = {s: [r.id for r in ordered if r.status == s] for s in ("killed", "timeout", "survived", "error", "stale")}
    n = len(ordered) - len(by["stale"])
    k = len(by["killed"]) + len(by["timeout"])
    rate = 100.0 * k / n if n else 0.0
    total = time.perf_counter() - t_start
    timeouts = f", {len(by['timeout'])} of them by timeout" if by["timeout"] else ""
    print(f"mutation: {k} killed of {n} ({rate:.1f}%){timeouts}, in {total / 60:.1f} min")
    print(f"mutation: survivors: {', '.join(by['survived']) or 'none'}")
    for s in ("timeout", "error", "stale"):
        if by[s]:
            print(f"mutation: {s}: {', '.join(by[s])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"killed": k, "total": n, "rate": rate, "threshold": THRESHOLD, "seconds": total,
                       **{s: v for s, v in by.items()}, "mutants": [asdict(r) for r in ordered]}, f, indent=1)
    return 0 if n and rate >= THRESHOLD and not by["error"] and not by["stale"] else 1


if __name__ == "__main__":
    sys.exit(main())
