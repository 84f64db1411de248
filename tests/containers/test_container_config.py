"""An endpoint's container settings: what its config allows, what it refuses and how the
refusal says what to add (no platform needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxstream.agent.config import ConfigError, EndpointConfig
from fxstream.agent.containers import ApptainerRuntime, ContainerError, Image
from fxstream.agent.policy import TaskPolicy


def config(**settings: object) -> EndpointConfig:
    base: dict[str, object] = {
        "name": "lab",
        "endpoint_id": "ep-1",
        "service_url": "http://localhost:1",
        "bootstrap_servers": "localhost:1",
    }
    return EndpointConfig(**(base | settings))  # type: ignore[arg-type]


def test_a_container_runtime_needs_an_allowed_image_of_its_own(
    runtimes: dict[str, str],
) -> None:
    with pytest.raises(ConfigError) as caught:
        config(runtime="bubblewrap").validate()
    assert "images: {worker: 'bubblewrap:<reference>'} and image: worker" in str(caught.value)

    with pytest.raises(ConfigError) as caught:
        config(runtime="bubblewrap", image="gpu", images={"host": "bubblewrap:/"}).validate()
    assert "image 'gpu' is not among images (host)" in str(caught.value)

    with pytest.raises(ConfigError) as caught:
        config(runtime="podman", image="host", images={"host": "bubblewrap:/"}).validate()
    assert "set runtime: bubblewrap" in str(caught.value)

    with pytest.raises(ConfigError) as caught:
        config(runtime="bubblewrap", image="w", images={"w": "bubblewrap:relative"}).validate()
    assert "must be an absolute path" in str(caught.value)

    good = config(runtime="bubblewrap", image="host", images={"host": "bubblewrap:/"})
    good.validate()
    assert good.worker_image() == Image("host", "bubblewrap", "/")


def test_an_apptainer_endpoint_is_refused_where_apptainer_is_missing() -> None:
    settings = config(runtime="apptainer", image="w", images={"w": "apptainer:/srv/w.sif"})
    if ApptainerRuntime().unavailable() is None:
        pytest.skip("apptainer is installed here: the endpoint is valid")
    with pytest.raises(ConfigError) as caught:
        settings.validate()
    assert "not packaged for Debian 12" in str(caught.value)


def test_container_settings_survive_save_and_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FXSTREAM_ENDPOINTS_DIR", str(tmp_path))
    saved = config(
        runtime="bubblewrap",
        image="host",
        images={"host": "bubblewrap:/", "oci": "podman:localhost/fxstream-worker:1"},
        writable_dirs=("/srv/scratch",),
    )
    saved.save()
    loaded = EndpointConfig.load("lab")
    assert loaded == saved
    assert loaded.worker_paths() == ((), ("/srv/scratch",))


def test_a_file_store_directory_is_writable_for_the_workers() -> None:
    settings = config(store_url="file:///srv/store")
    assert settings.worker_paths() == ((), ("/srv/store",))


def test_image_specs() -> None:
    assert Image.parse("w", "podman:localhost/w:1") == Image("w", "podman", "localhost/w:1")
    assert Image.parse("h", "bubblewrap:/").spec == "bubblewrap:/"
    with pytest.raises(ContainerError, match="'<runtime>:<reference>'"):
        Image.parse("w", "localhost/w:1")
    with pytest.raises(ContainerError, match="names no reference"):
        Image.parse("w", "podman:")


POLICY = TaskPolicy.of(
    config(
        runtime="bubblewrap",
        image="worker",
        images={"worker": "bubblewrap:/", "oci": "podman:localhost/fxstream-worker:1"},
    )
)


def test_a_function_runs_in_the_allowed_image_its_container_names() -> None:
    assert POLICY.image_for("fn-1", None) == (None, None)  # the endpoint's default
    assert POLICY.image_for("fn-1", "worker") == ("worker", None)
    assert POLICY.image_for("fn-1", "bubblewrap:/") == ("worker", None)  # by its spec
    assert POLICY.image_for("fn-1", "oci") == ("oci", None)  # allowed, not the default


def test_an_image_the_endpoint_does_not_allow_is_refused_saying_what_to_add() -> None:
    image, refusal = POLICY.image_for("fn-1", "gpu-image")
    assert image is None and refusal is not None
    assert "function fn-1 runs only in container 'gpu-image'" in refusal
    assert "endpoint 'lab' (ep-1) does not allow" in refusal
    assert "images allowed: oci, worker" in refusal
    assert "adds images: {gpu-image: '<runtime>:<reference>'}" in refusal
    assert str(config().path) in refusal
    _, by_spec = POLICY.image_for("fn-1", "podman:localhost/other:2")
    assert by_spec is not None and "images: {NAME: 'podman:localhost/other:2'}" in by_spec


def test_a_process_endpoint_refuses_every_container() -> None:
    plain = TaskPolicy.of(config())
    assert plain.image_for("fn-1", None) == (None, None)
    _, refusal = plain.image_for("fn-1", "worker")
    assert refusal is not None and "no container (runtime: process)" in refusal
