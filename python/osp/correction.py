"""LGP: snapshots of what an exact update needs, and the exact re-application (docs/design.md, "LGP").

OSP and DSync move some blocks with this rank's own gradient while their average is in flight. Before
that provisional update they take a snapshot of those blocks; when the average arrives the corrector
restores the snapshot and applies the optimizer's update with the averaged gradient, so the applied
update is exactly the synchronous one. One corrector per optimizer kind:

- ``FusedSGD`` (``torch.optim.SGD``: momentum, dampening, nesterov, weight decay, maximize) and
  ``FusedAdam`` (``Adam`` and ``AdamW``, amsgrad too) keep the optimizer's state in flat buffers and
  correct packed blocks of fp32 parameters with fused kernels, bitwise torch.optim's own step on the CPU;
- ``Generic``, for any other optimizer (and for a fused kind in a configuration the kernels do not
  cover): restore the touched parameters and their state, and step the wrapped optimizer again.

    snap = corrector.snapshot(fg, mask, n_deferred, hyper(group))  # before the provisional update
    ...                                                            # the average in flight
    corrector.correct([(snap, avg)])               # the exact update of the deferred blocks
    corrector.restore([snap])                      # or: put them back as they were, no update

A snapshot serves one ``correct`` or ``restore``, unless it is taken with ``carry`` (DSync's, of every
block): ``correct`` then carries it on where it can (``carry`` stays set), holding the state after the
exact update, ready for the next one on top. ``update`` is the wrapped optimizer's update of whole
groups with given gradients (DSync's replays of provisional steps), in the fused kernels where there
are some. ``adopt`` follows every step of the wrapped optimizer (the fused kinds keep its state in flat
buffers), and ``whole`` says whether a correction must redo every parameter's update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import ops
from .layout import FlatGroup, Workspace


def by_value(v):
    if torch.is_tensor(v):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(by_value(x) for x in v)
    return v


def hyper(group: dict) -> dict:
    """A param group's hyper-parameters by value: a tensor lr that a scheduler updates in place must
    not change the snapshot that the correction of this step uses."""
    return {k: by_value(v) for k, v in group.items() if k != "params"}


def unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's own step, without the step hooks torch.optim wraps around it: the hooks
    run once per ``DistributedOptimizer.step()``, not for each local update or correction."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


def _clone_state(st: Optional[dict]) -> Optional[dict]:
    if not st:
        return None
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}


@dataclass
class Snapshot:
    """What the exact update of one flat group's deferred blocks (where ``mask`` is not set) needs."""
    fg: FlatGroup
    mask: torch.Tensor  # blocks NOT in the snapshot (already exact)
    hyper: Dict[str, Any]  # the group's hyper-parameters for the update being corrected
    numel: int = 0  # elements of the deferred blocks
    #: parameters without a gradient on any rank in the update being corrected: the optimizer skips
    #: them (as torch.optim does), and ``correct`` leaves them as the snapshot found them
    absent: set = field(default_factory=set)
    #: a snapshot of every block asked to be carried on (DSync's): after ``correct`` it holds the state after
    #: the update, ready for the next one; ``correct`` clears it where it could not (take a new one then)
    carry: bool = False
    #: ``ops.mask_positions(mask)`` where the caller computed them once (the kernels need not, per call)
    positions: Optional[torch.Tensor] = None


@dataclass
class FusedSnapshot(Snapshot):
    param: Optional[torch.Tensor] = None  # the deferred blocks of the parameters, packed
    state: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # None: no state yet
    step: float = 1.0  # Adam: the number of the update being corrected


@dataclass
class GenericSnapshot(Snapshot):
    touched: List[int] = field(default_factory=list)
    params: Dict[int, torch.Tensor] = field(default_factory=dict)
    states: Dict[int, Optional[dict]] = field(default_factory=dict)
    grad: Optional[torch.Tensor] = None  # the step's flat gradient (critical blocks already averaged)


