"""Every agent of the secure platform connects as its own endpoint's principal ``ep.<E>``.

A real private platform (broker, Redis, service processes, the local endpoint's agent) and
an endpoint added as ``fxstream-endpoint configure`` and ``start`` add one. For each running
agent: its config names no other principal's file, its 0600 credential holds the principal
``ep.<E>`` and the API token the service issued the endpoint (not its owner's), the platform
home holds no copy of the admin's credential for it, and that principal is what the broker
lets write only the endpoint's own ``from.ep.<E>`` topic: a record for another endpoint's,
or a dispatch, is refused by the broker itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from confluent_kafka import KafkaError, Producer

from fxstream.agent.config import EndpointConfig
from fxstream.agent.credentials import EndpointCredentials
from fxstream.ops.private import PrivatePlatform
from fxstream.topics import KafkaConnection
from fxstream.topics.acls import Role, username_for
from tests.e2e.stack import added_endpoint

pytestmark = pytest.mark.platform


@dataclass(frozen=True)
class RunningAgent:
    """One agent of the platform and what it connects with."""

    endpoint_id: str
    pid: int
    config: EndpointConfig
    credentials: EndpointCredentials
    credentials_path: Path


def _square(x: int) -> int:
    return x * x


@pytest.fixture(scope="module")
def stack(shared_platform: PrivatePlatform) -> PrivatePlatform:
    """The session's shared platform (tests/conftest.py): this module only uses it."""
    return shared_platform


def _agent(endpoints_dir: Path, name: str, endpoint_id: str, pid: int | None) -> RunningAgent:
    assert pid is not None, f"the agent of endpoint {name} is not running"
    saved = os.environ.get("FXSTREAM_ENDPOINTS_DIR")
    os.environ["FXSTREAM_ENDPOINTS_DIR"] = str(endpoints_dir)
    try:
        # The endpoint's directory (and so its credential's path) is found from the variable.
        config = EndpointConfig.load(name)
        credentials, path = config.credentials(), config.credentials_path
    finally:
        if saved is None:
            del os.environ["FXSTREAM_ENDPOINTS_DIR"]
        else:
            os.environ["FXSTREAM_ENDPOINTS_DIR"] = saved
    assert config.endpoint_id == endpoint_id
    assert path.is_relative_to(endpoints_dir / name)
    return RunningAgent(endpoint_id, pid, config, credentials, path)


@pytest.fixture(scope="module")
def agents(stack: PrivatePlatform) -> Iterator[list[RunningAgent]]:
    """The local endpoint's agent and an added endpoint's, both running and online (the
    added one is stopped after the module)."""
    with added_endpoint(stack, "added", store_url=None) as extra:
        services = stack.platform.services()
        yield [
            _agent(services.endpoints_dir, "local", stack.endpoint_id, services.endpoint.pid()),
            _agent(
                stack.home / "extra-endpoints", extra.name, extra.endpoint_id, extra.process.pid()
            ),
        ]


def _produce(kafka: KafkaConnection, topic: str) -> KafkaError | None:
    """Produce one record as ``kafka``'s principal: the delivery error, None if accepted."""
    producer = Producer(
        {**kafka.confluent(), "log_level": 2, "message.timeout.ms": 20_000, "acks": "all"}
    )
    answers: list[KafkaError | None] = []
    producer.produce(
        topic, key=b"probe", value=b"probe", on_delivery=lambda e, _: answers.append(e)
    )
    producer.flush(30)
    assert answers, f"no delivery report for {topic}"
    return answers[0]


def test_each_agent_holds_its_own_endpoints_principal_and_token(
    stack: PrivatePlatform, agents: list[RunningAgent]
) -> None:
    owner_token = stack.settings.token
    admin = stack.kafka
    assert admin.secure and owner_token is not None
    for agent in agents:
        # Nothing in the config overrides the endpoint's own principal.
        assert agent.config.kafka_credentials is None, agent.config
        kafka = agent.config.kafka(agent.credentials)
        assert kafka.username == username_for(Role.ENDPOINT, agent.endpoint_id)
        assert kafka.username == f"ep.{agent.endpoint_id}"
        assert kafka.password not in (None, admin.password)
        assert oct(agent.credentials_path.stat().st_mode & 0o777) == "0o600"
        # The token it fetches code with is the endpoint's own: it sees that endpoint only.
        token = agent.credentials.token
        assert token != owner_token
        seen = httpx.get(
            f"{stack.settings.service_url}/v1/endpoints",
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert seen.status_code == 200, seen.text
        assert [e["endpoint_id"] for e in seen.json()] == [agent.endpoint_id]
    # No admin-equivalent credential is kept for an endpoint in the platform home.
    credentials_dir = stack.home / "credentials"
    for path in credentials_dir.iterdir():
        assert not path.name.startswith("endpoint"), path
    # And the agents run tasks and heartbeat (the endpoints are online) as those principals.
    with stack.executor() as local, stack.executor(agents[1].endpoint_id) as added:
        assert local.submit(_square, 6).result(timeout=120) == 36
        assert added.submit(_square, 7).result(timeout=120) == 49


def test_the_broker_refuses_an_agents_principal_anything_but_its_own_topic(
    stack: PrivatePlatform, agents: list[RunningAgent]
) -> None:
    catalogue = stack.catalogue
    local, added = agents
    local_kafka = local.config.kafka(local.credentials)
    # Another endpoint's topic, and any endpoint's queue: refused by the broker.
    for topic in (
        catalogue.from_endpoint(added.endpoint_id),
        catalogue.endpoint_queue(local.endpoint_id),
        catalogue.endpoint_queue(added.endpoint_id),
    ):
        error = _produce(local_kafka, topic)
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, (
            topic,
            error,
        )
    # Control: the same principal may write its own topic (the ingress dead-letters this
    # record, which is no agent record), so the refusals above are the ACLs', not a broken
    # connection.
    assert _produce(local_kafka, catalogue.from_endpoint(local.endpoint_id)) is None
