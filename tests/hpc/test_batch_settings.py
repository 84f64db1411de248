"""An endpoint's ``batch:`` section: what is refused (and how it says so), and the Parsl
provider and launcher built from it, for the documented Slurm and PBS Pro endpoints."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from parsl.launchers import MpiExecLauncher, SimpleLauncher, SrunLauncher
from parsl.providers import LocalProvider, PBSProProvider, SlurmProvider

from fxstream.agent.batch_settings import BatchSettings, BatchSettingsError
from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.agent.containers import Image
from fxstream.topics import ResourceSpecification
from tests.hpc.support import REPO


def documented(heading: str) -> dict[str, Any]:
    section = (REPO / "docs" / "hpc.md").read_text().split(heading, 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None, f"docs/hpc.md lost the example under {heading!r}"
    loaded: dict[str, Any] = yaml.safe_load(block.group(1))
    return loaded


def load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: dict[str, Any]) -> EndpointConfig:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path))
    directory = tmp_path / raw["name"]
    directory.mkdir(mode=0o700)
    (directory / "config.yaml").write_text(yaml.safe_dump(raw))
    return EndpointConfig.load(raw["name"])


def test_the_documented_slurm_endpoint_loads_and_builds_a_slurm_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load(tmp_path, monkeypatch, documented("### An endpoint on a Slurm cluster"))
    assert config.engine == "htex" and config.batch is not None
    provider = config.batch_settings().build_provider()
    assert isinstance(provider, SlurmProvider)
    assert (provider.partition, provider.account) == ("debug", "my-allocation")
    assert (provider.walltime, provider.exclusive) == ("00:30:00", False)
    assert (provider.min_blocks, provider.max_blocks, provider.init_blocks) == (0, 2, 0)
    assert isinstance(provider.launcher, SrunLauncher)
    assert config.batch_settings().workers_per_block(cores_per_node=64) == 4
    assert provider.status_polling_interval == 60  # Parsl's default for Slurm
    quicker = BatchSettings(provider="slurm", status_period_s=5).build_provider()
    assert isinstance(quicker, SlurmProvider) and quicker.status_polling_interval == 5


def test_the_documented_pbs_pro_endpoint_loads_and_builds_a_pbs_provider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load(tmp_path, monkeypatch, documented("### An endpoint on a PBS Pro cluster"))
    provider = config.batch_settings().build_provider()
    assert isinstance(provider, PBSProProvider)
    assert (provider.queue, provider.account, provider.walltime) == (
        "debug",
        "my-allocation",
        "01:00:00",
    )
    assert "filesystems=home:eagle" in provider.scheduler_options
    assert provider.nodes_per_block == 2 and isinstance(provider.launcher, MpiExecLauncher)


def test_a_saved_batch_section_loads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path))
    config = EndpointConfig(
        name="hpc",
        endpoint_id="5f0c1c2e-0000-4000-8000-000000000003",
        service_url="http://127.0.0.1:1",
        bootstrap_servers="127.0.0.1:2",
        engine="htex",
        batch=BatchSettings(provider="slurm", partition="short", max_blocks=3),
    )
    config.save()
    again = EndpointConfig.load("hpc")
    assert again.batch == config.batch
    assert isinstance(BatchSettings().build_provider(), LocalProvider)


@pytest.mark.parametrize(
    ("batch", "says"),
    [
        ({"provider": "sge"}, "batch.provider 'sge' is not one of local, slurm"),
        ({"provider": "pbspro", "partition": "x"}, "takes no partition; it takes account"),
        ({"provider": "slurm", "queue": "x"}, "takes no queue"),
        ({"provider": "local", "walltime": "01:00:00"}, "takes none of them"),
        ({"provider": "slurm", "walltime": "90 minutes"}, "must be HH:MM:SS"),
        ({"min_blocks": 2, "init_blocks": 1}, "min_blocks <= init_blocks <= max_blocks"),
        ({"launcher": "srun"}, "srun needs provider slurm"),
        ({"strategy": "greedy"}, "batch.strategy 'greedy' is not one of"),
        ({"partiton": "debug"}, "unknown batch setting(s) ['partiton']"),
        ({"status_period_s": 0.5}, "status_period_s must be at least 1 second"),
    ],
)
def test_a_batch_setting_that_cannot_work_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: dict[str, Any], says: str
) -> None:
    raw = {
        "name": "bad",
        "endpoint_id": "5f0c1c2e-0000-4000-8000-000000000004",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:2",
        "engine": "htex",
        "batch": batch,
    }
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(tmp_path, monkeypatch, raw)


def test_batch_without_htex_and_htex_with_several_environments_are_refused() -> None:
    common: dict[str, Any] = {
        "name": "x",
        "endpoint_id": "5f0c1c2e-0000-4000-8000-000000000005",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:2",
    }
    with pytest.raises(ConfigError, match="batch: is read only with engine: htex"):
        EndpointConfig(**common, batch=BatchSettings()).validate()
    # One container for every block's workers: the endpoint's image, and no other.
    contained = EndpointConfig(
        **common, engine="htex", runtime="bubblewrap", image="x", images={"x": "bubblewrap:/"}
    )
    contained.validate()
    assert contained.worker_image() == Image("x", "bubblewrap", "/")
    with pytest.raises(ConfigError, match=r"one container, the endpoint's image \(x\): remove y"):
        EndpointConfig(
            **common,
            engine="htex",
            runtime="bubblewrap",
            image="x",
            images={"x": "bubblewrap:/", "y": "bubblewrap:/"},
        ).validate()
    with pytest.raises(ConfigError, match="remove interpreters"):
        EndpointConfig(**common, engine="htex", interpreters=["/usr/bin/python3"]).validate()
    with pytest.raises(ConfigError, match=r"'process' .* or 'htex'"):
        EndpointConfig(**common, engine="slurm").validate()
    with pytest.raises(BatchSettingsError, match="max_workers_per_node"):
        BatchSettings(max_workers_per_node=0).validate()


def test_the_documented_mpi_endpoint_loads_in_parsl_s_mpi_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load(tmp_path, monkeypatch, documented("### An MPI endpoint on a Slurm cluster"))
    settings = config.batch_settings()
    assert settings.mpi is not None and settings.mpi.launcher == "mpiexec"
    assert settings.mpi_tasks_per_block == 2 == settings.workers_per_block(cores_per_node=64)
    provider = settings.build_provider()
    assert isinstance(provider, SlurmProvider) and isinstance(provider.launcher, SimpleLauncher)
    assert provider.nodes_per_block == 2
    # What the agent refuses before fetching any code, saying what to do instead.
    spec = ResourceSpecification.from_mapping
    assert config.resource_refusal(spec({"num_nodes": 2, "ranks_per_node": 8})) is None
    too_many = config.resource_refusal(spec({"num_nodes": 3}))
    assert too_many is not None and "ask for at most 2" in too_many
    plain = config.resource_refusal(None)
    assert plain is not None and '{"num_nodes": 1, "ranks_per_node": 1}' in plain
    # Saved and loaded back, the mpi section survives.
    config.save()
    assert EndpointConfig.load(config.name).batch_settings().mpi == settings.mpi


def test_an_endpoint_without_mpi_refuses_a_task_with_a_resource_specification() -> None:
    common: dict[str, Any] = {
        "name": "x",
        "endpoint_id": "5f0c1c2e-0000-4000-8000-000000000006",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:2",
    }
    spec = ResourceSpecification.from_mapping({"num_nodes": 1, "ranks_per_node": 2})
    process = EndpointConfig(**common)
    assert process.resource_refusal(None) is None
    refusal = process.resource_refusal(spec)
    assert refusal is not None and "engine: htex and batch.mpi" in refusal
    htex = EndpointConfig(**common, engine="htex", batch=BatchSettings(provider="slurm"))
    assert htex.resource_refusal(None) is None
    refusal = htex.resource_refusal(spec)
    assert refusal is not None and "has no MPI mode" in refusal


MPI_SLURM: dict[str, Any] = {"provider": "slurm", "launcher": "simple", "nodes_per_block": 2}


@pytest.mark.parametrize(
    ("batch", "says"),
    [
        ({**MPI_SLURM, "mpi": {"launcher": "mpirun"}}, "batch.mpi.launcher 'mpirun' is not one"),
        ({**MPI_SLURM, "mpi": {"launchr": "srun"}}, "unknown batch.mpi setting(s) ['launchr']"),
        ({**MPI_SLURM, "mpi": "mpiexec"}, "batch.mpi must be a mapping"),
        ({**MPI_SLURM, "launcher": "single", "mpi": {}}, "batch.mpi needs batch.launcher: simple"),
        ({"launcher": "simple", "mpi": {}}, "a provider whose jobs list their nodes"),
        ({**MPI_SLURM, "mpi": {"max_tasks_per_block": 3}}, "between 1 and nodes_per_block (2)"),
        ({**MPI_SLURM, "max_workers_per_node": 2, "mpi": {}}, "set batch.mpi.max_tasks_per_block"),
        (
            {"provider": "pbspro", "launcher": "simple", "mpi": {"launcher": "srun"}},
            "srun needs provider slurm",
        ),
    ],
)
def test_an_mpi_setting_that_cannot_work_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: dict[str, Any], says: str
) -> None:
    raw = {
        "name": "badmpi",
        "endpoint_id": "5f0c1c2e-0000-4000-8000-000000000007",
        "service_url": "http://127.0.0.1:1",
        "bootstrap_servers": "127.0.0.1:2",
        "engine": "htex",
        "batch": batch,
    }
    with pytest.raises(ConfigError, match=re.escape(says)):
        load(tmp_path, monkeypatch, raw)
