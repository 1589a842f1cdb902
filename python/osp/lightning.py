"""``osp.lightning.OSPStrategy``: osp's optimizer under PyTorch Lightning's Trainer (from a checkout:
``pip install -e ".[lightning]"``; osp is not on PyPI).

    trainer = lightning.pytorch.Trainer(strategy=OSPStrategy(sync=osp.OSP(critical="auto")),
                                        accelerator="cpu", devices=2)

It is Lightning's DDP strategy (the same launcher, cluster environments and torch.distributed process group:
Gloo on CPU, NCCL on GPU) with three differences:

- the model is not wrapped in ``DistributedDataParallel``: each optimizer that ``configure_optimizers`` returns
  is wrapped in ``osp.DistributedOptimizer`` (on the default process group), and the parameters, buffers and
  optimizer state come from rank 0 once, at setup;
- the step: Lightning's closure (forward, ``zero_grad``, backward) runs exactly once, then ``opt.step()``
  (under ``osp.HSP`` with further micro-batches for the extras); clipping (``gradient_clip_val``, by norm or
  by value, and ``self.clip_gradients`` in manual optimization) is osp's exact clipping of the averaged
  gradient; the batches ``accumulate_grad_batches`` accumulates run in ``opt.no_sync()``, as DDP's do;
- ``opt.flush()`` (and, with ``broadcast_buffers``, the buffers from rank 0) wherever Lightning reads weights
  or optimizer state: before the validation, test and predict loops, before every checkpoint is dumped, and at
  ``on_train_end``, before any callback's (so ``fit`` returns with bitwise equal replicas).

Importing ``osp`` does not import Lightning; importing this module does (``pytorch_lightning`` 2.x, or the
``lightning`` package's ``lightning.pytorch``).
"""
from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch

try:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.plugins.precision import MixedPrecision, Precision
    from pytorch_lightning.strategies import DDPStrategy
except ImportError:  # the unified package
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Callback
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError as e:
        raise ImportError("osp.lightning needs PyTorch Lightning 2.x: pip install 'lightning>=2.1' (or "
                          "pytorch-lightning>=2.1; from osp's checkout: pip install -e '.[lightning]')") from e

from .broadcast import broadcast_optimizer_state, broadcast_parameters, sync_buffers
from .modes import HSP
from .modes.base import Options
from .optimizer import DistributedOptimizer

__all__ = ["OSPStrategy"]

_PG_TIMEOUT = timedelta(minutes=30)


