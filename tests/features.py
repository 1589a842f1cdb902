"""The feature registry: a row for every option and method of ``osp.DistributedOptimizer`` (and each public
function of ``osp`` a training loop calls), as PyTorch's ``OptimizerInfo`` rows are for its optimizers.

A row says which public names it covers and how the generated tables reach it:

- ``crossed``: the row is a value of the *feature axis* of the conformance tables (tests/conformance.py): its
  keywords go to ``DistributedOptimizer(...)``, its ``end`` runs after the loop's steps (``join()``), and the
  tables cross it with modes x loop patterns x optimizers x dtypes: pairwise on one rank (oracle: plain
  ``torch.optim``) in ``make test``, every mode with every feature on a few loops in ``make test`` too, and the
  full product in ``make conformance-features``; on 2 and 3 ranks (replicas bitwise equal, equal to the replay
  of the averaged recorded gradients, uneven data for ``join``) a pairwise sample (tests/test_conformance_ranks.py).
- ``patterns``: loop patterns of ``conformance.PATTERNS`` that exercise it (``no_sync()``, clipping, ...), which
  the same tables cross with every mode, optimizer, dtype and feature.
- ``tests``: test files (or ``file::test``) for what the tables cannot express (another engine's process sets,
  membership changes), checked to exist.
- ``refused``: per mode name or family, the error the combination raises by design (a regex of its message),
  identically on every rank.

``tests/test_features.py`` fails when a public keyword or method of ``DistributedOptimizer`` (or a name in
``osp.__all__``) has no row, so a new feature cannot skip the tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class Feature:
    name: str
    covers: Tuple[str, ...]  # public names: DistributedOptimizer keywords, methods, properties; osp functions
    crossed: bool = False  # a value of the feature axis of the generated tables
    #: keywords for ``DistributedOptimizer(...)``; a callable gets the loop's Env (e.g. a callback into it)
    kwargs: object = field(default_factory=dict)
    end: Optional[Callable] = None  # called with the Env after the loop's steps, before flush()
    patterns: Tuple[str, ...] = ()  # conformance.PATTERNS that exercise it
    tests: Tuple[str, ...] = ()  # test files or node ids that exercise it
    refused: Dict[str, str] = field(default_factory=dict)  # mode name or family -> regex of the refusal
    uneven: bool = False  # on several ranks: rank r runs out of data r steps early and joins
    apart: bool = False  # on several ranks: every rank's model starts from other weights (the keyword fixes it)

    def keywords(self, env) -> dict:
        return dict(self.kwargs(env) if callable(self.kwargs) else self.kwargs)


def _join(env) -> None:
    if env.wrapped:
        env.opt.join()


def _synced(env) -> dict:
    return {"on_synced": lambda opt: env.synced.append(env.digest())}


#: every mode but BSP's own: the average is assembled from parts there (osp.keywords)
_NOT_BSP = {f: "gradient_predivide_factor is for osp.BSP" for f in ("osp", "dsync", "hsp")}

F = Feature
FEATURES: Dict[str, Feature] = {f.name: f for f in [
    # -- the axis: keywords and methods crossed with everything ----------------------------------------
    F("none", ("named_parameters", "sync", "backend", "timeout", "step", "zero_grad", "param_groups", "state",
               "defaults", "stats", "last_step", "nbytes", "in_flight"), crossed=True),
    F("op-sum", ("op",), crossed=True, kwargs={"op": "sum"}),
    F("predivide-4", ("gradient_predivide_factor",), crossed=True, kwargs={"gradient_predivide_factor": 4.0},
      refused=_NOT_BSP),
    F("groups-2", ("groups",), crossed=True, kwargs={"groups": 2}),
    F("sparse-as-dense", ("sparse_as_dense",), crossed=True, kwargs={"sparse_as_dense": True}),
    F("on-synced", ("on_synced",), crossed=True, kwargs=_synced),
    F("check-replicas-1", ("check_replicas",), crossed=True, kwargs={"check_replicas": 1}),
    F("broadcast-parameters", ("broadcast_parameters",), crossed=True, kwargs={"broadcast_parameters": True},
      apart=True),
    F("join", ("join",), crossed=True, end=_join, uneven=True),
    # -- reached through the loop patterns (crossed with every mode, optimizer, dtype and feature) -------
    F("accumulation", ("backward_passes_per_step",), patterns=("accumulate-2", "accumulate-3", "no-sync-accumulate-2")),
    F("no-sync", ("no_sync",), patterns=("no-sync", "no-sync-accumulate-2")),
    F("clip-norm", ("clip_grad_norm_",), patterns=("clip-opt", "clip-opt-loose", "clip-opt-sometimes",
                                                    "param-groups-clip-opt")),
    F("clip-value", ("clip_grad_value_",), patterns=("clip-value-opt",)),
    F("synchronize", ("synchronize", "skip_synchronize"), patterns=("synchronize-clip",)),
    F("flush", ("flush",), patterns=("flush-mid-run",)),
    F("checkpoints", ("state_dict", "load_state_dict"), patterns=("state-dict-round-trip", "scaler-overflow-reload")),
    F("reset-world", ("reset_world",), patterns=("reset-world",)),
    F("grad-scaler", (), patterns=("scaler", "scaler-overflow", "scaler-unscale-clip", "scaler-overflows-flushed",
                                   "scaler-overflow-reload", "scaler-overflow-one-rank")),
    F("gradient-penalty", (), patterns=("grad-penalty",)),
    F("tied-weights", (), patterns=("tied-weights",)),
    F("parametrization", (), patterns=("weight-norm",)),
    F("ema", (), patterns=("ema",)),
    F("compiled", (), patterns=("compiled-eager",)),
    F("max-norm-embedding", (), patterns=("max-norm-embedding",)),
    # -- where the tables cannot reach: tests of their own ---------------------------------------------
    F("compression", ("compression",), tests=("tests/test_compression.py",
                                              "tests/test_conformance_ranks.py::test_compressed_ranks_equal_the_"
                                              "replay_of_the_compressed_average")),
    F("process-set", ("process_set",), tests=("tests/test_horovod_parity.py", "tests/test_osp_horovod.py")),
    F("membership", ("check_world",), tests=("tests/test_elastic.py",)),
    F("add-param-group", ("add_param_group",),
      tests=("tests/test_optimizer.py::test_param_groups_changed_after_wrapping_raise",)),
    F("hsp-extras", (), tests=("tests/test_hsp.py",)),
    F("broadcasts", ("broadcast_parameters", "broadcast_optimizer_state", "broadcast_buffers", "sync_buffers"),
      tests=("tests/test_broadcast.py", "tests/test_replicas.py")),
    F("closure-only-optimizer", (), tests=("tests/test_intersections.py",)),
    F("strided-parameters", (), tests=("tests/test_intersections.py",)),
    F("launchers", ("init_from_env",), tests=("tests/test_launch.py",)),
    F("modes", ("BSP", "OSP", "DSync", "HSP", "DistributedOptimizer", "Compression", "ops"),
      tests=("tests/test_conformance.py",)),
]}

#: the values of the feature axis
AXIS = sorted(n for n, f in FEATURES.items() if f.crossed)


def refusal(mode: str, feature: str) -> Optional[str]:
    """The refusal ``feature`` has by design under ``mode`` (its name, or its family: the name's first part)."""
    f = FEATURES[feature].refused
    return f.get(mode, f.get(mode.split("-")[0]))
