"""The backward passes of the coming step: which reached which parameter, and when the step's last ended.

``Accumulation`` is called by the post-accumulate-grad hook of every wrapped parameter. It counts the
passes per parameter (``backward_passes_per_step`` of them make a step), tells the mode when a
parameter's gradient is ready (``on_ready``: its last pass) and when the step's last pass ended
(``end_backward``), and starts the step again (``restart``) when gradients were zeroed or replaced
since a pass (a GAN's ``D.zero_grad()`` after G's backward ran through D). It also records each
gradient's version when the passes ended, to tell a gradient changed in place before ``step()``
(clipping) from a zeroed one and from a backward that came too late. HSP's extra micro-batches
(``extra()``) add passes beyond ``backward_passes_per_step`` without telling the mode.

Parameters the step's last pass will not reach are ready when that pass begins, not when it ends: at its
first gradient, autograd says which gradient accumulators its graph will run
(``torch._C._will_engine_execute_node``, as ``torch.autograd.graph.register_multi_grad_hook`` asks), so
an unused parameter (a frozen branch, a head this batch skipped) does not hold back its bucket and every
later one until backward ends. This is exact, not a guess from the step before: a parameter the graph
will not reach gets no gradient in this pass. (A gradient that still arrives during that pass, from a
backward re-entered inside it, is refused; a later pass that reaches one finds its bucket started, as it
would have found it at the end of the pass before. Modes say whether they take this: ``Mode.ready_unreached_early``.)
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch
from torch.autograd.graph import get_gradient_edge

from .layout import FlatGroup


def _accumulator(p: torch.Tensor):
    """``p``'s gradient accumulator (the autograd node a backward reaching ``p`` runs); None while it
    does not require a gradient."""
    return get_gradient_edge(p).node if p.requires_grad else None


class Accumulation:
    def __init__(self, groups: List[FlatGroup], passes_per_step: int, mode,
                 prescale: Optional[Callable[[], float]] = None, before_pass: Optional[Callable[[], None]] = None):
        """``prescale``: the factor every pass's gradient gets before it accumulates into ``.grad``
        (``keywords.Reduction``: op=Sum, gradient_predivide_factor), asked for at each pass. ``before_pass``: called
        at each backward pass's first gradient here, before anything of the pass (the optimizer's world check)."""
        self.groups, self.passes_per_step, self.mode = groups, passes_per_step, mode
        self.before_pass = before_pass
        self.fresh = False  # a backward reached the parameters since the last step
        self.clip = None  # the Clip opt.clip_grad_norm_ / clip_grad_value_ asked for the coming step
        self._where = {p: (fg, i) for fg in groups for i, p in enumerate(fg.params)}
        # per parameter: how many passes reached it, and the version of its gradient after the last one
        self._passes: Dict[torch.nn.Parameter, int] = {}
        self._seen: Dict[torch.nn.Parameter, int] = {}
        self._backwards = 0  # passes of the coming step that reached these parameters
        self._averaged = False  # the step's last pass ended and .grad holds the average (BSP)
        self._task: Optional[int] = None  # the autograd graph task last seen
        self._versions: Optional[List[tuple]] = None  # (is its alias, version) of each gradient then
        self._in_extra = False  # an extra micro-batch (HSP's step(closure)) is running
        self._extra_passes = 0  # passes that ended inside extra micro-batches
        self._no_sync = False  # inside no_sync(): passes accumulate locally and do not count
        # each parameter's gradient accumulator (held, as DDP's reducer holds them: one node for every
        # graph), asked whether a pass will reach it; and the parameters a pass was told it will not reach
        self._accumulators = [(p, _accumulator(p)) for fg in groups for p in fg.params]
        self._unreached: set = set()
        # the pass that found them is still running: a gradient for one of them now comes from a backward
        # nested in it. (After that pass, a later one may reach them, as one may reach any parameter
        # whose bucket ended its step's backward: each mode handles that as before.)
        self._unreached_open = False
        # the hooks hold this object weakly: a dropped optimizer must not keep reacting to backward
        # (e.g. starting collectives) when the model is wrapped again
        ref = weakref.WeakMethod(self.on_grad)

        def hook(p, ref=ref):
            fn = ref()
            if fn is not None:
                fn(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for fg in groups for p in fg.params]
        # the prescale acts on what accumulates into .grad, and on nothing else: a pre-hook on each
        # parameter's gradient accumulator, which a backward pass runs (no_sync passes, HSP's extra
        # micro-batches, the backward of a create_graph graph alike) and torch.autograd.grad does not. A
        # tensor hook on the parameter would scale autograd.grad's results too (a gradient penalty's).
        # Each node is held here, apart from ``_accumulators``: released, torch would make the parameter
        # a new one, without the hook
        self._scale = None
        self._scaled: Dict[torch.nn.Parameter, tuple] = {}  # parameter -> (its node, the hook's handle)
        if prescale is not None:
            def scale(grads, prescale=prescale):
                f = prescale()
                if f == 1.0 or grads[0] is None:
                    return None
                return (grads[0] * f,) + tuple(grads[1:])

            self._scale = scale
            for p, node in self._accumulators:
                self._hook_scale(p, node)

    def _hook_scale(self, p: torch.Tensor, node) -> None:
        """Put the prescale on ``node``, ``p``'s gradient accumulator now (off the one it had before)."""
        if self._scale is None or node is None:
            return
        held = self._scaled.get(p)
        if held is not None:
            if held[0] is node:
                return
            held[1].remove()
        self._scaled[p] = (node, node.register_prehook(self._scale))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        for _, h in self._scaled.values():
            h.remove()
        self._scaled.clear()

    def on_grad(self, p: torch.Tensor) -> None:
        """A backward pass accumulated ``p``'s gradient."""
        task = torch._C._current_graph_task_id()
        first = task != self._task
        if first:  # this backward's first gradient here: finish the pass when it ends
            if self.before_pass is not None:
                self.before_pass()
            self._task = task
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: ref() is not None and ref()._end_pass())
        self.fresh = True
        fg, i = self._where[p]
        if p in self._unreached and self._unreached_open:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient from a backward pass other than the one its "
                "step's averages started in, which did not reach it: a backward re-entered inside another, as "
                "torch.utils.checkpoint(..., use_reentrant=True) does. Use use_reentrant=False")
        alias, n = fg.grad_views[i], self._passes.get(p, 0)
        if self._no_sync:
            self._accumulate_unsynced(fg, i, p, alias)
            return
        changed = n and (p.grad is not alias or alias._version != self._seen[p] + 1)
        if changed and self._in_extra:
            self._task = None
            raise RuntimeError(
                f"osp: the gradient of {fg.names[i]!r} was zeroed or replaced inside the closure passed to step(); "
                "an extra micro-batch must accumulate into .grad (no zero_grad() in the closure: the step's first "
                "micro-batch is already there)")
        if changed or (self._averaged and self._zeroed_since_averaging(p)):
            # zeroed, set to None or replaced since its last backward (e.g. a GAN's D.zero_grad() after
            # G's backward ran through D, or after D's average): the step's accumulation starts again
            self.restart()
            n = 0
        if first:
            self._ready_unreached()
        self._gather(fg, i, p, alias)
        n += 1
        if n > self.passes_per_step and not self._in_extra:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient from {n} backward passes since the last step(), "
                f"more than backward_passes_per_step={self.passes_per_step}. Call step() after each "
                "backward, zero the gradients before the next one, or raise backward_passes_per_step to "
                "accumulate gradients locally")
        if self._averaged:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient from a backward pass after this step's gradients "
                f"were averaged (its backward_passes_per_step={self.passes_per_step} pass(es) had "
                "ended). Sum the losses and call backward() once, raise backward_passes_per_step, or call "
                "step() first. (A backward re-entered inside another, as torch.utils.checkpoint(..., "
                "use_reentrant=True) does, ends a pass early: use use_reentrant=False.)")
        self._passes[p] = n
        self._seen[p] = alias._version
        if n == self.passes_per_step and not self._in_extra:
            self.mode.on_ready(p)

    def _ready_unreached(self) -> None:
        """At the first gradient of the step's last counted pass: the parameters this pass's graph will not
        reach have had their last pass (a missing gradient counts as zeros): tell the mode now."""
        if (not self.mode.ready_unreached_early or self._no_sync or self._in_extra or self._averaged
                or self._backwards + 1 < self.passes_per_step):
            return
        will_run = torch._C._will_engine_execute_node
        for k, (p, node) in enumerate(self._accumulators):
            if (self._passes.get(p, 0) >= self.passes_per_step or p in self._unreached
                    or (node is not None and will_run(node))):
                continue
            # the held node may be stale (``p.data`` of another dtype gets a new accumulator, a frozen
            # parameter has none): ask again
            fresh = _accumulator(p)
            if fresh is not node:
                self._accumulators[k] = (p, fresh)
                self._hook_scale(p, fresh)
                if fresh is not None and will_run(fresh):
                    continue
            self._unreached.add(p)
            self._unreached_open = True
            self.mode.on_ready(p)

    @staticmethod
    def _gather(fg: FlatGroup, i: int, p, alias) -> None:
        """``p``'s new gradient into the flat gradient, where backward made a tensor of its own (a sparse one
        only when made dense, ``sparse_as_dense``: else refused where it is gathered, by a bucket or in
        ``step()``)."""
        if p.grad is not alias and (p.grad.layout == torch.strided or fg.sparse_as_dense):
            fg.gather_grads([p])
        fg.absent.discard(i)  # it has a gradient now (a bucket started before may have found none)

    def _accumulate_unsynced(self, fg: FlatGroup, i: int, p, alias) -> None:
        """A pass inside ``no_sync()``: the gradient stays in ``.grad`` (osp's flat gradient), to be
        averaged with the first pass outside, which counts as the step's; nothing starts."""
        if self._backwards >= self.passes_per_step:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient inside no_sync() after the step's last counted "
                f"backward pass (of backward_passes_per_step={self.passes_per_step}), whose averages have "
                "started; run the no_sync() passes before it, as with DDP, or call step() first")
        self._gather(fg, i, p, alias)
        if p in self._passes:  # a counted pass reached it before: its count no longer sees this change
            self._seen[p] = alias._version

    @contextmanager
    def no_sync(self):
        """DDP's ``no_sync()``: backward passes inside accumulate into ``.grad`` without averaging and do
        not count toward ``backward_passes_per_step``; the next pass outside averages their sum."""
        if self._in_extra:
            raise RuntimeError("osp: no_sync() inside the closure passed to step(): an extra micro-batch is "
                               "already part of the step's average")
        if self._no_sync:
            raise RuntimeError("osp: no_sync() entered again inside no_sync()")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def _end_pass(self) -> None:
        self._task = None
        self._unreached_open = False
        if self._no_sync:
            return
        if self._in_extra:
            self._extra_passes += 1
            return
        self._backwards += 1
        if self._backwards >= self.passes_per_step:
            self.mode.end_backward()
            self._averaged = self.mode.grad_is_average
            self._versions = [(p.grad is a, a._version) for fg in self.groups
                              for p, a in zip(fg.params, fg.grad_views)]

    def _zeroed_since_averaging(self, current: torch.Tensor) -> bool:
        """Whether a gradient averaged at the end of the step's last pass was since zeroed, set to None
        or replaced (``current`` just had a backward accumulate into it)."""
        k = 0
        for fg in self.groups:
            for p, alias in zip(fg.params, fg.grad_views):
                held, v = self._versions[k]
                k += 1
                if not held:
                    continue
                grown = 1 if p is current else 0
                if p.grad is not alias or alias._version != v + grown:
                    return True
        return False

    def zero_grad(self, set_to_none: bool) -> None:
        if self._in_extra:
            raise RuntimeError("osp: zero_grad() inside the closure passed to step(): an extra micro-batch "
                               "must accumulate into .grad (the step's first micro-batch is already there)")
        self.restart()
        self.fresh = False
        for fg in self.groups:
            fg.zero_grad(set_to_none)

    def restart(self) -> None:
        """The gradients were zeroed or replaced: the mode drops what this step's passes started."""
        self.mode.restart()
        self.new_step()

    def new_step(self) -> None:
        """Forget the passes, presence and clip request of the step being accumulated."""
        self._passes.clear()
        self._unreached.clear()
        self._backwards = 0
        self._versions = None
        self._averaged = False
        self.clip = None
        for fg in self.groups:
            fg.absent.clear()

    def reset(self, mode) -> None:
        """A new mode (``reset_world``): nothing of the step being accumulated is kept."""
        self.mode = mode
        self.fresh = False
        self._task = None
        self._in_extra = False
        self.new_step()

    def edited(self, allowed: int) -> List[str]:
        """Parameters whose gradient was changed in place after the step's backward ended, beyond
        ``allowed`` changes each (a GradScaler's unscale or overflow check), or replaced by another
        tensor."""
        if self._versions is None:
            return []
        out, k = [], 0
        for fg in self.groups:
            for name, p, a in zip(fg.names, fg.params, fg.grad_views):
                held, old = self._versions[k]
                k += 1
                if a._version - old > allowed or (held and p.grad is not a):
                    out.append(name)
        return out

    def check_fresh(self) -> None:
        if not self.fresh:
            raise RuntimeError(
                f"osp: step() called without a backward pass reaching this optimizer's parameters (e.g. "
                f"{self.groups[0].names[0]!r}) since the last step() or zero_grad(); every step needs new "
                "gradients (call loss.backward() first). "
                "If backward did run, the model no longer uses the parameters this optimizer was built with "
                "(e.g. model.load_state_dict(..., assign=True) or a layer replaced after wrapping): build "
                "and wrap the optimizer after such changes")

    def shadow_pass(self) -> None:
        """``join()``: the step's backward passes, run with no gradient on this rank: every parameter is
        ready at once (its gradient counts as zeros), in the order the buckets start."""
        self.fresh = True
        for fg in self.groups:
            for p in fg.params:
                self.mode.on_ready(p)
        self._backwards = self.passes_per_step - 1
        self._end_pass()

    @contextmanager
    def extra(self):
        """An extra micro-batch (HSP's ``step(closure)``) runs inside: its passes accumulate into
        ``.grad`` beyond ``backward_passes_per_step``; yields a callable returning how many ended."""
        before = self._extra_passes
        self._in_extra = True
        try:
            yield lambda: self._extra_passes - before
        finally:
            self._in_extra = False