class Generic:
    """Any optimizer: snapshot whole parameters that have a deferred element (and their state); correct
    by restoring them and stepping the wrapped optimizer on just those, under the hyper-parameters of
    the step being corrected. Reads the mask on the host."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._ws: Dict[int, Workspace] = {}
        #: the update of one parameter may read the others (a global-norm optimizer, any custom one): a
        #: correction then restores and re-steps every parameter of every group, with the exact gradient
        self.whole = type(optimizer) not in PER_PARAMETER

    def workspace(self, fg: FlatGroup) -> Workspace:
        ws = self._ws.get(id(fg))
        if ws is None:
            ws = self._ws[id(fg)] = Workspace(fg)
        return ws

    def adopt(self, groups: Sequence[FlatGroup]) -> None:
        """Called after every step of the wrapped optimizer and after loading its state."""

    def snapshot(self, fg: FlatGroup, mask: torch.Tensor, n_deferred: int, step_hyper: dict,
                 carry: bool = False, params: Optional[List[int]] = None,
                 positions: Optional[torch.Tensor] = None) -> Snapshot:
        """Before the update whose blocks outside ``mask`` (``n_deferred`` elements) ``correct`` will redo
        under ``step_hyper``; ``carry``: of every block, to be carried on (see the module docstring).
        ``params``: the parameters that may have an element outside ``mask``, where the caller knows them
        on the host (a superset is exact too: a parameter whose blocks were all in ``mask`` is stepped again
        with the gradient it was stepped with); without it the generic way reads the mask on the host.
        ``positions``: the mask's ``ops.mask_positions``, computed once by the caller."""
        if self.whole or n_deferred == fg.padded:
            touched = list(range(len(fg.params)))
        else:
            touched = fg.touched(~mask) if params is None else list(params)
        s = self._keep(GenericSnapshot(fg=fg, mask=mask, hyper=step_hyper, numel=n_deferred, carry=carry,
                                       touched=touched, positions=positions))
        s.grad = self.workspace(fg)("snap.grad").copy_(fg.grad)
        return s

    def _hold(self, fg: FlatGroup, indices) -> "GenericSnapshot":
        """A copy of parameters ``indices`` of ``fg`` and their state, to put back with ``restore``
        after an update that must leave them alone (they had no gradient on any rank)."""
        return self._keep(GenericSnapshot(fg=fg, mask=torch.ones(0, dtype=torch.bool), hyper={},
                                          touched=sorted(indices)))

    def _keep(self, s: "GenericSnapshot") -> "GenericSnapshot":
        """Copy the parameters ``s.touched`` and their state into ``s``."""
        st = self.optimizer.state
        for i in s.touched:
            p = s.fg.params[i]
            s.params[i] = p.detach().clone()
            s.states[i] = _clone_state(st.get(p))
        return s

    def correct(self, items: List[Tuple[Snapshot, torch.Tensor]]) -> None:
        """The exact update of each snapshot's blocks with its averaged gradient (from the values the
        snapshot holds); the parameters in its ``absent`` end as the snapshot found them. A snapshot taken
        with ``carry`` then holds the state after the update, or has ``carry`` cleared."""
        self._correct_generic(items)

    def _correct_generic(self, items) -> None:
        if not items:
            return
        with stepping_only(self.optimizer) as set_grad:
            for s, avg in items:
                fg = s.fg
                ops.merge_blocks(None, avg, s.mask, fg.block_size, s.grad, s.numel // fg.block_size,
                                 positions=s.positions)
                self.optimizer.param_groups[fg.group_index].update(s.hyper)
                self._restore_generic(s)
                for i in s.touched:
                    if i not in s.absent:
                        set_grad(fg.params[i], fg.view(s.grad, i))
            unhooked_step(self.optimizer)
        for s, _ in items:  # the next snapshot may take the kernels (the state exists now): not carried
            s.carry = False

    def update(self, items: List[Tuple[FlatGroup, torch.Tensor]], step_hyper: List[dict],
               absent: Sequence[set] = ()) -> None:
        """The wrapped optimizer's update of whole flat groups with the gradients ``items``, under the
        hyper-parameters ``step_hyper`` (one dict per param group); ``absent``: per item, the parameters
        left alone (no gradient). Update numbers (Adam's) continue from the state's."""
        absent = list(absent) or [set()] * len(items)
        with stepping_only(self.optimizer) as set_grad:
            for g, h in zip(self.optimizer.param_groups, step_hyper):
                g.update(h)
            for (fg, grad), skip in zip(items, absent):
                for i, p in enumerate(fg.params):
                    if i not in skip:
                        set_grad(p, fg.view(grad, i))
            unhooked_step(self.optimizer)
        self.adopt([fg for fg, _ in items])

    def _restore_generic(self, s: "GenericSnapshot") -> None:
        state = self.optimizer.state
        for i in s.touched:
            p = s.fg.params[i]
            p.copy_(s.params[i])
            snap = s.states[i]
            if snap is None:
                state.pop(p, None)
                continue
            st = state.setdefault(p, {})
            for k in list(st):
                if k not in snap:
                    del st[k]
            for k, v in snap.items():
                if torch.is_tensor(v) and torch.is_tensor(st.get(k)) and st[k].shape == v.shape:
                    st[k].copy_(v)
                else:
                    st[k] = v

    def restore(self, snaps: Sequence[Snapshot]) -> None:
        """Put the snapshotted blocks back as they were (no update)."""
        for s in snaps:
            self._restore_generic(s)

    def _step_count(self, fg: FlatGroup) -> float:
        """How many updates the state of ``fg`` has had, where the kernels need it (Adam); else 0."""
        return 0.0

    def nbytes(self) -> int:
        """Bytes of the buffers kept for snapshots."""
        return sum(ws.nbytes() for ws in self._ws.values())