class OSPStrategy(DDPStrategy):
    """Lightning's DDP strategy with ``osp.DistributedOptimizer`` doing the averaging (see the module docstring).

    Args:
        sync: the mode, ``osp.OSP(...)`` (the default: ``critical="auto"``), ``osp.BSP()``, ``osp.DSync(...)`` or
            ``osp.HSP(...)``; each optimizer gets a copy.
        compression: what the gradients travel as (``DistributedOptimizer(compression=)``).
        step_timeout: seconds a collective of a step may take before it raises (``DistributedOptimizer(timeout=)``).
        broadcast_buffers: as DDP's: before each training batch every buffer (BatchNorm statistics) becomes rank
            0's, and again at every flush point, so evaluation and checkpoints see equal buffers.
        hsp_batches: under ``osp.HSP``, where the extra micro-batches come from: None (the default), a second
            iterator over the training DataLoader, restarted when it runs out; or a callable returning an
            iterable of batches.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as ``DDPStrategy``'s.
    """

    strategy_name = "osp"

    def __init__(self, sync: Optional[Options] = None, *, compression=None, step_timeout: float = 600.0,
                 broadcast_buffers: bool = True, hsp_batches: Optional[Callable[[], Any]] = None,
                 accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = _PG_TIMEOUT, start_method: str = "popen") -> None:
        from .modes import OSP

        sync = OSP(critical="auto") if sync is None else sync
        if not isinstance(sync, Options):
            raise ValueError(f"osp: OSPStrategy(sync=) expects osp.BSP(), osp.OSP(...), osp.DSync(...) or "
                             f"osp.HSP(...), got {sync!r}")
        if hsp_batches is not None and not callable(hsp_batches):
            raise ValueError(f"osp: OSPStrategy(hsp_batches=) expects a callable returning an iterable of batches, "
                             f"got {hsp_batches!r}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.sync, self.compression, self.step_timeout = sync, compression, float(step_timeout)
        self.broadcast_buffers = bool(broadcast_buffers)
        self._hsp_batches, self._extras = hsp_batches, None

    def __repr__(self) -> str:
        return f"OSPStrategy(sync={self.sync!r})"

    # -- no DDP wrapper; osp's optimizers ------------------------------------------------------------
    def configure_ddp(self) -> None:
        """Nothing to wrap: osp's optimizer averages the gradients."""

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if not any(isinstance(cb, _Flush) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, _Flush(self))  # first: every other callback sees flushed weights
        self._patch_clipping()

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        if isinstance(self.sync, HSP) and trainer.accumulate_grad_batches != 1:
            raise ValueError(f"osp: OSPStrategy with osp.HSP and accumulate_grad_batches="
                             f"{trainer.accumulate_grad_batches}: HSP's extra micro-batches are counted per step, "
                             "which Lightning's accumulation does not tell it; use accumulate_grad_batches=1 with HSP "
                             "(its extras are the accumulation), or another mode")
        if isinstance(self.sync, HSP) and not module.automatic_optimization:
            raise ValueError("osp: OSPStrategy with osp.HSP needs automatic optimization: HSP's extra micro-batches "
                             "run training_step, which under manual optimization steps the optimizers itself; use "
                             "osp.BSP(), osp.OSP(...) or osp.DSync(...)")
        if isinstance(self.sync, HSP) and getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("osp: OSPStrategy with osp.HSP and precision='16-mixed': HSP's extras run from "
                             "opt.step(closure), and torch.amp.GradScaler.step() takes no closure; use "
                             "'bf16-mixed' (no scaler) or another mode")
        names = {p: n for n, p in module.named_parameters()}
        wrapped = []
        for inner in self.optimizers:
            if isinstance(inner, DistributedOptimizer):
                raise ValueError("osp: configure_optimizers returned an osp.DistributedOptimizer; under "
                                 "OSPStrategy return the plain torch.optim optimizer (the strategy wraps it)")
            params = [p for g in inner.param_groups for p in g["params"]]
            unnamed = [p for p in params if p not in names]
            if unnamed:
                raise ValueError(f"osp: an optimizer holds {len(unnamed)} tensor(s) that are not parameters of the "
                                 f"LightningModule (shape {tuple(unnamed[0].shape)}); osp needs each to be one")
            named = [(names[p], p) for p in params]
            wrapped.append(DistributedOptimizer(inner, named_parameters=named, sync=copy.deepcopy(self.sync),
                                                backend="torch", timeout=self.step_timeout,
                                                compression=self.compression))
        for config in self.lr_scheduler_configs:  # schedulers were built on the inner optimizers
            for inner, opt in zip(self.optimizers, wrapped):
                if getattr(config.scheduler, "optimizer", None) is inner:
                    config.scheduler.optimizer = opt
        self.optimizers = wrapped
        # as Horovod's users do: every rank starts from rank 0's parameters, buffers and optimizer state
        broadcast_parameters(module.state_dict(), root_rank=0, backend="torch")
        for opt in wrapped:
            broadcast_optimizer_state(opt, root_rank=0, backend="torch")

    def _osp_optimizers(self) -> List[DistributedOptimizer]:
        return [_unwrap(o) for o in self.optimizers if isinstance(_unwrap(o), DistributedOptimizer)]

    # -- the step ------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        """Lightning's closure (forward, zero_grad, backward) once, then ``opt.step()``: osp's ``step`` takes a
        closure only for HSP's extra micro-batches, and its averages start from the backward's hooks."""
        opt = _unwrap(optimizer)
        if not isinstance(opt, DistributedOptimizer):  # nothing would average its gradients: no DDP wrapper here
            raise RuntimeError(f"osp: OSPStrategy was asked to step {type(opt).__name__}, which it did not wrap in "
                               "osp.DistributedOptimizer; return every optimizer from configure_optimizers")
        if kwargs:
            raise TypeError(f"osp: optimizer.step() under OSPStrategy takes no keyword arguments, got {sorted(kwargs)}")
        model = model or self.lightning_module
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            # MixedPrecision's own flow: the closure, unscale_ (BSP; osp unscales inside otherwise), clipping,
            # scaler.step(opt), which calls opt.step() without a closure, then scaler.update()
            return plugin.optimizer_step(opt, model=model, closure=closure)
        if type(plugin).optimizer_step not in (Precision.optimizer_step, MixedPrecision.optimizer_step):
            raise ValueError(f"osp: OSPStrategy cannot run the step of the precision plugin "
                             f"{type(plugin).__name__}; use precision '32-true', '16-mixed', 'bf16-mixed', "
                             "'16-true', 'bf16-true' or '64-true'")
        result = plugin._wrap_closure(model, opt, closure)  # the closure, on_before_optimizer_step, clipping
        if result is None and model.automatic_optimization:
            # training_step returned None: Lightning skips the backward (every rank must skip alike, as under DDP)
            return None
        extra = self._extra_closure(model, opt) if isinstance(self.sync, HSP) else None
        opt.step(extra)
        return result

    def _extra_closure(self, model, opt) -> Callable[[], Any]:
        """HSP's extra micro-batch: the next batch of the extras' own iterator, ``training_step`` and backward as
        Lightning's closure runs them (without zero_grad: it adds to the step's gradient)."""
        def extra():
            batch = self._next_extra()
            batch = self.batch_to_device(batch)
            prev = model._current_fx_name
            model._current_fx_name = "training_step"
            try:
                out = self.training_step(batch, self.lightning_module.trainer.fit_loop.epoch_loop.batch_idx)
            finally:
                model._current_fx_name = prev
            loss = out["loss"] if isinstance(out, dict) else out
            if loss is None:
                raise RuntimeError("osp: training_step returned None for one of HSP's extra micro-batches: under "
                                   "OSPStrategy with osp.HSP every batch must give a loss")
            self.backward(loss, opt)
            return loss.detach()
        return extra

    def _next_extra(self):
        if self._extras is None:
            self._extras = self._extra_batches()
        try:
            return next(self._extras)
        except StopIteration:
            self._extras = self._extra_batches()
            return next(self._extras)

    def _extra_batches(self):
        if self._hsp_batches is not None:
            return iter(self._hsp_batches())
        loader = self.lightning_module.trainer.train_dataloader
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ValueError(f"osp: OSPStrategy with osp.HSP draws its extras from the training DataLoader, but "
                             f"train_dataloader is a {type(loader).__name__}; pass OSPStrategy(hsp_batches=...)")
        return iter(loader)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """The batches ``accumulate_grad_batches`` accumulates before a step: ``opt.no_sync()``, as DDP's."""
        with contextlib.ExitStack() as stack:
            for opt in self._osp_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    def _patch_clipping(self) -> None:
        """The precision plugin's clipping acts on ``.grad``, which under OSP, DSync and HSP holds this rank's own
        gradient: clip the average instead (``opt.clip_grad_norm_`` / ``opt.clip_grad_value_``, exact)."""
        plugin = self.precision_plugin
        if getattr(plugin, "_osp_clipping", False):
            return
        original = plugin.clip_gradients

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm="norm"):
            opt = _unwrap(optimizer)
            if not isinstance(opt, DistributedOptimizer):
                return original(optimizer, clip_val, gradient_clip_algorithm)
            if clip_val is None or clip_val <= 0:
                return None
            if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
                return opt.clip_grad_value_(clip_val)
            return opt.clip_grad_norm_(clip_val)

        plugin.clip_gradients = clip_gradients
        plugin._osp_clipping = True

    # -- where Lightning reads weights or optimizer state -------------------------------------------
    def flush(self) -> None:
        """Every osp optimizer's ``flush()`` (and the buffers from rank 0): replicas bitwise equal. A collective:
        Lightning calls it on every rank at the same points."""
        for opt in self._osp_optimizers():
            opt.flush()
        module = self.lightning_module
        if self.broadcast_buffers and module is not None and self._osp_optimizers() \
                and any(True for _ in module.buffers()):
            sync_buffers(module, root_rank=0, backend="torch")

    def lightning_module_state_dict(self) -> dict:
        self.flush()  # a checkpoint's first read (dump_checkpoint); then the optimizer states
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        opt = _unwrap(optimizer)
        if isinstance(opt, DistributedOptimizer) and opt.in_flight:
            opt.flush()
        return super().optimizer_state(optimizer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        if self.broadcast_buffers and self._osp_optimizers() and any(True for _ in module.buffers()):
            sync_buffers(module, root_rank=0, backend="torch")  # DDP's broadcast_buffers, before the forward

    def teardown(self) -> None:
        self._extras = None
        super().teardown()


class _Flush(Callback):
    """The strategy's flush points, as the first callback: before the evaluation loops and at the end of
    training (``fit`` returns with replicas bitwise equal)."""

    def __init__(self, strategy: OSPStrategy):
        self.strategy = strategy

    def on_validation_start(self, trainer, pl_module) -> None:
        self.strategy.flush()

    def on_test_start(self, trainer, pl_module) -> None:
        self.strategy.flush()

    def on_predict_start(self, trainer, pl_module) -> None:
        self.strategy.flush()

    def on_train_end(self, trainer, pl_module) -> None:
        self.strategy.flush()


def _unwrap(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

