"""The batch engine's settings: an endpoint YAML's ``batch:`` section, and the Parsl parts
(provider, launcher, scaling) built from it.

An endpoint with ``engine: htex`` runs its tasks through Parsl's HighThroughputExecutor
(:mod:`fxstream.agent.batch_engine`), whose *blocks* of workers come from a Parsl
*provider*: ``local`` (processes on this machine), ``slurm``, ``pbspro``, ``torque``,
``lsf``, ``condor`` or ``gridengine``. A block is one scheduler job of
``nodes_per_block`` nodes with ``max_workers_per_node`` workers on each (default: one per
``cores_per_worker`` cores of the node); the engine keeps between ``min_blocks`` and
``max_blocks`` of them, ``init_blocks`` at start, growing when tasks wait and releasing
a block idle for ``max_idletime_s`` (Parsl's ``strategy``: ``simple``,
``htex_auto_scale``, or ``none`` for a fixed size). ``launcher`` starts the workers on a
block's nodes (``single`` for one node, ``srun`` under Slurm, ``mpiexec``, ``simple``).

Which options a provider takes: ``partition``, ``qos``, ``constraint``, ``exclusive``
(slurm); ``queue`` (pbspro, torque, lsf, gridengine); ``account`` (slurm, pbspro,
torque; ``project`` for lsf and condor); ``walltime`` ("HH:MM:SS") and
``scheduler_options`` (lines added to the job script's header) for every scheduler.
An option a provider does not take is refused by :meth:`BatchSettings.validate`, so a
YAML for one scheduler is not silently half-read by another.

``mpi`` (a mapping: ``launcher``, ``max_tasks_per_block``) turns on Parsl's MPI mode
(:class:`MpiSettings`): a block runs one worker pool on its first node (``launcher:
simple``) whose workers each run one MPI task at a time; Parsl's ``MPITaskScheduler``
gives each task ``num_nodes`` of the block's nodes (from ``SLURM_NODELIST`` or
``PBS_NODEFILE``: the ``slurm``, ``pbspro`` and ``torque`` providers), holds back a
task until that many are free, and sets ``$PARSL_MPI_PREFIX`` to the ``mpiexec``,
``srun`` or ``aprun`` command for those nodes and the task's ranks.

``address`` is where the workers reach the engine's interchange: ``127.0.0.1`` when
they run on this machine (``local``, or a single-node test cluster), the login node's
address on the compute nodes' network otherwise. The interchange's traffic is
encrypted and authenticated with CurveZMQ (Parsl's ``encrypted=True``; always on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # Parsl is imported when a provider is built, not with the config
    from parsl.launchers.base import Launcher
    from parsl.providers.base import ExecutionProvider

__all__ = [
    "LAUNCHERS",
    "MPI_LAUNCHERS",
    "MPI_PROVIDERS",
    "PROVIDERS",
    "STRATEGIES",
    "BatchSettings",
    "BatchSettingsError",
    "MpiSettings",
]

PROVIDERS: Final = ("local", "slurm", "pbspro", "torque", "lsf", "condor", "gridengine")
"""The providers an endpoint may name (Parsl's, by its short names)."""

LAUNCHERS: Final = ("single", "srun", "mpiexec", "simple")
"""How workers start on a block's nodes."""

STRATEGIES: Final = ("simple", "htex_auto_scale", "none")
"""Parsl's scaling strategies."""

MPI_LAUNCHERS: Final = ("mpiexec", "srun", "aprun")
"""How an MPI task's ranks start on its nodes (Parsl's ``VALID_LAUNCHERS``)."""

MPI_PROVIDERS: Final = ("slurm", "pbspro", "torque")
"""The providers whose jobs tell Parsl's MPI mode their nodes (``SLURM_NODELIST``,
``PBS_NODEFILE``); a ``local`` block has no node list."""

_WALLTIME = re.compile(r"^\d{1,4}:[0-5]\d:[0-5]\d$")

# Which optional settings each provider takes (the rest apply to all).
_TAKES: Final[dict[str, frozenset[str]]] = {
    "local": frozenset(),
    "slurm": frozenset(
        {"partition", "account", "qos", "constraint", "exclusive", "walltime", "scheduler_options"}
    ),
    "pbspro": frozenset({"queue", "account", "walltime", "scheduler_options"}),
    "torque": frozenset({"queue", "account", "walltime", "scheduler_options"}),
    "lsf": frozenset({"queue", "project", "walltime", "scheduler_options"}),
    "condor": frozenset({"project", "walltime", "scheduler_options"}),
    "gridengine": frozenset({"queue", "walltime", "scheduler_options"}),
}
_OPTIONAL: Final = frozenset(
    {
        "partition",
        "account",
        "qos",
        "constraint",
        "exclusive",
        "queue",
        "project",
        "walltime",
        "scheduler_options",
    }
)


class BatchSettingsError(ValueError):
    """A ``batch:`` setting that cannot work; the message names it and what to write."""


@dataclass
class MpiSettings:
    """``batch.mpi``: Parsl's MPI mode (see the module notes).

    ``launcher`` starts each task's ranks on its nodes: ``mpiexec`` (MPICH's Hydra, or
    Open MPI's), ``srun`` (Slurm only) or ``aprun``. ``max_tasks_per_block`` is how many
    MPI tasks one block runs at once (default: ``nodes_per_block``, one per node; a task
    takes whole nodes, so more than the block's nodes would only wait).
    """

    launcher: str = "mpiexec"
    max_tasks_per_block: int | None = None

    @classmethod
    def from_mapping(cls, raw: Any) -> MpiSettings:
        """``batch.mpi`` as the YAML gives it; unknown keys refused, naming them."""
        if isinstance(raw, MpiSettings):
            return raw
        if not isinstance(raw, dict):
            raise BatchSettingsError(
                "batch.mpi must be a mapping such as {launcher: mpiexec, max_tasks_per_block: 2}"
            )
        known = {"launcher", "max_tasks_per_block"}
        unknown = sorted(str(key) for key in set(raw) - known)
        if unknown:
            raise BatchSettingsError(
                f"unknown batch.mpi setting(s) {unknown}: it takes launcher and max_tasks_per_block"
            )
        settings = cls(**raw)
        if not isinstance(settings.launcher, str) or (
            settings.max_tasks_per_block is not None
            and (
                isinstance(settings.max_tasks_per_block, bool)
                or not isinstance(settings.max_tasks_per_block, int)
            )
        ):
            raise BatchSettingsError(
                "batch.mpi.launcher must be a name and batch.mpi.max_tasks_per_block a number"
            )
        return settings


@dataclass
class BatchSettings:
    """An endpoint's ``batch:`` section (see the module notes)."""

    provider: str = "local"
    launcher: str = "single"
    nodes_per_block: int = 1
    init_blocks: int = 1
    min_blocks: int = 0
    max_blocks: int = 1
    max_workers_per_node: int | None = None
    cores_per_worker: float = 1.0
    worker_init: str = ""
    address: str = "127.0.0.1"
    strategy: str = "simple"
    max_idletime_s: float = 120.0
    strategy_period_s: float = 5.0
    # Scheduler options (each provider takes some: see _TAKES).
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool | None = None
    queue: str | None = None
    project: str | None = None
    walltime: str | None = None
    scheduler_options: str | None = None
    cmd_timeout_s: int = 60
    # How often the provider asks the scheduler about its blocks (None: Parsl's default,
    # 60 s for Slurm, PBS Pro and the others; 5 s for local): how soon a block the
    # scheduler ended is seen as gone, and replaced.
    status_period_s: float | None = None
    # Parsl's MPI mode (MpiSettings); None: every task is one Python call on one worker.
    mpi: MpiSettings | None = None

    def __post_init__(self) -> None:
        if self.mpi is not None:
            self.mpi = MpiSettings.from_mapping(self.mpi)

    @property
    def mpi_tasks_per_block(self) -> int:
        """How many MPI tasks one block runs at once (0 without ``mpi``)."""
        if self.mpi is None:
            return 0
        return self.mpi.max_tasks_per_block or self.nodes_per_block

    def resource_refusal(self, num_nodes: int | None) -> str | None:
        """Why a task asking for ``num_nodes`` nodes (``None``: no resource
        specification) cannot run on these blocks, or ``None`` when it can."""
        if self.mpi is None:
            if num_nodes is None:
                return None
            return (
                "this endpoint's batch engine has no MPI mode, so it cannot run a task with a "
                "resource_specification: submit it to an endpoint whose batch: has mpi:, or "
                "submit it without resource_specification"
            )
        if num_nodes is None:
            return (
                "this endpoint runs MPI tasks only (batch.mpi): submit with a "
                'resource_specification, e.g. {"num_nodes": 1, "ranks_per_node": 1} for a '
                "plain function"
            )
        if num_nodes > self.nodes_per_block:
            return (
                f"the task asks for {num_nodes} nodes and this endpoint's blocks have "
                f"{self.nodes_per_block} (batch.nodes_per_block): ask for at most "
                f"{self.nodes_per_block}, or raise nodes_per_block"
            )
        return None

    def validate(self) -> None:
        """Raise :class:`BatchSettingsError` naming the setting when a value cannot work."""
        if self.provider not in PROVIDERS:
            raise BatchSettingsError(
                f"batch.provider {self.provider!r} is not one of {', '.join(PROVIDERS)}"
            )
        if self.launcher not in LAUNCHERS:
            raise BatchSettingsError(
                f"batch.launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}"
            )
        if self.strategy not in STRATEGIES:
            raise BatchSettingsError(
                f"batch.strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}"
            )
        if self.nodes_per_block < 1:
            raise BatchSettingsError("batch.nodes_per_block must be at least 1")
        if not 0 <= self.min_blocks <= self.init_blocks <= self.max_blocks:
            raise BatchSettingsError(
                "batch blocks must satisfy 0 <= min_blocks <= init_blocks <= max_blocks "
                f"(now {self.min_blocks}, {self.init_blocks}, {self.max_blocks})"
            )
        if self.max_blocks < 1:
            raise BatchSettingsError("batch.max_blocks must be at least 1")
        if self.max_workers_per_node is not None and self.max_workers_per_node < 1:
            raise BatchSettingsError("batch.max_workers_per_node must be at least 1")
        if self.cores_per_worker <= 0:
            raise BatchSettingsError("batch.cores_per_worker must be positive")
        if self.max_idletime_s < 0 or self.strategy_period_s <= 0:
            raise BatchSettingsError(
                "batch.max_idletime_s must be >= 0 and batch.strategy_period_s positive"
            )
        if self.status_period_s is not None and self.status_period_s < 1:
            raise BatchSettingsError("batch.status_period_s must be at least 1 second")
        if self.cmd_timeout_s < 1:
            raise BatchSettingsError("batch.cmd_timeout_s must be at least 1")
        if self.walltime is not None and not _WALLTIME.match(self.walltime):
            raise BatchSettingsError(
                f"batch.walltime {self.walltime!r} must be HH:MM:SS (e.g. 01:00:00)"
            )
        set_options = {name for name in _OPTIONAL if getattr(self, name) is not None}
        refused = sorted(set_options - _TAKES[self.provider])
        if refused:
            takes = sorted(_TAKES[self.provider]) or ["none of them"]
            raise BatchSettingsError(
                f"batch: the {self.provider} provider takes no {', '.join(refused)}; "
                f"it takes {', '.join(takes)}: remove the others"
            )
        if self.launcher == "srun" and self.provider != "slurm":
            raise BatchSettingsError("batch.launcher srun needs provider slurm")
        if self.mpi is not None:
            self._validate_mpi(self.mpi)

    def _validate_mpi(self, mpi: MpiSettings) -> None:
        if mpi.launcher not in MPI_LAUNCHERS:
            raise BatchSettingsError(
                f"batch.mpi.launcher {mpi.launcher!r} is not one of {', '.join(MPI_LAUNCHERS)}"
            )
        if mpi.launcher == "srun" and self.provider != "slurm":
            raise BatchSettingsError("batch.mpi.launcher srun needs provider slurm")
        if self.provider not in MPI_PROVIDERS:
            raise BatchSettingsError(
                f"batch.mpi needs a provider whose jobs list their nodes "
                f"({', '.join(MPI_PROVIDERS)}), not {self.provider}: Parsl's MPI mode reads "
                "a block's nodes from SLURM_NODELIST or PBS_NODEFILE"
            )
        if self.launcher != "simple":
            raise BatchSettingsError(
                "batch.mpi needs batch.launcher: simple (one worker pool on each block's "
                "first node; each task's ranks are started by batch.mpi.launcher)"
            )
        if self.max_workers_per_node is not None:
            raise BatchSettingsError(
                "batch.max_workers_per_node does not apply with batch.mpi: set "
                "batch.mpi.max_tasks_per_block (MPI tasks one block runs at once)"
            )
        per_block = mpi.max_tasks_per_block
        if per_block is not None and not 1 <= per_block <= self.nodes_per_block:
            raise BatchSettingsError(
                f"batch.mpi.max_tasks_per_block must be between 1 and nodes_per_block "
                f"({self.nodes_per_block}), not {per_block}: each MPI task takes whole nodes"
            )

    def workers_per_block(self, cores_per_node: int) -> int:
        """How many workers one block runs, its nodes having ``cores_per_node`` cores (with
        ``mpi``: how many MPI tasks it runs at once)."""
        if self.mpi is not None:
            return self.mpi_tasks_per_block
        per_node = max(1, int(cores_per_node / self.cores_per_worker))
        if self.max_workers_per_node is not None:
            per_node = min(per_node, self.max_workers_per_node)
        return per_node * self.nodes_per_block

    def build_launcher(self) -> Launcher:
        """The Parsl launcher ``launcher`` names."""
        from parsl.launchers import (
            MpiExecLauncher,
            SimpleLauncher,
            SingleNodeLauncher,
            SrunLauncher,
        )

        if self.launcher == "srun":
            return SrunLauncher()
        if self.launcher == "mpiexec":
            return MpiExecLauncher()
        if self.launcher == "simple":
            return SimpleLauncher()
        return SingleNodeLauncher()

    def build_provider(self) -> ExecutionProvider:
        """The Parsl provider ``provider`` names, with this section's settings."""
        from parsl.providers import (
            CondorProvider,
            GridEngineProvider,
            LocalProvider,
            LSFProvider,
            PBSProProvider,
            SlurmProvider,
            TorqueProvider,
        )

        common: dict[str, Any] = {
            "nodes_per_block": self.nodes_per_block,
            "init_blocks": self.init_blocks,
            "min_blocks": self.min_blocks,
            "max_blocks": self.max_blocks,
            "worker_init": self.worker_init,
            "launcher": self.build_launcher(),
            "cmd_timeout": self.cmd_timeout_s,
        }
        chosen = {name: getattr(self, name) for name in _TAKES[self.provider]}
        options = {name: value for name, value in chosen.items() if value is not None}
        provider: ExecutionProvider
        if self.provider == "local":
            provider = LocalProvider(**common)  # type: ignore[no-untyped-call]
        elif self.provider == "slurm":
            provider = SlurmProvider(**common, **options)
        elif self.provider == "pbspro":
            provider = PBSProProvider(**common, **options)  # type: ignore[no-untyped-call]
        elif self.provider == "torque":
            provider = TorqueProvider(**common, **options)  # type: ignore[no-untyped-call]
        elif self.provider == "lsf":
            provider = LSFProvider(**common, **options)  # type: ignore[no-untyped-call]
        elif self.provider == "condor":
            provider = CondorProvider(**common, **options)
        else:
            provider = GridEngineProvider(**common, **options)
        if self.status_period_s is not None:
            _poll_every(provider, self.status_period_s)
        return provider


def _poll_every(provider: ExecutionProvider, seconds: float) -> None:
    """Make ``provider`` ask its scheduler every ``seconds``: Parsl's providers fix their
    ``status_polling_interval`` as a read-only property of the class, so the instance gets
    a subclass of its own class that answers ``seconds`` (nothing else changes)."""
    base = type(provider)
    polled = type(
        base.__name__,
        (base,),
        {"status_polling_interval": property(lambda _self: seconds), "__module__": __name__},
    )
    provider.__class__ = polled