class stepping_only:
    """Step the wrapped optimizer on chosen parameters only: every other gradient is hidden (an optimizer
    skips a parameter without a gradient), and gradients and hyper-parameters are put back after."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grads = [p.grad for p in self.params]
        self.hyper = [hyper(g) for g in self.optimizer.param_groups]
        for p in self.params:
            p.grad = None

        def set_grad(p, g):
            p.grad = g
        return set_grad

    def __exit__(self, *exc):
        for p, g in zip(self.params, self.grads):
            p.grad = g
        for g, h in zip(self.optimizer.param_groups, self.hyper):
            g.update(h)
        return False


#: ATen's CPU kernels use fused multiply-adds (as osp's CPU kernels do) under these capabilities only
_CPU_FMA = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class _Fused(Generic):
    """The flat-state machinery the fused correctors share; a group the kernels cannot take goes the
    generic way."""

    keys: Tuple[str, ...] = ()

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.flat: Dict[int, Dict[str, torch.Tensor]] = {}  # per flat group: optimizer state, flat

    def state_keys(self, fg: FlatGroup) -> Tuple[str, ...]:
        return self.keys

    def fused_ok(self, fg: FlatGroup) -> bool:
        # the kernels update whole groups: every parameter must have state, or none (a parameter
        # without a gradient on any rank so far has none). On the CPU they spell out the fused
        # multiply-adds of ATen's AVX2/AVX512 kernels: under another CPU capability (no FMA, another
        # architecture) torch's own step corrects
        group = self.optimizer.param_groups[fg.group_index]
        st = self.optimizer.state
        return not (group.get("differentiable") or group.get("capturable")) \
            and (fg.param.device.type != "cpu" or _CPU_FMA) \
            and len({bool(st.get(p)) for p in fg.params}) == 1

    def adopt(self, groups: Sequence[FlatGroup]) -> None:
        """Move the optimizer's per-parameter state tensors into flat buffers (views), so the block
        kernels can pack and correct them; loaded or new state tensors are copied in. A parameter
        without state (no gradient yet on any rank) is skipped."""
        st = self.optimizer.state
        for fg in groups:
            for key in self.state_keys(fg):
                flat = self.flat.setdefault(id(fg), {})
                for i, p in enumerate(fg.params):
                    t = st[p].get(key) if p in st else None
                    if t is None:
                        continue
                    if key not in flat:
                        flat[key] = torch.zeros_like(fg.param)
                    v = fg.view(flat[key], i)
                    if t.data_ptr() != v.data_ptr():
                        v.copy_(t)
                        st[p][key] = v

    def has_state(self, fg: FlatGroup) -> bool:
        return all(self.optimizer.state.get(p) for p in fg.params)

    def snapshot(self, fg, mask, n_deferred, step_hyper, carry=False, params=None, positions=None):
        if not self.fused_ok(fg):
            return super().snapshot(fg, mask, n_deferred, step_hyper, carry, params, positions)
        ws, bs = self.workspace(fg), fg.block_size
        s = FusedSnapshot(fg=fg, mask=mask, hyper=step_hyper, numel=n_deferred, carry=carry,
                          param=ws("snap.param", n_deferred))
        s.positions = positions
        ops.split_blocks(fg.param, mask, bs, None, s.param, n_deferred // bs, positions=positions)
        flat = self.flat.get(id(fg), {}) if self.has_state(fg) else {}
        for key in self.state_keys(fg):
            if key in flat:
                s.state[key] = ws("snap." + key, n_deferred)
                ops.split_blocks(flat[key], mask, bs, None, s.state[key], n_deferred // bs, positions=positions)
            else:
                s.state[key] = None  # no state before this step (its first)
        s.step = self._step_count(fg) + 1
        return s

    def _held(self, s: FusedSnapshot) -> GenericSnapshot:
        """The parameters of ``s.absent`` as ``s`` found them, to put back after its correction: from the
        snapshot where it holds every block (in the group's own layout), else as they are now (a
        snapshot of some blocks is corrected before the next update: they still hold those values)."""
        if s.numel != s.fg.padded:
            return self._hold(s.fg, s.absent)
        fg = s.fg
        out = GenericSnapshot(fg=fg, mask=torch.ones(0, dtype=torch.bool), hyper={}, touched=sorted(s.absent))
        for i in out.touched:
            out.params[i] = fg.view(s.param, i).clone()
            if any(buf is None for buf in s.state.values()):
                out.states[i] = None
            else:
                out.states[i] = {k: fg.view(buf, i).clone() for k, buf in s.state.items()}
                out.states[i].update(self._scalar_state(s))
        return out

    def _scalar_state(self, snap: FusedSnapshot) -> dict:
        """The per-parameter state a fused snapshot keeps as one number for the group."""
        return {}

    def _new_scalars(self, step: float) -> dict:
        """The per-parameter numbers of a state that update number ``step`` of a kernel created."""
        return {}

    def _link(self, fg: FlatGroup, step: float) -> None:
        """After a kernel applied update number ``step`` to every parameter of ``fg``: each parameter's
        state in the optimizer is its view of the flat buffers, created where it had none (the kernel
        wrote it in the flat buffers only); the caller then puts back those the update must leave alone."""
        st, flat = self.optimizer.state, self.flat.get(id(fg), {})
        keys = self.state_keys(fg)
        if not keys:  # a stateless update (SGD without momentum): torch.optim keeps no state either
            return
        for i, p in enumerate(fg.params):
            if st.get(p) and all(k in st[p] for k in keys):
                continue
            ps = st.setdefault(p, {})
            for k, v in self._new_scalars(step).items():
                ps.setdefault(k, v)
            for key in keys:
                ps[key] = fg.view(flat[key], i)

    def correct(self, items):
        generic = [(s, a) for s, a in items if not isinstance(s, FusedSnapshot)]
        for s, avg in items:
            if isinstance(s, FusedSnapshot):
                held = self._held(s) if s.absent else None  # the kernels update whole blocks
                if len(s.absent) == len(s.fg.params):  # no gradient anywhere: torch.optim leaves them all
                    self.restore([held])
                    continue
                self._set_count(s.fg, s.step)
                flat = self.flat.setdefault(id(s.fg), {})
                for key in self.state_keys(s.fg):  # no parameter of the group has state on this rank yet
                    if key not in flat:
                        flat[key] = torch.zeros_like(s.fg.param)
                carried = s.carry and held is None  # computed in its own buffers, which then hold the new state
                if carried or not self._correct_into(s, avg):
                    self._kernel(s.fg, s.param, avg, s.state, s.hyper, s.step)
                    for key, buf in s.state.items():
                        ops.merge_blocks(None, buf, s.mask, s.fg.block_size, self.flat[id(s.fg)][key],
                                         s.numel // s.fg.block_size, positions=s.positions)
                    ops.merge_blocks(None, s.param, s.mask, s.fg.block_size, s.fg.param,
                                     s.numel // s.fg.block_size, positions=s.positions)
                # every parameter the average brought a gradient to has its state now, as torch.optim
                # would leave it, also one this rank's own gradient missed (no state from its provisional
                # update here, while the ranks that had one have it)
                self._link(s.fg, s.step)
                if held is not None:
                    self.restore([held])
                if carried:
                    s.step += 1
                else:
                    s.carry = False
        self._correct_generic(generic)
        # the generic path may leave new state tensors (a parameter's first update): link them, as the
        # group may take the kernels again next time
        self.adopt([s.fg for s, _ in generic])

    def restore(self, snaps):
        st = self.optimizer.state
        for s in snaps:
            if not isinstance(s, FusedSnapshot):
                self._restore_generic(s)
                self.adopt([s.fg])
                continue
            bs = s.fg.block_size
            ops.merge_blocks(None, s.param, s.mask, bs, s.fg.param, s.numel // bs, positions=s.positions)
            self._set_count(s.fg, s.step - 1)  # the update number of the state snapshotted
            if any(buf is None for buf in s.state.values()):
                for p in s.fg.params:  # the state begins after the snapshot
                    st.pop(p, None)
                continue
            for key, buf in s.state.items():
                ops.merge_blocks(None, buf, s.mask, bs, self.flat[id(s.fg)][key], s.numel // bs,
                                 positions=s.positions)

    def update(self, items, step_hyper, absent=()):
        generic, gabsent = [], []
        for (fg, grad), skip in zip(items, list(absent) or [set()] * len(items)):
            if skip or not (self.fused_ok(fg) and self.has_state(fg)):  # the kernels update whole groups
                generic.append((fg, grad))
                gabsent.append(skip)
                continue
            state = {key: self.flat[id(fg)][key] for key in self.state_keys(fg)}
            step = self._step_count(fg) + 1
            self._kernel(fg, fg.param, grad, state, step_hyper[fg.group_index], step)
            self._set_count(fg, step)
        if generic:
            super().update(generic, step_hyper, gabsent)

    def _set_count(self, fg: FlatGroup, step: float) -> None:
        """A kernel applied update number ``step`` to every parameter of ``fg``: where the optimizer keeps
        that number in its own state (Adam's ``step``), it must say so too, or the steps that follow
        (torch's own, a replay) would count from the number the provisional updates left."""

    def _correct_into(self, s: FusedSnapshot, avg: torch.Tensor) -> bool:
        """The exact update of ``s``'s blocks written straight to their places in the flat parameter
        and state, in one pass (``s`` keeps the values from before); False where no kernel does that."""
        return False

    def _kernel(self, fg, param, grad, state, h, step) -> None:
        """One exact optimizer update of ``param`` (packed, or a whole group) with ``grad``; ``state`` holds
        buffers of the same layout (a None entry: the state starts with this update); they are filled
        in place (a None entry is replaced)."""
        raise NotImplementedError


class FusedSGD(_Fused):
    keys = ("momentum_buffer",)

    def fused_ok(self, fg):
        # fp32 only: in fp16/bf16 ATen's SGD arithmetic depends on where an element sits in its parameter
        # (its vector loops and their scalar tails round differently), which packed blocks do not keep;
        # there torch's own step corrects
        return super().fused_ok(fg) and fg.dtype == torch.float32

    def state_keys(self, fg):
        return self.keys if self.optimizer.param_groups[fg.group_index].get("momentum", 0) else ()

    def _kernel(self, fg, param, grad, state, h, step):
        momentum = h.get("momentum", 0)
        mom = state.get("momentum_buffer") if momentum else None
        first = bool(momentum) and mom is None
        if first:
            mom = state["momentum_buffer"] = torch.empty_like(param)
        ops.sgd_step_(param, grad, mom, lr=float(h["lr"]), momentum=momentum, dampening=h["dampening"],
                      weight_decay=h["weight_decay"], nesterov=h["nesterov"],
                      maximize=h.get("maximize", False), first=first)

    def _correct_into(self, s, avg):
        h = s.hyper
        momentum = h.get("momentum", 0)
        snap_mom = s.state.get("momentum_buffer") if momentum else None
        ops.sgd_step_into_(s.fg.param, self.flat[id(s.fg)]["momentum_buffer"] if momentum else None, s.param,
                           snap_mom, avg, s.mask, s.fg.block_size, lr=float(h["lr"]), momentum=momentum,
                           dampening=h["dampening"], weight_decay=h["weight_decay"], nesterov=h["nesterov"],
                           maximize=h.get("maximize", False), first=bool(momentum) and snap_mom is None,
                           deferred_blocks=s.numel // s.fg.block_size, positions=s.positions)
        return True


class FusedAdam(_Fused):
    """``Adam`` and ``AdamW``."""

    keys = ("exp_avg", "exp_avg_sq")

    def state_keys(self, fg):
        amsgrad = self.optimizer.param_groups[fg.group_index].get("amsgrad", False)
        return self.keys + ("max_exp_avg_sq",) if amsgrad else self.keys

    def fused_ok(self, fg):
        # the kernel takes one step number for the whole group; in fp32 it is bitwise torch's Adam (its
        # square root is torch's own: ops.adam_step_), in fp16/bf16 it is not, so there torch's own step
        # corrects (Adam's sensitivity to its second moment grows a last-bit difference into a visible one)
        # The step counts must be on the host: Adam(fused=True) keeps them on the parameters' device, and
        # reading them would sync every step (torch's own fused step corrects there, the generic way).
        # A tensor lr (or betas, eps, weight decay): torch's Adam then computes its step size and decay
        # factor in fp32 tensor arithmetic, the kernel in double from a float; torch's own step corrects.
        group = self.optimizer.param_groups[fg.group_index]
        tensors = any(torch.is_tensor(group.get(k)) for k in ("lr", "eps", "weight_decay")) \
            or any(torch.is_tensor(b) for b in group.get("betas", ()))
        return super().fused_ok(fg) and fg.dtype == torch.float32 and not tensors and self._steps_on_host(fg) \
            and len({self._step_of(p) for p in fg.params}) == 1

    def _steps_on_host(self, fg) -> bool:
        st = self.optimizer.state
        return all(not torch.is_tensor(st[p].get("step")) or st[p]["step"].device.type == "cpu"
                   for p in fg.params if st.get(p))

    def _step_of(self, p) -> float:
        st = self.optimizer.state.get(p)
        return float(st["step"]) if st else 0.0

    def _step_count(self, fg):
        return self._step_of(fg.params[0])

    def _scalar_state(self, snap):
        return {"step": torch.tensor(float(snap.step) - 1.0, dtype=torch.get_default_dtype())}

    def _new_scalars(self, step):
        return {"step": torch.tensor(float(step), dtype=torch.get_default_dtype())}

    def _set_count(self, fg, step):
        for p in fg.params:
            st = self.optimizer.state.get(p)
            if st and torch.is_tensor(st.get("step")):
                st["step"].fill_(step)

    def _kernel(self, fg, param, grad, state, h, step):
        for key in self.state_keys(fg):
            if state.get(key) is None:  # Adam's state starts at zero
                state[key] = torch.zeros_like(param)
        beta1, beta2 = h["betas"]
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or h.get("decoupled_weight_decay", False)
        amsgrad = h.get("amsgrad", False)
        ops.adam_step_(param, grad, state["exp_avg"], state["exp_avg_sq"],
                       state["max_exp_avg_sq"] if amsgrad else None, step=step, lr=float(h["lr"]),
                       beta1=float(beta1), beta2=float(beta2), eps=h["eps"], weight_decay=h["weight_decay"],
                       amsgrad=amsgrad, maximize=h.get("maximize", False), decoupled=decoupled)


#: torch.optim's optimizers whose update of a parameter reads only that parameter, its gradient and its
#: state: the generic correction may re-step just the parameters it touches. Any other optimizer (a
#: subclass too: it may read more) is re-stepped whole.
PER_PARAMETER = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                 torch.optim.Adamax, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
                 torch.optim.Rprop, torch.optim.ASGD)


def corrector_for(optimizer: torch.optim.Optimizer) -> Generic:
    """The corrector for ``optimizer``'s kind: exactly SGD, Adam or AdamW get osp's kernels, unless
    asked for torch's ``fused`` kernels (whose fp16/bf16 arithmetic osp's do not repeat: torch's own step
    corrects them); a subclass may change the update, so it takes the generic path."""
    kind = {torch.optim.SGD: FusedSGD, torch.optim.Adam: FusedAdam, torch.optim.AdamW: FusedAdam}
    if any(g.get("fused") for g in optimizer.param_groups):
        return Generic(optimizer)
    return kind.get(type(optimizer), Generic)(optimizer)
